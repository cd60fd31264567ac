// The CUDA backend's plugin table (and, compiled as HIP, the HIP backend's):
// runtime probing, devices, memory, copies and the kernel entries.
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "common.cuh"
#include "tensor_ops/ops.h"

#ifndef TENSOR_OPS_GPU_ARCHS
#define TENSOR_OPS_GPU_ARCHS "unknown"
#endif

namespace tensor_ops::gpu {
namespace {

thread_local std::string last_error_text;

void copy_str(char* dst, size_t n, const std::string& s) { std::snprintf(dst, n, "%s", s.c_str()); }

// The call as written in cuda/, named as the runtime that ran it: the HIP
// build compiles "cudaMalloc(...)" into hipMalloc.
std::string api_call(const char* call) {
  std::string s = call;
  if (s.rfind("cuda", 0) == 0) s.replace(0, 4, TENSOR_OPS_GPU_API);
  return s;
}

std::string describe(cudaError_t code) {
  return std::to_string(int(code)) + " (" + cudaGetErrorName(code) + ": " + cudaGetErrorString(code) + ")";
}

// Versions come as 1000 * major + 10 * minor (CUDA) or HIP_VERSION's
// 10^7 * major + 10^5 * minor + patch.
std::string version_str(int v) {
#ifdef TENSOR_OPS_HIP
  return std::to_string(v / 10000000) + "." + std::to_string(v / 100000 % 100) + "." + std::to_string(v % 100000);
#else
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
#endif
}

std::string runtime_version() {
  int v = 0;
  return cudaRuntimeGetVersion(&v) == cudaSuccess ? version_str(v) : "unknown";
}

std::string driver_version() {
  int v = 0;  // 0 when no driver is installed
  return cudaDriverGetVersion(&v) == cudaSuccess && v > 0 ? version_str(v) : "none";
}

to_status gpu_init(char* reason, size_t reason_len) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && count > 0) return TO_OK;
  const std::string returned = api_call("cudaGetDeviceCount") + " returned " + std::to_string(int(err)) + " (" +
                               cudaGetErrorName(err) + ")" + (err == cudaSuccess ? " and 0 devices" : "");
  const std::string versions = "driver " + driver_version() + ", runtime " + runtime_version();
  std::string why;
  if (err == cudaErrorInsufficientDriver)
    why = TENSOR_OPS_GPU_NAME " driver not found or too old (" + versions + "): " + returned;
  else if (err == cudaErrorNoDevice || err == cudaSuccess)
    why = "no " TENSOR_OPS_GPU_NAME " device found (" + versions + "): " + returned;
  else
    why = TENSOR_OPS_GPU_NAME " runtime failed to start (" + versions + "): " + returned + ": " +
          cudaGetErrorString(err);
  (void)cudaGetLastError();  // clears the error it just reported
  copy_str(reason, reason_len, why);
  return TO_ERR_BACKEND_UNAVAILABLE;
}

int32_t gpu_priority() { return TENSOR_OPS_GPU_PRIORITY; }

int32_t gpu_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clears the error it just reported
    return 0;
  }
  return count;
}

