// The OpenCL backend's plugin table: devices of every platform, buffers as
// cl_mem handles (TO_BACKEND_HANDLE_MEMORY), blocking copies, and the kernel
// entries. Kernels are enqueued on the device's in-order queue and not
// waited for: copies and later kernels on that queue come after them.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>

#include "binary_cache.h"
#include "cl_check.h"
#include "devices.h"
#include "programs.h"
#include "tensor_ops/ops.h"

namespace tensor_ops::opencl {
namespace {

void copy_str(char* dst, size_t n, const std::string& s) { std::snprintf(dst, n, "%s", s.c_str()); }

// The device with its context and queue ready.
to_status open_device(int32_t device, ClDevice** out) {
  ClDevice* d = device_at(device);
  if (!d) return TO_ERR_INVALID_ARGUMENT;
  TENSOR_OPS_CL_RETURN_IF_ERROR(ready(*d));
  *out = d;
  return TO_OK;
}

cl_mem mem(const to_tensor& t) { return static_cast<cl_mem>(t.data); }

to_status cl_init(char* reason, size_t reason_len) {
  std::string why;
  const to_status st = enumerate_devices(&why);
  if (st != TO_OK) copy_str(reason, reason_len, why);
  return st;
}

// Above the CPU backend (50) with a GPU; below it when OpenCL only has CPU
// devices (PoCL), which run only when asked for.
int32_t cl_priority() { return has_gpu() ? 70 : 40; }

int32_t cl_device_count() { return device_count(); }

to_status cl_device_info(int32_t device, to_device_info* out) {
  ClDevice* d = device_at(device);
  if (!d) return TO_ERR_INVALID_ARGUMENT;
  *out = to_device_info{};
  copy_str(out->name, sizeof(out->name), d->name);
  copy_str(out->vendor, sizeof(out->vendor), d->vendor);
  copy_str(out->driver_version, sizeof(out->driver_version), d->driver_version);
  copy_str(out->compute_capability, sizeof(out->compute_capability), d->opencl_c_version);
  out->device_type = (d->type & CL_DEVICE_TYPE_GPU)           ? TO_DEVICE_GPU
                     : (d->type & CL_DEVICE_TYPE_ACCELERATOR) ? TO_DEVICE_ACCELERATOR
                     : (d->type & CL_DEVICE_TYPE_CPU)         ? TO_DEVICE_CPU
                                                              : TO_DEVICE_OTHER;
  out->total_memory_bytes = d->global_mem_bytes;
  out->is_available = d->available;
  const BinaryCache& cache = BinaryCache::instance();
  const std::string cache_problem = cache.problem();
  // fp16 is cl_khr_fp16 (half arithmetic); float16 tensors run everywhere,
  // stored through vload_half / vstore_half with fp32 math (fp16_storage).
  std::string props = "platform=" + d->platform_name + "\nplatform_version=" + d->platform_version +
                      "\ndevice_version=" + d->device_version + "\nopencl_c_version=" + d->opencl_c_version +
                      "\ndevice_type=" + device_type_name(d->type) +
                      "\ncompute_units=" + std::to_string(d->compute_units) +
                      "\nmax_clock_mhz=" + std::to_string(d->max_clock_mhz) +
                      "\nmax_work_group_size=" + std::to_string(d->max_work_group_size) +
                      "\nlocal_mem_bytes=" + std::to_string(d->local_mem_bytes) +
                      "\nmax_alloc_bytes=" + std::to_string(d->max_alloc_bytes) +
                      "\nfp16=" + std::to_string(int(d->fp16)) + "\nfp16_storage=1\nbf16=1" +
                      "\nfp64=" + std::to_string(int(d->fp64)) +
                      "\ncompiler_available=" + std::to_string(int(d->compiler_available)) +
                      "\nbinary_cache_dir=" + cache.dir() +
                      "\nbinary_cache_hits=" + std::to_string(d->binary_cache_hits.load()) +
                      "\nbinary_cache_misses=" + std::to_string(d->binary_cache_misses.load()) +
                      "\nbinary_cache_rejected=" + std::to_string(d->binary_cache_rejected.load()) +
                      (cache_problem.empty() ? "" : "\nbinary_cache_problem=" + cache_problem) +
                      "\nhost_to_device_copies=" + std::to_string(d->host_to_device_copies.load()) +
                      "\ndevice_to_host_copies=" + std::to_string(d->device_to_host_copies.load());
  copy_str(out->properties, sizeof(out->properties), props);
  return TO_OK;
}

to_status cl_mem_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes) {
  ClDevice* d = device_at(device);
  if (!d) return TO_ERR_INVALID_ARGUMENT;
  // OpenCL has no query for free memory: report what this plugin has not
  // allocated (other processes and the driver's own use are invisible).
  const uint64_t used = d->allocated_bytes.load();
  *total_bytes = d->global_mem_bytes;
  *free_bytes = used < d->global_mem_bytes ? d->global_mem_bytes - used : 0;
  return TO_OK;
}

to_status create_buffer(ClDevice& d, size_t bytes, cl_mem* out, cl_int* code) {
  cl_int& err = *code;
  TENSOR_OPS_CL_CHECK((*out = clCreateBuffer(d.context, CL_MEM_READ_WRITE, bytes, nullptr, &err), err));
  return TO_OK;
}

to_status cl_allocate(int32_t device, size_t bytes, void** ptr) {
  *ptr = nullptr;
  if (bytes == 0) return TO_OK;
  ClDevice* d = nullptr;
  TENSOR_OPS_CL_RETURN_IF_ERROR(open_device(device, &d));
  if (d->max_alloc_bytes && bytes > d->max_alloc_bytes)
    return fail(TO_ERR_OUT_OF_MEMORY, "opencl: " + std::to_string(bytes) + " bytes is more than '" + d->name +
                                          "' allows in one buffer (CL_DEVICE_MAX_MEM_ALLOC_SIZE = " +
                                          std::to_string(d->max_alloc_bytes) + " bytes)");
  cl_mem m = nullptr;
  cl_int err = CL_SUCCESS;
  const to_status st = create_buffer(*d, bytes, &m, &err);
  // Out of resources while allocating is out of memory; elsewhere that code
  // usually means a failed launch.
  if (st != TO_OK) return err == CL_OUT_OF_RESOURCES ? TO_ERR_OUT_OF_MEMORY : st;
  d->allocated_bytes += bytes;
  *ptr = m;
  return TO_OK;
}

// No status to return: a failure is kept as the last error.
void cl_deallocate(int32_t device, void* ptr, size_t bytes) {
  if (!ptr) return;
  ClDevice* d = device_at(device);
  if (!d) return;
  const cl_int err = clReleaseMemObject(static_cast<cl_mem>(ptr));
  if (err != CL_SUCCESS) {
    fail_call("clReleaseMemObject(ptr)", err, __FILE__, __LINE__);
    return;
  }
  d->allocated_bytes -= bytes;
}

to_status cl_copy(int32_t device, void* dst, uint64_t dst_offset, const void* src, uint64_t src_offset, size_t bytes,
                  int32_t kind) {
  if (kind < 0 || kind > 2)
    return fail(TO_ERR_INVALID_ARGUMENT, "copy kind " + std::to_string(kind) + " is not 0 (h2d), 1 (d2h) or 2 (d2d)");
  if (bytes == 0) return TO_OK;
  ClDevice* d = nullptr;
  TENSOR_OPS_CL_RETURN_IF_ERROR(open_device(device, &d));
  cl_command_queue q = d->queue;
  if (kind == 0) {
    TENSOR_OPS_CL_CHECK(clEnqueueWriteBuffer(q, static_cast<cl_mem>(dst), CL_TRUE, dst_offset, bytes,
                                             static_cast<const char*>(src) + src_offset, 0, nullptr, nullptr));
    ++d->host_to_device_copies;
  } else if (kind == 1) {
    TENSOR_OPS_CL_CHECK(clEnqueueReadBuffer(q, static_cast<cl_mem>(const_cast<void*>(src)), CL_TRUE, src_offset, bytes,
                                            static_cast<char*>(dst) + dst_offset, 0, nullptr, nullptr));
    ++d->device_to_host_copies;
  } else {
    TENSOR_OPS_CL_CHECK(clEnqueueCopyBuffer(q, static_cast<cl_mem>(const_cast<void*>(src)), static_cast<cl_mem>(dst),
                                            src_offset, dst_offset, bytes, 0, nullptr, nullptr));
    TENSOR_OPS_CL_CHECK(clFinish(q));
  }
  return TO_OK;
}

to_status cl_memset(int32_t device, void* dst, uint64_t offset, int32_t value, size_t bytes) {
  if (bytes == 0) return TO_OK;
  ClDevice* d = nullptr;
  TENSOR_OPS_CL_RETURN_IF_ERROR(open_device(device, &d));
  const cl_uchar pattern = cl_uchar(value);
  TENSOR_OPS_CL_CHECK(clEnqueueFillBuffer(d->queue, static_cast<cl_mem>(dst), &pattern, sizeof(pattern), offset, bytes,
                                          0, nullptr, nullptr));
  TENSOR_OPS_CL_CHECK(clFinish(d->queue));
  return TO_OK;
}

to_status cl_synchronize(int32_t device) {
  ClDevice* d = nullptr;
  TENSOR_OPS_CL_RETURN_IF_ERROR(open_device(device, &d));
  TENSOR_OPS_CL_CHECK(clFinish(d->queue));
  return TO_OK;
}

const char* cl_last_error() { return last_error(); }

// --- kernel launches ---

struct LocalFloats {
  size_t count;
};

to_status set_arg(cl_kernel k, cl_uint index, const LocalFloats& local) {
  TENSOR_OPS_CL_CHECK(clSetKernelArg(k, index, local.count * sizeof(cl_float), nullptr));
  return TO_OK;
}

template <class A>
to_status set_arg(cl_kernel k, cl_uint index, const A& value) {
  TENSOR_OPS_CL_CHECK(clSetKernelArg(k, index, sizeof(A), &value));
  return TO_OK;
}

template <class... A>
to_status set_args(cl_kernel k, const A&... values) {
  cl_uint index = 0;
  to_status st = TO_OK;
  ((st = st == TO_OK ? set_arg(k, index++, values) : st), ...);
  return st;
}

// Kernels index elements: the byte offset in elements.
to_status element_offset(const to_tensor& t, cl_ulong* out) {
  const uint64_t item = t.dtype == TO_FLOAT32 ? 4 : 2;
  if (t.byte_offset % item != 0)
    return fail(TO_ERR_INVALID_ARGUMENT, "opencl: byte offset " + std::to_string(t.byte_offset) +
                                             " is not a multiple of the element size " + std::to_string(item));
  *out = t.byte_offset / item;
  return TO_OK;
}

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

size_t pow2_at_least(size_t n) {
  size_t p = 1;
  while (p < n) p *= 2;
  return p;
}

to_status enqueue(ClDevice& d, cl_kernel k, cl_uint dims, const size_t* global, const size_t* local) {
  TENSOR_OPS_CL_CHECK(clEnqueueNDRangeKernel(d.queue, k, dims, nullptr, global, local, 0, nullptr, nullptr));
  TENSOR_OPS_CL_CHECK(clFlush(d.queue));
  return TO_OK;
}

to_status run_rms_norm(const to_op_call* c) {
  const to_tensor &x = c->inputs[0], &w = c->inputs[1], &y = c->outputs[0];
  ClDevice* d = nullptr;
  Program* p = nullptr;
  TENSOR_OPS_CL_RETURN_IF_ERROR(open_device(x.device_id, &d));
  TENSOR_OPS_CL_RETURN_IF_ERROR(program_for(*d, to_dtype(x.dtype), &p));
  cl_ulong x_off = 0, w_off = 0, y_off = 0;
  TENSOR_OPS_CL_RETURN_IF_ERROR(element_offset(x, &x_off));
  TENSOR_OPS_CL_RETURN_IF_ERROR(element_offset(w, &w_off));
  TENSOR_OPS_CL_RETURN_IF_ERROR(element_offset(y, &y_off));
  const size_t rows = size_t(x.shape[0]), cols = size_t(x.shape[1]);
  const size_t group = std::min(p->rms_norm_group, pow2_at_least((cols + 7) / 8));
  const size_t global = rows * group;
  std::lock_guard<std::mutex> lock(p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_args(p->rms_norm, mem(x), x_off, cl_ulong(x.strides[0]), mem(w), w_off, mem(y),
                                         y_off, cl_ulong(y.strides[0]), cl_ulong(cols), cl_float(c->scalars[0]),
                                         LocalFloats{group}));
  return enqueue(*d, p->rms_norm, 1, &global, &group);
}

to_status run_activation(const to_op_call* c, ActivationKernel activation) {
  const to_tensor &x = c->inputs[0], &y = c->outputs[0];
  ClDevice* d = nullptr;
  Program* p = nullptr;
  TENSOR_OPS_CL_RETURN_IF_ERROR(open_device(x.device_id, &d));
  TENSOR_OPS_CL_RETURN_IF_ERROR(program_for(*d, to_dtype(x.dtype), &p));
  cl_ulong x_off = 0, y_off = 0;
  TENSOR_OPS_CL_RETURN_IF_ERROR(element_offset(x, &x_off));
  TENSOR_OPS_CL_RETURN_IF_ERROR(element_offset(y, &y_off));
  const size_t rows = size_t(x.shape[0]), cols = size_t(x.shape[1]);
  std::lock_guard<std::mutex> lock(p->launch_mutex);
  if (rows == 1 || (size_t(x.strides[0]) == cols && size_t(y.strides[0]) == cols)) {
    cl_kernel k = p->activation[activation][kFlat];
    const size_t n = rows * cols;
    const size_t chunks = (n + 7) / 8;  // a work-item takes 8 elements
    const size_t group = std::min(p->activation_group, pow2_at_least(chunks));
    const size_t global = round_up(chunks, group);
    TENSOR_OPS_CL_RETURN_IF_ERROR(set_args(k, mem(x), x_off, mem(y), y_off, cl_ulong(n)));
    return enqueue(*d, k, 1, &global, &group);
  }
  cl_kernel k = p->activation[activation][kRows];
  const size_t chunks = (cols + 7) / 8;
  const size_t local[2] = {std::min(p->activation_group, pow2_at_least(chunks)), 1};
  const size_t global[2] = {round_up(chunks, local[0]), rows};
  TENSOR_OPS_CL_RETURN_IF_ERROR(
      set_args(k, mem(x), x_off, cl_ulong(x.strides[0]), mem(y), y_off, cl_ulong(y.strides[0]), cl_ulong(cols)));
  return enqueue(*d, k, 2, global, local);
}

to_status run_silu(const to_op_call* c) { return run_activation(c, kSilu); }
to_status run_gelu(const to_op_call* c) { return run_activation(c, c->ints[0] == 1 ? kGeluTanh : kGeluErf); }

to_backend_v1 make_table() {
  to_backend_v1 t{};
  t.abi_version = TENSOR_OPS_PLUGIN_ABI_VERSION;
  t.name = "opencl";
  t.flags = TO_BACKEND_HANDLE_MEMORY;
  t.init = cl_init;
  t.priority = cl_priority;
  t.device_count = cl_device_count;
  t.device_info = cl_device_info;
  t.mem_info = cl_mem_info;
  t.allocate = cl_allocate;
  t.deallocate = cl_deallocate;
  t.copy = cl_copy;
  t.memset = cl_memset;
  t.synchronize = cl_synchronize;
  t.last_error = cl_last_error;
  t.kernels[int(OpId::rms_norm)] = run_rms_norm;
  t.kernels[int(OpId::silu)] = run_silu;
  t.kernels[int(OpId::gelu)] = run_gelu;
  return t;
}

}  // namespace
}  // namespace tensor_ops::opencl

extern "C" __attribute__((visibility("default"))) const to_backend_v1* tensor_ops_backend_v1() {
  static const to_backend_v1 table = tensor_ops::opencl::make_table();
  return &table;
}
