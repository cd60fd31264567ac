// The CPU kernels, compiled once per ISA level. The including file defines
// TENSOR_OPS_ISA_NS (the namespace) and TENSOR_OPS_ISA_NAME, and is built
// with that level's compiler flags.
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TENSOR_OPS_HAVE_STREAM 1
#endif

#include "attention_tiles.h"
#include "isa.h"
#include "linear_items.h"
#include "tensor_ops/ops.h"

namespace tensor_ops::cpu {
namespace TENSOR_OPS_ISA_NS {
namespace {

#include "vec_math.h"

constexpr int64_t kBlock = 512;

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

inline void stream_fence() {
#ifdef TENSOR_OPS_HAVE_STREAM
  _mm_sfence();
#endif
}

// ---- vf rows ----------------------------------------------------------------

TENSOR_OPS_VEC_INLINE vf vload(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

TENSOR_OPS_VEC_INLINE void vstore(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

// Streaming store of a whole register; p is aligned to sizeof(vf).
TENSOR_OPS_VEC_INLINE void vstream(float* p, vf v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
  _mm256_stream_ps(p, (__m256)v);
#elif defined(TENSOR_OPS_HAVE_STREAM)
  _mm_stream_ps(p, (__m128)v);
#else
  vstore(p, v);
#endif
}

TENSOR_OPS_VEC_INLINE float hsum(vf v) {
  float s = 0;
  for (int j = 0; j < kVW; ++j) s += v[j];
  return s;
}

// How a row function reads and writes its lanes at index i: Full, a whole
// register; Part, the first n lanes (the row's head or tail), the others
// zero on load and left alone on store. keep() sets the unused lanes of a
// result to fill, so they drop out of reductions.
struct Full {
  TENSOR_OPS_VEC_INLINE vf ld(const float* p) const { return vload(p); }
  TENSOR_OPS_VEC_INLINE void st(float* p, vf v) const { vstore(p, v); }
  TENSOR_OPS_VEC_INLINE vf keep(vf v, float) const { return v; }
};
struct Part {
  int n;
  TENSOR_OPS_VEC_INLINE vf ld(const float* p) const {
    vf v = {};
    __builtin_memcpy(&v, p, size_t(n) * 4);
    return v;
  }
  TENSOR_OPS_VEC_INLINE void st(float* p, vf v) const { __builtin_memcpy(p, &v, size_t(n) * 4); }
  TENSOR_OPS_VEC_INLINE vf keep(vf v, float fill) const {
    vf r = splat<vf>(fill);
    for (int j = 0; j < n; ++j) r[j] = v[j];
    return r;
  }
};

// v as it stands, rounded: the compiler may not fuse the product that made
// it into a later add or subtract (FMA contraction). Where a sum of rounded
// products is subtracted from one of them (layer_norm's g - mean(g)), an
// unrounded product leaves its rounding error behind, not 0.
TENSOR_OPS_VEC_INLINE vf rounded(vf v) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(v));
#elif defined(__SSE__)
  __asm__("" : "+x"(v));
#endif
  return v;
}

// K sums at once: f(i, access) returns K registers, summed as vsum sums one
// (fp32 lanes within a block of kBlock elements, double across blocks; two
// accumulators per sum, the row's tail into the second, its unused lanes
// dropped). One pass over a row for several of its reductions.
template <int K, class F>
TENSOR_OPS_VEC_INLINE std::array<double, K> vsums(int64_t n, F f) {
  std::array<double, K> total{};
  for (int64_t c = 0; c < n; c += kBlock) {
    const int64_t e = min64(c + kBlock, n);
    std::array<vf, K> a0{}, a1{};
    int64_t i = c;
    for (; i + 2 * kVW <= e; i += 2 * kVW) {
      const std::array<vf, K> u = f(i, Full{}), v = f(i + kVW, Full{});
      for (int k = 0; k < K; ++k) a0[k] += u[k], a1[k] += v[k];
    }
    for (; i + kVW <= e; i += kVW) {
      const std::array<vf, K> u = f(i, Full{});
      for (int k = 0; k < K; ++k) a0[k] += u[k];
    }
    if (i < e) {
      const Part a{int(e - i)};
      const std::array<vf, K> u = f(i, a);
      for (int k = 0; k < K; ++k) a1[k] += a.keep(u[k], 0.0f);
    }
    for (int k = 0; k < K; ++k) total[k] += double(hsum(a0[k] + a1[k]));
  }
  return total;
}

// Sum of f(i, access) over [0, n): vsums of one.
template <class F>
TENSOR_OPS_VEC_INLINE double vsum(int64_t n, F f) {
  return vsums<1>(n, [&](int64_t i, auto a) { return std::array<vf, 1>{f(i, a)}; })[0];
}

// Max of f(i, access) over [0, n) (-inf when empty). NaN lanes are skipped;
// *nan (when given) is set if there was one.
template <class F>
TENSOR_OPS_VEC_INLINE float vmax(int64_t n, F f, bool* nan = nullptr) {
  vf m0 = splat<vf>(-__builtin_inff()), m1 = m0;
  vu bad = {};
  int64_t i = 0;
  for (; i + 2 * kVW <= n; i += 2 * kVW) {
    const vf a = f(i, Full{}), b = f(i + kVW, Full{});
    m0 = max_t(a, m0);
    m1 = max_t(b, m1);
    if (nan) bad |= (vu)(a != a) | (vu)(b != b);
  }
  for (; i + kVW <= n; i += kVW) {
    const vf a = f(i, Full{});
    m0 = max_t(a, m0);
    if (nan) bad |= (vu)(a != a);
  }
  if (i < n) {
    const Part p{int(n - i)};
    const vf a = p.keep(f(i, p), -__builtin_inff());
    m1 = max_t(a, m1);
    if (nan) bad |= (vu)(a != a);
  }
  m0 = max_t(m1, m0);
  float r = m0[0];
  uint32_t any = bad[0];
  for (int j = 1; j < kVW; ++j) {
    r = m0[j] > r ? m0[j] : r;
    any |= bad[j];
  }
  if (nan) *nan = any != 0;
  return r;
}

// ---- D-typed lanes: 16-bit storage widened to / narrowed from vf in
// registers (no row buffer). ldx/stx address element i of a row of D.

typedef uint16_t vh __attribute__((vector_size(kVW * 2)));

TENSOR_OPS_VEC_INLINE vh hload(const uint16_t* p, Full) {
  vh v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
TENSOR_OPS_VEC_INLINE vh hload(const uint16_t* p, Part a) {
  vh v = {};
  __builtin_memcpy(&v, p, size_t(a.n) * 2);
  return v;
}
TENSOR_OPS_VEC_INLINE void hstore(uint16_t* p, vh v, Full) { __builtin_memcpy(p, &v, sizeof v); }
TENSOR_OPS_VEC_INLINE void hstore(uint16_t* p, vh v, Part a) { __builtin_memcpy(p, &v, size_t(a.n) * 2); }

// bf16 -> fp32 is the 16 bits moved to the top of a 32-bit lane: one
// vpmovzxwd + vpslld (SSE2 has no pmovzxwd: unpacking zeros below each
// value is the same shift in one instruction).
template <DType D>
TENSOR_OPS_VEC_INLINE vf widen(vh h) {
  if constexpr (D == DType::BFloat16) {
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16);
#elif defined(__SSE2__)
    return (vf)_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_cvtsi64_si128(__builtin_bit_cast(long long, h)));
#else
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
  } else {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps((__m128i)h);
#else
    vf r;
    for (int j = 0; j < kVW; ++j) r[j] = half_bits_to_f32(h[j]);
    return r;
#endif
  }
}

// Round to nearest even, NaN kept quiet (as f32_to_bf16_bits / f32_to_half_bits).
// bf16: the rounded value is the top half of u + 0x7fff + (bit 16 of u) (an
// overflow carries into the exponent: inf), a NaN's top half with the quiet
// bit set; both computed on integer lanes (exact under any MXCSR mode, so
// subnormals round like normals), then the top halves packed.
//
// Note [bf16 narrowing by instruction]
// The integer rounding is ~10 instructions per register, 7 of them on the
// two ports (0 and 5) that also run every FMA, so in a compute-bound kernel
// (silu, gelu: exp, erf, reciprocals) it costs time: bf16 silu / gelu on
// [32, 4096] took 1.4x / 1.3x their fp16 time (Xeon, AVX-512, 1 thread).
// AVX512-BF16's vcvtneps2bf16 does the same rounding (RNE, a NaN's top half
// with the quiet bit set) in one instruction, except that it reads a
// subnormal input as zero; the other levels and torch round those like
// normals. So the avx512_bf16 level looks for subnormal lanes (two
// integer tests; vfpclassps reads subnormals as zero under DAZ) and takes
// the instruction when there is none (always, in practice), the
// integer path otherwise: the same bits at every level (test_bf16_rounding,
// all 2^16 patterns and random fp32, subnormals included). Measured, 1 thread
// [32, 4096]: silu 53.4 -> 45 us, gelu 62.8 -> 51-53 us (fp16: 41, 46).
template <DType D>
TENSOR_OPS_VEC_INLINE vh narrow(vf v) {
  if constexpr (D == DType::BFloat16) {
#if defined(__AVX512BF16__)
    // Subnormal lanes: exponent 0, mantissa not (on integer lanes: vfpclassps
    // would read them as zero under DAZ).
    const __m512i bits = (__m512i)v;
    const __mmask16 sub = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)),
                                                      bits, _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(sub == 0, 1)) return (vh)_mm512_cvtneps_pbh((__m512)v);
#endif
#if defined(__AVX512F__)
    const __m512i u = (__m512i)v;
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q),
                              _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return (vh)_mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#elif defined(__AVX2__)
    const __m256i u = (__m256i)v;
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    const __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256 nan = _mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q);
    // Shift + extract + pack: measured faster on Zen 3 than vpshufb + vpermq
    // (2 uops there) or packing two registers at once.
    const __m256i h = _mm256_srli_epi32((__m256i)_mm256_blendv_ps((__m256)r, (__m256)q, nan), 16);
    return (vh)_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
