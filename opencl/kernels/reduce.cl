// Work-group reductions and partial 8-element loads / stores for the
// row-wise kernels. A row belongs to one work-group of a power-of-two size
// (1 on CPU devices, 256 on GPUs: Program::row_group); work-item `lid` takes
// the 8-element chunks lid, lid + size, ... so a GPU's loads coalesce.
// Every work-item of the group must call a reduction (they hold barriers);
// all of them get the result. `red` has get_local_size(0) floats.

inline float group_sum(float v, __local float* red) {
  const uint lid = get_local_id(0), size = get_local_size(0);
  if (size == 1) return v;
  barrier(CLK_LOCAL_MEM_FENCE);  // red may still be read by an earlier reduction
  red[lid] = v;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint h = size >> 1; h > 0; h >>= 1) {
    if (lid < h) red[lid] += red[lid + h];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  return red[0];
}

inline float group_max(float v, __local float* red) {
  const uint lid = get_local_id(0), size = get_local_size(0);
  if (size == 1) return v;
  barrier(CLK_LOCAL_MEM_FENCE);
  red[lid] = v;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint h = size >> 1; h > 0; h >>= 1) {
    if (lid < h) red[lid] = fmax(red[lid], red[lid + h]);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  return red[0];
}

inline float hsum8(float8 a) { return ((a.s0 + a.s1) + (a.s2 + a.s3)) + ((a.s4 + a.s5) + (a.s6 + a.s7)); }
inline float hmax8(float8 a) {
  const float4 m4 = fmax(a.lo, a.hi);
  const float2 m2 = fmax(m4.lo, m4.hi);
  return fmax(m2.lo, m2.hi);
}

// Elements [i, i + n) (n <= 8, fewer only at a row's end) as a float8;
// lanes past n hold `fill`.
inline float8 load8n(const __global T* p, ulong i, ulong n, float fill) {
  if (n >= 8) return load8_f32(p, i);
  float t[8];
  for (uint j = 0; j < 8; ++j) t[j] = j < n ? load_f32(p, i + j) : fill;
  return vload8(0, t);
}

inline void store8n(__global T* p, ulong i, float8 v, ulong n) {
  if (n >= 8) {
    store8_f32(p, i, v);
    return;
  }
  float t[8];
  vstore8(v, 0, t);
  for (uint j = 0; j < n; ++j) store_f32(p, i + j, t[j]);
}

// Lanes j with j < lim (lim clamped to [0, 8]).
inline int8 lanes_below(long lim) {
  const int l = (int)clamp(lim, 0L, 8L);
  return (int8)(0, 1, 2, 3, 4, 5, 6, 7) < (int8)(l);
}

// The chunk loop of a work-item over a row of `cols`: c is the chunk's first
// column, n its length.
#define TO_ROW_CHUNKS(cols)                                                         \
  for (ulong k_ = get_local_id(0), c = 8 * k_, n = min((cols) - c, (ulong)8);      \
       c < (cols); k_ += get_local_size(0), c = 8 * k_, n = min((cols) - c, (ulong)8))

// int32 or int64 indices (positions, targets) by a flag.
inline long index_at(const __global int* p, int is64, ulong i) {
  return is64 ? ((const __global long*)p)[i] : (long)p[i];
}
