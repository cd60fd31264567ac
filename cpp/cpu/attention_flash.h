// Attention forward and backward as blocked flash attention, included by
// kernels_llm.h inside each ISA namespace (after ld / st).
//
// Note [flash attention on the CPU]
// Work is tiled: a tile of query rows against tiles of keys, with both
// products (S = Q K^T and O += P V, and the backward's four) done by one
// register-blocked micro-kernel on fp32 tiles: MR rows x 16-48 lanes of C
// held in registers while the shared dimension streams through (BLIS' shape;
// Note [attention micro-kernel shapes]).
// Query rows are packed by key-value head: a tile holds consecutive query
// positions for every query head of the group (row r: position r / G, head
// r % G), so grouped-query attention reads each K/V tile once for the whole
// group and never copies K/V per head. Causal key tiles past a row tile's
// last visible key are skipped whole; only the diagonal tiles are masked.
// The softmax is online (running max and sum per row, the accumulator
// rescaled when the max grows), in fp32 for every storage dtype.
// Backward (deterministic, no atomics), two schedules with the same bits:
// fused, each (batch, kv head) item on one thread with FlashAttention-2's
// five tile products (dQ accumulated in the item's scratch), when there are
// enough such items to keep the threads busy; otherwise phase 0 gives each
// (batch, kv head, key tile) item its own dK / dV rows, recomputing P from
// the saved log-sum-exp, and phase 1 each query row tile its dQ rows: seven
// products (S and dP in both), the price of no shared accumulator.

constexpr int kNL = int(kAttnLanes);  // lanes in one column block of the micro-kernel
constexpr int kNV = kNL / kVW;         // vectors per column block
constexpr int kMR = 6;                 // rows per micro-kernel call (the kNL-lane block)
static_assert(kAttnRows % kMR == 0 && kAttnRows % kNL == 0 && kAttnKeys % kNL == 0, "tile sizes");

// p rounded up to the next page boundary (Note [AMX buffers on page
// boundaries]): the kernels' scratch regions start on pages, so their
// speed does not depend on where the pool's block fell.
inline float* attn_page(void* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 4095) / 4096 * 4096);
}

// *p in every lane, as one broadcast load (splat's `vf{} + x` costs an add
// before the broadcast: 12 extra uops per 12 FMAs in the micro-kernel).
TENSOR_OPS_VEC_INLINE vf bcast(const float* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (vf)_mm256_broadcast_ss(p);
#elif defined(__SSE__)
  return (vf)_mm_load1_ps(p);
#else
  return splat<vf>(*p);
#endif
}

// C[MR][NV vectors] = (acc ? C : 0) + A[MR][K] B[K][NV vectors]; A's element
// (r, k) at A[r * lda + k * ak] (Strided; else ak = 1: row-major). lda = 1
// reads a transposed, packed tile. The row-major form keeps its own indexing:
// the decode forward (S = Q K^T, 4 rows) ran ~20% slower through the strided
// one. Each element of C is one multiply-add chain over k in order, whatever
// MR and NV are: the blocking never changes a bit.
template <int MR, int NV, bool Strided>
TENSOR_OPS_VEC_INLINE void attn_micro(int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t ldb,
                                      float* C, int64_t ldc, bool acc) {
  // Every loop but k unrolled by pragma: without it GCC kept c[][] on the
  // stack and stored all of it back on every k.
  vf c[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = acc ? vload(C + r * ldc + v * kVW) : vf{};
  static_assert(NV >= 1 && NV <= 4, "up to four vectors of B");
  for (int64_t k = 0; k < K; ++k) {
    // B's vectors as named values, not an array: GCC left a `vf b[NV]` in
    // memory (stored, then every FMA reading it back from the stack).
    const float* bk = B + k * ldb;
    const vf b0 = vload(bk), b1 = NV > 1 ? vload(bk + kVW) : b0, b2 = NV > 2 ? vload(bk + 2 * kVW) : b0,
             b3 = NV > 3 ? vload(bk + 3 * kVW) : b0;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const vf a = bcast(A + r * lda + (Strided ? k * ak : k));
      c[r][0] += a * b0;
      if constexpr (NV > 1) c[r][1] += a * b1;
      if constexpr (NV > 2) c[r][2] += a * b2;
      if constexpr (NV > 3) c[r][3] += a * b3;
    }
  }
  // C's row addresses made again here: GCC kept the MR loads' addresses
  // live through the k loop for these stores, parked in vector registers,
  // and then had no register left for B (read from the stack on every FMA).
  float* Cs = C;
  asm("" : "+r"(Cs));
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(Cs + r * ldc + v * kVW, c[r][v]);
}

// Note [attention micro-kernel shapes]
// The micro-kernel's MR x NV accumulators must cover the FMA latency (2
// FMAs a cycle x 4 cycles: >= 8 independent chains) and its loads (NV + MR
// a k step: one per B vector, one broadcast per row) must stay under its
// FMAs (MR x NV), two loads a cycle. With 16 lanes as one AVX2 block
// (NV = 2, MR = 6: 12 chains, 8 loads per 12 FMAs) both hold. On AVX-512
// the same 16 lanes are one vector: 6 chains and 7 loads per 6 FMAs, and
// the fp32 forward reached 57-63% of torch.mm's peak (torch's SDPA ~84%).
// So AVX-512 takes the columns 48 at a time (NV = 3, MR = 6: 18 chains, 9
// loads per 18 FMAs) or 32 (NV = 2, MR = 8: 16 chains, 10 loads), picked to
// divide N (S^T's 48 packed rows, head dims 64 / 128, 64-key tiles). Larger
// blocks (8 x 3, 12 x 2: 24 chains) ran slower: GCC ran out of general
// registers for the row addresses, parked them in vector registers and
// read B from the stack on every FMA. 1 thread, fp32, % of torch.mm's peak
// in the same run, forward / forward+backward: [1, 32/8, 1024, 128] 63% /
// 64% -> 88% / 88% (non-causal), 57% / 59% -> 79% / 79% (causal).
template <int NV, int MR, bool Strided>
inline void attn_gemm_cols(int64_t M, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B,
                           int64_t ldb, float* C, int64_t ldc, bool acc) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    attn_micro<MR, NV, Strided>(K, A + m * lda, lda, ak, B, ldb, C + m * ldc, ldc, acc);
  // the last M % MR rows in blocks of 8, 4, 2, 1 (fewer instantiations than one per count)
  auto part = [&](auto rows) {
    constexpr int P = decltype(rows)::value;
    if constexpr (P < MR) {
      if (M - m >= P) {
        attn_micro<P, NV, Strided>(K, A + m * lda, lda, ak, B, ldb, C + m * ldc, ldc, acc);
        m += P;
      }
    }
  };
  part(std::integral_constant<int, 8>{});
  part(std::integral_constant<int, 4>{});
  part(std::integral_constant<int, 2>{});
  part(std::integral_constant<int, 1>{});
}

template <bool Strided>
inline void attn_gemm_t(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B,
                        int64_t ldb, float* C, int64_t ldc, bool acc) {
#if defined(__AVX512F__)
  static_assert(kVW == kNL, "one vector per 16-lane block");
  // whole blocks of 48 or of 32 when either divides N, else 48s then the rest
  const int64_t w = N % 48 == 0 ? 48 : N % 32 == 0 ? 32 : 48;
  int64_t n = 0;
  if (w == 48)
    for (; n + 48 <= N; n += 48) attn_gemm_cols<3, 6, Strided>(M, K, A, lda, ak, B + n, ldb, C + n, ldc, acc);
  for (; n + 32 <= N; n += 32) attn_gemm_cols<2, 8, Strided>(M, K, A, lda, ak, B + n, ldb, C + n, ldc, acc);
  for (; n < N; n += 16) attn_gemm_cols<1, 8, Strided>(M, K, A, lda, ak, B + n, ldb, C + n, ldc, acc);
#else
  for (int64_t n = 0; n < N; n += kNL) attn_gemm_cols<kNV, kMR, Strided>(M, K, A, lda, ak, B + n, ldb, C + n, ldc, acc);
#endif
}

// C[M][N] = (acc ? C : 0) + A[M][K] B[K][N] on fp32 tiles; N a multiple of
// kNL; A's element (m, k) at A[m * lda + k * ak].
inline void attn_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B,
                      int64_t ldb, float* C, int64_t ldc, bool acc) {
  if (ak == 1)
    attn_gemm_t<false>(M, N, K, A, lda, 1, B, ldb, C, ldc, acc);
  else
    attn_gemm_t<true>(M, N, K, A, lda, ak, B, ldb, C, ldc, acc);
}
// Row-major A.
inline void attn_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                      float* C, int64_t ldc, bool acc) {
  attn_gemm_t<false>(M, N, K, A, lda, 1, B, ldb, C, ldc, acc);
}

inline void zero_f(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 0;
}

// The geometry of one attention call. Query rows are packed per kv head
// (Note [flash attention on the CPU]); key j is visible from position i when
// j <= i + off (causal), every key otherwise.
struct AttnShape {
  int64_t B, Hq, Hkv, G, Lq, Lk, Dm, Dp, rows, row_tiles, key_tiles;
  bool causal;
  int64_t off;
  float scale;

  AttnShape(const to_tensor& q, const to_tensor& k, const to_op_call& c)
      : B(q.shape[0]), Hq(q.shape[1]), Hkv(k.shape[1]), G(Hq / Hkv), Lq(q.shape[2]), Lk(k.shape[2]),
        Dm(q.shape[3]), Dp(attn_pad(q.shape[3])), rows(G * Lq), row_tiles((G * Lq + kAttnRows - 1) / kAttnRows),
        key_tiles((k.shape[2] + kAttnKeys - 1) / kAttnKeys), causal(c.ints[0] != 0),
        off(attention_causal_offset(c, q.shape[2], k.shape[2])), scale(float(c.scalars[0])) {}

  // element offset of packed row r (position r / G, head kvh * G + r % G) of batch b
  int64_t row_offset(int64_t b, int64_t kvh, int64_t r) const {
    return ((b * Hq + kvh * G + r % G) * Lq + r / G) * Dm;
  }
  int64_t lse_index(int64_t b, int64_t kvh, int64_t r) const { return (b * Hq + kvh * G + r % G) * Lq + r / G; }
  // keys [0, end) may be visible from packed rows [r0, r1)
  int64_t key_end(int64_t r1) const {
    if (!causal) return Lk;
    const int64_t e = (r1 - 1) / G + off + 1;
    return e < 0 ? 0 : (e > Lk ? Lk : e);
  }
  // the last key visible from packed row r (as a float for the vector masks); -inf when none
  float limit(int64_t r) const {
    if (!causal) return __builtin_inff();
    return float(r / G + off);
  }
  // the first packed row that can see key j (position j - off; 0 when not causal)
  int64_t first_row(int64_t j) const {
    const int64_t r = causal ? (j - off) * G : 0;
    return r < 0 ? 0 : r;
  }
};

