// Storage type T and its fp32 loads / stores, one element or eight. The host
// compiles the program once per dtype with -DTO_DTYPE_F32, -DTO_DTYPE_F16 or
// -DTO_DTYPE_BF16; all math is fp32. Indices are element indices (the host
// passes byte offsets divided by the element size); vector loads need only
// element alignment, so any offset works.
#if defined(TO_DTYPE_F32)
typedef float T;
inline float load_f32(const __global T* p, ulong i) { return p[i]; }
inline float8 load8_f32(const __global T* p, ulong i) { return vload8(0, p + i); }
inline void store_f32(__global T* p, ulong i, float v) { p[i] = v; }
inline void store8_f32(__global T* p, ulong i, float8 v) { vstore8(v, 0, p + i); }
#elif defined(TO_DTYPE_F16)
// half as storage only: vload_half / vstore_half are core OpenCL C and need
// no cl_khr_fp16 (PoCL's CPU device has none).
typedef half T;
inline float load_f32(const __global T* p, ulong i) { return vload_half(i, p); }
inline float8 load8_f32(const __global T* p, ulong i) { return vload_half8(0, p + i); }
inline void store_f32(__global T* p, ulong i, float v) { vstore_half_rte(v, i, p); }
inline void store8_f32(__global T* p, ulong i, float8 v) { vstore_half8_rte(v, 0, p + i); }
#elif defined(TO_DTYPE_BF16)
// bfloat16 as its bits, the upper half of a float. Stores round to nearest
// even and keep NaN a (quiet) NaN instead of rounding it to infinity.
typedef ushort T;
inline float load_f32(const __global T* p, ulong i) { return as_float((uint)p[i] << 16); }
inline float8 load8_f32(const __global T* p, ulong i) { return as_float8(convert_uint8(vload8(0, p + i)) << 16); }
inline void store_f32(__global T* p, ulong i, float v) {
  const uint u = as_uint(v);
  const uint rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  p[i] = (ushort)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}
inline void store8_f32(__global T* p, ulong i, float8 v) {
  const uint8 u = as_uint8(v);
  const uint8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint8 nan = (u >> 16) | 0x40u;
  vstore8(convert_ushort8(select(rounded, nan, (u & 0x7fffffffu) > 0x7f800000u)), 0, p + i);
}
#else
#error "compile with -DTO_DTYPE_F32, -DTO_DTYPE_F16 or -DTO_DTYPE_BF16"
#endif
