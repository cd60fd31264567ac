#pragma once
// The kernels of one (device, dtype): the embedded program built with that
// dtype's defines on first use, from the binary cache when it holds it.
#include "cl_api.h"

#include <mutex>

#include "devices.h"

namespace tensor_ops::opencl {

// Activations in the order of tensor_ops::Activation (ops.h).
enum ActivationKernel { kSilu = 0, kGeluErf = 1, kGeluTanh = 2 };
// Contiguous tensors take one flat range; strided rows a 2-D range.
enum Layout { kFlat = 0, kRows = 1 };

// The LLM op set's kernels (kernels/*.cl), by name in kKernelNames.
enum KernelId {
  kLayerNorm,
  kAddRmsNorm,
  kNormBackwardRows,
  kNormBackwardPartials,
  kNormBackwardFinal,
  kSoftmax,
  kSoftmaxBackward,
  kCrossEntropy,
  kRope,
  kAttentionFwd,
  kAttentionBwdDelta,
  kAttentionBwdDq,
  kAttentionBwdDkdv,
  // Per activation (ActivationKernel order): act_bwd flat / rows, glu flat / rows, glu_bwd.
  kActBwdFlat,
  kActBwdRows = kActBwdFlat + 3,
  kGluFlat = kActBwdRows + 3,
  kGluRows = kGluFlat + 3,
  kGluBwd = kGluRows + 3,
  kKernelCount = kGluBwd + 3
};

struct Program {
  cl_program program = nullptr;
  cl_kernel rms_norm = nullptr;
  cl_kernel activation[3][2] = {};
  cl_kernel kernels[kKernelCount] = {};
  // Work-group sizes the launches use (at most what each kernel allows):
  // rms_norm_group for every row-wise kernel (a work-group per row),
  // activation_group for the elementwise ones, attention_group for the
  // attention kernels (a work-group per query or key row).
  size_t rms_norm_group = 1, activation_group = 1, attention_group = 1, row_group = 1;
  // An int the rope / cross_entropy kernels set on a bad index (made on
  // first use, under launch_mutex).
  cl_mem bad_flag = nullptr;
  // Stands in for the cl_mem of a tensor with no elements (a null handle
  // crashes PoCL's clSetKernelArg); kernels never read it.
  cl_mem dummy = nullptr;
  // clSetKernelArg on a shared kernel is not thread-safe: held from the
  // first argument to the enqueue.
  std::mutex launch_mutex;
};

// The program for dtype on d, built on first use; a build failure is
// TO_ERR_DEVICE with the compiler's log in the last error.
to_status program_for(ClDevice& d, to_dtype dtype, Program** out);
// The options a dtype's program is built with (part of the cache key).
std::string build_options(to_dtype dtype);

}  // namespace tensor_ops::opencl
