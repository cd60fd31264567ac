// The norms over the last dimension: rms_norm, layer_norm, add_rms_norm and
// the rms / layer norm backward. One block per row, fp32 accumulation (the
// CPU reference's math), 16-byte chunks where the layout allows (V > 1).
#include <algorithm>

#include "common.cuh"

namespace tensor_ops::gpu {
namespace {

// rms_norm's weight is offset + w (Gemma's 1 + w), in fp32; the host passes
// -0.0f for none: w + -0.0f is w bit for bit, a -0.0 weight included.
//
// Every pass over a row visits element e from the same thread, so an output
// may be its input (in place): each element is read before the same thread
// writes it, and other threads never touch it. Blocks stride over rows past
// the grid. The row stays in registers (for_chunks, common.cuh), split at
// its 16-byte boundary (Note [Row head and tail]); a short row takes a group
// of `group` threads, several rows a block (Note [Rows per block]). Rows past
// the last (r >= rows) of the last block's groups are empty: their threads
// still take part in the reductions. With keep (the host's norm_launch;
// always for Grouped, whose vectors always fit), the weight / bias are read
// once per block into dynamic shared memory and from there for each of the
// block's rows (Note [Weight once per block]).
template <class T, int V, bool Grouped>
__global__ void __launch_bounds__(Grouped ? kGroupBlockThreads : kMaxBlockThreads)
    rms_norm_kernel(const T* x, int64_t x_stride, const T* __restrict__ w, T* y, int64_t y_stride,
                    int64_t rows, int64_t cols, float eps, float offset, int group, bool keep) {
  const RowGroup<Grouped> g = row_group<Grouped>(group);
  extern __shared__ __align__(16) float norm_kept[];  // Note [Weight once per block]
  const T* wk = Grouped || keep ? keep_columns(w, cols, reinterpret_cast<char*>(norm_kept)) : w;
  for (int64_t r0 = int64_t(blockIdx.x) * g.per_block; r0 < rows; r0 += int64_t(gridDim.x) * g.per_block) {
    const int64_t r = r0 + g.index;
    const T* xr = x + r * x_stride;
    T* yr = y + r * y_stride;
    const RowSplit s = split_row<T, V>(xr, r < rows ? cols : 0);
    const bool in_registers = row_in_registers<RowRegs<T, V, Grouped>>(g, s), w_vec = aligned16(w + s.head);
    RowRegs<T, V, Grouped> a;
    float squares = 0.0f;
    for_chunks(g, in_registers, true, s, a, [&](int64_t, const auto& b) {
#pragma unroll
      for (int k = 0; k < kWidth<decltype(b)>; ++k) squares += b[k] * b[k];
    }, xr);
    const float sum = group_sum(g, squares);
    // One double op per row: the same rounding as the CPU backend's scale.
    const float scale = float(1.0 / sqrt(double(sum) / double(cols) + double(eps)));
    for_chunks(g, in_registers, false, s, a, [&](int64_t e, auto& b) {
      constexpr int n = kWidth<decltype(b)>;
      float wv[n];
      load_column(wk, e, w_vec, wv);
#pragma unroll
      for (int k = 0; k < n; ++k) b[k] = b[k] * scale * (wv[k] + offset);
      store_at(yr, e, b);
    }, xr);
  }
}

// Two passes for the statistics (mean, then the centred variance: no
// cancellation), one for the output. b is NULL without a bias.
//
// Note [layer_norm's corrected mean] (GPU): the fp32 mean m of a row is a
// few ulps of |m| off (its lane sums are rounded), and every output carries
// that error times rstd: a constant row (variance 0, rstd 1 / sqrt(eps))
// of 1.7 at 7 columns gave the bias + 4.7e-5, and the backward's x_hat was
// as far from 0 (dweight 5.7, not 0, for rows of 12345.678 at 40000
// columns). The variance pass also sums the deviations d = x - m (exact
// for x near m), whose mean is m's error: the mean is m + sum(d) / n and
// the variance sum(d^2) / n - (sum(d) / n)^2 (the corrected two-pass
// algorithm, as the CPU backend's layer_corrected). A constant row c gives
// m + (c - m) = c and variance 0 exactly, so x - mean is 0 and y is the
// bias. The forward and both backward kernels correct alike. No pass more
// over the row: a second sum in the variance pass, one more reduction.
__device__ __forceinline__ float corrected_mean(float m, float dev_sum, int64_t cols, double& shift) {
  shift = double(dev_sum) / double(cols);
  return m + float(shift);
}
template <class T, int V, bool Grouped>
__global__ void __launch_bounds__(Grouped ? kGroupBlockThreads : kMaxBlockThreads)
    layer_norm_kernel(const T* x, int64_t x_stride, const T* __restrict__ w, const T* __restrict__ b, T* y,
                      int64_t y_stride, int64_t rows, int64_t cols, float eps, int group, bool keep) {
  const RowGroup<Grouped> g = row_group<Grouped>(group);
  extern __shared__ __align__(16) float norm_kept[];  // Note [Weight once per block]: w, then b
  char* const sh = reinterpret_cast<char*>(norm_kept);
  const T* wk = Grouped || keep ? keep_columns(w, cols, sh) : w;
  const T* bk = (Grouped || keep) && b ? keep_columns(b, cols, sh + kept_bytes(cols, sizeof(T))) : b;
  for (int64_t r0 = int64_t(blockIdx.x) * g.per_block; r0 < rows; r0 += int64_t(gridDim.x) * g.per_block) {
    const int64_t r = r0 + g.index;
    const T* xr = x + r * x_stride;
    T* yr = y + r * y_stride;
    const RowSplit s = split_row<T, V>(xr, r < rows ? cols : 0);
    const bool in_registers = row_in_registers<RowRegs<T, V, Grouped>>(g, s), w_vec = aligned16(w + s.head),
               b_vec = b && aligned16(b + s.head);
    RowRegs<T, V, Grouped> a;
    float part = 0.0f;
    for_chunks(g, in_registers, true, s, a, [&](int64_t, const auto& c) {
#pragma unroll
      for (int k = 0; k < kWidth<decltype(c)>; ++k) part += c[k];
    }, xr);
    const float m = float(double(group_sum(g, part)) / double(cols));
    part = 0.0f;
    float dev = 0.0f;
    for_chunks(g, in_registers, false, s, a, [&](int64_t, const auto& c) {
#pragma unroll
      for (int k = 0; k < kWidth<decltype(c)>; ++k) {
        const float d = c[k] - m;
        part += d * d;
        dev += d;
      }
    }, xr);
    // Note [layer_norm's corrected mean] (GPU).
    double shift;
    const float mean = corrected_mean(m, group_sum(g, dev), cols, shift);
    const double var = fmax(double(group_sum(g, part)) / double(cols) - shift * shift, 0.0);
    const float rstd = float(1.0 / sqrt(var + double(eps)));
    for_chunks(g, in_registers, false, s, a, [&](int64_t e, auto& c) {
      constexpr int n = kWidth<decltype(c)>;
      float wv[n], bv[n] = {};
      load_column(wk, e, w_vec, wv);
      if (b) load_column(bk, e, b_vec, bv);
#pragma unroll
      for (int k = 0; k < n; ++k) c[k] = (c[k] - mean) * rstd * wv[k] + bv[k];
      store_at(yr, e, c);
    }, xr);
  }
}

// s = x + residual, rounded to T and stored as residual_out; y normalises
// the rounded s (kept by the thread that stored it: in its registers, or
// read back from residual_out for long rows). out may be x and residual_out
// may be residual (the core allows nothing else).
template <class T, int V, bool Grouped>
__global__ void __launch_bounds__(Grouped ? kGroupBlockThreads : kMaxBlockThreads)
    add_rms_norm_kernel(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const T* __restrict__ w,
                        T* y, int64_t y_stride, T* res_out, int64_t res_out_stride, int64_t rows, int64_t cols,
                        float eps, int group, bool keep) {
  const RowGroup<Grouped> g = row_group<Grouped>(group);
  extern __shared__ __align__(16) float norm_kept[];  // Note [Weight once per block]
  const T* wk = Grouped || keep ? keep_columns(w, cols, reinterpret_cast<char*>(norm_kept)) : w;
  for (int64_t r0 = int64_t(blockIdx.x) * g.per_block; r0 < rows; r0 += int64_t(gridDim.x) * g.per_block) {
    const int64_t r = r0 + g.index;
    const T* xr = x + r * x_stride;
    const T* rr = res + r * res_stride;
    T* yr = y + r * y_stride;
    T* ro = res_out + r * res_out_stride;
    const RowSplit s = split_row<T, V>(xr, r < rows ? cols : 0);
    const bool in_registers = row_in_registers<RowRegs<T, V, Grouped>>(g, s), w_vec = aligned16(w + s.head);
    RowRegs<T, V, Grouped> a;
    float squares = 0.0f;
    for_chunks(g, in_registers, true, s, a, [&](int64_t e, auto& c) {
      constexpr int n = kWidth<decltype(c)>;
      float d[n];
      load_at(rr, e, d);
#pragma unroll
      for (int k = 0; k < n; ++k) {
        c[k] = to_f32(from_f32<T>(c[k] + d[k]));
        squares += c[k] * c[k];
      }
      store_at(ro, e, c);
    }, xr);
    const float scale = float(1.0 / sqrt(double(group_sum(g, squares)) / double(cols) + double(eps)));
    for_chunks(g, in_registers, false, s, a, [&](int64_t e, auto& c) {
      constexpr int n = kWidth<decltype(c)>;
      float wv[n];
      load_column(wk, e, w_vec, wv);
#pragma unroll
      for (int k = 0; k < n; ++k) c[k] = c[k] * scale * wv[k];
      store_at(yr, e, c);
    }, ro);
  }
}

// The norm backward kernels' rstd, and (Layer) their mean corrected as the
// forward's (Note [layer_norm's corrected mean] (GPU)): mean is the row's
// fp32 mean (0 for rms_norm), sq and dev this thread's sums of (x - mean)^2
// and of (x - mean). Block-wide: every thread of the block calls it.
template <bool Layer>
__device__ __forceinline__ float backward_rstd(float& mean, float sq, float dev, int64_t cols, float eps) {
  double shift = 0.0;
  if (Layer) mean = corrected_mean(mean, block_sum(dev), cols, shift);
  return float(1.0 / sqrt(fmax(double(block_sum(sq)) / double(cols) - shift * shift, 0.0) + double(eps)));
}

// Threads of a norm_backward_kernel block: at most 512, so that a thread may
// hold 128 registers (x, dy, w and the dweight / dbias sums of K chunks;
// under a 1024-thread bound, 64, and K = 4 spilled 300-900 bytes). One
// block per SM runs anyway (kBackwardBlocks).
constexpr int kBackwardThreads = 512;

// Norm backward, first stage: dx per row, and per block the fp32 sums over
// its rows of dy * x_hat (dweight) and dy (dbias, Layer only), written once
// at the end to partial[blockIdx.x] / partial[gridDim.x + blockIdx.x] (cols
// floats each). A persistent grid: each block strides over rows, and every
// thread owns the same K chunks of every row (chunk threadIdx.x + j *
// blockDim.x), so it keeps their weight, the row's x and dy (as stored) and
// its dweight / dbias sums in registers: x, dy and w are each read once, and
// the partial sums are written once per block. The grid size depends on rows
// only, so the sums come out the same on every run and every device. dx may
// be dy or x (the core allows the same view): a thread writes only chunks it
// has already read.
template <class T, int V, int K, bool Layer>
__global__ void __launch_bounds__(kBackwardThreads)
    norm_backward_kernel(const T* dy, int64_t dy_stride, const T* x, int64_t x_stride, const T* __restrict__ w,
                         T* dx, int64_t dx_stride, float* __restrict__ partial, int64_t rows, int64_t cols,
                         float eps, float offset) {
  using C = Vec<T, V>;
  const int64_t chunks = cols / V;
  int64_t idx[K];
  bool has[K];
  C wc[K] = {};
  float dw[K][V], db[K][V];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    idx[j] = int64_t(threadIdx.x) + int64_t(j) * blockDim.x;
    has[j] = idx[j] < chunks;
    if (has[j]) wc[j] = reinterpret_cast<const C*>(w)[idx[j]];
#pragma unroll
    for (int k = 0; k < V; ++k) dw[j][k] = db[j][k] = 0.0f;
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    C xc[K] = {}, gc[K] = {};
    // Every load of the row before the first reduction.
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (has[j]) {
        xc[j] = reinterpret_cast<const C*>(x + r * x_stride)[idx[j]];
        gc[j] = reinterpret_cast<const C*>(dy + r * dy_stride)[idx[j]];
      }
    float mean = 0.0f, part = 0.0f;
    if (Layer) {
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (has[j])
#pragma unroll
          for (int k = 0; k < V; ++k) part += to_f32(xc[j].v[k]);
      mean = float(double(block_sum(part)) / double(cols));
      part = 0.0f;
    }
    float dev = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (has[j])
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = to_f32(xc[j].v[k]) - mean;
          part += d * d;
          if (Layer) dev += d;
        }
    const float rstd = backward_rstd<Layer>(mean, part, dev, cols, eps);
    // c1 = mean(g * x_hat), c2 = mean(g) with g = dy * (w + offset) (rms_norm's
    // offset; -0.0f for none, as in rms_norm_kernel). g is rounded to
    // fp32 the same way here and below (mul_rn: never fused into an FMA), so
    // g - c2 is exactly 0 where it should be (cols == 1) and not the product's
    // rounding error times rstd.
    float p1 = 0.0f, p2 = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (has[j])
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float g = to_f32(gc[j].v[k]);
          const float xh = (to_f32(xc[j].v[k]) - mean) * rstd, gw = mul_rn(g, to_f32(wc[j].v[k]) + offset);
          dw[j][k] += g * xh;
          if (Layer) db[j][k] += g;
          p1 += gw * xh;
          p2 += gw;
        }
    const float c1 = float(double(block_sum(p1)) / double(cols));
    const float c2 = Layer ? float(double(block_sum(p2)) / double(cols)) : 0.0f;
    T* dr = dx + r * dx_stride;
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (has[j]) {
        float a[V];
#pragma unroll
        for (int k = 0; k < V; ++k)
          a[k] = rstd * (mul_rn(to_f32(gc[j].v[k]), to_f32(wc[j].v[k]) + offset) - c2 -
                         (to_f32(xc[j].v[k]) - mean) * rstd * c1);
        store_chunk(dr, idx[j], a);
      }
  }
  float* pw = partial + int64_t(blockIdx.x) * cols;
  float* pb = partial + int64_t(gridDim.x + blockIdx.x) * cols;
