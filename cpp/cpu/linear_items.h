#pragma once
// How the CPU linear (linear_rows.h, linear_kn.h) splits its work, shared
// with the dispatcher (cpu_backend.cpp): items are blocks of rows of w, or
// of columns of a [K, N] w.
#include <cstdint>

namespace tensor_ops::cpu {

// Rows of w per item: about 32 KiB of them (several rows of x read the block
// from cache), a multiple of 8, 8 to 256. A function of K and the dtype
// only, never of the thread count (Note [linear rows]).
inline int64_t linear_rows_per_item(int64_t K, int64_t item_bytes) {
  const int64_t row = K * item_bytes > 0 ? K * item_bytes : 1;
  const int64_t rows = (int64_t(32) << 10) / row / 8 * 8;
  return rows < 8 ? 8 : (rows > 256 ? 256 : rows);
}

// Columns of a [K, N] w (weight_layout kn, linear_kn.h) per item: 64, a
// multiple of every ISA's widest tile of one row of x but for AVX-512's
// fp32 (half of it). A constant, never a function of the thread count (Note
// [linear kn]); N = 768 (GPT-2's projections) still gives 12 items.
constexpr int64_t kLinearKnColsPerItem = 64;

}  // namespace tensor_ops::cpu
