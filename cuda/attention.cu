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
#include <cstring>
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
        out[qo + e] = from_f32<T>(l != 0.0f ? acc[t] / l : 0.0f);
      }
    }
    for (int r = tid; r < rows; r += nt)
      lse[bh * a.Lq + i0 + r] = row_l[r] != 0.0f ? row_m[r] + logf(row_l[r]) : kNegInf;
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

#ifndef TENSOR_OPS_HIP
// ---------------------------------------------------------------------------
// Forward on tensor cores (CUDA, float16 / bfloat16): mma.sync m16n8k16 with
// fp32 accumulators, FlashAttention-2's layout. A block of 4 warps owns 64
// query rows (16 per warp, their Q fragments held in registers for the whole
// key loop); 64-key tiles of K (row-major) and V (transposed, so that a B
// fragment is one 32-bit load) are staged in shared memory, zero-filled past
// the keys and past the head dim; S = Q K^T stays in the accumulators, the
// online softmax runs on them (a row lives in one quad of lanes), and P is
// fed back as the A operand of O += P V without leaving registers. P is
// rounded to T as the sum of two parts (hi = T(p), lo = T(p - hi)), two
// mma per fragment: P V keeps ~16 bits of P instead of T's 8 or 11, so the
// result has the fp32 kernel's accuracy at 1.5x the mma count.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
// point type"), lane = 4 g + t, each 32-bit word two elements, the lower
// index in the low half:
//   A 16x16 (row-major): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1],
//                        a[2] = A[g][2t+8..2t+9], a[3] = A[g+8][2t+8..2t+9]
//   B 16x8 (k x n):      b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C, D 16x8 (fp32):    c[0], c[1] = C[g][2t], C[g][2t+1]; c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaRows = 16 * kMmaWarps;  // query rows per block
constexpr int kMmaKeys = 64;              // keys per shared-memory tile
constexpr int kMmaMaxDim = 128;

// Head dims the kernel is built for (D is zero-padded up to the next).
inline int mma_dim(int64_t D) { return D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : 128; }

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T h[2] = {from_f32<T>(lo), from_f32<T>(hi)};
  uint32_t u;
  memcpy(&u, h, sizeof u);
  return u;
}

template <class T>
__device__ __forceinline__ float unpack(uint32_t w, int i) {
  T h[2];
  memcpy(h, &w, sizeof w);
  return to_f32(h[i]);
}

__device__ __forceinline__ uint32_t ld32(const void* p) { return *static_cast<const uint32_t*>(p); }

// c += A B for one warp (fragments as above).
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  // The same product from the fragment layout, by shuffles (targets before
  // sm_80, and the emulator, which thereby checks the layout the kernel
  // assumes): k pair kk comes from lane 4 g + kk % 4 of A's rows and from
  // lane 4 n + kk % 4 of B's column n.
  const int lane = int(threadIdx.x) % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int hi = kk >> 2, src = kk & 3;
    const uint32_t a_top = __shfl_sync(0xffffffffu, a[2 * hi], 4 * g + src);
    const uint32_t a_bottom = __shfl_sync(0xffffffffu, a[2 * hi + 1], 4 * g + src);
    const uint32_t b_word = hi ? b1 : b0;
    const uint32_t b_left = __shfl_sync(0xffffffffu, b_word, 8 * t + src);
    const uint32_t b_right = __shfl_sync(0xffffffffu, b_word, 8 * t + 4 + src);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      c[0] += unpack<T>(a_top, e) * unpack<T>(b_left, e);
      c[1] += unpack<T>(a_top, e) * unpack<T>(b_right, e);
      c[2] += unpack<T>(a_bottom, e) * unpack<T>(b_left, e);
      c[3] += unpack<T>(a_bottom, e) * unpack<T>(b_right, e);
    }
  }
#endif
}

