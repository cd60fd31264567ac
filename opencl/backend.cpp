// The OpenCL backend's plugin table: devices of every platform, buffers as
// cl_mem handles (TO_BACKEND_HANDLE_MEMORY), blocking copies, and the kernel
// entries. Kernels are enqueued on the device's in-order queue and not
// waited for: copies and later kernels on that queue come after them.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <type_traits>

#include "binary_cache.h"
#include "cl_check.h"
#include "devices.h"
#include "programs.h"
#include "tensor_ops/bad_index.h"
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

uint64_t item_size(int32_t dtype) {
  return dtype == TO_FLOAT32 || dtype == TO_INT32 ? 4 : dtype == TO_INT64 ? 8 : 2;
}

// Kernels index elements: the byte offset in elements.
to_status element_offset(const to_tensor& t, cl_ulong* out) {
  const uint64_t item = item_size(t.dtype);
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

// rms_norm's weight offset as the kernels take it: -0.0f for none (w + -0.0f
// is w bit for bit; +0.0f would turn a -0.0 weight into +0.0).
cl_float weight_offset(double offset) { return offset == 0 ? -0.0f : cl_float(offset); }

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
                                         weight_offset(c->scalars[1]), LocalFloats{group}));
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


// --- the LLM op set ---

// What a launch needs: the device, the dtype's program and its kernels.
struct Launch {
  ClDevice* d = nullptr;
  Program* p = nullptr;
};

to_status begin(const to_tensor& x, Launch* l) {
  TENSOR_OPS_CL_RETURN_IF_ERROR(open_device(x.device_id, &l->d));
  return program_for(*l->d, to_dtype(x.dtype), &l->p);
}

// A tensor as (cl_mem, element offset) kernel arguments.
struct Buf {
  cl_mem m = nullptr;
  cl_ulong off = 0;
};

bool has_elements(const to_tensor& t) {
  for (int32_t i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return false;
  return true;
}

// A tensor with no elements gets the dummy buffer: its handle is no cl_mem
// (the core's device memory hands out (void*)64 for an empty tensor).
to_status buf(const Launch& l, const to_tensor& t, Buf* out) {
  out->m = t.data && has_elements(t) ? mem(t) : l.p->dummy;
  return element_offset(t, &out->off);
}

to_status set_arg(cl_kernel k, cl_uint index, const Buf& b) {
  TENSOR_OPS_CL_CHECK(clSetKernelArg(k, index, sizeof(cl_mem), &b.m));
  TENSOR_OPS_CL_CHECK(clSetKernelArg(k, index + 1, sizeof(cl_ulong), &b.off));
  return TO_OK;
}

// set_args with Buf taking two slots.
template <class A>
cl_uint arg_slots(const A&) {
  return std::is_same_v<A, Buf> ? 2 : 1;
}

template <class... A>
to_status set_kernel_args(cl_kernel k, const A&... values) {
  cl_uint index = 0;
  to_status st = TO_OK;
  ((st = st == TO_OK ? set_arg(k, index, values) : st, index += arg_slots(values)), ...);
  return st;
}

// A scratch buffer for one call, released once the enqueued kernels using it
// are done (OpenCL keeps it until then).
struct TempBuffer {
  cl_mem m = nullptr;
  ~TempBuffer() {
    if (m) clReleaseMemObject(m);
  }
};

to_status temp_buffer(ClDevice& d, size_t bytes, TempBuffer* out) {
  cl_int err = CL_SUCCESS;
  TENSOR_OPS_CL_CHECK((out->m = clCreateBuffer(d.context, CL_MEM_READ_WRITE, std::max<size_t>(bytes, 16), nullptr,
                                               &err),
                       err));
  return TO_OK;
}

// A work-group per row, the tuned row group (1 on CPU devices), capped at
// what the row's chunks of 8 need.
to_status enqueue_rows(const Launch& l, cl_kernel k, size_t rows, size_t cols) {
  if (rows == 0) return TO_OK;
  const size_t group = std::min(l.p->row_group, pow2_at_least((cols + 7) / 8));
  const size_t global = rows * group;
  return enqueue(*l.d, k, 1, &global, &group);
}

size_t row_group_for(const Launch& l, size_t cols) { return std::min(l.p->row_group, pow2_at_least((cols + 7) / 8)); }

// The flag a kernel sets on a bad index: zeroed before the launch, read
// (blocking) after it.
to_status clear_flag(const Launch& l) {
  if (!l.p->bad_flag) {
    cl_int err = CL_SUCCESS;
    TENSOR_OPS_CL_CHECK((l.p->bad_flag = clCreateBuffer(l.d->context, CL_MEM_READ_WRITE, sizeof(cl_int), nullptr, &err), err));
  }
  const cl_int zero = 0;  // the fill copies the pattern: nothing outlives this call
  TENSOR_OPS_CL_CHECK(
      clEnqueueFillBuffer(l.d->queue, l.p->bad_flag, &zero, sizeof(zero), 0, sizeof(zero), 0, nullptr, nullptr));
  return TO_OK;
}

to_status read_flag(const Launch& l, cl_int* out) {
  *out = 0;
  TENSOR_OPS_CL_CHECK(
      clEnqueueReadBuffer(l.d->queue, l.p->bad_flag, CL_TRUE, 0, sizeof(cl_int), out, 0, nullptr, nullptr));
  return TO_OK;
}

cl_ulong rstride(const to_tensor& t) { return cl_ulong(t.strides[0]); }

to_status run_layer_norm(const to_op_call* c) {
  const to_tensor &x = c->inputs[0], &w = c->inputs[1], &y = c->outputs[0];
  const bool has_bias = c->ints[0] != 0;
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(x, &l));
  Buf bx, bw, bb, by;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, x, &bx));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, w, &bw));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, y, &by));
  if (has_bias) TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, c->inputs[2], &bb));
  else bb = bw;
  const size_t rows = size_t(x.shape[0]), cols = size_t(x.shape[1]);
  cl_kernel k = l.p->kernels[kLayerNorm];
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, bx, rstride(x), bw, bb, cl_int(has_bias), by, rstride(y),
                                                cl_ulong(cols), cl_float(c->scalars[0]),
                                                LocalFloats{row_group_for(l, cols)}));
  return enqueue_rows(l, k, rows, cols);
}