#pragma unroll
  for (int j = 0; j < K; ++j)
    if (has[j]) {
      store_chunk(pw, idx[j], dw[j]);
      if (Layer) store_chunk(pb, idx[j], db[j]);
    }
}

// The first stage for rows too long for the registers (more than
// kMaxRegisterChunks chunks per thread): the row is read again per pass and
// the block's dweight / dbias sums live in partial, read and written per row.
template <class T, int V, bool Layer>
__global__ void __launch_bounds__(kMaxBlockThreads)
    norm_backward_wide_kernel(const T* dy, int64_t dy_stride, const T* x, int64_t x_stride,
                              const T* __restrict__ w, T* dx, int64_t dx_stride, float* __restrict__ partial,
                              int64_t rows, int64_t cols, float eps, float offset) {
  const int64_t chunks = cols / V;
  float* dw = partial + int64_t(blockIdx.x) * cols;
  float* db = partial + int64_t(gridDim.x + blockIdx.x) * cols;
  for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x)
#pragma unroll
    for (int k = 0; k < V; ++k) {
      dw[i * V + k] = 0.0f;
      if (Layer) db[i * V + k] = 0.0f;
    }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    const T* gr = dy + r * dy_stride;
    float mean = 0.0f, part = 0.0f;
    if (Layer) {
      for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
        float a[V];
        load_chunk(xr, i, a);
#pragma unroll
        for (int k = 0; k < V; ++k) part += a[k];
      }
      mean = float(double(block_sum(part)) / double(cols));
      part = 0.0f;
    }
    float dev = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V];
      load_chunk(xr, i, a);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = a[k] - mean;
        part += d * d;
        if (Layer) dev += d;
      }
    }
    const float rstd = backward_rstd<Layer>(mean, part, dev, cols, eps);
    float p1 = 0.0f, p2 = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], g[V], wv[V];
      load_chunk(xr, i, a);
      load_chunk(gr, i, g);
      load_chunk(w, i, wv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float xh = (a[k] - mean) * rstd, gw = mul_rn(g[k], wv[k] + offset);
        dw[i * V + k] += g[k] * xh;
        if (Layer) db[i * V + k] += g[k];
        p1 += gw * xh;
        p2 += gw;
      }
    }
    const float c1 = float(double(block_sum(p1)) / double(cols));
    const float c2 = Layer ? float(double(block_sum(p2)) / double(cols)) : 0.0f;
    T* dr = dx + r * dx_stride;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], g[V], wv[V];
      load_chunk(xr, i, a);
      load_chunk(gr, i, g);
      load_chunk(w, i, wv);
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = rstd * (mul_rn(g[k], wv[k] + offset) - c2 - (a[k] - mean) * rstd * c1);
      store_chunk(dr, i, a);
    }
  }
}

