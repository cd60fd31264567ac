#pragma once
// The backend registry: the built-in CPU backend plus every plugin found
// beside the core library (libtensor_ops_<name>.so), and backend selection.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "tensor_ops/plugin.h"

namespace tensor_ops {

struct BackendStatus {
  std::string name;
  bool compiled = false;  // a plugin (or the built-in CPU backend) exists
  bool usable = false;    // its runtime initialised and it has a device
  std::string reason;     // why not usable / not compiled; empty when usable
  int priority = 0;
  std::string library;    // the plugin file, or "built-in"
  std::vector<std::string> ops;  // the ops it has kernels for (empty when not compiled)
};

struct DeviceRecord {
  std::string backend;
  int32_t device_id = 0;
  to_device_info info{};
};

class Backend {
 public:
  Backend(const to_backend_v1* table, std::string library, void* handle);
  const std::string& name() const { return name_; }
  const to_backend_v1& table() const { return *table_; }
  bool usable() const { return usable_; }
  const std::string& reason() const { return reason_; }
  int priority() const { return priority_; }
  const std::string& library() const { return library_; }
  int device_count() const;
  // Throws the matching Error with the backend's last_error() on failure.
  void check(to_status status, const char* what) const;
  // Marks a usable backend unusable (a child forked after it initialised).
  void disable(std::string reason);

 private:
  const to_backend_v1* table_;
  std::string name_, library_, reason_;
  void* handle_;
  bool usable_ = false;
  int priority_ = 0;
};

class Registry {
 public:
  static Registry& instance();

  // Every backend the project knows, compiled or not, sorted by priority.
  std::vector<BackendStatus> status() const;
  std::vector<DeviceRecord> devices() const;
  // nullptr when no backend of that name was loaded.
  Backend* find(const std::string& name) const;
  // Throws InvalidArgument for an unknown name (listing the valid ones) and
  // BackendUnavailable for a known one that cannot run.
  Backend& require(const std::string& name) const;

  // The backend host data runs on: use() scope > set_backend() >
  // TENSOR_OPS_BACKEND > TENSOR_OPS_PRIORITY order > default priority.
  // A selection naming an external backend counts as automatic here.
  Backend& active() const;
  // The backend an op on host data runs on: active(), except that a selection
  // naming an external backend throws ExternalBackendSelected.
  Backend& host_backend() const;
  // The external backend the selection names, or nullptr.
  const std::string* external_choice() const;
  // "auto" or "" returns to automatic selection.
  void set_backend(const std::string& name);
  // The selected backend's name (an external one included).
  std::string selected_name() const;
  // Thread-local scope used by the Python `use(...)` context.
  void push_scope(const std::string& name);
  void pop_scope();
  // Throws as push_scope would for `name` (unknown, or not usable), pushing nothing.
  void check_scope(const std::string& name) const;
  // Replaces this thread's scope stack (innermost last), names as check_scope
  // accepted them: the Python binding mirrors its context variable here
  // (Note [use() per context] in python/src/scope.cpp).
  void set_scopes(std::vector<std::string> names);

  // Names accepted by set_backend / TENSOR_OPS_BACKEND.
  std::vector<std::string> known_names() const;
  std::vector<std::string> usable_names() const;

  // Backends served outside the core (the Python XLA shim: "xla", "tpu").
  // TENSOR_OPS_BACKEND / TENSOR_OPS_PRIORITY may name them: the core then
  // makes its own automatic choice for whatever the outside layer does not
  // take. Unregistered, such a name is an unknown backend (C embedders).
  void set_external_backends(std::vector<std::string> names);

  // Loads libtensor_ops_*.so from `dir` (tests use this for a mock plugin).
  void load_plugins_from(const std::string& dir);

 private:
  Registry();
  void add(std::unique_ptr<Backend> backend);
  // pthread_atfork handlers (Note [fork] in registry.cpp).
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();
  std::vector<Backend*> by_priority() const;
  Backend& resolve_auto(const std::string& forced, const std::string& order) const;
  // active() and external_choice() given the environment, read once per call.
  Backend& active_in(const char* forced, const char* order) const;
  const std::string* external_choice_in(const char* forced) const;

  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<BackendStatus> missing_;  // known names with no plugin
  std::vector<std::string> external_;   // set_external_backends (set once, at import)
  const std::string* find_external(const char* name) const;  // the entry, or nullptr
  std::atomic<Backend*> selected_backend_{nullptr};  // set_backend(); nullptr = auto
  std::atomic<int> selected_external_{-1};           // set_backend() of external_[i]
  std::atomic<uint64_t> generation_{1};              // bumped when plugins load
};

// Directory holding libtensor_ops.so (plugins are looked up there).
std::string core_library_dir();

}  // namespace tensor_ops
