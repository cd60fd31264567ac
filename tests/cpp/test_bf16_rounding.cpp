// bfloat16 widening and narrowing in the CPU kernels' lanes, bit for bit
// against a reference written from the definition (round to nearest, ties
// to even, by comparing distances in double; NaN stays NaN with the quiet
// bit set), at every ISA level this CPU runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#ifndef TENSOR_OPS_CPU_X86
#define TENSOR_OPS_CPU_X86  // isa.h declares the x86 levels under it (the library's build defines it)
#endif
#endif

#include "cpu/cpu_backend.h"
#include "cpu/isa.h"

namespace {

using tensor_ops::DType;
namespace cpu = tensor_ops::cpu;

const cpu::IsaKernels& table(const std::string& level) {
#ifdef TENSOR_OPS_CPU_X86
  if (level == "avx2") return cpu::kernels_avx2();
  if (level == "avx512") return cpu::kernels_avx512();
  if (level == "avx512_bf16") return cpu::kernels_avx512_bf16();
  if (level == "amx") return cpu::kernels_amx();
#endif
  return cpu::kernels_baseline();
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The value of a bf16 pattern's magnitude (no NaN), with 0x7f80 read as
// 2^128: rounding acts as if the exponent were unbounded, then overflows.
double bf16_magnitude(uint16_t h) {
  const int e = (h >> 7) & 0xff, m = h & 0x7f;
  if (e == 0xff) return std::ldexp(1.0, 128);
  if (e == 0) return std::ldexp(double(m), -133);
  return std::ldexp(double(128 + m), e - 134);
}

uint16_t reference_narrow(uint32_t u) {
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN: sign and payload kept, quiet
  if (a == 0x7f800000u) return uint16_t(sign | 0x7f80);
  const double x = double(from_bits(a));
  const uint16_t lo = uint16_t(a >> 16), hi = uint16_t(lo + 1);
  const double dlo = x - bf16_magnitude(lo), dhi = bf16_magnitude(hi) - x;
  const uint16_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1 ? hi : lo);
  return uint16_t(sign | pick);
}

class Bf16Rounding : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::vector<std::string> levels = cpu::supported_isas();
    if (std::find(levels.begin(), levels.end(), GetParam()) == levels.end())
      GTEST_SKIP() << "this CPU cannot run the " << GetParam() << " kernels";
  }
  const cpu::IsaKernels& k() const { return table(GetParam()); }

  // from_float over src at each start offset 0..3 (full registers, a head
  // and a tail in different lanes), checked against reference_narrow.
  // mxcsr: the MXCSR for the conversion only (the reference needs exact
  // double arithmetic).
  void expect_narrow(const std::vector<float>& src, unsigned mxcsr = 0) const {
    std::vector<uint16_t> want(src.size());
    for (size_t i = 0; i < src.size(); ++i) want[i] = reference_narrow(bits(src[i]));
    for (size_t shift = 0; shift < 4 && shift < src.size(); ++shift) {
      const size_t n = src.size() - shift;
      std::vector<uint16_t> got(n + 1, 0xabcd);
#if defined(__x86_64__)
      const unsigned saved = _mm_getcsr();
      if (mxcsr) _mm_setcsr(mxcsr);
#endif
      k().from_float(DType::BFloat16, src.data() + shift, got.data(), int64_t(n));
#if defined(__x86_64__)
      _mm_setcsr(saved);
#endif
      int bad = 0;
      for (size_t i = 0; i < n && bad < 8; ++i) {
        const uint32_t u = bits(src[shift + i]);
        if (got[i] != want[shift + i]) {
          ++bad;
          ADD_FAILURE() << GetParam() << ": fp32 0x" << std::hex << u << " narrowed to 0x" << got[i] << ", want 0x"
                        << want[shift + i] << std::dec << " (element " << i << " of " << n << ")";
        }
      }
      EXPECT_EQ(got[n], 0xabcd) << "wrote past the end, n = " << n;
    }
  }
};

