#include "cpu_backend.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "../core/env.h"
#include "attention_tiles.h"
#include "isa.h"
#include "linear_items.h"
#include "tensor_ops/bad_index.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "thread_pool.h"

namespace tensor_ops::cpu {
namespace {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512bw = false, avx512vl = false,
       avx512dq = false, avx512_bf16 = false;
  bool amx_cpu = false;  // cpuid: AMX-TILE and AMX-BF16
  bool amx = false;      // and Linux granted this process the tile state
  std::string amx_reason;  // why amx is false
};

// AMX tiles need the kernel's permission per process (Linux 5.16+:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); without it the
// first tile instruction faults. Granted once, for every thread.
bool request_amx(std::string& reason) {
#if defined(__x86_64__) && defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0) return true;
  reason = std::string("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") + std::strerror(errno) +
           ")";
#else
  reason = "AMX needs Linux's arch_prctl(ARCH_REQ_XCOMP_PERM) on x86-64";
#endif
  return false;
}

CpuFeatures detect() {
  CpuFeatures f;
#ifdef TENSOR_OPS_CPU_X86
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  // CPUID.1:ECX.F16C: clang before 16 has no "f16c" for __builtin_cpu_supports.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  f.f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE
  f.amx_cpu = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 22 & 1) && (edx >> 24 & 1);
  if (!f.amx_cpu)
    f.amx_reason = "this CPU has no AMX-BF16 tiles";
  else if (!(f.avx512_bf16 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx2 && f.fma && f.f16c))
    f.amx_reason = "the amx level needs the avx512_bf16 level too";
  else
    f.amx = request_amx(f.amx_reason);
#else
  f.amx_reason = "not an x86-64 build";
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

std::vector<const IsaKernels*> supported_levels() {
  std::vector<const IsaKernels*> v{&kernels_baseline()};
#ifdef TENSOR_OPS_CPU_X86
  const CpuFeatures& f = features();
  if (f.avx2 && f.fma && f.f16c) v.push_back(&kernels_avx2());
  if (f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) {
    v.push_back(&kernels_avx512());
    if (f.avx512_bf16) v.push_back(&kernels_avx512_bf16());
    if (f.amx) v.push_back(&kernels_amx());
  }
#endif
  return v;
}

const IsaKernels* pick_level(const std::string& name) {
  static const char* known[] = {"baseline", "avx2", "avx512", "avx512_bf16", "amx"};
  if (std::find_if(std::begin(known), std::end(known), [&](const char* k) { return name == k; }) ==
      std::end(known))
    throw InvalidArgument("unknown CPU ISA level '" + name + "'; valid: baseline, avx2, avx512, avx512_bf16, amx, auto");
  for (const IsaKernels* k : supported_levels())
    if (name == k->name) return k;
  throw Unsupported("this CPU cannot run the '" + name + "' kernels (supported: " + [] {
    std::string s;
    for (const IsaKernels* k : supported_levels()) s += (s.empty() ? "" : ", ") + std::string(k->name);
    return s;
  }() + ")");
}

const IsaKernels* initial_level() {
  const char* env = std::getenv("TENSOR_OPS_CPU_ISA");
  const IsaKernels* best = supported_levels().back();
  if (env && *env && std::string(env) != "auto") {
    // A level above what the CPU has falls back to the best it has.
    try {
      return pick_level(env);
    } catch (const Error& e) {
      add_env_warning("TENSOR_OPS_CPU_ISA", env, std::string("is not usable (") + e.what() + ")",
                      std::string("'") + best->name + "' (the best level this CPU runs)");
    }
  }
  return best;
}

std::atomic<const IsaKernels*>& level() {
  static std::atomic<const IsaKernels*> l{initial_level()};
  return l;
}

thread_local std::string last_error_text;

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Outputs past half the last-level cache are written with streaming stores.
bool streaming(int64_t out_bytes) {
  const int64_t threshold = stream_threshold_bytes();
  return threshold > 0 && out_bytes >= threshold;
}

// Note [streaming stores and compute]
// A streaming store pays when the output's lines come quickly: row ops
// (norms, softmax) write a row's output in one light pass from cache. A
// single-pass elementwise op that computes a lot per output line (an
// activation, a gated unit or their backward on 16-bit data, where a line
// holds 32 elements; gelu in any dtype) writes a line only every few dozen
// cycles, and there streaming made it up to 2x slower. Measured, Xeon
// (AVX-512), [8192, 8192], 2 threads, ms with / without streaming stores:
// bf16 silu 41.1 / 21.6, gelu 44.0 / 22.2, swiglu 46.6 / 21.5, silu_backward
// 37.2 / 19.5; fp32 gelu (tanh) 43.4 / 27.0, gelu_backward 76.0 / 46.7; but
// fp32 swiglu 27.7 / 31.9, geglu 28.4 / 32.0, silu_backward 28.0 / 31.7,
// silu 23.8 / 25.2 and softmax 21.6 / 31.1 gain from it. So elementwise ops
// stream only for fp32 outputs: of a gated unit, or of silu (activation id 0).
bool elementwise_streams(OpId op, DType out, int64_t activation) {
  return out == DType::Float32 && (op == OpId::glu || activation == 0);
}

}  // namespace