#elif defined(__SSE2__)
    const __m128i u = (__m128i)v;
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    const __m128i r = _mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb);
    const __m128i q = _mm_or_si128(u, _mm_set1_epi32(0x400000));
    const __m128i nan = (__m128i)_mm_cmpunord_ps((__m128)v, (__m128)v);
    // SSE2 packs with signed saturation only: shift arithmetically, so
    // each top half comes back as the int16 it already is.
    const __m128i h = _mm_srai_epi32(_mm_or_si128(_mm_andnot_si128(nan, r), _mm_and_si128(nan, q)), 16);
    return __builtin_bit_cast(vh, _mm_cvtsi128_si64(_mm_packs_epi32(h, h)));
#else
    const vu u = (vu)v;
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu r = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
    return __builtin_convertvector(r, vh);
#endif
  } else {
#if defined(__AVX512F__)
    return (vh)_mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__F16C__)
    return (vh)_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    vh r;
    for (int j = 0; j < kVW; ++j) r[j] = f32_to_half_bits(v[j]);
    return r;
#endif
  }
}

template <DType D, class A>
TENSOR_OPS_VEC_INLINE vf ldx(const void* row, int64_t i, A a) {
  if constexpr (D == DType::Float32) return a.ld(static_cast<const float*>(row) + i);
  else return widen<D>(hload(static_cast<const uint16_t*>(row) + i, a));
}

