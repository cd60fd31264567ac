#pragma once
// Host storage for one dtype, read and written as float through dtype.h's
// conversions, so tests build inputs and references from the stored values.
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensor_ops/dtype.h"
#include "tensor_ops/tensor.h"

namespace tensor_ops::testing {

class HostBuffer {
 public:
  // operator new aligns the bytes for every dtype.
  HostBuffer(DType dtype, int64_t n) : dtype_(dtype), n_(n), bytes_(size_t(n) * dtype_size(dtype)) {}

  DType dtype() const { return dtype_; }
  int64_t size() const { return n_; }
  void* data() { return bytes_.data(); }

  // Raw bits of element i (for bitwise comparisons).
  uint32_t bits(int64_t i) const {
    if (dtype_ == DType::Float32) {
      uint32_t u;
      std::memcpy(&u, bytes_.data() + i * 4, 4);
      return u;
    }
    uint16_t h;
    std::memcpy(&h, bytes_.data() + i * 2, 2);
    return h;
  }
  float get(int64_t i) const {
    switch (dtype_) {
      case DType::Float32: return bits_float(bits(i));
      case DType::Float16: return half_to_float(uint16_t(bits(i)));
      case DType::BFloat16: return bf16_to_float(uint16_t(bits(i)));
    }
    return 0;
  }
  // Stores v rounded to the dtype.
  void set(int64_t i, float v) {
    if (dtype_ == DType::Float32) {
      std::memcpy(bytes_.data() + i * 4, &v, 4);
      return;
    }
    const uint16_t h = dtype_ == DType::Float16 ? float_to_half(v) : float_to_bf16(v);
    std::memcpy(bytes_.data() + i * 2, &h, 2);
  }

  // A view starting `offset` elements in.
  Tensor tensor(std::vector<int64_t> shape, std::vector<int64_t> strides = {}, Device device = {},
                int64_t offset = 0) {
    return Tensor(bytes_.data() + offset * int64_t(dtype_size(dtype_)), dtype_, std::move(shape),
                  std::move(strides), std::move(device));
  }

 private:
  DType dtype_;
  int64_t n_;
  std::vector<unsigned char> bytes_;
};

}  // namespace tensor_ops::testing
