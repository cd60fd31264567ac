// Elementwise ops: silu and gelu (erf and tanh forms), their backward, and
// the gated units (swiglu / geglu) forward and backward. One kernel pair
// serves them all: NI inputs -> NO outputs through an fp32 functor, written
// as the CPU reference writes the math.
#include <algorithm>

#include "common.cuh"

namespace tensor_ops::gpu {
namespace {

// The activation ids of ops.h: 0 silu, 1 gelu (erf), 2 gelu (tanh).
__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ __forceinline__ float act_forward(int act, float v) {
  if (act == 0) return v / (1.0f + expf(-v));
  if (act == 1) return 0.5f * v * erfcf(v * -0.70710678118654752f);
  // 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation for small u.
  const float u = 0.79788456080286536f * (v + 0.044715f * v * v * v);
  return v / (1.0f + expf(-2.0f * u));
}

// d act / dv
__device__ __forceinline__ float act_grad(int act, float v) {
  if (act == 0) {
    const float s = sigmoid(v);
    return s * (1.0f + v * (1.0f - s));
  }
  if (act == 1) {
    const float cdf = 0.5f * erfcf(v * -0.70710678118654752f);
    return cdf + v * 0.39894228040143268f * expf(-0.5f * v * v);
  }
  const float k = 0.79788456080286536f;
  const float u = k * (v + 0.044715f * v * v * v);
  const float s = sigmoid(2.0f * u);
  return s + v * s * (1.0f - s) * 2.0f * k * (1.0f + 3.0f * 0.044715f * (v * v));
}

// y = act(x)
struct Activate {
  static constexpr int kIn = 1, kOut = 1;
  int act;
  __device__ void operator()(const float (&in)[1], float (&out)[1]) const { out[0] = act_forward(act, in[0]); }
};
// in dy, x -> dx
struct ActivateBackward {
  static constexpr int kIn = 2, kOut = 1;
  int act;
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const { out[0] = in[0] * act_grad(act, in[1]); }
};
// in gate, up -> act(gate) * up
struct Gated {
  static constexpr int kIn = 2, kOut = 1;
  int act;
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const {
    out[0] = act_forward(act, in[0]) * in[1];
  }
};
// in dy, gate, up -> dgate, dup
struct GatedBackward {
  static constexpr int kIn = 3, kOut = 2;
  int act;
  __device__ void operator()(const float (&in)[3], float (&out)[2]) const {
    out[0] = in[0] * in[2] * act_grad(act, in[1]);
    out[1] = in[0] * act_forward(act, in[1]);
  }
};

// The views of one call: element 0 and row stride of each input and output.
template <class T, class Op>
struct Views {
  const T* in[Op::kIn];
  T* out[Op::kOut];
  int64_t in_stride[Op::kIn];
  int64_t out_stride[Op::kOut];
};

// Element e of every view through op (e counts from each view's element 0).
template <class T, class Op>
__device__ __forceinline__ void apply_flat(const Views<T, Op>& v, const Op& op, int64_t e) {
  float a[Op::kIn], b[Op::kOut];
#pragma unroll
  for (int k = 0; k < Op::kIn; ++k) a[k] = to_f32(v.in[k][e]);
  op(a, b);
#pragma unroll
  for (int k = 0; k < Op::kOut; ++k) v.out[k][e] = from_f32<T>(b[k]);
}

// Contiguous views that share their offset from a 16-byte boundary: `head`
// single elements up to that boundary, then 16-byte chunks, then fewer than
// V single elements. Grid-stride over the chunks. Every element is read and
// written by one thread, so an output may be an input (in place).
// Chunk i (V elements) of every input through op into chunk i of every output.
template <class T, int V, class Op>
__device__ __forceinline__ void apply_chunk(const T* const (&in)[Op::kIn], T* const (&out)[Op::kOut], const Op& op,
                                            int64_t i) {
  float a[Op::kIn][V], b[Op::kOut][V];
#pragma unroll
  for (int k = 0; k < Op::kIn; ++k) load_chunk(in[k], i, a[k]);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    float x[Op::kIn], y[Op::kOut];
#pragma unroll
    for (int k = 0; k < Op::kIn; ++k) x[k] = a[k][j];
    op(x, y);
#pragma unroll
    for (int k = 0; k < Op::kOut; ++k) b[k][j] = y[k];
  }
#pragma unroll
  for (int k = 0; k < Op::kOut; ++k) store_chunk(out[k], i, b[k]);
}

template <class T, class Op>
__global__ void elementwise_span_kernel(Views<T, Op> v, int64_t n, int64_t head, Op op) {
  constexpr int V = 16 / sizeof(T);
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t chunks = (n - head) / V;
  for (int64_t i = tid; i < chunks; i += stride) {
    const T* in[Op::kIn];
    T* out[Op::kOut];
#pragma unroll
    for (int k = 0; k < Op::kIn; ++k) in[k] = v.in[k] + head;
#pragma unroll
    for (int k = 0; k < Op::kOut; ++k) out[k] = v.out[k] + head;
    apply_chunk<T, V>(in, out, op, i);
  }
  const int64_t tail = head + chunks * V;  // head < V and n - tail < V
  if (tid < head) apply_flat(v, op, tid);
  if (tail + tid < n) apply_flat(v, op, tail + tid);
}

// Rows with their own strides (gate and up as the halves of a fused
// [N, 2H] projection, say) whose rows start at the same offset from a
// 16-byte boundary in every view (rows_same_offset16): per row a scalar
// head, 16-byte chunks and a scalar tail (Note [Row head and tail]).
// blockIdx.y strides over rows, the x dimension over chunks.
template <class T, class Op>
__global__ void elementwise_rows_vec_kernel(Views<T, Op> v, int64_t rows, int64_t cols, Op op) {
  constexpr int V = 16 / sizeof(T);
  const int64_t c0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t c_step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* in[Op::kIn];
    T* out[Op::kOut];
#pragma unroll
    for (int k = 0; k < Op::kIn; ++k) in[k] = v.in[k] + r * v.in_stride[k];
#pragma unroll
    for (int k = 0; k < Op::kOut; ++k) out[k] = v.out[k] + r * v.out_stride[k];
    const RowSplit s = split_row<T, V>(in[0], cols);
    if (c0 < s.head) apply_chunk<T, 1>(in, out, op, c0);
    if (c0 < s.tail) apply_chunk<T, 1>(in, out, op, s.head + s.chunks * V + c0);
#pragma unroll
    for (int k = 0; k < Op::kIn; ++k) in[k] += s.head;
#pragma unroll
    for (int k = 0; k < Op::kOut; ++k) out[k] += s.head;
    for (int64_t c = c0; c < s.chunks; c += c_step) apply_chunk<T, V>(in, out, op, c);
  }
}

