// Row softmax / log_softmax (scaled, optionally causal), their backward, and
// cross-entropy with an optional gradient. One block per row (a group of
// threads per short row, Note [Rows per block]); the max and
// the sum of exponentials come from one online pass (each thread keeps a
// running max and sum, merged over the block), fp32 throughout.
#include <algorithm>
#include <cmath>

#include "common.cuh"
#include "tensor_ops/bad_index.h"

namespace tensor_ops::gpu {
namespace {

// y = softmax(scale * x) (log_softmax when log). causal: row r is query
// i = r % lq of the last two dims and sees columns j < i + cols - lq + 1
// (causal 1, bottom-right aligned) or j < i + 1 (causal 2, top-left); a row that sees nothing is 0 (log: -inf), as are
// the masked columns. y may be x (in place): element e stays with one thread.
template <class T, int V, bool Grouped>
__global__ void __launch_bounds__(Grouped ? kGroupBlockThreads : kMaxBlockThreads)
    softmax_kernel(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows, int64_t cols, float scale,
                   int causal, int64_t lq, bool log, int group) {
  const RowGroup<Grouped> g = row_group<Grouped>(group);
  for (int64_t r0 = int64_t(blockIdx.x) * g.per_block; r0 < rows; r0 += int64_t(gridDim.x) * g.per_block) {
    const int64_t r = r0 + g.index;
    const T* xr = x + r * x_stride;
    T* yr = y + r * y_stride;
    const RowSplit sp = split_row<T, V>(xr, r < rows ? cols : 0);
    const bool in_registers = row_in_registers<RowRegs<T, V, Grouped>>(g, sp);
    const int64_t valid = causal ? clamp64(r % lq + (causal == 2 ? 0 : cols - lq) + 1, 0, cols) : cols;
    float m = kNegInf, s = 0.0f;
    RowRegs<T, V, Grouped> a;
    // Note [One exp per element]: softmax of a row in registers keeps
    // exp(v - m), m this thread's own max, from the sum pass in place of x
    // and scales it by exp(m - row max) / sum for the output: one exp per
    // element (and one per thread) where the online pass and the output
    // pass took two. The thread's max comes first, from its registers, so
    // nothing is rescaled. log_softmax needs v, not its exp; a streamed row
    // is not kept: both take the online pass and recompute.
    const bool keep_exp = in_registers && !log;
    if (keep_exp) {
      for_chunks(g, true, true, sp, a, [&](int64_t e, const auto& b) {
#pragma unroll
        for (int k = 0; k < kWidth<decltype(b)>; ++k)
          if (e + k < valid) m = fmaxf(m, mul_rn(b[k], scale));
      }, xr);
      for_chunks(g, true, false, sp, a, [&](int64_t e, auto& b) {
#pragma unroll
        for (int k = 0; k < kWidth<decltype(b)>; ++k) {
          const float v = mul_rn(b[k], scale);
          b[k] = e + k < valid && v != kNegInf ? expf(v - m) : 0.0f;  // -inf adds nothing (-inf - -inf is NaN)
          s += b[k];
        }
      }, xr);
    } else {
      for_chunks(g, in_registers, true, sp, a, [&](int64_t e, const auto& b) {
#pragma unroll
        for (int k = 0; k < kWidth<decltype(b)>; ++k)
          if (e + k < valid) online_add(mul_rn(b[k], scale), m, s);
      }, xr);
    }
    float sum;
    const float row_max = group_max_sum(g, m, s, &sum);
    // log: (v - max) - log(sum); else exp(v - max) / sum. v = x * scale is
    // rounded alike in both passes (mul_rn, never fused into the subtraction),
    // so the row's max element gives exactly -log(sum) (0 for one column).
    // Not v - (max + log(sum)): where log(sum) is under half an ulp of max
    // (|max| from 2^25 for five columns), max + log(sum) rounds it away (a
    // row of five 7e9 gave 0, not -log(5)).
    const float lsum = log ? logf(sum) : 0.0f;
    const float inv = 1.0f / sum;
    const float masked = log ? kNegInf : 0.0f;
    // keep_exp: this thread's exp(v - m) to the row's (exactly 1 / sum where m is the row max).
    const float own = keep_exp && s != 0.0f ? expf(m - row_max) * inv : 0.0f;
    for_chunks(g, in_registers, false, sp, a, [&](int64_t e, auto& b) {
#pragma unroll
      for (int k = 0; k < kWidth<decltype(b)>; ++k) {
        const float v = mul_rn(b[k], scale) - row_max;
        b[k] = e + k >= valid ? masked : (keep_exp ? b[k] * own : (log ? v - lsum : expf(v) * inv));
      }
      store_at(yr, e, b);
    }, xr);
  }
}

// dx = scale * (dy - exp(y) * sum(dy)) (log) or scale * y * (dy - sum(dy * y)).
// dx may be dy or y (in place). Two rows (dy and y) in registers, kRowChunks<T>
// chunks of each.
template <class T, int V, bool Grouped>
__global__ void __launch_bounds__(Grouped ? kGroupBlockThreads : kMaxBlockThreads)
    softmax_backward_kernel(const T* dy, int64_t dy_stride, const T* y, int64_t y_stride, T* dx, int64_t dx_stride,
                            int64_t rows, int64_t cols, float scale, bool log, int group) {
  const RowGroup<Grouped> g = row_group<Grouped>(group);
  for (int64_t r0 = int64_t(blockIdx.x) * g.per_block; r0 < rows; r0 += int64_t(gridDim.x) * g.per_block) {
    const int64_t r = r0 + g.index;
    const T* gr = dy + r * dy_stride;
    const T* yr = y + r * y_stride;
    const RowSplit sp = split_row<T, V>(gr, r < rows ? cols : 0);
    RowRegs<T, V, Grouped, 2> a;
    const bool in_registers = row_in_registers<RowRegs<T, V, Grouped>>(g, sp);
    float part = 0.0f;
    for_chunks(g, in_registers, true, sp, a, [&](int64_t, const auto& d, const auto& p) {
#pragma unroll
      for (int k = 0; k < kWidth<decltype(d)>; ++k) part += log ? d[k] : d[k] * p[k];
    }, gr, yr);
    const float s = group_sum(g, part);
    T* dr = dx + r * dx_stride;
    for_chunks(g, in_registers, false, sp, a, [&](int64_t e, auto& d, const auto& p) {
#pragma unroll
      for (int k = 0; k < kWidth<decltype(d)>; ++k)
        d[k] = log ? scale * (d[k] - expf(p[k]) * s) : scale * p[k] * (d[k] - s);
      store_at(dr, e, d);
    }, gr, yr);
  }
}

// Cross-entropy's options: label smoothing eps, z-loss zl, softcap cap (0: none).
struct CeOptions {
  float eps, zl, cap;
};

// The logit as the softmax sees it: cap * tanh(x / cap), or x.
__device__ __forceinline__ float ce_z(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

// With z = ce_z(row) and lse = logsumexp(z): loss[r] = (1 - eps) (lse - z[t])
// + eps (lse - mean(z)) + zl lse^2; dlogits (when not NULL) = grad_scale *
// (softmax(z) (1 + 2 zl lse) - eps / C - (1 - eps) onehot(t)) * dz/dx. Rows
// whose target is the ignore index get 0 (and a zero gradient row); any
// other target outside [0, C) raises *bad and leaves the row. dlogits may be
// logits (in place): row[t] is read before the row's first barrier, chunks
// stay with one thread.
template <class T, int V, bool Grouped, class I>
__global__ void __launch_bounds__(Grouped ? kGroupBlockThreads : kMaxBlockThreads)
    cross_entropy_kernel(const T* logits, int64_t l_stride, const I* __restrict__ target,
                         float* __restrict__ loss, T* dlogits, int64_t d_stride, int64_t rows,
                         int64_t cols, int64_t ignore_index, float grad_scale, CeOptions o, int* bad,
                         int group) {
  // The row's target and target logit, read by the group's lane 0 and
  // shared (not one load per thread); two slots by row parity, so a row's
  // write never meets a slower thread still reading the previous row's (an
  // iteration has one barrier: the one after the write).
  __shared__ int64_t target_sh[2][kMaxRowGroups];
  __shared__ float logit_sh[2][kMaxRowGroups];
  const RowGroup<Grouped> g = row_group<Grouped>(group);
  int64_t it = 0;
  for (int64_t r0 = int64_t(blockIdx.x) * g.per_block; r0 < rows; r0 += int64_t(gridDim.x) * g.per_block, ++it) {
    const int slot = int(it & 1);
    const int64_t r = r0 + g.index;
    const bool live = r < rows;
    const T* lr = logits + r * l_stride;
    if (g.lane == 0 && live) {
      const int64_t tr = int64_t(target[r]);
      target_sh[slot][g.index] = tr;
      logit_sh[slot][g.index] = tr >= 0 && tr < cols ? to_f32(lr[tr]) : 0.0f;
    }
    __syncthreads();
    const int64_t t = live ? target_sh[slot][g.index] : 0;
    T* dr = dlogits ? dlogits + r * d_stride : nullptr;
    const RowSplit full = split_row<T, V>(lr, live ? cols : 0);
    const bool ignored = live && t == ignore_index;
    if (ignored) {
      if (g.lane == 0) loss[r] = 0.0f;
      if (dr) {
        const float zero[V] = {}, zero1[1] = {};
        const int64_t j = g.lane;
        if (j < full.head) store_at(dr, j, zero1);
        for (int64_t i = j; i < full.chunks; i += g.size) store_at(dr, full.head + i * V, zero);
        if (j < full.tail) store_at(dr, full.head + full.chunks * V + j, zero1);
      }
    }
    const bool run = live && !ignored && t >= 0 && t < cols;
    if (live && !ignored && !run && g.lane == 0) *bad = 1;
    // Ignored, bad and past-the-end rows go on empty through the reductions
    // (every thread of the block takes part in them).
    const RowSplit sp = run ? full : RowSplit{};
    const float target_logit = run ? ce_z(logit_sh[slot][g.index], o.cap) : 0.0f;
    const bool in_registers = row_in_registers<RowRegs<T, V, Grouped>>(g, sp);
    float m = kNegInf, s = 0.0f, zs = 0.0f;
    RowRegs<T, V, Grouped> a;
    // A row in registers keeps z (one tanh under a softcap) and, without a
    // softcap, exp(z - m) in its place (Note [One exp per element]); with
    // one the gradient needs z, so exp(z - max) is taken again there.
    const bool keep_exp = in_registers && o.cap == 0.0f;
    if (in_registers) {
      for_chunks(g, true, true, sp, a, [&](int64_t, auto& b) {
#pragma unroll
        for (int k = 0; k < kWidth<decltype(b)>; ++k) {
          b[k] = ce_z(b[k], o.cap);
          m = fmaxf(m, b[k]);
          zs += b[k];
        }
      }, lr);
      for_chunks(g, true, false, sp, a, [&](int64_t, auto& b) {
#pragma unroll
        for (int k = 0; k < kWidth<decltype(b)>; ++k) {
          const float p = b[k] != kNegInf ? expf(b[k] - m) : 0.0f;  // -inf adds nothing (-inf - -inf is NaN)
          s += p;
          if (keep_exp) b[k] = p;
        }
      }, lr);
    } else {
      for_chunks(g, false, true, sp, a, [&](int64_t, const auto& b) {
#pragma unroll
        for (int k = 0; k < kWidth<decltype(b)>; ++k) {
          const float z = ce_z(b[k], o.cap);
          online_add(z, m, s);
          zs += z;
        }
      }, lr);
    }
    float sum;
    const float row_max = group_max_sum(g, m, s, &sum);
    const float mean = o.eps != 0.0f ? group_sum(g, zs) / float(cols) : 0.0f;
    if (!run) continue;
    // (max - z) + log(sum), not lse - z: past |max| ~1e15 max + log(sum) rounds log(sum) away even in double.
    const double lsum = ::log(double(sum)), lse = double(row_max) + lsum;
    if (g.lane == 0)
      loss[r] = float((1.0 - o.eps) * ((double(row_max) - double(target_logit)) + lsum) +
                      o.eps * ((double(row_max) - double(mean)) + lsum) + o.zl * lse * lse);
    if (!dr) continue;
    const float p_scale = float((1.0 + 2.0 * o.zl * lse) / sum) * grad_scale;
    const float c0 = grad_scale * o.eps / float(cols), one = (1.0f - o.eps) * grad_scale;
    // keep_exp: this thread's exp(z - m) to the row's softmax times p_scale.
    const float own = keep_exp && s != 0.0f ? expf(m - row_max) * p_scale : 0.0f;
    for_chunks(g, in_registers, false, sp, a, [&](int64_t e, auto& b) {
#pragma unroll
      for (int k = 0; k < kWidth<decltype(b)>; ++k) {
        const float z = in_registers ? b[k] : ce_z(b[k], o.cap);  // not z where keep_exp (no softcap)
        float d = (keep_exp ? b[k] * own : expf(z - row_max) * p_scale) - c0 - (e + k == t ? one : 0.0f);
        if (o.cap > 0.0f) d *= 1.0f - (z / o.cap) * (z / o.cap);
        b[k] = d;
      }
      store_at(dr, e, b);
    }, lr);
  }
}

template <class T>
to_status softmax_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &yt = c->outputs[0];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const int64_t lq = c->ints[2] > 0 ? c->ints[2] : 1;
  return with_chunk<T>(rows_same_offset16({&xt, &yt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    const RowLaunch l = row_launch(rows, cols / V);
    return with_grouping(l, [&](auto grouped) {
      softmax_kernel<T, V, decltype(grouped)::value><<<l.blocks, l.threads, 0, stream>>>(
          element0<const T>(xt), xt.strides[0], element0<T>(yt), yt.strides[0], rows, cols, float(c->scalars[0]),
          int(c->ints[0]), lq, c->ints[1] != 0, l.group);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
  });
}

template <class T>
to_status softmax_backward_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &gt = c->inputs[0], &yt = c->inputs[1], &dt = c->outputs[0];
  const int64_t rows = yt.shape[0], cols = yt.shape[1];
  return with_chunk<T>(rows_same_offset16({&gt, &yt, &dt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    const RowLaunch l = row_launch(rows, cols / V);
    return with_grouping(l, [&](auto grouped) {
      softmax_backward_kernel<T, V, decltype(grouped)::value><<<l.blocks, l.threads, 0, stream>>>(
          element0<const T>(gt), gt.strides[0], element0<const T>(yt), yt.strides[0], element0<T>(dt), dt.strides[0],
          rows, cols, float(c->scalars[0]), c->ints[1] != 0, l.group);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
  });
}

// Full views: logits [N, C], target int32 / int64 [N], loss float32 [N],
// dlogits [N, C] or absent (data == NULL).
template <class T>
to_status cross_entropy_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &lt = c->inputs[0], &tt = c->inputs[1], &ls = c->outputs[0], &dt = c->outputs[1];
  const int64_t rows = lt.shape[0], cols = lt.shape[1];
  T* dlogits = c->ints[1] && dt.data ? element0<T>(dt) : nullptr;
  const to_tensor* grad = dlogits ? &dt : nullptr;
  const bool vec = grad ? rows_same_offset16({&lt, grad}, sizeof(T)) : rows_same_offset16({&lt}, sizeof(T));
  BadIndexFlag bad(BadIndex::target);
  if (to_status s = bad.arm(bad_target_message(cols, c->ints[0])); s != TO_OK) return s;
  const to_status s = with_chunk<T>(vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    const RowLaunch l = row_launch(rows, cols / V);
    return with_grouping(l, [&](auto grouped) {
      auto run = [&](auto* target) {
        cross_entropy_kernel<T, V, decltype(grouped)::value><<<l.blocks, l.threads, 0, stream>>>(
            element0<const T>(lt), lt.strides[0], target, element0<float>(ls), dlogits, grad ? dt.strides[0] : 0,
            rows, cols, c->ints[0], float(c->scalars[0]),
            CeOptions{float(c->scalars[1]), float(c->scalars[2]), float(c->scalars[3])}, bad.device(), l.group);
      };
      if (tt.dtype == TO_INT64)
        run(element0<const int64_t>(tt));
      else
        run(element0<const int32_t>(tt));
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
  });
  if (s != TO_OK) return s;
  return TO_OK;
}

}  // namespace

to_status launch_softmax(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return softmax_typed<decltype(tag)>(call, stream); });
}

to_status launch_softmax_backward(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return softmax_backward_typed<decltype(tag)>(call, stream); });
}

to_status launch_cross_entropy(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return cross_entropy_typed<decltype(tag)>(call, stream); });
}

}  // namespace tensor_ops::gpu