// rows x D of src (contiguous rows) into an nmax x DP tile of dst (row
// pitch `pitch`), or its transpose (dst[d * pitch + r]), zeros past rows
// and past D. 16-byte loads where D == DP and src is 16-byte aligned.
template <class T, int DP, bool kTranspose>
__device__ __forceinline__ void stage_tile(T* dst, int pitch, const T* src, int rows, int nmax, int D) {
  constexpr int V = 16 / sizeof(T);
  if (D == DP && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    for (int c = threadIdx.x; c < nmax * (DP / V); c += blockDim.x) {
      const int r = c / (DP / V), d = c % (DP / V) * V;
      Vec<T, V> chunk;
      if (r < rows)
        chunk = reinterpret_cast<const Vec<T, V>*>(src + int64_t(r) * DP)[d / V];
      else
        for (int e = 0; e < V; ++e) chunk.v[e] = from_f32<T>(0.0f);
      if constexpr (kTranspose)
        for (int e = 0; e < V; ++e) dst[(d + e) * pitch + r] = chunk.v[e];
      else
        reinterpret_cast<Vec<T, V>*>(dst + r * pitch)[d / V] = chunk;
    }
  } else {
    for (int c = threadIdx.x; c < nmax * DP; c += blockDim.x) {
      const int r = c / DP, d = c % DP;
      const T x = r < rows && d < D ? src[int64_t(r) * D + d] : from_f32<T>(0.0f);
      dst[kTranspose ? d * pitch + r : r * pitch + d] = x;
    }
  }
}

__device__ __forceinline__ int64_t ceil_div_dev(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Query tile `tile` (q_tiles per (batch, head), tile_rows rows each): its
// (batch, head) index bh, first row i0, rows, and the element offsets of its
// first q row (qo) and of its kv head's K / V (kvo).
struct QueryTile {
  int64_t bh, i0, qo, kvo;
  int rows;
  __device__ QueryTile(const AttnDims& a, int64_t tile, int64_t q_tiles, int tile_rows)
      : bh(tile / q_tiles), i0(tile % q_tiles * tile_rows) {
    rows = int(min64(tile_rows, a.Lq - i0));
    qo = (bh * a.Lq + i0) * a.D;
    kvo = (bh / a.Hq * a.Hkv + bh % a.Hq / (a.Hq / a.Hkv)) * a.Lk * a.D;
  }
};

// The A fragments of rows r0 .. r0 + 15 of a row-major tile (pitch in T), one per 16 columns.
template <class T, int DP>
__device__ __forceinline__ void load_a(uint32_t (&fr)[DP / 16][4], const T* tile, int pitch, int r0) {
  const int g = int(threadIdx.x) % 32 >> 2, t = int(threadIdx.x) % 4;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    const T* p = tile + (r0 + g) * pitch + kk * 16 + 2 * t;
    fr[kk][0] = ld32(p);
    fr[kk][1] = ld32(p + 8 * pitch);
    fr[kk][2] = ld32(p + 8);
    fr[kk][3] = ld32(p + 8 * pitch + 8);
  }
}

// acc[n] = A B_n for n < NT: B_n[d][c] = tile[(8 n + c) * pitch + d], the
// rows of a row-major tile as columns (S = Q K^T from K's rows).
template <class T, int DP, int NT>
__device__ __forceinline__ void mma_by_rows(float (&acc)[NT][4], const uint32_t (&a)[DP / 16][4], const T* tile,
                                            int pitch) {
  const int g = int(threadIdx.x) % 32 >> 2, t = int(threadIdx.x) % 4;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      const T* p = tile + (n * 8 + g) * pitch + kk * 16 + 2 * t;
      mma_16816<T>(acc[n], a[kk], ld32(p), ld32(p + 8));
    }
  }
}

