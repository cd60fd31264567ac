// Shared by every file in cuda/, in both builds: the CUDA plugin (nvcc + the
// host compiler) and the HIP plugin (the same files compiled as HIP, with
// TENSOR_OPS_HIP defined and the CUDA names mapped by hip/vendor.h).
#ifndef TENSOR_OPS_CUDA_COMMON_CUH
#define TENSOR_OPS_CUDA_COMMON_CUH

#ifdef TENSOR_OPS_HIP
#include "../hip/vendor.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define TENSOR_OPS_GPU_NAME "CUDA"
#define TENSOR_OPS_GPU_API "cuda"
#define TENSOR_OPS_WARP_SIZE 32
#define TENSOR_OPS_GPU_PRIORITY 100
#endif

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "tensor_ops/plugin.h"

namespace tensor_ops::gpu {

// Records "<call> returned <code> (<name>: <text>) at <file>:<line>" as this
// thread's last error and reads the runtime's pending copy of it, so the next
// launch check (cudaGetLastError) does not report it again. Returns the
// status the code maps to (TO_ERR_OUT_OF_MEMORY for allocation failures).
to_status fail(const char* call, cudaError_t code, const char* file, int line);
// Records a message that is not a vendor error (a bad argument, say).
to_status fail(to_status status, const std::string& message);

// One check for every vendor call: never aborts, always returns a status.
#define TENSOR_OPS_CUDA_CHECK(call)                                                \
  do {                                                                             \
    const cudaError_t tensor_ops_err_ = (call);                                    \
    if (tensor_ops_err_ != cudaSuccess)                                            \
      return ::tensor_ops::gpu::fail(#call, tensor_ops_err_, __FILE__, __LINE__);  \
  } while (0)

// Makes a device current for one call and restores the caller's afterwards:
// torch and other frameworks in the same process keep their current device.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);  // nothing to report it to here
  }
  to_status enter(int device) {
    TENSOR_OPS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      TENSOR_OPS_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
    return TO_OK;
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Element 0 of a view (byte_offset is 0 for pointer devices, honoured anyway).
template <class T>
inline T* element0(const to_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}

__host__ __device__ inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Block sizes are multiples of 64 so that they hold whole warps on every
// target: 32-wide NVIDIA warps, wave32 (RDNA) and wave64 (CDNA) on AMD.
constexpr int kBlockMultiple = 64;
constexpr int kMaxBlockThreads = 1024;
// Grids stop here and kernels stride over the rest (gridDim.y's limit too).
constexpr int64_t kMaxGridBlocks = 65535;

// Runs f(T{}) with T the storage type for a to_dtype.
template <class F>
to_status with_dtype(int32_t dtype, F&& f) {
  switch (dtype) {
    case TO_FLOAT32: return f(float{});
    case TO_FLOAT16: return f(__half{});
    case TO_BFLOAT16: return f(__nv_bfloat16{});
  }
  return fail(TO_ERR_UNSUPPORTED, "dtype " + std::to_string(dtype) + " is not float32, float16 or bfloat16");
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads for one block per row: enough for one chunk each up to 1024, whole 64s.
inline int row_block_threads(int64_t chunks) {
  const int64_t n = ceil_div(chunks, kBlockMultiple) * kBlockMultiple;
  return int(n < kBlockMultiple ? kBlockMultiple : (n > kMaxBlockThreads ? kMaxBlockThreads : n));
}

// Blocks for one block per row; kernels stride over the rows past the grid.
inline unsigned row_blocks(int64_t rows) { return unsigned(rows < kMaxGridBlocks ? rows : kMaxGridBlocks); }

// Note [Rows per block]: a short row (up to kMaxGroupThreads chunks: 128
// fp32 or 256 bf16 columns) takes a group of G threads, the least power of
// two from kMinGroupThreads holding one chunk each, and a block of
// kGroupBlockThreads runs kGroupBlockThreads / G rows; its sums and maxima
// are shuffles within the group, no barrier. One block per row would leave
// most of its 64 threads idle there (a 128-column fp32 row is 32 chunks) and
// pay two barriers per reduction for a few elements. G >= 8 gives the head
// and tail elements of a row (fewer than V <= 8 each, Note [Row head and
// tail]) a thread each; G <= 32 keeps a group inside a warp on every target
// (wave32 and wave64 included). Longer rows keep a block each (G = blockDim.x).
constexpr int kMinGroupThreads = 8;
constexpr int kMaxGroupThreads = 32;
constexpr int kGroupBlockThreads = 256;
constexpr int kMaxRowGroups = kGroupBlockThreads / kMinGroupThreads;

// The launch of a row kernel for rows of `chunks` chunks: blocks, threads a
// block, threads a row (the kernels' `group`).
struct RowLaunch {
  unsigned blocks;
  int threads, group;
};
inline RowLaunch row_launch(int64_t rows, int64_t chunks) {
  if (chunks > kMaxGroupThreads) {
    const int threads = row_block_threads(chunks);
    return {row_blocks(rows), threads, threads};
  }
  int group = kMinGroupThreads;
  while (group < chunks) group *= 2;
  return {row_blocks(ceil_div(rows, kGroupBlockThreads / group)), kGroupBlockThreads, group};
}

// Runs f(std::bool_constant<Grouped>{}): Grouped when the launch l runs
// several rows a block. The two are separate kernels: a grouped row holds
// one chunk a thread and reduces by shuffles only, which keeps the
// block-per-row kernel's registers as they were (one kernel serving both
// spilled 12-108 bytes under the 1024-thread bound).
template <class F>
to_status with_grouping(const RowLaunch& l, F&& f) {
  if (l.group < l.threads) return f(std::true_type{});
  return f(std::false_type{});
}

// Whether the row kernels may move 16-byte chunks: every view's element 0 and
// row stride (when there is more than one row) on 16-byte boundaries and cols
// a whole number of chunks. Absent optional views (data == NULL) pass.
inline bool rows_aligned16(std::initializer_list<const to_tensor*> views, size_t item) {
  for (const to_tensor* t : views) {
    if (!t->data) continue;
    const int64_t chunk = int64_t(16 / item);
    if (t->shape[1] % chunk != 0 || !aligned16(element0<const char>(*t))) return false;
    if (t->shape[0] > 1 && t->strides[0] % chunk != 0) return false;
  }
  return true;
}

// Whether every row of the views starts at the same offset from a 16-byte
// boundary as the first view's row (Note [Row head and tail]): element 0 of
// each at the same offset, a whole number of elements, and row strides that
// differ by a multiple of 16 bytes (when there is more than one row). Absent
// optional views (data == NULL) pass.
inline bool rows_same_offset16(const to_tensor* const* views, size_t count, size_t item) {
  const to_tensor* first = nullptr;
  for (size_t i = 0; i < count; ++i) {
    const to_tensor* t = views[i];
    if (!t->data) continue;
    const uintptr_t offset = reinterpret_cast<uintptr_t>(element0<const char>(*t)) % 16;
    if (offset % item != 0) return false;
    if (!first) {
      first = t;
      continue;
    }
    if (offset != reinterpret_cast<uintptr_t>(element0<const char>(*first)) % 16) return false;
    if (t->shape[0] > 1 && (t->strides[0] - first->strides[0]) * int64_t(item) % 16 != 0) return false;
  }
  return true;
}
inline bool rows_same_offset16(std::initializer_list<const to_tensor*> views, size_t item) {
  return rows_same_offset16(views.begin(), views.size(), item);
}

// Runs f(std::integral_constant<int, V>{}) with V = 16 / sizeof(T) (16-byte
// chunks) when vec, else V = 1: both paths of one kernel.
template <class T, class F>
to_status with_chunk(bool vec, F&& f) {
  if (vec) return f(std::integral_constant<int, int(16 / sizeof(T))>{});
  return f(std::integral_constant<int, 1>{});
}

// The plugin's stream-ordered memory pool for scratch on the current device,
// created on first use. Its release threshold keeps up to kScratchKeepBytes
// of freed scratch reserved across synchronizations, so the next call reuses
// it (the device's default pool has threshold 0: every synchronize hands it
// back and the next call maps it again). The core's caching pool is on the
// other side of the plugin ABI, out of reach here. *pool is null where the
// device has no memory pools (cudaErrorNotSupported).
constexpr unsigned long long kScratchKeepBytes = 256ull << 20;
to_status scratch_pool(cudaMemPool_t* pool);

// Stream-ordered device memory for one call (partial sums): from
// scratch_pool() where the device has memory pools, else cudaMalloc. Freed in
// stream order when the owner goes out of scope.
class DeviceScratch {
 public:
  explicit DeviceScratch(cudaStream_t stream) : stream_(stream) {}
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    if (!ptr_) return;
    // Nothing to report a failure to here; the next call's check sees it.
    if (async_)
      (void)cudaFreeAsync(ptr_, stream_);
    else
      (void)cudaFree(ptr_);  // waits for the device, so the kernels are done
  }
  to_status allocate(size_t bytes) {
    cudaMemPool_t pool = nullptr;
    if (to_status s = scratch_pool(&pool); s != TO_OK) return s;
    async_ = pool != nullptr;
    const cudaError_t err = async_ ? cudaMallocFromPoolAsync(&ptr_, bytes, pool, stream_) : cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      return fail(async_ ? "cudaMallocFromPoolAsync(&ptr, bytes, pool, stream)" : "cudaMalloc(&ptr, bytes)", err,
                  __FILE__, __LINE__);
    }
    return TO_OK;
  }
  template <class T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  bool async_ = true;
};

// The kernels that index tables with values from the data (rope's positions,
// cross-entropy's targets) raise a flag in device memory for a bad one. The
// flag is sticky, one per device and kind: a call neither waits for its
// kernel nor copies anything back (the host runs ahead, and the call can be
// captured in a CUDA graph). The next synchronizing call of this plugin on
// that device (a copy, a memset or synchronize(): where results reach the
// host; for host arrays, the copy of the same call's output) reads the
// flags, clears them and fails with InvalidArgument and the message of the
// last call of that kind (the CPU backend's text, naming the op and the
// table's range) plus where it was reported.
enum class BadIndex { position = 0, target = 1 };
constexpr int kBadIndexKinds = 2;

class BadIndexFlag {
 public:
  explicit BadIndexFlag(BadIndex kind) : kind_(kind) {}
  // The current device's flag (allocated and zeroed on its first use; kept
  // until the process ends); message is what a raise reports.
  to_status arm(const std::string& message);
  int* device() const { return flag_; }