// Second stage: out[c] = the sum over p of partial[p][c] (dweight, blockIdx.y
// 0) or partial[parts + p][c] (dbias, blockIdx.y 1). A block takes
// kSumCols columns: thread (ty, tx) sums rows ty, ty + kSumRows, ... of
// column tx in that order (each warp reads whole 128-byte lines), then row 0
// adds the kSumRows sums in ty order: a fixed order, so the same answer on
// every run.
constexpr int kSumCols = 32;
constexpr int kSumRows = 8;

template <class T>
__global__ void __launch_bounds__(kSumCols * kSumRows)
    column_sum_kernel(const float* __restrict__ partial, int64_t parts, int64_t cols, T* __restrict__ dweight,
                      T* __restrict__ dbias) {
  __shared__ float sums[kSumRows][kSumCols];
  const float* src = partial + int64_t(blockIdx.y) * parts * cols;
  T* out = blockIdx.y == 0 ? dweight : dbias;
  const int tx = int(threadIdx.x) % kSumCols, ty = int(threadIdx.x) / kSumCols;
  for (int64_t c0 = int64_t(blockIdx.x) * kSumCols; c0 < cols; c0 += int64_t(gridDim.x) * kSumCols) {
    const int64_t c = c0 + tx;
    float s = 0.0f;
    if (c < cols)
      for (int64_t p = ty; p < parts; p += kSumRows) s += src[p * cols + c];
    sums[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < cols) {
      float t = 0.0f;
#pragma unroll
      for (int k = 0; k < kSumRows; ++k) t += sums[k][tx];
      out[c] = from_f32<T>(t);
    }
    __syncthreads();
  }
}