// Element i of a row of D as stored: fp32 lanes, or a register of D's bits
// (which stx and vmapx store without rounding again).
template <DType D, class A>
TENSOR_OPS_VEC_INLINE auto ldraw(const void* row, int64_t i, A a) {
  if constexpr (D == DType::Float32) return a.ld(static_cast<const float*>(row) + i);
  else return hload(static_cast<const uint16_t*>(row) + i, a);
}

// A 16-bit register of D from v: narrowed from fp32 lanes, or v itself
// when it already holds D's bits (a row copied without a second rounding).
template <DType D, class V>
TENSOR_OPS_VEC_INLINE vh bits_of(V v) {
  if constexpr (std::is_same_v<V, vh>) return v;
  else return narrow<D>(v);
}

// v: fp32 lanes, or (16-bit D) a register of D's bits.
template <DType D, class V, class A>
TENSOR_OPS_VEC_INLINE void stx(void* row, int64_t i, V v, A a) {
  if constexpr (D == DType::Float32) a.st(static_cast<float*>(row) + i, v);
  else hstore(static_cast<uint16_t*>(row) + i, bits_of<D>(v), a);
}

// Streaming store of a whole register of D at element i (aligned for it);
// a plain store where the ISA has no streaming store of that width.
template <DType D, class V>
TENSOR_OPS_VEC_INLINE void streamx(void* row, int64_t i, V v) {
  if constexpr (D == DType::Float32) {
    vstream(static_cast<float*>(row) + i, v);
  } else {
    uint16_t* p = static_cast<uint16_t*>(row) + i;
#if defined(__AVX512F__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), (__m256i)bits_of<D>(v));
#elif defined(__AVX__)
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), (__m128i)bits_of<D>(v));
#else
    hstore(p, bits_of<D>(v), Full{});