 private:
  BadIndex kind_;
  int* flag_ = nullptr;
};

// After the device synchronized (gpu_copy, gpu_memset, gpu_synchronize):
// fails with the message of any flag raised since the last report on this
// device, and clears them.
to_status report_bad_indices(int32_t device);

// Kernel launchers, one per op (norm.cu, activation.cu, softmax.cu, rope.cu,
// attention.cu): the core has validated the call.
to_status launch_rms_norm(const to_op_call* call, cudaStream_t stream);
to_status launch_layer_norm(const to_op_call* call, cudaStream_t stream);
to_status launch_add_rms_norm(const to_op_call* call, cudaStream_t stream);
to_status launch_rms_norm_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_layer_norm_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_silu(const to_op_call* call, cudaStream_t stream);
to_status launch_gelu(const to_op_call* call, cudaStream_t stream);
to_status launch_activation_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_glu(const to_op_call* call, cudaStream_t stream);
to_status launch_glu_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_softmax(const to_op_call* call, cudaStream_t stream);
to_status launch_softmax_backward(const to_op_call* call, cudaStream_t stream);
to_status launch_cross_entropy(const to_op_call* call, cudaStream_t stream);
to_status launch_rope(const to_op_call* call, cudaStream_t stream);
to_status launch_attention(const to_op_call* call, cudaStream_t stream);
to_status launch_attention_backward(const to_op_call* call, cudaStream_t stream);

#if defined(__CUDACC__) || defined(__HIPCC__)

constexpr int kWarpSize = TENSOR_OPS_WARP_SIZE;
// Reductions keep one slot per warp; 1024 threads of the narrowest warp (32).
constexpr int kMaxWarps = kMaxBlockThreads / 32;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// a * b rounded to fp32 and never contracted into an FMA with what uses it
// (nvcc and hipcc both contract by default): for differences that must
// cancel exactly against a sum of the same rounded products.
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef TENSOR_OPS_HIP
#pragma clang fp contract(off)
  return a * b;  // HIP's __fmul_rn is a plain a * b, contractable
#else
  return __fmul_rn(a, b);
#endif
}

