#pragma once
// Tile sizes of the CPU flash attention (attention_flash.h), shared with the
// dispatcher (cpu_backend.cpp), which splits the work into tiles and sizes
// each chunk's scratch from them.
#include <cstdint>

namespace tensor_ops::cpu {

constexpr int64_t kAttnRows = 48;   // query rows per tile (a multiple of 6 and 16)
constexpr int64_t kAttnKeys = 64;   // keys per tile (a multiple of 16)
constexpr int64_t kAttnLanes = 16;  // head_dim and tile columns are padded to a multiple of this
constexpr int64_t kAttnAmxKeys = 256;          // keys per block of the AMX forward (a multiple of 64)
constexpr int64_t kAttnAmxBackwardKeys = 128;  // and of its backward (a multiple of 64)

inline int64_t attn_pad(int64_t n) { return (n + kAttnLanes - 1) / kAttnLanes * kAttnLanes; }
// head_dim as the AMX kernels pad it: whole 32-element (64-byte) tile rows
inline int64_t amx_dq(int64_t head_dim) { return (head_dim + 31) / 32 * 32; }

// Scratch floats per chunk: forward, and the larger of the backward's two phases.
// The forward's is the larger of the fp32 tile's (attention_tile_keys) and
// the AMX tile's (attention_amx_rows: head_dim padded to 32, bf16 buffers).
inline int64_t attention_scratch_floats(int64_t head_dim) {
  const int64_t Dp = attn_pad(head_dim), R = kAttnRows, K = kAttnKeys, Dq = amx_dq(head_dim);
  // amx: its regions each start on a page (attention_amx_rows): up to a page of slack before each of six
  // + a page of slack: attention_k starts its regions on a page
  const int64_t fp32 = 2 * R * Dp + 2 * K * Dp + R * K + 4 * R + 1024,
                amx = 4 * R + 2 * Dq * R + kAttnAmxKeys * R * 3 / 2 + 6 * 1024;
  return fp32 > amx ? fp32 : amx;
}
inline int64_t attention_backward_scratch_floats(int64_t head_dim) {
  const int64_t Dp = attn_pad(head_dim), R = kAttnRows, K = kAttnKeys;
  const int64_t phase0 = 4 * K * Dp + 4 * R * Dp + 2 * K * R + 3 * R + Dp;
  const int64_t phase1 = 3 * R * Dp + 3 * Dp * K + 2 * R * K + 3 * R + Dp;
  return (phase0 > phase1 ? phase0 : phase1) + 1024;  // + a page of slack (attention_backward_k)
}
// The fused backward (one item per batch and kv head): dQ, Q^T and dO^T for
// all `rows` packed rows of the item, plus one key tile's and one row tile's
// buffers.
inline int64_t attention_fused_backward_scratch_floats(int64_t rows, int64_t head_dim) {
  const int64_t Dp = attn_pad(head_dim), R = kAttnRows, K = kAttnKeys, rp = (rows + R - 1) / R * R;
  return 3 * rp * Dp + 3 * rp + 5 * K * Dp + 2 * R * K + 2 * R * Dp + Dp + 1024;  // + a page (attention_backward_k)
}

// The amx level's bf16 backward (attention_backward_amx): dQ^T, lse, Delta
// and limits for all rows, each row tile's Q and dO packed two ways, one key
// block's S^T, dP^T, dK and dV in fp32, its P^T and dS^T in bf16, a row tile
// of bf16 rows (head_dim padded to 32).
inline int64_t attention_amx_backward_scratch_floats(int64_t rows, int64_t head_dim) {
  const int64_t R = kAttnRows, K = kAttnAmxBackwardKeys, Dq = amx_dq(head_dim),
                tiles = (rows + R - 1) / R, rp = tiles * R;
  // + a page of slack before each of its 11 regions and at the end of each row tile's packs
  // (attention_backward_amx puts them on page boundaries)
  return Dq * rp + 3 * rp + tiles * (R + 64) * Dq + 2 * K * R + 2 * K * Dq + 2 * Dq +
         (2 * K * 64 + K * R + R * Dq) / 2 + 16 + (12 + tiles) * 1024;
}

}  // namespace tensor_ops::cpu
