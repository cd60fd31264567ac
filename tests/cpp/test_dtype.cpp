// dtype.h: names and the exact float <-> float16 / bfloat16 conversions,
// checked exhaustively (every 16-bit pattern), at hand-built edge cases, and
// against a slow reference that rounds with exact double arithmetic.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>

#include "tensor_ops/dtype.h"
#include "tensor_ops/errors.h"
#include "thrown_message.h"

namespace tensor_ops {
namespace {

using ::testing::HasSubstr;
using testing::thrown_message;

std::string hex(uint32_t u) {
  char s[16];
  std::snprintf(s, sizeof(s), "0x%08x", u);
  return s;
}

// A binary format: `mant` fraction bits, exponent bias, smallest normal
// exponent, the largest finite value.
struct Format {
  int mant, bias, emin;
  double max_finite;
};
constexpr Format kHalf{10, 15, -14, 65504.0};
constexpr Format kBf16{7, 127, -126, 0x1.fep127};

// The value of bits h in format f, from the textbook formula.
double decode(const Format& f, uint32_t h) {
  const uint32_t sign = h >> (f.mant + (f.mant == 10 ? 5 : 8));
  const uint32_t exp = (h >> f.mant) & (f.mant == 10 ? 0x1fu : 0xffu);
  const uint32_t frac = h & ((1u << f.mant) - 1);
  const uint32_t exp_max = f.mant == 10 ? 0x1fu : 0xffu;
  double v;
  if (exp == exp_max)
    v = frac ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (exp == 0)
    v = std::ldexp(double(frac), f.emin - f.mant);
  else
    v = std::ldexp(1.0 + std::ldexp(double(frac), -f.mant), int(exp) - f.bias);
  return sign ? -v : v;
}

// x (a float's value, finite) rounded to format f by exact double arithmetic:
// scale to the grid of the binade (or the denormal grid), round half to even
// with nearbyint, scale back; past the largest finite value it is infinity.
double reference_round(const Format& f, double x) {
  const double a = std::fabs(x);
  if (a == 0) return x;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const double ulp = std::ldexp(1.0, std::max(e - 1, f.emin) - f.mant);
  const double r = std::nearbyint(a / ulp) * ulp;
  const double out = r > f.max_finite ? std::numeric_limits<double>::infinity() : r;
  return std::signbit(x) ? -out : out;
}

// The bits of a value of format f (finite or infinite, not NaN).
uint32_t encode(const Format& f, double v) {
  const int exp_bits = f.mant == 10 ? 5 : 8;
  const uint32_t sign = std::signbit(v) ? 1u << (f.mant + exp_bits) : 0u;
  const double a = std::fabs(v);
  if (std::isinf(a)) return sign | (((1u << exp_bits) - 1) << f.mant);
  if (a < std::ldexp(1.0, f.emin)) return sign | uint32_t(std::ldexp(a, f.mant - f.emin));
  int e;
  const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  return sign | (uint32_t(e - 1 + f.bias) << f.mant) | uint32_t(std::ldexp(2 * m - 1, f.mant));
}

bool is_half_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool is_bf16_nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }

TEST(DTypeNames, RoundTripThroughNames) {
  for (DType t : {DType::Float32, DType::Float16, DType::BFloat16}) EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  EXPECT_STREQ(dtype_name(DType::Float32), "float32");
  EXPECT_STREQ(dtype_name(DType::Float16), "float16");
  EXPECT_STREQ(dtype_name(DType::BFloat16), "bfloat16");
  EXPECT_EQ(dtype_from_name("f32"), DType::Float32);
  EXPECT_EQ(dtype_from_name("f16"), DType::Float16);
  EXPECT_EQ(dtype_from_name("half"), DType::Float16);
  EXPECT_EQ(dtype_from_name("bf16"), DType::BFloat16);
  EXPECT_EQ(dtype_size(DType::Float32), 4u);
  EXPECT_EQ(dtype_size(DType::Float16), 2u);
  EXPECT_EQ(dtype_size(DType::BFloat16), 2u);
}

TEST(DTypeNames, UnknownNameIsADTypeError) {
  const std::string msg = thrown_message<DTypeError>([] { dtype_from_name("float64"); });
  EXPECT_THAT(msg, HasSubstr("float64"));
  EXPECT_THAT(msg, HasSubstr("bfloat16"));  // lists what is accepted
  EXPECT_THROW(dtype_from_name(""), DTypeError);
  EXPECT_THROW(dtype_from_name("Float32"), DTypeError);
  // DTypeError is an InvalidArgument (ValueError family in Python).
  EXPECT_THROW(dtype_from_name("int8"), InvalidArgument);
}

TEST(Half, DecodesEveryPatternByTheFormula) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    SCOPED_TRACE(hex(h));
    const float got = half_to_float(uint16_t(h));
    const double want = decode(kHalf, h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got));
      ASSERT_EQ(std::signbit(got), bool(h & 0x8000u));
      ASSERT_EQ(float_bits(got) & 0x7fffffu, (h & 0x3ffu) << 13) << "payload kept";
    } else {
      ASSERT_EQ(float_bits(got), float_bits(float(want))) << "got " << got << ", want " << want;
    }
  }
}

