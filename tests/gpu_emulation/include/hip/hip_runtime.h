// Emulator stand-in for the HIP runtime API (see ../../README.md): the names
// hip/ uses (and a few more), over emu/runtime.h.
#ifndef TENSOR_OPS_EMU_HIP_RUNTIME_H
#define TENSOR_OPS_EMU_HIP_RUNTIME_H

#include "../emu/runtime.h"

typedef ::emu::Error hipError_t;
typedef ::emu::MemcpyKind hipMemcpyKind;
typedef ::emu::DeviceProp hipDeviceProp_t;
typedef emuStream* hipStream_t;
typedef emuEvent* hipEvent_t;

constexpr hipError_t hipSuccess = ::emu::kSuccess;
constexpr hipError_t hipErrorInvalidValue = ::emu::kInvalidValue;
constexpr hipError_t hipErrorOutOfMemory = ::emu::kMemoryAllocation;
constexpr hipError_t hipErrorInvalidConfiguration = ::emu::kInvalidConfiguration;
constexpr hipError_t hipErrorInsufficientDriver = ::emu::kInsufficientDriver;
constexpr hipError_t hipErrorInvalidDeviceFunction = ::emu::kInvalidDeviceFunction;
constexpr hipError_t hipErrorNoDevice = ::emu::kNoDevice;
constexpr hipError_t hipErrorInvalidDevice = ::emu::kInvalidDevice;
constexpr hipError_t hipErrorNoBinaryForGpu = ::emu::kNoKernelImageForDevice;
constexpr hipError_t hipErrorLaunchOutOfResources = ::emu::kLaunchOutOfResources;
constexpr hipError_t hipErrorLaunchFailure = ::emu::kLaunchFailure;
constexpr hipError_t hipErrorNotSupported = ::emu::kNotSupported;
constexpr hipMemcpyKind hipMemcpyHostToHost = ::emu::kHostToHost;
constexpr hipMemcpyKind hipMemcpyHostToDevice = ::emu::kHostToDevice;
constexpr hipMemcpyKind hipMemcpyDeviceToHost = ::emu::kDeviceToHost;
constexpr hipMemcpyKind hipMemcpyDeviceToDevice = ::emu::kDeviceToDevice;
constexpr hipMemcpyKind hipMemcpyDefault = ::emu::kDefault;
constexpr unsigned hipEventDefault = 0, hipEventDisableTiming = 2;

inline hipError_t hipMalloc(void** p, size_t n) { return ::emu::malloc_device(p, n); }
template <class T>
hipError_t hipMalloc(T** p, size_t n) {
  return ::emu::malloc_device(reinterpret_cast<void**>(p), n);
}
inline hipError_t hipMallocAsync(void** p, size_t n, hipStream_t s) { return ::emu::malloc_async(p, n, s); }
inline hipError_t hipFree(void* p) { return ::emu::free_device(p); }
inline hipError_t hipFreeAsync(void* p, hipStream_t s) { return ::emu::free_async(p, s); }
inline hipError_t hipMemcpy(void* d, const void* s, size_t n, hipMemcpyKind k) {
  return ::emu::memcpy_sync(d, s, n, k);
}
inline hipError_t hipMemcpyAsync(void* d, const void* s, size_t n, hipMemcpyKind k, hipStream_t st = nullptr) {
  return ::emu::memcpy_async(d, s, n, k, st);
}
// hipMemset is asynchronous for device memory: queued on the default stream.
inline hipError_t hipMemset(void* d, int v, size_t n) { return ::emu::memset_async(d, v, n, nullptr); }
inline hipError_t hipMemsetAsync(void* d, int v, size_t n, hipStream_t s = nullptr) {
  return ::emu::memset_async(d, v, n, s);
}
inline hipError_t hipStreamSynchronize(hipStream_t s) { return ::emu::stream_synchronize(s); }
inline hipError_t hipDeviceSynchronize() { return ::emu::device_synchronize(); }
inline hipError_t hipEventCreateWithFlags(hipEvent_t* e, unsigned f) { return ::emu::event_create(e, f); }
inline hipError_t hipEventCreate(hipEvent_t* e) { return ::emu::event_create(e, 0); }
inline hipError_t hipEventDestroy(hipEvent_t e) { return ::emu::event_destroy(e); }
inline hipError_t hipEventRecord(hipEvent_t e, hipStream_t s = nullptr) { return ::emu::event_record(e, s); }
inline hipError_t hipStreamWaitEvent(hipStream_t s, hipEvent_t e, unsigned f = 0) {
  return ::emu::stream_wait_event(s, e, f);
}
inline hipError_t hipGetLastError() { return ::emu::get_last_error(); }
inline hipError_t hipPeekAtLastError() { return ::emu::peek_at_last_error(); }
inline hipError_t hipGetDeviceCount(int* n) { return ::emu::get_device_count(n); }
inline hipError_t hipGetDevice(int* d) { return ::emu::get_device(d); }
inline hipError_t hipSetDevice(int d) { return ::emu::set_device(d); }
inline hipError_t hipGetDeviceProperties(hipDeviceProp_t* p, int d) { return ::emu::get_device_properties(p, d); }
inline hipError_t hipMemGetInfo(size_t* f, size_t* t) { return ::emu::mem_get_info(f, t); }
inline hipError_t hipRuntimeGetVersion(int* v) { return ::emu::runtime_get_version(v); }
inline hipError_t hipDriverGetVersion(int* v) { return ::emu::driver_get_version(v); }
inline const char* hipGetErrorName(hipError_t e) { return ::emu::error_name(e); }
inline const char* hipGetErrorString(hipError_t e) { return ::emu::error_string(e); }

// Memory pools (cudaMemPoolCreate and what DeviceScratch uses of them).
typedef emuMemPool* hipMemPool_t;
enum hipMemAllocationType { hipMemAllocationTypeInvalid = 0, hipMemAllocationTypePinned = 1 };
enum hipMemLocationType { hipMemLocationTypeInvalid = 0, hipMemLocationTypeDevice = 1 };
enum hipMemPoolAttr { hipMemPoolAttrReleaseThreshold = 4 };
struct hipMemLocation {
  hipMemLocationType type;
  int id;
};
struct hipMemPoolProps {
  hipMemAllocationType allocType;
  int handleTypes;
  hipMemLocation location;
  void* win32SecurityAttributes;
  unsigned char reserved[64];
};
inline hipError_t hipMemPoolCreate(hipMemPool_t* pool, const hipMemPoolProps* props) {
  if (!pool || !props || props->allocType != hipMemAllocationTypePinned ||
      props->location.type != hipMemLocationTypeDevice)
    return ::emu::kInvalidValue;
  *pool = new emuMemPool();
  return ::emu::kSuccess;
}
inline hipError_t hipMemPoolSetAttribute(hipMemPool_t pool, hipMemPoolAttr attr, void* value) {
  if (!pool || attr != hipMemPoolAttrReleaseThreshold || !value) return ::emu::kInvalidValue;
  pool->release_threshold = *static_cast<unsigned long long*>(value);
  return ::emu::kSuccess;
}
inline hipError_t hipMallocFromPoolAsync(void** p, size_t n, hipMemPool_t pool, hipStream_t s) {
  if (!pool) return ::emu::kInvalidValue;
  return ::emu::malloc_async(p, n, s);
}

#endif
