// Op bindings: outputs are allocated by the Python layer with the caller's
// framework; the GIL is released around the kernels.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "convert.h"
#include "tensor_ops/ops.h"

namespace nb = nanobind;
using Array = nb::handle;

namespace tensor_ops::python {

void init_ops(nb::module_& m) {
  m.def(
      "rms_norm",
      [](const Array& x, const Array& weight, const Array& out, double eps, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16), tw = to_tensor(weight, "weight", bf16), to = to_tensor(out, "out", bf16);
        nb::gil_scoped_release release;
        rms_norm(tx, tw, to, eps);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("out"), nb::arg("eps"), nb::arg("bf16") = false,
      "rms_norm over the last dimension into out (validated by the core).");
  m.def(
      "silu",
      [](const Array& x, const Array& out, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16), to = to_tensor(out, "out", bf16);
        nb::gil_scoped_release release;
        silu(tx, to);
      },
      nb::arg("x"), nb::arg("out"), nb::arg("bf16") = false);
  m.def(
      "gelu",
      [](const Array& x, const Array& out, const std::string& approximate, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16), to = to_tensor(out, "out", bf16);
        nb::gil_scoped_release release;
        gelu(tx, to, approximate);
      },
      nb::arg("x"), nb::arg("out"), nb::arg("approximate"), nb::arg("bf16") = false);
  m.def(
      "data_ptr",
      [](const Array& x) {
        Tensor t = to_tensor(x, "x", true);
        return reinterpret_cast<uintptr_t>(t.data()) + t.byte_offset();
      },
      nb::arg("x"),
      "The data pointer the core sees for x (tests use it to prove zero-copy).");
  m.def(
      "backend_for", [](const Array& x) { return backend_for(to_tensor(x, "x")); }, nb::arg("x"),
      "Name of the backend an op on x would run on.");
}

}  // namespace tensor_ops::python
