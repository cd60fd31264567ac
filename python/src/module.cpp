// tensor_ops._C: thin bindings; each topic registers itself.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace tensor_ops::python {
void init_errors(nb::module_& m);
void init_memory(nb::module_& m);
void init_ops(nb::module_& m);
void init_registry(nb::module_& m);
void init_streams(nb::module_& m);
}  // namespace tensor_ops::python

NB_MODULE(_C, m) {
  m.doc() = "tensor_ops native core";
  tensor_ops::python::init_errors(m);
  tensor_ops::python::init_memory(m);
  tensor_ops::python::init_ops(m);
  tensor_ops::python::init_registry(m);
  tensor_ops::python::init_streams(m);
}
