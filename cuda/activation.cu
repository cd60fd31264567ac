// Elementwise activations: silu and gelu (erf and tanh forms), fp32 math for
// every storage type, written as the CPU reference writes them.
#include <algorithm>

#include "common.cuh"

namespace tensor_ops::gpu {
namespace {

struct Silu {
  __device__ float operator()(float v) const { return v / (1.0f + expf(-v)); }
};
struct GeluErf {
  __device__ float operator()(float v) const { return 0.5f * v * erfcf(v * -0.70710678118654752f); }
};
// 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation for small u.
struct GeluTanh {
  __device__ float operator()(float v) const {
    const float u = 0.79788456080286536f * (v + 0.044715f * v * v * v);
    return v / (1.0f + expf(-2.0f * u));
  }
};

template <class T, class Op>
__device__ __forceinline__ T apply(Op op, T v) {
  return from_f32<T>(op(to_f32(v)));
}

// A contiguous span whose x and y share their offset from a 16-byte
// boundary: `head` single elements up to that boundary, then 16-byte chunks,
// then fewer than V single elements. Grid-stride over the chunks.
template <class T, class Op>
__global__ void unary_span_kernel(const T* x, T* y, int64_t n, int64_t head, Op op) {
  constexpr int V = 16 / sizeof(T);
  using Chunk = Vec<T, V>;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t chunks = (n - head) / V;
  const Chunk* xc = reinterpret_cast<const Chunk*>(x + head);
  Chunk* yc = reinterpret_cast<Chunk*>(y + head);
  for (int64_t i = tid; i < chunks; i += stride) {
    Chunk a = xc[i];
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] = apply(op, a.v[k]);
    yc[i] = a;
  }
  const int64_t tail = head + chunks * V;  // head < V and n - tail < V
  if (tid < head) y[tid] = apply(op, x[tid]);
  if (tail + tid < n) y[tail + tid] = apply(op, x[tail + tid]);
}

// Any other layout: rows with their own strides, one element at a time.
// blockIdx.y strides over rows, the x dimension over columns.
template <class T, class Op>
__global__ void unary_rows_kernel(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows, int64_t cols,
                                  Op op) {
  const int64_t c0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t c_step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = c0; c < cols; c += c_step) y[r * y_stride + c] = apply(op, x[r * x_stride + c]);
}

constexpr int kThreads = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <class T, class Op>
to_status unary_typed(const to_op_call* c, cudaStream_t stream, Op op) {
  const to_tensor &xt = c->inputs[0], &yt = c->outputs[0];
  const T* x = element0<const T>(xt);
  T* y = element0<T>(yt);
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const int64_t xs = xt.strides[0], ys = yt.strides[0];
  const bool contiguous = rows == 1 || (xs == cols && ys == cols);
  const uintptr_t x_mis = reinterpret_cast<uintptr_t>(x) % 16, y_mis = reinterpret_cast<uintptr_t>(y) % 16;
  if (contiguous && x_mis == y_mis && x_mis % sizeof(T) == 0) {
    constexpr int V = 16 / sizeof(T);
    const int64_t n = rows * cols;
    const int64_t head = std::min<int64_t>(n, int64_t((16 - x_mis) % 16 / sizeof(T)));
    const int64_t blocks = std::clamp<int64_t>(ceil_div((n - head) / V, kThreads), 1, kMaxGridBlocks);
    unary_span_kernel<T><<<unsigned(blocks), kThreads, 0, stream>>>(x, y, n, head, op);
  } else {
    const dim3 grid(unsigned(std::min<int64_t>(ceil_div(cols, kThreads), 64)),
                    unsigned(std::min<int64_t>(rows, kMaxGridBlocks)));
    unary_rows_kernel<T><<<grid, kThreads, 0, stream>>>(x, xs, y, ys, rows, cols, op);
  }
  TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  return TO_OK;
}

template <class Op>
to_status launch_unary(const to_op_call* call, cudaStream_t stream, Op op) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return unary_typed<decltype(tag)>(call, stream, op); });
}

}  // namespace

to_status launch_silu(const to_op_call* call, cudaStream_t stream) { return launch_unary(call, stream, Silu{}); }

to_status launch_gelu(const to_op_call* call, cudaStream_t stream) {
  if (call->ints[0] == 1) return launch_unary(call, stream, GeluTanh{});
  return launch_unary(call, stream, GeluErf{});
}

}  // namespace tensor_ops::gpu
