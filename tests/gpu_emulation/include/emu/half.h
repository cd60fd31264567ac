// fp16 / bf16 storage types and the conversions cuda/ uses, for the
// emulator: __half, __nv_bfloat16 (CUDA) and hip_bfloat16 (ROCm). Bit-exact
// round-to-nearest-even conversions, subnormals, infinities and NaN included,
// done in software so the host compiler's own _Float16 support does not matter.
#ifndef TENSOR_OPS_EMU_HALF_H
#define TENSOR_OPS_EMU_HALF_H

#include <cstdint>
#include <cstring>

namespace emu {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0));  // inf / NaN
  if (exp == 0) {
    const float v = float(man) * (1.0f / 16777216.0f);  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_half_bits_rn(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));  // inf / NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds past 65504: inf
  if (a < 0x38800000u) {                                 // below 2^-14: subnormal or zero
    // value * 2^24 rounded to an integer, ties to even (nearbyint under the default mode).
    const float scaled = bits_f32(a) * 16777216.0f;  // exact: a power of two
    uint32_t m = uint32_t(scaled);
    const float rest = scaled - float(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);  // m == 0x400 rolls into the smallest normal: correct
  }
  const uint32_t exp = (a >> 23) - 112u, man = a & 0x7fffffu;
  uint32_t h = (exp << 10) | (man >> 13);
  const uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_f32(uint32_t(b) << 16); }

inline uint16_t float_to_bf16_bits_rn(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace emu

struct __half {
  uint16_t __x;
};
inline float __half2float(__half h) { return emu::half_bits_to_float(h.__x); }
inline __half __float2half_rn(float f) { return __half{emu::float_to_half_bits_rn(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }

struct __nv_bfloat16 {
  uint16_t __x;
};
inline float __bfloat162float(__nv_bfloat16 b) { return emu::bf16_bits_to_float(b.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{emu::float_to_bf16_bits_rn(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

// ROCm's hip_bfloat16: a struct with explicit float conversions (RNE).
struct hip_bfloat16 {
  uint16_t data;
  hip_bfloat16() = default;
  explicit hip_bfloat16(float f) : data(emu::float_to_bf16_bits_rn(f)) {}
  explicit operator float() const { return emu::bf16_bits_to_float(data); }
};

#endif
