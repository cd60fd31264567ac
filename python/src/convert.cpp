#include "convert.h"

#include "tensor_ops/errors.h"

namespace nb = nanobind;

namespace tensor_ops::python {
namespace {

std::string dl_dtype_name(nb::dlpack::dtype d) {
  std::string base;
  switch (nb::dlpack::dtype_code(d.code)) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: base = "code" + std::to_string(int(d.code)) + "_"; break;
  }
  return base + std::to_string(int(d.bits)) + (d.lanes > 1 ? "x" + std::to_string(int(d.lanes)) : "");
}

Device device_of(const nb::ndarray<nb::ro>& a, const char* arg) {
  const int32_t id = a.device_id();
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
    case nb::device::rocm_host::value: return Device{"host", 0};
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value: return Device{"cuda", id};
    case nb::device::rocm::value: return Device{"hip", id};
    case nb::device::opencl::value: return Device{"opencl", id};
    case nb::device::oneapi::value: return Device{"sycl", id};
    default:
      throw InvalidArgument(std::string(arg) + " lives on DLPack device type " + std::to_string(a.device_type()) +
                            ", which tensor_ops cannot reach");
  }
}

}  // namespace

Tensor to_tensor(const nb::ndarray<nb::ro>& a, const char* arg, bool as_bfloat16) {
  const nb::dlpack::dtype d = a.dtype();
  DType dt;
  if (d.lanes == 1 && d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 32)
    dt = DType::Float32;
  else if (d.lanes == 1 && d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16)
    dt = DType::Float16;
  else if (d.lanes == 1 && d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16)
    dt = DType::BFloat16;
  else if (as_bfloat16 && d.lanes == 1 && d.code == uint8_t(nb::dlpack::dtype_code::UInt) && d.bits == 16)
    dt = DType::BFloat16;
  else if (d.lanes == 1 && d.code == uint8_t(nb::dlpack::dtype_code::Int) && d.bits == 32)
    dt = DType::Int32;
  else if (d.lanes == 1 && d.code == uint8_t(nb::dlpack::dtype_code::Int) && d.bits == 64)
    dt = DType::Int64;
  else
    throw DTypeError(std::string(arg) + " has dtype " + dl_dtype_name(d) +
                     "; tensor_ops ops take float32, float16 or bfloat16 data (int32 or int64 for indices)");
  std::vector<int64_t> shape(a.ndim()), strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = a.shape(i);
    strides[i] = a.stride(i);
  }
  return Tensor(const_cast<void*>(a.data()), dt, std::move(shape), std::move(strides), device_of(a, arg));
}

Tensor to_tensor(nb::handle h, const char* arg, bool as_bfloat16) {
  if (nb::isinstance<Tensor>(h)) return nb::cast<const Tensor&>(h);
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(h, a))
    throw DTypeError(std::string(arg) + " of type " + nb::inst_name(h).c_str() +
                     " is not an array tensor_ops can read (numpy, torch, DLPack or tensor_ops.Tensor)");
  return to_tensor(a, arg, as_bfloat16);
}

}  // namespace tensor_ops::python