to_status run_add_rms_norm(const to_op_call* c) {
  const to_tensor &x = c->inputs[0], &r = c->inputs[1], &w = c->inputs[2], &y = c->outputs[0], &ro = c->outputs[1];
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(x, &l));
  Buf bx, br, bw, by, bro;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, x, &bx));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, r, &br));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, w, &bw));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, y, &by));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, ro, &bro));
  const size_t rows = size_t(x.shape[0]), cols = size_t(x.shape[1]);
  cl_kernel k = l.p->kernels[kAddRmsNorm];
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, bx, rstride(x), br, rstride(r), bw, by, rstride(y), bro,
                                                rstride(ro), cl_ulong(cols), cl_float(c->scalars[0]),
                                                LocalFloats{row_group_for(l, cols)}));
  return enqueue_rows(l, k, rows, cols);
}

// Row blocks of the dweight partial sums: ~64 rows each, at most 256 blocks.
to_status run_norm_backward(const to_op_call* c, bool layer) {
  const to_tensor &dy = c->inputs[0], &x = c->inputs[1], &w = c->inputs[2], &dx = c->outputs[0],
                  &dw = c->outputs[1];
  const bool has_bias = layer && c->ints[0] != 0;
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(x, &l));
  Buf bdy, bx, bw, bdx, bdw, bdb;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dy, &bdy));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, x, &bx));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, w, &bw));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dx, &bdx));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dw, &bdw));
  if (has_bias) TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, c->outputs[2], &bdb));
  else bdb = bdw;
  const size_t rows = size_t(x.shape[0]), cols = size_t(x.shape[1]);
  const size_t rows_per_block = std::max<size_t>(64, (rows + 255) / 256);
  const size_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  TempBuffer stats, partial;
  TENSOR_OPS_CL_RETURN_IF_ERROR(temp_buffer(*l.d, rows * 2 * sizeof(cl_float), &stats));
  TENSOR_OPS_CL_RETURN_IF_ERROR(temp_buffer(*l.d, blocks * 2 * cols * sizeof(cl_float), &partial));
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  cl_kernel k = l.p->kernels[kNormBackwardRows];
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, bdy, rstride(dy), bx, rstride(x), bw, bdx, rstride(dx), stats.m,
                                                cl_ulong(cols), cl_float(c->scalars[0]),
                                                weight_offset(layer ? 0.0 : c->scalars[1]), cl_int(layer),
                                                LocalFloats{row_group_for(l, cols)}));
  TENSOR_OPS_CL_RETURN_IF_ERROR(enqueue_rows(l, k, rows, cols));
  const size_t col_group = std::min<size_t>(l.p->activation_group, 64);
  if (blocks > 0) {
    k = l.p->kernels[kNormBackwardPartials];
    TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, bdy, rstride(dy), bx, rstride(x), stats.m, partial.m,
                                                  cl_ulong(rows), cl_ulong(cols), cl_ulong(rows_per_block)));
    const size_t local[2] = {col_group, 1}, global[2] = {round_up(cols, col_group), blocks};
    TENSOR_OPS_CL_RETURN_IF_ERROR(enqueue(*l.d, k, 2, global, local));
  }
  k = l.p->kernels[kNormBackwardFinal];
  TENSOR_OPS_CL_RETURN_IF_ERROR(
      set_kernel_args(k, partial.m, cl_ulong(blocks), cl_ulong(cols), bdw, bdb, cl_int(has_bias)));
  const size_t global = round_up(cols, col_group);
  return enqueue(*l.d, k, 1, &global, &col_group);
}

