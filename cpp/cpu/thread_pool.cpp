#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <new>
#include <string>

#include "../core/env.h"

namespace tensor_ops::cpu {

namespace {

constexpr int kMaxThreads = 1024;
constexpr int64_t kDefaultSpinUs = 50;  // Note [spinning workers]

int cpus_available() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n >= 1) return n;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? int(hc) : 1;
}

int read_num_threads() {
  const char* env = std::getenv("TENSOR_OPS_NUM_THREADS");
  if (!env || !*env) return cpus_available();
  long n = 0;
  const bool whole = parse_long(env, &n);
  if (whole && n >= 1 && n <= kMaxThreads) return int(n);
  if (whole && n > kMaxThreads) {
    add_env_warning("TENSOR_OPS_NUM_THREADS", env, "is above the limit of " + std::to_string(kMaxThreads) +
                                                       " threads", std::to_string(kMaxThreads));
    return kMaxThreads;
  }
  const int cpus = cpus_available();
  add_env_warning("TENSOR_OPS_NUM_THREADS", env,
                  "is not a whole number from 1 to " + std::to_string(kMaxThreads),
                  std::to_string(cpus) + " (the CPUs this process may run on)");
  return cpus;
}

int64_t read_spin_us() {
  const char* env = std::getenv("TENSOR_OPS_SPIN_US");
  if (!env || !*env) return kDefaultSpinUs;
  long n = 0;
  if (parse_long(env, &n) && n >= 0 && n <= 100000) return n;
  add_env_warning("TENSOR_OPS_SPIN_US", env, "is not a whole number from 0 to 100000",
                  std::to_string(kDefaultSpinUs));
  return kDefaultSpinUs;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::atomic<ThreadPool*> forking_pool{nullptr};  // the pool the fork handlers act on (Note [fork])

}  // namespace

int default_num_threads() {
  static const int n = read_num_threads();  // read once: a bad value warns once
  return n;
}

int64_t default_spin_us() {
  static const int64_t n = read_spin_us();
  return n;
}

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool(default_num_threads());
  return pool;
}

ThreadPool::ThreadPool(int threads) : num_threads_(threads < 1 ? 1 : threads) {
  spin_ns_ = default_spin_us() * 1000;
  start_workers();
  forking_pool = this;
  pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}

ThreadPool::~ThreadPool() {
  // Under the locks: a fork() in another thread holds them while it runs.
  {
    std::lock_guard<std::mutex> run(run_mutex_);
    forking_pool = nullptr;
  }
  stop_workers();
}

// Note [fork]: the lock order is parallel_for's (run_mutex_, then m_).
void ThreadPool::before_fork() {
  ThreadPool* p = forking_pool.load();
  if (!p) return;
  p->run_mutex_.lock();  // waits for a running region to finish
  p->m_.lock();
}

void ThreadPool::after_fork_in_parent() {
  ThreadPool* p = forking_pool.load();
  if (!p) return;
  p->m_.unlock();
  p->run_mutex_.unlock();
}

void ThreadPool::after_fork_in_child() {
  ThreadPool* p = forking_pool.load();
  if (!p) return;
  // The handles name threads this process does not have: joining or
  // destroying them is undefined, so they are moved out and never destroyed.
  new std::vector<std::thread>(std::move(p->workers_));  // leaves workers_ empty
  // Waiters of the parent's workers are recorded inside the condition
  // variables; destroying them would wait for those waiters forever.
  new (&p->start_cv_) std::condition_variable();
  new (&p->done_cv_) std::condition_variable();
  p->open_ = false;
  p->active_ = 0;
  p->stop_ = false;
  p->fn_ = nullptr;
  p->workers_started_ = false;
  p->gomp_.store(nullptr);  // libgomp's threads are not in the child either, and it does not survive fork
  p->m_.unlock();
  p->run_mutex_.unlock();
}

int ThreadPool::num_threads() const { return num_threads_.load(std::memory_order_relaxed); }

