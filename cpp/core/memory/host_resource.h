#pragma once
#include "tensor_ops/memory.h"

namespace tensor_ops {

// Host memory, 64-byte aligned; blocks of 2 MiB and more are 2 MiB aligned
// and advised as huge pages (a fresh 512 MiB output otherwise costs ~150 ms
// of 4 KiB page faults on this project's machines).
class HostResource final : public MemoryResource {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) noexcept override;
  MemInfo mem_info() const override;
};

}  // namespace tensor_ops
