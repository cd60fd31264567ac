// rms_norm: y = x / sqrt(mean(x^2) + eps) * w over the last dimension, one
// block per row, fp32 accumulation (the CPU reference's math).
#include <algorithm>

#include "common.cuh"

namespace tensor_ops::gpu {
namespace {

// V = 16 / sizeof(T) when every row start, w and cols allow 16-byte accesses;
// else V = 1. Blocks stride over rows past the grid limit. x is not
// __restrict__: it may be y (in place); w never overlaps y (the core checks).
template <class T, int V>
__global__ void __launch_bounds__(kMaxBlockThreads)
    rms_norm_kernel(const T* x, int64_t x_stride, const T* __restrict__ w, T* y, int64_t y_stride,
                    int64_t rows, int64_t cols, float eps) {
  using Chunk = Vec<T, V>;
  const int64_t chunks = cols / V;
  const Chunk* wc = reinterpret_cast<const Chunk*>(w);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    // x may be y (in place): x is read in full before the barrier in block_sum
    // and each element is read then written by the same thread after it.
    const Chunk* xc = reinterpret_cast<const Chunk*>(x + r * x_stride);
    Chunk* yc = reinterpret_cast<Chunk*>(y + r * y_stride);
    float squares = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      const Chunk a = xc[i];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float f = to_f32(a.v[k]);
        squares += f * f;
      }
    }
    const float sum = block_sum(squares);
    // One double op per row: the same rounding as the CPU backend's scale.
    const float scale = float(1.0 / sqrt(double(sum) / double(cols) + double(eps)));
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      const Chunk a = xc[i], b = wc[i];
      Chunk o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = from_f32<T>(to_f32(a.v[k]) * scale * to_f32(b.v[k]));
      yc[i] = o;
    }
  }
}

// Threads per block: enough for one chunk each up to 1024, whole 64s.
int block_threads(int64_t chunks) {
  const int64_t n = (chunks + kBlockMultiple - 1) / kBlockMultiple * kBlockMultiple;
  return int(std::clamp<int64_t>(n, kBlockMultiple, kMaxBlockThreads));
}

template <class T>
to_status rms_norm_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &wt = c->inputs[1], &yt = c->outputs[0];
  const T* x = element0<const T>(xt);
  const T* w = element0<const T>(wt);
  T* y = element0<T>(yt);
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const int64_t xs = xt.strides[0], ys = yt.strides[0];
  constexpr int V = 16 / sizeof(T);
  const bool vec = cols % V == 0 && (rows == 1 || (xs % V == 0 && ys % V == 0)) && aligned16(x) && aligned16(w) &&
                   aligned16(y);
  const unsigned blocks = unsigned(std::min(rows, kMaxGridBlocks));
  const float eps = float(c->scalars[0]);
  if (vec)
    rms_norm_kernel<T, V><<<blocks, block_threads(cols / V), 0, stream>>>(x, xs, w, y, ys, rows, cols, eps);
  else
    rms_norm_kernel<T, 1><<<blocks, block_threads(cols), 0, stream>>>(x, xs, w, y, ys, rows, cols, eps);
  TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  return TO_OK;
}

}  // namespace

to_status launch_rms_norm(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return rms_norm_typed<decltype(tag)>(call, stream); });
}

}  // namespace tensor_ops::gpu
