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
#include <string>

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

// Kernel launchers (norm.cu, activation.cu): the core has validated the call.
to_status launch_rms_norm(const to_op_call* call, cudaStream_t stream);
to_status launch_silu(const to_op_call* call, cudaStream_t stream);
to_status launch_gelu(const to_op_call* call, cudaStream_t stream);

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

// V elements moved as one load / store: V = 16 / sizeof(T) gives 16-byte
// accesses, V = 1 the scalar path of the same kernel.
template <class T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
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

#endif  // device code

}  // namespace tensor_ops::gpu

#endif
