#include "limiting_resource.h"

#include <string>

#include "tensor_ops/errors.h"

namespace tensor_ops {

void* LimitingResource::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  {
    std::lock_guard<std::mutex> lock(m_);
    const uint64_t lim = limit_;
    if (lim && used_ + bytes > lim)
      throw OutOfMemory("allocation of " + std::to_string(bytes) + " bytes would exceed the memory limit of " +
                        std::to_string(lim) + " bytes (" + std::to_string(used_) + " in use)");
    used_ += bytes;
  }
  try {
    return upstream_.allocate(bytes);
  } catch (...) {
    used_ -= bytes;
    throw;
  }
}

void LimitingResource::deallocate(void* p, size_t bytes) noexcept {
  if (!p) return;
  upstream_.deallocate(p, bytes);
  used_ -= bytes;
}

}  // namespace tensor_ops