// Rows [r0, r0 + n) (packed) into dst [kAttnRows][ld] fp32, times mul; the
// padding columns [Dm, ld) and rows [n, kAttnRows) zero.
template <DType D>
inline void attn_load_rows(const AttnShape& s, const void* src, int64_t b, int64_t kvh, int64_t r0, int64_t n,
                           float* dst, int64_t stride, float mul) {
  for (int64_t r = 0; r < kAttnRows; ++r) {
    float* d = dst + r * stride;
    if (r < n) {
      ld<D>(src, s.row_offset(b, kvh, r0 + r), s.Dm, d);
      if (mul != 1.0f)
        for (int64_t x = 0; x < s.Dm; ++x) d[x] *= mul;
      zero_f(d + s.Dm, stride - s.Dm);
    } else {
      zero_f(d, stride);
    }
  }
}

// Key rows [j0, j0 + n) of kv head (b, kvh) into dst [rows][ld] (rows >= n zero).
template <DType D>
inline void attn_load_keys(const AttnShape& s, const void* src, int64_t b, int64_t kvh, int64_t j0, int64_t n,
                           float* dst, int64_t stride, int64_t rows) {
  const int64_t base = ((b * s.Hkv + kvh) * s.Lk + j0) * s.Dm;
  for (int64_t j = 0; j < rows; ++j) {
    float* d = dst + j * stride;
    if (j < n) {
      ld<D>(src, base + j * s.Dm, s.Dm, d);
      zero_f(d + s.Dm, stride - s.Dm);
    } else {
      zero_f(d, stride);
    }
  }
}

// dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block (AVX-512: 64
// in-register shuffles where the scalar loop made 256 loads and 256 stores;
// at head_dim 64 the scalar transposes were ~6% of the forward's time).
#if defined(__AVX512F__)
TENSOR_OPS_VEC_INLINE void transpose16x16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of single lanes
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks: pairs of lanes
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4b + q] holds rows 4b..4b+3, column 4k + q, in its 128-bit lane k.
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // 128-bit lanes: rows 0-7 and 8-15, then all 16
    t[q] = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x88);       // lanes 0, 2 of rows 0-3 / 4-7
    t[4 + q] = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xdd);   // lanes 1, 3
    t[8 + q] = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x88);
    t[12 + q] = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xdd);
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    // column 4k + q for k = 0, 2 (0x88) and 1, 3 (0xdd) of rows 0-7 | 8-15
    _mm512_storeu_ps(dst + (q) * ldd, _mm512_shuffle_f32x4(t[q], t[8 + q], 0x88));
    _mm512_storeu_ps(dst + (8 + q) * ldd, _mm512_shuffle_f32x4(t[q], t[8 + q], 0xdd));
    _mm512_storeu_ps(dst + (4 + q) * ldd, _mm512_shuffle_f32x4(t[4 + q], t[12 + q], 0x88));
    _mm512_storeu_ps(dst + (12 + q) * ldd, _mm512_shuffle_f32x4(t[4 + q], t[12 + q], 0xdd));
  }
}
#endif

// The transpose of a [rows][ld] tile (columns [0, Dm)) into dst [Dp][rows]:
// dst rows [Dm, Dp) are zero.
inline void attn_transpose(const AttnShape& s, const float* src, int64_t stride, int64_t rows, float* dst) {
#if defined(__AVX512F__)
  if (rows % 16 == 0 && s.Dp % 16 == 0) {
    for (int64_t d = 0; d < s.Dp; d += 16)
      for (int64_t j = 0; j < rows; j += 16) transpose16x16(src + j * stride + d, stride, dst + d * rows + j, rows);
    for (int64_t d = s.Dm; d < s.Dp; ++d) zero_f(dst + d * rows, rows);
    return;
  }
#endif
  for (int64_t d = 0; d < s.Dp; ++d)
    for (int64_t j = 0; j < rows; ++j) dst[d * rows + j] = d < s.Dm ? src[j * stride + d] : 0.0f;
}

// p = valid ? exp(x) : 0, valid where lim >= pos (the vector masks below).
TENSOR_OPS_VEC_INLINE vf masked_exp(vf x, vf pos, vf lim) {
  const vf e = exp_t(x);
  return from_bits(as_bits(e) & (vu)(pos <= lim));
}

// The finished rows of a forward row tile: O / l into the output, and the
// log-sum-exp m + log l (-inf for a row that saw no key).
template <DType D>
inline void attn_store_rows(const AttnShape& s, const to_tensor& o, const to_tensor& lse, int64_t b, int64_t kvh,
                            int64_t r0, int64_t nr, float* O, const float* m, const float* l) {
  for (int64_t r = 0; r < nr; ++r) {
    float* orow = O + r * s.Dp;
    // l == 0: the row saw no key (0, lse -inf). A NaN score (a NaN in q or k)
    // is kept by the probabilities' masks (!= -inf, not > -inf), so l is NaN
    // and the row and its lse are NaN, as torch's SDPA (the row used to drop
    // the NaN key, or come out 0 with lse -inf).
    const float inv = l[r] != 0 ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < s.Dm; ++d) orow[d] *= inv;
    st<D>(orow, o.data, s.row_offset(b, kvh, r0 + r), s.Dm);
    static_cast<float*>(lse.data)[s.lse_index(b, kvh, r0 + r)] =
        l[r] != 0 ? m[r] + __builtin_logf(l[r]) : -__builtin_inff();
  }
}

// One row of a key tile's scores S [kAttnKeys] (keys j0.., nk of them valid)
// into P in place: keys past the tile's end or the row's causal limit masked
// (when edge), the row's running max m and sum l updated, and its
// accumulator row O rescaled when the max grew. lane = {0, 1, ..}.
inline void attn_online_row(float* srow, int64_t j0, int64_t nk, float limit, bool edge, float& m, float& l,
                            float* orow, int64_t Dp, vf lane) {
  constexpr int64_t K = kAttnKeys;
  const float ninf = -__builtin_inff();
  const vf lim = splat<vf>(edge ? min_t(limit, float(j0 + nk - 1)) : __builtin_inff());
  vf mx = splat<vf>(ninf);
  for (int64_t j = 0; j < K; j += kVW) {
    const vf pos = lane + float(j0 + j);
    vf sv = vload(srow + j);
    sv = (vf)(((vu)(pos <= lim) & as_bits(sv)) | ((vu)(pos > lim) & as_bits(splat<vf>(ninf))));
    vstore(srow + j, sv);
    mx = max_t(mx, sv);
  }
  float mrow = ninf;
  for (int x = 0; x < kVW; ++x) mrow = max_t(mrow, mx[x]);
  const float mnew = max_t(m, mrow);
  if (mnew == ninf) {  // nothing visible yet: P is zero, the accumulator stays zero
    zero_f(srow, K);
    return;
  }
  const float corr = m == ninf ? 0.0f : exp_f32(m - mnew);
  vf sum = {};
  for (int64_t j = 0; j < K; j += kVW) {
    const vf sv = vload(srow + j);
    const vf p = from_bits(as_bits(exp_nonpos_t(sv - mnew)) & (vu)(sv != splat<vf>(ninf)));
    vstore(srow + j, p);
    sum += p;
  }
  l = l * corr + hsum(sum);
  if (corr != 1.0f)
    for (int64_t d = 0; d < Dp; d += kVW) vstore(orow + d, vload(orow + d) * corr);
  m = mnew;
}

// ---- decode: a few packed rows (<= kAttnDecodeRows) over the keys ---------
// Decode (Lq = 1: the G query heads of a kv head) is bound by reading K and
// V once. These rows read both in place, in D, with no tile copied or
// transposed: S = Q K^T as each key row's dot products with the (scaled,
// fp32) query rows, two keys at a time; O += P V with O's columns in
// registers while the tile's V rows stream past. The tile's V rows and the
// next tile's K rows are prefetched while the current ones are in use.
constexpr int64_t kAttnDecodeRows = 8;

// out[i] = the sum of v[i]'s lanes, i < 8. On AVX the eight reductions
// share one transpose of pairwise adds (9 instructions for the eight, where
// hsum's in-order lane chain is ~16 each); on AVX-512 each register's two
// halves are added first (2 instructions each), then the same transpose:
// ~25 instructions for the eight where hsum's 16-lane chains took ~250,
// which made the decode attention slower than torch's SDPA at head_dim 64
// (the chain cost more than the dot products). Each register's lanes are
// still summed in one fixed order, whichever of the eight it is.
#if defined(__AVX__)
TENSOR_OPS_VEC_INLINE void hsum8_avx(const __m256* v, float* out) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [v0 v1 v2 v3 | v0 v1 v2 v3] partial sums of the low | high 128 bits, u1 likewise for v4..v7
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  _mm256_storeu_ps(out, r);
}
#endif
TENSOR_OPS_VEC_INLINE void hsum8(const vf* v, float* out) {
#if defined(__AVX512F__)
  __m256 h[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256((__m512)v[i]), _mm512_extractf32x8_ps((__m512)v[i], 1));
  hsum8_avx(h, out);
#elif defined(__AVX__)
  hsum8_avx(reinterpret_cast<const __m256*>(v), out);
#else
  for (int i = 0; i < 8; ++i) out[i] = hsum(v[i]);
#endif
}

