#include "tensor_ops/registry.h"

#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "../cpu/cpu_backend.h"
#include "../cpu/thread_pool.h"
#include "env.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"

// TENSOR_OPS_BUILD_BACKENDS is set by CMake: "name=reason;..." for every
// backend the build knows, the reason empty when its plugin was built.
#ifndef TENSOR_OPS_BUILD_BACKENDS
#define TENSOR_OPS_BUILD_BACKENDS ""
#endif

namespace tensor_ops {

SelectionEnv selection_env() {
  static const char kBackend[] = "TENSOR_OPS_BACKEND=", kPriority[] = "TENSOR_OPS_PRIORITY=";
  SelectionEnv r;
  for (char** e = environ; e && *e; ++e) {
    const char* v = *e;
    if (v[0] != 'T' || std::strncmp(v, "TENSOR_OPS_", 11) != 0) continue;
    if (!r.backend && std::strncmp(v, kBackend, sizeof kBackend - 1) == 0) r.backend = v + sizeof kBackend - 1;
    else if (!r.priority && std::strncmp(v, kPriority, sizeof kPriority - 1) == 0)
      r.priority = v + sizeof kPriority - 1;
  }
  return r;
}

bool parse_long(const char* s, long* out) {
  if (!s || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-' || s[0] == '+')) return false;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno == ERANGE || end == s || *end != '\0') return false;
  *out = v;
  return true;
}

namespace {
std::mutex env_warnings_mutex;
std::vector<std::string>& env_warning_list() {
  static auto* list = new std::vector<std::string>();  // never freed: read until exit
  return *list;
}
}  // namespace

void add_env_warning(const char* name, const char* value, const std::string& problem, const std::string& used) {
  std::lock_guard<std::mutex> lock(env_warnings_mutex);
  env_warning_list().push_back(std::string(name) + "='" + value + "' " + problem + "; using " + used + " instead");
}

std::vector<std::string> environment_warnings() {
  cpu::default_num_threads();
  cpu::default_spin_us();
  cpu::active_isa();
  cpu::stream_threshold_bytes();
  std::lock_guard<std::mutex> lock(env_warnings_mutex);
  return env_warning_list();
}

std::vector<std::string> split_list(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(start, end - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
    start = end + 1;
  }
  return out;
}

std::string core_library_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&core_library_dir), &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string path = info.dli_fname;
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

Backend::Backend(const to_backend_v1* table, std::string library, void* handle)
    : table_(table), name_(table->name), library_(std::move(library)), handle_(handle) {
  char reason[512] = {0};
  to_status st = table_->init(reason, sizeof(reason));
  if (st != TO_OK) {
    reason_ = reason[0] ? reason : "initialisation failed";
    return;
  }
  priority_ = table_->priority();
  if (table_->device_count() <= 0) {
    reason_ = "no devices found";
    return;
  }
  usable_ = true;
}

int Backend::device_count() const { return usable_ ? table_->device_count() : 0; }

void Backend::disable(std::string reason) {
  usable_ = false;
  reason_ = std::move(reason);
}

void Backend::check(to_status status, const char* what) const {
  if (status == TO_OK) return;
  const char* msg = table_->last_error();
  throw_status(status, name_ + ": " + what + ": " + (msg && *msg ? msg : "failed"));
}

namespace {

thread_local std::vector<std::string> scope_stack;
std::mutex registry_mutex;

struct BuildInfo {
  std::string name, reason;
};

std::vector<BuildInfo> build_backends() {
  std::vector<BuildInfo> out;
  for (const std::string& item : split_list(TENSOR_OPS_BUILD_BACKENDS, ';')) {
    size_t eq = item.find('=');
    out.push_back({item.substr(0, eq), eq == std::string::npos ? "" : item.substr(eq + 1)});
  }
  return out;
}

// What makes a plugin's table unusable ("NULL 'copy'"), or "" when it is
// well formed. Every entry the core calls unconditionally is required; the
// kernels (NULL: unsupported op) and stream_wait (NULL: no streams) are not.
std::string table_problem(const to_backend_v1& t) {
  if (!t.name) return "NULL 'name'";
  if (!*t.name) return "an empty 'name'";
  const std::pair<const char*, bool> required[] = {
      {"init", t.init != nullptr},
      {"priority", t.priority != nullptr},
      {"device_count", t.device_count != nullptr},
      {"device_info", t.device_info != nullptr},
      {"mem_info", t.mem_info != nullptr},
      {"allocate", t.allocate != nullptr},
      {"deallocate", t.deallocate != nullptr},
      {"copy", t.copy != nullptr},
      {"memset", t.memset != nullptr},
      {"synchronize", t.synchronize != nullptr},
      {"last_error", t.last_error != nullptr},
  };
  std::string missing;
  for (const auto& [entry, present] : required)
    if (!present) missing += (missing.empty() ? "NULL '" : ", NULL '") + std::string(entry) + "'";
  return missing.empty() ? "" : missing + " (required entries of to_backend_v1, tensor_ops/plugin.h)";
}

}  // namespace

Registry& Registry::instance() {
  static Registry r;
  return r;
}

// Note [fork]: fork() copies only the calling thread. A vendor runtime (CUDA,
// OpenCL, SYCL) initialised in the parent has threads and driver state the
// child lacks, and calls into it hang or fail there; so in the child every
// backend whose table lacks TO_BACKEND_FORK_SAFE is marked unusable, with a
// reason that names the cure, before any op can reach it. The CPU backend is
// fork-safe (its thread pool resets itself, cpu/thread_pool.h). The registry's
// own lock is taken around fork() so the child never inherits it held.
namespace {
std::atomic<Registry*> constructed_registry{nullptr};  // set once the constructor has loaded every plugin
}

void Registry::before_fork() { registry_mutex.lock(); }
void Registry::after_fork_in_parent() { registry_mutex.unlock(); }

void Registry::after_fork_in_child() {
  registry_mutex.unlock();
  Registry* reg = constructed_registry.load(std::memory_order_acquire);
  if (!reg) return;
  Registry& r = *reg;
  for (const auto& b : r.backends_)
    if (b->usable() && !(b->table().flags & TO_BACKEND_FORK_SAFE))
      b->disable(b->name() + " runtime was initialised in the parent process before fork(); vendor runtimes do "
                             "not survive fork: start worker processes with the 'spawn' or 'forkserver' method "
                             "(multiprocessing.set_start_method('spawn'), or DataLoader(..., "
                             "multiprocessing_context='spawn')), or use the CPU backend in the child");
  // Per-thread caches of the automatic choice may name a backend just disabled.
  r.generation_.fetch_add(1, std::memory_order_acq_rel);
}

Registry::Registry() {
  pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
  add(std::make_unique<Backend>(cpu::cpu_backend_table(), "built-in", nullptr));
  load_plugins_from(core_library_dir());
  for (const std::string& dir : split_list(env_str("TENSOR_OPS_PLUGIN_PATH"), ':')) load_plugins_from(dir);
  for (const BuildInfo& b : build_backends()) {
    // Loaded, or present but failed to load (missing_ already says why).
    if (find(b.name) || std::any_of(missing_.begin(), missing_.end(),
                                    [&](const BackendStatus& s) { return s.name == b.name; }))
      continue;
    BackendStatus s;
    s.name = b.name;
    s.compiled = false;
    s.reason = b.reason.empty()
                   ? "compiled, but its plugin libtensor_ops_" + b.name + ".so is missing from " + core_library_dir()
                   : b.reason;
    s.compiled = b.reason.empty();
    missing_.push_back(s);
  }
  constructed_registry.store(this, std::memory_order_release);
}

void Registry::add(std::unique_ptr<Backend> backend) {
  for (const auto& b : backends_)
    if (b->name() == backend->name()) return;  // first one found wins
  backends_.push_back(std::move(backend));
}

void Registry::load_plugins_from(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> files;
  while (dirent* e = readdir(d)) {
    std::string f = e->d_name;
    if (f.rfind("libtensor_ops_", 0) == 0 && f.size() > 3 && f.compare(f.size() - 3, 3, ".so") == 0)
      files.push_back(f);
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const std::string& f : files) {
    std::string name = f.substr(14, f.size() - 17);
    std::string path = dir + "/" + f;
    if (find(name)) continue;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    auto fail = [&](const std::string& why) {
      missing_.erase(std::remove_if(missing_.begin(), missing_.end(),
                                    [&](const BackendStatus& s) { return s.name == name; }),
                     missing_.end());
      missing_.push_back({name, true, false, why, 0, path});
    };
    if (!handle) {
      const char* err = dlerror();
      fail(std::string("plugin failed to load (its vendor runtime is probably missing): ") + (err ? err : "?"));
      continue;
    }
    auto entry = reinterpret_cast<to_backend_entry_fn>(dlsym(handle, TENSOR_OPS_PLUGIN_ENTRY));
    const to_backend_v1* table = entry ? entry() : nullptr;
    if (!table) {
      fail("plugin has no " TENSOR_OPS_PLUGIN_ENTRY " entry point");
      dlclose(handle);
      continue;
    }
    if (table->abi_version < TENSOR_OPS_PLUGIN_ABI_MIN_VERSION || table->abi_version > TENSOR_OPS_PLUGIN_ABI_VERSION) {
      fail("plugin ABI version " + std::to_string(table->abi_version) + ", core expects " +
           std::to_string(TENSOR_OPS_PLUGIN_ABI_MIN_VERSION) + " to " + std::to_string(TENSOR_OPS_PLUGIN_ABI_VERSION));
      dlclose(handle);
      continue;
    }
    const std::string malformed = table_problem(*table);
    if (!malformed.empty()) {
      fail("plugin table from " + path + " has " + malformed);
      dlclose(handle);
      continue;
    }
    missing_.erase(std::remove_if(missing_.begin(), missing_.end(),
                                  [&](const BackendStatus& s) { return s.name == name; }),
                   missing_.end());
    add(std::make_unique<Backend>(table, path, handle));
  }
  generation_.fetch_add(1, std::memory_order_acq_rel);
}

Backend* Registry::find(const std::string& name) const {
  for (const auto& b : backends_)
    if (b->name() == name) return b.get();
  return nullptr;
}

std::vector<Backend*> Registry::by_priority() const {
  std::vector<Backend*> out;
  for (const auto& b : backends_) out.push_back(b.get());
  std::stable_sort(out.begin(), out.end(), [](Backend* a, Backend* b) { return a->priority() > b->priority(); });
  return out;
}

std::vector<BackendStatus> Registry::status() const {
  std::vector<BackendStatus> out;
  for (Backend* b : by_priority()) {
    BackendStatus s{b->name(), true, b->usable(), b->reason(), b->priority(), b->library(), {}};
#define TENSOR_OPS_OP(name, id, n_in, n_out) \
  if (b->table().kernels[id] != nullptr) s.ops.push_back(op_name(OpId(id)));
#include "tensor_ops/ops.def"
#undef TENSOR_OPS_OP
    out.push_back(std::move(s));
  }
  out.insert(out.end(), missing_.begin(), missing_.end());
  return out;
}

std::vector<DeviceRecord> Registry::devices() const {
  std::vector<DeviceRecord> out;
  for (Backend* b : by_priority()) {
    for (int i = 0; i < b->device_count(); ++i) {
      DeviceRecord r;
      r.backend = b->name();
      r.device_id = i;
      b->check(b->table().device_info(i, &r.info), "device_info");
      out.push_back(r);
    }
  }
  return out;
}

std::vector<std::string> Registry::known_names() const {
  std::vector<std::string> out;
  for (const BackendStatus& s : status()) out.push_back(s.name);
  out.insert(out.end(), external_.begin(), external_.end());
  return out;
}

std::vector<std::string> Registry::usable_names() const {
  std::vector<std::string> out;
  for (Backend* b : by_priority())
    if (b->usable()) out.push_back(b->name());
  return out;
}

static std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

Backend& Registry::require(const std::string& name) const {
  Backend* b = find(name);
  if (!b) {
    for (const BackendStatus& s : missing_)
      if (s.name == name)
        throw BackendUnavailable("backend '" + name + "' is not available: " + s.reason +
                                 " (usable backends: " + join(usable_names()) + ")");
    throw InvalidArgument("unknown backend '" + name + "'; valid backends: " + join(known_names()) +
                          "; usable here: " + join(usable_names()));
  }
  if (!b->usable())
    throw BackendUnavailable("backend '" + name + "' is not usable: " + b->reason() +
                             " (usable backends: " + join(usable_names()) + ")");
  return *b;
}

const std::string* Registry::find_external(const char* name) const {
  for (const std::string& e : external_)
    if (e == name) return &e;
  return nullptr;
}

const std::string* Registry::external_choice() const {
  return external_.empty() ? nullptr : external_choice_in(selection_env().backend);
}

const std::string* Registry::external_choice_in(const char* forced) const {
  if (external_.empty()) return nullptr;
  if (!scope_stack.empty() && scope_stack.back() != "auto") {
    const std::string& top = scope_stack.back();
    return find_external(top.c_str());
  }
  if (scope_stack.empty()) {  // a use("auto") scope skips set_backend()
    const int i = selected_external_.load(std::memory_order_acquire);
    if (i >= 0) return &external_[size_t(i)];
    if (selected_backend_.load(std::memory_order_acquire)) return nullptr;
  }
  return forced ? find_external(forced) : nullptr;
}

Backend& Registry::host_backend() const {
  const SelectionEnv env = selection_env();
  if (const std::string* name = external_choice_in(env.backend)) throw ExternalBackendSelected(*name);
  return active_in(env.backend, env.priority);
}

Backend& Registry::active() const {
  const SelectionEnv env = selection_env();
  return active_in(env.backend, env.priority);
}

Backend& Registry::active_in(const char* forced, const char* order) const {
  // A use("auto") scope skips set_backend() and falls to automatic choice;
  // a scope naming an external backend counts as "auto" here.
  const bool auto_scope =
      !scope_stack.empty() && (scope_stack.back() == "auto" || find_external(scope_stack.back().c_str()));
  if (!scope_stack.empty() && !auto_scope) return require(scope_stack.back());
  if (!auto_scope) {
    // Usable unless a fork() since set_backend() disabled it: require() says why.
    if (Backend* b = selected_backend_.load(std::memory_order_acquire)) return b->usable() ? *b : require(b->name());
  }
  // The automatic choice depends only on two environment variables: cached
  // per thread against their current values (read by the caller in one scan).
  thread_local std::string cached_forced, cached_order;
  thread_local Backend* cached = nullptr;
  thread_local uint64_t cached_generation = 0;
  const uint64_t gen = generation_.load(std::memory_order_acquire);
  if (cached && cached_generation == gen && cached_forced == (forced ? forced : "") &&
      cached_order == (order ? order : ""))
    return *cached;
  Backend& b = resolve_auto(forced ? forced : "", order ? order : "");
  cached_forced = forced ? forced : "";
  cached_order = order ? order : "";
  cached = &b;
  cached_generation = gen;
  return b;
}

void Registry::set_external_backends(std::vector<std::string> names) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  external_ = std::move(names);
  generation_.fetch_add(1, std::memory_order_acq_rel);
}

