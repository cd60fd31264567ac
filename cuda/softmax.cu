// Row softmax / log_softmax (scaled, optionally causal), their backward, and
// cross-entropy with an optional gradient. One block per row; the max and
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
// the masked columns. y may be x (in place): chunk i stays with one thread.
template <class T, int V>
__global__ void __launch_bounds__(kMaxBlockThreads)
    softmax_kernel(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows, int64_t cols, float scale,
                   int causal, int64_t lq, bool log) {
  const int64_t chunks = cols / V;
  const bool in_registers = chunks <= int64_t(blockDim.x) * kRowChunks<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * y_stride;
    const int64_t valid = causal ? clamp64(r % lq + (causal == 2 ? 0 : cols - lq) + 1, 0, cols) : cols;
    float m = kNegInf, s = 0.0f;
    float a[kRowChunks<T>][V];
    for_chunks<T, V>(in_registers, true, xr, chunks, a, [&](int64_t i, const float (&b)[V]) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (i * V + k < valid) online_add(mul_rn(b[k], scale), m, s);
    });
    float sum;
    const float row_max = block_max_sum(m, s, &sum);
    // log: v - (max + log(sum)); else exp(v - max) / sum. v = x * scale is
    // rounded alike in both passes (mul_rn, never fused into the subtraction),
    // so the row's max element gives exactly -log(sum) (0 for one column).
    const float shift = log ? row_max + logf(sum) : row_max;
    const float inv = 1.0f / sum;
    const float masked = log ? kNegInf : 0.0f;
    for_chunks<T, V>(in_registers, false, xr, chunks, a, [&](int64_t i, float (&b)[V]) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float v = mul_rn(b[k], scale) - shift;
        b[k] = i * V + k >= valid ? masked : (log ? v : expf(v) * inv);
      }
      store_chunk(yr, i, b);
    });
  }
}

// dx = scale * (dy - exp(y) * sum(dy)) (log) or scale * y * (dy - sum(dy * y)).
// dx may be dy or y (in place).
template <class T, int V>
__global__ void __launch_bounds__(kMaxBlockThreads)
    softmax_backward_kernel(const T* dy, int64_t dy_stride, const T* y, int64_t y_stride, T* dx, int64_t dx_stride,
                            int64_t rows, int64_t cols, float scale, bool log) {
  // Two rows (dy and y) in registers, kRowChunks<T> chunks of each (the
  // one-row for_chunks of common.cuh, twice).
  constexpr int kChunks = kRowChunks<T>;
  const int64_t chunks = cols / V;
  const bool in_registers = chunks <= int64_t(blockDim.x) * kChunks;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gr = dy + r * dy_stride;
    const T* yr = y + r * y_stride;
    float part = 0.0f;
    float g[kChunks][V], p[kChunks][V];  // when in_registers
    if (in_registers) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t i = threadIdx.x + int64_t(c) * blockDim.x;
        if (i >= chunks) break;
        load_chunk(gr, i, g[c]);
        load_chunk(yr, i, p[c]);
#pragma unroll
        for (int k = 0; k < V; ++k) part += log ? g[c][k] : g[c][k] * p[c][k];
      }
    } else {
      for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
        float gi[V], pi[V];
        load_chunk(gr, i, gi);
        load_chunk(yr, i, pi);
#pragma unroll
        for (int k = 0; k < V; ++k) part += log ? gi[k] : gi[k] * pi[k];
      }
    }
    const float s = block_sum(part);
    T* dr = dx + r * dx_stride;
    const auto finish = [&](int64_t i, float (&gi)[V], const float (&pi)[V]) {
#pragma unroll
      for (int k = 0; k < V; ++k) gi[k] = log ? scale * (gi[k] - expf(pi[k]) * s) : scale * pi[k] * (gi[k] - s);
      store_chunk(dr, i, gi);
    };
    if (in_registers) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t i = threadIdx.x + int64_t(c) * blockDim.x;
        if (i >= chunks) break;
        finish(i, g[c], p[c]);
      }
    } else {
      for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
        float gi[V], pi[V];
        load_chunk(gr, i, gi);
        load_chunk(yr, i, pi);
        finish(i, gi, pi);
      }
    }
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
template <class T, int V, class I>
__global__ void __launch_bounds__(kMaxBlockThreads)
    cross_entropy_kernel(const T* logits, int64_t l_stride, const I* __restrict__ target,
                         float* __restrict__ loss, T* dlogits, int64_t d_stride, int64_t rows,
                         int64_t cols, int64_t ignore_index, float grad_scale, CeOptions o, int* bad) {
  // The row's target and target logit, read by thread 0 and shared (not one
  // load per thread); two slots by row parity, so a row's write never meets
  // a slower thread still reading the previous row's (a row has one barrier
  // at least: the one after the write).
  __shared__ int64_t target_sh[2];
  __shared__ float logit_sh[2];
  const int64_t chunks = cols / V;
  const bool in_registers = chunks <= int64_t(blockDim.x) * kRowChunks<T>;
  int64_t it = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, ++it) {
    const int slot = int(it & 1);
    const T* lr = logits + r * l_stride;
    if (threadIdx.x == 0) {
      const int64_t tr = int64_t(target[r]);
      target_sh[slot] = tr;
      logit_sh[slot] = tr >= 0 && tr < cols ? to_f32(lr[tr]) : 0.0f;
    }
    __syncthreads();
    const int64_t t = target_sh[slot];
    T* dr = dlogits ? dlogits + r * d_stride : nullptr;
    if (t == ignore_index) {
      if (threadIdx.x == 0) loss[r] = 0.0f;
      if (dr) {
        const float zero[V] = {};
        for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) store_chunk(dr, i, zero);
      }
      continue;
    }
    if (t < 0 || t >= cols) {
      if (threadIdx.x == 0) *bad = 1;
      continue;
    }
    const float target_logit = ce_z(logit_sh[slot], o.cap);
    float m = kNegInf, s = 0.0f, zs = 0.0f;
    float a[kRowChunks<T>][V];
    for_chunks<T, V>(in_registers, true, lr, chunks, a, [&](int64_t, const float (&b)[V]) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float z = ce_z(b[k], o.cap);
        online_add(z, m, s);
        zs += z;
      }
    });
    float sum;
    const float row_max = block_max_sum(m, s, &sum);
    const float mean = o.eps != 0.0f ? block_sum(zs) / float(cols) : 0.0f;
    const double lse = double(row_max) + ::log(double(sum));
    if (threadIdx.x == 0)
      loss[r] = float((1.0 - o.eps) * (lse - double(target_logit)) + o.eps * (lse - double(mean)) +
                      o.zl * lse * lse);
    if (!dr) continue;
    const float p_scale = float((1.0 + 2.0 * o.zl * lse) / sum) * grad_scale;
    const float c0 = grad_scale * o.eps / float(cols), one = (1.0f - o.eps) * grad_scale;
    for_chunks<T, V>(in_registers, false, lr, chunks, a, [&](int64_t i, float (&b)[V]) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float z = ce_z(b[k], o.cap);
        float g = expf(z - row_max) * p_scale - c0 - (i * V + k == t ? one : 0.0f);
        if (o.cap > 0.0f) g *= 1.0f - (z / o.cap) * (z / o.cap);
        b[k] = g;
      }
      store_chunk(dr, i, b);
    });
  }
}

