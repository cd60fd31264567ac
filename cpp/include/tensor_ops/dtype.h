#pragma once
// float32 / float16 / bfloat16: names, sizes and exact scalar conversions
// (round to nearest even, NaN kept quiet, inf and denormals exact).
#include <cstdint>
#include <cstring>
#include <string>

#include "tensor_ops/plugin.h"

namespace tensor_ops {

enum class DType : int32_t {
  Float32 = TO_FLOAT32,
  Float16 = TO_FLOAT16,
  BFloat16 = TO_BFLOAT16,
  Int32 = TO_INT32,  // index tensors only (targets, positions)
  Int64 = TO_INT64,
};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float16:
    case DType::BFloat16: return 2;
    case DType::Int64: return 8;
    default: return 4;
  }
}
inline bool is_float(DType t) { return t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16; }
const char* dtype_name(DType t);
// Accepts "float32", "float16", "bfloat16" and the short forms f32/f16/bf16.
DType dtype_from_name(const std::string& name);

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow rounds to inf
  return uint16_t(u >> 16);
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    // zero or denormal: value = mant * 2^-24, exact in float
    float v = float(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN stays NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // result is a half denormal (or zero): let the FPU round by adding 0.5
    float v = bits_float(a) + 0.5f;
    return uint16_t(sign | uint16_t(float_bits(v) - 0x3f000000u));
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += (uint32_t(15 - 127) << 23) + 0xfffu + mant_odd;
  return uint16_t(sign | uint16_t(a >> 13));
}

}  // namespace tensor_ops