// V elements moved as one load / store: V = 16 / sizeof(T) gives 16-byte
// accesses, V = 1 the scalar path of the same kernel.
template <class T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

constexpr float kNegInf = -__builtin_inff();

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// N elements at p + e, as fp32, and back: one access of N * sizeof(T) bytes
// (p + e on that boundary; N = 16 / sizeof(T): 16-byte accesses).
template <class T, int N>
__device__ __forceinline__ void load_at(const T* p, int64_t e, float (&out)[N]) {
  const Vec<T, N> c = *reinterpret_cast<const Vec<T, N>*>(p + e);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_f32(c.v[k]);
}

template <class T, int N>
__device__ __forceinline__ void store_at(T* p, int64_t e, const float (&in)[N]) {
  Vec<T, N> c;
#pragma unroll
  for (int k = 0; k < N; ++k) c.v[k] = from_f32<T>(in[k]);
  *reinterpret_cast<Vec<T, N>*>(p + e) = c;
}

// Chunk i (V elements) of a row, as fp32, and back.
template <class T, int V>
__device__ __forceinline__ void load_chunk(const T* row, int64_t i, float (&out)[V]) {
  load_at(row, i * V, out);
}

template <class T, int V>
__device__ __forceinline__ void store_chunk(T* row, int64_t i, const float (&in)[V]) {
  store_at(row, i * V, in);
}

