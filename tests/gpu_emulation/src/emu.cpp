// The emulated GPU's implementation: fibers for GPU threads, the block
// scheduler (barriers, warp collectives, thread orders), the launch queue and
// the runtime API. One copy is linked into each emulated plugin.
#include "emu/runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#if !defined(__x86_64__)
#error "the GPU emulator's fiber switch is written for x86-64"
#endif

struct emuStream {};
struct emuEvent {
  unsigned flags;
};

// Saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save_sp and resumes the context
// whose stack pointer is new_sp. A new fiber's stack is laid out so that the
// restore "returns" into emu_fiber_start, which calls r13(r12).
extern "C" void emu_switch(void** save_sp, void* new_sp);
extern "C" void emu_fiber_start();
asm(R"(
  .text
  .globl emu_switch
  .hidden emu_switch
  .type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch,.-emu_switch
  .globl emu_fiber_start
  .hidden emu_fiber_start
  .type emu_fiber_start,@function
emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size emu_fiber_start,.-emu_fiber_start
)");

namespace emu {
namespace {

#if EMU_ASAN
constexpr size_t kStackBytes = 512 * 1024;
#else
constexpr size_t kStackBytes = 128 * 1024;
#endif
constexpr int kWarp = TENSOR_OPS_EMU_WARP;
constexpr size_t kMaxSmem = 48 * 1024;
constexpr size_t kTotalMemory = size_t(16) << 30;

enum class Schedule { inorder, reverse, interleaved };
enum State { kRunnable, kBarrier, kWarpWait, kDone };

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::inorder: return "inorder";
    case Schedule::reverse: return "reverse";
    case Schedule::interleaved: return "interleaved";
  }
  return "?";
}

Schedule schedule_from_env() {
  const char* s = std::getenv("TENSOR_OPS_EMU_SCHEDULE");
  if (!s || !*s || !std::strcmp(s, "inorder")) return Schedule::inorder;
  if (!std::strcmp(s, "reverse")) return Schedule::reverse;
  if (!std::strcmp(s, "interleaved")) return Schedule::interleaved;
  std::fprintf(stderr, "tensor_ops GPU emulator: TENSOR_OPS_EMU_SCHEDULE=%s is not inorder, reverse or interleaved\n",
               s);
  std::abort();
}

const Schedule kSchedule = schedule_from_env();

}  // namespace

struct Thread {
  void* sp = nullptr;
  char* stack = nullptr;  // kStackBytes, the lowest page a guard
  State state = kRunnable;
  uint3 idx{};
  int index = 0, warp = 0, lane = 0;
  bool started = false;
  uint64_t result = 0;
  void* fake_stack = nullptr;
};

namespace {

struct Warp {
  uint64_t exists = 0;  // lanes the block has
  uint64_t arrived = 0;
  const char* kind = nullptr;
  uint64_t mask = 0;
  int width = 0;
  uint64_t in[64];
  int arg[64];
};

struct Block {
  std::vector<Thread>* threads;
  std::vector<Warp> warps;
  int n = 0, live = 0, at_barrier = 0, rounds = 0;
  int lo = 0, hi = 0, cursor = 0;
  const std::function<void()>* body = nullptr;
  void* sched_sp = nullptr;
  void* sched_fake = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  std::string fault;
  char* smem = nullptr;
};

thread_local Block* cur_block = nullptr;
thread_local std::vector<Thread> thread_pool;  // with their stacks, reused by every launch
std::mutex shared_mutex;
std::vector<std::pair<char*, size_t>> shared_objects;  // the static __shared__ objects seen so far

void asan_start(void** fake, const void* bottom, size_t size) {
#if EMU_ASAN
  __sanitizer_start_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}
void asan_finish(void* fake, const void** bottom, size_t* size) {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}

char* new_stack() {
  void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("tensor_ops GPU emulator: mmap of a fiber stack");
    std::abort();
  }
  mprotect(p, size_t(sysconf(_SC_PAGESIZE)), PROT_NONE);  // overflow faults instead of corrupting
  return static_cast<char*>(p);
}

