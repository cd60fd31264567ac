#pragma once
// FailingResource (tests): throws OutOfMemory on every Nth allocation and/or
// for any request above a size, so every error path can be driven.
#include <atomic>

#include "tensor_ops/errors.h"
#include "tensor_ops/memory.h"

namespace tensor_ops {

class FailingResource final : public MemoryResource {
 public:
  explicit FailingResource(MemoryResource& upstream) : upstream_(upstream) {}
  void fail_every(uint64_t n) { every_ = n; }
  void fail_above(uint64_t bytes) { above_ = bytes; }
  void* allocate(size_t bytes) override {
    const uint64_t n = ++calls_;
    if ((every_ && n % every_ == 0) || (above_ && bytes > above_)) {
      ++failures_;
      throw OutOfMemory("injected failure (call " + std::to_string(n) + ", " + std::to_string(bytes) + " bytes)");
    }
    return upstream_.allocate(bytes);
  }
  void deallocate(void* p, size_t bytes) noexcept override { upstream_.deallocate(p, bytes); }
  MemInfo mem_info() const override { return upstream_.mem_info(); }
  uint64_t failures() const { return failures_; }

 private:
  MemoryResource& upstream_;
  std::atomic<uint64_t> every_{0}, above_{0}, calls_{0}, failures_{0};
};

}  // namespace tensor_ops