// A vector indexed by column (a norm's weight or bias): N elements at p + e
// in one access where vec (Note [Row head and tail]), else one at a time.
template <class T, int N>
__device__ __forceinline__ void load_column(const T* p, int64_t e, bool vec, float (&out)[N]) {
  if (N == 1 || vec) {
    load_at(p, e, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_f32(p[e + k]);
  }
}

// The element count of a register part that for_chunks hands to f (float[N]).
template <class A>
constexpr int kWidth = int(std::extent<std::remove_reference_t<A>>::value);

// Note [Row head and tail]: a row is split at its own first 16-byte
// boundary: `head` single elements before it, `chunks` 16-byte chunks of V
// elements, `tail` single elements after them (head, tail < V; V == 1:
// all chunks). A row that does not start on a boundary (contiguous bf16 rows
// of vocab 50257, fp32 rows of 4095) thus still moves all but 2 (V - 1)
// elements in 16-byte accesses, where it used to take the one-element path
// for the whole row (2-byte accesses, and a register limit of a quarter or an
// eighth of the elements). The views of one call share each row's split
// (rows_same_offset16 on the host; views that do not keep V = 1). A weight or
// bias indexed by column has one offset for every row, so it meets the row's
// boundary on some rows and not on others: on a row where w + head is on a
// boundary it is read in 16-byte chunks, elsewhere one element at a time
// (load_column). That keeps the 16-byte path for every row of x and y, which
// are rows x cols, where requiring the weight's offset too would leave most
// rows of an odd width on the scalar path; the weight's scalar reads are
// from its copy in shared memory (Note [Weight once per block]), or, for
// rows too wide for that, cols elements per row, hits in L1 / L2 after the
// first row.
struct RowSplit {
  int head;
  int64_t chunks;
  int tail;
};

template <class T, int V>
__device__ __forceinline__ RowSplit split_row(const T* row, int64_t cols) {
  const int head = V == 1 ? 0 : int(min64(cols, int64_t((16 - reinterpret_cast<uintptr_t>(row) % 16) % 16 / sizeof(T))));
  const int64_t chunks = (cols - head) / V;
  return {head, chunks, int(cols - head - chunks * V)};
}

// The row kernels (norms, softmax, cross-entropy) keep a row of up to
// blockDim.x * kRowChunks<T> chunks in registers (chunks threadIdx.x + c *
// blockDim.x), so it is read from global memory once; a longer row is read
// again per pass. 16 fp32 values a thread: 4 chunks of fp32, 2 of 16-bit
// types (more spill under the 1024-thread launch bound).
template <class T>
constexpr int kRowChunks = sizeof(T) == 4 ? 4 : 2;

// Chunks a thread keeps: kRowChunks<T> for a block per row, 1 for a group
// (Note [Rows per block]: a group has a thread per chunk).
template <class T, bool Grouped>
constexpr int kRegChunks = Grouped ? 1 : kRowChunks<T>;

// One thread's registers for M rows split alike (softmax's backward holds dy
// and y): its chunks, and head / tail element lane of each row.
template <class T, int V, bool Grouped, int M = 1>
struct RowRegs {
  static constexpr int kChunks = kRegChunks<T, Grouped>;
  float a[kChunks][M][V];
  float head[M][1], tail[M][1];
};

// The threads of one row (Note [Rows per block]): this thread's lane in
// its row's group, the group's size, its index in the block, groups a block;
// without Grouped the block (lane threadIdx.x, one row a block).
template <bool Grouped>
struct RowGroup {
  int lane, size, index, per_block;
};

template <bool Grouped>
__device__ __forceinline__ RowGroup<Grouped> row_group(int threads) {
  if constexpr (Grouped)
    return {int(threadIdx.x) % threads, threads, int(threadIdx.x) / threads, int(blockDim.x) / threads};
  else
    return {int(threadIdx.x), int(blockDim.x), 0, 1};
}

// Whether a row fits the registers Regs (a grouped row always does: the
// host gives a group a thread per chunk).
template <class Regs, bool Grouped>
__device__ __forceinline__ bool row_in_registers(const RowGroup<Grouped>& g, const RowSplit& s) {
  if constexpr (Grouped)
    return true;
  else
    return s.chunks <= int64_t(g.size) * Regs::kChunks;
}

// f(e, part_0, ..., part_{M-1}): one float[N] per row, the elements e.. e + N - 1.
template <int M, int N, class F>
__device__ __forceinline__ void call_part(F& f, int64_t e, float (&p)[M][N]) {
  static_assert(M == 1 || M == 2, "one or two rows");
  if constexpr (M == 1)
    f(e, p[0]);
  else
    f(e, p[0], p[1]);
}

// Runs f over this thread's parts of M rows split as s (head element
// g.lane, chunks g.lane + c * g.size, tail element g.lane): from the
// registers r (loading them first when load), or streaming each part from
// the rows.
template <class T, int V, bool Grouped, int M, class F, class... Rows>
__device__ __forceinline__ void for_chunks(const RowGroup<Grouped>& g, bool in_registers, bool load,
                                           const RowSplit& s, RowRegs<T, V, Grouped, M>& r, F&& f, Rows... rows) {
  static_assert(sizeof...(Rows) == M, "one row pointer per row held");
  const T* const p[M] = {rows...};
  const int64_t j = g.lane;
  const auto single = [&](int64_t e, float (&b)[M][1]) {
    if (load || !in_registers)
#pragma unroll
      for (int m = 0; m < M; ++m) b[m][0] = to_f32(p[m][e]);
    call_part(f, e, b);
  };
  if (j < s.head) single(j, r.head);
  if (in_registers) {
#pragma unroll
    for (int c = 0; c < r.kChunks; ++c) {
      const int64_t i = j + int64_t(c) * g.size;
      if (i >= s.chunks) break;
      if (load)
#pragma unroll
        for (int m = 0; m < M; ++m) load_at(p[m], s.head + i * V, r.a[c][m]);
      call_part(f, s.head + i * V, r.a[c]);
    }
  } else {
    for (int64_t i = j; i < s.chunks; i += g.size) {
      float b[M][V];
#pragma unroll
      for (int m = 0; m < M; ++m) load_at(p[m], s.head + i * V, b[m]);
      call_part(f, s.head + i * V, b);
    }
  }
  if (j < s.tail) single(s.head + s.chunks * V + j, r.tail);
}

// Note [Weight once per block]: a norm forward kernel copies its weight /
// bias once per block into dynamic shared memory (keep_columns, when they fit
// kMaxKeptBytes: every grouped launch, and rows of up to 5,100 fp32 / 10,200
// 16-bit columns with a bias, twice that without) and reads them from there
// for every row the block runs, so global memory sees them once per block,
// not once per row. The copy keeps each element's offset from a 16-byte
// boundary (the copy starts at its source's offset), so a chunk that is one
// 16-byte access in global memory is one in shared memory and the kernels
// read the copy exactly as they read the source (load_column, 16-byte chunks
// on the rows whose boundary the vector shares, Note [Row head and tail]).
// The host (norm_launch in norm.cu) sizes the grid so that each block runs
// at least kWeightShare * vectors / row views rows (the vectors' reads are
// at most about 1/kWeightShare of the rows' own traffic), but never below
// kFillBlocks (two per SM of an H100) for it: at a few hundred rows every
// row keeps its own block (its weight read, from the L2 on a GPU, still one
// 16-byte chunk at a time through the copy), and from a few thousand rows
// the share holds.
constexpr int64_t kMaxKeptBytes = 40 << 10;

// Shared bytes one kept vector of cols elements of `item` bytes takes: the
// elements after an offset of up to 15 bytes, whole 16-byte chunks.
__host__ __device__ inline int64_t kept_bytes(int64_t cols, int64_t item) { return (cols * item + 31) / 16 * 16; }

// Copies p[0, cols) to shared memory at sh (16-byte aligned, kept_bytes(cols,
// sizeof(T)) bytes) plus p's offset from a 16-byte boundary, in 16-byte
// chunks around a scalar head and tail, and returns the copy's element 0.
// Every thread of the block calls it (it ends with a barrier).
template <class T>
__device__ __forceinline__ const T* keep_columns(const T* p, int64_t cols, char* sh) {
  constexpr int V = int(16 / sizeof(T));
  T* kept = reinterpret_cast<T*>(sh + reinterpret_cast<uintptr_t>(p) % 16);
  const RowSplit s = split_row<T, V>(p, cols);
  for (int64_t i = threadIdx.x; i < s.chunks; i += blockDim.x)
    *reinterpret_cast<Vec<T, V>*>(kept + s.head + i * V) = *reinterpret_cast<const Vec<T, V>*>(p + s.head + i * V);
  if (int(threadIdx.x) < s.head) kept[threadIdx.x] = p[threadIdx.x];
  if (int(threadIdx.x) < s.tail) {
    const int64_t e = s.head + s.chunks * V + threadIdx.x;
    kept[e] = p[e];
  }
  __syncthreads();
  return kept;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block, returned to every thread. blockDim.x is a multiple of
// kWarpSize. Safe to call again at once (the result has its own slot).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kMaxWarps];
  __shared__ float total;
  const int lane = int(threadIdx.x) % kWarpSize, warp = int(threadIdx.x) / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = int(blockDim.x) / kWarpSize;
    v = warp_sum(lane < warps ? partial[lane] : 0.0f);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// Maximum over the block, as block_sum.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[kMaxWarps];
  __shared__ float total;
  const int lane = int(threadIdx.x) % kWarpSize, warp = int(threadIdx.x) / kWarpSize;
  v = warp_max(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = int(blockDim.x) / kWarpSize;
    v = warp_max(lane < warps ? partial[lane] : kNegInf);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// Sum and maximum over a row's group (Note [Rows per block]), returned to
// each of its threads: shuffles within a group of up to kMaxGroupThreads
// (every lane of a group gets the same bits: each step adds the same two
// values), block_sum / block_max for a block per row. Every thread of the
// block calls them (they hold barriers or whole-warp shuffles).
template <bool Grouped>
__device__ __forceinline__ float group_sum(const RowGroup<Grouped>& g, float v) {
  if constexpr (Grouped) {
    for (int offset = g.size / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  } else {
    return block_sum(v);
  }
}

template <bool Grouped>
__device__ __forceinline__ float group_max(const RowGroup<Grouped>& g, float v) {
  if constexpr (Grouped) {
    for (int offset = g.size / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
  } else {
    return block_max(v);
  }
}

// Merges per-thread online-softmax states (max m, sum s of exp(v - m)) over
// the row's group: returns the row max, *sum gets the sum of exp(v - max).
template <bool Grouped>
__device__ __forceinline__ float group_max_sum(const RowGroup<Grouped>& g, float m, float s, float* sum) {
  const float row_max = group_max(g, m);
  // s == 0: nothing seen (m may be -inf); never exp(-inf - -inf).
  *sum = group_sum(g, s == 0.0f ? 0.0f : s * expf(m - row_max));
  return row_max;
}

// One online-softmax step: v joins the state (m, s).
__device__ __forceinline__ void online_add(float v, float& m, float& s) {
  if (v > m) {
    s = s * expf(m - v) + 1.0f;
    m = v;
  } else if (v != kNegInf) {  // -inf adds nothing (and -inf - -inf is NaN)
    s += expf(v - m);
  }
}

#endif  // device code

}  // namespace tensor_ops::gpu

#endif