// Back to the scheduler; returns when the scheduler resumes this thread.
void yield() {
  Block* b = cur_block;
  Thread* t = current_thread;
  asan_start(t->state == kDone ? nullptr : &t->fake_stack, b->sched_bottom, b->sched_size);
  emu_switch(&t->sp, b->sched_sp);
  asan_finish(t->fake_stack, nullptr, nullptr);
}

void fiber_entry(Thread* t) {
  Block* b = cur_block;
  asan_finish(nullptr, &b->sched_bottom, &b->sched_size);
  (*b->body)();
  t->state = kDone;
  --b->live;
  yield();
  __builtin_trap();  // a finished thread is never resumed
}

void prepare(Thread* t) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(t->stack) + kStackBytes) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 16 - 64);
  uint32_t mxcsr;
  uint16_t fpucw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpucw));
  sp[0] = 0;
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
  sp[1] = sp[2] = 0;                                    // r15, r14
  sp[3] = reinterpret_cast<uint64_t>(&fiber_entry);     // r13
  sp[4] = reinterpret_cast<uint64_t>(t);                // r12
  sp[5] = sp[6] = 0;                                    // rbx, rbp
  sp[7] = reinterpret_cast<uint64_t>(&emu_fiber_start);  // return address
  t->sp = sp;
}

void resume(Block* b, Thread* t) {
  if (!t->started) {
    t->started = true;
    prepare(t);
  }
  current_thread = t;
  asan_start(&b->sched_fake, t->stack, kStackBytes);
  emu_switch(&b->sched_sp, t->sp);
  asan_finish(b->sched_fake, nullptr, nullptr);
  current_thread = nullptr;
}

void make_runnable(Block* b, Thread& t) {
  t.state = kRunnable;
  b->lo = std::min(b->lo, t.index);
  b->hi = std::max(b->hi, t.index);
}

// The next thread to run, as the schedule orders them: inorder and reverse
// run the lowest (highest) runnable thread until it blocks; interleaved goes
// round the threads from a starting point that moves at every barrier.
Thread* pick(Block* b) {
  std::vector<Thread>& th = *b->threads;
  switch (kSchedule) {
    case Schedule::inorder:
      while (b->lo < b->n && th[b->lo].state != kRunnable) ++b->lo;
      return b->lo < b->n ? &th[b->lo] : nullptr;
    case Schedule::reverse:
      while (b->hi >= 0 && th[b->hi].state != kRunnable) --b->hi;
      return b->hi >= 0 ? &th[b->hi] : nullptr;
    case Schedule::interleaved:
      for (int k = 0; k < b->n; ++k) {
        const int i = (b->cursor + k) % b->n;
        if (th[i].state == kRunnable) {
          b->cursor = (i + 1) % b->n;
          return &th[i];
        }
      }
      return nullptr;
  }
  return nullptr;
}

std::string thread_str(const Thread& t) {
  return "thread (" + std::to_string(t.idx.x) + "," + std::to_string(t.idx.y) + "," + std::to_string(t.idx.z) +
         ") (warp " + std::to_string(t.warp) + " lane " + std::to_string(t.lane) + ")";
}

std::string describe_stall(Block* b) {
  std::string s = "deadlock: no thread can run;";
  int shown = 0;
  for (const Thread& t : *b->threads) {
    if (t.state == kRunnable || shown >= 6) continue;
    ++shown;
    s += " " + thread_str(t) +
         (t.state == kDone ? " has exited" : t.state == kBarrier ? " waits at __syncthreads" : " waits at a ");
    if (t.state == kWarpWait) s += std::string(b->warps[t.warp].kind) + " its warp never completes";
    s += ";";
  }
  return s + " (a barrier or warp collective that not every thread reaches)";
}