// o += P B with P the fp32 accumulators of NT column tiles (16 x 8 NT) as
// the A operand (tiles 2 kk and 2 kk + 1 make A's columns 16 kk ..), each
// split into T's hi and lo parts (two mma); B[c][d] = tile_t[d * pitch + c]
// (a tile staged transposed).
template <class T, int DP, int NT>
__device__ __forceinline__ void mma_acc(float (&o)[DP / 8][4], const float (&p)[NT][4], const T* tile_t, int pitch) {
  const int g = int(threadIdx.x) % 32 >> 2, t = int(threadIdx.x) % 4;
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float* c = p[2 * kk + (w >> 1)] + 2 * (w & 1);
      hi[w] = pack2<T>(c[0], c[1]);
      lo[w] = pack2<T>(c[0] - unpack<T>(hi[w], 0), c[1] - unpack<T>(hi[w], 1));
    }
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
      const T* b = tile_t + (n * 8 + g) * pitch + kk * 16 + 2 * t;
      const uint32_t b0 = ld32(b), b1 = ld32(b + 8);
      mma_16816<T>(o[n], hi, b0, b1);
      mma_16816<T>(o[n], lo, b0, b1);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Rows r0 + g and r0 + g + 8 of a 16 x DP accumulator, as T, into rows of D
// elements at dst (rows at or past `rows` are not written).
template <class T, int DP>
__device__ __forceinline__ void store_rows(T* dst, const float (&acc)[DP / 8][4], int r0, int rows, int D,
                                           const float (&mul)[2]) {
  const int g = int(threadIdx.x) % 32 >> 2, t = int(threadIdx.x) % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + g + 8 * r;
    if (row >= rows) continue;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = n * 8 + 2 * t + e;
        if (d < D) dst[int64_t(row) * D + d] = from_f32<T>(acc[n][2 * r + e] * mul[r]);
      }
  }
}

template <class T, int DP>
__global__ void __launch_bounds__(kMmaThreads)
    attention_mma_kernel(const T* q, const T* __restrict__ k, const T* __restrict__ v, T* out,
                         float* __restrict__ lse, AttnDims a) {
  extern __shared__ float smem[];
  constexpr int KP = DP + 8;        // row pitch: fragment loads of 8 rows x 4 lanes hit 32 banks
  constexpr int VP = kMmaKeys + 8;  // pitch of V transposed
  T* ks = reinterpret_cast<T*>(smem);  // kMmaKeys x KP; the Q tile (kMmaRows x KP) before the key loop
  T* vt = ks + kMmaKeys * KP;          // DP x VP
  const int D = a.D;
  const int warp = int(threadIdx.x) / 32, t = int(threadIdx.x) % 4, g = int(threadIdx.x) % 32 >> 2;
  const int64_t q_tiles = ceil_div_dev(a.Lq, kMmaRows);
  for (int64_t tile = blockIdx.x; tile < a.B * a.Hq * q_tiles; tile += gridDim.x) {
    const QueryTile qt(a, tile, q_tiles, kMmaRows);
    const int64_t bh = qt.bh, i0 = qt.i0, qo = qt.qo, kvo = qt.kvo;
    const int rows = qt.rows;
    __syncthreads();  // the previous tile's readers of ks / vt are done
    stage_tile<T, DP, false>(ks, KP, q + qo, rows, kMmaRows, D);
    __syncthreads();
    const int r0 = warp * 16;
    uint32_t qa[DP / 16][4];
    load_a<T, DP>(qa, ks, KP, r0);
    float o[DP / 8][4];
    zero(o);
    // This lane's two rows, i0 + r0 + g and 8 below: running max and sum.
    float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
    const int64_t vis[2] = {visible_keys(a, i0 + r0 + g), visible_keys(a, i0 + r0 + g + 8)};
    const int64_t nk = visible_keys(a, i0 + rows - 1);  // the tile's last row sees the most
    for (int64_t j0 = 0; j0 < nk; j0 += kMmaKeys) {
      const int nb = int(min64(kMmaKeys, nk - j0));
      __syncthreads();  // Q fragments loaded / the last tile's P V done
      stage_tile<T, DP, false>(ks, KP, k + kvo + j0 * D, nb, kMmaKeys, D);
      stage_tile<T, DP, true>(vt, VP, v + kvo + j0 * D, nb, kMmaKeys, D);
      __syncthreads();
      float s[kMmaKeys / 8][4];
      mma_by_rows<T, DP>(s, qa, ks, KP);
      float mx[2] = {kNegInf, kNegInf};
#pragma unroll
      for (int n = 0; n < kMmaKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = j0 + n * 8 + 2 * t + (e & 1);
          s[n][e] = key < vis[e >> 1] ? s[n][e] * a.scale : kNegInf;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
        }
      float corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m[r], mx[r]);
        corr[r] = m_new == kNegInf ? 1.0f : expf(m[r] - m_new);  // never exp(-inf - -inf)
        m[r] = m_new;
        l[r] *= corr[r];
      }
#pragma unroll
      for (int n = 0; n < kMmaKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = s[n][e] == kNegInf ? 0.0f : expf(s[n][e] - m[e >> 1]);
          s[n][e] = p;
          l[e >> 1] += p;
        }
#pragma unroll
      for (int n = 0; n < DP / 8; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
      }
      mma_acc<T, DP>(o, s, vt, VP);
    }
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
      inv[r] = l[r] != 0.0f ? 1.0f / l[r] : 0.0f;  // NaN (a NaN in q or k) stays NaN
      const int row = r0 + g + 8 * r;
      if (t == 0 && row < rows) lse[bh * a.Lq + i0 + row] = l[r] != 0.0f ? m[r] + logf(l[r]) : kNegInf;
    }
    store_rows<T, DP>(out + qo, o, r0, rows, D, inv);
  }
}