// Blocks of the backward's first stage (one per SM of an H100; a constant,
// not the device's count, so that the sums are the same on every device):
// the partial sums cost 2 * kBackwardBlocks * cols floats of scratch.
// Global memory sees, per block, w once and its fp32 dweight (and dbias)
// partials written and read once: 3 (rms) to 5 (layer) fp32 rows, up to 9
// rows of a bf16 layer_norm. Unlike the forward's weight (Note [Weight once
// per block]) this is not traded for SMs: at a few hundred rows (the traffic
// check's 256) within 1.1x of the ideal bytes would take 8-25 blocks, and
// the rows' dx needs every SM; from a few thousand rows (4096 rows: within
// 1.1x) the partials are small beside the rows.
constexpr int64_t kBackwardBlocks = 132;
// Chunks per thread the first stage keeps in registers (K); rows with more
// take norm_backward_wide_kernel.
constexpr int kMaxRegisterChunks = 4;

// Note [Weight once per block]: a block runs at least kWeightShare *
// vectors / row views rows (rms_norm 6, layer_norm 12 with a bias,
// add_rms_norm 3), so that the weight / bias, read once per block, add at
// most about 1/kWeightShare to the rows' traffic, but the grid never drops
// below kFillBlocks (two blocks per SM of a 132-SM H100) for it: at a few
// hundred rows (decode batches, the traffic check's 256) every row keeps a
// block of its own, as row_launch gives it, and its weight re-read is an L2
// hit on a GPU (8-16 KB); fewer blocks than SMs would serialise rows. From
// kFillBlocks * kWeightShare-ish rows (the check's 4096) the share holds.
constexpr int64_t kWeightShare = 12;
constexpr int64_t kFillBlocks = 2 * 132;

