#pragma once
// Moving tensors between the host and devices (through the device pools).
#include "tensor_ops/tensor.h"

namespace tensor_ops {

// Device named "cpu", "host", "cpu:0", "opencl", "opencl:1", ...; "" is the
// active backend's device 0. Unknown backends raise InvalidArgument.
Device parse_device(const std::string& name);
// "cpu" for the host, else "backend:id".
std::string device_name(const Device& d);

// Copies src's bytes into dst: both contiguous, same byte size.
void copy_bytes(const Tensor& dst, const Tensor& src);
// A contiguous, pool-owned copy of src on `device`.
Tensor to_device(const Tensor& src, const Device& device);
// Fills a contiguous tensor with zero bytes.
void zero_fill(const Tensor& t);

}  // namespace tensor_ops