// dot[i] = dout_i . out_i (fp32), one warp per row: the D_i both backward kernels read.
template <class T>
__global__ void attention_dot_kernel(const T* __restrict__ dout, const T* __restrict__ out,
                                     float* __restrict__ dot, int64_t rows, int D) {
  const int lane = int(threadIdx.x) % kWarpSize, warps = int(blockDim.x) / kWarpSize;
  for (int64_t r = int64_t(blockIdx.x) * warps + int(threadIdx.x) / kWarpSize; r < rows;
       r += int64_t(gridDim.x) * warps) {
    float s = 0.0f;
    for (int d = lane; d < D; d += kWarpSize) s += to_f32(dout[r * D + d]) * to_f32(out[r * D + d]);
    s = warp_sum(s);
    if (lane == 0) dot[r] = s;
  }
}

// Backward on tensor cores, two kernels that each own what they write (no
// atomics, the same bits every run). Both recompute P = exp(scale S - lse)
// and dP from the same fragments; dS = P (dP - D_i) scale.
constexpr int kMmaBwdCols = 32;  // keys per tile (dq kernel), queries per tile (dk / dv kernel)

// dq by tiles of 64 query rows: Q and dout fragments in registers; 32-key
// tiles of K and V row-major (S = Q K^T, dP = dout V^T) and K transposed (dq += dS K).
template <class T, int DP>
__global__ void __launch_bounds__(kMmaThreads)
    attention_dq_mma_kernel(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                            const T* __restrict__ v, const float* __restrict__ lse, const float* __restrict__ dot,
                            T* __restrict__ dq, AttnDims a) {
  extern __shared__ float smem[];
  constexpr int KP = DP + 8, TP = kMmaBwdCols + 8;
  T* ks = reinterpret_cast<T*>(smem);  // kMmaBwdCols x KP; Q then dout (kMmaRows x KP each) before the key loop
  T* vs = ks + kMmaBwdCols * KP;       // kMmaBwdCols x KP
  T* kt = vs + kMmaBwdCols * KP;       // DP x TP
  const int D = a.D;
  const int warp = int(threadIdx.x) / 32, t = int(threadIdx.x) % 4, g = int(threadIdx.x) % 32 >> 2;
  const int64_t q_tiles = ceil_div_dev(a.Lq, kMmaRows);
  for (int64_t tile = blockIdx.x; tile < a.B * a.Hq * q_tiles; tile += gridDim.x) {
    const QueryTile qt(a, tile, q_tiles, kMmaRows);
    const int64_t bh = qt.bh, i0 = qt.i0, qo = qt.qo, kvo = qt.kvo;
    const int rows = qt.rows;
    T* dos = ks + kMmaRows * KP;
    __syncthreads();
    stage_tile<T, DP, false>(ks, KP, q + qo, rows, kMmaRows, D);
    stage_tile<T, DP, false>(dos, KP, dout + qo, rows, kMmaRows, D);
    __syncthreads();
    const int r0 = warp * 16;
    uint32_t qa[DP / 16][4], da[DP / 16][4];
    load_a<T, DP>(qa, ks, KP, r0);
    load_a<T, DP>(da, dos, KP, r0);
    float acc[DP / 8][4];
    zero(acc);
    float L[2], Di[2];
    int64_t vis[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = i0 + r0 + g + 8 * r;
      L[r] = i < a.Lq ? lse[bh * a.Lq + i] : kNegInf;  // rows past Lq: p = 0
      Di[r] = i < a.Lq ? dot[bh * a.Lq + i] : 0.0f;
      vis[r] = visible_keys(a, i);
    }
    const int64_t nk = visible_keys(a, i0 + rows - 1);
    for (int64_t j0 = 0; j0 < nk; j0 += kMmaBwdCols) {
      const int nb = int(min64(kMmaBwdCols, nk - j0));
      __syncthreads();
      stage_tile<T, DP, false>(ks, KP, k + kvo + j0 * D, nb, kMmaBwdCols, D);
      stage_tile<T, DP, false>(vs, KP, v + kvo + j0 * D, nb, kMmaBwdCols, D);
      stage_tile<T, DP, true>(kt, TP, k + kvo + j0 * D, nb, kMmaBwdCols, D);
      __syncthreads();
      float s[kMmaBwdCols / 8][4], dp[kMmaBwdCols / 8][4];
      mma_by_rows<T, DP>(s, qa, ks, KP);
      mma_by_rows<T, DP>(dp, da, vs, KP);
#pragma unroll
      for (int n = 0; n < kMmaBwdCols / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int64_t key = j0 + n * 8 + 2 * t + (e & 1);
          const float p = L[r] != kNegInf && key < vis[r] ? expf(a.scale * s[n][e] - L[r]) : 0.0f;
          s[n][e] = p * (dp[n][e] - Di[r]) * a.scale;
        }
      mma_acc<T, DP>(acc, s, kt, TP);
    }
    const float one[2] = {1.0f, 1.0f};
    store_rows<T, DP>(dq + qo, acc, r0, rows, D, one);
  }
}