// S[r][j] = Q[r] . K row j, for NR rows of Q (fp32, stride Dp, zero past Dm)
// and keys [0, nk) of the rows at element `kp0` of kdata (stride Dm), 8 / NR
// keys at a time (2 for NR = 3).
template <DType D, int NR>
inline void attn_decode_qk(const float* Q, int64_t Dp, const void* kdata, int64_t kp0, int64_t Dm, int64_t nk,
                           float* S, int64_t lds, const char* pf_a, const char* pf_b, int64_t pf_rows) {
  constexpr int64_t row_bytes_per_elem = dtype_size(D);
  auto keys = [&](int64_t j, auto kn) {
    constexpr int KN = decltype(kn)::value;
    // rows j.. of the two prefetch streams (the tile's V rows, the next tile's K rows)
    for (int x = 0; x < KN; ++x)
      if (j + x < pf_rows)
        for (int64_t off = 0; off < Dm * row_bytes_per_elem; off += 64) {
          prefetch(pf_a + (j + x) * Dm * row_bytes_per_elem + off);
          if (pf_b) prefetch(pf_b + (j + x) * Dm * row_bytes_per_elem + off);
        }
    vf acc[NR][KN] = {};
    auto step = [&](int64_t d, auto a) {
      vf kv[KN];
#pragma GCC unroll 8
      for (int x = 0; x < KN; ++x) kv[x] = ldx<D>(kdata, kp0 + (j + x) * Dm + d, a);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const vf qv = vload(Q + r * Dp + d);
#pragma GCC unroll 8
        for (int x = 0; x < KN; ++x) acc[r][x] += qv * kv[x];
      }
    };
    int64_t d = 0;
    for (; d + kVW <= Dm; d += kVW) step(d, Full{});
    if (d < Dm) step(d, Part{int(Dm - d)});
    if constexpr (NR * KN > 1) {  // the sums at once (hsum8), not one lane chain each
      vf all[8] = {};
      float sums[8];
#pragma GCC unroll 8
      for (int i = 0; i < NR * KN; ++i) all[i] = acc[i / KN][i % KN];
      hsum8(all, sums);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
        for (int x = 0; x < KN; ++x) S[r * lds + j + x] = sums[r * KN + x];
    } else {
      S[j] = hsum(acc[0][0]);
    }
  };
  // keys per pass: up to eight dot products in flight, reduced by one hsum8
  constexpr int KN = NR == 1 ? 8 : NR == 2 ? 4 : 2;
  int64_t j = 0;
  for (; j + KN <= nk; j += KN) keys(j, std::integral_constant<int, KN>{});
  for (; j < nk; ++j) keys(j, std::integral_constant<int, 1>{});
}

// O[r] += sum_j P[r][j] V row j, j < nk, for NR rows (O stride Dp; V rows at
// element vp0 of vdata, stride Dm): two column vectors of O per pass.
template <DType D, int NR>
inline void attn_decode_pv(const float* P, int64_t lds, const void* vdata, int64_t vp0, int64_t Dm, int64_t nk,
                           float* O, int64_t Dp) {
  auto cols = [&](int64_t d, auto n, auto a) {
    constexpr int CN = decltype(n)::value;
    vf o[NR][CN];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
      for (int x = 0; x < CN; ++x) o[r][x] = vload(O + r * Dp + d + x * kVW);
    for (int64_t j = 0; j < nk; ++j) {
      vf vv[CN];
#pragma GCC unroll 2
      for (int x = 0; x < CN; ++x) vv[x] = ldx<D>(vdata, vp0 + j * Dm + d + x * kVW, a);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const vf p = bcast(P + r * lds + j);
#pragma GCC unroll 2
        for (int x = 0; x < CN; ++x) o[r][x] += p * vv[x];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
      for (int x = 0; x < CN; ++x) vstore(O + r * Dp + d + x * kVW, o[r][x]);
  };
  int64_t d = 0;
  for (; d + 2 * kVW <= Dm; d += 2 * kVW) cols(d, std::integral_constant<int, 2>{}, Full{});
  if (d + kVW <= Dm) cols(d, std::integral_constant<int, 1>{}, Full{}), d += kVW;
  if (d < Dm) cols(d, std::integral_constant<int, 1>{}, Part{int(Dm - d)});
}

// Calls f(std::integral_constant<int, NR>) for NR = n (1..4).
template <class F>
TENSOR_OPS_VEC_INLINE void attn_rows_1to4(int64_t n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// prefetch the rows [j0, j0 + n) (stride Dm elements of `item` bytes) at element p0 of data
inline void attn_prefetch_rows(const void* data, int64_t p0, int64_t Dm, int64_t n, int64_t item) {
  const char* base = static_cast<const char*>(data) + p0 * item;
  const int64_t bytes = n * Dm * item;
  for (int64_t x = 0; x < bytes; x += 64) prefetch(base + x);
}

template <DType D>
void attention_decode_rows(const to_op_call& c, const AttnShape& s, int64_t b, int64_t kvh, int64_t r0, int64_t nr,
                           float* scratch) {
  const to_tensor &q = c.inputs[0], &k = c.inputs[1], &v = c.inputs[2], &o = c.outputs[0], &lse = c.outputs[1];
  const int64_t Dp = s.Dp, R = kAttnRows, K = kAttnKeys, Dm = s.Dm;
  constexpr int64_t item = dtype_size(D);
  float *Q = scratch, *O = Q + R * Dp, *S = O + R * Dp, *m = S + R * K, *l = m + R;
  const float ninf = -__builtin_inff();
  for (int64_t r = 0; r < nr; ++r) {  // the nr rows only (attn_load_rows fills all kAttnRows)
    float* d = Q + r * Dp;
    ld<D>(q.data, s.row_offset(b, kvh, r0 + r), Dm, d);
    for (int64_t x = 0; x < Dm; ++x) d[x] *= s.scale;
    zero_f(d + Dm, Dp - Dm);
  }
  zero_f(O, nr * Dp);
  for (int64_t r = 0; r < nr; ++r) m[r] = ninf, l[r] = 0;
  const int64_t kend = s.key_end(r0 + nr), kvbase = (b * s.Hkv + kvh) * s.Lk * Dm;
  vf lane = {};
  for (int x = 0; x < kVW; ++x) lane[x] = float(x);
  attn_prefetch_rows(k.data, kvbase, Dm, min64(K, kend), item);
  for (int64_t j0 = 0; j0 < kend; j0 += K) {
    const int64_t nk = min64(K, kend - j0), p0 = kvbase + j0 * Dm;
    // While the first row group's scores are made, the tile's V rows and the
    // next tile's K rows are prefetched, a few lines per key.
    const char* vrows = static_cast<const char*>(v.data) + p0 * item;
    const char* knext = j0 + K < kend ? static_cast<const char*>(k.data) + (p0 + K * Dm) * item : nullptr;
    const int64_t nnext = knext ? min64(K, kend - j0 - K) : 0;
    for (int64_t g = 0; g < nr; g += 4)
      attn_rows_1to4(nr - g, [&](auto n) {
        attn_decode_qk<D, decltype(n)::value>(Q + g * Dp, Dp, k.data, p0, Dm, nk, S + g * K, K, vrows,
                                              g == 0 && nnext >= nk ? knext : nullptr, g == 0 ? nk : 0);
      });
    if (knext && nnext < nk) attn_prefetch_rows(k.data, p0 + K * Dm, Dm, nnext, item);
    const bool edge = nk < K || (s.causal && j0 + K - 1 > r0 / s.G + s.off);
    for (int64_t r = 0; r < nr; ++r)
      attn_online_row(S + r * K, j0, nk, edge ? s.limit(r0 + r) : __builtin_inff(), edge, m[r], l[r], O + r * Dp,
                      Dp, lane);
    for (int64_t g = 0; g < nr; g += 4)
      attn_rows_1to4(nr - g, [&](auto n) {
        attn_decode_pv<D, decltype(n)::value>(S + g * K, K, v.data, p0, Dm, nk, O + g * Dp, Dp);
      });
  }
  attn_store_rows<D>(s, o, lse, b, kvh, r0, nr, O, m, l);
}

// The running max (from mo) of a key tile's scores down columns g.. of
// S^T [nk][ld] (query rows in the lanes): key j's scores, times mul when
// Scale, masked to -inf past each row's limit lv on an edge tile, and
// stored back when store. The max runs in four chains: one chain made this
// loop wait out vmaxps' latency on every key (the hottest loop outside the
// products at head_dim 64). The same max as one chain for scores without
// NaN.
template <bool Scale>
TENSOR_OPS_VEC_INLINE vf attn_tile_max(float* St, int64_t ld, int64_t g, int64_t nk, int64_t j0, bool edge,
                                       bool store, vf mo, vf lv, vf mul) {
  const vf ninf = splat<vf>(-__builtin_inff());
  auto score = [&](int64_t j) {
    float* sp = St + j * ld + g;
    vf sv = vload(sp);
    if (Scale) sv = sv * mul;
    if (edge)
      sv = (vf)(((vu)(splat<vf>(float(j0 + j)) <= lv) & as_bits(sv)) |
                ((vu)(splat<vf>(float(j0 + j)) > lv) & as_bits(ninf)));
    if (store) vstore(sp, sv);
    return sv;
  };
  vf mx = mo, mx1 = mo, mx2 = mo, mx3 = mo;
  int64_t j = 0;
  for (; j + 4 <= nk; j += 4) {
    mx = max_t(mx, score(j));
    mx1 = max_t(mx1, score(j + 1));
    mx2 = max_t(mx2, score(j + 2));
    mx3 = max_t(mx3, score(j + 3));
  }
  for (; j < nk; ++j) mx = max_t(mx, score(j));
  return max_t(max_t(mx, mx1), max_t(mx2, mx3));
}

// ---- forward: items are (batch, kv head, packed row tile) ----------------
// scratch (attention_scratch_floats): Q | O (rows x Dp) | K^T (Dp x keys) |
// V (keys x Dp) | S (rows x keys) | m | l | lim | corr (rows)
//
// A tile of more than kNL rows computes S^T = K Q^T (keys x rows) against
// Q^T packed once per row tile, so no key tile is transposed: K is read in
// place (fp32) or converted once, the softmax runs down the columns with the
// rows in the lanes, and O += P V reads P^T as a transposed A. V is read in
// place too for fp32 with head_dim a multiple of kNL. Smaller tiles (decode:
// a few rows over a long cache) keep S = Q K^T, rows x keys, where a key
// tile's transpose costs less than S^T's padding to kNL rows would.
template <DType D>
void attention_tile_keys(const to_op_call& c, const AttnShape& s, int64_t b, int64_t kvh, int64_t r0, int64_t nr,
                         float* scratch) {
  const to_tensor &q = c.inputs[0], &k = c.inputs[1], &v = c.inputs[2], &o = c.outputs[0], &lse = c.outputs[1];
  const int64_t Dp = s.Dp, R = kAttnRows, K = kAttnKeys, Np = attn_pad(nr);
  float *Qt = scratch, *O = Qt + R * Dp, *Kb = O + R * Dp, *Vb = Kb + Dp * K, *St = Vb + K * Dp, *m = St + R * K,
        *l = m + R, *lim = l + R, *corr = lim + R;
  const float ninf = -__builtin_inff();
  attn_load_rows<D>(s, q.data, b, kvh, r0, nr, O, Dp, s.scale);
  attn_transpose(s, O, Dp, R, Qt);
  zero_f(O, R * Dp);
  for (int64_t r = 0; r < R; ++r) m[r] = ninf, l[r] = 0, lim[r] = r < nr ? s.limit(r0 + r) : __builtin_inff();
  const int64_t kend = s.key_end(r0 + nr), kvbase = (b * s.Hkv + kvh) * s.Lk * s.Dm;
  const bool f32 = D == DType::Float32, v_in_place = f32 && s.Dm == Dp;
  for (int64_t j0 = 0; j0 < kend; j0 += K) {
    const int64_t nk = min64(K, kend - j0);
    const float* Kp = f32 ? static_cast<const float*>(k.data) + kvbase + j0 * s.Dm : Kb;
    if (!f32) attn_load_keys<D>(s, k.data, b, kvh, j0, nk, Kb, Dp, nk);
    attn_gemm(nk, Np, s.Dm, Kp, f32 ? s.Dm : Dp, 1, Qt, R, St, R, false);  // S^T = K Q^T
    // causal: some key of the tile is past the first row's limit
    const bool edge = s.causal && j0 + nk - 1 > r0 / s.G + s.off;
    for (int64_t g = 0; g < Np; g += kVW) {
      const vf mo = vload(m + g), lv = vload(lim + g);
      const vf mx = attn_tile_max<false>(St, R, g, nk, j0, edge, edge, mo, lv, vf{});
      const vu seen = (vu)(mx > splat<vf>(ninf));  // rows that have seen a key
      vf sum = {};
      for (int64_t j = 0; j < nk; ++j) {
        float* sp = St + j * R + g;
        const vf sv = vload(sp);
        const vf p = from_bits(as_bits(exp_nonpos_t(sv - mx)) & (vu)(sv != splat<vf>(ninf)));
        vstore(sp, p);
        sum += p;
      }
      const vf cr = from_bits(as_bits(exp_nonpos_t(mo - mx)) & seen);  // 0 while m was -inf
      vstore(l + g, vload(l + g) * cr + sum);
      vstore(m + g, mx);
      vstore(corr + g, cr);
    }
    for (int64_t r = 0; r < nr; ++r) {
      if (corr[r] == 1.0f) continue;
      float* orow = O + r * Dp;
      const vf cr = splat<vf>(corr[r]);
      for (int64_t d = 0; d < Dp; d += kVW) vstore(orow + d, vload(orow + d) * cr);
    }
    const float* Vp = v_in_place ? static_cast<const float*>(v.data) + kvbase + j0 * s.Dm : Vb;
    if (!v_in_place) attn_load_keys<D>(s, v.data, b, kvh, j0, nk, Vb, Dp, nk);
    attn_gemm(nr, Dp, nk, St, 1, R, Vp, Dp, O, Dp, true);  // O += P V, P^T read transposed
  }
  attn_store_rows<D>(s, o, lse, b, kvh, r0, nr, O, m, l);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- forward on AMX tiles (the amx level: bfloat16 rows > kNL) -----------
// Note [AMX attention]
// The amx level runs the bf16 forward's two products on AMX tiles
// (tdpbf16ps: a 16 x 16 fp32 tile += 16 x 32 bf16 times 32 x 16 bf16, 512
// multiply-adds per instruction where an AVX-512 FMA does 16), the
// softmax between them in fp32 AVX-512 as in attention_tile_keys:
// - S^T = K Q^T: K's rows are the A tiles (row-major, as stored); Q^T is
//   packed once per row tile in the B layout (pairs of head dims
//   interleaved: the transpose of Q read as 32-bit pairs).
// - the softmax runs down S^T's columns with the query rows in the lanes;
//   P^T is rounded to bf16 straight into the B layout of the second
//   product (two keys interleaved per query), as torch's bf16 SDPA rounds P.
// - O^T += V^T P^T: V^T (per (batch, kv head), packed once per chunk) gives
//   the A tiles; O^T stays fp32 in the scratch, rescaled per query lane
//   when the running max grows, and is transposed once at the end.
// K and V are copied per (batch, kv head) into zero-padded buffers (keys to
// a multiple of kAttnAmxKeys, head_dim to 32), so every tile load is whole and
// padding keys (masked to P = 0) multiply zeros. Each S and O element is a
// fixed sequence of tile instructions: the same bits at any thread count.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Our tile configuration while in scope: every tile 16 rows x 64 bytes.
// Tile state is per thread, and the thread may be one of torch's OpenMP
// workers whose own AMX kernels (oneDNN's brgemm) configured the tiles and
// may count on that configuration still being loaded at their next call.
// So the scope saves the thread's configuration and puts it back at its
// end (the tiles' data is not kept: no caller keeps data in tiles between
// kernels), or releases the tiles where none was loaded.
class AmxTileScope {
 public:
  AmxTileScope() {
    _tile_storeconfig(&saved_);
    AmxTileConfig c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
  }
  ~AmxTileScope() {
    if (saved_.palette != 0)
      _tile_loadconfig(&saved_);
    else
      _tile_release();
  }
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;

 private:
  AmxTileConfig saved_;
};

// Note [AMX buffers on page boundaries] (all attention kernels)
// The AMX products read tiles at strides of whole kilobytes (V^T's rows are
// Lkp * 2 bytes apart), and their speed depended on where the key buffers
// and the scratch fell relative to each other in the cache sets: the same
// bf16 forward, [1, 32/8, 1024, 128] non-causal on 1 thread, took 27-29 ms
// in some processes and 44-49 ms in others, decided by the heap's state
// when the buffers were allocated (how much Python had allocated before).
// So the packed keys are page-aligned (AmxBuf) and the forward's and
// backward's scratch regions start on page boundaries (attention_amx_rows,
// attention_backward_amx): one layout, the fast one, in every process. The
// fp32 / fp16 kernels' scratch starts on a page too (attention_k,
// attention_backward_k; fp32 [1, 32/8, 1024, 128] non-causal, 1 thread:
// forward 113-123 -> 104-112 ms, forward+backward 427-461 -> 383-411 ms).
class AmxBuf {
 public:
  uint16_t* data() const { return p_.get(); }
  size_t size() const { return n_; }
  void resize(size_t n) {
    if (n <= n_) return;
    const size_t bytes = (n * 2 + 4095) / 4096 * 4096;
    void* q = std::aligned_alloc(4096, bytes);
    if (!q) throw std::bad_alloc();
    p_.reset(static_cast<uint16_t*>(q));
    n_ = bytes / 2;
  }

 private:
  struct Free {
    void operator()(uint16_t* q) const { std::free(q); }
  };
  std::unique_ptr<uint16_t, Free> p_;
  size_t n_ = 0;
};

// One (batch, kv head)'s keys, padded: K [Lkp][Dq] and V^T [Dq][Lkp] bf16.
struct AmxKv {
  AmxBuf k, vt, tile;
  int64_t Lkp = 0, Dq = 0;
};

// dst[c * ldd + r] = src[r * lds + c], 16 x 16 16-bit elements (widened to
// 32-bit lanes for transpose16x16 and narrowed back: exact).
inline void amx_transpose16x16_u16(const uint16_t* src, int64_t lds, uint16_t* dst, int64_t ldd) {
  alignas(64) float a[256], t[256];
  for (int i = 0; i < 16; ++i) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * lds));
    _mm512_store_si512(a + 16 * i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  }
  transpose16x16(a, 16, t, 16);
  for (int i = 0; i < 16; ++i) {
    const __m512i y = _mm512_srli_epi32(_mm512_load_si512(t + 16 * i), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * ldd), _mm512_cvtepi32_epi16(y));
  }
}

