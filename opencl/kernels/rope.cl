// Rotary embedding on x [B, S, H, D] (contiguous) with cos / sin tables
// [P, half] and positions [B or 1, S] (int32 or int64). Dimension 1 is the
// (b, s, h) row; dimension 0 item j < half rotates pair j (NeoX: j and
// j + half; GPT-J interleaved: 2j and 2j + 1), j >= half copies the
// unrotated element 2 half + (j - half). inverse rotates by -angle. Each
// item reads its elements before writing them: y may be x. A position
// outside [0, P) sets *bad = 1 (the host reports it).
__kernel void rope(const __global T* x, ulong x_off, const __global T* cs, ulong cs_off, const __global T* sn,
                   ulong sn_off, const __global int* pos, ulong pos_off, int pos64, ulong pos_batch_stride,
                   __global T* y, ulong y_off, ulong S, ulong H, ulong D, ulong half_dim, ulong P, int interleaved,
                   int inverse, __global int* bad) {
  const ulong j = get_global_id(0), row = get_global_id(1);
  if (j >= D - half_dim) return;
  const ulong bs = row / H, b = bs / S, s = bs % S;
  const ulong base = row * D;
  if (j >= half_dim) {
    const ulong e = 2 * half_dim + (j - half_dim);
    store_f32(y, y_off + base + e, load_f32(x, x_off + base + e));
    return;
  }
  const long p = index_at(pos, pos64, pos_off + b * pos_batch_stride + s);
  if (p < 0 || p >= (long)P) {
    *bad = 1;
    return;
  }
  const float co = load_f32(cs, cs_off + (ulong)p * half_dim + j);
  const float si = (inverse ? -1.0f : 1.0f) * load_f32(sn, sn_off + (ulong)p * half_dim + j);
  const ulong a = interleaved ? 2 * j : j, bb = interleaved ? 2 * j + 1 : j + half_dim;
  const float x1 = load_f32(x, x_off + base + a), x2 = load_f32(x, x_off + base + bb);
  store_f32(y, y_off + base + a, x1 * co - x2 * si);
  store_f32(y, y_off + base + bb, x2 * co + x1 * si);
}