// dk, dv by tiles of 64 keys over every query of the kv head's group: K and
// V fragments in registers; 32-query tiles of Q and dout row-major (S^T = K
// Q^T, dP^T = V dout^T) and transposed (dv += P^T dout, dk += dS^T Q).
template <class T, int DP>
__global__ void __launch_bounds__(kMmaThreads)
    attention_dkdv_mma_kernel(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const float* __restrict__ lse,
                              const float* __restrict__ dot, T* __restrict__ dk, T* __restrict__ dv, AttnDims a) {
  extern __shared__ float smem[];
  constexpr int KP = DP + 8, TP = kMmaBwdCols + 8;
  T* qs = reinterpret_cast<T*>(smem);  // kMmaBwdCols x KP; K then V (kMmaRows x KP each) before the query loop
  T* dos = qs + kMmaBwdCols * KP;      // kMmaBwdCols x KP
  T* qt = dos + kMmaBwdCols * KP;      // DP x TP
  T* dot_t = qt + DP * TP;             // DP x TP
  float* row_l = reinterpret_cast<float*>(dot_t + DP * TP);  // lse, kMmaBwdCols
  float* row_d = row_l + kMmaBwdCols;                        // D_i
  const int D = a.D;
  const int warp = int(threadIdx.x) / 32, t = int(threadIdx.x) % 4, g = int(threadIdx.x) % 32 >> 2;
  const int64_t k_tiles = (a.Lk + kMmaRows - 1) / kMmaRows, group = a.Hq / a.Hkv;
  for (int64_t tile = blockIdx.x; tile < a.B * a.Hkv * k_tiles; tile += gridDim.x) {
    const int64_t bkv = tile / k_tiles, j0 = tile % k_tiles * kMmaRows;
    const int keys = int(min64(kMmaRows, a.Lk - j0));
    const int64_t ko = (bkv * a.Lk + j0) * D;
    T* vs = qs + kMmaRows * KP;
    __syncthreads();
    stage_tile<T, DP, false>(qs, KP, k + ko, keys, kMmaRows, D);
    stage_tile<T, DP, false>(vs, KP, v + ko, keys, kMmaRows, D);
    __syncthreads();
    const int r0 = warp * 16;
    uint32_t ka[DP / 16][4], va[DP / 16][4];
    load_a<T, DP>(ka, qs, KP, r0);
    load_a<T, DP>(va, vs, KP, r0);
    float acc_k[DP / 8][4], acc_v[DP / 8][4];
    zero(acc_k);
    zero(acc_v);
    const int64_t key[2] = {j0 + r0 + g, j0 + r0 + g + 8};
    // The first query that sees key j0 (causal); earlier ones see none of the tile.
    const int64_t i_first = a.causal ? clamp64(j0 - a.offset, 0, a.Lq) : 0;
    for (int64_t h = bkv % a.Hkv * group; h < (bkv % a.Hkv + 1) * group; ++h) {
      const int64_t bh = bkv / a.Hkv * a.Hq + h;
      for (int64_t i0 = i_first; i0 < a.Lq; i0 += kMmaBwdCols) {
        const int nq = int(min64(kMmaBwdCols, a.Lq - i0));
        const int64_t qo = (bh * a.Lq + i0) * D;
        __syncthreads();
        stage_tile<T, DP, false>(qs, KP, q + qo, nq, kMmaBwdCols, D);
        stage_tile<T, DP, false>(dos, KP, dout + qo, nq, kMmaBwdCols, D);
        stage_tile<T, DP, true>(qt, TP, q + qo, nq, kMmaBwdCols, D);
        stage_tile<T, DP, true>(dot_t, TP, dout + qo, nq, kMmaBwdCols, D);
        for (int r = threadIdx.x; r < kMmaBwdCols; r += blockDim.x) {
          row_l[r] = r < nq ? lse[bh * a.Lq + i0 + r] : kNegInf;  // queries past Lq: p = 0
          row_d[r] = r < nq ? dot[bh * a.Lq + i0 + r] : 0.0f;
        }
        __syncthreads();
        float p[kMmaBwdCols / 8][4], ds[kMmaBwdCols / 8][4];
        mma_by_rows<T, DP>(p, ka, qs, KP);
        mma_by_rows<T, DP>(ds, va, dos, KP);
#pragma unroll
        for (int n = 0; n < kMmaBwdCols / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = n * 8 + 2 * t + (e & 1);
            const float L = row_l[c];
            const float pij =
                L != kNegInf && key[e >> 1] < visible_keys(a, i0 + c) ? expf(a.scale * p[n][e] - L) : 0.0f;
            p[n][e] = pij;
            ds[n][e] = pij * (ds[n][e] - row_d[c]) * a.scale;
          }
        mma_acc<T, DP>(acc_v, p, dot_t, TP);
        mma_acc<T, DP>(acc_k, ds, qt, TP);
      }
    }
    const float one[2] = {1.0f, 1.0f};
    store_rows<T, DP>(dk + ko, acc_k, r0, keys, D, one);
    store_rows<T, DP>(dv + ko, acc_v, r0, keys, D, one);
  }
}