to_status run_rms_norm_backward(const to_op_call* c) { return run_norm_backward(c, false); }
to_status run_layer_norm_backward(const to_op_call* c) { return run_norm_backward(c, true); }

to_status run_softmax(const to_op_call* c) {
  const to_tensor &x = c->inputs[0], &y = c->outputs[0];
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(x, &l));
  Buf bx, by;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, x, &bx));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, y, &by));
  const size_t rows = size_t(x.shape[0]), cols = size_t(x.shape[1]);
  cl_kernel k = l.p->kernels[kSoftmax];
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(
      k, bx, rstride(x), by, rstride(y), cl_ulong(cols), cl_float(c->scalars[0]), cl_int(c->ints[0]),
      cl_int(c->ints[1] != 0), cl_ulong(c->ints[2] > 0 ? c->ints[2] : 1), LocalFloats{row_group_for(l, cols)}));
  return enqueue_rows(l, k, rows, cols);
}

to_status run_softmax_backward(const to_op_call* c) {
  const to_tensor &dy = c->inputs[0], &y = c->inputs[1], &dx = c->outputs[0];
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(y, &l));
  Buf bdy, by, bdx;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dy, &bdy));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, y, &by));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dx, &bdx));
  const size_t rows = size_t(y.shape[0]), cols = size_t(y.shape[1]);
  cl_kernel k = l.p->kernels[kSoftmaxBackward];
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, bdy, rstride(dy), by, rstride(y), bdx, rstride(dx),
                                                cl_ulong(cols), cl_float(c->scalars[0]), cl_int(c->ints[1] != 0),
                                                LocalFloats{row_group_for(l, cols)}));
  return enqueue_rows(l, k, rows, cols);
}

// Every tensor of the call contiguous (or one row): one flat range.
bool all_flat(const to_op_call* c) {
  auto flat = [](const to_tensor& t) { return t.shape[0] <= 1 || t.strides[0] == t.shape[1]; };
  for (int i = 0; i < c->n_inputs; ++i)
    if (!flat(c->inputs[i])) return false;
  for (int i = 0; i < c->n_outputs; ++i)
    if (!flat(c->outputs[i])) return false;
  return true;
}

// activation_backward (dy, x -> dx) and glu (gate, up -> y): two inputs, one output.
to_status run_binary_elementwise(const to_op_call* c, int flat_kernel, int rows_kernel) {
  const to_tensor &a = c->inputs[0], &b = c->inputs[1], &y = c->outputs[0];
  const int64_t act = c->ints[0];
  if (act < 0 || act > 2) return fail(TO_ERR_INVALID_ARGUMENT, "opencl: activation " + std::to_string(act));
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(a, &l));
  Buf ba, bb, by;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, a, &ba));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, b, &bb));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, y, &by));
  const size_t rows = size_t(a.shape[0]), cols = size_t(a.shape[1]);
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  if (all_flat(c)) {
    cl_kernel k = l.p->kernels[flat_kernel + act];
    const size_t n = rows * cols, chunks = (n + 7) / 8;
    const size_t group = std::min(l.p->activation_group, pow2_at_least(chunks));
    const size_t global = round_up(chunks, group);
    TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, ba, bb, by, cl_ulong(n)));
    return enqueue(*l.d, k, 1, &global, &group);
  }
  cl_kernel k = l.p->kernels[rows_kernel + act];
  const size_t chunks = (cols + 7) / 8;
  const size_t local[2] = {std::min(l.p->activation_group, pow2_at_least(chunks)), 1};
  const size_t global[2] = {round_up(chunks, local[0]), rows};
  TENSOR_OPS_CL_RETURN_IF_ERROR(
      set_kernel_args(k, ba, rstride(a), bb, rstride(b), by, rstride(y), cl_ulong(cols)));
  return enqueue(*l.d, k, 2, global, local);
}

