// LayerNorm, add + RMSNorm and the two norm backwards, with the CPU
// backend's math (cpp/cpu/kernels_llm.h): fp32, a work-group per row
// (reduce.cl), two passes for the variance (sum of (x - mean)^2).

// y = (x - mean) * rstd * w + b. Every pass reads x again, so y may be x.
__kernel void layer_norm(const __global T* x, ulong x_off, ulong x_stride, const __global T* w, ulong w_off,
                         const __global T* b, ulong b_off, int has_bias, __global T* y, ulong y_off,
                         ulong y_stride, ulong cols, float eps, __local float* red) {
  const ulong row = get_group_id(0);
  const ulong xr = x_off + row * x_stride, yr = y_off + row * y_stride;
  // The mean as x0 + mean(x - x0), x0 the row's first element (the CPU's
  // Note [layer_norm's mean]): a row of one value sums exact zeros and
  // normalises to 0, not to its mean's rounding error over sqrt(eps).
  const float x0 = load8n(x, xr, 1, 0.0f).s0;
  float8 acc = 0.0f;
  TO_ROW_CHUNKS(cols) acc += select((float8)0.0f, load8n(x, xr + c, n, 0.0f) - x0, lanes_below(n));
  const float mean = x0 + group_sum(hsum8(acc), red) / (float)cols;
  acc = 0.0f;
  TO_ROW_CHUNKS(cols) {
    const float8 d = select((float8)0.0f, load8n(x, xr + c, n, 0.0f) - mean, lanes_below(n));
    acc += d * d;
  }
  const float rstd = 1.0f / sqrt(group_sum(hsum8(acc), red) / (float)cols + eps);
  TO_ROW_CHUNKS(cols) {
    float8 v = (load8n(x, xr + c, n, 0.0f) - mean) * rstd * load8n(w, w_off + c, n, 0.0f);
    if (has_bias) v += load8n(b, b_off + c, n, 0.0f);
    store8n(y, yr + c, v, n);
  }
}

// residual_out = x + residual (stored, then read back: the norm sees the
// rounded sum, as on the CPU); y = rms_norm(residual_out) * w. Each element
// is read and written by one work-item, so out may be x and residual_out
// may be residual.
__kernel void add_rms_norm(const __global T* x, ulong x_off, ulong x_stride, const __global T* r, ulong r_off,
                           ulong r_stride, const __global T* w, ulong w_off, __global T* y, ulong y_off,
                           ulong y_stride, __global T* ro, ulong ro_off, ulong ro_stride, ulong cols, float eps,
                           __local float* red) {
  const ulong row = get_group_id(0);
  const ulong xr = x_off + row * x_stride, rr = r_off + row * r_stride, yr = y_off + row * y_stride,
              ror = ro_off + row * ro_stride;
  float8 acc = 0.0f;
  TO_ROW_CHUNKS(cols) {
    store8n(ro, ror + c, load8n(x, xr + c, n, 0.0f) + load8n(r, rr + c, n, 0.0f), n);
    const float8 s = load8n(ro, ror + c, n, 0.0f);
    acc += s * s;
  }
  const float scale = 1.0f / sqrt(group_sum(hsum8(acc), red) / (float)cols + eps);
  TO_ROW_CHUNKS(cols) store8n(y, yr + c, load8n(ro, ror + c, n, 0.0f) * scale * load8n(w, w_off + c, n, 0.0f), n);
}