// Shared memory of the three kernels above.
template <class T>
size_t mma_smem_bytes(AttnKernel kind, int DP) {
  const int KP = DP + 8, TP = kMmaBwdCols + 8;
  switch (kind) {
    case AttnKernel::forward: return size_t(kMmaKeys * KP + DP * (kMmaKeys + 8)) * sizeof(T);
    case AttnKernel::dq:
      return size_t(std::max(2 * kMmaRows * KP, 2 * kMmaBwdCols * KP + DP * TP)) * sizeof(T);
    case AttnKernel::dkdv:
      return std::max(size_t(2 * kMmaRows * KP) * sizeof(T),
                      size_t(2 * kMmaBwdCols * KP + 2 * DP * TP) * sizeof(T) + 2 * kMmaBwdCols * sizeof(float));
  }
  return 0;
}

// Runs f(std::integral_constant<int, DP>{}) for the head dim the kernels are built for.
template <class F>
to_status with_mma_dim(int64_t D, F&& f) {
  switch (mma_dim(D)) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
  }
  return f(std::integral_constant<int, 128>{});
}

template <class T>
to_status attention_mma(const AttnDims& a, const T* q, const T* k, const T* v, T* out, float* lse,
                        cudaStream_t stream) {
  const unsigned grid = grid_for(a.B * a.Hq * ceil_div(a.Lq, kMmaRows));
  return with_mma_dim(a.D, [&](auto dp) {
    constexpr int DP = decltype(dp)::value;
    attention_mma_kernel<T, DP><<<grid, kMmaThreads, mma_smem_bytes<T>(AttnKernel::forward, DP), stream>>>(
        q, k, v, out, lse, a);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    return TO_OK;
  });
}