template <class T>
to_status softmax_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &yt = c->outputs[0];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const int64_t lq = c->ints[2] > 0 ? c->ints[2] : 1;
  return with_chunk<T>(rows_aligned16({&xt, &yt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    softmax_kernel<T, V><<<row_blocks(rows), row_block_threads(cols / V), 0, stream>>>(
        element0<const T>(xt), xt.strides[0], element0<T>(yt), yt.strides[0], rows, cols, float(c->scalars[0]),
        int(c->ints[0]), lq, c->ints[1] != 0);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    return TO_OK;
  });
}

template <class T>
to_status softmax_backward_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &gt = c->inputs[0], &yt = c->inputs[1], &dt = c->outputs[0];
  const int64_t rows = yt.shape[0], cols = yt.shape[1];
  return with_chunk<T>(rows_aligned16({&gt, &yt, &dt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    softmax_backward_kernel<T, V><<<row_blocks(rows), row_block_threads(cols / V), 0, stream>>>(
        element0<const T>(gt), gt.strides[0], element0<const T>(yt), yt.strides[0], element0<T>(dt), dt.strides[0],
        rows, cols, float(c->scalars[0]), c->ints[1] != 0);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    return TO_OK;
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
  const bool vec = rows_aligned16({&lt}, sizeof(T)) && (!grad || rows_aligned16({grad}, sizeof(T)));
  BadIndexFlag bad(BadIndex::target);
  if (to_status s = bad.arm(bad_target_message(cols, c->ints[0])); s != TO_OK) return s;
  const to_status s = with_chunk<T>(vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    const unsigned threads = unsigned(row_block_threads(cols / V));
    auto run = [&](auto* target) {
      cross_entropy_kernel<T, V><<<row_blocks(rows), threads, 0, stream>>>(
          element0<const T>(lt), lt.strides[0], target, element0<float>(ls), dlogits, grad ? dt.strides[0] : 0,
          rows, cols, c->ints[0], float(c->scalars[0]),
          CeOptions{float(c->scalars[1]), float(c->scalars[2]), float(c->scalars[3])}, bad.device());
    };
    if (tt.dtype == TO_INT64)
      run(element0<const int64_t>(tt));
    else
      run(element0<const int32_t>(tt));
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    return TO_OK;
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
