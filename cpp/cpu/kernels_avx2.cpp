// The CPU kernels built for the avx2 level (flags set in CMakeLists.txt).
#define TENSOR_OPS_ISA_NS avx2
#define TENSOR_OPS_ISA_NAME "avx2"
#include "kernels_impl.h"
