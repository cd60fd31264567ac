// Attention with grouped-query heads, q [B, Hq, Lq, D], k / v [B, Hkv, Lk, D]
// (contiguous), flash style: scores never reach global memory. causal 1 is
// bottom-right aligned (query i sees keys j < i + Lk - Lq + 1), 2 top-left
// (j < i + 1).
//
// Forward: a work-group per query row (b, h, i); keys in blocks of the group
// size G, item t scoring key j0 + t; online softmax (running max m and sum
// l, the output accumulator rescaled when m grows) with the accumulator in
// local memory, dimension d owned by item d % G. Writes out and
// lse = m + log(l) (-inf for a row that sees no key, its out 0).

inline long causal_offset(ulong Lq, ulong Lk, int causal) { return causal == 2 ? 0L : (long)Lk - (long)Lq; }

inline ulong causal_keys(ulong i, ulong Lq, ulong Lk, int causal) {
  if (!causal) return Lk;
  return (ulong)clamp((long)i + causal_offset(Lq, Lk, causal) + 1, 0L, (long)Lk);
}

inline float dot_local_global(const __local float* a, const __global T* b, ulong b0, ulong D) {
  float8 acc = 0.0f;
  ulong d = 0;
  for (; d + 8 <= D; d += 8) acc += vload8(0, a + d) * load8_f32(b, b0 + d);
  float s = hsum8(acc);
  for (; d < D; ++d) s += a[d] * load_f32(b, b0 + d);
  return s;
}

inline float dot_global(const __global T* a, ulong a0, const __global T* b, ulong b0, ulong D) {
  float8 acc = 0.0f;
  ulong d = 0;
  for (; d + 8 <= D; d += 8) acc += load8_f32(a, a0 + d) * load8_f32(b, b0 + d);
  float s = hsum8(acc);
  for (; d < D; ++d) s += load_f32(a, a0 + d) * load_f32(b, b0 + d);
  return s;
}

// local: qs[D], acc[D], p[G], red[G]
__kernel void attention_fwd(const __global T* q, ulong q_off, const __global T* k, ulong k_off, const __global T* v,
                            ulong v_off, __global T* o, ulong o_off, __global float* lse, ulong lse_off, ulong Hq,
                            ulong Hkv, ulong Lq, ulong Lk, ulong D, float scale, int causal, __local float* qs,
                            __local float* acc, __local float* p, __local float* red) {
  const ulong row = get_group_id(0);  // (b * Hq + h) * Lq + i
  const uint lid = get_local_id(0), G = get_local_size(0);
  const ulong i = row % Lq, bh = row / Lq, b = bh / Hq, h = bh % Hq;
  const ulong kvh = h / (Hq / Hkv);
  const ulong kbase = (b * Hkv + kvh) * Lk * D;
  const ulong nk = causal_keys(i, Lq, Lk, causal);
  for (ulong d = lid; d < D; d += G) {
    qs[d] = load_f32(q, q_off + row * D + d) * scale;
    acc[d] = 0.0f;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  float m = -INFINITY, l = 0.0f;
  for (ulong j0 = 0; j0 < nk; j0 += G) {
    const ulong j = j0 + lid, nb = min((ulong)G, nk - j0);
    const float s = j < nk ? dot_local_global(qs, k, k_off + kbase + j * D, D) : -INFINITY;
    const float mn = fmax(m, group_max(s, red));
    const float corr = m == -INFINITY ? 0.0f : exp(m - mn);
    const float pj = j < nk ? exp(s - mn) : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);  // the previous block's p is read
    p[lid] = pj;
    l = l * corr + group_sum(pj, red);  // its barriers publish p
    if (G == 1) barrier(CLK_LOCAL_MEM_FENCE);
    for (ulong d = lid; d < D; d += G) {
      float a = acc[d] * corr;
      const ulong v0 = v_off + kbase + j0 * D + d;
      for (ulong t = 0; t < nb; ++t) a += p[t] * load_f32(v, v0 + t * D);
      acc[d] = a;
    }
    m = mn;
  }
  const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // NaN (a NaN in q or k) stays NaN
  for (ulong d = lid; d < D; d += G) store_f32(o, o_off + row * D + d, acc[d] * inv);
  if (lid == 0) lse[lse_off + row] = l != 0.0f ? m + log(l) : -INFINITY;
}

// Backward. delta[row] = dot(dout_row, out_row) (one item per query row).
__kernel void attention_bwd_delta(const __global T* dout, ulong do_off, const __global T* o, ulong o_off,
                                  __global float* delta, ulong rows, ulong D) {
  const ulong row = get_global_id(0);
  if (row < rows) delta[row] = dot_global(dout, do_off + row * D, o, o_off + row * D, D);
}