// The launch of a norm forward at rows x cols (chunks a row) whose weight /
// bias (`vectors` of them) are indexed by column and whose rows x cols views
// number `row_views` (x and y; add_rms_norm's residual in and out too):
// row_launch's blocks and threads, the kernels' keep and the dynamic shared
// bytes for it. When the vectors fit kMaxKeptBytes, each block keeps them and
// runs at least kWeightShare * vectors / row_views rows (whole passes of its
// groups); else a block per row (a grouped pass) reads them per row, as the
// grid of row_launch.
struct NormLaunch {
  RowLaunch l;
  bool keep;
  size_t smem;
};
NormLaunch norm_launch(int64_t rows, int64_t cols, int64_t chunks, size_t item, int vectors, int row_views) {
  RowLaunch l = row_launch(rows, chunks);
  const int64_t smem = vectors * kept_bytes(cols, int64_t(item));
  if (smem > kMaxKeptBytes) return {l, false, 0};
  const int64_t per_pass = l.threads / l.group;
  const int64_t min_rows = ceil_div(kWeightShare * vectors, row_views);
  const int64_t per_block = ceil_div(min_rows, per_pass) * per_pass;
  const int64_t fill = std::min<int64_t>(l.blocks, kFillBlocks);
  l.blocks = std::max<unsigned>(row_blocks(ceil_div(rows, per_block)), unsigned(fill));
  // Kept even by a block of one pass: the copy moves in 16-byte chunks, where
  // a row off the weight's 16-byte boundary (odd widths) reads it per element.
  return {l, true, size_t(smem)};
}