int64_t stream_threshold_bytes() {
  static const int64_t threshold = [] {
    const int64_t fallback = int64_t(16) << 20;
    const char* env = std::getenv("TENSOR_OPS_STREAM_BYTES");
    if (!env || !*env) return fallback;
    long v = 0;
    if (parse_long(env, &v)) return int64_t(v);  // 0 or less: never stream
    add_env_warning("TENSOR_OPS_STREAM_BYTES", env, "is not a whole number of bytes", std::to_string(fallback));
    return fallback;
  }();
  return threshold;
}

namespace {

// Work per task: about 64 KiB of data, so small calls stay on one thread.
int64_t grain_for(int64_t bytes_per_item) { return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, bytes_per_item)); }

DType dt_of(const to_tensor& t) { return DType(t.dtype); }

to_status run_rms_norm(const to_op_call* c) {
  const to_tensor &x = c->inputs[0], &w = c->inputs[1], &y = c->outputs[0];
  const int64_t rows = x.shape[0], cols = x.shape[1];
  const IsaKernels* k = level().load();
  std::vector<float> wf(static_cast<size_t>(cols));
  k->to_float(dt_of(w), w.data, wf.data(), cols);
  // Gemma's offset + w, in fp32; a zero offset leaves w as it is (a -0.0 weight too).
  if (const float offset = float(c->scalars[1]); offset != 0)
    for (float& v : wf) v = offset + v;
  const float eps = float(c->scalars[0]);
  const int64_t item = int64_t(dtype_size(dt_of(x)));
  const bool nt = streaming(rows * cols * item);
  ThreadPool::instance().parallel_for(rows, grain_for(cols * item * 2), [&](int64_t r0, int64_t r1) {
    k->rms_norm(dt_of(x), x.data, x.strides[0], wf.data(), y.data, y.strides[0], r0, r1, cols, eps, nt);
  });
  return TO_OK;
}

// Elementwise ops: one flat span when both views are contiguous, else row by row.
template <class F>
to_status run_unary(const to_op_call* c, F span_fn) {
  const to_tensor &x = c->inputs[0], &y = c->outputs[0];
  const int64_t rows = x.shape[0], cols = x.shape[1];
  const int64_t item = int64_t(dtype_size(dt_of(x)));
  const auto* xb = static_cast<const char*>(x.data);
  auto* yb = static_cast<char*>(y.data);
  if ((rows == 1 || (x.strides[0] == cols && y.strides[0] == cols))) {
    const int64_t n = rows * cols;
    constexpr int64_t align = 64;  // chunk boundaries on whole cache lines
    const int64_t blocks = (n + align - 1) / align;
    ThreadPool::instance().parallel_for(blocks, grain_for(align * item * 2), [&](int64_t b0, int64_t b1) {
      const int64_t i0 = b0 * align, i1 = std::min(n, b1 * align);
      span_fn(xb + i0 * item, yb + i0 * item, i1 - i0);
    });
  } else {
    ThreadPool::instance().parallel_for(rows, grain_for(cols * item * 2), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        span_fn(xb + r * x.strides[0] * item, yb + r * y.strides[0] * item, cols);
    });
  }
  return TO_OK;
}

