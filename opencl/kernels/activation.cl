// Elementwise activations with the CPU backend's formulas
// (cpp/cpu/vec_math.h) on float8: each work-item takes 8 consecutive
// elements (the last one fewer). One kernel pair per activation rather than
// a mode argument, so no work-item evaluates another activation's branch.

// erfc via Numerical Recipes' erfcc (fractional error < 1.2e-7 everywhere),
// as on the CPU; PoCL's builtin erfc is scalar library code, ~30x slower.
inline float8 erfc8(float8 t) {
  const float8 z = fabs(t);
  const float8 u = 1.0f / (1.0f + 0.5f * z);
  float8 p = 0.17087277f;
  p = p * u - 0.82215223f;
  p = p * u + 1.48851587f;
  p = p * u - 1.13520398f;
  p = p * u + 0.27886807f;
  p = p * u - 0.18628806f;
  p = p * u + 0.09678418f;
  p = p * u + 0.37409196f;
  p = p * u + 1.00002368f;
  p = p * u - 1.26551223f;
  const float8 r = u * exp(p - z * z);
  return select(r, 2.0f - r, t < 0.0f);
}

inline float8 silu8(float8 x) { return x / (1.0f + exp(-x)); }

inline float8 gelu_erf8(float8 x) { return 0.5f * x * erfc8(x * -0.70710678118654752f); }

// 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation for small u.
inline float8 gelu_tanh8(float8 x) {
  const float8 u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return x / (1.0f + exp(-2.0f * u));
}

// Elements [i, i + n) of x to y, through FN in eights; a short last piece
// goes element by element (FN of a splat, lane 0 kept).
#define TO_ACTIVATION_SPAN(FN, x, xi, y, yi, n)                                 \
  if ((n) >= 8) {                                                               \
    store8_f32(y, yi, FN(load8_f32(x, xi)));                                    \
  } else {                                                                      \
    for (ulong j = 0; j < (n); ++j) store_f32(y, (yi) + j, FN((float8)(load_f32(x, (xi) + j))).s0); \
  }

// NAME_flat: both tensors contiguous, one range of n elements.
// NAME_rows: rows with their own strides; dimension 0 walks a row's chunks.
#define TO_ACTIVATION_KERNELS(NAME, FN)                                                                    \
  __kernel void NAME##_flat(const __global T* x, ulong x_off, __global T* y, ulong y_off, ulong n) {      \
    const ulong i = 8 * get_global_id(0);                                                                 \
    if (i < n) {                                                                                          \
      const ulong m = min(n - i, (ulong)8);                                                               \
      TO_ACTIVATION_SPAN(FN, x, x_off + i, y, y_off + i, m)                                               \
    }                                                                                                     \
  }                                                                                                       \
  __kernel void NAME##_rows(const __global T* x, ulong x_off, ulong x_stride, __global T* y, ulong y_off, \
                            ulong y_stride, ulong cols) {                                                 \
    const ulong c = 8 * get_global_id(0);                                                                 \
    const ulong r = get_global_id(1);                                                                     \
    if (c < cols) {                                                                                       \
      const ulong m = min(cols - c, (ulong)8);                                                            \
      TO_ACTIVATION_SPAN(FN, x, x_off + r * x_stride + c, y, y_off + r * y_stride + c, m)                 \
    }                                                                                                     \
  }

TO_ACTIVATION_KERNELS(silu, silu8)
TO_ACTIVATION_KERNELS(gelu_erf, gelu_erf8)
TO_ACTIVATION_KERNELS(gelu_tanh, gelu_tanh8)
