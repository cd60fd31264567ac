#include "programs.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "binary_cache.h"
#include "kernel_sources.h"

namespace tensor_ops::opencl {
namespace {

const char* dtype_name(to_dtype t) {
  switch (t) {
    case TO_FLOAT32: return "float32";
    case TO_FLOAT16: return "float16";
    case TO_BFLOAT16: return "bfloat16";
    default: return "?";
  }
}

std::string build_log(const ClDevice& d, cl_program program) {
  size_t n = 0;
  if (clGetProgramBuildInfo(program, d.id, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n) != CL_SUCCESS || n == 0)
    return "(no build log)";
  std::string log(n, '\0');
  if (clGetProgramBuildInfo(program, d.id, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr) != CL_SUCCESS)
    return "(no build log)";
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  constexpr size_t kMaxLog = 16 << 10;
  if (log.size() > kMaxLog) log = log.substr(0, kMaxLog) + "\n... (build log truncated)";
  return log.empty() ? "(empty build log)" : log;
}

// Everything the compiled binary depends on, in full (the cache compares it).
std::string cache_key(const ClDevice& d, const std::string& options) {
  return "tensor_ops opencl program\nplatform=" + d.platform_name + "\nplatform_version=" + d.platform_version +
         "\ndevice=" + d.name + "\ndevice_version=" + d.device_version + "\ndriver_version=" + d.driver_version +
         "\noptions=" + options + "\nsource_sha256=" + kProgramSourceSha256 + "\n";
}

// Power of two, at most `limit`, no larger than needed for `work` items.
size_t pow2_group(size_t limit, size_t want) {
  size_t g = 1;
  while (g * 2 <= std::min(limit, want)) g *= 2;
  return g;
}

to_status make_kernels(ClDevice& d, Program& p) {
  static const char* const names[3][2] = {
      {"silu_flat", "silu_rows"}, {"gelu_erf_flat", "gelu_erf_rows"}, {"gelu_tanh_flat", "gelu_tanh_rows"}};
  cl_int err = CL_SUCCESS;
  size_t limit = 0;
  TENSOR_OPS_CL_CHECK((p.rms_norm = clCreateKernel(p.program, "rms_norm", &err), err));
  TENSOR_OPS_CL_CHECK(clGetKernelWorkGroupInfo(p.rms_norm, d.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(limit), &limit, nullptr));
  // A GPU wants a few warps per row. A CPU device runs a work-group as a
  // loop on one core: one work-item per row (float8 math, no reduction) was
  // fastest on PoCL (4096x4096: 18 ms against 27 ms with 4 to 64 items).
  // TENSOR_OPS_OPENCL_RMS_NORM_GROUP overrides (rounded down to a power of
  // two; it also lets PoCL run the reduction a GPU runs).
  const bool cpu = d.type & CL_DEVICE_TYPE_CPU;
  size_t rms_group = cpu ? 1 : 256;
  if (const char* env = std::getenv("TENSOR_OPS_OPENCL_RMS_NORM_GROUP"); env && std::atol(env) > 0)
    rms_group = size_t(std::atol(env));
  p.rms_norm_group = pow2_group(limit, rms_group);
  static const char* const llm_names[kKernelCount] = {
      "layer_norm", "add_rms_norm", "norm_backward_rows", "norm_backward_partials", "norm_backward_final",
      "softmax", "softmax_backward", "cross_entropy", "rope", "attention_fwd", "attention_bwd_delta",
      "attention_bwd_dq", "attention_bwd_dkdv",
      "act_bwd_silu_flat", "act_bwd_gelu_erf_flat", "act_bwd_gelu_tanh_flat",
      "act_bwd_silu_rows", "act_bwd_gelu_erf_rows", "act_bwd_gelu_tanh_rows",
      "glu_silu_flat", "glu_gelu_erf_flat", "glu_gelu_tanh_flat",
      "glu_silu_rows", "glu_gelu_erf_rows", "glu_gelu_tanh_rows",
      "glu_bwd_silu", "glu_bwd_gelu_erf", "glu_bwd_gelu_tanh"};
  // Row-wise kernels share rms_norm's tuned group. Attention takes 64 items
  // (a block of keys per step) on a GPU. On CPU devices a work-group is a
  // loop on one core: PoCL ran 1 item per query row fastest (1x8x512x64
  // causal: forward 34-64 ms against 120-150 ms with 8, backward 2-3x
  // faster), Intel's CPU runtime, which vectorises across items, 8 to 16
  // (forward 90-110 ms against 175-190 ms with 1).
  size_t row_limit = limit, attention_limit = d.max_work_group_size, elementwise_limit = d.max_work_group_size;
  for (int i = 0; i < kKernelCount; ++i) {
    TENSOR_OPS_CL_CHECK((p.kernels[i] = clCreateKernel(p.program, llm_names[i], &err), err));
    TENSOR_OPS_CL_CHECK(
        clGetKernelWorkGroupInfo(p.kernels[i], d.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(limit), &limit, nullptr));
    if (i <= kCrossEntropy) row_limit = std::min(row_limit, limit);
    else if (i <= kAttentionBwdDkdv) attention_limit = std::min(attention_limit, limit);
    else elementwise_limit = std::min(elementwise_limit, limit);
  }
  p.row_group = pow2_group(row_limit, rms_group);
  TENSOR_OPS_CL_CHECK((p.dummy = clCreateBuffer(d.context, CL_MEM_READ_WRITE, 16, nullptr, &err), err));
  const bool pocl = d.platform_name.find("Portable Computing Language") != std::string::npos;
  size_t attention_group = cpu ? (pocl ? 1 : 8) : 64;
  if (const char* env = std::getenv("TENSOR_OPS_OPENCL_ATTENTION_GROUP"); env && std::atol(env) > 0)
    attention_group = size_t(std::atol(env));
  p.attention_group = pow2_group(attention_limit, attention_group);
  size_t activation_limit = d.max_work_group_size;
  for (int a = 0; a < 3; ++a)
    for (int l = 0; l < 2; ++l) {
      TENSOR_OPS_CL_CHECK((p.activation[a][l] = clCreateKernel(p.program, names[a][l], &err), err));
      TENSOR_OPS_CL_CHECK(clGetKernelWorkGroupInfo(p.activation[a][l], d.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(limit),
                                                   &limit, nullptr));
      activation_limit = std::min(activation_limit, limit);
    }
  // 256 items of 8 elements; PoCL timed the same from 64 to 4096.
  p.activation_group = pow2_group(std::min(activation_limit, elementwise_limit), 256);
  return TO_OK;
}

void release(Program& p) {
  if (p.rms_norm) clReleaseKernel(p.rms_norm);
  for (auto& pair : p.activation)
    for (cl_kernel& k : pair) {
      if (k) clReleaseKernel(k);
      k = nullptr;
    }
  for (cl_kernel& k : p.kernels) {
    if (k) clReleaseKernel(k);
    k = nullptr;
  }
  if (p.bad_flag) clReleaseMemObject(p.bad_flag);
  if (p.dummy) clReleaseMemObject(p.dummy);
  p.bad_flag = p.dummy = nullptr;
  if (p.program) clReleaseProgram(p.program);
  p.rms_norm = nullptr;
  p.program = nullptr;
}

// From a cached binary; false (and nothing kept) when the driver refuses it.
bool build_from_binary(ClDevice& d, const std::vector<unsigned char>& binary, const std::string& options, Program& p) {
  const size_t size = binary.size();
  const unsigned char* data = binary.data();
  cl_int binary_status = CL_SUCCESS, err = CL_SUCCESS;
  p.program = clCreateProgramWithBinary(d.context, 1, &d.id, &size, &data, &binary_status, &err);
  const bool ok = err == CL_SUCCESS && binary_status == CL_SUCCESS &&
                  clBuildProgram(p.program, 1, &d.id, options.c_str(), nullptr, nullptr) == CL_SUCCESS &&
                  make_kernels(d, p) == TO_OK;
  if (!ok) release(p);
  return ok;
}

to_status build_from_source(ClDevice& d, to_dtype dtype, const std::string& options, Program& p) {
  if (!d.compiler_available)
    return fail(TO_ERR_DEVICE, "opencl device '" + d.name + "' has no OpenCL C compiler (CL_DEVICE_COMPILER_AVAILABLE "
                               "is false), so the tensor_ops kernels cannot be built for it");
  cl_int err = CL_SUCCESS;
  const char* source = kProgramSource;
  TENSOR_OPS_CL_CHECK((p.program = clCreateProgramWithSource(d.context, 1, &source, nullptr, &err), err));
  err = clBuildProgram(p.program, 1, &d.id, options.c_str(), nullptr, nullptr);
  if (err != CL_SUCCESS) {
    const std::string log = build_log(d, p.program);
    release(p);
    return fail(TO_ERR_DEVICE, std::string("building the OpenCL kernels for ") + dtype_name(dtype) + " on '" + d.name +
                                   "' failed: clBuildProgram returned " + cl_code_str(err) + " (options \"" + options +
                                   "\"); build log:\n" + log);
  }
  const to_status st = make_kernels(d, p);
  if (st != TO_OK) release(p);
  return st;
}

std::vector<unsigned char> program_binary(cl_program program) {
  size_t size = 0;
  if (clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr) != CL_SUCCESS || size == 0)
    return {};
  std::vector<unsigned char> binary(size);
  unsigned char* data = binary.data();
  if (clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof(data), &data, nullptr) != CL_SUCCESS) return {};
  return binary;
}

}  // namespace

