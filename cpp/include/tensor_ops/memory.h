#pragma once
// Memory as small composable resources (the RMM idea): a raw resource per
// device, a caching pool on top, a limit, statistics, and a failure injector
// for tests. Each resource takes its upstream by reference and owns nothing
// of it. deallocate() never throws.
#include <cstddef>
#include <cstdint>
#include <string>

namespace tensor_ops {

struct MemInfo {
  uint64_t free = 0, total = 0;
};

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // Throws OutOfMemory when the memory is not there (DeviceError for other
  // vendor failures). allocate(0) returns nullptr.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) noexcept = 0;
  // What the device reports free / total.
  virtual MemInfo mem_info() const = 0;
  // Returns cached, unused memory to the device (pools); adaptors forward.
  virtual void release_cached() {}
  // Bytes held in caches that release_cached() would return.
  virtual uint64_t cached_bytes() const { return 0; }
};

}  // namespace tensor_ops