#endif
  }
}

// row[i..] = f(i, access) over [0, n) for a row of D, a register at a time,
// written from registers (fp32 lanes narrowed there, or a register of D's
// bits stored as it is; no staging buffer). nt:
// streaming stores, with the body aligned for them (a partial register
// first; the row is aligned to its element size).
template <DType D, class F>
TENSOR_OPS_VEC_INLINE void vmapx(void* row, int64_t n, bool nt, F f) {
  int64_t i = 0;
  if (nt) {
    const int64_t mis = int64_t(reinterpret_cast<uintptr_t>(row) / dtype_size(D)) % kVW;
    if (mis && n > 0) {
      const Part a{int(min64(n, kVW - mis))};
      stx<D>(row, 0, f(int64_t(0), a), a);
      i = a.n;
    }
    for (; i + kVW <= n; i += kVW) streamx<D>(row, i, f(i, Full{}));
  }
  for (; i + kVW <= n; i += kVW) stx<D>(row, i, f(i, Full{}), Full{});
  if (i < n) {
    const Part a{int(n - i)};
    stx<D>(row, i, f(i, a), a);
  }
}

// Row r's first element of a 2-D view.
template <DType D>
TENSOR_OPS_VEC_INLINE char* row_of(const to_tensor& t, int64_t r) {
  return static_cast<char*>(t.data) + r * t.strides[0] * int64_t(dtype_size(D));
}

// Software prefetch of the cache line holding p (the next row, while the
// current one is computed from cache, so memory is never idle).
TENSOR_OPS_VEC_INLINE void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
// The same toward L2 only (prefetcht1): for a row larger than L1, as
// cross-entropy's 128 KiB vocab rows. A line bound for L1 holds one of its
// ~16 fill buffers until it arrives; L2's queue keeps more lines in flight.
// CE forward [4096, 32000] fp32, 1 thread: 52.8 -> 49.3 ms (a plain read of
// the same bytes: 40.4 ms).
TENSOR_OPS_VEC_INLINE void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Note [elementwise prefetch]
// The elementwise ops (activations, gated units, their backward) compute
// ~25-60 instructions per register, and at DRAM sizes their time was about
// the compute time plus the memory time: the hardware prefetcher, which
// stops at each 4 KiB page, did not keep enough lines in flight behind the
// math. So each kBlock block of an input first prefetches its lines from
// 512 bytes in to 512 bytes past its end. Measured, Xeon, [16384, 8192],
// 2 threads, ms without / with (prefetch distance 256 / 512 / 1024 / 2048
// bytes: 512 was best; a prefetchw of the outputs too was not faster):
// silu fp32 45.6 / 30.3-30.6, bf16 40.1 / 25.3-25.7, fp16 28.8 / 21.9-22.8;
// gelu bf16 40.4 / 27.8.
constexpr int64_t kPrefetchAheadBytes = 512;

// Prefetch a block's input: p's elements [0, n) are about to be read, and
// the input runs on to element rest (>= n).
template <DType D>
TENSOR_OPS_VEC_INLINE void prefetch_ahead(const void* p, int64_t n, int64_t rest) {
  constexpr int64_t item = dtype_size(D), line = 64 / item, ahead = kPrefetchAheadBytes / item;
  const char* b = static_cast<const char*>(p);
  for (int64_t i = ahead; i < min64(n + ahead, rest); i += line) prefetch(b + i * item);
}

