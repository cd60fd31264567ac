// Scalar math written so the compiler vectorises the loops that call it.
// Included inside each ISA namespace by kernels_impl.h: no includes here and
// nothing shared between ISA translation units (so no out-of-line copy built
// for AVX-512 can be picked by baseline code).
//
// Every function here is force-inlined: a loop calling an out-of-line copy
// cannot vectorise. GCC had outlined exp_f32 and erfc_f32 (called from many
// kernels), which made gelu (erf) and softmax run scalar, a call per element.
#ifndef TENSOR_OPS_VEC_INLINE
#define TENSOR_OPS_VEC_INLINE inline __attribute__((always_inline))
#endif

TENSOR_OPS_VEC_INLINE float bits_to_f32(uint32_t u) { return __builtin_bit_cast(float, u); }
TENSOR_OPS_VEC_INLINE uint32_t f32_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

// One SIMD register of fp32 lanes for this ISA level (GCC/Clang vector
// extensions: the same source is 4, 8 or 16 lanes wide). The math below is
// written once as templates over T = float or vf, so the tail of a row goes
// through the same instructions as its body (bit-identical lanes).
#if defined(__AVX512F__)
constexpr int kVW = 16;
#elif defined(__AVX__)
constexpr int kVW = 8;
#else
constexpr int kVW = 4;
#endif
typedef float vf __attribute__((vector_size(kVW * 4)));
typedef uint32_t vu __attribute__((vector_size(kVW * 4)));

TENSOR_OPS_VEC_INLINE uint32_t as_bits(float f) { return f32_to_bits(f); }
TENSOR_OPS_VEC_INLINE float from_bits(uint32_t u) { return bits_to_f32(u); }
TENSOR_OPS_VEC_INLINE vu as_bits(vf f) { return (vu)f; }
TENSOR_OPS_VEC_INLINE vf from_bits(vu u) { return (vf)u; }

// c broadcast to T (a scalar stays a scalar).
template <class T>
TENSOR_OPS_VEC_INLINE T splat(float c) {
  return T{} + c;
}

// max(a, b) and min(a, b) as one instruction (maxps/minps: b when either is
// NaN; GCC turns a vector `a > b ? a : b` into compare + blend instead).
TENSOR_OPS_VEC_INLINE float max_t(float a, float b) { return a > b ? a : b; }
TENSOR_OPS_VEC_INLINE float min_t(float a, float b) { return a < b ? a : b; }
TENSOR_OPS_VEC_INLINE vf max_t(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#elif defined(__SSE__)
  return (vf)_mm_max_ps((__m128)a, (__m128)b);
#else
  return a > b ? a : b;
#endif
}
TENSOR_OPS_VEC_INLINE vf min_t(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_min_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vf)_mm256_min_ps((__m256)a, (__m256)b);
#elif defined(__SSE__)
  return (vf)_mm_min_ps((__m128)a, (__m128)b);
#else
  return a < b ? a : b;
#endif
}

// 1 / d. On lanes: the reciprocal estimate and one Newton step (~2 ulp),
// a third of a divide's cost on the FP pipes the activations are bound by.
TENSOR_OPS_VEC_INLINE float recip_t(float d) { return 1.0f / d; }
TENSOR_OPS_VEC_INLINE vf recip_t(vf d) {
#if defined(__AVX512F__)
  const vf r = (vf)_mm512_rcp14_ps((__m512)d);
#elif defined(__AVX__)
  const vf r = (vf)_mm256_rcp_ps((__m256)d);
#elif defined(__SSE__)
  const vf r = (vf)_mm_rcp_ps((__m128)d);
#else
  return 1.0f / d;
#endif
#if defined(__SSE__)
  return r * (2.0f - d * r);
#endif
}

template <class T>
TENSOR_OPS_VEC_INLINE T abs_t(T x) {
  return from_bits(as_bits(x) & 0x7fffffffu);
}

// e^r for |r| <= ln2/2: 1 + r + r^2 q(r) with q of degree 3, fitted for
// relative error (1.1e-7 in exact arithmetic; Cephes' degree-5 q is more
// than float needs), by Estrin's scheme: the activations are bound by this
// chain's latency.
template <class T>
TENSOR_OPS_VEC_INLINE T exp_poly_t(T r) {
  const T r2 = r * r;
  const T q = (1.666711122e-01f * r + 4.999923110e-01f) + (8.312801830e-03f * r + 4.189020768e-02f) * r2;
  return q * r2 + (r + 1.0f);
}

// e^x, relative error < 2.2e-7 on [-87.3, 88.3] (Cody-Waite reduction as
// Cephes expf, exp_poly_t); inputs outside are clamped, NaN stays NaN. The
// integer exponent is read from the bits of the rounding sum rather than by
// a float-to-int conversion (undefined for NaN), and the whole body is
// select-only, so it runs on vf lanes as well as scalars.
template <class T>
TENSOR_OPS_VEC_INLINE T exp_t(T x) {
  // max then min, each in the operand order that hands a NaN x through.
  const T xc = min_t(splat<T>(88.3f), max_t(splat<T>(-87.3f), x));
  const T t = xc * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds to an integer
  const T n = t - 12582912.0f;
  T r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const auto ni = as_bits(t) - 0x4B400000u;  // n, two's complement in the low bits
  return exp_poly_t(r) * from_bits((ni + 127u) << 23);
}

