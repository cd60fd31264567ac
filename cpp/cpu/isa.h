#pragma once
// The CPU kernels of one instruction-set level. kernels_impl.h is compiled
// once per level (baseline, AVX2+FMA+F16C, AVX-512, AVX-512 with AVX512-BF16, that with AMX tiles) and the best level the
// CPU runs is chosen at run time by cpuid.
#include <cstdint>

#include "tensor_ops/dtype.h"
#include "tensor_ops/plugin.h"

namespace tensor_ops::cpu {

struct IsaKernels {
  const char* name;
  // Rows [r0, r1) of x (row stride xs) into y (row stride ys); w is fp32.
  // nt: write with non-temporal stores (outputs larger than the caches).
  void (*rms_norm)(DType dt, const void* x, int64_t xs, const float* w, void* y, int64_t ys, int64_t r0,
                   int64_t r1, int64_t cols, float eps, bool nt);
  // Contiguous spans of n elements.
  void (*silu)(DType dt, const void* x, void* y, int64_t n, bool nt);
  void (*gelu)(DType dt, const void* x, void* y, int64_t n, int64_t tanh_mode, bool nt);
  void (*to_float)(DType dt, const void* src, float* dst, int64_t n);
  void (*from_float)(DType dt, const float* src, void* dst, int64_t n);
  // The other ops (kernels_llm.h): work items [i0, i1) of a validated call,
  // with an fp32 scratch area per chunk; nonzero return: a bad index in the
  // data (1: a rope position, 2: a cross-entropy target).
  using ItemKernel = int (*)(const to_op_call& call, int64_t i0, int64_t i1, float* scratch);
  ItemKernel ops[TENSOR_OPS_MAX_OPS];
};

// Call only the levels the CPU runs (cpu_backend.cpp checks cpuid).
const IsaKernels& kernels_baseline();
#ifdef TENSOR_OPS_CPU_X86
const IsaKernels& kernels_avx2();
const IsaKernels& kernels_avx512();
const IsaKernels& kernels_avx512_bf16();
const IsaKernels& kernels_amx();
#endif

}  // namespace tensor_ops::cpu