// dq, dk, dv (each may be scratch, see attention_backward_typed).
template <class T>
to_status attention_backward_mma(const AttnDims& a, const T* dout, const T* q, const T* k, const T* v, const T* out,
                                 const float* lse, T* dq, T* dk, T* dv, cudaStream_t stream) {
  const int64_t rows = a.B * a.Hq * a.Lq;
  DeviceScratch dot(stream);
  if (rows > 0) {
    if (to_status s = dot.allocate(size_t(rows) * sizeof(float)); s != TO_OK) return s;
    constexpr int kThreads = 256;
    attention_dot_kernel<T><<<grid_for(ceil_div(rows, kThreads / kWarpSize)), kThreads, 0, stream>>>(
        dout, out, dot.get<float>(), rows, a.D);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  }
  return with_mma_dim(a.D, [&](auto dp) {
    constexpr int DP = decltype(dp)::value;
    if (rows * a.D > 0) {
      attention_dq_mma_kernel<T, DP>
          <<<grid_for(a.B * a.Hq * ceil_div(a.Lq, kMmaRows)), kMmaThreads, mma_smem_bytes<T>(AttnKernel::dq, DP),
             stream>>>(dout, q, k, v, lse, dot.get<float>(), dq, a);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    }
    if (a.B * a.Hkv * a.Lk * a.D > 0) {
      attention_dkdv_mma_kernel<T, DP>
          <<<grid_for(a.B * a.Hkv * ceil_div(a.Lk, kMmaRows)), kMmaThreads,
             mma_smem_bytes<T>(AttnKernel::dkdv, DP), stream>>>(dout, q, k, v, lse, dot.get<float>(), dk, dv, a);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    }
    return TO_OK;
  });
}
#endif  // !TENSOR_OPS_HIP

template <class T>
to_status attention_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &qt = c->inputs[0], &kt = c->inputs[1], &vt = c->inputs[2], &ot = c->outputs[0],
                  &lt = c->outputs[1];
  if (to_status s = check_head_dim("attention", qt.shape[3]); s != TO_OK) return s;
  const AttnDims a = dims_of(c, qt, kt);
#ifndef TENSOR_OPS_HIP
  if constexpr (!std::is_same_v<T, float>)
    if (a.D <= kMmaMaxDim)
      return attention_mma<T>(a, element0<const T>(qt), element0<const T>(kt), element0<const T>(vt),
                              element0<T>(ot), element0<float>(lt), stream);
#endif
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
  bool on_tensor_cores = false;
#ifndef TENSOR_OPS_HIP
  if constexpr (!std::is_same_v<T, float>)
    if (a.D <= kMmaMaxDim) {
      on_tensor_cores = true;
      if (to_status s = attention_backward_mma<T>(a, dout, q, k, v, out, lse, grads[0], grads[1], grads[2], stream);
          s != TO_OK)
        return s;
    }
#endif
  if (!on_tensor_cores && a.B * a.Hq * a.Lq * a.D > 0) {
    const int64_t tiles = a.B * a.Hq * ceil_div(a.Lq, tq.rows);
    attention_dq_kernel<T><<<grid_for(tiles), kAttnThreads, tq.smem_bytes, stream>>>(dout, q, k, v, out, lse,
                                                                                     grads[0], a, tq.rows, tq.cols);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  }
  if (!on_tensor_cores && a.B * a.Hkv * a.Lk * a.D > 0) {
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