to_status gpu_device_info(int32_t device, to_device_info* out) {
  cudaDeviceProp p{};
  TENSOR_OPS_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  *out = to_device_info{};
  copy_str(out->name, sizeof(out->name), p.name);
  out->device_type = TO_DEVICE_GPU;
  out->total_memory_bytes = uint64_t(p.totalGlobalMem);
  out->is_available = 1;
  copy_str(out->driver_version, sizeof(out->driver_version), driver_version() + " (runtime " + runtime_version() + ")");
#ifdef TENSOR_OPS_HIP
  // The gfx target says what an AMD GPU can run; major.minor does not.
  const std::string arch = p.gcnArchName;
  const std::string target = arch.substr(0, arch.find(':'));
  const bool fp8 = target.rfind("gfx94", 0) == 0 || target.rfind("gfx95", 0) == 0 || target.rfind("gfx12", 0) == 0;
  copy_str(out->vendor, sizeof(out->vendor), "AMD");
  copy_str(out->compute_capability, sizeof(out->compute_capability), target);
  std::string props = "gcn_arch=" + arch + "\ncompute_units=" + std::to_string(p.multiProcessorCount);
#else
  const int cc = p.major * 10 + p.minor;
  const bool fp8 = cc >= 89;
  copy_str(out->vendor, sizeof(out->vendor), "NVIDIA");
  copy_str(out->compute_capability, sizeof(out->compute_capability),
           std::to_string(p.major) + "." + std::to_string(p.minor));
  std::string props = "sm_count=" + std::to_string(p.multiProcessorCount);
#endif
  char pci[32];  // as nvidia-smi / rocm-smi print it
  std::snprintf(pci, sizeof(pci), "%04x:%02x:%02x.0", unsigned(p.pciDomainID), unsigned(p.pciBusID),
                unsigned(p.pciDeviceID));
  // Kernels keep fp16 / bf16 as storage and compute in fp32: every device
  // the build targets runs all three dtypes.
  props += "\nbf16=1\nfp16=1\nfp8=" + std::to_string(int(fp8)) + "\nwarp_size=" + std::to_string(p.warpSize) +
           "\nl2_bytes=" + std::to_string(p.l2CacheSize) + "\nshared_mem_per_block=" +
           std::to_string(p.sharedMemPerBlock) + "\nmax_threads_per_block=" + std::to_string(p.maxThreadsPerBlock) +
           "\npci_bus_id=" + pci + "\nruntime_version=" + runtime_version() + "\ndriver_version=" + driver_version() +
           "\nbuilt_for=" TENSOR_OPS_GPU_ARCHS;
  copy_str(out->properties, sizeof(out->properties), props);
  return TO_OK;
}

to_status gpu_mem_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes) {
  DeviceGuard guard;
  if (to_status s = guard.enter(device); s != TO_OK) return s;
  size_t free_b = 0, total_b = 0;
  TENSOR_OPS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  *free_bytes = free_b;
  *total_bytes = total_b;
  return TO_OK;
}

to_status gpu_allocate(int32_t device, size_t bytes, void** ptr) {
  *ptr = nullptr;
  if (bytes == 0) return TO_OK;
  DeviceGuard guard;
  if (to_status s = guard.enter(device); s != TO_OK) return s;
  TENSOR_OPS_CUDA_CHECK(cudaMalloc(ptr, bytes));
  return TO_OK;
}

// No status to return: a failure is kept as the last error for the log.
void gpu_deallocate(int32_t device, void* ptr, size_t) {
  if (!ptr) return;
  DeviceGuard guard;
  if (guard.enter(device) != TO_OK) return;
  const cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) fail("cudaFree(ptr)", err, __FILE__, __LINE__);
}

// The sticky bad-index flags (common.cuh, BadIndexFlag): per device, an int
// per kind in device memory, the message of the last call of each kind, and
// whether a call has used them since the last report (only then does a
// synchronizing call read them back).
constexpr int kMaxFlagDevices = 64;
struct BadIndexFlags {
  int* flags = nullptr;
  std::string message[kBadIndexKinds];
  bool armed = false;
};
std::mutex bad_index_mutex;
BadIndexFlags bad_index_flags[kMaxFlagDevices];

// scratch_pool()'s pools, per device: tried once; null where unsupported.
struct ScratchPool {
  bool tried = false;
  cudaMemPool_t pool = nullptr;
};
std::mutex scratch_pool_mutex;
ScratchPool scratch_pools[kMaxFlagDevices];

// Blocking, as the ABI asks: cudaMemcpy returns early for device-to-device
// copies and cudaMemset for device memory, so those wait for the default
// stream (which also orders them after kernels launched on it).
to_status gpu_copy(int32_t device, void* dst, uint64_t dst_offset, const void* src, uint64_t src_offset,
                   size_t bytes, int32_t kind) {
  static const cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice};
  if (kind < 0 || kind > 2)
    return fail(TO_ERR_INVALID_ARGUMENT, "copy kind " + std::to_string(kind) + " is not 0 (h2d), 1 (d2h) or 2 (d2d)");
  if (bytes == 0) return TO_OK;
  DeviceGuard guard;
  if (to_status s = guard.enter(device); s != TO_OK) return s;
  TENSOR_OPS_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + dst_offset, static_cast<const char*>(src) + src_offset,
                                   bytes, kinds[kind]));
  if (kind == 2) TENSOR_OPS_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return report_bad_indices(device);
}

to_status gpu_memset(int32_t device, void* dst, uint64_t offset, int32_t value, size_t bytes) {
  if (bytes == 0) return TO_OK;
  DeviceGuard guard;
  if (to_status s = guard.enter(device); s != TO_OK) return s;
  TENSOR_OPS_CUDA_CHECK(cudaMemset(static_cast<char*>(dst) + offset, value, bytes));
  TENSOR_OPS_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return report_bad_indices(device);
}

