// Backends, devices and selection.
#include <atomic>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "../../cpp/core/env.h"
#include "../../cpp/cpu/cpu_backend.h"
#include "convert.h"
#include "tensor_ops/registry.h"

namespace nb = nanobind;

namespace tensor_ops::python {

// Note [use() per context]
// tensor_ops.use(name) is a context variable (contextvars), not a per-thread
// stack: asyncio tasks interleaving their `with use(...)` blocks on one thread
// each get the backend their own block named (with a per-thread stack, a task
// inside use("cpu") ran on another task's "xla", and the first exit popped the
// other's scope), and a block that ends on another thread (a generator resumed
// by a thread pool) no longer pops that thread's own scope. The core keeps its
// per-thread stack (C embedders, the kernels' selection without the GIL); the
// binding mirrors the variable's value there, with the GIL, before an op reads
// its arguments and before a selection query: one PyContextVar_Get and a
// pointer compare per call, the stack rebuilt only when the value changed.
// A block's entry is marked inactive when the block ends and the generation
// is bumped, so every thread rebuilds its mirror without it: a block that
// ended in another context (the generator case) cannot reset the variable
// where it was set (the thread that entered it stayed on that backend for
// good), and a task created inside the block holds a copy of the entry.
namespace {
PyObject* scope_var = nullptr;  // the ContextVar: tuple of entries (.name, .active), innermost last
std::atomic<uint64_t> scope_generation{0};
thread_local PyObject* scope_applied = nullptr;  // the tuple last mirrored on this thread (owned)
thread_local uint64_t scope_applied_generation = 0;
}  // namespace

void sync_scope() {
  if (!scope_var) return;
  PyObject* v = nullptr;
  if (PyContextVar_Get(scope_var, nullptr, &v) < 0) throw nb::python_error();
  const uint64_t gen = scope_generation.load(std::memory_order_acquire);
  if (!v || (v == scope_applied && gen == scope_applied_generation)) {
    Py_XDECREF(v);
    return;
  }
  nb::object value = nb::steal(v);
  std::vector<std::string> names;
  if (PyTuple_Check(v)) {
    for (nb::handle entry : nb::borrow<nb::tuple>(value))
      if (nb::cast<bool>(entry.attr("active"))) names.push_back(nb::cast<std::string>(entry.attr("name")));
  }
  Registry::instance().set_scopes(std::move(names));
  Py_XSETREF(scope_applied, value.release().ptr());
  scope_applied_generation = gen;
}

void init_registry(nb::module_& m) {
  m.def("backends", [] {
    nb::list out;
    for (const BackendStatus& s : Registry::instance().status()) {
      nb::dict d;
      d["name"] = s.name;
      d["compiled"] = s.compiled;
      d["usable"] = s.usable;
      d["reason"] = s.reason;
      d["priority"] = s.priority;
      d["library"] = s.library;
      d["ops"] = s.ops;
      out.append(d);
    }
    return out;
  });
  m.def("devices", [] {
    nb::list out;
    for (const DeviceRecord& r : Registry::instance().devices()) {
      nb::dict d;
      d["backend"] = r.backend;
      d["device_id"] = r.device_id;
      d["device_name"] = std::string(r.info.name);
      d["vendor"] = std::string(r.info.vendor);
      d["driver_version"] = std::string(r.info.driver_version);
      d["compute_capability"] = std::string(r.info.compute_capability);
      d["device_type"] = r.info.device_type;
      d["total_memory_bytes"] = r.info.total_memory_bytes;
      d["is_available"] = bool(r.info.is_available);
      d["properties"] = std::string(r.info.properties);
      out.append(d);
    }
    return out;
  });
  m.def("active_backend", [] {
    sync_scope();
    return Registry::instance().active().name();
  });
  m.def("selected_backend", [] {
    sync_scope();
    return Registry::instance().selected_name();
  });
  m.def("external_selected", [] {
    sync_scope();
    return Registry::instance().external_choice() != nullptr;
  });
  m.def("check_scope", [](const std::string& name) { Registry::instance().check_scope(name); });
  m.def("scopes_changed", [] { scope_generation.fetch_add(1, std::memory_order_acq_rel); });
  m.def("set_scope_var", [](nb::handle var) {
    if (!PyContextVar_CheckExact(var.ptr())) throw nb::type_error("set_scope_var takes a contextvars.ContextVar");
    Py_XSETREF(scope_var, nb::borrow(var).release().ptr());
  });
  m.def("set_backend", [](const std::string& name) { Registry::instance().set_backend(name); });
  m.def("set_external_backends",
        [](const std::vector<std::string>& names) { Registry::instance().set_external_backends(names); });
  m.def("load_plugins_from", [](const std::string& dir) { Registry::instance().load_plugins_from(dir); });
  m.def("core_library_dir", &core_library_dir);
  m.def("environment_warnings", &environment_warnings,
        "Malformed TENSOR_OPS_* environment variables: one sentence each, naming the value used instead.");
  m.def("cpu_supported_isas", &cpu::supported_isas);
  m.def("cpu_active_isa", &cpu::active_isa);
  m.def("cpu_set_isa", &cpu::set_isa);
  m.def("cpu_num_threads", &cpu::num_threads);
  m.def("cpu_set_num_threads", &cpu::set_num_threads, nb::call_guard<nb::gil_scoped_release>());
  m.def("cpu_set_openmp", &cpu::set_openmp, nb::arg("gomp_parallel"), nb::arg("omp_get_max_threads") = 0,
        nb::call_guard<nb::gil_scoped_release>(),
        "Run the CPU pool's regions on an OpenMP runtime's threads: the address of its GOMP_parallel (0: our own "
        "workers) and of its omp_get_max_threads (0: none; else a region's team is no larger than the calling "
        "thread's OpenMP thread count). tensor_ops.torch points them at torch's.");
  m.def("cpu_uses_openmp", &cpu::uses_openmp);
  m.def("cpu_region_threads", &cpu::region_threads,
        "The threads a CPU region started now from this thread would run on.");
}

}  // namespace tensor_ops::python