// e^x for x <= 0 (a rounding error above is fine) and not NaN: softmax's
// x - max, whose caller sends rows with a NaN or an infinite max elsewhere.
// Two operations fewer than exp_t: no upper clamp; a one-step reduction
// (ln2 rounded to float adds at most 2.4e-7 relative error, at n = -125);
// and 2^n as exp_nonpos_sum_t applies it. Below -86.5 the result is exactly 0 (torch's
// e^x is 0 or a subnormal under 1.6e-38 there): a masked (-inf) column gets
// probability 0, not e^-86.5 = 2.7e-38.
// exp_nonpos_t without its select: e^-86.5 = 2.7e-38 below -86.5, not 0.
// Only for a sum that holds e^0 = 1 (softmax's and cross-entropy's
// denominators), where that is nothing; two instructions fewer. 2^n applied
// by adding n to the exponent bits, which the clamp at -86.5 keeps a normal
// number (vscalefps on AVX-512: one instruction instead of two, the same
// bits).
template <class T>
TENSOR_OPS_VEC_INLINE T exp_nonpos_sum_t(T x) {
  const T xc = max_t(splat<T>(-86.5f), x);
  const T t = xc * 1.44269504088896341f + 12582912.0f;
  const T n = t - 12582912.0f;
  const T r = xc - n * 0.693147182464599609375f;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, vf>) return (vf)_mm512_scalef_ps((__m512)exp_poly_t(r), (__m512)n);
#endif
  // (bits(t) << 23) is n << 23: 1.5 * 2^23's low 9 bits are zero.
  return from_bits(as_bits(exp_poly_t(r)) + (as_bits(t) << 23));
}

template <class T>
TENSOR_OPS_VEC_INLINE T exp_nonpos_t(T x) {
  return x < splat<T>(-86.5f) ? splat<T>(0.0f) : exp_nonpos_sum_t(x);
}

// e^x as exp_t, but 0 below exp_t's range (exp_t clamps to e^-87.3 there),
// so that a product with an infinite or huge factor is torch's NaN or 0.
template <class T>
TENSOR_OPS_VEC_INLINE T exp_flush_t(T x) {
  return x < splat<T>(-87.3f) ? splat<T>(0.0f) : exp_t(x);
}

// sigmoid(v), exactly 0 where it underflows (v < -87.3): the clamped exp
// left 1/e^88.3 there, which the lanes' reciprocal estimate turns into 0 and
// the scalar tail's divide into 4.7e-39, so x * sigmoid(x) was -inf (tail)
// or NaN (lanes) at x = -inf, and -1.4 instead of 0 at x = -3e38.
template <class T>
TENSOR_OPS_VEC_INLINE T sigmoid_t(T v) {
  return v < splat<T>(-87.3f) ? splat<T>(0.0f) : recip_t(1.0f + exp_t(-v));
}

// x * sigmoid(x): torch's specials follow (inf at inf, NaN at -inf, 0 below).
template <class T>
TENSOR_OPS_VEC_INLINE T silu_t(T x) {
  return x * sigmoid_t(x);
}

// erfc via Numerical Recipes' erfcc (fractional error < 1.2e-7 everywhere),
// so gelu keeps its relative accuracy in the negative tail too.
// |t| is clamped at 10 (erfc(10) = 2e-45 is 0 in float; exp_flush_t makes it
// exactly 0), which keeps u finite at t = +-inf: erfc(inf) = 0, erfc(-inf) = 2.
template <class T>
TENSOR_OPS_VEC_INLINE T erfc_t(T t) {
  const T z = min_t(splat<T>(10.0f), abs_t(t));  // this operand order hands a NaN through
  const T u = recip_t(1.0f + 0.5f * z);
  // The degree-9 polynomial by Estrin's scheme: 4 dependent FMA levels
  // instead of Horner's 9 (the loop is latency-bound, not port-bound).
  const T u2 = u * u, u4 = u2 * u2, u8 = u4 * u4;
  const T a0 = 1.00002368f * u - 1.26551223f, a1 = 0.09678418f * u + 0.37409196f;
  const T a2 = 0.27886807f * u - 0.18628806f, a3 = 1.48851587f * u - 1.13520398f;
  const T a4 = 0.17087277f * u - 0.82215223f;
  const T p = (a0 + a1 * u2) + (a2 + a3 * u2) * u4 + a4 * u8;
  const T ans = u * exp_flush_t(p - z * z);
  // erfc(-z) = 2 - erfc(z), as a select so the lanes stay branch-free
  return t < splat<T>(0.0f) ? 2.0f - ans : ans;
}