[[noreturn]] void fault_here(const std::string& what) {
  Block* b = cur_block;
  Thread* t = current_thread;
  if (b->fault.empty()) b->fault = thread_str(*t) + ": " + what;
  t->state = kDone;  // never resumed: the scheduler abandons the block
  yield();
  __builtin_trap();
}

// The result lane i of a completed collective gets.
uint64_t collective_result(const Warp& w, int i, std::string* error) {
  const std::string kind = w.kind;
  const int width = w.width, seg = i / (width ? width : 1) * width;
  auto from = [&](int src) -> uint64_t {
    if (!(w.mask >> src & 1)) {
      *error = kind + ": lane " + std::to_string(i) + " reads lane " + std::to_string(src) +
               ", which is not in the mask";
      return 0;
    }
    return w.in[src];
  };
  if (kind == "shfl") return from(seg + (w.arg[i] & (width - 1)));
  if (kind == "shfl_xor") {
    const int src = i ^ w.arg[i];
    return src / width * width == seg && src < kWarp ? from(src) : w.in[i];
  }
  if (kind == "shfl_down") return i % width + w.arg[i] < width ? from(i + w.arg[i]) : w.in[i];
  if (kind == "shfl_up") return i % width >= w.arg[i] ? from(i - w.arg[i]) : w.in[i];
  uint64_t votes = 0;
  for (int l = 0; l < kWarp; ++l)
    if ((w.mask >> l & 1) && w.in[l]) votes |= uint64_t(1) << l;
  if (kind == "ballot") return votes;
  if (kind == "any") return votes != 0;
  if (kind == "all") return votes == (w.mask & w.exists);
  return 0;  // __syncwarp
}

}  // namespace

thread_local Thread* current_thread = nullptr;
thread_local uint3 block_idx{};
thread_local dim3 block_dim, grid_dim;

const uint3& thread_idx() {
  if (!current_thread) device_fault("threadIdx read outside a kernel");
  return current_thread->idx;
}

void device_fault(const char* what) {
  if (!current_thread) {
    std::fprintf(stderr, "tensor_ops GPU emulator: %s\n", what);
    std::abort();
  }
  fault_here(what);
}

void syncthreads() {
  Thread* t = current_thread;
  if (!t) device_fault("__syncthreads() outside a kernel");
  const Warp& w = cur_block->warps[t->warp];
  if (w.arrived)
    fault_here(std::string("__syncthreads() while lanes of its warp wait at ") + w.kind +
               " (divergent warp collective)");
  t->state = kBarrier;
  ++cur_block->at_barrier;
  yield();
}

bool shared_object(void* object, size_t bytes) {
  std::lock_guard<std::mutex> lock(shared_mutex);
  shared_objects.emplace_back(static_cast<char*>(object), bytes);
  std::memset(object, 0xff, bytes);  // the first block that declares it reads garbage too
  return true;
}

void* dynamic_shared_base() { return cur_block ? cur_block->smem : nullptr; }

