#pragma once
// The raw memory of one device of a backend plugin (cudaMalloc,
// clCreateBuffer, sycl::malloc_device... behind the plugin table).
#include "tensor_ops/memory.h"
#include "tensor_ops/plugin.h"

namespace tensor_ops {

class BackendResource final : public MemoryResource {
 public:
  BackendResource(const to_backend_v1& table, int32_t device) : table_(table), device_(device) {}
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) noexcept override;
  MemInfo mem_info() const override;

 private:
  const to_backend_v1& table_;
  int32_t device_;
};

}  // namespace tensor_ops