// A row op's next row (nullptr after the last of its range), prefetched
// toward L2 a line per register of its last pass over the current row, which
// runs from cache: the next row's first pass then reads from L2.
template <DType D>
TENSOR_OPS_VEC_INLINE const char* next_row(const to_tensor& t, int64_t r, int64_t r1) {
  return r + 1 < r1 ? row_of<D>(t, r + 1) : nullptr;
}
template <DType D>
TENSOR_OPS_VEC_INLINE void prefetch_next(const char* next, int64_t i) {
  if (next) prefetch_l2(next + i * int64_t(dtype_size(D)));
}

// A row of D read by several passes as fp32 lanes: fp32 in place; a 16-bit
// row widened once, by its first pass, into buf (a row of scratch, from
// cache), which the later passes read instead of widening it again. Softmax
// writes its e^x into that scratch row anyway: [16384, 8192] bf16 / fp16,
// 2 threads, two A/B runs: 22.8-24.2 -> 22.2-22.9 ms. layer_norm and the
// norm backwards were slower with it (bf16 layer_norm 22-23 -> 25-26 ms,
// rms_norm_backward 29-34 -> 34-55 ms): their extra stores cost more than
// the widening they saved.
template <DType D>
struct RowF32 {
  const void* row;
  float* buf;
  template <class A>
  TENSOR_OPS_VEC_INLINE vf first(int64_t i, A a) const {
    const vf v = ldx<D>(row, i, a);
    if constexpr (D != DType::Float32) a.st(buf + i, v);
    return v;
  }
  template <class A>
  TENSOR_OPS_VEC_INLINE vf again(int64_t i, A a) const {
    if constexpr (D == DType::Float32) return a.ld(static_cast<const float*>(row) + i);
    else return a.ld(buf + i);
  }
};

// Storage <-> fp32 for n contiguous elements, a register at a time (the
// 16-bit types widened / narrowed in lanes, the tail as a partial register).
template <DType D>
inline void load_f32(const void* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVW <= n; i += kVW) vstore(dst + i, ldx<D>(src, i, Full{}));
  if (i < n) {
    const Part a{int(n - i)};
    a.st(dst + i, ldx<D>(src, i, a));
  }
}

template <DType D>
inline void store_f32(const float* src, void* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVW <= n; i += kVW) stx<D>(dst, i, vload(src + i), Full{});
  if (i < n) {
    const Part a{int(n - i)};
    stx<D>(dst, i, a.ld(src + i), a);
  }
}

// Two passes over each row (the second from cache); y written from
// registers, 16-bit data widened and narrowed in them.
template <DType D>
void rms_norm_t(const void* x, int64_t xs, const float* w, void* y, int64_t ys, int64_t r0, int64_t r1,
                int64_t cols, float eps, bool nt) {
  constexpr int64_t item = dtype_size(D);
  for (int64_t r = r0; r < r1; ++r) {
    const void* xr = static_cast<const char*>(x) + r * xs * item;
    void* yr = static_cast<char*>(y) + r * ys * item;
    const double total = vsum(cols, [&](int64_t i, auto a) {
      const vf t = ldx<D>(xr, i, a);
      return t * t;
    });
    const float scale = float(1.0 / __builtin_sqrt(total / double(cols) + double(eps)));
    const char* nx = r + 1 < r1 ? static_cast<const char*>(x) + (r + 1) * xs * item : nullptr;
    vmapx<D>(yr, cols, nt, [&](int64_t i, auto a) {
      prefetch_next<D>(nx, i);
      return ldx<D>(xr, i, a) * scale * a.ld(w + i);
    });
  }
}

// y = f(x) elementwise over a contiguous span; nt: streaming stores. The
// input prefetched a block ahead (Note [elementwise prefetch]).
template <DType D, class F>
inline void map_span(const void* x, void* y, int64_t n, F f, bool nt) {
  constexpr int64_t item = dtype_size(D);
  for (int64_t s = 0; s < n; s += kBlock) {
    const int64_t e = min64(s + kBlock, n);
    const char* xs = static_cast<const char*>(x) + s * item;
    prefetch_ahead<D>(xs, e - s, n - s);
    vmapx<D>(static_cast<char*>(y) + s * item, e - s, nt, [&](int64_t i, auto a) { return f(ldx<D>(xs, i, a)); });
  }
}