to_status run_activation_backward(const to_op_call* c) { return run_binary_elementwise(c, kActBwdFlat, kActBwdRows); }
to_status run_glu(const to_op_call* c) { return run_binary_elementwise(c, kGluFlat, kGluRows); }

to_status run_glu_backward(const to_op_call* c) {
  const to_tensor &dy = c->inputs[0], &g = c->inputs[1], &u = c->inputs[2], &dg = c->outputs[0], &du = c->outputs[1];
  const int64_t act = c->ints[0];
  if (act < 0 || act > 2) return fail(TO_ERR_INVALID_ARGUMENT, "opencl: activation " + std::to_string(act));
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(g, &l));
  Buf bdy, bg, bu, bdg, bdu;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dy, &bdy));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, g, &bg));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, u, &bu));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dg, &bdg));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, du, &bdu));
  const bool flat = all_flat(c);
  const size_t rows = flat ? 1 : size_t(g.shape[0]);
  const size_t cols = flat ? size_t(g.shape[0] * g.shape[1]) : size_t(g.shape[1]);
  cl_kernel k = l.p->kernels[kGluBwd + act];
  const size_t chunks = (cols + 7) / 8;
  const size_t local[2] = {std::min(l.p->activation_group, pow2_at_least(chunks)), 1};
  const size_t global[2] = {round_up(chunks, local[0]), rows};
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, bdy, rstride(dy), bg, rstride(g), bu, rstride(u), bdg, rstride(dg),
                                                bdu, rstride(du), cl_ulong(cols)));
  return enqueue(*l.d, k, 2, global, local);
}

to_status run_rope(const to_op_call* c) {
  const to_tensor &x = c->inputs[0], &cs = c->inputs[1], &sn = c->inputs[2], &pos = c->inputs[3], &y = c->outputs[0];
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(x, &l));
  Buf bx, bc, bs, bp, by;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, x, &bx));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, cs, &bc));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, sn, &bs));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, pos, &bp));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, y, &by));
  const size_t B = size_t(x.shape[0]), S = size_t(x.shape[1]), H = size_t(x.shape[2]), D = size_t(x.shape[3]);
  const size_t P = size_t(cs.shape[0]), half = size_t(cs.shape[1]);
  const cl_ulong pos_batch_stride = pos.shape[0] == 1 ? 0 : cl_ulong(pos.strides[0]);
  cl_kernel k = l.p->kernels[kRope];
  // A GPU takes an element pair per work-item; a CPU device a row per
  // work-item (PoCL: 4x512x16x128 took 19 ms with a pair per item).
  const size_t items = D - half;
  const bool cpu = l.d->type & CL_DEVICE_TYPE_CPU;
  const size_t width = cpu ? 1 : std::min<size_t>(std::min<size_t>(l.p->activation_group, 64), pow2_at_least(items));
  const size_t rows = B * S * H, row_block = cpu ? std::min<size_t>(64, rows) : 1;
  const size_t local[2] = {width, row_block};
  const size_t global[2] = {cpu ? 1 : round_up(items, width), round_up(rows, row_block)};
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(clear_flag(l));
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, bx, bc, bs, bp, cl_int(pos.dtype == TO_INT64), pos_batch_stride,
                                                by, cl_ulong(S), cl_ulong(H), cl_ulong(D), cl_ulong(half),
                                                cl_ulong(P), cl_int(c->ints[0] != 0), cl_int(c->ints[1] != 0),
                                                l.p->bad_flag, cl_ulong(rows)));
  TENSOR_OPS_CL_RETURN_IF_ERROR(enqueue(*l.d, k, 2, global, local));
  cl_int bad = 0;
  TENSOR_OPS_CL_RETURN_IF_ERROR(read_flag(l, &bad));
  if (bad) return fail(TO_ERR_INVALID_ARGUMENT, bad_position_message(int64_t(P)));
  return TO_OK;
}