// dst [Dq] = src's n elements then zeros (all zeros where src is null).
inline void amx_copy_padded(uint16_t* dst, const uint16_t* src, int64_t n, int64_t Dq) {
  if (!src) n = 0;
  if (n) std::memcpy(dst, src, size_t(n) * 2);
  std::memset(dst + n, 0, size_t(Dq - n) * 2);
}

// Keys [0, Lkp) of (b, kvh) from src [.., Lk, Dm] into dst [Lkp][Dq],
// zero-padded (keys past Lk, head dims past Dm).
inline void amx_pack_key_rows(const AttnShape& s, const void* src, int64_t b, int64_t kvh, int64_t Lkp, int64_t Dq,
                              uint16_t* dst) {
  const uint16_t* p = static_cast<const uint16_t*>(src) + (b * s.Hkv + kvh) * s.Lk * s.Dm;
  for (int64_t j = 0; j < Lkp; ++j) amx_copy_padded(dst + j * Dq, j < s.Lk ? p + j * s.Dm : nullptr, s.Dm, Dq);
}

// Packed rows [r0, r0 + nr) of (b, kvh) from src [B, Hq, Lq, Dm] (Q or dO)
// into dst [kAttnRows][Dq], zero-padded.
inline void amx_pack_row_tile(const AttnShape& s, const void* src, int64_t b, int64_t kvh, int64_t r0, int64_t nr,
                              int64_t Dq, uint16_t* dst) {
  const uint16_t* p = static_cast<const uint16_t*>(src);
  for (int64_t r = 0; r < kAttnRows; ++r)
    amx_copy_padded(dst + r * Dq, r < nr ? p + s.row_offset(b, kvh, r0 + r) : nullptr, s.Dm, Dq);
}

// The same keys transposed: dst [Dq][Lkp], a padded 64-key tile at a time
// through tile [64][Dq].
inline void amx_pack_key_cols(const AttnShape& s, const void* src, int64_t b, int64_t kvh, int64_t Lkp, int64_t Dq,
                              uint16_t* dst, uint16_t* tile) {
  constexpr int64_t K = kAttnKeys;
  const uint16_t* p = static_cast<const uint16_t*>(src) + (b * s.Hkv + kvh) * s.Lk * s.Dm;
  for (int64_t j0 = 0; j0 < Lkp; j0 += K) {
    for (int64_t j = 0; j < K; ++j)
      amx_copy_padded(tile + j * Dq, j0 + j < s.Lk ? p + (j0 + j) * s.Dm : nullptr, s.Dm, Dq);
    for (int64_t j = 0; j < K; j += 16)
      for (int64_t d = 0; d < Dq; d += 16) amx_transpose16x16_u16(tile + j * Dq + d, Dq, dst + d * Lkp + j0 + j, Lkp);
  }
}

