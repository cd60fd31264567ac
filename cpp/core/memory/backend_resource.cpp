#include "backend_resource.h"

#include <string>

#include "tensor_ops/errors.h"

namespace tensor_ops {

void* BackendResource::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  to_status st = table_.allocate(device_, bytes, &p);
  if (st != TO_OK) {
    const char* msg = table_.last_error ? table_.last_error() : "";
    throw_status(st == TO_ERR_OUT_OF_MEMORY ? TO_ERR_OUT_OF_MEMORY : st,
                 std::string(table_.name) + ": allocating " + std::to_string(bytes) + " bytes failed: " + msg);
  }
  return p;
}

void BackendResource::deallocate(void* p, size_t bytes) noexcept {
  if (p) table_.deallocate(device_, p, bytes);
}

MemInfo BackendResource::mem_info() const {
  MemInfo info;
  if (table_.mem_info(device_, &info.free, &info.total) != TO_OK) info = MemInfo{};
  return info;
}

}  // namespace tensor_ops