to_status run_cross_entropy(const to_op_call* c) {
  const to_tensor &lg = c->inputs[0], &tg = c->inputs[1], &loss = c->outputs[0];
  const bool has_grad = c->ints[1] != 0;
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(lg, &l));
  Buf blg, btg, bloss, bdl;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, lg, &blg));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, tg, &btg));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, loss, &bloss));
  if (has_grad) TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, c->outputs[1], &bdl));
  else bdl = blg;
  const size_t N = size_t(lg.shape[0]), C = size_t(lg.shape[1]);
  cl_kernel k = l.p->kernels[kCrossEntropy];
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(clear_flag(l));
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(k, blg, btg, cl_int(tg.dtype == TO_INT64), bloss, bdl,
                                                cl_int(has_grad), cl_ulong(C), cl_long(c->ints[0]),
                                                cl_float(c->scalars[0]), l.p->bad_flag,
                                                LocalFloats{row_group_for(l, C)}, cl_float(c->scalars[1]),
                                                cl_float(c->scalars[2]), cl_float(c->scalars[3])));
  TENSOR_OPS_CL_RETURN_IF_ERROR(enqueue_rows(l, k, N, C));
  cl_int bad = 0;
  TENSOR_OPS_CL_RETURN_IF_ERROR(read_flag(l, &bad));
  if (bad) return fail(TO_ERR_INVALID_ARGUMENT, bad_target_message(int64_t(C), c->ints[0]));
  return TO_OK;
}

// Local memory for `floats` floats, or a clear error when the device has
// less (head_dim too large for this kernel's layout).
to_status check_local(const Launch& l, size_t floats, const char* op) {
  if (l.d->local_mem_bytes && floats * sizeof(cl_float) > l.d->local_mem_bytes)
    return fail(TO_ERR_UNSUPPORTED, std::string("opencl ") + op + ": needs " + std::to_string(floats * 4) +
                                        " bytes of local memory, '" + l.d->name + "' has " +
                                        std::to_string(l.d->local_mem_bytes));
  return TO_OK;
}

to_status run_attention(const to_op_call* c) {
  const to_tensor &q = c->inputs[0], &k = c->inputs[1], &v = c->inputs[2], &o = c->outputs[0], &lse = c->outputs[1];
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(q, &l));
  Buf bq, bk, bv, bo, blse;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, q, &bq));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, k, &bk));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, v, &bv));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, o, &bo));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, lse, &blse));
  const size_t B = size_t(q.shape[0]), Hq = size_t(q.shape[1]), Lq = size_t(q.shape[2]), D = size_t(q.shape[3]);
  const size_t Hkv = size_t(k.shape[1]), Lk = size_t(k.shape[2]);
  const size_t G = l.p->attention_group;
  TENSOR_OPS_CL_RETURN_IF_ERROR(check_local(l, 2 * D + 2 * G, "attention"));
  cl_kernel kk = l.p->kernels[kAttentionFwd];
  const size_t rows = B * Hq * Lq, global = rows * G;
  if (rows == 0) return TO_OK;
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(kk, bq, bk, bv, bo, blse, cl_ulong(Hq), cl_ulong(Hkv), cl_ulong(Lq),
                                                cl_ulong(Lk), cl_ulong(D), cl_float(c->scalars[0]),
                                                cl_int(c->ints[0]), LocalFloats{D}, LocalFloats{D},
                                                LocalFloats{G}, LocalFloats{G}));
  return enqueue(*l.d, kk, 1, &global, &G);
}

