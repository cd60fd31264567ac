// Softmax / log-softmax (scaled, causal), its backward, and cross-entropy:
// a work-group per row (reduce.cl), fp32, the CPU backend's semantics.

// y = softmax(scale * x) over the first `valid` columns of the row, 0 (log:
// -inf) past them; causal 1: valid = clamp(row % lq + cols - lq + 1, 0, cols)
// (bottom-right aligned), 2: clamp(row % lq + 1, 0, cols) (top-left). A fully masked row is all 0 (log: -inf). The last
// pass reads x before writing y at the same place: y may be x.
__kernel void softmax(const __global T* x, ulong x_off, ulong x_stride, __global T* y, ulong y_off, ulong y_stride,
                      ulong cols, float scale, int causal, int log_out, ulong lq, __local float* red) {
  // x * scale rounded as the max was taken, never fused into the "- m": a
  // fused difference is the exact product's excess over the rounded max, up
  // to half an ulp of m above 0, which exp overflows once |scale x| passes
  // ~2^31 (a row of 1e10 at scale 0.7 gave inf).
#pragma OPENCL FP_CONTRACT OFF
  const ulong row = get_group_id(0);
  const ulong xr = x_off + row * x_stride, yr = y_off + row * y_stride;
  ulong valid = cols;
  if (causal)
    valid = (ulong)clamp((long)(row % lq) + (causal == 2 ? 0L : (long)cols - (long)lq) + 1, 0L, (long)cols);
  const float ninf = -INFINITY;
  float8 mx = ninf;
  // padding lanes -inf after the scale (-inf times a negative scale is +inf: every row was NaN)
  TO_ROW_CHUNKS(valid) mx = fmax(mx, select((float8)ninf, load8n(x, xr + c, n, 0.0f) * scale, lanes_below(n)));
  const float m = group_max(hmax8(mx), red);
  float8 acc = 0.0f;
  TO_ROW_CHUNKS(valid) acc += select((float8)0.0f, exp(load8n(x, xr + c, n, 0.0f) * scale - m), lanes_below(n));
  const float sum = group_sum(hsum8(acc), red);
  // (v - m) - log(sum), not v - (m + log(sum)): exact where m is large.
  const float log_sum = log(sum), inv = 1.0f / sum;
  TO_ROW_CHUNKS(cols) {
    const float8 v = load8n(x, xr + c, n, 0.0f) * scale;
    const int8 in = lanes_below((long)valid - (long)c);
    const float8 out = log_out ? select((float8)ninf, (v - m) - log_sum, in) : select((float8)0.0f, exp(v - m) * inv, in);
    store8n(y, yr + c, out, n);
  }
}

// dx = scale * y * (dy - sum(dy * y)); log: dx = scale * (dy - exp(y) * sum(dy)).
// dx may be y (each element read, then written, by one work-item).
__kernel void softmax_backward(const __global T* dy, ulong dy_off, ulong dy_stride, const __global T* y,
                               ulong y_off, ulong y_stride, __global T* dx, ulong dx_off, ulong dx_stride, ulong cols,
                               float scale, int log_in, __local float* red) {
  const ulong row = get_group_id(0);
  const ulong gr = dy_off + row * dy_stride, yr = y_off + row * y_stride, dr = dx_off + row * dx_stride;
  float8 acc = 0.0f;
  TO_ROW_CHUNKS(cols) {
    const float8 g = load8n(dy, gr + c, n, 0.0f);
    acc += log_in ? g : g * load8n(y, yr + c, n, 0.0f);
  }
  const float s = group_sum(hsum8(acc), red);
  TO_ROW_CHUNKS(cols) {
    const float8 g = load8n(dy, gr + c, n, 0.0f), p = load8n(y, yr + c, n, 0.0f);
    store8n(dx, dr + c, log_in ? scale * (g - exp(p) * s) : scale * p * (g - s), n);
  }
}

// With z = cap * tanh(x / cap) (cap > 0; else z = x) and lse = logsumexp(z_r):
// loss[r] = (1 - eps) (lse - z_r[t]) + eps (lse - mean(z_r)) + zl lse^2 (the
// first term as log(sum) + (max - z[t]): no cancellation for large logits);
// dlogits (has_grad) = grad_scale * (softmax(z_r) (1 + 2 zl lse) - eps / C -
// (1 - eps) onehot(t)) * dz/dx. Rows with t == ignore_index: loss 0, grad 0.
// A target outside [0, C) sets *bad = 2 (the host reports it) and the row is
// left alone. dl may be lg (in place): z[t] is read before the first barrier
// and each element is read, then written, by one work-item.
float8 ce_z(float8 x, float cap) { return cap > 0.0f ? cap * tanh(x / cap) : x; }

__kernel void cross_entropy(const __global T* lg, ulong lg_off, const __global int* tg, ulong tg_off, int tg64,
                            __global float* loss, ulong loss_off, __global T* dl, ulong dl_off, int has_grad,
                            ulong C, long ignore, float gscale, __global int* bad, __local float* red, float eps,
                            float zl, float cap) {
  const ulong row = get_group_id(0);
  const long t = index_at(tg, tg64, tg_off + row);
  const ulong lr = lg_off + row * C, dr = dl_off + row * C;
  if (t == ignore) {
    if (get_local_id(0) == 0) loss[loss_off + row] = 0.0f;
    if (has_grad) TO_ROW_CHUNKS(C) store8n(dl, dr + c, (float8)0.0f, n);
    return;
  }
  if (t < 0 || t >= (long)C) {
    if (get_local_id(0) == 0) *bad = 2;
    return;
  }
  const float zt = ce_z((float8)load_f32(lg, lr + (ulong)t), cap).s0;
  const float ninf = -INFINITY;
  float8 mx = ninf;
  TO_ROW_CHUNKS(C) mx = fmax(mx, ce_z(load8n(lg, lr + c, n, ninf), cap));
  const float m = group_max(hmax8(mx), red);
  float8 acc = 0.0f, zsum = 0.0f;
  TO_ROW_CHUNKS(C) {
    const float8 z = ce_z(load8n(lg, lr + c, n, 0.0f), cap);
    acc += select((float8)0.0f, exp(z - m), lanes_below(n));
    zsum += select((float8)0.0f, z, lanes_below(n));
  }
  const float sum = group_sum(hsum8(acc), red);
  const float mean = eps != 0.0f ? group_sum(hsum8(zsum), red) / (float)C : 0.0f;
  const float lse = m + log(sum);
  if (get_local_id(0) == 0)
    loss[loss_off + row] = (1.0f - eps) * (log(sum) + (m - zt)) + eps * (log(sum) + (m - mean)) + zl * lse * lse;
  if (has_grad) {
    const float k1 = gscale * (1.0f + 2.0f * zl * lse) / sum, c0 = gscale * eps / (float)C;
    const float one = (1.0f - eps) * gscale;
    TO_ROW_CHUNKS(C) {
      const float8 z = ce_z(load8n(lg, lr + c, n, 0.0f), cap);
      float8 g = exp(z - m) * k1 - c0;
      g -= select((float8)0.0f, (float8)one, (int8)(0, 1, 2, 3, 4, 5, 6, 7) == (int8)((int)clamp((long)t - (long)c, -1L, 8L)));
      if (cap > 0.0f) g *= 1.0f - (z / cap) * (z / cap);
      store8n(dl, dr + c, g, n);
    }
  }
}
