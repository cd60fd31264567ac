// The CPU kernels built for the amx level: the avx512_bf16 level plus AMX
// tiles (AMX-TILE, AMX-BF16) for the bfloat16 attention forward's products
// (Note [AMX attention] in attention_flash.h); flags set in CMakeLists.txt.
// cpu_backend.cpp offers the level only where cpuid has both and Linux
// grants the tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
#define TENSOR_OPS_ISA_NS amx
#define TENSOR_OPS_ISA_NAME "amx"
#include "kernels_impl.h"
