// linear: y[M, N] = x[M, K] w[N, K]^T (+ bias), for a few rows of x (decode:
// M = batch x new tokens), included by kernels_llm.h inside each ISA
// namespace (after hsum8, get1 and set1).
//
// Note [linear rows]
// Bound by reading w once: each item is a block of w's rows
// (linear_rows_per_item, linear_items.h), read in place in D. Up to four rows of x (fp32: in
// place; 16-bit: widened once per chunk into the scratch) are dotted with
// 8 / NR rows of w at a time, every product's sum in its own register of
// fp32 lanes, reduced by hsum8. Every output element is one fixed chain: its
// lanes over K in order, then the same lane reduction whatever the group it
// was computed in (hsum8 reduces each register on its own), so a result does
// not depend on the thread count, on the chunking or on where its row falls
// in a block. More rows of x go four at a time over the block again (it is
// ~32 KiB: from cache).

// Note [linear prefetch]
// Decode reads each weight once, from DRAM, a tile of KN rows at a time, and
// each row is its own stream, which the hardware prefetcher restarts at every
// 4 KiB page. A 16-bit weight costs more instructions per byte (widening)
// than fp32, and kept fewer of its lines in flight. So a 16-bit tile
// prefetches the next tile's rows toward L2, a line of each per line of its
// own (next: the next tile's first row, or null for the last). One row of x,
// weights past the L3 (Xeon, bf16 [5632, 2048], [2048, 5632], [3072, 2048],
// interleaved with torch's F.linear on the same data): 1.07-1.14x -> 1.23-1.26x
// torch at 1 thread, 1.13-1.18x -> 1.27-1.30x at 2. fp32 is left as it was:
// it reads at the plain read's rate already, and the same prefetch made it
// 0-8% slower.

// out[r * KN + j] = X row r . W row j for NR rows of X (fp32, row stride xs)
// and KN rows of W (D, row stride ws), K elements each; next: KN rows at the
// same stride to prefetch (Note [linear prefetch]), or null.
template <DType D, int NR, int KN>
TENSOR_OPS_VEC_INLINE void linear_tile(const float* X, int64_t xs, const char* W, int64_t ws, int64_t K,
                                       float* out, const char* next = nullptr) {
  constexpr int64_t item = dtype_size(D);
  vf acc[NR][KN] = {};
  auto step = [&](int64_t d, auto a) {
    if (D != DType::Float32 && next && ((d * item) & 63) == 0) {
#pragma GCC unroll 8
      for (int j = 0; j < KN; ++j) prefetch_l2(next + (j * ws + d) * item);
    }
    if constexpr (NR == 1) {  // each row of w used once: widened and consumed at once (no 8 live temporaries)
      const vf xv = a.ld(X + d);
#pragma GCC unroll 8
      for (int j = 0; j < KN; ++j) acc[0][j] += xv * ldx<D>(W + j * ws * item, d, a);
    } else {
      vf wv[KN];
#pragma GCC unroll 8
      for (int j = 0; j < KN; ++j) wv[j] = ldx<D>(W + j * ws * item, d, a);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const vf xv = a.ld(X + r * xs + d);
#pragma GCC unroll 8
        for (int j = 0; j < KN; ++j) acc[r][j] += xv * wv[j];
      }
    }
  };
  int64_t d = 0;
  for (; d + kVW <= K; d += kVW) step(d, Full{});
  if (d < K) step(d, Part{int(K - d)});
  vf all[8] = {};
  float sums[8];
  static_assert(NR * KN <= 8, "one hsum8");
#pragma GCC unroll 8
  for (int i = 0; i < NR * KN; ++i) all[i] = acc[i / KN][i % KN];
  hsum8(all, sums);
#pragma GCC unroll 8
  for (int i = 0; i < NR * KN; ++i) out[i] = sums[i];
}

// Rows [n0, n1) of w against NR rows of x (X, row stride xs) into y's rows r0..:
// KN rows of w at a time, the rest one at a time (the same sums: Note
// [linear rows]).
template <DType D, int NR>
inline void linear_block(const to_op_call& c, const float* X, int64_t xs, int64_t r0, int64_t n0, int64_t n1) {
  const to_tensor &w = c.inputs[1], &b = c.inputs[2], &y = c.outputs[0];
  const int64_t K = w.shape[1];
  constexpr int KN = NR == 1 ? 8 : NR == 2 ? 4 : 2;
  float sums[8];
  auto store = [&](int64_t n, int kn) {
    for (int r = 0; r < NR; ++r) {
      char* yrow = row_of<D>(y, r0 + r);
      for (int j = 0; j < kn; ++j) {
        const float bias = c.ints[0] ? get1<D>(b.data, n + j) : 0.0f;
        set1<D>(yrow, n + j, sums[r * kn + j] + bias);
      }
    }
  };
  const int64_t N = w.shape[0];
  int64_t n = n0;
  for (; n + KN <= n1; n += KN) {
    // the next KN rows, this item's or the next one's (Note [linear prefetch])
    linear_tile<D, NR, KN>(X, xs, row_of<D>(w, n), w.strides[0], K, sums,
                           n + 2 * KN <= N ? row_of<D>(w, n + KN) : nullptr);
    store(n, KN);
  }
  for (; n < n1; ++n) {
    linear_tile<D, NR, 1>(X, xs, row_of<D>(w, n), w.strides[0], K, sums);
    store(n, 1);
  }
}

// Items: blocks of linear_rows_per_item (linear_items.h) rows of w, each
// read by every group of four rows of x in turn. scratch (16-bit x): x in
// fp32, [M][K]. A [K, N] w (ints[1]): linear_kn.h.
template <DType D>
int linear_k(const to_op_call& c, int64_t i0, int64_t i1, float* scratch) {
  if (c.ints[1]) return linear_kn_k<D>(c, i0, i1, scratch);
  const int64_t M = c.inputs[0].shape[0], K = c.inputs[0].shape[1], N = c.inputs[1].shape[0];
  const int64_t per = linear_rows_per_item(K, int64_t(dtype_size(D)));
  int64_t xs = 0;
  const float* X = linear_x_f32<D>(c.inputs[0], scratch, &xs);
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t n0 = it * per, n1 = min64(N, n0 + per);
    linear_row_groups(M, [&](int64_t r, auto nr) {
      linear_block<D, decltype(nr)::value>(c, X + r * xs, xs, r, n0, n1);
    });
  }
  return 0;
}
