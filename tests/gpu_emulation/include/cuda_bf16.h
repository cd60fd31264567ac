// Emulator stand-in for CUDA bf16 (see ../README.md).
#pragma once
#include "emu/half.h"