inline void amx_pack_kv(const AttnShape& s, const void* kdata, const void* vdata, int64_t b, int64_t kvh,
                        AmxKv& p) {
  const int64_t Dq = amx_dq(s.Dm), Lkp = (s.Lk + kAttnAmxKeys - 1) / kAttnAmxKeys * kAttnAmxKeys, K = kAttnKeys;
  p.Dq = Dq, p.Lkp = Lkp;
  if (int64_t(p.k.size()) < Lkp * Dq) p.k.resize(size_t(Lkp * Dq)), p.vt.resize(size_t(Lkp * Dq));
  if (int64_t(p.tile.size()) < K * Dq) p.tile.resize(size_t(K * Dq));
  amx_pack_key_rows(s, kdata, b, kvh, Lkp, Dq, p.k.data());
  amx_pack_key_cols(s, vdata, b, kvh, Lkp, Dq, p.vt.data(), p.tile.data());
}

// rows [R][Dq] (bf16) into the B layout of a product over head dims:
// dst [Dq / 2][2R], dst[i][2r + e] = rows[r][2i + e] (the transpose of the
// rows read as 32-bit pairs).
inline void amx_pack_dims(const uint16_t* rows, int64_t Dq, uint16_t* dst) {
  constexpr int64_t R = kAttnRows;
  for (int64_t d = 0; d < Dq / 2; d += 16)
    for (int64_t r = 0; r < R; r += 16)
      transpose16x16(reinterpret_cast<const float*>(rows) + r * (Dq / 2) + d, Dq / 2,
                     reinterpret_cast<float*>(dst) + d * R + r, R);
}

// Two keys' values for 16 query rows (fp32) as one row of the B layout of
// a product over keys: bf16 (round to nearest even), lane 2q from the
// first, 2q + 1 from the second.
TENSOR_OPS_VEC_INLINE __m512i amx_key_pair(vf first, vf second) {
  alignas(64) static constexpr uint16_t kIdx[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                    21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                    11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i h = (__m512i)_mm512_cvtne2ps_pbh((__m512)second, (__m512)first);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx), h);
}

// C^T products on a row tile's three 16-row query tiles (QT of them used):
// out [n32][kAttnRows] fp32 = A B, A the key rows a [n32][Dq] (bf16, K or
// V), B the row tile packed by amx_pack_dims; n32 a multiple of 32. Keys x
// query tiles 0-1 as a 2 x 2 block of C tiles (each A and B tile loaded
// once for two products), then keys x query tile 2.
inline void amx_keys_x_rows(const uint16_t* a, const uint16_t* bv, float* out, int64_t n32, int64_t QT, int64_t Dq) {
  constexpr int64_t R = kAttnRows;
  for (int64_t kt = 0; kt < n32; kt += 32) {
    const uint16_t* ka = a + kt * Dq;
    float* sc = out + kt * R;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < Dq / 32; ++t) {
      _tile_loadd(4, ka + t * 32, Dq * 2);
      _tile_loadd(5, ka + 16 * Dq + t * 32, Dq * 2);
      _tile_loadd(6, bv + t * 16 * 2 * R, 4 * R);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, bv + t * 16 * 2 * R + 32, 4 * R);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sc, 4 * R);
    _tile_stored(1, sc + 16, 4 * R);
    _tile_stored(2, sc + 16 * R, 4 * R);
    _tile_stored(3, sc + 16 * R + 16, 4 * R);
    if (QT == 3) {
      _tile_zero(0);
      _tile_zero(2);
      for (int64_t t = 0; t < Dq / 32; ++t) {
        _tile_loadd(4, ka + t * 32, Dq * 2);
        _tile_loadd(5, ka + 16 * Dq + t * 32, Dq * 2);
        _tile_loadd(6, bv + t * 16 * 2 * R + 64, 4 * R);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
      }
      _tile_stored(0, sc + 32, 4 * R);
      _tile_stored(2, sc + 16 * R + 32, 4 * R);
    }
  }
}

// C^T [Dq][ldc] (fp32, columns: the row tile's query rows) += A B over
// 32 * steps keys: A the head-dim-major keys at (lda elements per head dim:
// V^T or K^T from amx_pack_key_cols, at the block's first key), B pairs of
// keys per query row [steps * 16][2 kAttnRows] (P^T or dS^T, two keys
// interleaved per row).
inline void amx_dims_x_rows(const uint16_t* at, int64_t lda, const uint16_t* bp, float* c, int64_t ldc,
                            int64_t steps, int64_t QT, int64_t Dq) {
  constexpr int64_t R = kAttnRows;
  for (int64_t d0 = 0; d0 < Dq; d0 += 16) {
    _tile_loadd(0, c + d0 * ldc, 4 * ldc);
    _tile_loadd(1, c + d0 * ldc + 16, 4 * ldc);
    if (QT == 3) _tile_loadd(2, c + d0 * ldc + 32, 4 * ldc);
    for (int64_t t = 0; t < steps; ++t) {
      const uint16_t* va = at + d0 * lda + t * 32;
      const uint16_t* pb = bp + t * 16 * 2 * R;
      _tile_loadd(3, va, lda * 2);
      _tile_loadd(4, pb, 4 * R);
      _tile_dpbf16ps(0, 3, 4);
      _tile_loadd(5, pb + 32, 4 * R);
      _tile_dpbf16ps(1, 3, 5);
      if (QT == 3) {
        _tile_loadd(6, pb + 64, 4 * R);
        _tile_dpbf16ps(2, 3, 6);
      }
    }
    _tile_stored(0, c + d0 * ldc, 4 * ldc);
    _tile_stored(1, c + d0 * ldc + 16, 4 * ldc);
    if (QT == 3) _tile_stored(2, c + d0 * ldc + 32, 4 * ldc);
  }
}

// One row tile (rows r0.. of (b, kvh), nr > kNL of them) against the packed
// keys, kAttnAmxKeys at a time; scratch: attention_scratch_floats' AMX term
// (attention_tiles.h).
void attention_amx_rows(const to_op_call& c, const AttnShape& s, int64_t b, int64_t kvh, int64_t r0, int64_t nr,
                        const AmxKv& kv, float* scratch) {
  const to_tensor &q = c.inputs[0], &o = c.outputs[0], &lse = c.outputs[1];
  constexpr int64_t R = kAttnRows, K = kAttnAmxKeys;
  static_assert(R == 48 && K % 32 == 0, "the tile loops below take three 16-row query tiles");
  const int64_t Dq = kv.Dq, Lkp = kv.Lkp, Np = attn_pad(nr), QT = Np / 16;
  // Each region on a page boundary (Note [AMX buffers on page boundaries]):
  // the scratch has a page of slack for each.
  const auto page = attn_page;
  float* OT = page(scratch);                               // [Dq][R]: O^T in fp32
  float* St = page(OT + Dq * R);                           // [K][R]: S^T
  uint16_t* pv = reinterpret_cast<uint16_t*>(page(St + K * R));  // [K / 2][2R]: P^T, two keys per query
  uint16_t* qc = reinterpret_cast<uint16_t*>(page(pv + K * R));  // [R][Dq]: the row tile's queries
  uint16_t* qv = reinterpret_cast<uint16_t*>(page(qc + R * Dq));  // [Dq / 2][2R]: Q^T in the B layout
  float *m = page(qv + R * Dq), *l = m + R, *lim = l + R, *corr = lim + R;
  const float ninf = -__builtin_inff();
  amx_pack_row_tile(s, q.data, b, kvh, r0, nr, Dq, qc);
  amx_pack_dims(qc, Dq, qv);
  zero_f(OT, Dq * R);
  for (int64_t r = 0; r < R; ++r) m[r] = ninf, l[r] = 0, lim[r] = r < nr ? s.limit(r0 + r) : __builtin_inff();
  const int64_t kend = s.key_end(r0 + nr);
  // A positive finite scale multiplies inside the exp (e^(scale (s - max)),
  // the max taken over the unscaled scores, which it does not reorder), so
  // the scores are stored back only on a masked tile; any other scale
  // multiplies each score first. m holds the running max of the scores
  // times mul; lse = m * esc + log l.
  const bool folded = s.scale > 0 && s.scale < __builtin_inff();
  const vf mul = splat<vf>(folded ? 1.0f : s.scale), esc = splat<vf>(folded ? s.scale : 1.0f);
  for (int64_t j0 = 0; j0 < kend; j0 += K) {
    const int64_t nk = min64(K, kend - j0), nk32 = (nk + 31) / 32 * 32;
    const uint16_t* kp = kv.k.data() + j0 * Dq;
    amx_keys_x_rows(kp, qv, St, nk32, QT, Dq);  // S^T = K Q^T
    const bool edge = s.causal && j0 + nk - 1 > r0 / s.G + s.off;
    const bool store = edge || !folded;
    bool rescale = false;
    for (int64_t g = 0; g < Np; g += kVW) {
      const vf mo = vload(m + g), lv = vload(lim + g);
      const vf mx = folded ? attn_tile_max<false>(St, R, g, nk, j0, edge, edge, mo, lv, mul)
                           : attn_tile_max<true>(St, R, g, nk, j0, edge, true, mo, lv, mul);
      const vu seen = (vu)(mx > splat<vf>(ninf));
      const vf nmx = from_bits(as_bits(-(mx * esc)) & seen);  // -max * esc (0 where -inf: no NaN below)
      auto prob = [&](int64_t jj) -> vf {
        if (jj >= nk) return vf{};
        const vf sv = vload(St + jj * R + g);
        return from_bits(as_bits(exp_nonpos_t(sv * esc + nmx)) & (vu)(sv != splat<vf>(ninf)));
      };
      // Note [AMX softmax without masks]: a tile with no causal edge and a
      // folded scale holds the products as computed, finite unless q or k
      // hold an infinity: no -inf to zero and no select. A product of
      // -inf there gives e^-86.5 = 2.7e-38 instead of 0 (exp_nonpos_sum_t),
      // which moves no output a float can show next to the row's max term
      // e^0 = 1; +inf or NaN propagate as before. Two of the ~10
      // instructions per score fewer on the common tiles.
      auto prob_fast = [&](int64_t jj) -> vf {
        return jj < nk ? exp_nonpos_sum_t(vload(St + jj * R + g) * esc + nmx) : vf{};
      };
      // P^T's pairs and their sum, the loop compiled once per kind of tile
      auto pairs = [&](auto p) {
        vf sum = {};
        for (int64_t jj = 0; jj < nk32; jj += 2) {
          const vf p0 = p(jj), p1 = p(jj + 1);
          sum += p0;
          sum += p1;
          _mm512_storeu_si512(pv + (jj / 2) * 2 * R + 2 * g, amx_key_pair(p0, p1));
        }
        return sum;
      };
      const vf sum = store ? pairs(prob) : pairs(prob_fast);
      const vf cr = from_bits(as_bits(exp_nonpos_t((mo - mx) * esc)) & seen);
      vstore(l + g, vload(l + g) * cr + sum);
      vstore(m + g, mx);
      vstore(corr + g, cr);
      for (int x = 0; x < kVW; ++x) rescale |= cr[x] != 1.0f;
    }
    if (rescale)
      for (int64_t d = 0; d < Dq; ++d)
        for (int64_t g = 0; g < Np; g += kVW) vstore(OT + d * R + g, vload(OT + d * R + g) * vload(corr + g));
    amx_dims_x_rows(kv.vt.data() + j0, Lkp, pv, OT, R, nk32 / 32, QT, Dq);  // O^T += V^T P^T
  }
  for (int64_t r = 0; r < R; ++r) m[r] = m[r] * esc[0];  // the max of the scaled scores (-inf stays)
  float* O = St;  // [R][Dp], over S^T and the bf16 buffers after it (all done with)
  for (int64_t d = 0; d < s.Dp; d += 16)
    for (int64_t r = 0; r < R; r += 16) transpose16x16(OT + d * R + r, R, O + r * s.Dp + d, s.Dp);
  attn_store_rows<DType::BFloat16>(s, o, lse, b, kvh, r0, nr, O, m, l);
}
#endif