int64_t out_bytes(const to_tensor& t) { return t.shape[0] * t.shape[1] * int64_t(dtype_size(dt_of(t))); }

to_status run_silu(const to_op_call* c) {
  const IsaKernels* k = level().load();
  const DType dt = dt_of(c->inputs[0]);
  const bool nt = streaming(out_bytes(c->outputs[0])) && elementwise_streams(OpId::silu, dt, 0);
  return run_unary(c, [&](const void* x, void* y, int64_t n) { k->silu(dt, x, y, n, nt); });
}

to_status run_gelu(const to_op_call* c) {
  const IsaKernels* k = level().load();
  const DType dt = dt_of(c->inputs[0]);
  const int64_t mode = c->ints[0];
  const bool nt = streaming(out_bytes(c->outputs[0])) && elementwise_streams(OpId::gelu, dt, 1);
  return run_unary(c, [&](const void* x, void* y, int64_t n) { k->gelu(dt, x, y, n, mode, nt); });
}

// How an op's work splits: items, bytes touched per item (for the grain), fp32
// scratch per chunk.
struct Split {
  int64_t items, bytes_per_item, scratch;
};

bool all_flat(const to_op_call* c) {
  for (int i = 0; i < c->n_inputs; ++i)
    if (c->inputs[i].data && c->inputs[i].strides[0] != c->inputs[i].shape[1] && c->inputs[i].shape[0] > 1)
      return false;
  for (int i = 0; i < c->n_outputs; ++i)
    if (c->outputs[i].data && c->outputs[i].strides[0] != c->outputs[i].shape[1] && c->outputs[i].shape[0] > 1)
      return false;
  return true;
}

Split split_of(const to_op_call& c) {
  const to_tensor& x = c.inputs[0];
  const int64_t item = int64_t(dtype_size(dt_of(x)));
  const int64_t rows = x.shape[0], cols = x.ndim > 1 ? x.shape[1] : 1;
  const OpId op = OpId(c.op);
  switch (op) {
    case OpId::layer_norm: return {rows, cols * item * 2, 2 * cols};
    case OpId::rms_norm_backward:
    case OpId::layer_norm_backward: return {rows, cols * item * 3, 3 * cols};
    case OpId::add_rms_norm: return {rows, cols * item * 4, 2 * cols};
    case OpId::softmax:
    case OpId::cross_entropy: return {rows, cols * item * 2, cols};
    case OpId::softmax_backward: return {rows, cols * item * 3, 0};
    case OpId::activation_backward:
    case OpId::glu:
    case OpId::glu_backward:
      if (c.ints[3]) return {rows * cols, item * 5, 0};
      return {rows, cols * item * 5, 0};
    case OpId::rope: {
      const int64_t D = x.shape[3], half = c.inputs[1].shape[1];
      return {x.shape[0] * x.shape[1], x.shape[2] * D * item * 2, D + 2 * half};
    }
    // Attention items are tiles (attention_flash.h): packed query row tiles
    // per (batch, kv head), and for the backward's phase 0 (ints[6] == 0)
    // key tiles; each is worth a chunk of its own. The fused backward
    // (ints[6] == 2, and 3 on AMX tiles) takes whole (batch, kv head) items.
    case OpId::attention:
    case OpId::attention_backward: {
      const to_tensor& q = c.inputs[op == OpId::attention ? 0 : 1];
      const to_tensor& k = c.inputs[op == OpId::attention ? 1 : 2];
      const int64_t B = q.shape[0], Hkv = k.shape[1], rows = q.shape[1] / Hkv * q.shape[2], D = q.shape[3];
      if (op == OpId::attention_backward && c.ints[6] == 2)
        return {B * Hkv, int64_t(1) << 20, attention_fused_backward_scratch_floats(rows, D)};
      if (op == OpId::attention_backward && c.ints[6] == 3)
        return {B * Hkv, int64_t(1) << 20, attention_amx_backward_scratch_floats(rows, D)};
      const bool key_tiles = op == OpId::attention_backward && c.ints[6] == 0;
      const int64_t tiles = key_tiles ? (k.shape[2] + kAttnKeys - 1) / kAttnKeys : (rows + kAttnRows - 1) / kAttnRows;
      const int64_t scratch =
          op == OpId::attention ? attention_scratch_floats(D) : attention_backward_scratch_floats(D);
      return {B * Hkv * tiles, int64_t(1) << 20, scratch};
    }
    // Blocks of w's rows (Note [linear rows]); each group of four rows of x
    // reads a block again (from cache). 16-bit x is widened into the scratch.
    // A [K, N] w (ints[1]): blocks of its columns (Note [linear kn]), each
    // column tile's strip of w read again by each group of four rows of x.
    case OpId::linear: {
      const bool kn = c.ints[1] != 0;
      const int64_t N = c.inputs[1].shape[kn ? 1 : 0];
      const int64_t per = kn ? kLinearKnColsPerItem : linear_rows_per_item(cols, item);
      return {(N + per - 1) / per, per * std::max<int64_t>(cols, 1) * item * ((rows + 3) / 4),
              dt_of(x) == DType::Float32 ? 0 : rows * cols};
    }
    default: return {rows, cols * item, 0};
  }
}

