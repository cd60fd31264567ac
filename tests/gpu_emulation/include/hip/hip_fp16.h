// Emulator stand-in for HIP fp16 (see ../../README.md).
#pragma once
#include "emu/half.h"
