#pragma once
// The CPU backend: built into the core, always usable.
#include <cstdint>
#include <string>
#include <vector>

#include "tensor_ops/plugin.h"

namespace tensor_ops::cpu {

const to_backend_v1* cpu_backend_table();

// ISA levels this CPU runs ("baseline", "avx2", "avx512", "avx512_bf16", "amx"), lowest first.
std::vector<std::string> supported_isas();
// The level the kernels use now: the best supported one, capped by the
// TENSOR_OPS_CPU_ISA environment variable or set_isa().
std::string active_isa();
// TENSOR_OPS_STREAM_BYTES (read once; a malformed value warns through
// environment_warnings()), else 16 MiB: outputs of at least this many bytes
// are written with streaming stores; 0 or less turns them off.
int64_t stream_threshold_bytes();
// Throws InvalidArgument for an unknown level, Unsupported for one this CPU
// lacks. "auto" returns to the best level.
void set_isa(const std::string& name);
int num_threads();
// Resizes the CPU thread pool (clamped to 1..1024); waits for a running op.
void set_num_threads(int threads);
// Regions on an OpenMP runtime's threads (address of its GOMP_parallel; 0:
// our own workers). Note [torch's OpenMP threads] in thread_pool.cpp.
// omp_get_max_threads: the same runtime's (0: none); a region's team is then
// no larger than the calling thread's OpenMP thread count.
void set_openmp(uintptr_t gomp_parallel, uintptr_t omp_get_max_threads = 0);
bool uses_openmp();
// The threads a region started now from the calling thread would run on.
int region_threads();

}  // namespace tensor_ops::cpu
