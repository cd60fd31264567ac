// The CPU kernels built for the baseline level (flags set in CMakeLists.txt).
#define TENSOR_OPS_ISA_NS baseline
#define TENSOR_OPS_ISA_NAME "baseline"
#include "kernels_impl.h"