Backend& Registry::resolve_auto(const std::string& forced, const std::string& order_env) const {
  if (!forced.empty() && forced != "auto" && !find_external(forced.c_str())) {
    try {
      return require(forced);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("TENSOR_OPS_BACKEND: ") + e.what());
    } catch (const BackendUnavailable& e) {
      throw BackendUnavailable(std::string("TENSOR_OPS_BACKEND: ") + e.what());
    }
  }
  const std::vector<std::string> order = split_list(order_env);
  if (!order.empty()) {
    const std::vector<std::string> known = known_names();
    // A typo anywhere in the list is an error, not a silent skip.
    for (const std::string& name : order)
      if (std::find(known.begin(), known.end(), name) == known.end())
        throw InvalidArgument("TENSOR_OPS_PRIORITY names unknown backend '" + name + "'; valid backends: " +
                              join(known));
    for (const std::string& name : order) {
      Backend* b = find(name);
      if (b && b->usable()) return *b;
    }
  }
  for (Backend* b : by_priority())
    if (b->usable()) return *b;
  throw BackendUnavailable("no usable backend");
}

void Registry::set_backend(const std::string& name) {
  const std::string* external = find_external(name.c_str());
  if (name.empty() || name == "auto" || external) {
    const int index = external ? int(external - external_.data()) : -1;
    selected_backend_.store(nullptr, std::memory_order_release);
    selected_external_.store(index, std::memory_order_release);
    return;
  }
  Backend& b = require(name);
  selected_external_.store(-1, std::memory_order_release);
  selected_backend_.store(&b, std::memory_order_release);
}

std::string Registry::selected_name() const {
  if (const std::string* name = external_choice()) return *name;
  return active().name();
}

void Registry::check_scope(const std::string& name) const {
  if (name != "auto" && !find_external(name.c_str())) require(name);
}

void Registry::push_scope(const std::string& name) {
  check_scope(name);
  scope_stack.push_back(name);
}

void Registry::set_scopes(std::vector<std::string> names) { scope_stack = std::move(names); }

void Registry::pop_scope() {
  if (!scope_stack.empty()) scope_stack.pop_back();
}

}  // namespace tensor_ops