struct Silu {
  template <class T>
  TENSOR_OPS_VEC_INLINE T operator()(T v) const {
    return silu_t(v);
  }
};
struct GeluErf {
  template <class T>
  TENSOR_OPS_VEC_INLINE T operator()(T v) const {
    return gelu_erf_t(v);
  }
};
struct GeluTanh {
  template <class T>
  TENSOR_OPS_VEC_INLINE T operator()(T v) const {
    return gelu_tanh_t(v);
  }
};

template <class F>
void map_dispatch(DType dt, const void* x, void* y, int64_t n, F f, bool nt) {
  switch (dt) {
    case DType::Float32: map_span<DType::Float32>(x, y, n, f, nt); break;
    case DType::Float16: map_span<DType::Float16>(x, y, n, f, nt); break;
    case DType::BFloat16: map_span<DType::BFloat16>(x, y, n, f, nt); break;
    default: break;
  }
}

void rms_norm(DType dt, const void* x, int64_t xs, const float* w, void* y, int64_t ys, int64_t r0, int64_t r1,
              int64_t cols, float eps, bool nt) {
  switch (dt) {
    case DType::Float32: rms_norm_t<DType::Float32>(x, xs, w, y, ys, r0, r1, cols, eps, nt); break;
    case DType::Float16: rms_norm_t<DType::Float16>(x, xs, w, y, ys, r0, r1, cols, eps, nt); break;
    case DType::BFloat16: rms_norm_t<DType::BFloat16>(x, xs, w, y, ys, r0, r1, cols, eps, nt); break;
    default: break;
  }
  if (nt) stream_fence();
}

void silu(DType dt, const void* x, void* y, int64_t n, bool nt) {
  map_dispatch(dt, x, y, n, Silu{}, nt);
  if (nt) stream_fence();
}

void gelu(DType dt, const void* x, void* y, int64_t n, int64_t tanh_mode, bool nt) {
  if (tanh_mode)
    map_dispatch(dt, x, y, n, GeluTanh{}, nt);
  else
    map_dispatch(dt, x, y, n, GeluErf{}, nt);
  if (nt) stream_fence();
}

void to_float(DType dt, const void* src, float* dst, int64_t n) {
  switch (dt) {
    case DType::Float32: load_f32<DType::Float32>(src, dst, n); break;
    case DType::Float16: load_f32<DType::Float16>(src, dst, n); break;
    case DType::BFloat16: load_f32<DType::BFloat16>(src, dst, n); break;
    default: break;
  }
}

#include "kernels_llm.h"

}  // namespace
}  // namespace TENSOR_OPS_ISA_NS

#define TENSOR_OPS_CAT2(a, b) a##b
#define TENSOR_OPS_CAT(a, b) TENSOR_OPS_CAT2(a, b)
static IsaKernels make_kernels() {
  namespace k = TENSOR_OPS_ISA_NS;
  IsaKernels t{};
  t.name = TENSOR_OPS_ISA_NAME;
  t.rms_norm = k::rms_norm;
  t.silu = k::silu;
  t.gelu = k::gelu;
  t.to_float = k::to_float;
  t.from_float = k::from_float;
  t.ops[int(OpId::layer_norm)] = k::layer_norm;
  t.ops[int(OpId::rms_norm_backward)] = k::rms_norm_backward;
  t.ops[int(OpId::layer_norm_backward)] = k::layer_norm_backward;
  t.ops[int(OpId::add_rms_norm)] = k::add_rms_norm;
  t.ops[int(OpId::softmax)] = k::softmax;
  t.ops[int(OpId::softmax_backward)] = k::softmax_backward;
  t.ops[int(OpId::activation_backward)] = k::activation_backward;
  t.ops[int(OpId::glu)] = k::glu;
  t.ops[int(OpId::glu_backward)] = k::glu_backward;
  t.ops[int(OpId::rope)] = k::rope;
  t.ops[int(OpId::attention)] = k::attention;
  t.ops[int(OpId::attention_backward)] = k::attention_backward;
  t.ops[int(OpId::cross_entropy)] = k::cross_entropy;
  t.ops[int(OpId::linear)] = k::linear;
  return t;
}
// A function, not a global: a global's initialiser would run (with this
// level's instructions) when the library loads, on CPUs that lack them.
const IsaKernels& TENSOR_OPS_CAT(kernels_, TENSOR_OPS_ISA_NS)() {
  static const IsaKernels table = make_kernels();
  return table;
}

}  // namespace tensor_ops::cpu