// New workers start at the current generation, so they wait for the next region.
void ThreadPool::start_workers() {
  const uint64_t seen = generation_.load();
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i, seen] { worker(i, seen); });
  workers_started_ = true;
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
    ++generation_;  // ends a worker's spin at once
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  stop_ = false;
}

void ThreadPool::set_num_threads(int threads) {
  threads = threads < 1 ? 1 : threads > kMaxThreads ? kMaxThreads : threads;
  std::lock_guard<std::mutex> run(run_mutex_);  // waits for a running region to finish
  if (threads == num_threads_) return;
  stop_workers();
  num_threads_ = threads;
  start_workers();
}

static void chunk_range(int64_t n, int64_t chunks, int64_t i, int64_t& b, int64_t& e) {
  b = n * i / chunks;
  e = n * (i + 1) / chunks;
}

// Note [chunk affinity]: participant p (the caller is 0, worker i is i)
// first takes the chunks of its own share, [p, p + 1) * chunks / parts, in
// order, then helps with the others' shares from their ends backwards.
// Every chunk is claimed once (an atomic exchange per chunk). When every
// thread is on time, each thread runs the same rows call after call, so the
// rows a call writes and the next call reads stay in that core's L2, as with
// torch's static OpenMP schedule: [32, 4096] fp32 ops on two threads, handed
// out first come first served, ran barely faster than on one (rms_norm 27.5
// against 30 us, Xeon with 4 MiB L2 per core), the rows moving between cores
// call by call. The same held for the few-row linear's weight slices in
// decode ([1, 512] x [2048, 512]^T fp32: 53.5 us, torch 46; now 42). A
// thread that is late (descheduled by another runtime's
// spinning threads) costs only the chunk it is in: the others take the rest
// of its share. The chunks themselves depend only on n, grain and the thread
// count, so results do not change.
void ThreadPool::run_chunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t chunks, int part,
                            int parts, std::atomic<uint8_t>* claimed) {
  auto take = [&](int64_t i) {
    if (claimed[i].exchange(1, std::memory_order_relaxed)) return;
    int64_t b, e;
    chunk_range(n, chunks, i, b, e);
    fn(b, e);
  };
  if (part >= parts) part %= parts;
  for (int64_t i = chunks * part / parts, end = chunks * (part + 1) / parts; i < end; ++i) take(i);
  for (int q = 1; q < parts; ++q) {
    const int r = (part + q) % parts;
    for (int64_t i = chunks * (r + 1) / parts - 1, begin = chunks * r / parts; i >= begin; --i) take(i);
  }
}

std::atomic<uint8_t>* ThreadPool::claims_for(int64_t chunks) {
  if (chunks > claimed_size_) {
    claimed_.reset(new std::atomic<uint8_t>[size_t(chunks)]);
    claimed_size_ = chunks;
  }
  for (int64_t i = 0; i < chunks; ++i) claimed_[size_t(i)].store(0, std::memory_order_relaxed);
  return claimed_.get();
}

// Note [spinning workers]: a worker that has just run (or just missed) a
// region polls the generation for spin_ns_ before it sleeps on the condition
// variable. Waking a sleeping thread costs tens of microseconds under this
// VM's scheduler, as long as a whole [32, 4096] norm: with sleeping workers
// the caller ran such calls alone (2 threads no faster than 1). Polling with
// pause keeps the next call's wake-up to a cache-line transfer. Bounded, so
// that between bursts of our ops the workers give their cores back to the
// caller's other work (torch's OpenMP threads spin likewise after each op).
void ThreadPool::spin_for_next(uint64_t seen) const {
  if (spin_ns_ <= 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 1; generation_.load(std::memory_order_acquire) == seen; ++k) {
    cpu_relax();
    if ((k & 255) == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(spin_ns_)) return;
  }
}