TEST(Half, EveryPatternRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    SCOPED_TRACE(hex(h));
    const uint16_t back = float_to_half(half_to_float(uint16_t(h)));
    if (is_half_nan(uint16_t(h))) {
      ASSERT_TRUE(is_half_nan(back)) << hex(back);
      ASSERT_EQ(back & 0x8000u, h & 0x8000u);
    } else {
      ASSERT_EQ(back, h) << hex(back);
    }
  }
}

TEST(Half, RoundsTiesToEven) {
  // 1 + 2^-11 lies halfway between 1 (even) and 1 + 2^-10.
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(float_to_half(std::nextafter(1.0f + 0x1p-11f, 2.0f)), 0x3c01);
  EXPECT_EQ(float_to_half(std::nextafter(1.0f + 0x1p-11f, 0.0f)), 0x3c00);
  // 1 + 3 * 2^-11 lies halfway between 0x3c01 (odd) and 0x3c02.
  EXPECT_EQ(float_to_half(1.0f + 3 * 0x1p-11f), 0x3c02);
  // Half ulp at 2048 is 2: 2049 ties down to 2048, 2051 up to 2052.
  EXPECT_EQ(float_to_half(2049.0f), float_to_half(2048.0f));
  EXPECT_EQ(half_to_float(float_to_half(2051.0f)), 2052.0f);
  // A tie whose rounding carries into the exponent: 2047.5 -> 2048.
  EXPECT_EQ(float_to_half(2047.5f), 0x6800);
  EXPECT_EQ(float_to_half(-2047.5f), 0xe800);
  // Denormal ties: 3 * 2^-25 between 1 and 2 (-> 2), 5 * 2^-25 between 2 and 3 (-> 2).
  EXPECT_EQ(float_to_half(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(float_to_half(5 * 0x1p-25f), 0x0002);
  // Largest denormal + half an ulp ties up to the smallest normal.
  EXPECT_EQ(float_to_half(1023.5f * 0x1p-24f), 0x0400);
  EXPECT_EQ(float_to_half(1022.5f * 0x1p-24f), 0x03fe);
}

TEST(Half, RangeEdges) {
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(half_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(float_to_half(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);  // the tie above 65504 rounds to even: inf
  EXPECT_EQ(float_to_half(-65520.0f), 0xfc00);
  EXPECT_EQ(float_to_half(1e9f), 0x7c00);
  EXPECT_EQ(float_to_half(FLT_MAX), 0x7c00);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xfc00);

  EXPECT_EQ(float_to_half(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_half(0x1p-24f), 0x0001);  // smallest denormal
  EXPECT_EQ(half_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(float_to_half(0x1p-25f), 0x0000);  // exactly half of it: ties to zero (even)
  EXPECT_EQ(float_to_half(-0x1p-25f), 0x8000);
  EXPECT_EQ(float_to_half(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(float_to_half(std::nextafter(0x1p-25f, 0.0f)), 0x0000);
  EXPECT_EQ(float_to_half(0x1p-30f), 0x0000);
  EXPECT_EQ(float_to_half(1e-40f), 0x0000);  // a float denormal
  EXPECT_EQ(float_to_half(-1e-40f), 0x8000);

  EXPECT_EQ(float_to_half(0.0f), 0x0000);
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_TRUE(std::signbit(half_to_float(0x8000)));
  EXPECT_EQ(half_to_float(0x8000), 0.0f);
}

TEST(Half, NaNStaysNaN) {
  for (uint32_t f : {0x7fc00000u, 0x7f800001u, 0x7f802000u, 0x7fffffffu, 0xffc00000u, 0xff800001u}) {
    SCOPED_TRACE(hex(f));
    const uint16_t h = float_to_half(bits_float(f));
    EXPECT_TRUE(is_half_nan(h)) << hex(h);
    EXPECT_TRUE(h & 0x0200u) << "quiet bit set: " << hex(h);
    EXPECT_EQ(h & 0x8000u, (f >> 16) & 0x8000u);
  }
}

TEST(Half, MatchesDoubleReferenceOnRandomFloats) {
  const uint32_t seed = 20240611;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> exponent(100, 145);  // 2^-27 .. 2^18: denormals to overflow
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = rng();
    if (i % 4 != 0) u = (u & 0x807fffffu) | (exponent(rng) << 23);
    const float f = bits_float(u);
    const uint16_t got = float_to_half(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(is_half_nan(got)) << hex(u);
      continue;
    }
    const uint32_t want = encode(kHalf, reference_round(kHalf, double(f)));
    ASSERT_EQ(got, want) << "float " << hex(u) << " (" << f << "): got " << hex(got) << ", want " << hex(want);
  }
}

TEST(BFloat16, DecodesEveryPatternByTheFormula) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    SCOPED_TRACE(hex(h));
    const float got = bf16_to_float(uint16_t(h));
    const double want = decode(kBf16, h);
    if (std::isnan(want))
      ASSERT_TRUE(std::isnan(got));
    else
      ASSERT_EQ(float_bits(got), float_bits(float(want))) << "got " << got << ", want " << want;
  }
}

TEST(BFloat16, EveryPatternRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    SCOPED_TRACE(hex(h));
    const uint16_t back = float_to_bf16(bf16_to_float(uint16_t(h)));
    if (is_bf16_nan(uint16_t(h))) {
      ASSERT_TRUE(is_bf16_nan(back)) << hex(back);
      ASSERT_EQ(back & 0x8000u, h & 0x8000u);
    } else {
      ASSERT_EQ(back, h) << hex(back);
    }
  }
}

TEST(BFloat16, RoundsTiesToEven) {
  // 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 0x3f81.
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + 0x1p-8f, 2.0f)), 0x3f81);
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(float_to_bf16(-(1.0f + 3 * 0x1p-8f)), 0xbf82);
  // A tie that carries into the exponent: 0x3fff8000 -> 0x4000.
  EXPECT_EQ(float_to_bf16(bits_float(0x3fff8000u)), 0x4000);
  // Float denormals: 0x00008000 ties to 0, 0x00018000 to 0x0002.
  EXPECT_EQ(float_to_bf16(bits_float(0x00008000u)), 0x0000);
  EXPECT_EQ(float_to_bf16(bits_float(0x00018000u)), 0x0002);
}

