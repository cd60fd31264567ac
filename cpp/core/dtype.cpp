#include "tensor_ops/dtype.h"

#include "tensor_ops/errors.h"

namespace tensor_ops {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
  }
  return "unknown";
}

DType dtype_from_name(const std::string& n) {
  if (n == "float32" || n == "f32") return DType::Float32;
  if (n == "float16" || n == "f16" || n == "half") return DType::Float16;
  if (n == "bfloat16" || n == "bf16") return DType::BFloat16;
  if (n == "int32") return DType::Int32;
  if (n == "int64") return DType::Int64;
  throw DTypeError("unsupported dtype '" + n + "': tensor_ops takes float32, float16 and bfloat16");
}

}  // namespace tensor_ops
