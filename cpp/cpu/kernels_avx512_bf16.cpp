// The CPU kernels built for the avx512_bf16 level: the avx512 level plus
// AVX512-BF16's vcvtneps2bf16 for narrowing to bfloat16 (Note [bf16 narrowing
// by instruction] in kernels_impl.h); flags set in CMakeLists.txt.
#define TENSOR_OPS_ISA_NS avx512_bf16
#define TENSOR_OPS_ISA_NAME "avx512_bf16"
#include "kernels_impl.h"