template <DType D>
int attention_k(const to_op_call& c, int64_t i0, int64_t i1, float* scratch) {
  const to_tensor &q = c.inputs[0], &k = c.inputs[1], &v = c.inputs[2], &o = c.outputs[0], &lse = c.outputs[1];
  const AttnShape s(q, k, c);
  scratch = attn_page(scratch);  // Note [AMX buffers on page boundaries]: every path's scratch from a page
  const int64_t Dp = s.Dp, R = kAttnRows, K = kAttnKeys;
  float *Q = scratch, *O = Q + R * Dp, *Kt = O + R * Dp, *V = Kt + Dp * K, *S = V + K * Dp, *m = S + R * K,
        *l = m + R;
  const float ninf = -__builtin_inff();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // the keys of the (batch, kv head) last packed by this chunk; buffers kept by the thread
  static thread_local AmxKv kv;
  int64_t packed = -1;
  std::optional<AmxTileScope> tiles;  // configured at the chunk's first AMX row tile
#endif
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t b = it / (s.Hkv * s.row_tiles), kvh = (it / s.row_tiles) % s.Hkv, t = it % s.row_tiles;
    const int64_t r0 = t * R, nr = min64(R, s.rows - r0);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (D == DType::BFloat16 && nr > kNL) {
      if (packed != b * s.Hkv + kvh) amx_pack_kv(s, k.data, v.data, b, kvh, kv), packed = b * s.Hkv + kvh;
      if (!tiles) tiles.emplace();
      attention_amx_rows(c, s, b, kvh, r0, nr, kv, scratch);
      continue;
    }
#endif
    if (nr > kNL) {
      attention_tile_keys<D>(c, s, b, kvh, r0, nr, scratch);
      continue;
    }
    if (nr <= kAttnDecodeRows) {
      attention_decode_rows<D>(c, s, b, kvh, r0, nr, scratch);
      continue;
    }
    attn_load_rows<D>(s, q.data, b, kvh, r0, nr, Q, Dp, s.scale);
    zero_f(O, R * Dp);
    for (int64_t r = 0; r < R; ++r) m[r] = ninf, l[r] = 0;
    const int64_t kend = s.key_end(r0 + nr);
    vf lane = {};
    for (int x = 0; x < kVW; ++x) lane[x] = float(x);
    for (int64_t j0 = 0; j0 < kend; j0 += K) {
      const int64_t nk = min64(K, kend - j0);
      attn_load_keys<D>(s, k.data, b, kvh, j0, nk, V, Dp, K);  // K rows, transposed next
      attn_transpose(s, V, Dp, K, Kt);
      attn_load_keys<D>(s, v.data, b, kvh, j0, nk, V, Dp, K);
      attn_gemm(nr, K, s.Dm, Q, Dp, Kt, K, S, K, false);
      // masks: keys past the tile's end, and (causal) past each row's limit
      const bool edge = nk < K || (s.causal && j0 + K - 1 > r0 / s.G + s.off);
      for (int64_t r = 0; r < nr; ++r)
        attn_online_row(S + r * K, j0, nk, edge ? s.limit(r0 + r) : __builtin_inff(), edge, m[r], l[r], O + r * Dp,
                        Dp, lane);
      attn_gemm(nr, Dp, K, S, K, V, Dp, O, Dp, true);
    }
    attn_store_rows<D>(s, o, lse, b, kvh, r0, nr, O, m, l);
  }
  return 0;
}

// ---- backward -------------------------------------------------------------
// Packed row r's log-sum-exp from the forward and its causal limit, as the
// backward uses them: 0 and -inf for a row that saw no key (P = 0 there).
inline void attn_grad_row_lse(const AttnShape& s, const to_tensor& lse, int64_t b, int64_t kvh, int64_t r, float& L,
                              float& lim) {
  const float l = static_cast<const float*>(lse.data)[s.lse_index(b, kvh, r)];
  L = l == -__builtin_inff() ? 0.0f : l;
  lim = l == -__builtin_inff() ? -__builtin_inff() : s.limit(r);
}

// Per packed row tile: Q, dO (rows x Dp), lse, Delta = rowsum(dO * O), and
// each row's causal limit (-inf for padding rows and rows that saw no key).
template <DType D>
inline void attn_load_grad_rows(const AttnShape& s, const to_op_call& c, int64_t b, int64_t kvh, int64_t r0,
                                int64_t nr, float* Q, float* dO, float* L, float* Delta, float* lim, float* tmp) {
  const to_tensor &dout = c.inputs[0], &q = c.inputs[1], &o = c.inputs[4], &lse = c.inputs[5];
  attn_load_rows<D>(s, q.data, b, kvh, r0, nr, Q, s.Dp, 1.0f);
  attn_load_rows<D>(s, dout.data, b, kvh, r0, nr, dO, s.Dp, 1.0f);
  for (int64_t r = 0; r < kAttnRows; ++r) {
    if (r >= nr) {
      L[r] = 0, Delta[r] = 0, lim[r] = -__builtin_inff();
      continue;
    }
    ld<D>(o.data, s.row_offset(b, kvh, r0 + r), s.Dm, tmp);
    float dsum = 0;
    for (int64_t d = 0; d < s.Dm; ++d) dsum += tmp[d] * dO[r * s.Dp + d];
    Delta[r] = dsum;
    attn_grad_row_lse(s, lse, b, kvh, r0 + r, L[r], lim[r]);
  }
}

// Phase 0 (ints[6] == 0): items (batch, kv head, key tile) -> dK, dV rows.
template <DType D>
void attention_backward_kv(const to_op_call& c, const AttnShape& s, int64_t i0, int64_t i1, float* scratch) {
  const to_tensor &k = c.inputs[2], &v = c.inputs[3], &dk = c.outputs[1], &dv = c.outputs[2];
  const int64_t Dp = s.Dp, R = kAttnRows, K = kAttnKeys;
  float *Kr = scratch, *V = Kr + K * Dp, *dK = V + K * Dp, *dV = dK + K * Dp, *Q = dV + K * Dp, *dO = Q + R * Dp,
        *Qt = dO + R * Dp, *dOt = Qt + Dp * R, *P = dOt + Dp * R, *dP = P + K * R, *L = dP + K * R, *Delta = L + R,
        *lim = Delta + R, *tmp = lim + R;
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t b = it / (s.Hkv * s.key_tiles), kvh = (it / s.key_tiles) % s.Hkv, kt = it % s.key_tiles;
    const int64_t j0 = kt * K, nk = min64(K, s.Lk - j0);
    attn_load_keys<D>(s, k.data, b, kvh, j0, nk, Kr, Dp, K);
    attn_load_keys<D>(s, v.data, b, kvh, j0, nk, V, Dp, K);
    zero_f(dK, 2 * K * Dp);
    for (int64_t r0 = s.first_row(j0) / R * R; r0 < s.rows; r0 += R) {
      const int64_t nr = min64(R, s.rows - r0);
      attn_load_grad_rows<D>(s, c, b, kvh, r0, nr, Q, dO, L, Delta, lim, tmp);
      attn_transpose(s, Q, Dp, R, Qt);
      attn_transpose(s, dO, Dp, R, dOt);
      attn_gemm(nk, R, s.Dm, Kr, Dp, Qt, R, P, R, false);   // S^T
      attn_gemm(nk, R, s.Dm, V, Dp, dOt, R, dP, R, false);  // dP^T
      for (int64_t j = 0; j < nk; ++j) {
        const vf pos = splat<vf>(float(j0 + j));
        float *prow = P + j * R, *dprow = dP + j * R;
        for (int64_t r = 0; r < R; r += kVW) {
          const vf p = masked_exp(vload(prow + r) * s.scale - vload(L + r), pos, vload(lim + r));
          vstore(prow + r, p);
          vstore(dprow + r, p * (vload(dprow + r) - vload(Delta + r)) * s.scale);
        }
      }
      attn_gemm(nk, Dp, nr, P, R, dO, Dp, dV, Dp, true);
      attn_gemm(nk, Dp, nr, dP, R, Q, Dp, dK, Dp, true);
    }
    const int64_t base = ((b * s.Hkv + kvh) * s.Lk + j0) * s.Dm;
    for (int64_t j = 0; j < nk; ++j) {
      st<D>(dK + j * Dp, dk.data, base + j * s.Dm, s.Dm);
      st<D>(dV + j * Dp, dv.data, base + j * s.Dm, s.Dm);
    }
  }
}

