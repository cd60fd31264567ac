#pragma once
// A fixed pool of worker threads for the CPU kernels. Size: the
// TENSOR_OPS_NUM_THREADS environment variable, else the CPUs this process may
// run on. One parallel region at a time; a caller that finds the pool busy
// (another thread's op) runs its work inline instead of waiting.
//
// Note [fork]: fork() copies only the calling thread. pthread_atfork handlers
// take the pool's locks before fork (so no region is half-run and no lock is
// held by a thread the child lacks), release them in the parent, and in the
// child reset the bookkeeping: the parent's worker handles are abandoned (the
// threads do not exist there), the condition variables are re-created (their
// waiters vanished) and the first parallel region starts new workers.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tensor_ops::cpu {

class ThreadPool {
 public:
  static ThreadPool& instance();
  ~ThreadPool();
  int num_threads() const;
  // Resizes the pool (1..1024 threads) once no parallel region is running;
  // regions started afterwards use the new size.
  void set_num_threads(int threads);
  // Calls fn(begin, end) over [0, n) split into at most
  // kChunksPerThread * num_threads() ranges of at least `grain` items each,
  // shared out to the calling thread and the workers, each taking its own
  // share first and then helping with the others' (Note [chunk affinity]). The split
  // depends only on n, grain and the thread count, never on timing.
  static constexpr int kChunksPerThread = 8;
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
  // Note [torch's OpenMP threads]: with an OpenMP runtime's GOMP_parallel
  // entry point set (the one torch loaded), regions run on that runtime's
  // threads instead of ours; nullptr: our workers. Off in a forked child.
  using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
  // omp_max_threads: that runtime's omp_get_max_threads (or nullptr). With
  // it a region's team is no larger than the caller's OpenMP thread count:
  // torch.set_num_threads(1) makes our regions inline too (Note [team size]).
  using OmpMaxThreads = int (*)();
  void set_openmp(GompParallel fn, OmpMaxThreads omp_max_threads = nullptr);
  bool uses_openmp() const { return gomp_.load() != nullptr; }
  // The threads a region started now from this thread would run on.
  int region_threads() const;

 private:
  explicit ThreadPool(int threads);
  void start_workers();
  void stop_workers();
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();
  void worker(int index, uint64_t seen);
  void spin_for_next(uint64_t seen) const;
  // Runs the chunks participant `part` of `parts` claims (Note [chunk affinity]).
  static void run_chunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t chunks, int part,
                         int parts, std::atomic<uint8_t>* claimed);
  std::atomic<uint8_t>* claims_for(int64_t chunks);  // reset claim flags for a region (run_mutex_ held)

  std::atomic<int> num_threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one parallel region at a time
  std::mutex m_;
  std::condition_variable start_cv_, done_cv_;
  // Written under m_; read without it by workers spinning (Note [spinning workers]).
  std::atomic<uint64_t> generation_{0};
  int64_t spin_ns_ = 0;
  // Note [late workers]: a region is open while its caller still runs
  // chunks; a worker joins it (active_ + 1) only while it is open. The caller
  // then closes it and waits for the workers that joined, never for one that
  // has not woken yet: a worker descheduled by another runtime's spinning
  // threads (torch's OpenMP pool on the same cores) costs no wait; it finds
  // the region closed when it runs and goes back to sleep.
  bool open_ = false;
  int active_ = 0;
  int64_t n_ = 0, chunks_ = 0;
  int parts_ = 1;  // the region's participants: the caller (0) and workers 1..parts_-1
  std::unique_ptr<std::atomic<uint8_t>[]> claimed_;  // per chunk: taken (Note [chunk affinity])
  int64_t claimed_size_ = 0;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  bool stop_ = false;
  bool workers_started_ = false;  // false in a child forked after they started (Note [fork])
  std::atomic<GompParallel> gomp_{nullptr};
  std::atomic<OmpMaxThreads> omp_max_threads_{nullptr};
  int team_size(int threads) const;
};

// TENSOR_OPS_NUM_THREADS when it is a whole number from 1 to 1024 (a larger
// one is capped at 1024), else the CPUs this process may run on; a malformed
// value is reported once through environment_warnings() (core/env.h).
int default_num_threads();

// TENSOR_OPS_SPIN_US: how long (microseconds, 0..100000) an idle worker keeps
// polling for the next region before it sleeps (Note [spinning workers]).
int64_t default_spin_us();

}  // namespace tensor_ops::cpu
