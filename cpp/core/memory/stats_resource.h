#pragma once
// StatsResource: counts what passes through it (allocations and frees,
// bytes current and peak, failed allocations), in torch's vocabulary.
#include <atomic>
#include <mutex>

#include "tensor_ops/memory.h"

namespace tensor_ops {

struct AllocStats {
  uint64_t current_bytes = 0, peak_bytes = 0;
  uint64_t num_allocs = 0, num_frees = 0, num_alloc_failures = 0;
};

class StatsResource final : public MemoryResource {
 public:
  explicit StatsResource(MemoryResource& upstream) : upstream_(upstream) {}
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) noexcept override;
  MemInfo mem_info() const override { return upstream_.mem_info(); }
  void release_cached() override { upstream_.release_cached(); }
  uint64_t cached_bytes() const override { return upstream_.cached_bytes(); }
  AllocStats stats() const;
  void reset_peak();

 private:
  MemoryResource& upstream_;
  mutable std::mutex m_;
  AllocStats s_;
};

}  // namespace tensor_ops
