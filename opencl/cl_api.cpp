#include "cl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace tensor_ops::opencl {

#define TENSOR_OPS_CL_DEFINE(name, ret, params) name##_fn name = nullptr;
TENSOR_OPS_CL_FUNCTIONS(TENSOR_OPS_CL_DEFINE)
#undef TENSOR_OPS_CL_DEFINE

namespace {

// The loader is never closed: kernels and buffers may outlive static destruction.
std::string load() {
  const char* env = std::getenv("TENSOR_OPS_OPENCL_LIBRARY");
  const std::string path = env && *env ? env : "libOpenCL.so.1";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    return "no OpenCL ICD loader (" + path + ": " + (why ? why : "dlopen failed") +
           "); install one (e.g. ocl-icd-libopencl1) and an OpenCL driver (e.g. pocl-opencl-icd)";
  }
  std::string missing;
#define TENSOR_OPS_CL_RESOLVE(name, ret, params)                       \
  name = reinterpret_cast<name##_fn>(dlsym(lib, #name));               \
  if (!name) missing += (missing.empty() ? "" : ", ") + std::string(#name);
  TENSOR_OPS_CL_FUNCTIONS(TENSOR_OPS_CL_RESOLVE)
#undef TENSOR_OPS_CL_RESOLVE
  if (!missing.empty()) return "the OpenCL ICD loader " + path + " lacks OpenCL 1.2 functions: " + missing;
  return "";
}

}  // namespace

bool load_opencl(std::string* reason) {
  static const std::string* error = new std::string(load());
  *reason = *error;
  return error->empty();
}

}  // namespace tensor_ops::opencl
