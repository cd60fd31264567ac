// Attention, forward and backward, flash style: no [Lq, Lk] matrix in
// memory. q [B, Hq, Lq, D], k / v [B, Hkv, Lk, D] (Hkv divides Hq: query
// head h reads kv head h / (Hq / Hkv)), all contiguous; lse float32
// [B, Hq, Lq]. causal: query i sees keys j <= i + offset, offset Lk - Lq
// (mode 1, bottom-right aligned) or 0 (mode 2, top-left). fp32 math on tiles staged in shared memory.
//
// Forward: a block per tile of query rows streams key / value tiles through
// shared memory with an online softmax (running max, sum and rescaled
// accumulator per row). Backward: two kernels, each owning what it writes
// (no atomics): dq by query tiles, dk / dv by key tiles over every query of
// the kv head's group; both recompute p = exp(scale q.k - lse) and take
// D_i = dout_i . out_i. A row with lse == -inf (it saw no key) has p = 0.
#include <algorithm>
#include <string>

#include "common.cuh"

namespace tensor_ops::gpu {
namespace {

struct AttnDims {
  int64_t B, Hq, Hkv, Lq, Lk;
  int D;
  float scale;
  bool causal;
  int64_t offset;  // causal: query i sees keys j <= i + offset
};

// A block's accumulators: rows * D elements of a tile, kAttnAcc per thread.
constexpr int kAttnThreads = 256;
constexpr int kAttnAcc = 8;
constexpr int kAttnTileElems = kAttnThreads * kAttnAcc;
// 48 KiB of dynamic shared memory: what every target gives without opt-in.
constexpr int kAttnSmemFloats = 12288;

// Keys query i sees: [0, visible_keys(i)).
__device__ __forceinline__ int64_t visible_keys(const AttnDims& a, int64_t i) {
  return a.causal ? clamp64(i + a.offset + 1, 0, a.Lk) : a.Lk;
}

__device__ __forceinline__ float dot(const float* x, const float* y, int n) {
  float s = 0.0f;
#pragma unroll 4
  for (int d = 0; d < n; ++d) s += x[d] * y[d];
  return s;
}

// Stages n rows of D elements (contiguous in global memory) as fp32 rows of
// `pitch` floats; a pitch of D + 1 keeps column walks free of bank conflicts.
template <class T>
__device__ __forceinline__ void stage(float* dst, int pitch, const T* src, int n, int D, float scale = 1.0f) {
  for (int e = threadIdx.x; e < n * D; e += blockDim.x) dst[e / D * pitch + e % D] = to_f32(src[e]) * scale;
}

// row_d[r] = dot(dout row r, out row r): dout staged (pitch), out in global.
template <class T>
__device__ __forceinline__ void out_dots(float* row_d, const float* dos, int pitch, const T* out, int n, int D) {
  const int lane = int(threadIdx.x) % kWarpSize, warps = int(blockDim.x) / kWarpSize;
  for (int r = int(threadIdx.x) / kWarpSize; r < n; r += warps) {
    float s = 0.0f;
    for (int d = lane; d < D; d += kWarpSize) s += dos[r * pitch + d] * to_f32(out[int64_t(r) * D + d]);
    s = warp_sum(s);
    if (lane == 0) row_d[r] = s;
  }
}

// out may be q (the core allows the same view): a block reads its q tile
// before it writes the same tile of out, and no other block reads it.
template <class T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(const T* q, const T* __restrict__ k, const T* __restrict__ v, T* out, float* __restrict__ lse,
                     AttnDims a, int BQ, int BK) {
  extern __shared__ float smem[];
  const int D = a.D;
  float* qs = smem;                  // BQ x D, pre-scaled
  float* ks = qs + BQ * D;           // BK x (D + 1)
  float* vs = ks + BK * (D + 1);     // BK x D
  float* sc = vs + BK * D;           // BQ x (BK + 1): scores, then p
  float* row_m = sc + BQ * (BK + 1);  // running max
  float* row_l = row_m + BQ;          // running sum
  float* row_c = row_l + BQ;          // this tile's rescale of the accumulator
  const int tid = threadIdx.x, nt = blockDim.x;
  const int lane = tid % kWarpSize, warps = nt / kWarpSize;
  const int64_t q_tiles = (a.Lq + BQ - 1) / BQ, group = a.Hq / a.Hkv;
  for (int64_t tile = blockIdx.x; tile < a.B * a.Hq * q_tiles; tile += gridDim.x) {
    const int64_t bh = tile / q_tiles, i0 = tile % q_tiles * BQ;
    const int rows = int(min64(BQ, a.Lq - i0));
    const int64_t qo = (bh * a.Lq + i0) * D;
    const int64_t kvo = (bh / a.Hq * a.Hkv + bh % a.Hq / group) * a.Lk * D;
    stage(qs, D, q + qo, rows, D, a.scale);
    for (int r = tid; r < rows; r += nt) {
      row_m[r] = kNegInf;
      row_l[r] = 0.0f;
    }
    float acc[kAttnAcc];
#pragma unroll
    for (int t = 0; t < kAttnAcc; ++t) acc[t] = 0.0f;
    const int64_t nk = visible_keys(a, i0 + rows - 1);  // the tile's last row sees the most
    __syncthreads();
    for (int64_t j0 = 0; j0 < nk; j0 += BK) {
      const int nb = int(min64(BK, nk - j0));
      stage(ks, D + 1, k + kvo + j0 * D, nb, D);
      stage(vs, D, v + kvo + j0 * D, nb, D);
      __syncthreads();
      for (int p = tid; p < rows * nb; p += nt) {
        const int r = p / nb, j = p % nb;
        sc[r * (BK + 1) + j] = j0 + j < visible_keys(a, i0 + r) ? dot(qs + r * D, ks + j * (D + 1), D) : kNegInf;
      }
      __syncthreads();
      for (int r = tid / kWarpSize; r < rows; r += warps) {
        float* sr = sc + r * (BK + 1);
        float tile_max = kNegInf;
        for (int j = lane; j < nb; j += kWarpSize) tile_max = fmaxf(tile_max, sr[j]);
        const float m_old = row_m[r], m_new = fmaxf(m_old, warp_max(tile_max));
        float sum = 0.0f;
        for (int j = lane; j < nb; j += kWarpSize) {
          const float p = sr[j] == kNegInf ? 0.0f : expf(sr[j] - m_new);
          sr[j] = p;
          sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
          const float c = m_old == kNegInf ? 0.0f : expf(m_old - m_new);
          row_c[r] = c;
          row_l[r] = row_l[r] * c + sum;
          row_m[r] = m_new;
        }
      }
      __syncthreads();
#pragma unroll
      for (int t = 0; t < kAttnAcc; ++t) {
        const int e = tid + t * nt;
        if (e < rows * D) {
          const int r = e / D, d = e % D;
          const float* pr = sc + r * (BK + 1);
          float s = acc[t] * row_c[r];
          for (int j = 0; j < nb; ++j) s += pr[j] * vs[j * D + d];
          acc[t] = s;
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < kAttnAcc; ++t) {
      const int e = tid + t * nt;
      if (e < rows * D) {
        const float l = row_l[e / D];
        out[qo + e] = from_f32<T>(l > 0.0f ? acc[t] / l : 0.0f);
      }
    }
    for (int r = tid; r < rows; r += nt)
      lse[bh * a.Lq + i0 + r] = row_l[r] > 0.0f ? row_m[r] + logf(row_l[r]) : kNegInf;
    __syncthreads();
  }
}

// dq_i = scale * sum_j p_ij (dout_i . v_j - D_i) k_j, by tiles of query rows.
template <class T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dq_kernel(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, const T* __restrict__ out, const float* __restrict__ lse,
                        T* __restrict__ dq, AttnDims a, int BQ, int BK) {
  extern __shared__ float smem[];
  const int D = a.D;
  float* qs = smem;                  // BQ x D
  float* dos = qs + BQ * D;          // BQ x D
  float* ks = dos + BQ * D;          // BK x (D + 1)
  float* vs = ks + BK * (D + 1);     // BK x (D + 1)
  float* ds = vs + BK * (D + 1);     // BQ x (BK + 1)
  float* row_l = ds + BQ * (BK + 1);  // lse
  float* row_d = row_l + BQ;          // D_i
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t q_tiles = (a.Lq + BQ - 1) / BQ, group = a.Hq / a.Hkv;
  for (int64_t tile = blockIdx.x; tile < a.B * a.Hq * q_tiles; tile += gridDim.x) {
    const int64_t bh = tile / q_tiles, i0 = tile % q_tiles * BQ;
    const int rows = int(min64(BQ, a.Lq - i0));
    const int64_t qo = (bh * a.Lq + i0) * D;
    const int64_t kvo = (bh / a.Hq * a.Hkv + bh % a.Hq / group) * a.Lk * D;
    stage(qs, D, q + qo, rows, D);
    stage(dos, D, dout + qo, rows, D);
    for (int r = tid; r < rows; r += nt) row_l[r] = lse[bh * a.Lq + i0 + r];
    __syncthreads();
    out_dots(row_d, dos, D, out + qo, rows, D);
    float acc[kAttnAcc];
#pragma unroll
    for (int t = 0; t < kAttnAcc; ++t) acc[t] = 0.0f;
    const int64_t nk = visible_keys(a, i0 + rows - 1);
    __syncthreads();
    for (int64_t j0 = 0; j0 < nk; j0 += BK) {
      const int nb = int(min64(BK, nk - j0));
      stage(ks, D + 1, k + kvo + j0 * D, nb, D);
      stage(vs, D + 1, v + kvo + j0 * D, nb, D);
      __syncthreads();
      for (int p = tid; p < rows * nb; p += nt) {
        const int r = p / nb, j = p % nb;
        const float L = row_l[r];
        float g = 0.0f;
        if (L != kNegInf && j0 + j < visible_keys(a, i0 + r)) {
          const float pij = expf(a.scale * dot(qs + r * D, ks + j * (D + 1), D) - L);
          g = pij * (dot(dos + r * D, vs + j * (D + 1), D) - row_d[r]) * a.scale;
        }
        ds[r * (BK + 1) + j] = g;
      }
      __syncthreads();
#pragma unroll
      for (int t = 0; t < kAttnAcc; ++t) {
        const int e = tid + t * nt;
        if (e < rows * D) {
          const int r = e / D, d = e % D;
          float s = acc[t];
          for (int j = 0; j < nb; ++j) s += ds[r * (BK + 1) + j] * ks[j * (D + 1) + d];
          acc[t] = s;
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < kAttnAcc; ++t) {
      const int e = tid + t * nt;
      if (e < rows * D) dq[qo + e] = from_f32<T>(acc[t]);
    }
    __syncthreads();
  }
}

// dv_j = sum_i p_ij dout_i, dk_j = scale * sum_i p_ij (dout_i . v_j - D_i) q_i
// over the queries of every head that reads kv head (b, kvh), by key tiles.
template <class T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dkdv_kernel(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const T* __restrict__ out, const float* __restrict__ lse,
                          T* __restrict__ dk, T* __restrict__ dv, AttnDims a, int BK, int BQ) {
  extern __shared__ float smem[];
  const int D = a.D;
  float* ks = smem;                   // BK x D
  float* vs = ks + BK * D;            // BK x D
  float* qs = vs + BK * D;            // BQ x (D + 1)
  float* dos = qs + BQ * (D + 1);     // BQ x (D + 1)
  float* pm = dos + BQ * (D + 1);     // BK x (BQ + 1): p
  float* dsm = pm + BK * (BQ + 1);    // BK x (BQ + 1): dS
  float* row_l = dsm + BK * (BQ + 1);  // lse
  float* row_d = row_l + BQ;           // D_i
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t k_tiles = (a.Lk + BK - 1) / BK, group = a.Hq / a.Hkv;
  for (int64_t tile = blockIdx.x; tile < a.B * a.Hkv * k_tiles; tile += gridDim.x) {
    const int64_t bkv = tile / k_tiles, j0 = tile % k_tiles * BK;
    const int keys = int(min64(BK, a.Lk - j0));
    const int64_t ko = (bkv * a.Lk + j0) * D;
    stage(ks, D, k + ko, keys, D);
    stage(vs, D, v + ko, keys, D);
    float acc_k[kAttnAcc], acc_v[kAttnAcc];
#pragma unroll
    for (int t = 0; t < kAttnAcc; ++t) acc_k[t] = acc_v[t] = 0.0f;
    // The first query that sees key j0 (causal); earlier ones see none of the tile.
    const int64_t i_first = a.causal ? clamp64(j0 - a.offset, 0, a.Lq) : 0;
    for (int64_t h = bkv % a.Hkv * group; h < (bkv % a.Hkv + 1) * group; ++h) {
      const int64_t bh = bkv / a.Hkv * a.Hq + h;
      for (int64_t i0 = i_first; i0 < a.Lq; i0 += BQ) {
        const int nq = int(min64(BQ, a.Lq - i0));
        const int64_t qo = (bh * a.Lq + i0) * D;
        stage(qs, D + 1, q + qo, nq, D);
        stage(dos, D + 1, dout + qo, nq, D);
        for (int r = tid; r < nq; r += nt) row_l[r] = lse[bh * a.Lq + i0 + r];
        __syncthreads();
        out_dots(row_d, dos, D + 1, out + qo, nq, D);
        __syncthreads();
        for (int p = tid; p < keys * nq; p += nt) {
          const int j = p / nq, r = p % nq;
          const float L = row_l[r];
          float pij = 0.0f, g = 0.0f;
          if (L != kNegInf && j0 + j < visible_keys(a, i0 + r)) {
            pij = expf(a.scale * dot(qs + r * (D + 1), ks + j * D, D) - L);
            g = pij * (dot(dos + r * (D + 1), vs + j * D, D) - row_d[r]) * a.scale;
          }
          pm[j * (BQ + 1) + r] = pij;
          dsm[j * (BQ + 1) + r] = g;
        }
        __syncthreads();
#pragma unroll
        for (int t = 0; t < kAttnAcc; ++t) {
          const int e = tid + t * nt;
          if (e < keys * D) {
            const int j = e / D, d = e % D;
            float sv = acc_v[t], sk = acc_k[t];
            for (int r = 0; r < nq; ++r) {
              sv += pm[j * (BQ + 1) + r] * dos[r * (D + 1) + d];
              sk += dsm[j * (BQ + 1) + r] * qs[r * (D + 1) + d];
            }
            acc_v[t] = sv;
            acc_k[t] = sk;
          }
        }
        __syncthreads();
      }
    }
#pragma unroll
    for (int t = 0; t < kAttnAcc; ++t) {
      const int e = tid + t * nt;
      if (e < keys * D) {
        dk[ko + e] = from_f32<T>(acc_k[t]);
        dv[ko + e] = from_f32<T>(acc_v[t]);
      }
    }
    __syncthreads();
  }
}

// Tile sizes for a head dim D <= kAttnTileElems: `rows` is the tile whose
// rows * D accumulators the threads hold (at most 16 rows), `cols` the tile
// streamed past it, as many (up to 64) as fit in kAttnSmemFloats. At
// D = kAttnTileElems every kernel still fits rows = 1, cols = 1.
struct Tiles {
  int rows, cols;
  size_t smem_bytes;
};

enum class AttnKernel { forward, dq, dkdv };

// Floats of shared memory, as the kernels above lay it out.
int64_t smem_floats(AttnKernel kind, int64_t D, int64_t rows, int64_t cols) {
  switch (kind) {
    case AttnKernel::forward: return rows * D + cols * (D + 1) + cols * D + rows * (cols + 1) + 3 * rows;
    case AttnKernel::dq: return 2 * rows * D + 2 * cols * (D + 1) + rows * (cols + 1) + 2 * rows;
    case AttnKernel::dkdv: return 2 * rows * D + 2 * cols * (D + 1) + 2 * rows * (cols + 1) + 2 * cols;
  }
  return 0;
}

Tiles plan(AttnKernel kind, int64_t D) {
  Tiles t{int(std::min<int64_t>(16, kAttnTileElems / D)), 1, 0};
  for (int cols = 64; cols > 1; --cols)
    if (smem_floats(kind, D, t.rows, cols) <= kAttnSmemFloats) {
      t.cols = cols;
      break;
    }
  t.smem_bytes = size_t(smem_floats(kind, D, t.rows, t.cols)) * sizeof(float);
  return t;
}

to_status check_head_dim(const char* op, int64_t D) {
  if (D <= kAttnTileElems) return TO_OK;
  return fail(TO_ERR_UNSUPPORTED, std::string(op) + ": head_dim " + std::to_string(D) + " is above the " +
                                      TENSOR_OPS_GPU_NAME " kernels' limit of " + std::to_string(kAttnTileElems));
}

AttnDims dims_of(const to_op_call* c, const to_tensor& q, const to_tensor& k) {
  return AttnDims{q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], int(q.shape[3]),
                  float(c->scalars[0]), c->ints[0] != 0,
                  c->ints[0] == 2 ? 0 : k.shape[2] - q.shape[2]};
}

unsigned grid_for(int64_t tiles) { return unsigned(std::clamp<int64_t>(tiles, 1, kMaxGridBlocks)); }

template <class T>
to_status attention_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &qt = c->inputs[0], &kt = c->inputs[1], &vt = c->inputs[2], &ot = c->outputs[0],
                  &lt = c->outputs[1];
  if (to_status s = check_head_dim("attention", qt.shape[3]); s != TO_OK) return s;
  const AttnDims a = dims_of(c, qt, kt);
  const Tiles t = plan(AttnKernel::forward, a.D);
  const int64_t tiles = a.B * a.Hq * ceil_div(a.Lq, t.rows);
  attention_kernel<T><<<grid_for(tiles), kAttnThreads, t.smem_bytes, stream>>>(
      element0<const T>(qt), element0<const T>(kt), element0<const T>(vt), element0<T>(ot), element0<float>(lt), a,
      t.rows, t.cols);
  TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  return TO_OK;
}

int64_t numel(const to_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

bool overlaps(const to_tensor& a, size_t a_item, const to_tensor& b, size_t b_item) {
  const char *a0 = element0<const char>(a), *b0 = element0<const char>(b);
  return a0 < b0 + numel(b) * int64_t(b_item) && b0 < a0 + numel(a) * int64_t(a_item);
}

// inputs dout, q, k, v, out, lse; outputs dq, dk, dv. Either side may be
// empty (Lq == 0: dk = dv = 0; Lk == 0: dq = 0). The core lets an output be
// an input (the same view), but each kernel reads inputs the other one's
// outputs cover: such an output is computed in scratch and copied after.
template <class T>
to_status attention_backward_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &gt = c->inputs[0], &qt = c->inputs[1], &kt = c->inputs[2], &vt = c->inputs[3],
                  &ot = c->inputs[4], &lt = c->inputs[5];
  if (to_status s = check_head_dim("attention_backward", qt.shape[3]); s != TO_OK) return s;
  const AttnDims a = dims_of(c, qt, kt);
  const Tiles tq = plan(AttnKernel::dq, a.D), tk = plan(AttnKernel::dkdv, a.D);
  const T *dout = element0<const T>(gt), *q = element0<const T>(qt), *k = element0<const T>(kt),
          *v = element0<const T>(vt), *out = element0<const T>(ot);
  const float* lse = element0<const float>(lt);
  DeviceScratch tmp[3] = {DeviceScratch(stream), DeviceScratch(stream), DeviceScratch(stream)};
  T* grads[3];
  for (int i = 0; i < 3; ++i) {
    const to_tensor& g = c->outputs[i];
    grads[i] = element0<T>(g);
    bool alias = false;
    for (int j = 0; j < 6; ++j)
      alias = alias || overlaps(g, sizeof(T), c->inputs[j], j == 5 ? sizeof(float) : sizeof(T));
    if (alias && numel(g) > 0) {
      if (to_status s = tmp[i].allocate(size_t(numel(g)) * sizeof(T)); s != TO_OK) return s;
      grads[i] = tmp[i].get<T>();
    }
  }
  if (a.B * a.Hq * a.Lq * a.D > 0) {
    const int64_t tiles = a.B * a.Hq * ceil_div(a.Lq, tq.rows);
    attention_dq_kernel<T><<<grid_for(tiles), kAttnThreads, tq.smem_bytes, stream>>>(dout, q, k, v, out, lse,
                                                                                     grads[0], a, tq.rows, tq.cols);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  }
  if (a.B * a.Hkv * a.Lk * a.D > 0) {
    const int64_t tiles = a.B * a.Hkv * ceil_div(a.Lk, tk.rows);
    attention_dkdv_kernel<T><<<grid_for(tiles), kAttnThreads, tk.smem_bytes, stream>>>(
        dout, q, k, v, out, lse, grads[1], grads[2], a, tk.rows, tk.cols);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  }
  for (int i = 0; i < 3; ++i)
    if (grads[i] != element0<T>(c->outputs[i]))
      TENSOR_OPS_CUDA_CHECK(cudaMemcpyAsync(element0<T>(c->outputs[i]), grads[i],
                                            size_t(numel(c->outputs[i])) * sizeof(T), cudaMemcpyDeviceToDevice,
                                            stream));
  return TO_OK;
}

}  // namespace

to_status launch_attention(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return attention_typed<decltype(tag)>(call, stream); });
}

to_status launch_attention_backward(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return attention_backward_typed<decltype(tag)>(call, stream); });
}

}  // namespace tensor_ops::gpu
