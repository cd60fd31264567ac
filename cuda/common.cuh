// Shared by every file in cuda/, in both builds: the CUDA plugin (nvcc + the
// host compiler) and the HIP plugin (the same files compiled as HIP, with
// TENSOR_OPS_HIP defined and the CUDA names mapped by hip/vendor.h).
#ifndef TENSOR_OPS_CUDA_COMMON_CUH
#define TENSOR_OPS_CUDA_COMMON_CUH

#ifdef TENSOR_OPS_HIP
#include "../hip/vendor.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define TENSOR_OPS_GPU_NAME "CUDA"
#define TENSOR_OPS_GPU_API "cuda"
#define TENSOR_OPS_WARP_SIZE 32
#define TENSOR_OPS_GPU_PRIORITY 100
#endif

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "tensor_ops/plugin.h"

namespace tensor_ops::gpu {

// Records "<call> returned <code> (<name>: <text>) at <file>:<line>" as this
// thread's last error and reads the runtime's pending copy of it, so the next
// launch check (cudaGetLastError) does not report it again. Returns the
// status the code maps to (TO_ERR_OUT_OF_MEMORY for allocation failures).
to_status fail(const char* call, cudaError_t code, const char* file, int line);
// Records a message that is not a vendor error (a bad argument, say).
to_status fail(to_status status, const std::string& message);

// One check for every vendor call: never aborts, always returns a status.
#define TENSOR_OPS_CUDA_CHECK(call)                                                \
  do {                                                                             \
    const cudaError_t tensor_ops_err_ = (call);                                    \
    if (tensor_ops_err_ != cudaSuccess)                                            \
      return ::tensor_ops::gpu::fail(#call, tensor_ops_err_, __FILE__, __LINE__);  \
  } while (0)

// Makes a device current for one call and restores the caller's afterwards:
// torch and other frameworks in the same process keep their current device.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);  // nothing to report it to here
  }
  to_status enter(int device) {
    TENSOR_OPS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      TENSOR_OPS_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
    return TO_OK;
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Element 0 of a view (byte_offset is 0 for pointer devices, honoured anyway).
template <class T>
inline T* element0(const to_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Block sizes are multiples of 64 so that they hold whole warps on every
// target: 32-wide NVIDIA warps, wave32 (RDNA) and wave64 (CDNA) on AMD.
constexpr int kBlockMultiple = 64;
constexpr int kMaxBlockThreads = 1024;
// Grids stop here and kernels stride over the rest (gridDim.y's limit too).
constexpr int64_t kMaxGridBlocks = 65535;

// Runs f(T{}) with T the storage type for a to_dtype.
template <class F>
to_status with_dtype(int32_t dtype, F&& f) {
  switch (dtype) {
    case TO_FLOAT32: return f(float{});
    case TO_FLOAT16: return f(__half{});
    case TO_BFLOAT16: return f(__nv_bfloat16{});
  }
  return fail(TO_ERR_UNSUPPORTED, "dtype " + std::to_string(dtype) + " is not float32, float16 or bfloat16");
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads for one block per row: enough for one chunk each up to 1024, whole 64s.
inline int row_block_threads(int64_t chunks) {
  const int64_t n = ceil_div(chunks, kBlockMultiple) * kBlockMultiple;
  return int(n < kBlockMultiple ? kBlockMultiple : (n > kMaxBlockThreads ? kMaxBlockThreads : n));
}

// Blocks for one block per row; kernels stride over the rows past the grid.
inline unsigned row_blocks(int64_t rows) { return unsigned(rows < kMaxGridBlocks ? rows : kMaxGridBlocks); }

// Whether the row kernels may move 16-byte chunks: every view's element 0 and
// row stride (when there is more than one row) on 16-byte boundaries and cols
// a whole number of chunks. Absent optional views (data == NULL) pass.
inline bool rows_aligned16(std::initializer_list<const to_tensor*> views, size_t item) {
  for (const to_tensor* t : views) {
    if (!t->data) continue;
    const int64_t chunk = int64_t(16 / item);
    if (t->shape[1] % chunk != 0 || !aligned16(element0<const char>(*t))) return false;
    if (t->shape[0] > 1 && t->strides[0] % chunk != 0) return false;
  }
  return true;
}

// Runs f(std::integral_constant<int, V>{}) with V = 16 / sizeof(T) (16-byte
// chunks) when vec, else V = 1: both paths of one kernel.
template <class T, class F>
to_status with_chunk(bool vec, F&& f) {
  if (vec) return f(std::integral_constant<int, int(16 / sizeof(T))>{});
  return f(std::integral_constant<int, 1>{});
}

// The plugin's stream-ordered memory pool for scratch on the current device,
// created on first use. Its release threshold keeps up to kScratchKeepBytes
// of freed scratch reserved across synchronizations, so the next call reuses
// it (the device's default pool has threshold 0: every synchronize hands it
// back and the next call maps it again). The core's caching pool is on the
// other side of the plugin ABI, out of reach here. *pool is null where the
// device has no memory pools (cudaErrorNotSupported).
constexpr unsigned long long kScratchKeepBytes = 256ull << 20;
to_status scratch_pool(cudaMemPool_t* pool);

// Stream-ordered device memory for one call (partial sums): from
// scratch_pool() where the device has memory pools, else cudaMalloc. Freed in
// stream order when the owner goes out of scope.
class DeviceScratch {
 public:
  explicit DeviceScratch(cudaStream_t stream) : stream_(stream) {}
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    if (!ptr_) return;
    // Nothing to report a failure to here; the next call's check sees it.
    if (async_)
      (void)cudaFreeAsync(ptr_, stream_);
    else
      (void)cudaFree(ptr_);  // waits for the device, so the kernels are done
  }
  to_status allocate(size_t bytes) {
    cudaMemPool_t pool = nullptr;
    if (to_status s = scratch_pool(&pool); s != TO_OK) return s;
    async_ = pool != nullptr;
    const cudaError_t err = async_ ? cudaMallocFromPoolAsync(&ptr_, bytes, pool, stream_) : cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      return fail(async_ ? "cudaMallocFromPoolAsync(&ptr, bytes, pool, stream)" : "cudaMalloc(&ptr, bytes)", err,
                  __FILE__, __LINE__);
    }
    return TO_OK;
  }
  template <class T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  bool async_ = true;
};

// The kernels that index tables with values from the data (rope's positions,
// cross-entropy's targets) raise a flag in device memory for a bad one. The
// flag is sticky, one per device and kind: a call neither waits for its
// kernel nor copies anything back (the host runs ahead, and the call can be
// captured in a CUDA graph). The next synchronizing call of this plugin on
// that device (a copy, a memset or synchronize(): where results reach the
// host; for host arrays, the copy of the same call's output) reads the
// flags, clears them and fails with InvalidArgument and the message of the
// last call of that kind (the CPU backend's text, naming the op and the
// table's range) plus where it was reported.
enum class BadIndex { position = 0, target = 1 };
constexpr int kBadIndexKinds = 2;

class BadIndexFlag {
 public:
  explicit BadIndexFlag(BadIndex kind) : kind_(kind) {}
  // The current device's flag (allocated and zeroed on its first use; kept
  // until the process ends); message is what a raise reports.
  to_status arm(const std::string& message);
  int* device() const { return flag_; }

 private:
  BadIndex kind_;
  int* flag_ = nullptr;
};

// After the device synchronized (gpu_copy, gpu_memset, gpu_synchronize):
// fails with the message of any flag raised since the last report on this
// device, and clears them.
to_status report_bad_indices(int32_t device);

// Kernel launchers, one per op (norm.cu, activation.cu, softmax.cu, rope.cu,
// attention.cu): the core has validated the call.
to_status launch_rms_norm(const to_op_call* call, cudaStream_t stream);
to_status launch_layer_norm(const to_op_call* call, cudaStream_t stream);
to_status launch_add_rms_norm(const to_op_call* call, cudaStream_t stream);
to_status launch_rms_norm_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_layer_norm_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_silu(const to_op_call* call, cudaStream_t stream);
to_status launch_gelu(const to_op_call* call, cudaStream_t stream);
to_status launch_activation_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_glu(const to_op_call* call, cudaStream_t stream);
to_status launch_glu_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_softmax(const to_op_call* call, cudaStream_t stream);
to_status launch_softmax_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_cross_entropy(const to_op_call* call, cudaStream_t stream);
to_status launch_rope(const to_op_call* call, cudaStream_t stream);
to_status launch_attention(const to_op_call* call, cudaStream_t stream);
to_status launch_attention_backward(const to_op_call* call, cudaStream_t stream);

#if defined(__CUDACC__) || defined(__HIPCC__)

constexpr int kWarpSize = TENSOR_OPS_WARP_SIZE;
// Reductions keep one slot per warp; 1024 threads of the narrowest warp (32).
constexpr int kMaxWarps = kMaxBlockThreads / 32;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// a * b rounded to fp32 and never contracted into an FMA with what uses it
// (nvcc and hipcc both contract by default): for differences that must
// cancel exactly against a sum of the same rounded products.
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef TENSOR_OPS_HIP
#pragma clang fp contract(off)
  return a * b;  // HIP's __fmul_rn is a plain a * b, contractable
#else
  return __fmul_rn(a, b);
#endif
}

// V elements moved as one load / store: V = 16 / sizeof(T) gives 16-byte
// accesses, V = 1 the scalar path of the same kernel.
template <class T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

constexpr float kNegInf = -__builtin_inff();

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Chunk i (V elements) of a row, as fp32, and back.
template <class T, int V>
__device__ __forceinline__ void load_chunk(const T* row, int64_t i, float (&out)[V]) {
  const Vec<T, V> c = reinterpret_cast<const Vec<T, V>*>(row)[i];
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = to_f32(c.v[k]);
}

template <class T, int V>
__device__ __forceinline__ void store_chunk(T* row, int64_t i, const float (&in)[V]) {
  Vec<T, V> c;
#pragma unroll
  for (int k = 0; k < V; ++k) c.v[k] = from_f32<T>(in[k]);
  reinterpret_cast<Vec<T, V>*>(row)[i] = c;
}

// The row kernels (norms, softmax, cross-entropy) keep a row of up to
// blockDim.x * kRowChunks<T> chunks in registers (chunks threadIdx.x + c *
// blockDim.x), so it is read from global memory once; a longer row is read
// again per pass. 16 fp32 values a thread: 4 chunks of fp32, 2 of 16-bit
// types (more spill under the 1024-thread launch bound).
template <class T>
constexpr int kRowChunks = sizeof(T) == 4 ? 4 : 2;

// Runs f(i, chunk) over this thread's chunks of a row: from the registers a
// (loading them first when load), or streaming each from row.
template <class T, int V, class F>
__device__ __forceinline__ void for_chunks(bool in_registers, bool load, const T* row, int64_t chunks,
                                           float (&a)[kRowChunks<T>][V], F&& f) {
  if (in_registers) {
#pragma unroll
    for (int c = 0; c < kRowChunks<T>; ++c) {
      const int64_t i = threadIdx.x + int64_t(c) * blockDim.x;
      if (i >= chunks) break;
      if (load) load_chunk(row, i, a[c]);
      f(i, a[c]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float b[V];
      load_chunk(row, i, b);
      f(i, b);
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block, returned to every thread. blockDim.x is a multiple of
// kWarpSize. Safe to call again at once (the result has its own slot).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kMaxWarps];
  __shared__ float total;
  const int lane = int(threadIdx.x) % kWarpSize, warp = int(threadIdx.x) / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = int(blockDim.x) / kWarpSize;
    v = warp_sum(lane < warps ? partial[lane] : 0.0f);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// Maximum over the block, as block_sum.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[kMaxWarps];
  __shared__ float total;
  const int lane = int(threadIdx.x) % kWarpSize, warp = int(threadIdx.x) / kWarpSize;
  v = warp_max(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = int(blockDim.x) / kWarpSize;
    v = warp_max(lane < warps ? partial[lane] : kNegInf);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// Merges per-thread online-softmax states (max m, sum s of exp(v - m)) over
// the block: returns the row max, *sum gets the sum of exp(v - max).
__device__ __forceinline__ float block_max_sum(float m, float s, float* sum) {
  const float row_max = block_max(m);
  // s == 0: nothing seen (m may be -inf); never exp(-inf - -inf).
  *sum = block_sum(s == 0.0f ? 0.0f : s * expf(m - row_max));
  return row_max;
}

// One online-softmax step: v joins the state (m, s).
__device__ __forceinline__ void online_add(float v, float& m, float& s) {
  if (v > m) {
    s = s * expf(m - v) + 1.0f;
    m = v;
  } else if (v != kNegInf) {  // -inf adds nothing (and -inf - -inf is NaN)
    s += expf(v - m);
  }
}

#endif  // device code

}  // namespace tensor_ops::gpu

#endif