to_status run_phase(const to_op_call& c, const IsaKernels* k);

// The attention backward runs fused (one (batch, kv head) item per chunk,
// five tile products) when those items keep the threads about as busy as the
// two phases' finer tiles do with their seven products, and the per-thread
// dQ / Q^T / dO^T scratch stays under 256 MiB in all; otherwise in two
// phases. Both give the same bits (attention_flash.h), so the choice, which
// depends on the thread count, never changes a result.
bool fused_attention_backward(const to_op_call& c) {
  const to_tensor &q = c.inputs[1], &k = c.inputs[2];
  const int64_t items = q.shape[0] * k.shape[1], threads = ThreadPool::instance().num_threads();
  if (items < threads) return false;
  const int64_t rows = q.shape[1] / k.shape[1] * q.shape[2];
  const int64_t bytes = threads * attention_fused_backward_scratch_floats(rows, q.shape[3]) * 4;
  return (items + threads - 1) / threads * threads * 5 <= items * 7 && bytes <= (int64_t(256) << 20);
}

// The amx level runs a bf16 backward on AMX tiles, fused (ints[6] == 3:
// Note [AMX attention backward], attention_flash.h) whatever the thread
// count, so the choice never changes a result; unless one item's scratch
// passes 64 MiB (rows x head_dim past ~4M), which leaves the fp32 kernels.
bool amx_attention_backward(const to_op_call& c, const IsaKernels* k) {
  const to_tensor &q = c.inputs[1], &kt = c.inputs[2];
  if (std::strcmp(k->name, "amx") != 0 || dt_of(q) != DType::BFloat16) return false;
  const int64_t rows = q.shape[1] / kt.shape[1] * q.shape[2];
  return attention_amx_backward_scratch_floats(rows, q.shape[3]) * 4 <= (int64_t(64) << 20);
}

