// The emulated GPU: device built-ins (thread / block indices, barriers, warp
// collectives, shared memory, atomics), kernel launch and the runtime API
// (memory, copies, streams, events, device properties), vendor neutral.
// cuda_runtime.h and hip/hip_runtime.h give it the CUDA and the HIP names.
//
// A launch runs every block of the grid in turn on the calling host thread;
// the threads of a block are fibers that run cooperatively and switch only at
// __syncthreads() and at warp collectives, in the order that
// TENSOR_OPS_EMU_SCHEDULE picks (inorder, reverse, interleaved). Work is
// queued in stream order and runs at the next synchronising call, so host code
// that reads a result before synchronising sees stale data.
#ifndef TENSOR_OPS_EMU_RUNTIME_H
#define TENSOR_OPS_EMU_RUNTIME_H

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emu/half.h"

#ifndef TENSOR_OPS_EMU_WARP
#define TENSOR_OPS_EMU_WARP 32
#endif

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

struct emuStream;
struct emuEvent;
// A stream-ordered memory pool: device allocations like cudaMallocAsync's
// (the emulator caches nothing); its attributes are kept and ignored.
struct emuMemPool {
  unsigned long long release_threshold = 0;
};

namespace emu {

// One error enum for both API flavours; the vendor headers name the values.
enum Error : int {
  kSuccess = 0,
  kInvalidValue = 1,
  kMemoryAllocation = 2,
  kInvalidConfiguration = 9,
  kInsufficientDriver = 35,
  kInvalidDeviceFunction = 98,
  kNoDevice = 100,
  kInvalidDevice = 101,
  kNoKernelImageForDevice = 209,
  kLaunchOutOfResources = 701,
  kLaunchFailure = 719,
  kNotSupported = 801,
};
enum MemcpyKind : int { kHostToHost = 0, kHostToDevice = 1, kDeviceToHost = 2, kDeviceToDevice = 3, kDefault = 4 };

struct DeviceProp {
  char name[256];
  size_t totalGlobalMem, sharedMemPerBlock;
  int warpSize, maxThreadsPerBlock, major, minor, multiProcessorCount, l2CacheSize;
  int pciDomainID, pciBusID, pciDeviceID;
  char gcnArchName[256];
};

// ---- runtime API (emu.cpp) ----
Error malloc_device(void** ptr, size_t bytes);
Error malloc_async(void** ptr, size_t bytes, emuStream* stream);
Error free_device(void* ptr);
Error free_async(void* ptr, emuStream* stream);
Error memcpy_sync(void* dst, const void* src, size_t bytes, MemcpyKind kind);
Error memcpy_async(void* dst, const void* src, size_t bytes, MemcpyKind kind, emuStream* stream);
Error memset_async(void* dst, int value, size_t bytes, emuStream* stream);
Error stream_synchronize(emuStream* stream);
Error device_synchronize();
Error event_create(emuEvent** event, unsigned flags);
Error event_destroy(emuEvent* event);
Error event_record(emuEvent* event, emuStream* stream);
Error stream_wait_event(emuStream* stream, emuEvent* event, unsigned flags);
Error get_last_error();
Error peek_at_last_error();
Error get_device_count(int* count);
Error get_device(int* device);
Error set_device(int device);
Error get_device_properties(DeviceProp* prop, int device);
Error mem_get_info(size_t* free_bytes, size_t* total_bytes);
Error runtime_get_version(int* v);
Error driver_get_version(int* v);
const char* error_name(Error e);
const char* error_string(Error e);

// ---- device side ----
struct Thread;
extern thread_local Thread* current_thread;
extern thread_local uint3 block_idx;
extern thread_local dim3 block_dim, grid_dim;
const uint3& thread_idx();
void syncthreads();
void* dynamic_shared_base();
bool shared_object(void* object, size_t bytes);
// A warp collective: every active lane of the calling lane's warp gives
// `value`; when all have, lane i gets result(i, values of all lanes, lanes).
// kind names the collective (lanes of one warp must agree on it).
uint64_t warp_collective(const char* kind, uint64_t mask, uint64_t value, int arg, int width);
void device_fault(const char* what);

template <class T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_base());
}

template <class T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type wider than 8 bytes");
  uint64_t u = 0;
  __builtin_memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T from_bits(uint64_t u) {
  T v;
  __builtin_memcpy(&v, &u, sizeof(T));
  return v;
}

// ---- launch ----
// Queues one launch: validates the configuration now (as the runtime does,
// for cudaGetLastError) and runs `body` for every thread of every block
// when the queue runs.
void enqueue_launch(const char* kernel, dim3 grid, dim3 block, size_t smem, emuStream* stream,
                    std::function<void()> body);

// What `kernel<<<grid, block, smem, stream>>>(args)` becomes (the build's
// rewrite): launcher("kernel", grid, block, smem, stream)(
//     [](auto... a) { kernel(a...); }, args)
// so that the kernel's template arguments are deduced from the call, as nvcc
// does. The arguments are copied at launch, as the runtime copies them, and
// every GPU thread gets its own copy.
struct LaunchConfig {
  const char* name;
  dim3 grid, block;
  size_t smem;
  emuStream* stream;
  template <class F, class... A>
  void operator()(F f, A&&... a) const {
    std::tuple<std::decay_t<A>...> args(std::forward<A>(a)...);
    enqueue_launch(name, grid, block, smem, stream, [f, args]() {
      std::tuple<std::decay_t<A>...> mine = args;
      std::apply(f, mine);
    });
  }
};