void ThreadPool::worker(int index, uint64_t seen) {
  bool ran = false;
  for (;;) {
    if (ran) spin_for_next(seen);
    ran = true;
    std::unique_lock<std::mutex> lock(m_);
    start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_.load();
    if (!open_) continue;  // woke after its caller finished (Note [late workers])
    ++active_;
    const auto* fn = fn_;
    const int64_t n = n_, chunks = chunks_;
    const int parts = parts_;
    std::atomic<uint8_t>* claimed = claimed_.get();
    lock.unlock();
    run_chunks(*fn, n, chunks, index, parts, claimed);
    lock.lock();
    if (--active_ == 0 && !open_) done_cv_.notify_one();
  }
}

void ThreadPool::set_openmp(GompParallel fn, OmpMaxThreads omp_max_threads) {
  std::lock_guard<std::mutex> run(run_mutex_);  // not while a region runs
  gomp_.store(fn);
  omp_max_threads_.store(fn ? omp_max_threads : nullptr);
}

// Note [team size]: an OpenMP region ends at a barrier that every member of
// its team must reach, one that runs no chunk included. A team larger than
// the caller's OpenMP thread count (torch.set_num_threads(1), our pool at 2)
// woke a thread that torch leaves asleep, and on a loaded machine waited for
// it to be scheduled: a prepared llama decoded 5x slower than with the
// counts matched (22 against 115 tokens/s, 1 thread, the other core busy).
// So on torch's threads a region's team is the smaller of the two counts.
int ThreadPool::team_size(int threads) const {
  if (gomp_.load() == nullptr) return threads;
  if (OmpMaxThreads max_threads = omp_max_threads_.load()) {
    const int omp = max_threads();
    if (omp >= 1 && omp < threads) return omp;
  }
  return threads;
}

int ThreadPool::region_threads() const { return team_size(num_threads_); }

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  std::unique_lock<std::mutex> run(run_mutex_, std::try_to_lock);
  const int threads = team_size(num_threads_);  // read under run_mutex_: set_num_threads holds it
  int64_t chunks = n / grain;
  if (chunks > int64_t(threads) * kChunksPerThread) chunks = int64_t(threads) * kChunksPerThread;
  if (threads <= 1 || chunks <= 1 || !run.owns_lock()) {
    fn(0, n);
    return;
  }
  if (GompParallel gomp = gomp_.load()) {
    // Note [torch's OpenMP threads]: torch's OpenMP workers spin for a while
    // after each of torch's parallel ops; ours then had to share a core with
    // a spinning one, and a [32, 4096] silu between torch ops took 268 us on
    // 2 threads against 220 on one (124 with torch idle). On torch's own
    // threads the region starts at once. The chunks and how they are shared
    // out are ours, as below, so results do not change.
    // Participants as in Note [chunk affinity]: the caller 0, the team's
    // other threads 1.. in the order they arrive.
    struct Region {
      const std::function<void(int64_t, int64_t)>* fn;
      int64_t n, chunks;
      int parts;
      std::atomic<uint8_t>* claimed;
      std::thread::id caller;
      std::atomic<int> arrived{1};
    } region{&fn, n, chunks, threads, claims_for(chunks), std::this_thread::get_id()};
    gomp(
        [](void* p) {
          Region& r = *static_cast<Region*>(p);
          const int part = std::this_thread::get_id() == r.caller ? 0 : r.arrived.fetch_add(1);
          run_chunks(*r.fn, r.n, r.chunks, part, r.parts, r.claimed);
        },
        &region, unsigned(threads), 0);
    return;
  }
  if (!workers_started_) start_workers();  // the first region in a forked child
  {
    std::lock_guard<std::mutex> lock(m_);
    fn_ = &fn;
    n_ = n;
    chunks_ = chunks;
    parts_ = threads;
    claims_for(chunks);
    open_ = true;
    active_ = 0;
    ++generation_;
  }
  start_cv_.notify_all();
  run_chunks(fn, n, chunks, 0, threads, claimed_.get());  // returns once every chunk is taken
  std::unique_lock<std::mutex> lock(m_);
  open_ = false;
  done_cv_.wait(lock, [&] { return active_ == 0; });
}

}  // namespace tensor_ops::cpu