to_status gpu_synchronize(int32_t device) {
  DeviceGuard guard;
  if (to_status s = guard.enter(device); s != TO_OK) return s;
  TENSOR_OPS_CUDA_CHECK(cudaDeviceSynchronize());
  return report_bad_indices(device);
}

const char* gpu_last_error() { return last_error_text.c_str(); }

// An event recorded on producer, waited on by consumer: the device orders
// them, the host goes on. The event may be destroyed at once (the runtime
// keeps it until the wait is done).
to_status gpu_stream_wait(int32_t device, void* consumer, void* producer) {
  DeviceGuard guard;
  if (to_status s = guard.enter(device); s != TO_OK) return s;
  cudaEvent_t event = nullptr;
  TENSOR_OPS_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  cudaError_t err = cudaEventRecord(event, static_cast<cudaStream_t>(producer));
  const char* call = "cudaEventRecord(event, producer)";
  if (err == cudaSuccess) {
    err = cudaStreamWaitEvent(static_cast<cudaStream_t>(consumer), event, 0);
    call = "cudaStreamWaitEvent(consumer, event, 0)";
  }
  (void)cudaEventDestroy(event);
  return err == cudaSuccess ? TO_OK : fail(call, err, __FILE__, __LINE__);
}

// Runs a launcher on the device of the call's first input, on the caller's
// stream (NULL: the default stream, which torch's default stream is too).
template <to_status (*Launch)(const to_op_call*, cudaStream_t)>
to_status run(const to_op_call* call) {
  DeviceGuard guard;
  if (to_status s = guard.enter(call->inputs[0].device_id); s != TO_OK) return s;
  return Launch(call, static_cast<cudaStream_t>(call->stream));
}

to_backend_v1 make_table() {
  to_backend_v1 t{};
  t.abi_version = TENSOR_OPS_PLUGIN_ABI_VERSION;
  t.name = TENSOR_OPS_GPU_API;
  t.flags = TO_BACKEND_CE_OPTIONS | TO_BACKEND_NORM_OFFSET;  // device memory is plain pointers (not handles)
  t.init = gpu_init;
  t.priority = gpu_priority;
  t.device_count = gpu_device_count;
  t.device_info = gpu_device_info;
  t.mem_info = gpu_mem_info;
  t.allocate = gpu_allocate;
  t.deallocate = gpu_deallocate;
  t.copy = gpu_copy;
  t.memset = gpu_memset;
  t.synchronize = gpu_synchronize;
  t.last_error = gpu_last_error;
  t.stream_wait = gpu_stream_wait;
  t.kernels[int(OpId::rms_norm)] = run<launch_rms_norm>;
  t.kernels[int(OpId::silu)] = run<launch_silu>;
  t.kernels[int(OpId::gelu)] = run<launch_gelu>;
  t.kernels[int(OpId::layer_norm)] = run<launch_layer_norm>;
  t.kernels[int(OpId::rms_norm_backward)] = run<launch_rms_norm_backward>;
  t.kernels[int(OpId::layer_norm_backward)] = run<launch_layer_norm_backward>;
  t.kernels[int(OpId::add_rms_norm)] = run<launch_add_rms_norm>;
  t.kernels[int(OpId::softmax)] = run<launch_softmax>;
  t.kernels[int(OpId::softmax_backward)] = run<launch_softmax_backward>;
  t.kernels[int(OpId::activation_backward)] = run<launch_activation_backward>;
  t.kernels[int(OpId::glu)] = run<launch_glu>;
  t.kernels[int(OpId::glu_backward)] = run<launch_glu_backward>;
  t.kernels[int(OpId::rope)] = run<launch_rope>;
  t.kernels[int(OpId::attention)] = run<launch_attention>;
  t.kernels[int(OpId::attention_backward)] = run<launch_attention_backward>;
  t.kernels[int(OpId::cross_entropy)] = run<launch_cross_entropy>;
  return t;
}

}  // namespace

