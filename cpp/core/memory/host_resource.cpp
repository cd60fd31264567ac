#include "host_resource.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "tensor_ops/errors.h"

namespace tensor_ops {

namespace {
constexpr size_t kHuge = size_t(2) << 20;
}

void* HostResource::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  void* p = nullptr;
  if (posix_memalign(&p, align, (bytes + align - 1) / align * align) != 0 || !p)
    throw OutOfMemory("host allocation of " + std::to_string(bytes) + " bytes failed");
#ifdef MADV_HUGEPAGE
  if (align == kHuge) madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

void HostResource::deallocate(void* p, size_t) noexcept { std::free(p); }

MemInfo HostResource::mem_info() const {
  MemInfo info;
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  info.total = uint64_t(sysconf(_SC_PHYS_PAGES)) * page;
  info.free = uint64_t(sysconf(_SC_AVPHYS_PAGES)) * page;
  // MemAvailable counts reclaimable page cache too: the honest "free".
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") {
      info.free = kb * 1024;
      break;
    }
  }
  return info;
}

}  // namespace tensor_ops