uint64_t warp_collective(const char* kind, uint64_t mask, uint64_t value, int arg, int width) {
  Thread* t = current_thread;
  if (!t) device_fault("warp collective outside a kernel");
  Block* b = cur_block;
  Warp& w = b->warps[t->warp];
  if (kWarp == 32) mask &= 0xffffffffull;
  if (!std::strcmp(kind, "__syncwarp") || !std::strncmp(kind, "shfl", 4) || width == 0) {
    if (width == 0) width = kWarp;
  }
  if (width < 1 || width > kWarp || (width & (width - 1)))
    fault_here(std::string(kind) + " with width " + std::to_string(width) + ": not a power of two up to the warp size " +
               std::to_string(kWarp));
  if (!(mask >> t->lane & 1))
    fault_here(std::string(kind) + " with a mask (0x" + std::to_string(mask) + ") that leaves out the calling lane");
  if (mask & ~w.exists)
    fault_here(std::string(kind) + " with a mask naming lanes the block does not have (block of " +
               std::to_string(b->n) + " threads, warp " + std::to_string(kWarp) + ")");
  if (!w.arrived) {
    w.kind = kind;
    w.mask = mask;
    w.width = width;
  } else if (std::strcmp(w.kind, kind) || w.mask != mask || w.width != width) {
    fault_here(std::string("lanes of one warp disagree: ") + kind + " (width " + std::to_string(width) +
               ") here, " + w.kind + " (width " + std::to_string(w.width) + ") in other lanes");
  }
  w.in[t->lane] = value;
  w.arg[t->lane] = arg;
  w.arrived |= uint64_t(1) << t->lane;
  t->state = kWarpWait;
  if (w.arrived == mask) {  // the last lane: every lane gets its result
    std::string error;
    std::vector<Thread>& th = *b->threads;
    const int base = t->warp * kWarp;
    for (int l = 0; l < kWarp; ++l)
      if (mask >> l & 1) {
        th[base + l].result = collective_result(w, l, &error);
        make_runnable(b, th[base + l]);
      }
    w.arrived = 0;
    if (!error.empty()) fault_here(error);
  }
  yield();
  return t->result;
}

