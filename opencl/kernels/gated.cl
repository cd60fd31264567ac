// Activation backward and the gated units (glu, glu_backward), elementwise
// on float8 like activation.cl (whose activations they reuse). One kernel
// per (activation, layout): NAME_flat when every tensor is contiguous,
// NAME_rows with per-tensor row strides (dimension 0 walks a row's chunks,
// dimension 1 the rows). Each element is read and written by one
// work-item, so an output may be the input it replaces (dx = dy, out =
// gate or up).

inline float8 sigmoid8(float8 x) { return 1.0f / (1.0f + exp(-x)); }

// d act / dx, as cpp/cpu/kernels_llm.h act_grad_f32.
inline float8 silu_grad8(float8 x) {
  const float8 s = sigmoid8(x);
  return s * (1.0f + x * (1.0f - s));
}
inline float8 gelu_erf_grad8(float8 x) {
  return 0.5f * erfc8(x * -0.70710678118654752f) + x * 0.39894228040143268f * exp(-0.5f * x * x);
}
inline float8 gelu_tanh_grad8(float8 x) {
  const float k = 0.79788456080286536f;
  const float8 s = sigmoid8(2.0f * k * (x + 0.044715f * x * x * x));
  return s + x * s * (1.0f - s) * 2.0f * k * (1.0f + 3.0f * 0.044715f * (x * x));
}

// The first index of element (r, c) of a tensor given (off, stride).
#define TO_AT(off, stride) ((off) + r * (stride) + c)

// dx = dy * act'(x)
#define TO_ACT_BWD_BODY(GRAD, a, b, o)                                                         \
  store8n(dx, o, load8n(dy, a, n, 0.0f) * GRAD(load8n(x, b, n, 0.0f)), n);
// y = act(gate) * up
#define TO_GLU_BODY(ACT, a, b, o) store8n(y, o, ACT(load8n(g, a, n, 0.0f)) * load8n(u, b, n, 0.0f), n);

#define TO_GATED_KERNELS(NAME, ACT, GRAD)                                                                        \
  __kernel void act_bwd_##NAME##_flat(const __global T* dy, ulong dy_off, const __global T* x, ulong x_off,     \
                                      __global T* dx, ulong dx_off, ulong total) {                              \
    const ulong i = 8 * get_global_id(0);                                                                       \
    if (i >= total) return;                                                                                     \
    const ulong n = min(total - i, (ulong)8);                                                                   \
    TO_ACT_BWD_BODY(GRAD, dy_off + i, x_off + i, dx_off + i)                                                    \
  }                                                                                                             \
  __kernel void act_bwd_##NAME##_rows(const __global T* dy, ulong dy_off, ulong dy_st, const __global T* x,     \
                                      ulong x_off, ulong x_st, __global T* dx, ulong dx_off, ulong dx_st,       \
                                      ulong cols) {                                                             \
    const ulong c = 8 * get_global_id(0), r = get_global_id(1);                                                 \
    if (c >= cols) return;                                                                                      \
    const ulong n = min(cols - c, (ulong)8);                                                                    \
    TO_ACT_BWD_BODY(GRAD, TO_AT(dy_off, dy_st), TO_AT(x_off, x_st), TO_AT(dx_off, dx_st))                       \
  }                                                                                                             \
  __kernel void glu_##NAME##_flat(const __global T* g, ulong g_off, const __global T* u, ulong u_off,           \
                                  __global T* y, ulong y_off, ulong total) {                                    \
    const ulong i = 8 * get_global_id(0);                                                                       \
    if (i >= total) return;                                                                                     \
    const ulong n = min(total - i, (ulong)8);                                                                   \
    TO_GLU_BODY(ACT, g_off + i, u_off + i, y_off + i)                                                           \
  }                                                                                                             \
  __kernel void glu_##NAME##_rows(const __global T* g, ulong g_off, ulong g_st, const __global T* u,            \
                                  ulong u_off, ulong u_st, __global T* y, ulong y_off, ulong y_st, ulong cols) { \
    const ulong c = 8 * get_global_id(0), r = get_global_id(1);                                                 \
    if (c >= cols) return;                                                                                      \
    const ulong n = min(cols - c, (ulong)8);                                                                    \
    TO_GLU_BODY(ACT, TO_AT(g_off, g_st), TO_AT(u_off, u_st), TO_AT(y_off, y_st))                                \
  }                                                                                                             \
  /* dgate = dy * up * act'(gate), dup = dy * act(gate); rows of every tensor by its stride (flat: r = 0, */    \
  /* the strides unused). */                                                                                    \
  __kernel void glu_bwd_##NAME(const __global T* dy, ulong dy_off, ulong dy_st, const __global T* g,            \
                               ulong g_off, ulong g_st, const __global T* u, ulong u_off, ulong u_st,           \
                               __global T* dg, ulong dg_off, ulong dg_st, __global T* du, ulong du_off,         \
                               ulong du_st, ulong cols) {                                                       \
    const ulong c = 8 * get_global_id(0), r = get_global_id(1);                                                 \
    if (c >= cols) return;                                                                                      \
    const ulong n = min(cols - c, (ulong)8);                                                                    \
    const float8 d = load8n(dy, TO_AT(dy_off, dy_st), n, 0.0f), gv = load8n(g, TO_AT(g_off, g_st), n, 0.0f);    \
    const float8 uv = load8n(u, TO_AT(u_off, u_st), n, 0.0f);                                                   \
    store8n(dg, TO_AT(dg_off, dg_st), d * uv * GRAD(gv), n);                                                    \
    store8n(du, TO_AT(du_off, du_st), d * ACT(gv), n);                                                          \
  }

TO_GATED_KERNELS(silu, silu8, silu_grad8)
TO_GATED_KERNELS(gelu_erf, gelu_erf8, gelu_erf_grad8)
TO_GATED_KERNELS(gelu_tanh, gelu_tanh8, gelu_tanh_grad8)
