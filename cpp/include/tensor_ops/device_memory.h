#pragma once
// The memory of one device: raw resource -> limit -> caching pool ->
// statistics, plus OOM protection. One per device, created on first use and
// never destroyed (tensors may outlive static destruction at exit).
#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "tensor_ops/tensor.h"

namespace tensor_ops {

class MemoryResource;
class CachingPool;
class LimitingResource;
class StatsResource;

class DeviceMemory {
 public:
  // "host" memory for the host, or the pool of a backend's device.
  static DeviceMemory& of(const Device& device);

  // Memory that returns to the pool when the last owner goes away.
  // Throws OutOfMemory with requested/free/total/reserved/allocated bytes.
  std::shared_ptr<void> allocate(size_t bytes, double safety_margin = 1.2);
  // A contiguous tensor owned by a pool block.
  Tensor empty(const std::vector<int64_t>& shape, DType dtype, double safety_margin = 1.2);

  void empty_cache();
  // Caps what the pool may reserve at fraction * total device memory
  // (0 < fraction <= 1).
  void set_memory_fraction(double fraction);
  double memory_fraction() const { return fraction_; }
  // torch-style keys ("allocated_bytes.all.current", "num_ooms", ...).
  std::map<std::string, uint64_t> stats() const;
  void reset_peak_stats();
  const Device& device() const { return device_; }
  // Handle-addressed memory (OpenCL): blocks are not split.
  bool handle_memory() const { return handle_memory_; }

  // Tests: put a failure injector between the pool and the raw resource.
  void inject_failures(uint64_t every_nth, uint64_t above_bytes);

 private:
  DeviceMemory(Device device, std::unique_ptr<MemoryResource> raw, bool handle_memory);
  [[noreturn]] void throw_oom(size_t bytes, double margin, const std::string& why);

  Device device_;
  bool handle_memory_;
  std::unique_ptr<MemoryResource> raw_;
  std::unique_ptr<MemoryResource> failing_;
  std::unique_ptr<LimitingResource> limit_;
  std::unique_ptr<CachingPool> pool_;
  std::unique_ptr<StatsResource> stats_;
  double fraction_ = 1.0;
  std::atomic<uint64_t> num_retries_{0}, num_ooms_{0};
};

}  // namespace tensor_ops
