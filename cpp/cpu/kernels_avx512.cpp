// The CPU kernels built for the avx512 level (flags set in CMakeLists.txt).
#define TENSOR_OPS_ISA_NS avx512
#define TENSOR_OPS_ISA_NAME "avx512"
#include "kernels_impl.h"