to_status run_attention_backward(const to_op_call* c) {
  const to_tensor &dout = c->inputs[0], &q = c->inputs[1], &k = c->inputs[2], &v = c->inputs[3], &o = c->inputs[4],
                  &lse = c->inputs[5], &dq = c->outputs[0], &dk = c->outputs[1], &dv = c->outputs[2];
  Launch l;
  TENSOR_OPS_CL_RETURN_IF_ERROR(begin(q, &l));
  Buf bdo, bq, bk, bv, bo, blse, bdq, bdk, bdv;
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dout, &bdo));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, q, &bq));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, k, &bk));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, v, &bv));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, o, &bo));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, lse, &blse));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dq, &bdq));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dk, &bdk));
  TENSOR_OPS_CL_RETURN_IF_ERROR(buf(l, dv, &bdv));
  const size_t B = size_t(q.shape[0]), Hq = size_t(q.shape[1]), Lq = size_t(q.shape[2]), D = size_t(q.shape[3]);
  const size_t Hkv = size_t(k.shape[1]), Lk = size_t(k.shape[2]);
  const size_t G = l.p->attention_group;
  TENSOR_OPS_CL_RETURN_IF_ERROR(check_local(l, 4 * D + 2 * G, "attention_backward"));
  const size_t qrows = B * Hq * Lq, krows = B * Hkv * Lk;
  const cl_float scale = cl_float(c->scalars[0]);
  const cl_int causal = cl_int(c->ints[0]);  // 0 none, 1 bottom-right, 2 top-left
  TempBuffer delta;
  TENSOR_OPS_CL_RETURN_IF_ERROR(temp_buffer(*l.d, qrows * sizeof(cl_float), &delta));
  std::lock_guard<std::mutex> lock(l.p->launch_mutex);
  if (qrows > 0) {
    cl_kernel kk = l.p->kernels[kAttentionBwdDelta];
    const size_t group = std::min<size_t>(l.p->activation_group, 64), global = round_up(qrows, group);
    TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(kk, bdo, bo, delta.m, cl_ulong(qrows), cl_ulong(D)));
    TENSOR_OPS_CL_RETURN_IF_ERROR(enqueue(*l.d, kk, 1, &global, &group));
    kk = l.p->kernels[kAttentionBwdDq];
    TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(kk, bdo, bq, bk, bv, blse, delta.m, bdq, cl_ulong(Hq),
                                                  cl_ulong(Hkv), cl_ulong(Lq), cl_ulong(Lk), cl_ulong(D), scale,
                                                  causal, LocalFloats{D}, LocalFloats{D}, LocalFloats{D},
                                                  LocalFloats{G}));
    const size_t gq = qrows * G;
    TENSOR_OPS_CL_RETURN_IF_ERROR(enqueue(*l.d, kk, 1, &gq, &G));
  }
  if (krows > 0) {
    cl_kernel kk = l.p->kernels[kAttentionBwdDkdv];
    TENSOR_OPS_CL_RETURN_IF_ERROR(set_kernel_args(kk, bdo, bq, bk, bv, blse, delta.m, bdk, bdv, cl_ulong(Hq),
                                                  cl_ulong(Hkv), cl_ulong(Lq), cl_ulong(Lk), cl_ulong(D), scale,
                                                  causal, LocalFloats{D}, LocalFloats{D}, LocalFloats{D},
                                                  LocalFloats{D}, LocalFloats{G}, LocalFloats{G}));
    const size_t gk = krows * G;
    TENSOR_OPS_CL_RETURN_IF_ERROR(enqueue(*l.d, kk, 1, &gk, &G));
  }
  return TO_OK;
}

to_backend_v1 make_table() {
  to_backend_v1 t{};
  t.abi_version = TENSOR_OPS_PLUGIN_ABI_VERSION;
  t.name = "opencl";
  t.flags = TO_BACKEND_HANDLE_MEMORY | TO_BACKEND_CE_OPTIONS | TO_BACKEND_NORM_OFFSET;
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
  t.kernels[int(OpId::layer_norm)] = run_layer_norm;
  t.kernels[int(OpId::rms_norm_backward)] = run_rms_norm_backward;
  t.kernels[int(OpId::layer_norm_backward)] = run_layer_norm_backward;
  t.kernels[int(OpId::add_rms_norm)] = run_add_rms_norm;
  t.kernels[int(OpId::softmax)] = run_softmax;
  t.kernels[int(OpId::softmax_backward)] = run_softmax_backward;
  t.kernels[int(OpId::activation_backward)] = run_activation_backward;
  t.kernels[int(OpId::glu)] = run_glu;
  t.kernels[int(OpId::glu_backward)] = run_glu_backward;
  t.kernels[int(OpId::rope)] = run_rope;
  t.kernels[int(OpId::attention)] = run_attention;
  t.kernels[int(OpId::attention_backward)] = run_attention_backward;
  t.kernels[int(OpId::cross_entropy)] = run_cross_entropy;
  return t;
}

}  // namespace
}  // namespace tensor_ops::opencl

extern "C" __attribute__((visibility("default"))) const to_backend_v1* tensor_ops_backend_v1() {
  static const to_backend_v1 table = tensor_ops::opencl::make_table();
  return &table;
}
