// Rotary position embedding on x [B, S, H, D] (contiguous) with cos / sin
// tables [P, R/2] and positions [B or 1, S] (int32 or int64): GPT-NeoX
// (rotate halves) or GPT-J (interleaved pairs); inverse rotates by -angle
// (the backward). Dims past R pass through.
#include <algorithm>

#include "common.cuh"
#include "tensor_ops/bad_index.h"

namespace tensor_ops::gpu {
namespace {

// A block per token (b, s) at a time, a thread per k of a head's row for
// every head: k < half rotates pair k (its cos / sin read once per token,
// not once per head), k >= half copies dim k + half. y may be x (in place):
// each pair is read before the thread that owns it writes it. The position
// is read by thread 0 and shared; one outside [0, P) raises *bad and leaves
// the token's rows.
template <class T, class I>
__global__ void rope_kernel(const T* x, const T* __restrict__ cos_t, const T* __restrict__ sin_t,
                            const I* __restrict__ pos, int64_t pos_batch_stride, T* y, int64_t tokens, int64_t S,
                            int64_t H, int64_t D, int64_t half, int64_t P, bool interleaved, float sign, int* bad) {
  __shared__ int64_t pos_sh[2];  // by token parity: a token has one barrier, after the write
  int64_t it = 0;
  for (int64_t bs = blockIdx.x; bs < tokens; bs += gridDim.x, ++it) {
    const int slot = int(it & 1);
    if (threadIdx.x == 0) pos_sh[slot] = int64_t(pos[bs / S * pos_batch_stride + bs % S]);
    __syncthreads();
    const int64_t p = pos_sh[slot];
    if (p < 0 || p >= P) {
      if (threadIdx.x == 0) *bad = 1;
      continue;
    }
    const T* xt = x + bs * H * D;
    T* yt = y + bs * H * D;
    for (int64_t k = threadIdx.x; k < D - half; k += blockDim.x) {
      if (k >= half) {
        for (int64_t h = 0; h < H; ++h) yt[h * D + k + half] = xt[h * D + k + half];
        continue;
      }
      const int64_t a = interleaved ? 2 * k : k, b = interleaved ? 2 * k + 1 : k + half;
      const float co = to_f32(cos_t[p * half + k]), si = sign * to_f32(sin_t[p * half + k]);
      for (int64_t h = 0; h < H; ++h) {
        const float x1 = to_f32(xt[h * D + a]), x2 = to_f32(xt[h * D + b]);
        yt[h * D + a] = from_f32<T>(x1 * co - x2 * si);
        yt[h * D + b] = from_f32<T>(x2 * co + x1 * si);
      }
    }
  }
}

template <class T>
to_status rope_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &ct = c->inputs[1], &st = c->inputs[2], &pt = c->inputs[3],
                  &yt = c->outputs[0];
  const int64_t B = xt.shape[0], S = xt.shape[1], H = xt.shape[2], D = xt.shape[3];
  const int64_t P = ct.shape[0], half = ct.shape[1];
  const int64_t tokens = B * S;
  const int64_t pos_batch_stride = pt.shape[0] == 1 ? 0 : S;
  // Threads: one per item of a row, whole 64s, at most 256 (a block loops past that).
  const int threads = int(std::min<int64_t>(ceil_div(D - half, kBlockMultiple) * kBlockMultiple, 256));
  BadIndexFlag bad(BadIndex::position);
  if (to_status s = bad.arm(bad_position_message(P)); s != TO_OK) return s;
  auto run = [&](auto* pos) {
    rope_kernel<T><<<row_blocks(tokens), threads, 0, stream>>>(element0<const T>(xt), element0<const T>(ct),
                                                             element0<const T>(st), pos, pos_batch_stride,
                                                             element0<T>(yt), tokens, S, H, D, half, P,
                                                             c->ints[0] != 0, c->ints[1] ? -1.0f : 1.0f, bad.device());
  };
  if (pt.dtype == TO_INT64)
    run(element0<const int64_t>(pt));
  else
    run(element0<const int32_t>(pt));
  TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  return TO_OK;
}

}  // namespace

to_status launch_rope(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return rope_typed<decltype(tag)>(call, stream); });
}

}  // namespace tensor_ops::gpu
