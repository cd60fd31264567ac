#pragma once
// Tensor: dtype + shape + strides + device + data + an owner that keeps the
// data alive (a pool block, or the foreign array it came from).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensor_ops/dtype.h"
#include "tensor_ops/plugin.h"

namespace tensor_ops {

// Where data lives: on the host, or on device `id` of backend `backend`.
struct Device {
  std::string backend = "host";
  int32_t id = 0;
  bool is_host() const { return backend == "host"; }
  std::string str() const { return is_host() ? "cpu" : backend + ":" + std::to_string(id); }
  bool operator==(const Device& o) const { return backend == o.backend && id == o.id; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

class Tensor {
 public:
  Tensor() = default;
  // strides in elements; empty strides mean contiguous (row-major).
  Tensor(void* data, DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {},
         Device device = {}, std::shared_ptr<void> owner = nullptr, uint64_t byte_offset = 0);

  void* data() const { return data_; }
  // Offset of element 0 from data(), for handle-addressed memory (OpenCL).
  uint64_t byte_offset() const { return byte_offset_; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  const Device& device() const { return device_; }
  const std::shared_ptr<void>& owner() const { return owner_; }
  int64_t ndim() const { return int64_t(shape_.size()); }
  int64_t numel() const;
  int64_t nbytes() const { return numel() * int64_t(dtype_size(dtype_)); }
  bool is_contiguous() const;
  // "float32[4, 7]" for messages.
  std::string describe() const;
  // Byte range [lo, hi) the view touches (for overlap checks).
  std::pair<uintptr_t, uintptr_t> byte_span() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::Float32;
  std::vector<int64_t> shape_, strides_;
  Device device_;
  std::shared_ptr<void> owner_;
  uint64_t byte_offset_ = 0;
};

std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace tensor_ops
