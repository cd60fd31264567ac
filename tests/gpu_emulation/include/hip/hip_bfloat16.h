// Emulator stand-in for ROCm hip_bfloat16 (see ../../README.md).
#pragma once
#include "emu/half.h"