// erf(z) as z P(z^2) / Q(z^2) on z clamped to [-4, 4] (erf(4) is 1 in
// float): the rational approximation Eigen and XLA use for float, no exp and
// no table; absolute error < 4.3e-7 with recip_t's divide.
template <class T>
TENSOR_OPS_VEC_INLINE T erf_rational_t(T z) {
  const T x = min_t(splat<T>(4.0f), max_t(splat<T>(-4.0f), z));  // operand order hands a NaN through
  const T x2 = x * x;
  T p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  T q = x2 * -1.45660718464996e-05f - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return x * p * recip_t(q);
}

// Whether any lane of v is greater than b. AVX-512 compares into a mask
// register and tests it (a vector comparison's result would be moved to a
// vector and back to a mask: two more port-5 instructions per register).
TENSOR_OPS_VEC_INLINE bool any_greater(float v, float b) { return v > b; }
template <class T>
TENSOR_OPS_VEC_INLINE bool any_greater(T v, float b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(b), _CMP_GT_OQ) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_ps((__m256)(v > splat<T>(b))) != 0;
#elif defined(__SSE__)
  return _mm_movemask_ps((__m128)(v > splat<T>(b))) != 0;
#else
  for (int j = 0; j < kVW; ++j)
    if (v[j] > b) return true;
  return false;
#endif
}

// gelu(x) = x Phi(x) = 0.5 x erfc(-x / sqrt2). For z = -x / sqrt2 <= 2 (x >=
// -2.83) erfc = 1 - erf_rational: ~20 operations instead of erfc_t's ~45
// (a reciprocal, a degree-9 polynomial and an exp); relative error < 7.1e-5
// at worst (near x = -2.83, where torch's 1 + erf has up to ~3e-5), < 7e-6
// for x >= -2.1, < 6e-7 for x >= -1. Past it erfc_t keeps the negative
// tail's relative accuracy (1 - erf cancels there). Each lane takes its own
// value by a select, so a result never depends on its neighbours; erfc_t runs
// only for vectors that have such a lane: ~2% of vectors for N(0, 1) inputs,
// ~50% for N(0, 2^2) (then about as fast as before), more for wider inputs
// (up to ~1.4x slower when every vector has one).
// Phi(x) itself is gelu_cdf_t, which gelu's gradient Phi(x) + x phi(x) uses
// too (absolute error < 2.2e-7 on the fast side).
template <class T>
TENSOR_OPS_VEC_INLINE T gelu_cdf_t(T x) {
  const T z = x * -0.70710678118654752f;
  const T fast = 0.5f * (1.0f - erf_rational_t(z));
  if (!any_greater(z, 2.0f)) return fast;
  const T tail = 0.5f * erfc_t(z);
  return z > splat<T>(2.0f) ? tail : fast;
}

// x Phi(x): the same bits as 0.5 x (1 - erf) while 0.5 Phi is a normal
// number (a factor 0.5 is exact there; 116 of 500k gelu outputs, all under
// 1e-37, moved by an ulp or two).
template <class T>
TENSOR_OPS_VEC_INLINE T gelu_erf_t(T x) {
  return x * gelu_cdf_t(x);
}

// 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation for small u.
template <class T>
TENSOR_OPS_VEC_INLINE T gelu_tanh_t(T x) {
  const T u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return x * sigmoid_t(2.0f * u);
}

TENSOR_OPS_VEC_INLINE float exp_f32(float x) { return exp_t(x); }
TENSOR_OPS_VEC_INLINE float silu_f32(float x) { return silu_t(x); }
TENSOR_OPS_VEC_INLINE float gelu_erf_f32(float x) { return gelu_erf_t(x); }
TENSOR_OPS_VEC_INLINE float gelu_tanh_f32(float x) { return gelu_tanh_t(x); }

TENSOR_OPS_VEC_INLINE float bf16_bits_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

TENSOR_OPS_VEC_INLINE uint16_t f32_to_bf16_bits(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

TENSOR_OPS_VEC_INLINE float half_bits_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Normal: rebias the exponent; denormal: mant * 2^-24 (exact, and immune
  // to flush-to-zero modes); inf/NaN last.
  float v = bits_to_f32((em << 13) + 0x38000000u);
  v = em < 0x400u ? float(em) * 5.9604644775390625e-08f : v;
  v = em >= 0x7c00u ? bits_to_f32(0x7f800000u | (em << 13)) : v;
  return bits_to_f32(f32_to_bits(v) | sign);
}

TENSOR_OPS_VEC_INLINE uint16_t f32_to_half_bits(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint32_t out;
  if (a > 0x7f800000u) {
    out = 0x7e00u | ((a >> 13) & 0x3ffu);
  } else if (a >= 0x477ff000u) {
    out = 0x7c00u;
  } else if (a < 0x38800000u) {
    out = f32_to_bits(bits_to_f32(a) + 0.5f) - 0x3f000000u;
  } else {
    out = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  }
  return uint16_t(sign | out);
}