// ---- blocks and launches ----
namespace {

struct Launch {
  std::string kernel;
  dim3 grid, block;
  size_t smem;
  std::function<void()> body;
};

std::mutex queue_mutex;  // the queue and running it: one host thread runs the "device" at a time
std::deque<std::function<void()>> queue;
std::string pending_fault;  // a kernel's fault, reported by the next synchronising call
std::string fault_text;     // what error_string(kLaunchFailure) returns
thread_local Error last_error = kSuccess;

std::string dim_str(dim3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

void fill_static_shared() {
  std::lock_guard<std::mutex> lock(shared_mutex);
  for (const auto& o : shared_objects) std::memset(o.first, 0xff, o.second);
}

// Runs one block to completion; returns the fault, empty when none.
std::string run_block(const Launch& L, uint3 bidx, char* smem) {
  const int n = int(L.block.x * L.block.y * L.block.z);
  if (int(thread_pool.size()) < n) thread_pool.resize(size_t(n));
  Block b;
  b.threads = &thread_pool;
  b.n = n;
  b.live = n;
  b.lo = 0;
  b.hi = n - 1;
  b.body = &L.body;
  b.smem = smem;
  const int nwarps = (n + kWarp - 1) / kWarp;
  b.warps.assign(size_t(nwarps), Warp{});
  for (int i = 0; i < n; ++i) {
    Thread& t = thread_pool[size_t(i)];
    if (!t.stack) t.stack = new_stack();
    t.state = kRunnable;
    t.started = false;
    t.index = i;
    t.warp = i / kWarp;
    t.lane = i % kWarp;
    t.idx = uint3{unsigned(i) % L.block.x, unsigned(i) / L.block.x % L.block.y, unsigned(i) / (L.block.x * L.block.y)};
    t.fake_stack = nullptr;
    b.warps[size_t(t.warp)].exists |= uint64_t(1) << t.lane;
  }
  cur_block = &b;
  block_idx = bidx;
  while (b.fault.empty()) {
    if (Thread* t = pick(&b)) {
      resume(&b, t);
      continue;
    }
    if (b.live == 0) break;
    if (b.at_barrier == b.live && b.live < n) {
      // Some threads exited and the rest wait at a barrier: undefined in CUDA
      // (the guide: a barrier in conditional code must be reached by the
      // whole block), a hang on some hardware.
      b.fault = "__syncthreads() reached by " + std::to_string(b.live) + " threads after " +
                std::to_string(n - b.live) + " of the block exited (a barrier in divergent code)";
      break;
    }
    if (b.at_barrier == b.live) {  // every thread is at the barrier
      ++b.rounds;
      b.at_barrier = 0;
      for (Thread& t : *b.threads)
        if (t.index < n && t.state == kBarrier) make_runnable(&b, t);
      b.lo = 0;
      b.hi = n - 1;
      b.cursor = int((uint64_t(b.rounds) * 2654435761u) % uint64_t(n));
      continue;
    }
    b.fault = describe_stall(&b);
  }
  cur_block = nullptr;
  if (!b.fault.empty()) {
#if EMU_ASAN
    // Abandoned fibers leave their frames' redzones poisoned: clear them
    // before the stacks are reused.
    for (int i = 0; i < n; ++i) ASAN_UNPOISON_MEMORY_REGION(thread_pool[size_t(i)].stack, kStackBytes);
#endif
    return "kernel " + L.kernel + " <<<" + dim_str(L.grid) + ", " + dim_str(L.block) + ", " +
           std::to_string(L.smem) + ">>> block " + dim_str(dim3(bidx)) + ": " + b.fault + " [schedule " +
           schedule_name(kSchedule) + ", warp " + std::to_string(kWarp) + "]";
  }
  return {};
}

// ---- global-memory traffic (the traffic build, build.py --traffic) ----
// The kernel files are compiled with -fsanitize=kernel-address and every
// access made a call (asan-instrumentation-with-call-threshold=0): GCC then
// calls __asan_{load,store}{1,2,4,8,16,N}_noabort(addr) before each load and
// store, which are defined below. While a kernel runs, an access inside a
// device allocation (cudaMalloc[Async]) adds its size to the launch's loaded
// or stored bytes; shared memory, the threads' stacks and host memory are
// not device allocations and do not count. Every access counts, so a row
// read twice counts twice: a count of the passes over global memory (the
// DRAM traffic of a GPU whose caches hold nothing between passes).
// The accesses are counted too (bytes / access: whether a kernel moves
// 16-byte chunks or single elements), and those of 2, 4, 8 or 16 bytes whose
// address is not a multiple of their size: a GPU faults on a misaligned
// vector access, which x86 runs without complaint.
// TENSOR_OPS_EMU_TRAFFIC=path appends one line per launch:
//   kernel <TAB> grid <TAB> block <TAB> loaded bytes <TAB> stored bytes <TAB> accesses <TAB> misaligned accesses
void run_launch_blocks(const Launch& L);
#ifdef TENSOR_OPS_EMU_TRAFFIC
bool allocation_range(uintptr_t a, size_t bytes, uintptr_t* lo, uintptr_t* hi);
bool counting = false;  // a kernel runs (only the draining host thread sets it)
uint64_t loaded = 0, stored = 0, accesses = 0, misaligned = 0;
uintptr_t hit_lo = 1, hit_hi = 0;  // the allocation the last access hit

void count_access(uintptr_t a, size_t n, bool store) {
  if (!counting) return;
  if (!(a >= hit_lo && a + n <= hit_hi) && !allocation_range(a, n, &hit_lo, &hit_hi)) return;
  (store ? stored : loaded) += n;
  ++accesses;
  if ((n == 2 || n == 4 || n == 8 || n == 16) && a % n != 0) ++misaligned;
}

void run_launch(const Launch& L) {
  static const char* traffic_path = std::getenv("TENSOR_OPS_EMU_TRAFFIC");
  if (!traffic_path || !*traffic_path) return run_launch_blocks(L);
  loaded = stored = accesses = misaligned = 0;
  hit_lo = 1;
  hit_hi = 0;
  counting = true;
  run_launch_blocks(L);
  counting = false;
  if (FILE* f = std::fopen(traffic_path, "a")) {
    std::fprintf(f, "%s\t%s\t%s\t%llu\t%llu\t%llu\t%llu\n", L.kernel.c_str(), dim_str(L.grid).c_str(),
                 dim_str(L.block).c_str(), (unsigned long long)loaded, (unsigned long long)stored,
                 (unsigned long long)accesses, (unsigned long long)misaligned);
    std::fclose(f);
  }
}
#else
void run_launch(const Launch& L) { run_launch_blocks(L); }
#endif

void run_launch_blocks(const Launch& L) {
  if (!pending_fault.empty()) return;  // the device already faulted: later work does not run
  block_dim = L.block;
  grid_dim = L.grid;
  // Dynamic shared memory: exactly what the launch asked for (ASan traps
  // accesses past it), refilled with NaN bytes for every block.
  char* smem = static_cast<char*>(std::malloc(L.smem ? L.smem : 1));
  for (unsigned z = 0; z < L.grid.z && pending_fault.empty(); ++z)
    for (unsigned y = 0; y < L.grid.y && pending_fault.empty(); ++y)
      for (unsigned x = 0; x < L.grid.x; ++x) {
        std::memset(smem, 0xff, L.smem);
        fill_static_shared();
        std::string f = run_block(L, uint3{x, y, z}, smem);
        if (!f.empty()) {
          std::fprintf(stderr, "tensor_ops GPU emulator: %s\n", f.c_str());
          pending_fault = f;
          break;
        }
      }
  std::free(smem);
}

void push(std::function<void()> f) {
  std::lock_guard<std::mutex> lock(queue_mutex);
  queue.push_back(std::move(f));
}

// Runs everything queued; returns the fault of a kernel that ran (once).
Error drain() {
  std::lock_guard<std::mutex> lock(queue_mutex);
  while (!queue.empty()) {
    std::function<void()> f = std::move(queue.front());
    queue.pop_front();
    f();
  }
  if (pending_fault.empty()) return kSuccess;
  fault_text = "unspecified launch failure: " + pending_fault;
  pending_fault.clear();
  last_error = kLaunchFailure;
  return kLaunchFailure;
}

// ---- device memory ----
std::mutex alloc_mutex;
std::map<uintptr_t, size_t> allocations;
size_t allocated_bytes = 0;

bool in_allocation(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(alloc_mutex);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second;
}

#ifdef TENSOR_OPS_EMU_TRAFFIC
bool allocation_range(uintptr_t a, size_t bytes, uintptr_t* lo, uintptr_t* hi) {
  std::lock_guard<std::mutex> lock(alloc_mutex);
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return false;
  --it;
  if (!(a >= it->first && a + bytes <= it->first + it->second)) return false;
  *lo = it->first;
  *hi = it->first + it->second;
  return true;
}
#endif

Error fail(Error e) {
  last_error = e;
  return e;
}

Error check_copy(void* dst, const void* src, size_t bytes, MemcpyKind kind) {
  const bool dst_dev = kind == kHostToDevice || kind == kDeviceToDevice;
  const bool src_dev = kind == kDeviceToHost || kind == kDeviceToDevice;
  if (kind == kDefault) return kSuccess;
  if ((dst_dev && !in_allocation(dst, bytes)) || (src_dev && !in_allocation(src, bytes))) return kInvalidValue;
  if ((!dst_dev && in_allocation(dst, 1)) || (!src_dev && in_allocation(src, 1))) return kInvalidValue;
  return kSuccess;
}

}  // namespace

void enqueue_launch(const char* kernel, dim3 grid, dim3 block, size_t smem, emuStream*, std::function<void()> body) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    std::fprintf(stderr, "tensor_ops GPU emulator: kernel %s launched with grid %s block %s: invalid configuration\n",
                 kernel, dim_str(grid).c_str(), dim_str(block).c_str());
    last_error = kInvalidConfiguration;
    return;
  }
  if (smem > kMaxSmem) {
    std::fprintf(stderr, "tensor_ops GPU emulator: kernel %s asks for %zu bytes of dynamic shared memory (> %zu)\n",
                 kernel, smem, kMaxSmem);
    last_error = kInvalidValue;
    return;
  }
  Launch L{kernel, grid, block, smem, std::move(body)};
  push([L = std::move(L)]() { run_launch(L); });
}