inline LaunchConfig launcher(const char* name, dim3 grid, dim3 block, size_t smem = 0, emuStream* stream = nullptr) {
  return LaunchConfig{name, grid, block, smem, stream};
}

}  // namespace emu

// ---- CUDA C++ device built-ins ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static shared memory: one object for the block (blocks run one at a time).
// build.py rewrites `__shared__ T name[N];` in the kernel sources into
// `static T name[N]; EMU_SHARED_OBJECT(name)`, which registers the object:
// every block starts with the registered objects filled with 0xff bytes (NaN
// in every float type), so a read before the block wrote never sees what an
// earlier block or launch left there.
#define __shared__ static
#define EMU_SHARED_OBJECT(name) \
  static const bool emu_shared_##name = ::emu::shared_object(&name, sizeof(name)); \
  (void)emu_shared_##name;
#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)
constexpr int warpSize = TENSOR_OPS_EMU_WARP;

inline void __syncthreads() { ::emu::syncthreads(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)::emu::warp_collective("__syncwarp", mask, 0, 0, 0); }

// a * b rounded to fp32, never contracted into an FMA (the barrier keeps the
// compiler from fusing it with what uses the product).
inline float __fmul_rn(float a, float b) {
  float r = a * b;
  __asm__("" : "+x"(r));
  return r;
}
inline float __fadd_rn(float a, float b) {
  float r = a + b;
  __asm__("" : "+x"(r));
  return r;
}
inline float __expf(float v) { return expf(v); }
inline float __logf(float v) { return logf(v); }
inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }
inline float __frcp_rn(float v) { return 1.0f / v; }

namespace emu {
enum ShflKind { kIdx, kUp, kDown, kXor };
template <class T>
T shfl(const char* kind, unsigned long long mask, T v, int arg, int width) {
  return from_bits<T>(warp_collective(kind, mask, to_bits(v), arg, width));
}
}  // namespace emu

// CUDA's (with a lane mask) ...
template <class T>
T __shfl_sync(unsigned long long mask, T v, int src, int width = warpSize) {
  return ::emu::shfl("shfl", mask, v, src, width);
}
template <class T>
T __shfl_xor_sync(unsigned long long mask, T v, int lane_mask, int width = warpSize) {
  return ::emu::shfl("shfl_xor", mask, v, lane_mask, width);
}
template <class T>
T __shfl_down_sync(unsigned long long mask, T v, unsigned delta, int width = warpSize) {
  return ::emu::shfl("shfl_down", mask, v, int(delta), width);
}
template <class T>
T __shfl_up_sync(unsigned long long mask, T v, unsigned delta, int width = warpSize) {
  return ::emu::shfl("shfl_up", mask, v, int(delta), width);
}
inline unsigned long long __ballot_sync(unsigned long long mask, int p) {
  return ::emu::warp_collective("ballot", mask, p != 0, 0, 0);
}
inline int __any_sync(unsigned long long mask, int p) { return ::emu::warp_collective("any", mask, p != 0, 0, 0) != 0; }
inline int __all_sync(unsigned long long mask, int p) { return ::emu::warp_collective("all", mask, p != 0, 0, 0) != 0; }
// ... and HIP's (the whole wavefront).
#define TENSOR_OPS_EMU_ALL_LANES (TENSOR_OPS_EMU_WARP == 64 ? ~0ull : 0xffffffffull)
template <class T>
T __shfl(T v, int src, int width = warpSize) {
  return ::emu::shfl("shfl", TENSOR_OPS_EMU_ALL_LANES, v, src, width);
}
template <class T>
T __shfl_xor(T v, int lane_mask, int width = warpSize) {
  return ::emu::shfl("shfl_xor", TENSOR_OPS_EMU_ALL_LANES, v, lane_mask, width);
}
template <class T>
T __shfl_down(T v, unsigned delta, int width = warpSize) {
  return ::emu::shfl("shfl_down", TENSOR_OPS_EMU_ALL_LANES, v, int(delta), width);
}
template <class T>
T __shfl_up(T v, unsigned delta, int width = warpSize) {
  return ::emu::shfl("shfl_up", TENSOR_OPS_EMU_ALL_LANES, v, int(delta), width);
}
inline unsigned long long __ballot(int p) { return __ballot_sync(TENSOR_OPS_EMU_ALL_LANES, p); }
inline int __any(int p) { return __any_sync(TENSOR_OPS_EMU_ALL_LANES, p); }
inline int __all(int p) { return __all_sync(TENSOR_OPS_EMU_ALL_LANES, p); }

// Atomics: fibers of a block never run at once and blocks run in turn, so a
// plain read-modify-write is atomic here.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
T atomicSub(T* p, T v) {
  const T old = *p;
  *p = old - v;
  return old;
}
template <class T>
T atomicMax(T* p, T v) {
  const T old = *p;
  *p = old < v ? v : old;
  return old;
}
template <class T>
T atomicMin(T* p, T v) {
  const T old = *p;
  *p = v < old ? v : old;
  return old;
}
template <class T>
T atomicExch(T* p, T v) {
  const T old = *p;
  *p = v;
  return old;
}
template <class T>
T atomicCAS(T* p, T compare, T v) {
  const T old = *p;
  if (old == compare) *p = v;
  return old;
}
template <class T>
T atomicOr(T* p, T v) {
  const T old = *p;
  *p = old | v;
  return old;
}
template <class T>
T atomicAnd(T* p, T v) {
  const T old = *p;
  *p = old & v;
  return old;
}

#endif