// Runs an item kernel over the pool's threads. Each chunk gets its own
// scratch (ChunkScratch); the norm backward ops then sum the chunks' dweight
// (and dbias) partials and store them in the weight's dtype.
to_status run_items(const to_op_call* call) {
  to_op_call c = *call;
  const OpId op = OpId(c.op);
  if (op == OpId::activation_backward || op == OpId::glu || op == OpId::glu_backward) c.ints[3] = all_flat(&c);
  // Streaming stores for the ops whose kernels honour ints[7] (vmapx).
  const to_tensor& big = op == OpId::cross_entropy ? c.outputs[1] : c.outputs[0];
  const bool elementwise = op == OpId::glu || op == OpId::activation_backward;
  const bool row_op = op == OpId::add_rms_norm || op == OpId::softmax || op == OpId::layer_norm ||
                      op == OpId::softmax_backward || op == OpId::rms_norm_backward || op == OpId::layer_norm_backward;
  c.ints[7] = (row_op || elementwise ||
               (op == OpId::cross_entropy && c.ints[1])) &&
              big.data && streaming(big.shape[0] * big.shape[1] * int64_t(dtype_size(dt_of(big)))) &&
              (!elementwise || elementwise_streams(op, dt_of(big), c.ints[0]));
  const IsaKernels* k = level().load();
  if (op == OpId::attention_backward && amx_attention_backward(c, k)) {
    c.ints[6] = 3;
  } else if (op == OpId::attention_backward && fused_attention_backward(c)) {
    c.ints[6] = 2;
  } else if (op == OpId::attention_backward) {  // two phases: dK / dV per key tile, then dQ per row tile
    c.ints[6] = 0;
    if (to_status st = run_phase(c, k); st != TO_OK) return st;
    c.ints[6] = 1;
  }
  return run_phase(c, k);
}

// Every chunk's scratch for one call. The calling thread keeps the buffer
// (up to kKeptScratchBytes, 8 MiB) for its next calls, and it is not zeroed
// (Note [chunk scratch]) except for the attention backward, whose tile
// products were written against zeroed padding. A fresh zeroed 128 KiB per
// chunk was ~4 us per attention item, ~35 us of a 64-key decode call (as
// long as the rest of it), and ~15 us of a [32, 4096] layer_norm call. A call
// on the same thread while this one runs (none today) gets a buffer of its own.
//
// Note [chunk scratch]: a kernel writes each scratch element before it reads
// it (rows loaded or converted into it, accumulators zeroed by the kernel at
// the start of its chunk, as the norm backward's dweight / dbias partials).
class ChunkScratch {
 public:
  static constexpr size_t kKeptScratchBytes = size_t(8) << 20;
  ChunkScratch(size_t n, bool zeroed) {
    std::vector<float>& kept = kept_buffer();
    if (!in_use() && n * sizeof(float) <= kKeptScratchBytes) {
      in_use() = true;
      owner_ = true;
      if (kept.size() < n) kept.resize(n);
      p_ = kept.data();
    } else {
      own_.resize(n);
      p_ = own_.data();
    }
    if (zeroed && n) std::memset(p_, 0, n * sizeof(float));
  }
  ~ChunkScratch() {
    if (owner_) in_use() = false;
  }
  ChunkScratch(const ChunkScratch&) = delete;
  ChunkScratch& operator=(const ChunkScratch&) = delete;
  float* data() const { return p_; }
  float operator[](size_t i) const { return p_[i]; }

 private:
  static std::vector<float>& kept_buffer() {
    thread_local std::vector<float> b;
    return b;
  }
  static bool& in_use() {
    thread_local bool u = false;
    return u;
  }
  bool owner_ = false;
  float* p_ = nullptr;
  std::vector<float> own_;
};

