#pragma once
// Errors of the OpenCL plugin: one check macro for every OpenCL call. A
// failed call becomes the thread's last error ("call returned code (NAME) at
// opencl/file.cpp:line") and a to_status; nothing here throws or aborts.
#include "cl_api.h"

#include <string>

#include "tensor_ops/plugin.h"

namespace tensor_ops::opencl {

const char* cl_error_name(cl_int code);
// "-1001 CL_PLATFORM_NOT_FOUND_KHR"
std::string cl_code_str(cl_int code);

// Records the failed call; CL_MEM_OBJECT_ALLOCATION_FAILURE is
// TO_ERR_OUT_OF_MEMORY, every other code TO_ERR_DEVICE.
to_status fail_call(const char* call, cl_int code, const char* file, int line);
to_status fail(to_status status, const std::string& message);
const char* last_error();

}  // namespace tensor_ops::opencl

// `call` is any expression giving a cl_int: an OpenCL call, or for the
// clCreate* functions `(obj = clCreateX(..., &err), err)`.
#define TENSOR_OPS_CL_CHECK(call)                                                             \
  do {                                                                                         \
    const cl_int tensor_ops_cl_code_ = (call);                                                 \
    if (tensor_ops_cl_code_ != CL_SUCCESS)                                                     \
      return ::tensor_ops::opencl::fail_call(#call, tensor_ops_cl_code_, __FILE__, __LINE__); \
  } while (0)

// Passes a failed to_status (its last error already set) to the caller.
#define TENSOR_OPS_CL_RETURN_IF_ERROR(expr)         \
  do {                                               \
    const to_status tensor_ops_cl_status_ = (expr);  \
    if (tensor_ops_cl_status_ != TO_OK) return tensor_ops_cl_status_; \
  } while (0)
