#include "tensor_ops/tensor.h"

#include <algorithm>
#include <limits>

#include "tensor_ops/errors.h"

namespace tensor_ops {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Tensor::Tensor(void* data, DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
               Device device, std::shared_ptr<void> owner, uint64_t byte_offset)
    : data_(data), dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)),
      device_(std::move(device)), owner_(std::move(owner)), byte_offset_(byte_offset) {
  if (shape_.size() > TENSOR_OPS_MAX_DIMS)
    throw InvalidArgument("tensor has " + std::to_string(shape_.size()) + " dimensions; at most " +
                          std::to_string(TENSOR_OPS_MAX_DIMS) + " are supported");
  // Sizes must be non-negative, and the product of the sizes (zeros counted
  // as ones, since contiguous strides are built from it) times the item size
  // must fit in int64.
  const int64_t limit = std::numeric_limits<int64_t>::max() / 8;
  int64_t span = 1;
  for (int64_t d : shape_) {
    if (d < 0) throw InvalidArgument("negative dimension in shape " + shape_str(shape_));
    const int64_t e = std::max<int64_t>(d, 1);
    if (span > limit / e) throw InvalidArgument("shape " + shape_str(shape_) + " overflows the addressable size");
    span *= e;
  }
  const int64_t n = numel();
  if (strides_.empty()) {
    strides_.resize(shape_.size());
    int64_t s = 1;
    for (size_t i = shape_.size(); i-- > 0;) {
      strides_[i] = s;
      s *= std::max<int64_t>(shape_[i], 1);
    }
  } else if (strides_.size() != shape_.size()) {
    throw InvalidArgument("strides " + shape_str(strides_) + " do not match shape " + shape_str(shape_));
  } else {
    // The extent (sum of |stride| * (size - 1)) must not overflow either.
    int64_t extent = 0;
    for (size_t i = 0; i < shape_.size(); ++i) {
      if (shape_[i] == 0) continue;
      int64_t term;
      const bool min_stride = strides_[i] == std::numeric_limits<int64_t>::min();  // has no magnitude in int64
      const int64_t st = min_stride ? 0 : strides_[i] < 0 ? -strides_[i] : strides_[i];
      if (min_stride || __builtin_mul_overflow(st, shape_[i] - 1, &term) ||
          __builtin_add_overflow(extent, term, &extent) || extent > limit)
        throw InvalidArgument("strides " + shape_str(strides_) + " with shape " + shape_str(shape_) +
                              " overflow the addressable size");
    }
  }
  if (data_ == nullptr && n != 0) throw InvalidArgument("tensor " + describe() + " has a null data pointer");
  // Kernels load whole elements: a misaligned one is undefined behaviour (and
  // can fault in vectorised loops). The caller may retry with an aligned copy.
  const uintptr_t address = reinterpret_cast<uintptr_t>(data_) + uintptr_t(byte_offset_);
  if (n != 0 && address % dtype_size(dtype_) != 0)
    throw LayoutError("tensor " + describe() + " starts at an address that is not a multiple of its " +
                      std::to_string(dtype_size(dtype_)) + "-byte element size");
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no elements: any strides describe them (the default ones count 0-size dims as 1)
  int64_t s = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != s) return false;
    s *= shape_[i];
  }
  return true;
}

std::string Tensor::describe() const {
  std::string s = std::string(dtype_name(dtype_)) + shape_str(shape_);
  if (!device_.is_host()) s += " on " + device_.str();
  return s;
}

std::pair<uintptr_t, uintptr_t> Tensor::byte_span() const {
  if (numel() == 0) return {0, 0};
  int64_t lo = 0, hi = 0;
  for (size_t i = 0; i < shape_.size(); ++i) {
    int64_t ext = (shape_[i] - 1) * strides_[i];
    (ext < 0 ? lo : hi) += ext;
  }
  const int64_t item = int64_t(dtype_size(dtype_));
  auto base = reinterpret_cast<uintptr_t>(data_) + uintptr_t(byte_offset_);
  return {base + uintptr_t(lo * item), base + uintptr_t((hi + 1) * item)};
}

}  // namespace tensor_ops
