#pragma once
// LimitingResource: refuses upstream allocations beyond a byte cap (the
// memory fraction). A limit of 0 means no cap.
#include <atomic>
#include <mutex>

#include "tensor_ops/memory.h"

namespace tensor_ops {

class LimitingResource final : public MemoryResource {
 public:
  explicit LimitingResource(MemoryResource& upstream, uint64_t limit = 0) : upstream_(upstream), limit_(limit) {}
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) noexcept override;
  MemInfo mem_info() const override { return upstream_.mem_info(); }
  void release_cached() override { upstream_.release_cached(); }
  uint64_t cached_bytes() const override { return upstream_.cached_bytes(); }
  void set_limit(uint64_t bytes) { limit_ = bytes; }
  uint64_t limit() const { return limit_; }
  uint64_t used() const { return used_; }

 private:
  MemoryResource& upstream_;
  std::atomic<uint64_t> limit_;
  std::atomic<uint64_t> used_{0};
  std::mutex m_;
};

}  // namespace tensor_ops