to_status fail(const char* call, cudaError_t code, const char* file, int line) {
  (void)cudaGetLastError();  // clears the error it just reported
  std::string where = file;
  // "cuda/norm.cu:42" rather than the build machine's absolute path.
  const size_t slash = where.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    const size_t parent = where.rfind('/', slash - 1);
    where = where.substr(parent == std::string::npos ? 0 : parent + 1);
  }
  last_error_text = api_call(call) + " returned " + describe(code) + " at " + where + ":" + std::to_string(line);
  if (code == cudaErrorNoKernelImageForDevice || code == cudaErrorInvalidDeviceFunction)
    last_error_text += "; this plugin was built for " TENSOR_OPS_GPU_ARCHS
                       ": rebuild with your GPU's architecture in CMAKE_" TENSOR_OPS_GPU_NAME "_ARCHITECTURES";
  return code == cudaErrorMemoryAllocation ? TO_ERR_OUT_OF_MEMORY : TO_ERR_DEVICE;
}

to_status BadIndexFlag::arm(const std::string& message) {
  int device = 0;
  TENSOR_OPS_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxFlagDevices)
    return fail(TO_ERR_UNSUPPORTED, "device " + std::to_string(device) + ": the bad-index flags cover devices 0 to " +
                                        std::to_string(kMaxFlagDevices - 1));
  std::lock_guard<std::mutex> lock(bad_index_mutex);
  BadIndexFlags& f = bad_index_flags[device];
  if (!f.flags) {
    int* flags = nullptr;
    TENSOR_OPS_CUDA_CHECK(cudaMalloc(&flags, kBadIndexKinds * sizeof(int)));
    // Zeroed before any kernel can raise them (cudaMemset orders after the
    // default stream's work; the callers' streams wait for it below).
    const cudaError_t err = cudaMemset(flags, 0, kBadIndexKinds * sizeof(int));
    if (err == cudaSuccess) (void)cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      (void)cudaFree(flags);
      return fail("cudaMemset(flags, 0, bytes)", err, __FILE__, __LINE__);
    }
    f.flags = flags;
  }
  f.message[int(kind_)] = message;
  f.armed = true;
  flag_ = f.flags + int(kind_);
  return TO_OK;
}

to_status scratch_pool(cudaMemPool_t* pool) {
  *pool = nullptr;
  int device = 0;
  TENSOR_OPS_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxFlagDevices) return TO_OK;  // cudaMalloc, then
  std::lock_guard<std::mutex> lock(scratch_pool_mutex);
  ScratchPool& p = scratch_pools[device];
  if (!p.tried) {
    cudaMemPoolProps props;
    std::memset(&props, 0, sizeof(props));
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t created = nullptr;
    cudaError_t err = cudaMemPoolCreate(&created, &props);
    if (err == cudaErrorNotSupported) {
      (void)cudaGetLastError();  // clears it: cudaMalloc is the answer
      p.tried = true;
      return TO_OK;
    }
    if (err != cudaSuccess) return fail("cudaMemPoolCreate(&pool, &props)", err, __FILE__, __LINE__);
    unsigned long long keep = kScratchKeepBytes;
    // Without the threshold the pool still works, caching less: not an error.
    if (cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
      (void)cudaGetLastError();
    p.pool = created;
    p.tried = true;
  }
  *pool = p.pool;
  return TO_OK;
}

to_status report_bad_indices(int32_t device) {
  if (device < 0 || device >= kMaxFlagDevices) return TO_OK;
  std::lock_guard<std::mutex> lock(bad_index_mutex);
  BadIndexFlags& f = bad_index_flags[device];
  if (!f.armed) return TO_OK;
  f.armed = false;
  int raised[kBadIndexKinds] = {};
  // The caller has synchronized the device: the kernels that may raise are done.
  TENSOR_OPS_CUDA_CHECK(cudaMemcpy(raised, f.flags, sizeof(raised), cudaMemcpyDeviceToHost));
  std::string message;
  for (int k = 0; k < kBadIndexKinds; ++k)
    if (raised[k]) message += (message.empty() ? "" : "; ") + f.message[k];
  if (message.empty()) return TO_OK;
  TENSOR_OPS_CUDA_CHECK(cudaMemset(f.flags, 0, sizeof(raised)));
  return fail(TO_ERR_INVALID_ARGUMENT, message + " (found on the device by the kernel of an earlier call; reported by " +
                                          "the first copy, memset or synchronize on the device after it)");
}

to_status fail(to_status status, const std::string& message) {
  last_error_text = message;
  return status;
}

}  // namespace tensor_ops::gpu

extern "C" __attribute__((visibility("default"))) const to_backend_v1* tensor_ops_backend_v1(void) {
  static const to_backend_v1 table = tensor_ops::gpu::make_table();
  return &table;
}