// Any other layout: rows with their own strides, one element at a time.
// blockIdx.y strides over rows, the x dimension over columns.
template <class T, class Op>
__global__ void elementwise_rows_kernel(Views<T, Op> v, int64_t rows, int64_t cols, Op op) {
  const int64_t c0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t c_step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = c0; c < cols; c += c_step) {
      float a[Op::kIn], b[Op::kOut];
#pragma unroll
      for (int k = 0; k < Op::kIn; ++k) a[k] = to_f32(v.in[k][r * v.in_stride[k] + c]);
      op(a, b);
#pragma unroll
      for (int k = 0; k < Op::kOut; ++k) v.out[k][r * v.out_stride[k] + c] = from_f32<T>(b[k]);
    }
}

constexpr int kThreads = 256;

template <class T, class Op>
to_status elementwise_typed(const to_op_call* c, cudaStream_t stream, Op op) {
  Views<T, Op> v;
  const to_tensor* views[Op::kIn + Op::kOut];
  const int64_t rows = c->inputs[0].shape[0], cols = c->inputs[0].shape[1];
  bool contiguous = true, same_offset = true;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(element0<const T>(c->inputs[0])) % 16;
  auto note = [&](const to_tensor& t, int64_t& stride) {
    stride = t.strides[0];
    contiguous = contiguous && (rows == 1 || stride == cols);
    same_offset = same_offset && reinterpret_cast<uintptr_t>(element0<const T>(t)) % 16 == mis;
  };
  for (int k = 0; k < Op::kIn; ++k) {
    v.in[k] = element0<const T>(c->inputs[k]);
    views[k] = &c->inputs[k];
    note(c->inputs[k], v.in_stride[k]);
  }
  for (int k = 0; k < Op::kOut; ++k) {
    v.out[k] = element0<T>(c->outputs[k]);
    views[Op::kIn + k] = &c->outputs[k];
    note(c->outputs[k], v.out_stride[k]);
  }
  if (contiguous && same_offset && mis % sizeof(T) == 0) {
    constexpr int V = 16 / sizeof(T);
    const int64_t n = rows * cols;
    const int64_t head = std::min<int64_t>(n, int64_t((16 - mis) % 16 / sizeof(T)));
    const int64_t blocks = std::clamp<int64_t>(ceil_div((n - head) / V, kThreads), 1, kMaxGridBlocks);
    elementwise_span_kernel<T><<<unsigned(blocks), kThreads, 0, stream>>>(v, n, head, op);
  } else if (rows_same_offset16(views, Op::kIn + Op::kOut, sizeof(T))) {
    const dim3 grid(unsigned(std::clamp<int64_t>(ceil_div(cols / int64_t(16 / sizeof(T)), kThreads), 1, 64)),
                    unsigned(std::min<int64_t>(rows, kMaxGridBlocks)));
    elementwise_rows_vec_kernel<T><<<grid, kThreads, 0, stream>>>(v, rows, cols, op);
  } else {
    const dim3 grid(unsigned(std::min<int64_t>(ceil_div(cols, kThreads), 64)),
                    unsigned(std::min<int64_t>(rows, kMaxGridBlocks)));
    elementwise_rows_kernel<T><<<grid, kThreads, 0, stream>>>(v, rows, cols, op);
  }
  TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  return TO_OK;
}

template <class Op>
to_status launch_elementwise(const to_op_call* call, cudaStream_t stream, Op op) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return elementwise_typed<decltype(tag)>(call, stream, op); });
}

}  // namespace

to_status launch_silu(const to_op_call* call, cudaStream_t stream) {
  return launch_elementwise(call, stream, Activate{0});
}

// ints[0]: 0 erf, 1 tanh; as activation ids 1 and 2.
to_status launch_gelu(const to_op_call* call, cudaStream_t stream) {
  return launch_elementwise(call, stream, Activate{call->ints[0] == 1 ? 2 : 1});
}

to_status launch_activation_backward(const to_op_call* call, cudaStream_t stream) {
  return launch_elementwise(call, stream, ActivateBackward{int(call->ints[0])});
}

to_status launch_glu(const to_op_call* call, cudaStream_t stream) {
  return launch_elementwise(call, stream, Gated{int(call->ints[0])});
}

to_status launch_glu_backward(const to_op_call* call, cudaStream_t stream) {
  return launch_elementwise(call, stream, GatedBackward{int(call->ints[0])});
}

}  // namespace tensor_ops::gpu