// Phase 1 (ints[6] == 1): items (batch, kv head, packed row tile) -> dQ rows.
template <DType D>
void attention_backward_q(const to_op_call& c, const AttnShape& s, int64_t i0, int64_t i1, float* scratch) {
  const to_tensor &k = c.inputs[2], &v = c.inputs[3], &dq = c.outputs[0];
  const int64_t Dp = s.Dp, R = kAttnRows, K = kAttnKeys;
  float *Q = scratch, *dO = Q + R * Dp, *dQ = dO + R * Dp, *Kt = dQ + R * Dp, *Kr = Kt + Dp * K, *Vt = Kr + K * Dp,
        *P = Vt + Dp * K, *dP = P + R * K, *L = dP + R * K, *Delta = L + R, *lim = Delta + R, *tmp = lim + R;
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t b = it / (s.Hkv * s.row_tiles), kvh = (it / s.row_tiles) % s.Hkv, t = it % s.row_tiles;
    const int64_t r0 = t * R, nr = min64(R, s.rows - r0);
    attn_load_grad_rows<D>(s, c, b, kvh, r0, nr, Q, dO, L, Delta, lim, tmp);
    zero_f(dQ, R * Dp);
    const int64_t kend = s.key_end(r0 + nr);
    for (int64_t j0 = 0; j0 < kend; j0 += K) {
      const int64_t nk = min64(K, kend - j0);
      attn_load_keys<D>(s, v.data, b, kvh, j0, nk, Kr, Dp, K);
      attn_transpose(s, Kr, Dp, K, Vt);
      attn_load_keys<D>(s, k.data, b, kvh, j0, nk, Kr, Dp, K);
      attn_transpose(s, Kr, Dp, K, Kt);
      attn_gemm(nr, K, s.Dm, Q, Dp, Kt, K, P, K, false);
      attn_gemm(nr, K, s.Dm, dO, Dp, Vt, K, dP, K, false);
      vf lane = {};
      for (int x = 0; x < kVW; ++x) lane[x] = float(x);
      for (int64_t r = 0; r < nr; ++r) {
        float *prow = P + r * K, *dprow = dP + r * K;
        const vf lr = splat<vf>(L[r]), dr = splat<vf>(Delta[r]);
        const vf lim_r = splat<vf>(min_t(lim[r], float(j0 + nk - 1)));
        for (int64_t j = 0; j < K; j += kVW) {
          const vf p = masked_exp(vload(prow + j) * s.scale - lr, lane + float(j0 + j), lim_r);
          vstore(dprow + j, p * (vload(dprow + j) - dr) * s.scale);
        }
      }
      attn_gemm(nr, Dp, nk, dP, K, Kr, Dp, dQ, Dp, true);
    }
    for (int64_t r = 0; r < nr; ++r) st<D>(dQ + r * Dp, dq.data, s.row_offset(b, kvh, r0 + r), s.Dm);
  }
}

