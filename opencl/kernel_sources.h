#pragma once
// The OpenCL C program (kernels/*.cl), embedded at build time by
// embed_kernels.cmake.

namespace tensor_ops::opencl {

extern const char kProgramSource[];
extern const char kProgramSourceSha256[];  // hex; part of the binary cache key

}  // namespace tensor_ops::opencl