Error malloc_device(void** ptr, size_t bytes) {
  *ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(alloc_mutex);
    if (bytes > kTotalMemory - allocated_bytes) return fail(kMemoryAllocation);
  }
  void* p = nullptr;
  if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) return fail(kMemoryAllocation);
  std::memset(p, 0xff, bytes);  // garbage, as fresh device memory is (NaN in every float type)
  std::lock_guard<std::mutex> lock(alloc_mutex);
  allocations[reinterpret_cast<uintptr_t>(p)] = bytes;
  allocated_bytes += bytes;
  *ptr = p;
  return kSuccess;
}

Error malloc_async(void** ptr, size_t bytes, emuStream*) { return malloc_device(ptr, bytes); }

namespace {
Error release(void* ptr) {
  if (!ptr) return kSuccess;
  std::lock_guard<std::mutex> lock(alloc_mutex);
  auto it = allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == allocations.end()) return kInvalidValue;
  allocated_bytes -= it->second;
  allocations.erase(it);
  std::free(ptr);
  return kSuccess;
}
}  // namespace

Error free_device(void* ptr) {
  const Error e = drain();  // cudaFree waits for the device
  if (Error r = release(ptr); r != kSuccess) return fail(r);
  return e;
}

Error free_async(void* ptr, emuStream*) {
  if (ptr && !in_allocation(ptr, 0)) return fail(kInvalidValue);
  push([ptr]() { (void)release(ptr); });
  return kSuccess;
}

