// Emulator stand-in for the CUDA runtime API (see ../README.md): the names
// cuda/ uses (and a few more), over emu/runtime.h.
#ifndef TENSOR_OPS_EMU_CUDA_RUNTIME_H
#define TENSOR_OPS_EMU_CUDA_RUNTIME_H

#include "emu/runtime.h"

typedef ::emu::Error cudaError_t;
typedef ::emu::MemcpyKind cudaMemcpyKind;
typedef ::emu::DeviceProp cudaDeviceProp;
typedef emuStream* cudaStream_t;
typedef emuEvent* cudaEvent_t;

constexpr cudaError_t cudaSuccess = ::emu::kSuccess;
constexpr cudaError_t cudaErrorInvalidValue = ::emu::kInvalidValue;
constexpr cudaError_t cudaErrorMemoryAllocation = ::emu::kMemoryAllocation;
constexpr cudaError_t cudaErrorInvalidConfiguration = ::emu::kInvalidConfiguration;
constexpr cudaError_t cudaErrorInsufficientDriver = ::emu::kInsufficientDriver;
constexpr cudaError_t cudaErrorInvalidDeviceFunction = ::emu::kInvalidDeviceFunction;
constexpr cudaError_t cudaErrorNoDevice = ::emu::kNoDevice;
constexpr cudaError_t cudaErrorInvalidDevice = ::emu::kInvalidDevice;
constexpr cudaError_t cudaErrorNoKernelImageForDevice = ::emu::kNoKernelImageForDevice;
constexpr cudaError_t cudaErrorLaunchOutOfResources = ::emu::kLaunchOutOfResources;
constexpr cudaError_t cudaErrorLaunchFailure = ::emu::kLaunchFailure;
constexpr cudaError_t cudaErrorNotSupported = ::emu::kNotSupported;
constexpr cudaMemcpyKind cudaMemcpyHostToHost = ::emu::kHostToHost;
constexpr cudaMemcpyKind cudaMemcpyHostToDevice = ::emu::kHostToDevice;
constexpr cudaMemcpyKind cudaMemcpyDeviceToHost = ::emu::kDeviceToHost;
constexpr cudaMemcpyKind cudaMemcpyDeviceToDevice = ::emu::kDeviceToDevice;
constexpr cudaMemcpyKind cudaMemcpyDefault = ::emu::kDefault;
constexpr unsigned cudaEventDefault = 0, cudaEventDisableTiming = 2;

inline cudaError_t cudaMalloc(void** p, size_t n) { return ::emu::malloc_device(p, n); }
template <class T>
cudaError_t cudaMalloc(T** p, size_t n) {
  return ::emu::malloc_device(reinterpret_cast<void**>(p), n);
}
inline cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t s) { return ::emu::malloc_async(p, n, s); }
inline cudaError_t cudaFree(void* p) { return ::emu::free_device(p); }
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t s) { return ::emu::free_async(p, s); }
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  return ::emu::memcpy_sync(d, s, n, k);
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t st = nullptr) {
  return ::emu::memcpy_async(d, s, n, k, st);
}
// cudaMemset is asynchronous for device memory: queued on the default stream.
inline cudaError_t cudaMemset(void* d, int v, size_t n) { return ::emu::memset_async(d, v, n, nullptr); }
inline cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t s = nullptr) {
  return ::emu::memset_async(d, v, n, s);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) { return ::emu::stream_synchronize(s); }
inline cudaError_t cudaDeviceSynchronize() { return ::emu::device_synchronize(); }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned f) { return ::emu::event_create(e, f); }
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return ::emu::event_create(e, 0); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { return ::emu::event_destroy(e); }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) { return ::emu::event_record(e, s); }
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f = 0) {
  return ::emu::stream_wait_event(s, e, f);
}
inline cudaError_t cudaGetLastError() { return ::emu::get_last_error(); }
inline cudaError_t cudaPeekAtLastError() { return ::emu::peek_at_last_error(); }
inline cudaError_t cudaGetDeviceCount(int* n) { return ::emu::get_device_count(n); }
inline cudaError_t cudaGetDevice(int* d) { return ::emu::get_device(d); }
inline cudaError_t cudaSetDevice(int d) { return ::emu::set_device(d); }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) { return ::emu::get_device_properties(p, d); }
inline cudaError_t cudaMemGetInfo(size_t* f, size_t* t) { return ::emu::mem_get_info(f, t); }
inline cudaError_t cudaRuntimeGetVersion(int* v) { return ::emu::runtime_get_version(v); }
inline cudaError_t cudaDriverGetVersion(int* v) { return ::emu::driver_get_version(v); }
inline const char* cudaGetErrorName(cudaError_t e) { return ::emu::error_name(e); }
inline const char* cudaGetErrorString(cudaError_t e) { return ::emu::error_string(e); }

// Memory pools (cudaMemPoolCreate and what DeviceScratch uses of them).
typedef emuMemPool* cudaMemPool_t;
enum cudaMemAllocationType { cudaMemAllocationTypeInvalid = 0, cudaMemAllocationTypePinned = 1 };
enum cudaMemLocationType { cudaMemLocationTypeInvalid = 0, cudaMemLocationTypeDevice = 1 };
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 };
struct cudaMemLocation {
  cudaMemLocationType type;
  int id;
};
struct cudaMemPoolProps {
  cudaMemAllocationType allocType;
  int handleTypes;
  cudaMemLocation location;
  void* win32SecurityAttributes;
  unsigned char reserved[64];
};
inline cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
  if (!pool || !props || props->allocType != cudaMemAllocationTypePinned ||
      props->location.type != cudaMemLocationTypeDevice)
    return ::emu::kInvalidValue;
  *pool = new emuMemPool();
  return ::emu::kSuccess;
}
inline cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (!pool || attr != cudaMemPoolAttrReleaseThreshold || !value) return ::emu::kInvalidValue;
  pool->release_threshold = *static_cast<unsigned long long*>(value);
  return ::emu::kSuccess;
}
inline cudaError_t cudaMallocFromPoolAsync(void** p, size_t n, cudaMemPool_t pool, cudaStream_t s) {
  if (!pool) return ::emu::kInvalidValue;
  return ::emu::malloc_async(p, n, s);
}

#endif