// dx of rms_norm (layer = 0) or layer_norm (layer = 1) for one row, and the
// row's mean and rstd into stats[2 row], stats[2 row + 1] for the dweight
// sums. g = dy * (w + offset) (rms_norm's offset; -0.0f for none, as in
// rms_norm), x_hat = (x - mean) * rstd:
// dx = rstd * (g - mean(g) [layer] - x_hat * mean(g * x_hat)).
__kernel void norm_backward_rows(const __global T* dy, ulong dy_off, ulong dy_stride, const __global T* x,
                                 ulong x_off, ulong x_stride, const __global T* w, ulong w_off, __global T* dx,
                                 ulong dx_off, ulong dx_stride, __global float* stats, ulong cols, float eps,
                                 float offset, int layer, __local float* red) {
  const ulong row = get_group_id(0);
  const ulong gr = dy_off + row * dy_stride, xr = x_off + row * x_stride, dr = dx_off + row * dx_stride;
  float8 acc = 0.0f;
  float mean = 0.0f;
  if (layer) {  // the forward's mean (layer_norm above)
    const float x0 = load8n(x, xr, 1, 0.0f).s0;
    TO_ROW_CHUNKS(cols) acc += select((float8)0.0f, load8n(x, xr + c, n, 0.0f) - x0, lanes_below(n));
    mean = x0 + group_sum(hsum8(acc), red) / (float)cols;
    acc = 0.0f;
  }
  TO_ROW_CHUNKS(cols) {
    const float8 d = select((float8)0.0f, load8n(x, xr + c, n, 0.0f) - mean, lanes_below(n));
    acc += d * d;
  }
  const float rstd = 1.0f / sqrt(group_sum(hsum8(acc), red) / (float)cols + eps);
  float8 gx = 0.0f, gs = 0.0f;
  TO_ROW_CHUNKS(cols) {
    const float8 g = load8n(dy, gr + c, n, 0.0f) * (load8n(w, w_off + c, n, 0.0f) + offset);
    const float8 xh = select((float8)0.0f, (load8n(x, xr + c, n, 0.0f) - mean) * rstd, lanes_below(n));
    gx += g * xh;
    gs += g;
  }
  const float c1 = group_sum(hsum8(gx), red) / (float)cols;
  const float c2 = layer ? group_sum(hsum8(gs), red) / (float)cols : 0.0f;
  TO_ROW_CHUNKS(cols) {
    const float8 g = load8n(dy, gr + c, n, 0.0f) * (load8n(w, w_off + c, n, 0.0f) + offset);
    const float8 xh = (load8n(x, xr + c, n, 0.0f) - mean) * rstd;
    store8n(dx, dr + c, rstd * (g - c2 - xh * c1), n);
  }
  if (get_local_id(0) == 0) {
    stats[2 * row] = mean;
    stats[2 * row + 1] = rstd;
  }
}

// Stage one of dweight / dbias: column c over the rows of block
// get_global_id(1) ([blk * rows_per_block, ...)), into
// partial[blk * cols + c] and partial[(blocks + blk) * cols + c]. Fixed
// blocks and a fixed order: the same sums every run.
__kernel void norm_backward_partials(const __global T* dy, ulong dy_off, ulong dy_stride, const __global T* x,
                                     ulong x_off, ulong x_stride, const __global float* stats,
                                     __global float* partial, ulong rows, ulong cols, ulong rows_per_block) {
  const ulong c = get_global_id(0), blk = get_global_id(1), blocks = get_global_size(1);
  if (c >= cols) return;
  const ulong r1 = min(rows, (blk + 1) * rows_per_block);
  float dw = 0.0f, db = 0.0f;
  for (ulong r = blk * rows_per_block; r < r1; ++r) {
    const float g = load_f32(dy, dy_off + r * dy_stride + c);
    dw += g * (load_f32(x, x_off + r * x_stride + c) - stats[2 * r]) * stats[2 * r + 1];
    db += g;
  }
  partial[blk * cols + c] = dw;
  partial[(blocks + blk) * cols + c] = db;
}

// Stage two: the blocks' partials summed in order, stored in the weight's
// dtype (zeros when there are no rows).
__kernel void norm_backward_final(const __global float* partial, ulong blocks, ulong cols, __global T* dw,
                                  ulong dw_off, __global T* db, ulong db_off, int has_bias) {
  const ulong c = get_global_id(0);
  if (c >= cols) return;
  float sw = 0.0f, sb = 0.0f;
  for (ulong b = 0; b < blocks; ++b) {
    sw += partial[b * cols + c];
    sb += partial[(blocks + b) * cols + c];
  }
  store_f32(dw, dw_off + c, sw);
  if (has_bias) store_f32(db, db_off + c, sb);
}
