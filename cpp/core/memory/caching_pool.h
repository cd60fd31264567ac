#pragma once
// CachingPool: keeps freed blocks for reuse instead of returning them to the
// device (PyTorch's caching allocator, in small).
//
// Note [Pool layout]: requests round up to 512 B. Requests up to 1 MiB are
// carved from 2 MiB segments ("small"); larger ones get a segment of their
// size rounded to 2 MiB ("large"). A free block of the right pool is reused
// by best fit and split when the remainder is worth keeping (>= 512 B small,
// > 1 MiB large); freed neighbours in a segment merge again. A segment goes
// back upstream only through release_cached() (empty_cache), when all of it
// is free. Handle-addressed memory (OpenCL cl_mem) cannot be split: with
// splittable=false every block is its own segment, reused whole when it is
// at most twice the request.
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "tensor_ops/memory.h"

namespace tensor_ops {

struct PoolStats {
  uint64_t reserved_bytes = 0, reserved_peak = 0;  // held from upstream
  uint64_t allocated_bytes = 0, allocated_peak = 0;  // handed out (rounded sizes)
  uint64_t requested_bytes = 0;                      // handed out (as asked)
  uint64_t segments = 0, active_blocks = 0;
  uint64_t cache_hits = 0, cache_misses = 0;
  uint64_t upstream_allocs = 0, upstream_frees = 0, releases = 0;
};

// Keeps freed single nodes for reuse so the steady state of the pool makes no
// calls to the system allocator (used under the pool's lock only).
template <class T>
struct NodeRecycler {
  using value_type = T;
  std::shared_ptr<std::vector<void*>> spare = std::make_shared<std::vector<void*>>();
  NodeRecycler() = default;
  template <class U>
  NodeRecycler(const NodeRecycler<U>&) {}  // rebinding: a list of its own node size
  T* allocate(size_t n) {
    if (n == 1 && !spare->empty()) {
      void* p = spare->back();
      spare->pop_back();
      return static_cast<T*>(p);
    }
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n == 1 && spare->size() < 4096) {
      try {
        spare->push_back(p);
        return;
      } catch (...) {
      }
    }
    ::operator delete(p);
  }
  ~NodeRecycler() {
    if (spare.use_count() == 1)
      for (void* p : *spare) ::operator delete(p);
  }
  // Every node comes from ::operator new, so any instance may free it.
  template <class U>
  bool operator==(const NodeRecycler<U>&) const { return true; }
  template <class U>
  bool operator!=(const NodeRecycler<U>&) const { return false; }
};

class CachingPool final : public MemoryResource {
 public:
  explicit CachingPool(MemoryResource& upstream, bool splittable = true);
  ~CachingPool() override;

  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) noexcept override;
  MemInfo mem_info() const override { return upstream_.mem_info(); }
  void release_cached() override;
  uint64_t cached_bytes() const override;
  PoolStats stats() const;
  void reset_peaks();
  // Checks the internal invariants (tests); throws Error with what broke.
  void validate() const;

  static constexpr size_t kRound = 512;
  static constexpr size_t kSmallLimit = size_t(1) << 20;
  static constexpr size_t kSegment = size_t(2) << 20;

 private:
  struct Block {
    char* ptr;
    size_t size;
    bool small;
    bool free = true;
    size_t requested = 0;
    Block* prev = nullptr;  // neighbours inside one segment
    Block* next = nullptr;
  };
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  using FreeSet = std::set<Block*, BySize, NodeRecycler<Block*>>;

  void* allocate_locked(size_t bytes);
  Block* new_segment(size_t size, bool small);
  void release_locked();
  Block* make_block(char* ptr, size_t size, bool small);
  void drop_block(Block* b);

  MemoryResource& upstream_;
  const bool splittable_;
  mutable std::mutex m_;
  FreeSet free_small_, free_large_;
  std::unordered_map<void*, Block*, std::hash<void*>, std::equal_to<void*>,
                     NodeRecycler<std::pair<void* const, Block*>>>
      active_;
  std::vector<Block*> spare_blocks_;
  std::vector<Block*> segments_;  // first block of each segment
  std::map<Block*, size_t> segment_size_;
  PoolStats stats_;
};

}  // namespace tensor_ops