to_status run_phase(const to_op_call& c, const IsaKernels* k) {
  const OpId op = OpId(c.op);
  const Split sp = split_of(c);
  ThreadPool& pool = ThreadPool::instance();
  const int64_t grain = grain_for(sp.bytes_per_item);
  // Over-decomposed (the pool hands chunks out dynamically); the count
  // depends on the thread count only, so per-chunk partial sums (norm
  // backward's dweight) reduce in the same order on every run.
  int64_t chunks = std::min<int64_t>(int64_t(pool.num_threads()) * ThreadPool::kChunksPerThread,
                                     std::max<int64_t>(1, sp.items / grain));
  // fused attention backward: equal items, one chunk (and scratch) per thread
  if (op == OpId::attention_backward && c.ints[6] >= 2) chunks = std::min<int64_t>(sp.items, pool.num_threads());
  if (sp.items == 0) chunks = 1;
  ChunkScratch scratch(size_t(chunks * sp.scratch), op == OpId::attention_backward && c.ints[6] != 3);
  std::atomic<int> bad{0};
  pool.parallel_for(chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t ci = b; ci < e; ++ci) {
      const int64_t i0 = sp.items * ci / chunks, i1 = sp.items * (ci + 1) / chunks;
      if (int r = k->ops[int(op)](c, i0, i1, scratch.data() + ci * sp.scratch)) bad = r;
    }
    if (c.ints[7]) stream_fence();  // on the thread that issued the streaming stores
  });
  if (bad == 1) {
    last_error_text = bad_position_message(c.inputs[1].shape[0]);
    return TO_ERR_INVALID_ARGUMENT;
  }
  if (bad == 2) {
    last_error_text = bad_target_message(c.inputs[0].shape[1], c.ints[0]);
    return TO_ERR_INVALID_ARGUMENT;
  }
  if (op == OpId::rms_norm_backward || op == OpId::layer_norm_backward) {
    const int64_t cols = c.inputs[1].shape[1];
    std::vector<float> sum(size_t(cols) * 2, 0.0f);
    for (int64_t ci = 0; ci < chunks; ++ci)
      for (int64_t j = 0; j < cols; ++j) {
        sum[size_t(j)] += scratch[size_t(ci * sp.scratch + cols + j)];
        sum[size_t(cols + j)] += scratch[size_t(ci * sp.scratch + 2 * cols + j)];
      }
    k->from_float(dt_of(c.outputs[1]), sum.data(), c.outputs[1].data, cols);
    if (op == OpId::layer_norm_backward && c.ints[0])
      k->from_float(dt_of(c.outputs[2]), sum.data() + cols, c.outputs[2].data, cols);
  }
  return TO_OK;
}

std::string cpuinfo_field(const char* key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) {
      size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  }
  return "";
}

void copy_str(char* dst, size_t n, const std::string& s) {
  std::snprintf(dst, n, "%s", s.c_str());
}

to_status cpu_init(char*, size_t) { return TO_OK; }
int32_t cpu_priority() { return 50; }
int32_t cpu_device_count() { return 1; }

to_status cpu_mem_info(int32_t, uint64_t* free_bytes, uint64_t* total_bytes) {
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  *total_bytes = uint64_t(sysconf(_SC_PHYS_PAGES)) * page;
  *free_bytes = uint64_t(sysconf(_SC_AVPHYS_PAGES)) * page;
  return TO_OK;
}

to_status cpu_device_info(int32_t device, to_device_info* out) {
  if (device != 0) {
    last_error_text = "cpu has one device (0), asked for " + std::to_string(device);
    return TO_ERR_INVALID_ARGUMENT;
  }
  *out = to_device_info{};
  std::string name = cpuinfo_field("model name");
  copy_str(out->name, sizeof(out->name), name.empty() ? "CPU" : name);
  copy_str(out->vendor, sizeof(out->vendor), cpuinfo_field("vendor_id"));
  copy_str(out->compute_capability, sizeof(out->compute_capability), active_isa());
  out->device_type = TO_DEVICE_CPU;
  uint64_t free_b = 0, total_b = 0;
  cpu_mem_info(0, &free_b, &total_b);
  out->total_memory_bytes = total_b;
  out->is_available = 1;
  const CpuFeatures& f = features();
  std::string isas;
  for (const std::string& s : supported_isas()) isas += (isas.empty() ? "" : ",") + s;
  std::string props = "isa=" + active_isa() + "\nsupported_isas=" + isas +
                      "\nthreads=" + std::to_string(num_threads()) + "\nhas_avx2=" + std::to_string(f.avx2) +
                      "\nhas_fma=" + std::to_string(f.fma) + "\nhas_f16c=" + std::to_string(f.f16c) +
                      "\nhas_avx512=" + std::to_string(f.avx512f) +
                      "\nhas_avx512_bf16=" + std::to_string(f.avx512_bf16) + "\nhas_amx=" + std::to_string(f.amx) +
                      (f.amx ? std::string() : "\namx_unavailable=" + f.amx_reason);
  copy_str(out->properties, sizeof(out->properties), props);
  return TO_OK;
}

