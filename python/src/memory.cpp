// tensor_ops.Tensor (device-resident data owned by a pool block) and the
// memory API: stats, empty_cache, memory fraction, OOM-protected allocation.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "convert.h"
#include "tensor_ops/device_memory.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/transfer.h"

namespace nb = nanobind;

namespace tensor_ops::python {
namespace {

// The tensor as an nb::ndarray view whose owner keeps the pool block alive.
template <class... Framework>
auto as_ndarray(const Tensor& t, bool bits_as_uint16 = false) {
  auto* keep = new std::shared_ptr<void>(t.owner());
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<void>*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
  nb::dlpack::dtype dt = dl_dtype(t.dtype());
  if (bits_as_uint16 && dtype_size(t.dtype()) == 2) dt = nb::dtype<uint16_t>();
  return nb::ndarray<Framework...>(static_cast<char*>(t.data()) + t.byte_offset(), t.ndim(), shape.data(), owner,
                                strides.data(), dt, dl_device_type(t.device()), t.device().id);
}

std::vector<int64_t> shape_arg(const std::vector<int64_t>& s) { return s; }

}  // namespace

void init_memory(nb::module_& m) {
  nb::class_<Tensor>(m, "Tensor", "Device-resident data owned by a tensor_ops pool block.", nb::is_weak_referenceable())
      .def_prop_ro("shape", [](const Tensor& t) {
        nb::list l;
        for (int64_t d : t.shape()) l.append(d);
        return nb::tuple(l);
      })
      .def_prop_ro("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype())); })
      .def_prop_ro("device", [](const Tensor& t) { return device_name(t.device()); })
      .def_prop_ro("nbytes", &Tensor::nbytes)
      .def_prop_ro("ndim", &Tensor::ndim)
      .def_prop_ro("data_ptr", [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) + t.byte_offset(); })
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("to", [](const Tensor& t, const std::string& device) {
        Device d = parse_device(device);
        if (d == t.device()) return t;
        nb::gil_scoped_release release;
        return to_device(t, d);
      }, nb::arg("device"), "A copy on another device (self when already there).")
      .def("_host_bits", [](const Tensor& t) {
        // A host view (zero-copy on the host, a copy from a device) with
        // 16-bit types as uint16 bits; the Python layer picks the numpy dtype.
        Tensor h = t.device().is_host() ? t : to_device(t, Device{});
        return as_ndarray<nb::numpy>(h, true);
      })
      .def("__dlpack__", [](const Tensor& t, nb::kwargs) {
        // A legacy "dltensor" capsule; host data needs no stream
        // synchronisation, device plugins synchronise in their copies.
        return dlpack_capsule(t);
      })
      .def("__dlpack_device__", [](const Tensor& t) { return nb::make_tuple(dl_device_type(t.device()), t.device().id); })
      .def("__repr__", [](const Tensor& t) { return "tensor_ops.Tensor(" + t.describe() + ", device=" + device_name(t.device()) + ")"; });

  m.def("parse_device", [](const std::string& d) { return device_name(parse_device(d)); });
  m.def(
      "empty",
      [](const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device, double margin) {
        Device d = parse_device(device);
        DType dt = dtype_from_name(dtype);
        nb::gil_scoped_release release;
        return DeviceMemory::of(d).empty(shape_arg(shape), dt, margin);
      },
      nb::arg("shape"), nb::arg("dtype"), nb::arg("device"), nb::arg("safety_margin") = 1.2);
  m.def("zero_", [](const Tensor& t) { zero_fill(t); });
  m.def(
      "from_host",
      [](const nb::ndarray<nb::ro>& a, const std::string& device, bool bf16) {
        Tensor src = to_tensor(a, "array", bf16);
        if (!src.device().is_host()) throw InvalidArgument("from_host needs a host array, got " + src.describe());
        Device d = parse_device(device);
        nb::gil_scoped_release release;
        return to_device(src, d);
      },
      nb::arg("array"), nb::arg("device"), nb::arg("bf16") = false);
  m.def("memory_stats", [](const std::string& device) { return DeviceMemory::of(parse_device(device)).stats(); });
  m.def("empty_cache", [](const std::string& device) { DeviceMemory::of(parse_device(device)).empty_cache(); });
  m.def("set_memory_fraction", [](double f, const std::string& device) {
    DeviceMemory::of(parse_device(device)).set_memory_fraction(f);
  });
  m.def("reset_peak_memory_stats", [](const std::string& device) {
    DeviceMemory::of(parse_device(device)).reset_peak_stats();
  });
  m.def("_inject_alloc_failures", [](uint64_t every, uint64_t above, const std::string& device) {
    DeviceMemory::of(parse_device(device)).inject_failures(every, above);
  });
}

}  // namespace tensor_ops::python