TEST_P(Bf16Rounding, WidensEveryBf16ValueExactly) {
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  for (size_t shift = 0; shift < 4; ++shift) {
    const size_t n = all.size() - shift;
    std::vector<float> got(n);
    k().to_float(DType::BFloat16, all.data() + shift, got.data(), int64_t(n));
    int bad = 0;
    for (size_t i = 0; i < n && bad < 8; ++i) {
      const uint16_t h = all[shift + i];
      const bool nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
      // The value from the definition (subnormals included), and the bits.
      const double want = nan ? 0.0 : (h & 0x8000 ? -1.0 : 1.0) * ((h & 0x7fff) == 0x7f80 ? INFINITY : bf16_magnitude(h & 0x7fff));
      const bool ok = bits(got[i]) == uint32_t(h) << 16 && (nan ? std::isnan(got[i]) : double(got[i]) == want);
      if (!ok) {
        ++bad;
        ADD_FAILURE() << GetParam() << ": bf16 0x" << std::hex << h << " widened to 0x" << bits(got[i]) << std::dec;
      }
    }
  }
}

TEST_P(Bf16Rounding, NarrowsEdgeValues) {
  std::vector<uint32_t> edges = {
      0x00000000, 0x80000000,  // +-0
      0x7f800000, 0xff800000,  // +-inf
      0x7f7fffff, 0xff7fffff,  // +-FLT_MAX: overflows to inf
      0x7f7f7fff, 0x7f7f8000, 0x7f7f8001, 0x7f7effff, 0x7f7e8000,  // around the largest bf16 (ties to even)
      0x00000001, 0x80000001, 0x00007fff, 0x00008000, 0x00008001, 0x00018000, 0x007f8000, 0x007fffff,  // subnormals
      0x00800000, 0x00808000, 0x00818000,  // the smallest normal and ties next to it
      0x3f800000, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0xbf808000, 0xbf818000,  // ties at 1
      0x7f800001, 0xff800001, 0x7fbfffff, 0x7fc00000, 0xffc00000, 0x7fffffff, 0xffffffff, 0x7f810000,  // NaNs
  };
  std::vector<float> src;
  for (int rep = 0; rep < 3; ++rep)  // each edge in every lane position
    for (uint32_t u : edges) src.push_back(from_bits(u));
  expect_narrow(src);
}

TEST_P(Bf16Rounding, NarrowsRandomFp32) {
  const uint32_t seed = 20261124;
  std::mt19937 rng(seed);
  std::vector<float> src(1 << 20);
  for (size_t i = 0; i < src.size(); ++i) {
    uint32_t u = rng();
    // A quarter with the low 16 bits at a tie or next to one.
    if (i % 4 == 1) u = (u & 0xffff0000u) | (0x8000u + (rng() % 3) - 1);
    src[i] = from_bits(u);
  }
  SCOPED_TRACE("seed " + std::to_string(seed));
  expect_narrow(src);
}

TEST_P(Bf16Rounding, RoundTripOfEveryBf16ValueIsExact) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  std::vector<float> f(all.size());
  std::vector<uint16_t> back(all.size());
  k().to_float(DType::BFloat16, all.data(), f.data(), int64_t(all.size()));
  k().from_float(DType::BFloat16, f.data(), back.data(), int64_t(all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    const bool nan = (all[i] & 0x7f80) == 0x7f80 && (all[i] & 0x7f);
    // A NaN comes back quiet (a signalling one gains the quiet bit).
    const uint16_t want = nan ? uint16_t(all[i] | 0x40) : all[i];
    ASSERT_EQ(back[i], want) << GetParam() << ": bf16 0x" << std::hex << all[i];
  }
}

#if defined(__x86_64__)
// Integer lanes: flush-to-zero and denormals-are-zero do not change the rounding.
TEST_P(Bf16Rounding, NarrowsSubnormalsUnderFtzDaz) {
  std::vector<float> src;
  for (uint32_t u : {0x00000001u, 0x00008000u, 0x00018000u, 0x007fffffu, 0x80408000u, 0x807f8001u})
    for (int rep = 0; rep < 20; ++rep) src.push_back(from_bits(u));
  expect_narrow(src, _mm_getcsr() | 0x8040u);
}
#endif

INSTANTIATE_TEST_SUITE_P(Levels, Bf16Rounding, ::testing::Values("baseline", "avx2", "avx512", "avx512_bf16", "amx"),
                         [](const auto& info) { return info.param; });

}  // namespace