Error memcpy_sync(void* dst, const void* src, size_t bytes, MemcpyKind kind) {
  if (Error e = check_copy(dst, src, bytes, kind); e != kSuccess) return fail(e);
  const Error e = drain();
  if (e != kSuccess) return e;
  std::memmove(dst, src, bytes);
  return kSuccess;
}

Error memcpy_async(void* dst, const void* src, size_t bytes, MemcpyKind kind, emuStream*) {
  if (Error e = check_copy(dst, src, bytes, kind); e != kSuccess) return fail(e);
  push([=]() { std::memmove(dst, src, bytes); });
  return kSuccess;
}

Error memset_async(void* dst, int value, size_t bytes, emuStream*) {
  if (!in_allocation(dst, bytes)) return fail(kInvalidValue);
  push([=]() { std::memset(dst, value, bytes); });
  return kSuccess;
}

Error stream_synchronize(emuStream*) { return drain(); }
Error device_synchronize() { return drain(); }

Error event_create(emuEvent** event, unsigned flags) {
  *event = new emuEvent{flags};
  return kSuccess;
}
Error event_destroy(emuEvent* event) {
  delete event;
  return kSuccess;
}
// One queue serves every stream, so stream order is program order: an event
// recorded on one stream is always complete for the work queued after it.
Error event_record(emuEvent* event, emuStream*) { return event ? kSuccess : fail(kInvalidValue); }
Error stream_wait_event(emuStream*, emuEvent* event, unsigned) { return event ? kSuccess : fail(kInvalidValue); }

Error get_last_error() {
  const Error e = last_error;
  last_error = kSuccess;
  return e;
}
Error peek_at_last_error() { return last_error; }

Error get_device_count(int* count) {
  *count = 1;
  return kSuccess;
}
Error get_device(int* device) {
  *device = 0;
  return kSuccess;
}
Error set_device(int device) { return device == 0 ? kSuccess : fail(kInvalidDevice); }

