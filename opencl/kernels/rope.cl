// Rotary embedding on x [B, S, H, D] (contiguous) with cos / sin tables
// [P, half] and positions [B or 1, S] (int32 or int64). Dimension 1 is the
// (b, s, h) row; index j < half rotates pair j (NeoX: j and
// j + half; GPT-J interleaved: 2j and 2j + 1), j >= half copies the
// unrotated element 2 half + (j - half). inverse rotates by -angle. Each
// item reads its elements before writing them: y may be x. A position
// outside [0, P) sets *bad = 1 (the host reports it).
__kernel void rope(const __global T* x, ulong x_off, const __global T* cs, ulong cs_off, const __global T* sn,
                   ulong sn_off, const __global int* pos, ulong pos_off, int pos64, ulong pos_batch_stride,
                   __global T* y, ulong y_off, ulong S, ulong H, ulong D, ulong half_dim, ulong P, int interleaved,
                   int inverse, __global int* bad, ulong rows) {
  const ulong row = get_global_id(1);
  if (row >= rows) return;
  const ulong bs = row / H, b = bs / S, s = bs % S;
  const ulong base = row * D;
  const long p = index_at(pos, pos64, pos_off + b * pos_batch_stride + s);
  const bool ok = p >= 0 && p < (long)P;
  if (!ok && get_global_id(0) < half_dim) *bad = 1;
  // Dimension 0 may be narrower than D - half (a CPU device takes a row per
  // work-item): each item strides over the row.
  for (ulong j = get_global_id(0); j < D - half_dim; j += get_global_size(0)) {
    if (j >= half_dim) {
      const ulong e = 2 * half_dim + (j - half_dim);
      store_f32(y, y_off + base + e, load_f32(x, x_off + base + e));
      continue;
    }
    if (!ok) continue;
    const float co = load_f32(cs, cs_off + (ulong)p * half_dim + j);
    const float si = (inverse ? -1.0f : 1.0f) * load_f32(sn, sn_off + (ulong)p * half_dim + j);
    const ulong a = interleaved ? 2 * j : j, bb = interleaved ? 2 * j + 1 : j + half_dim;
    const float x1 = load_f32(x, x_off + base + a), x2 = load_f32(x, x_off + base + bb);
    store_f32(y, y_off + base + a, x1 * co - x2 * si);
    store_f32(y, y_off + base + bb, x2 * co + x1 * si);
  }
}