// Fused (ints[6] == 2): items (batch, kv head) -> dQ, dK and dV, with the
// five tile products of FlashAttention-2 (S and dP computed once per tile
// pair). Key tiles outside, row tiles inside; dQ accumulates in fp32 in the
// item's scratch. Every sum runs in the same order as in phases 0 and 1
// (dK / dV over rows ascending, dQ over keys ascending, each product element
// one fused multiply-add chain over head_dim), so both schedules give the
// same bits and the dispatcher may pick either (cpu_backend.cpp).
// scratch (attention_fused_backward_scratch_floats): dQ | Q^T | dO^T (rows
// tile by tile, [Dp][kAttnRows] each) | L | Delta | lim (rows) | K (keys x
// Dp) | K^T | V^T | dK^T | dV^T (Dp x keys) | S | dP (rows x keys) | two
// row tiles | Dp
template <DType D>
void attention_backward_fused(const to_op_call& c, const AttnShape& s, int64_t i0, int64_t i1, float* scratch) {
  const to_tensor &k = c.inputs[2], &v = c.inputs[3], &dq = c.outputs[0], &dk = c.outputs[1], &dv = c.outputs[2];
  const int64_t Dp = s.Dp, R = kAttnRows, K = kAttnKeys, rows_pad = s.row_tiles * R;
  float *dQ = scratch, *Qt = dQ + rows_pad * Dp, *dOt = Qt + rows_pad * Dp, *L = dOt + rows_pad * Dp,
        *Delta = L + rows_pad, *lim = Delta + rows_pad, *Kr = lim + rows_pad, *Kt = Kr + K * Dp, *Vt = Kt + Dp * K,
        *dKt = Vt + Dp * K, *dVt = dKt + Dp * K, *S = dVt + Dp * K, *dP = S + R * K, *T0 = dP + R * K,
        *T1 = T0 + R * Dp, *tmp = T1 + R * Dp;
  float* Vr = T0;  // a key tile's V rows before the transpose (K x Dp over T0 and T1)
  static_assert(2 * kAttnRows >= kAttnKeys, "V rows fit in the two row tiles");
  vf lane = {};
  for (int x = 0; x < kVW; ++x) lane[x] = float(x);
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t b = it / s.Hkv, kvh = it % s.Hkv;
    // every row tile's Q^T, dO^T, lse, Delta and limits, once
    for (int64_t t = 0; t < s.row_tiles; ++t) {
      const int64_t r0 = t * R, nr = min64(R, s.rows - r0);
      attn_load_grad_rows<D>(s, c, b, kvh, r0, nr, T0, T1, L + r0, Delta + r0, lim + r0, tmp);
      attn_transpose(s, T0, Dp, R, Qt + r0 * Dp);
      attn_transpose(s, T1, Dp, R, dOt + r0 * Dp);
    }
    zero_f(dQ, rows_pad * Dp);
    for (int64_t j0 = 0; j0 < s.Lk; j0 += K) {
      const int64_t nk = min64(K, s.Lk - j0);
      attn_load_keys<D>(s, k.data, b, kvh, j0, nk, Kr, Dp, K);
      attn_transpose(s, Kr, Dp, K, Kt);
      attn_load_keys<D>(s, v.data, b, kvh, j0, nk, Vr, Dp, K);
      attn_transpose(s, Vr, Dp, K, Vt);
      zero_f(dKt, 2 * Dp * K);
      for (int64_t r0 = s.first_row(j0) / R * R; r0 < s.rows; r0 += R) {
        const int64_t nr = min64(R, s.rows - r0);
        // keys [j0, j0 + ne) may be visible from this row tile (causal: fewer
        // near the diagonal); Ne: those padded to whole column blocks
        const int64_t ne = min64(nk, s.key_end(r0 + nr) - j0), Ne = attn_pad(ne);
        if (ne <= 0) continue;
        const float *qt = Qt + r0 * Dp, *dot = dOt + r0 * Dp;
        attn_gemm(nr, Ne, s.Dm, qt, 1, R, Kt, K, S, K, false);    // S = Q K^T
        attn_gemm(nr, Ne, s.Dm, dot, 1, R, Vt, K, dP, K, false);  // dP = dO V^T
        for (int64_t r = 0; r < nr; ++r) {
          float *prow = S + r * K, *dprow = dP + r * K;
          const vf lr = splat<vf>(L[r0 + r]), dr = splat<vf>(Delta[r0 + r]);
          const vf lim_r = splat<vf>(min_t(lim[r0 + r], float(j0 + ne - 1)));
          for (int64_t j = 0; j < Ne; j += kVW) {
            const vf p = masked_exp(vload(prow + j) * s.scale - lr, lane + float(j0 + j), lim_r);
            vstore(prow + j, p);
            vstore(dprow + j, p * (vload(dprow + j) - dr) * s.scale);
          }
        }
        attn_gemm(s.Dm, Ne, nr, dot, R, 1, S, K, dVt, K, true);  // dV^T += dO^T P
        attn_gemm(s.Dm, Ne, nr, qt, R, 1, dP, K, dKt, K, true);  // dK^T += Q^T dS
        attn_gemm(nr, Dp, ne, dP, K, Kr, Dp, dQ + r0 * Dp, Dp, true);  // dQ += dS K
      }
      const int64_t base = ((b * s.Hkv + kvh) * s.Lk + j0) * s.Dm;
      for (int64_t j = 0; j < nk; ++j) {
        for (int64_t d = 0; d < s.Dm; ++d) tmp[d] = dKt[d * K + j];
        st<D>(tmp, dk.data, base + j * s.Dm, s.Dm);
        for (int64_t d = 0; d < s.Dm; ++d) tmp[d] = dVt[d * K + j];
        st<D>(tmp, dv.data, base + j * s.Dm, s.Dm);
      }
    }
    for (int64_t r = 0; r < s.rows; ++r) st<D>(dQ + r * Dp, dq.data, s.row_offset(b, kvh, r), s.Dm);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Note [AMX attention backward]
// The amx level's bf16 backward: FlashAttention-2's five products on AMX
// tiles, one (batch, kv head) item per thread (the fused schedule, chosen
// for every such call whatever the thread count: ints[6] == 3, cpu_backend.cpp), key
// blocks of kAttnAmxBackwardKeys outside, row tiles inside, as
// attention_backward_fused.
// With the rows in the lanes (as the forward):
// - S^T = K Q^T and dP^T = V dO^T (amx_keys_x_rows: K's and V's rows as A
//   tiles; Q^T and dO^T packed once per row tile);
// - P^T = exp(scale S^T - lse) and dS^T = P^T (dP^T - Delta) scale in fp32,
//   rounded to bf16 three ways: P^T and dS^T keys x rows (A tiles of the
//   next two products), dS^T as key pairs per row (B of the last);
// - dV += P^T dO and dK += dS^T Q (rows as the shared dimension: dO and Q
//   packed as row pairs), in fp32 per key block;
// - dQ^T += K^T dS^T (amx_dims_x_rows, K^T packed per item), fp32 for all
//   of the item's rows, transposed once at the end.
// Delta = rowsum(dO * O) in fp32 from the bf16 tensors. Every sum runs in
// one fixed order on one thread: the same bits at any thread count.
struct AmxBwdKv {
  AmxBuf k, v, kt, tile;  // Note [AMX buffers on page boundaries]
};

// rows [kAttnRows][Dq] into the B layout of a product over rows:
// dst [32][2 Dq], dst[p][2d + e] = rows[2p + e][d]; pairs past the tile zero.
inline void amx_pack_row_pairs(const uint16_t* rows, int64_t Dq, uint16_t* dst) {
  constexpr int64_t R = kAttnRows;
  alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t p = 0; p < R / 2; ++p)
    for (int64_t d = 0; d < Dq; d += 32) {
      const __m512i a = _mm512_loadu_si512(rows + 2 * p * Dq + d), b = _mm512_loadu_si512(rows + (2 * p + 1) * Dq + d);
      _mm512_storeu_si512(dst + p * 2 * Dq + 2 * d, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + p * 2 * Dq + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  std::memset(dst + (R / 2) * 2 * Dq, 0, size_t(32 - R / 2) * 2 * Dq * 2);
}

// C [n16][Dq] (fp32, keys x head dims) += A B over the row tile's rows
// (steps of 32): A [n16][64] bf16 keys x rows (P^T or dS^T), B the rows as
// pairs (amx_pack_row_pairs of dO or Q).
inline void amx_keys_x_dims(const uint16_t* a, const uint16_t* bp, float* c, int64_t n16, int64_t steps, int64_t Dq) {
  for (int64_t kt = 0; kt < n16; kt += 16)
    for (int64_t d0 = 0; d0 < Dq; d0 += 32) {
      float* cc = c + kt * Dq + d0;
      _tile_loadd(0, cc, Dq * 4);
      _tile_loadd(1, cc + 16, Dq * 4);
      for (int64_t t = 0; t < steps; ++t) {
        _tile_loadd(2, a + kt * 64 + t * 32, 128);
        _tile_loadd(3, bp + t * 16 * 2 * Dq + 2 * d0, Dq * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(4, bp + t * 16 * 2 * Dq + 2 * d0 + 32, Dq * 4);
        _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, cc, Dq * 4);
      _tile_stored(1, cc + 16, Dq * 4);
    }
}

// scratch: attention_amx_backward_scratch_floats (attention_tiles.h)
void attention_backward_amx(const to_op_call& c, const AttnShape& s, int64_t i0, int64_t i1, float* scratch) {
  const to_tensor &dout = c.inputs[0], &q = c.inputs[1], &k = c.inputs[2], &v = c.inputs[3], &o = c.inputs[4],
                  &lse = c.inputs[5], &dq = c.outputs[0], &dk = c.outputs[1], &dv = c.outputs[2];
  constexpr int64_t R = kAttnRows, K = kAttnAmxBackwardKeys;
  // each row tile's packs: whole pages, so each starts on one
  const int64_t Dq = amx_dq(s.Dm), rp = s.row_tiles * R, Lkp = (s.Lk + K - 1) / K * K,
                pack = ((R + 64) * Dq + 1023) / 1024 * 1024;
  // Each region on a page boundary (Note [AMX buffers on page boundaries]); the
  // scratch has a page of slack for each (attention_amx_backward_scratch_floats).
  float *dQt = attn_page(scratch), *packs = attn_page(dQt + Dq * rp), *St = attn_page(packs + s.row_tiles * pack),
        *dPt = attn_page(St + K * R), *dKa = attn_page(dPt + K * R), *dVa = attn_page(dKa + K * Dq);
  uint16_t* Pt = reinterpret_cast<uint16_t*>(attn_page(dVa + K * Dq));
  uint16_t* dSt = reinterpret_cast<uint16_t*>(attn_page(Pt + K * 64));
  uint16_t* dSv = reinterpret_cast<uint16_t*>(attn_page(dSt + K * 64));
  uint16_t* rowbuf = reinterpret_cast<uint16_t*>(attn_page(dSv + K * R));
  float *L = attn_page(rowbuf + R * Dq), *Delta = L + rp, *lim = Delta + rp, *tmp = lim + rp;
  static thread_local AmxBwdKv kv;
  if (int64_t(kv.k.size()) < Lkp * Dq)
    kv.k.resize(size_t(Lkp * Dq)), kv.v.resize(size_t(Lkp * Dq)), kv.kt.resize(size_t(Lkp * Dq));
  if (int64_t(kv.tile.size()) < K * Dq) kv.tile.resize(size_t(K * Dq));
  const float ninf = -__builtin_inff();
  const vf scale = splat<vf>(s.scale);
  AmxTileScope tiles;
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t b = it / s.Hkv, kvh = it % s.Hkv;
    amx_pack_key_rows(s, k.data, b, kvh, Lkp, Dq, kv.k.data());
    amx_pack_key_rows(s, v.data, b, kvh, Lkp, Dq, kv.v.data());
    amx_pack_key_cols(s, k.data, b, kvh, Lkp, Dq, kv.kt.data(), kv.tile.data());
    // every row tile's Q and dO (both layouts), lse, Delta and limits, once
    for (int64_t t = 0; t < s.row_tiles; ++t) {
      const int64_t r0 = t * R, nr = min64(R, s.rows - r0);
      uint16_t* pk = reinterpret_cast<uint16_t*>(packs + t * pack);
      uint16_t *qv = pk, *dov = qv + R * Dq, *qr = dov + R * Dq, *dor = qr + 64 * Dq;
      for (int src = 0; src < 2; ++src) {
        amx_pack_row_tile(s, src ? dout.data : q.data, b, kvh, r0, nr, Dq, rowbuf);
        amx_pack_dims(rowbuf, Dq, src ? dov : qv);
        amx_pack_row_pairs(rowbuf, Dq, src ? dor : qr);
      }
      for (int64_t r = 0; r < R; ++r) {
        if (r >= nr) {
          L[r0 + r] = 0, Delta[r0 + r] = 0, lim[r0 + r] = ninf;
          continue;
        }
        ld<DType::BFloat16>(o.data, s.row_offset(b, kvh, r0 + r), s.Dm, tmp);
        ld<DType::BFloat16>(dout.data, s.row_offset(b, kvh, r0 + r), s.Dm, tmp + Dq);
        float dsum = 0;
        for (int64_t d = 0; d < s.Dm; ++d) dsum += tmp[d] * tmp[Dq + d];
        Delta[r0 + r] = dsum;
        attn_grad_row_lse(s, lse, b, kvh, r0 + r, L[r0 + r], lim[r0 + r]);
      }
    }
    zero_f(dQt, Dq * rp);
    for (int64_t j0 = 0; j0 < s.Lk; j0 += K) {
      const int64_t nk = min64(K, s.Lk - j0);
      zero_f(dKa, 2 * K * Dq);  // dK and dV
      for (int64_t r0 = s.first_row(j0) / R * R; r0 < s.rows; r0 += R) {
        const int64_t nr = min64(R, s.rows - r0), ne = min64(nk, s.key_end(r0 + nr) - j0);
        if (ne <= 0) continue;
        const int64_t Np = attn_pad(nr), QT = Np / 16, ne32 = (ne + 31) / 32 * 32, steps = (Np + 31) / 32;
        const uint16_t* pk = reinterpret_cast<const uint16_t*>(packs + (r0 / R) * pack);
        const uint16_t *qv = pk, *dov = qv + R * Dq, *qr = dov + R * Dq, *dor = qr + 64 * Dq;
        amx_keys_x_rows(kv.k.data() + j0 * Dq, qv, St, ne32, QT, Dq);    // S^T = K Q^T
        amx_keys_x_rows(kv.v.data() + j0 * Dq, dov, dPt, ne32, QT, Dq);  // dP^T = V dO^T
        if (Np < 64)
          for (int64_t j = 0; j < ne32; ++j) {
            std::memset(Pt + j * 64 + Np, 0, size_t(64 - Np) * 2);
            std::memset(dSt + j * 64 + Np, 0, size_t(64 - Np) * 2);
          }
        for (int64_t g = 0; g < Np; g += kVW) {
          const vf lr = vload(L + r0 + g), dr = vload(Delta + r0 + g), lm = vload(lim + r0 + g);
          // keys past ne (the last 32-key step's padding) get zero rows
          auto grads = [&](int64_t j, vf& p, vf& ds) {
            p = vf{}, ds = vf{};
            if (j < ne) {
              p = masked_exp(vload(St + j * R + g) * scale - lr, splat<vf>(float(j0 + j)), lm);
              ds = p * (vload(dPt + j * R + g) - dr) * scale;
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(Pt + j * 64 + g), (__m256i)_mm512_cvtneps_pbh((__m512)p));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dSt + j * 64 + g), (__m256i)_mm512_cvtneps_pbh((__m512)ds));
          };
          for (int64_t j = 0; j < ne32; j += 2) {
            vf p0, ds0, p1, ds1;
            grads(j, p0, ds0);
            grads(j + 1, p1, ds1);
            _mm512_storeu_si512(dSv + (j / 2) * 2 * R + 2 * g, amx_key_pair(ds0, ds1));
          }
        }
        const int64_t n16 = (ne + 15) / 16 * 16;
        amx_keys_x_dims(Pt, dor, dVa, n16, steps, Dq);   // dV += P^T dO
        amx_keys_x_dims(dSt, qr, dKa, n16, steps, Dq);   // dK += dS^T Q
        amx_dims_x_rows(kv.kt.data() + j0, Lkp, dSv, dQt + r0, rp, ne32 / 32, QT, Dq);  // dQ^T += K^T dS^T
      }
      const int64_t base = ((b * s.Hkv + kvh) * s.Lk + j0) * s.Dm;
      for (int64_t j = 0; j < nk; ++j) {
        st<DType::BFloat16>(dKa + j * Dq, dk.data, base + j * s.Dm, s.Dm);
        st<DType::BFloat16>(dVa + j * Dq, dv.data, base + j * s.Dm, s.Dm);
      }
    }
    float* rows16 = St;  // [16][Dq], over S^T and dP^T
    for (int64_t r = 0; r < s.rows; r += 16) {
      for (int64_t d = 0; d < Dq; d += 16) transpose16x16(dQt + d * rp + r, rp, rows16 + d, Dq);
      for (int64_t x = 0; x < 16 && r + x < s.rows; ++x)
        st<DType::BFloat16>(rows16 + x * Dq, dq.data, s.row_offset(b, kvh, r + x), s.Dm);
    }
  }
}
#endif

template <DType D>
int attention_backward_k(const to_op_call& c, int64_t i0, int64_t i1, float* scratch) {
  const AttnShape s(c.inputs[1], c.inputs[2], c);
  scratch = attn_page(scratch);  // Note [AMX buffers on page boundaries]: every path's scratch from a page
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (D == DType::BFloat16 && c.ints[6] == 3) {
    attention_backward_amx(c, s, i0, i1, scratch);
    return 0;
  }
#endif
  if (c.ints[6] == 0)
    attention_backward_kv<D>(c, s, i0, i1, scratch);
  else if (c.ints[6] == 1)
    attention_backward_q<D>(c, s, i0, i1, scratch);
  else
    attention_backward_fused<D>(c, s, i0, i1, scratch);
  return 0;
}
