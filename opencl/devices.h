#pragma once
// The OpenCL devices of every platform, found once, best first (GPUs, then
// accelerators, then CPUs), each with a context and an in-order queue made
// on first use. Never destroyed: tensors may outlive static destruction.
#include "cl_api.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cl_check.h"

namespace tensor_ops::opencl {

struct Program;

struct ClDevice {
  cl_platform_id platform = nullptr;
  cl_device_id id = nullptr;
  cl_device_type type = 0;
  std::string name, vendor, driver_version, device_version, opencl_c_version, platform_name, platform_version;
  uint64_t global_mem_bytes = 0, max_alloc_bytes = 0, local_mem_bytes = 0;
  uint32_t compute_units = 0, max_clock_mhz = 0;
  size_t max_work_group_size = 1;
  bool available = false, compiler_available = false, fp16 = false, fp64 = false;

  // Made by ready(); valid once it returned TO_OK.
  cl_context context = nullptr;
  cl_command_queue queue = nullptr;

  // OpenCL cannot say how much memory is free: mem_info reports the total
  // minus what this plugin holds.
  std::atomic<uint64_t> allocated_bytes{0};
  std::atomic<uint64_t> host_to_device_copies{0}, device_to_host_copies{0};
  std::atomic<uint64_t> binary_cache_hits{0}, binary_cache_misses{0}, binary_cache_rejected{0};

  // Programs per dtype (to_dtype of the float types), built on first use.
  std::mutex programs_mutex;
  std::unique_ptr<Program> programs[3];

  std::once_flag ready_once;
  to_status ready_status = TO_OK;
  std::string ready_error;
};

// Enumerates once. TO_OK when at least one device exists; otherwise writes
// why not into reason.
to_status enumerate_devices(std::string* reason);
int32_t device_count();
bool has_gpu();
// nullptr, with the last error set, for an id out of range.
ClDevice* device_at(int32_t device);
// The context and queue of a device, created on first use.
to_status ready(ClDevice& d);
const char* device_type_name(cl_device_type type);

}  // namespace tensor_ops::opencl