Error get_device_properties(DeviceProp* p, int device) {
  if (device != 0) return fail(kInvalidDevice);
  *p = DeviceProp{};
  std::snprintf(p->name, sizeof(p->name), "tensor_ops GPU emulator (warp %d, %s schedule)", kWarp,
                schedule_name(kSchedule));
  p->totalGlobalMem = kTotalMemory;
  p->sharedMemPerBlock = kMaxSmem;
  p->warpSize = kWarp;
  p->maxThreadsPerBlock = 1024;
  p->major = 8;
  p->minor = 0;
  p->multiProcessorCount = 1;
  p->l2CacheSize = 40 << 20;
  std::snprintf(p->gcnArchName, sizeof(p->gcnArchName), "%s", kWarp == 64 ? "gfx90a:sramecc+:xnack-" : "gfx1030");
  return kSuccess;
}

Error mem_get_info(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(alloc_mutex);
  *total_bytes = kTotalMemory;
  *free_bytes = kTotalMemory - allocated_bytes;
  return kSuccess;
}

#ifdef TENSOR_OPS_HIP
Error runtime_get_version(int* v) { return *v = 60000000, kSuccess; }  // "6.0.0"
Error driver_get_version(int* v) { return *v = 60000000, kSuccess; }
#define EMU_API "hip"
#else
Error runtime_get_version(int* v) { return *v = 12040, kSuccess; }  // "12.4"
Error driver_get_version(int* v) { return *v = 12040, kSuccess; }
#define EMU_API "cuda"
#endif

const char* error_name(Error e) {
  switch (e) {
    case kSuccess: return EMU_API "Success";
    case kInvalidValue: return EMU_API "ErrorInvalidValue";
#ifdef TENSOR_OPS_HIP
    case kMemoryAllocation: return "hipErrorOutOfMemory";
    case kNoKernelImageForDevice: return "hipErrorNoBinaryForGpu";
#else
    case kMemoryAllocation: return "cudaErrorMemoryAllocation";
    case kNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
#endif
    case kInvalidConfiguration: return EMU_API "ErrorInvalidConfiguration";
    case kInsufficientDriver: return EMU_API "ErrorInsufficientDriver";
    case kInvalidDeviceFunction: return EMU_API "ErrorInvalidDeviceFunction";
    case kNoDevice: return EMU_API "ErrorNoDevice";
    case kInvalidDevice: return EMU_API "ErrorInvalidDevice";
    case kLaunchOutOfResources: return EMU_API "ErrorLaunchOutOfResources";
    case kLaunchFailure: return EMU_API "ErrorLaunchFailure";
    case kNotSupported: return EMU_API "ErrorNotSupported";
  }
  return "unknown error";
}

const char* error_string(Error e) {
  switch (e) {
    case kSuccess: return "no error";
    case kInvalidValue: return "invalid argument";
    case kMemoryAllocation: return "out of memory";
    case kInvalidConfiguration: return "invalid configuration argument";
    case kLaunchFailure: return fault_text.empty() ? "unspecified launch failure" : fault_text.c_str();
    default: return error_name(e);
  }
}

}  // namespace emu

// The traffic build's instrumentation callbacks (see count_access); hidden,
// like everything in the plugin, so they bind inside it.
#ifdef TENSOR_OPS_EMU_TRAFFIC
#define EMU_TRAFFIC_CALLBACKS(n)                                                                 \
  extern "C" void __asan_load##n##_noabort(uintptr_t a) { emu::count_access(a, n, false); } \
  extern "C" void __asan_store##n##_noabort(uintptr_t a) { emu::count_access(a, n, true); }
EMU_TRAFFIC_CALLBACKS(1)
EMU_TRAFFIC_CALLBACKS(2)
EMU_TRAFFIC_CALLBACKS(4)
EMU_TRAFFIC_CALLBACKS(8)
EMU_TRAFFIC_CALLBACKS(16)
extern "C" void __asan_loadN_noabort(uintptr_t a, size_t n) {
  emu::count_access(a, n, false);
}
extern "C" void __asan_storeN_noabort(uintptr_t a, size_t n) {
  emu::count_access(a, n, true);
}
extern "C" void __asan_handle_no_return() {}
#endif
