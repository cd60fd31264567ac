// Softmax / log-softmax (scaled, causal), its backward, and cross-entropy:
// a work-group per row (reduce.cl), fp32, the CPU backend's semantics.

// y = softmax(scale * x) over the first `valid` columns of the row, 0 (log:
// -inf) past them; causal 1: valid = clamp(row % lq + cols - lq + 1, 0, cols)
// (bottom-right aligned), 2: clamp(row % lq + 1, 0, cols) (top-left). A fully masked row is all 0 (log: -inf). The last
// pass reads x before writing y at the same place: y may be x.
__kernel void softmax(const __global T* x, ulong x_off, ulong x_stride, __global T* y, ulong y_off, ulong y_stride,
                      ulong cols, float scale, int causal, int log_out, ulong lq, __local float* red) {
  const ulong row = get_group_id(0);
  const ulong xr = x_off + row * x_stride, yr = y_off + row * y_stride;
  ulong valid = cols;
  if (causal)
    valid = (ulong)clamp((long)(row % lq) + (causal == 2 ? 0L : (long)cols - (long)lq) + 1, 0L, (long)cols);
  const float ninf = -INFINITY;
  float8 mx = ninf;
  TO_ROW_CHUNKS(valid) mx = fmax(mx, load8n(x, xr + c, n, ninf) * scale);
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

// loss[r] = logsumexp(x_r) - x_r[t] (as log(sum) + (max - x_r[t]): no
// cancellation for large logits); dlogits (has_grad) = grad_scale *
// (softmax(x_r) - onehot(t)). Rows with t == ignore_index: loss 0, grad 0. A
// target outside [0, C) sets *bad = 2 (the host reports it) and the row is
// left alone.
__kernel void cross_entropy(const __global T* lg, ulong lg_off, const __global int* tg, ulong tg_off, int tg64,
                            __global float* loss, ulong loss_off, __global T* dl, ulong dl_off, int has_grad,
                            ulong C, long ignore, float gscale, __global int* bad, __local float* red) {
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
  const float ninf = -INFINITY;
  float8 mx = ninf;
  TO_ROW_CHUNKS(C) mx = fmax(mx, load8n(lg, lr + c, n, ninf));
  const float m = group_max(hmax8(mx), red);
  float8 acc = 0.0f;
  TO_ROW_CHUNKS(C) acc += select((float8)0.0f, exp(load8n(lg, lr + c, n, 0.0f) - m), lanes_below(n));
  const float sum = group_sum(hsum8(acc), red);
  if (get_local_id(0) == 0) loss[loss_off + row] = log(sum) + (m - load_f32(lg, lr + (ulong)t));
  if (has_grad) {
    const float inv = gscale / sum;
    TO_ROW_CHUNKS(C) {
      float8 g = exp(load8n(lg, lr + c, n, 0.0f) - m) * inv;
      g -= select((float8)0.0f, (float8)gscale, (int8)(0, 1, 2, 3, 4, 5, 6, 7) == (int8)((int)clamp((long)t - (long)c, -1L, 8L)));
      store8n(dl, dr + c, g, n);
    }
  }
}