TEST(BFloat16, RangeEdgesAndSpecials) {
  EXPECT_EQ(float_to_bf16(bits_float(0x7f7f7fffu)), 0x7f7f);  // just under the tie: largest finite
  EXPECT_EQ(float_to_bf16(bits_float(0x7f7f8000u)), 0x7f80);  // the tie above it rounds to inf
  EXPECT_EQ(float_to_bf16(FLT_MAX), 0x7f80);
  EXPECT_EQ(float_to_bf16(-FLT_MAX), 0xff80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
}

TEST(BFloat16, NaNStaysQuietNaN) {
  // Payloads only in the low 16 bits would truncate to inf without quieting.
  for (uint32_t f : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fffffffu, 0xffc00000u, 0xff800001u}) {
    SCOPED_TRACE(hex(f));
    const uint16_t h = float_to_bf16(bits_float(f));
    EXPECT_TRUE(is_bf16_nan(h)) << hex(h);
    EXPECT_TRUE(h & 0x0040u) << "quiet bit set: " << hex(h);
    EXPECT_EQ(h & 0x8000u, (f >> 16) & 0x8000u);
  }
}

TEST(BFloat16, MatchesDoubleReferenceOnRandomFloats) {
  const uint32_t seed = 20240612;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = rng();
    if (i % 4 == 1) u &= 0x807fffffu;                // float denormals
    if (i % 4 == 2) u |= 0x7f000000u;                // near overflow
    if (i % 4 == 3) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    const float f = bits_float(u);
    const uint16_t got = float_to_bf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(is_bf16_nan(got)) << hex(u);
      continue;
    }
    const uint32_t want = encode(kBf16, reference_round(kBf16, double(f)));
    ASSERT_EQ(got, want) << "float " << hex(u) << " (" << f << "): got " << hex(got) << ", want " << hex(want);
  }
}

}  // namespace
}  // namespace tensor_ops
