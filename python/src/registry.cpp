// Backends, devices and selection.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "../../cpp/core/env.h"
#include "../../cpp/cpu/cpu_backend.h"
#include "tensor_ops/registry.h"

namespace nb = nanobind;

namespace tensor_ops::python {

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
  m.def("active_backend", [] { return Registry::instance().active().name(); });
  m.def("selected_backend", [] { return Registry::instance().selected_name(); });
  m.def("external_selected", [] { return Registry::instance().external_choice() != nullptr; });
  m.def("set_backend", [](const std::string& name) { Registry::instance().set_backend(name); });
  m.def("set_external_backends",
        [](const std::vector<std::string>& names) { Registry::instance().set_external_backends(names); });
  m.def("push_scope", [](const std::string& name) { Registry::instance().push_scope(name); });
  m.def("pop_scope", [] { Registry::instance().pop_scope(); });
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