std::string build_options(to_dtype dtype) {
  static const char* defines[] = {"-DTO_DTYPE_F32", "-DTO_DTYPE_F16", "-DTO_DTYPE_BF16"};
  std::string options = defines[dtype];
  // Extra compiler options for every program, e.g. "-cl-mad-enable".
  if (const char* extra = std::getenv("TENSOR_OPS_OPENCL_BUILD_OPTIONS"); extra && *extra)
    options += std::string(" ") + extra;
  return options;
}

to_status program_for(ClDevice& d, to_dtype dtype, Program** out) {
  if (dtype != TO_FLOAT32 && dtype != TO_FLOAT16 && dtype != TO_BFLOAT16)
    return fail(TO_ERR_UNSUPPORTED, "opencl kernels take float32, float16 or bfloat16, got dtype " + std::to_string(dtype));
  TENSOR_OPS_CL_RETURN_IF_ERROR(ready(d));
  std::lock_guard<std::mutex> lock(d.programs_mutex);
  std::unique_ptr<Program>& slot = d.programs[dtype];
  if (!slot) {
    auto p = std::make_unique<Program>();
    const std::string options = build_options(dtype);
    const std::string key = cache_key(d, options);
    const BinaryCache& cache = BinaryCache::instance();
    std::vector<unsigned char> binary;
    const BinaryCache::Lookup found = cache.load(key, &binary);
    if (found == BinaryCache::Lookup::Hit && build_from_binary(d, binary, options, *p)) {
      ++d.binary_cache_hits;
    } else {
      if (found != BinaryCache::Lookup::Absent) ++d.binary_cache_rejected;
      ++d.binary_cache_misses;
      TENSOR_OPS_CL_RETURN_IF_ERROR(build_from_source(d, dtype, options, *p));
      cache.store(key, program_binary(p->program));
    }
    slot = std::move(p);
  }
  *out = slot.get();
  return TO_OK;
}

}  // namespace tensor_ops::opencl
