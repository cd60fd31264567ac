// Emulator stand-in for CUDA fp16 (see ../README.md).
#pragma once
#include "emu/half.h"
