// linear with w stored [K, N] (weight_layout kn: y[M, N] = x[M, K] w (+
// bias), transformers' Conv1D), for a few rows of x; included by
// kernels_llm.h inside each ISA namespace (before linear_rows.h).
//
// Note [linear kn]
// Bound by reading w once, in place: the axpy form, a row of w at a time.
// For a tile of TN registers of columns and NR rows of x, every k in order
// adds x[r, k] * w[k, tile] into the tile's NR x TN accumulators (fp32
// lanes, one output element per lane, in registers), then the bias is added
// and the tile stored. Every output element is one chain over k = 0 .. K-1
// in its own lane, the same whatever tile width, group of rows, item or
// thread computed it (a partial register's lanes too): the same bits on any
// thread count and whatever rows of x surround it. Items are blocks of
// kLinearKnColsPerItem columns (linear_items.h); an item's block of w
// ([K, 64]) is read again by each group of four rows of x (from cache after
// the first).

// Rows of w ahead whose tile lines are prefetched: w's rows are far apart
// (12 KiB for GPT-2's c_fc), a stride the hardware prefetchers follow
// poorly; 16 rows measured bf16 [768, 3072] 5.4 -> 8.3 GB/s on one thread
// (fp32 11.4 -> 12.1; 48 rows no better), on a loaded 2-core EPYC VM.
// Accumulators in an L1 buffer over 256-column row segments (longer runs
// of w per row) measured no faster.
constexpr int64_t kLinearKnPrefetchRows = 16;

// y[r0 .. r0 + NR, n .. n + TN * kVW) (to n + a.n for a Part tile, TN = 1)
// for NR rows of x (fp32, X, row stride xs).
template <DType D, int NR, int TN, class A>
TENSOR_OPS_VEC_INLINE void linear_kn_tile(const to_op_call& c, const float* X, int64_t xs, int64_t r0, int64_t n,
                                          A a) {
  const to_tensor &w = c.inputs[1], &b = c.inputs[2], &y = c.outputs[0];
  constexpr int64_t item = dtype_size(D);
  const int64_t K = w.shape[0], ws = w.strides[0] * item;
  vf acc[NR][TN] = {};
  const char* wk = row_of<D>(w, 0) + n * item;
  constexpr int64_t lines = (TN * kVW * item + 63) / 64;
  for (int64_t k = 0; k < K; ++k, wk += ws) {
    if (k + kLinearKnPrefetchRows < K)
#pragma GCC unroll 8
      for (int64_t l = 0; l < lines; ++l) prefetch(wk + kLinearKnPrefetchRows * ws + l * 64);
    vf xb[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) xb[r] = splat<vf>(X[r * xs + k]);
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j) {
      const vf wv = ldx<D>(wk, j * kVW, a);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[r][j] += xb[r] * wv;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    char* yrow = row_of<D>(y, r0 + r);
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j) {
      const vf bias = c.ints[0] ? ldx<D>(b.data, n + j * kVW, a) : vf{};
      stx<D>(yrow, n + j * kVW, acc[r][j] + bias, a);
    }
  }
}

// Columns [n, n1) for NR rows of x: tiles of TN registers, then of TN / 2,
// ..., 1, then a partial register.
template <DType D, int NR, int TN>
inline void linear_kn_cols(const to_op_call& c, const float* X, int64_t xs, int64_t r0, int64_t n, int64_t n1) {
  for (; n + TN * kVW <= n1; n += TN * kVW) linear_kn_tile<D, NR, TN>(c, X, xs, r0, n, Full{});
  if constexpr (TN > 1) {
    linear_kn_cols<D, NR, TN / 2>(c, X, xs, r0, n, n1);
  } else if (n < n1) {
    linear_kn_tile<D, NR, 1>(c, X, xs, r0, n, Part{int(n1 - n)});
  }
}

// Items: blocks of kLinearKnColsPerItem columns of w, each tile of them
// read by every group of four rows of x in turn. scratch (16-bit x): x in
// fp32, [M][K].
template <DType D>
int linear_kn_k(const to_op_call& c, int64_t i0, int64_t i1, float* scratch) {
  const int64_t M = c.inputs[0].shape[0], N = c.inputs[1].shape[1];
  int64_t xs = 0;
  const float* X = linear_x_f32<D>(c.inputs[0], scratch, &xs);
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t n0 = it * kLinearKnColsPerItem, n1 = min64(N, n0 + kLinearKnColsPerItem);
    linear_row_groups(M, [&](int64_t r, auto nr) {
      constexpr int NR = decltype(nr)::value;
      linear_kn_cols<D, NR, NR >= 3 ? 2 : 8 / NR>(c, X + r * xs, xs, r, n0, n1);
    });
  }
  return 0;
}
