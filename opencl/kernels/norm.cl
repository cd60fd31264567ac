// RMSNorm: y = x / sqrt(mean(x^2) + eps) * (offset + w) over each row, in
// fp32 (offset: Gemma's 1; the host passes -0.0f for none, and w + -0.0f is
// w bit for bit, a -0.0 weight included).
// One work-group per row. Each work-item sums the squares of its 8-element
// chunks (chunk k at 8k, strided by the group size so a GPU's loads
// coalesce) and of the tail past the last whole chunk; then a tree reduction
// in local memory (the host launches a power-of-two group and gives
// `partial` that many floats). Every work-item reads its elements again
// after the barrier, so y may be x.
__kernel void rms_norm(const __global T* x, ulong x_off, ulong x_stride, const __global T* w, ulong w_off,
                       __global T* y, ulong y_off, ulong y_stride, ulong cols, float eps,
                       float offset, __local float* partial) {
  const ulong row = get_group_id(0);
  const uint lid = get_local_id(0);
  const uint size = get_local_size(0);
  const ulong xr = x_off + row * x_stride;
  const ulong yr = y_off + row * y_stride;
  const ulong chunks = cols / 8;
  float8 acc = 0.0f;
  for (ulong k = lid; k < chunks; k += size) {
    const float8 v = load8_f32(x, xr + 8 * k);
    acc += v * v;
  }
  float sum = ((acc.s0 + acc.s1) + (acc.s2 + acc.s3)) + ((acc.s4 + acc.s5) + (acc.s6 + acc.s7));
  for (ulong c = 8 * chunks + lid; c < cols; c += size) {
    const float v = load_f32(x, xr + c);
    sum += v * v;
  }
  partial[lid] = sum;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint half_size = size >> 1; half_size > 0; half_size >>= 1) {
    if (lid < half_size) partial[lid] += partial[lid + half_size];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float scale = 1.0f / sqrt(partial[0] / (float)cols + eps);
  for (ulong k = lid; k < chunks; k += size)
    store8_f32(y, yr + 8 * k, load8_f32(x, xr + 8 * k) * scale * (load8_f32(w, w_off + 8 * k) + offset));
  for (ulong c = 8 * chunks + lid; c < cols; c += size)
    store_f32(y, yr + c, load_f32(x, xr + c) * scale * (load_f32(w, w_off + c) + offset));
}
