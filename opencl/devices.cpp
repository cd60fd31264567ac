#include "devices.h"

#include <algorithm>

#include "programs.h"

namespace tensor_ops::opencl {
namespace {

struct Enumeration {
  std::vector<std::unique_ptr<ClDevice>> devices;
  to_status status = TO_OK;
  std::string reason;
};

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\0' || s.back() == ' ')) s.pop_back();
  s.erase(0, s.find_first_not_of(' '));
  return s;
}

std::string device_string(cl_device_id d, cl_device_info what) {
  size_t n = 0;
  if (clGetDeviceInfo(d, what, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  if (clGetDeviceInfo(d, what, n, s.data(), nullptr) != CL_SUCCESS) return "";
  return trimmed(s);
}

std::string platform_string(cl_platform_id p, cl_platform_info what) {
  size_t n = 0;
  if (clGetPlatformInfo(p, what, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  if (clGetPlatformInfo(p, what, n, s.data(), nullptr) != CL_SUCCESS) return "";
  return trimmed(s);
}

template <class V>
V device_value(cl_device_id d, cl_device_info what) {
  V v{};
  if (clGetDeviceInfo(d, what, sizeof(v), &v, nullptr) != CL_SUCCESS) return V{};
  return v;
}

bool has_extension(const std::string& extensions, const char* name) {
  const std::string padded = " " + extensions + " ";
  return padded.find(std::string(" ") + name + " ") != std::string::npos;
}

std::unique_ptr<ClDevice> describe(cl_platform_id platform, cl_device_id id) {
  auto d = std::make_unique<ClDevice>();
  d->platform = platform;
  d->id = id;
  d->type = device_value<cl_device_type>(id, CL_DEVICE_TYPE);
  d->name = device_string(id, CL_DEVICE_NAME);
  d->vendor = device_string(id, CL_DEVICE_VENDOR);
  d->driver_version = device_string(id, CL_DRIVER_VERSION);
  d->device_version = device_string(id, CL_DEVICE_VERSION);
  d->opencl_c_version = device_string(id, CL_DEVICE_OPENCL_C_VERSION);
  d->platform_name = platform_string(platform, CL_PLATFORM_NAME);
  d->platform_version = platform_string(platform, CL_PLATFORM_VERSION);
  d->global_mem_bytes = device_value<cl_ulong>(id, CL_DEVICE_GLOBAL_MEM_SIZE);
  d->max_alloc_bytes = device_value<cl_ulong>(id, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
  d->local_mem_bytes = device_value<cl_ulong>(id, CL_DEVICE_LOCAL_MEM_SIZE);
  d->compute_units = device_value<cl_uint>(id, CL_DEVICE_MAX_COMPUTE_UNITS);
  d->max_clock_mhz = device_value<cl_uint>(id, CL_DEVICE_MAX_CLOCK_FREQUENCY);
  d->max_work_group_size = std::max<size_t>(1, device_value<size_t>(id, CL_DEVICE_MAX_WORK_GROUP_SIZE));
  d->available = device_value<cl_bool>(id, CL_DEVICE_AVAILABLE) == CL_TRUE;
  d->compiler_available = device_value<cl_bool>(id, CL_DEVICE_COMPILER_AVAILABLE) == CL_TRUE;
  const std::string extensions = device_string(id, CL_DEVICE_EXTENSIONS);
  d->fp16 = has_extension(extensions, "cl_khr_fp16");
  d->fp64 = has_extension(extensions, "cl_khr_fp64") || device_value<cl_device_fp_config>(id, CL_DEVICE_DOUBLE_FP_CONFIG) != 0;
  return d;
}

// GPUs first, then accelerators, then CPUs: device 0 is the one host arrays
// are staged to.
int type_rank(cl_device_type t) {
  if (t & CL_DEVICE_TYPE_GPU) return 0;
  if (t & CL_DEVICE_TYPE_ACCELERATOR) return 1;
  if (t & CL_DEVICE_TYPE_CPU) return 2;
  return 3;
}

Enumeration enumerate() {
  Enumeration e;
  if (!load_opencl(&e.reason)) {
    e.status = TO_ERR_BACKEND_UNAVAILABLE;
    return e;
  }
  cl_uint n_platforms = 0;
  cl_int err = clGetPlatformIDs(0, nullptr, &n_platforms);
  if (err == CL_SUCCESS && n_platforms == 0) err = CL_PLATFORM_NOT_FOUND_KHR;
  if (err != CL_SUCCESS) {
    e.status = TO_ERR_BACKEND_UNAVAILABLE;
    e.reason = "no OpenCL platforms found (clGetPlatformIDs returned " + cl_code_str(err) +
               "); install an OpenCL driver (e.g. pocl-opencl-icd) or check the ICD files in /etc/OpenCL/vendors "
               "(or OCL_ICD_VENDORS)";
    return e;
  }
  std::vector<cl_platform_id> platforms(n_platforms);
  clGetPlatformIDs(n_platforms, platforms.data(), nullptr);
  std::string platform_errors;
  for (cl_platform_id p : platforms) {
    cl_uint n = 0;
    err = clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 0, nullptr, &n);
    if (err != CL_SUCCESS || n == 0) {
      platform_errors += (platform_errors.empty() ? "" : "; ") + platform_string(p, CL_PLATFORM_NAME) +
                         ": clGetDeviceIDs returned " + cl_code_str(err == CL_SUCCESS ? CL_DEVICE_NOT_FOUND : err);
      continue;
    }
    std::vector<cl_device_id> ids(n);
    clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, n, ids.data(), nullptr);
    for (cl_device_id id : ids) e.devices.push_back(describe(p, id));
  }
  std::stable_sort(e.devices.begin(), e.devices.end(),
                   [](const auto& a, const auto& b) { return type_rank(a->type) < type_rank(b->type); });
  if (e.devices.empty()) {
    e.status = TO_ERR_BACKEND_UNAVAILABLE;
    e.reason = "no OpenCL devices found on " + std::to_string(n_platforms) + " platform(s) (" + platform_errors + ")";
  }
  return e;
}

const Enumeration& enumeration() {
  static const Enumeration* e = new Enumeration(enumerate());  // never freed: see devices.h
  return *e;
}

}  // namespace

to_status enumerate_devices(std::string* reason) {
  const Enumeration& e = enumeration();
  *reason = e.reason;
  return e.status;
}

int32_t device_count() { return int32_t(enumeration().devices.size()); }

bool has_gpu() {
  for (const auto& d : enumeration().devices)
    if (d->type & CL_DEVICE_TYPE_GPU) return true;
  return false;
}

ClDevice* device_at(int32_t device) {
  const auto& all = enumeration().devices;
  if (device < 0 || size_t(device) >= all.size()) {
    fail(TO_ERR_INVALID_ARGUMENT,
         "opencl device " + std::to_string(device) + " does not exist (" + std::to_string(all.size()) + " devices)");
    return nullptr;
  }
  return all[size_t(device)].get();
}

static to_status make_context(ClDevice& d) {
  cl_int err = CL_SUCCESS;
  const cl_context_properties props[] = {CL_CONTEXT_PLATFORM, cl_context_properties(d.platform), 0};
  TENSOR_OPS_CL_CHECK((d.context = clCreateContext(props, 1, &d.id, nullptr, nullptr, &err), err));
  TENSOR_OPS_CL_CHECK((d.queue = clCreateCommandQueue(d.context, d.id, 0, &err), err));
  return TO_OK;
}

to_status ready(ClDevice& d) {
  std::call_once(d.ready_once, [&] {
    d.ready_status = make_context(d);
    if (d.ready_status != TO_OK) d.ready_error = "opencl device '" + d.name + "': " + last_error();
  });
  return d.ready_status == TO_OK ? TO_OK : fail(d.ready_status, d.ready_error);
}

const char* device_type_name(cl_device_type type) {
  if (type & CL_DEVICE_TYPE_GPU) return "GPU";
  if (type & CL_DEVICE_TYPE_ACCELERATOR) return "ACCELERATOR";
  if (type & CL_DEVICE_TYPE_CPU) return "CPU";
  return "OTHER";
}

}  // namespace tensor_ops::opencl
