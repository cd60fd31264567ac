#include "stats_resource.h"

#include <algorithm>

#include "tensor_ops/errors.h"

namespace tensor_ops {

void* StatsResource::allocate(size_t bytes) {
  void* p;
  try {
    p = upstream_.allocate(bytes);
  } catch (const OutOfMemory&) {
    std::lock_guard<std::mutex> lock(m_);
    ++s_.num_alloc_failures;
    throw;
  }
  std::lock_guard<std::mutex> lock(m_);
  if (p) {
    s_.current_bytes += bytes;
    s_.peak_bytes = std::max(s_.peak_bytes, s_.current_bytes);
    ++s_.num_allocs;
  }
  return p;
}

void StatsResource::deallocate(void* p, size_t bytes) noexcept {
  if (!p) return;
  upstream_.deallocate(p, bytes);
  std::lock_guard<std::mutex> lock(m_);
  s_.current_bytes -= bytes;
  ++s_.num_frees;
}

AllocStats StatsResource::stats() const {
  std::lock_guard<std::mutex> lock(m_);
  return s_;
}

void StatsResource::reset_peak() {
  std::lock_guard<std::mutex> lock(m_);
  s_.peak_bytes = s_.current_bytes;
}

}  // namespace tensor_ops