// rms_norm's weight offset as the kernels take it: -0.0f for none (+0.0f
// would turn a -0.0 weight into +0.0).
float weight_offset(double offset) { return offset == 0 ? -0.0f : float(offset); }

template <class T>
to_status rms_norm_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &wt = c->inputs[1], &yt = c->outputs[0];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const float eps = float(c->scalars[0]), offset = weight_offset(c->scalars[1]);
  return with_chunk<T>(rows_same_offset16({&xt, &yt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    const NormLaunch n = norm_launch(rows, cols, cols / V, sizeof(T), 1, 2);
    const RowLaunch& l = n.l;
    return with_grouping(l, [&](auto grouped) {
      rms_norm_kernel<T, V, decltype(grouped)::value><<<l.blocks, l.threads, n.smem, stream>>>(
          element0<const T>(xt), xt.strides[0], element0<const T>(wt), element0<T>(yt), yt.strides[0], rows, cols,
          eps, offset, l.group, n.keep);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
  });
}

template <class T>
to_status layer_norm_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &wt = c->inputs[1], &bt = c->inputs[2], &yt = c->outputs[0];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const T* b = c->ints[0] && bt.data ? element0<const T>(bt) : nullptr;
  const float eps = float(c->scalars[0]);
  return with_chunk<T>(rows_same_offset16({&xt, &yt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    const NormLaunch n = norm_launch(rows, cols, cols / V, sizeof(T), b ? 2 : 1, 2);
    const RowLaunch& l = n.l;
    return with_grouping(l, [&](auto grouped) {
      layer_norm_kernel<T, V, decltype(grouped)::value><<<l.blocks, l.threads, n.smem, stream>>>(
          element0<const T>(xt), xt.strides[0], element0<const T>(wt), b, element0<T>(yt), yt.strides[0], rows,
          cols, eps, l.group, n.keep);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
  });
}

template <class T>
to_status add_rms_norm_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &rt = c->inputs[1], &wt = c->inputs[2], &yt = c->outputs[0],
                  &ot = c->outputs[1];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const float eps = float(c->scalars[0]);
  return with_chunk<T>(rows_same_offset16({&xt, &rt, &yt, &ot}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    const NormLaunch n = norm_launch(rows, cols, cols / V, sizeof(T), 1, 4);
    const RowLaunch& l = n.l;
    return with_grouping(l, [&](auto grouped) {
      add_rms_norm_kernel<T, V, decltype(grouped)::value><<<l.blocks, l.threads, n.smem, stream>>>(
          element0<const T>(xt), xt.strides[0], element0<const T>(rt), rt.strides[0], element0<const T>(wt),
          element0<T>(yt), yt.strides[0], element0<T>(ot), ot.strides[0], rows, cols, eps, l.group, n.keep);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
  });
}

// inputs dy, x, w; outputs dx, dweight, dbias (Layer with a bias).
template <class T, bool Layer>
to_status norm_backward_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &gt = c->inputs[0], &xt = c->inputs[1], &wt = c->inputs[2], &dxt = c->outputs[0],
                  &dwt = c->outputs[1], &dbt = c->outputs[2];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const int64_t parts = std::min(rows, kBackwardBlocks);
  DeviceScratch scratch(stream);
  if (parts > 0) {
    if (to_status s = scratch.allocate(size_t(2 * parts * cols) * sizeof(float)); s != TO_OK) return s;
    const to_status s = with_chunk<T>(rows_aligned16({&gt, &xt, &wt, &dxt}, sizeof(T)), [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int64_t chunks = cols / V;
      const int64_t per_thread = ceil_div(chunks, kBackwardThreads);
      const float eps = float(c->scalars[0]), offset = weight_offset(Layer ? 0.0 : c->scalars[1]);
      auto run = [&](auto k) {
        constexpr int K = decltype(k)::value;
        norm_backward_kernel<T, V, K, Layer><<<unsigned(parts), row_block_threads(ceil_div(chunks, K)), 0, stream>>>(
            element0<const T>(gt), gt.strides[0], element0<const T>(xt), xt.strides[0], element0<const T>(wt),
            element0<T>(dxt), dxt.strides[0], scratch.get<float>(), rows, cols, eps, offset);
      };
      if (per_thread <= 1)
        run(std::integral_constant<int, 1>{});
      else if (per_thread <= 2)
        run(std::integral_constant<int, 2>{});
      else if (per_thread <= kMaxRegisterChunks)
        run(std::integral_constant<int, kMaxRegisterChunks>{});
      else
        norm_backward_wide_kernel<T, V, Layer><<<unsigned(parts), row_block_threads(chunks), 0, stream>>>(
            element0<const T>(gt), gt.strides[0], element0<const T>(xt), xt.strides[0], element0<const T>(wt),
            element0<T>(dxt), dxt.strides[0], scratch.get<float>(), rows, cols, eps, offset);
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
    if (s != TO_OK) return s;
  }
  // With no rows the sums are zeros: parts == 0 reads no partials.
  if (cols == 0) return TO_OK;
  const bool bias = Layer && c->ints[0] && dbt.data;
  const dim3 grid(unsigned(std::min(ceil_div(cols, kSumCols), kMaxGridBlocks)), bias ? 2 : 1);
  column_sum_kernel<T><<<grid, kSumCols * kSumRows, 0, stream>>>(scratch.get<float>(), parts, cols,
                                                                 element0<T>(dwt), bias ? element0<T>(dbt) : nullptr);
  TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  return TO_OK;
}

}  // namespace

to_status launch_rms_norm(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return rms_norm_typed<decltype(tag)>(call, stream); });
}

to_status launch_layer_norm(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return layer_norm_typed<decltype(tag)>(call, stream); });
}

to_status launch_add_rms_norm(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return add_rms_norm_typed<decltype(tag)>(call, stream); });
}

to_status launch_rms_norm_backward(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return norm_backward_typed<decltype(tag), false>(call, stream); });
}

to_status launch_layer_norm_backward(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return norm_backward_typed<decltype(tag), true>(call, stream); });
}

}  // namespace tensor_ops::gpu