to_status cpu_allocate(int32_t, size_t bytes, void** ptr) {
  *ptr = bytes ? std::aligned_alloc(64, (bytes + 63) / 64 * 64) : nullptr;
  if (bytes && !*ptr) {
    last_error_text = "host allocation of " + std::to_string(bytes) + " bytes failed";
    return TO_ERR_OUT_OF_MEMORY;
  }
  return TO_OK;
}

void cpu_deallocate(int32_t, void* ptr, size_t) { std::free(ptr); }

to_status cpu_copy(int32_t, void* dst, uint64_t dst_offset, const void* src, uint64_t src_offset, size_t bytes,
                   int32_t) {
  if (bytes) std::memcpy(static_cast<char*>(dst) + dst_offset, static_cast<const char*>(src) + src_offset, bytes);
  return TO_OK;
}

to_status cpu_memset(int32_t, void* dst, uint64_t offset, int32_t value, size_t bytes) {
  if (bytes) std::memset(static_cast<char*>(dst) + offset, value, bytes);
  return TO_OK;
}

to_status cpu_synchronize(int32_t) { return TO_OK; }
const char* cpu_last_error() { return last_error_text.c_str(); }

to_backend_v1 make_table() {
  to_backend_v1 t{};
  t.flags = TO_BACKEND_FORK_SAFE;  // the thread pool resets itself in a forked child
  t.abi_version = TENSOR_OPS_PLUGIN_ABI_VERSION;
  t.name = "cpu";
  t.init = cpu_init;
  t.priority = cpu_priority;
  t.device_count = cpu_device_count;
  t.device_info = cpu_device_info;
  t.mem_info = cpu_mem_info;
  t.allocate = cpu_allocate;
  t.deallocate = cpu_deallocate;
  t.copy = cpu_copy;
  t.memset = cpu_memset;
  t.synchronize = cpu_synchronize;
  t.last_error = cpu_last_error;
  t.kernels[int(OpId::rms_norm)] = run_rms_norm;
  t.kernels[int(OpId::silu)] = run_silu;
  t.kernels[int(OpId::gelu)] = run_gelu;
  for (OpId op : {OpId::layer_norm, OpId::rms_norm_backward, OpId::layer_norm_backward, OpId::add_rms_norm,
                  OpId::softmax, OpId::softmax_backward, OpId::activation_backward, OpId::glu, OpId::glu_backward,
                  OpId::rope, OpId::attention, OpId::attention_backward, OpId::cross_entropy, OpId::linear})
    t.kernels[int(op)] = run_items;
  t.flags |= TO_BACKEND_CE_OPTIONS | TO_BACKEND_NORM_OFFSET;  // cross_entropy's options, rms_norm's offset
  return t;
}

}  // namespace

const to_backend_v1* cpu_backend_table() {
  static const to_backend_v1 table = make_table();
  return &table;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const IsaKernels* k : supported_levels()) out.push_back(k->name);
  return out;
}

std::string active_isa() { return level().load()->name; }

void set_isa(const std::string& name) {
  level().store(name == "auto" ? supported_levels().back() : pick_level(name));
}

int num_threads() { return ThreadPool::instance().num_threads(); }

void set_num_threads(int threads) { ThreadPool::instance().set_num_threads(threads); }

void set_openmp(uintptr_t gomp_parallel, uintptr_t omp_get_max_threads) {
  ThreadPool::instance().set_openmp(reinterpret_cast<ThreadPool::GompParallel>(gomp_parallel),
                                    reinterpret_cast<ThreadPool::OmpMaxThreads>(omp_get_max_threads));
}

bool uses_openmp() { return ThreadPool::instance().uses_openmp(); }

int region_threads() { return ThreadPool::instance().region_threads(); }

}  // namespace tensor_ops::cpu