// p = exp(scale q.k - lse), ds = p (dout.v - delta) scale.
// dq: a work-group per query row, keys in blocks of G (as the forward);
// dq[d] = sum_j ds_j k_j[d], dimension d owned by item d % G.
// local: qs[D] (q), gs[D] (dout), acc[D], ds[G]
__kernel void attention_bwd_dq(const __global T* dout, ulong do_off, const __global T* q, ulong q_off,
                               const __global T* k, ulong k_off, const __global T* v, ulong v_off,
                               const __global float* lse, ulong lse_off, const __global float* delta,
                               __global T* dq, ulong dq_off, ulong Hq, ulong Hkv, ulong Lq, ulong Lk, ulong D,
                               float scale, int causal, __local float* qs, __local float* gs, __local float* acc,
                               __local float* ds) {
  const ulong row = get_group_id(0);
  const uint lid = get_local_id(0), G = get_local_size(0);
  const ulong i = row % Lq, bh = row / Lq, b = bh / Hq, h = bh % Hq;
  const ulong kbase = (b * Hkv + h / (Hq / Hkv)) * Lk * D;
  const float L = lse[lse_off + row], Di = delta[row];
  const ulong nk = L == -INFINITY ? 0 : causal_keys(i, Lq, Lk, causal);
  for (ulong d = lid; d < D; d += G) {
    qs[d] = load_f32(q, q_off + row * D + d);
    gs[d] = load_f32(dout, do_off + row * D + d);
    acc[d] = 0.0f;
  }
  for (ulong j0 = 0; j0 < nk; j0 += G) {
    const ulong j = j0 + lid, nb = min((ulong)G, nk - j0);
    barrier(CLK_LOCAL_MEM_FENCE);  // qs, gs written; the previous block's ds read
    float dsj = 0.0f;
    if (j < nk) {
      const float pj = exp(scale * dot_local_global(qs, k, k_off + kbase + j * D, D) - L);
      dsj = pj * (dot_local_global(gs, v, v_off + kbase + j * D, D) - Di) * scale;
    }
    ds[lid] = dsj;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (ulong d = lid; d < D; d += G) {
      float a = acc[d];
      const ulong k0 = k_off + kbase + j0 * D + d;
      for (ulong t = 0; t < nb; ++t) a += ds[t] * load_f32(k, k0 + t * D);
      acc[d] = a;
    }
  }
  for (ulong d = lid; d < D; d += G) store_f32(dq, dq_off + row * D + d, acc[d]);
}

// dk, dv: a work-group per key row (b, kvh, j); the (head, query) pairs of
// its query heads that see key j in blocks of G, item t taking one pair;
// dv[d] = sum p dout[d], dk[d] = sum ds q[d]. No atomics: each group owns
// its key row.
// local: ks[D], vs[D], acck[D], accv[D], pp[G], ds[G]
__kernel void attention_bwd_dkdv(const __global T* dout, ulong do_off, const __global T* q, ulong q_off,
                                 const __global T* k, ulong k_off, const __global T* v, ulong v_off,
                                 const __global float* lse, ulong lse_off, const __global float* delta,
                                 __global T* dk, ulong dk_off, __global T* dv, ulong dv_off, ulong Hq, ulong Hkv,
                                 ulong Lq, ulong Lk, ulong D, float scale, int causal, __local float* ks,
                                 __local float* vs, __local float* acck, __local float* accv, __local float* pp,
                                 __local float* ds) {
  const ulong krow = get_group_id(0);  // (b * Hkv + kvh) * Lk + j
  const uint lid = get_local_id(0), G = get_local_size(0);
  const ulong j = krow % Lk, bk = krow / Lk, b = bk / Hkv, kvh = bk % Hkv;
  const ulong group = Hq / Hkv;
  // Queries i >= j - offset see key j under the causal mask.
  const ulong i0 = causal ? (ulong)clamp((long)j - causal_offset(Lq, Lk, causal), 0L, (long)Lq) : 0;
  const ulong per_head = Lq - i0, pairs = group * per_head;
  for (ulong d = lid; d < D; d += G) {
    ks[d] = load_f32(k, k_off + krow * D + d);
    vs[d] = load_f32(v, v_off + krow * D + d);
    acck[d] = 0.0f;
    accv[d] = 0.0f;
  }
  const ulong qrow0 = (b * Hq + kvh * group) * Lq;  // first query row of the group's first head
  for (ulong t0 = 0; t0 < pairs; t0 += G) {
    const ulong t = t0 + lid, nb = min((ulong)G, pairs - t0);
    barrier(CLK_LOCAL_MEM_FENCE);
    float pt = 0.0f, dst = 0.0f;
    if (t < pairs) {
      const ulong row = qrow0 + (t / per_head) * Lq + i0 + t % per_head;
      const float L = lse[lse_off + row];
      if (L != -INFINITY) {
        pt = exp(scale * dot_local_global(ks, q, q_off + row * D, D) - L);
        dst = pt * (dot_local_global(vs, dout, do_off + row * D, D) - delta[row]) * scale;
      }
    }
    pp[lid] = pt;
    ds[lid] = dst;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (ulong d = lid; d < D; d += G) {
      float ak = acck[d], av = accv[d];
      for (ulong u = 0; u < nb; ++u) {
        const ulong tu = t0 + u;
        const ulong row = qrow0 + (tu / per_head) * Lq + i0 + tu % per_head;
        ak += ds[u] * load_f32(q, q_off + row * D + d);
        av += pp[u] * load_f32(dout, do_off + row * D + d);
      }
      acck[d] = ak;
      accv[d] = av;
    }
  }
  for (ulong d = lid; d < D; d += G) {
    store_f32(dk, dk_off + krow * D + d, acck[d]);
    store_f32(dv, dv_off + krow * D + d, accv[d]);
  }
}
