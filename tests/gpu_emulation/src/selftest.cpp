// The emulator's own tests (run by .ci/gpu_emulation before the conformance
// suites): a missing __syncthreads changes the answer under some schedule,
// a divergent barrier and a bad shuffle width are reported as launch
// failures, warp collectives give what CUDA defines, and the fp16 / bf16
// conversions round to nearest even (against the compiler's _Float16 and an
// exhaustive round trip). Exit status 0 when all pass.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_runtime.h"

static int failures = 0;
#define EXPECT(cond, ...)                    \
  do {                                       \
    if (!(cond)) {                           \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);              \
      std::printf("\n");                     \
      ++failures;                            \
    }                                        \
  } while (0)

// Sum of 0..n-1 over a block through shared memory; `sync` false drops the
// barrier between the writes and the read: a race.
__global__ void block_sum(int* out, bool sync) {
  __shared__ int vals[256];
  EMU_SHARED_OBJECT(vals)  // what build.py's rewrite adds
  vals[threadIdx.x] = int(threadIdx.x);
  if (sync) __syncthreads();
  if (threadIdx.x == blockDim.x - 1 || threadIdx.x == 0) {
    int s = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) s += vals[i];
    out[threadIdx.x == 0 ? 0 : 1] = s;
  }
}

__global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 32) __syncthreads();
  out[0] = 1;
}

#define FULL (warpSize == 64 ? ~0ull : 0xffffffffull)
__global__ void warp_ops(int* out) {
  const int lane = int(threadIdx.x) % warpSize;
  int v = lane;
  for (int o = warpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  out[threadIdx.x] = v;                                                         // sum of lanes
  out[blockDim.x + threadIdx.x] = __shfl_down_sync(FULL, lane, 1);       // lane + 1, last keeps
  out[2 * blockDim.x + threadIdx.x] = int(__ballot_sync(FULL, lane % 2) & 0xff);  // 0xaa
}

__global__ void bad_width(int* out) { out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1, 48); }

static std::vector<int> run(void (*kernel)(int*, bool), bool sync, unsigned threads, cudaError_t* err) {
  int* d = nullptr;
  cudaMalloc(&d, 2 * sizeof(int));
  ::emu::launcher("block_sum", dim3(1), dim3(threads))([kernel, sync](int* p) { kernel(p, sync); }, d);
  std::vector<int> h(2);
  *err = cudaMemcpy(h.data(), d, 2 * sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(d);
  return h;
}

int main() {
  const char* sched = std::getenv("TENSOR_OPS_EMU_SCHEDULE");
  sched = sched ? sched : "inorder";
  cudaError_t err;
  // With the barrier every schedule gets the sum; without it, thread 0 reads
  // before the others wrote under inorder, thread 255 under reverse.
  std::vector<int> good = run(block_sum, true, 256, &err);
  EXPECT(err == cudaSuccess && good[0] == 255 * 128 && good[1] == 255 * 128, "block_sum with a barrier: %d %d",
         good[0], good[1]);
  std::vector<int> racy = run(block_sum, false, 256, &err);
  if (!std::strcmp(sched, "inorder")) EXPECT(racy[0] != 255 * 128, "inorder: the race went unseen by thread 0");
  if (!std::strcmp(sched, "reverse")) EXPECT(racy[1] != 255 * 128, "reverse: the race went unseen by thread 255");

  int* d = nullptr;
  cudaMalloc(&d, 3 * 64 * sizeof(int));
  ::emu::launcher("divergent_barrier", dim3(1), dim3(64))([](int* p) { divergent_barrier(p); }, d);
  err = cudaDeviceSynchronize();
  EXPECT(err == cudaErrorLaunchFailure, "a barrier only warp 0 reaches: got %s", cudaGetErrorName(err));
  EXPECT(std::strstr(cudaGetErrorString(err), "divergent") != nullptr, "message: %s", cudaGetErrorString(err));

  ::emu::launcher("bad_width", dim3(1), dim3(32))([](int* p) { bad_width(p); }, d);
  err = cudaDeviceSynchronize();
  EXPECT(err == cudaErrorLaunchFailure, "shuffle width 48: got %s", cudaGetErrorName(err));

  // A lane outside the mask taking part (CUDA's 32-bit full mask on a 64-wide wavefront).
  ::emu::launcher("bad_width", dim3(1), dim3(64))([](int* p) { p[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1); }, d);
  err = cudaDeviceSynchronize();
  if (warpSize == 64) EXPECT(err == cudaErrorLaunchFailure, "32-bit mask, wave64: got %s", cudaGetErrorName(err));
  if (warpSize == 32) EXPECT(err == cudaSuccess, "32-bit mask, warp 32: got %s", cudaGetErrorName(err));

  ::emu::launcher("warp_ops", dim3(1), dim3(64))([](int* p) { warp_ops(p); }, d);
  std::vector<int> h(3 * 64);
  err = cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT(err == cudaSuccess, "warp_ops: %s", cudaGetErrorString(err));
  const int W = warpSize;
  for (int t = 0; t < 64; ++t) {
    const int lane = t % W;
    EXPECT(h[t] == W * (W - 1) / 2, "shfl_xor sum, thread %d: %d", t, h[t]);
    EXPECT(h[64 + t] == (lane + 1 < W ? lane + 1 : lane), "shfl_down, thread %d: %d", t, h[64 + t]);
    EXPECT(h[128 + t] == 0xaa, "ballot, thread %d: %x", t, h[128 + t]);
  }
  // An invalid configuration is reported at launch, by cudaGetLastError.
  ::emu::launcher("warp_ops", dim3(0), dim3(64))([](int* p) { warp_ops(p); }, d);
  EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid 0 accepted");
  cudaFree(d);

  // fp16 / bf16: every half round-trips; random floats round as _Float16 does.
  for (unsigned b = 0; b < 65536; ++b) {
    const __half h16{uint16_t(b)};
    const float f = __half2float(h16);
    if (f == f) EXPECT(__float2half_rn(f).__x == b, "half 0x%04x round trip", b);
    const __nv_bfloat16 bf{uint16_t(b)};
    const float g = __bfloat162float(bf);
    if (g == g) EXPECT(__float2bfloat16_rn(g).__x == b, "bf16 0x%04x round trip", b);
  }
  uint32_t x = 12345;
  for (int i = 0; i < 2000000; ++i) {
    x = x * 1664525u + 1013904223u;
    float f;
    uint32_t u = x;
    std::memcpy(&f, &u, 4);
    if (f != f) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    if (__float2half_rn(f).__x != rb) {
      EXPECT(false, "float %a -> half 0x%04x, _Float16 gives 0x%04x", double(f), __float2half_rn(f).__x, rb);
      break;
    }
  }
  std::printf("gpu_emulation selftest (%s schedule, warp %d): %s\n", sched, W, failures ? "FAILED" : "passed");
  return failures ? 1 : 0;
}
