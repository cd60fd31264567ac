#include "caching_pool.h"

#include <algorithm>

#include "tensor_ops/errors.h"

namespace tensor_ops {

CachingPool::CachingPool(MemoryResource& upstream, bool splittable)
    : upstream_(upstream), splittable_(splittable) {}

CachingPool::Block* CachingPool::make_block(char* ptr, size_t size, bool small) {
  if (spare_blocks_.empty()) return new Block{ptr, size, small};
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  *b = Block{ptr, size, small};
  return b;
}

void CachingPool::drop_block(Block* b) {
  if (spare_blocks_.size() < 4096) {
    try {
      spare_blocks_.push_back(b);
      return;
    } catch (...) {
    }
  }
  delete b;
}

CachingPool::~CachingPool() {
  // Live blocks at destruction belong to a leaking caller; free what we own.
  std::lock_guard<std::mutex> lock(m_);
  for (Block* seg : segments_) {
    upstream_.deallocate(seg->ptr, segment_size_[seg]);
    for (Block* b = seg; b;) {
      Block* n = b->next;
      delete b;
      b = n;
    }
  }
  for (Block* b : spare_blocks_) delete b;
}

void* CachingPool::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(m_);
  void* p = allocate_locked(bytes);
  stats_.requested_bytes += bytes;
  active_[p]->requested = bytes;
  return p;
}

CachingPool::Block* CachingPool::new_segment(size_t size, bool small) {
  void* p = upstream_.allocate(size);  // throws OutOfMemory
  Block* b;
  try {
    b = make_block(static_cast<char*>(p), size, small);
    segments_.push_back(b);
  } catch (...) {
    upstream_.deallocate(p, size);
    throw;
  }
  segment_size_[b] = size;
  stats_.reserved_bytes += size;
  stats_.reserved_peak = std::max(stats_.reserved_peak, stats_.reserved_bytes);
  ++stats_.segments;
  ++stats_.upstream_allocs;
  return b;
}

void* CachingPool::allocate_locked(size_t bytes) {
  if (bytes > (size_t(1) << 62)) throw OutOfMemory("request of " + std::to_string(bytes) + " bytes is absurd");
  const size_t size = (bytes + kRound - 1) / kRound * kRound;
  const bool small = splittable_ && size <= kSmallLimit;
  FreeSet& pool = small ? free_small_ : free_large_;
  Block key{nullptr, size, small};
  auto it = pool.lower_bound(&key);
  Block* b = nullptr;
  if (it != pool.end() && (splittable_ || (*it)->size <= 2 * size)) {
    b = *it;
    pool.erase(it);
    ++stats_.cache_hits;
  } else {
    ++stats_.cache_misses;
    size_t seg = small ? kSegment : (splittable_ ? (size + kSegment - 1) / kSegment * kSegment : size);
    b = new_segment(seg, small);
  }
  const size_t min_rest = small ? kRound : kSmallLimit + 1;
  if (splittable_ && b->size - size >= min_rest) {
    Block* rest = make_block(b->ptr + size, b->size - size, small);
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    pool.insert(rest);
  }
  b->free = false;
  active_[b->ptr] = b;
  stats_.allocated_bytes += b->size;
  stats_.allocated_peak = std::max(stats_.allocated_peak, stats_.allocated_bytes);
  ++stats_.active_blocks;
  return b->ptr;
}

void CachingPool::deallocate(void* p, size_t) noexcept {
  if (!p) return;
  std::lock_guard<std::mutex> lock(m_);
  auto it = active_.find(p);
  if (it == active_.end()) return;  // not ours: ignore rather than corrupt
  Block* b = it->second;
  active_.erase(it);
  stats_.allocated_bytes -= b->size;
  stats_.requested_bytes -= b->requested;
  --stats_.active_blocks;
  b->free = true;
  b->requested = 0;
  FreeSet& pool = b->small ? free_small_ : free_large_;
  // Merge with free neighbours of the same segment.
  if (b->prev && b->prev->free) {
    Block* a = b->prev;
    pool.erase(a);
    a->size += b->size;
    a->next = b->next;
    if (b->next) b->next->prev = a;
    drop_block(b);
    b = a;
  }
  if (b->next && b->next->free) {
    Block* c = b->next;
    pool.erase(c);
    b->size += c->size;
    b->next = c->next;
    if (c->next) c->next->prev = b;
    drop_block(c);
  }
  pool.insert(b);
}

void CachingPool::release_locked() {
  std::vector<Block*> keep;
  for (Block* seg : segments_) {
    if (seg->free && !seg->next) {  // the whole segment is one free block
      (seg->small ? free_small_ : free_large_).erase(seg);
      const size_t size = segment_size_[seg];
      segment_size_.erase(seg);
      upstream_.deallocate(seg->ptr, size);
      stats_.reserved_bytes -= size;
      --stats_.segments;
      ++stats_.upstream_frees;
      drop_block(seg);
    } else {
      keep.push_back(seg);
    }
  }
  segments_.swap(keep);
  ++stats_.releases;
}

void CachingPool::release_cached() {
  std::lock_guard<std::mutex> lock(m_);
  release_locked();
  upstream_.release_cached();
}

uint64_t CachingPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(m_);
  uint64_t n = 0;
  for (Block* seg : segments_)
    if (seg->free && !seg->next) n += seg->size;
  return n;
}

PoolStats CachingPool::stats() const {
  std::lock_guard<std::mutex> lock(m_);
  return stats_;
}

void CachingPool::reset_peaks() {
  std::lock_guard<std::mutex> lock(m_);
  stats_.reserved_peak = stats_.reserved_bytes;
  stats_.allocated_peak = stats_.allocated_bytes;
}

void CachingPool::validate() const {
  std::lock_guard<std::mutex> lock(m_);
  uint64_t reserved = 0, allocated = 0, active = 0, free_blocks = 0;
  for (Block* seg : segments_) {
    if (seg->prev) throw Error("pool: segment head has a predecessor");
    auto sz = segment_size_.find(seg);
    if (sz == segment_size_.end()) throw Error("pool: segment without a size");
    reserved += sz->second;
    size_t covered = 0;
    for (const Block* b = seg; b; b = b->next) {
      if (b->ptr != seg->ptr + covered) throw Error("pool: blocks of a segment are not contiguous");
      covered += b->size;
      if (b->next && b->next->prev != b) throw Error("pool: broken neighbour links");
      if (b->free) {
        ++free_blocks;
        const FreeSet& pool = b->small ? free_small_ : free_large_;
        if (!pool.count(const_cast<Block*>(b))) throw Error("pool: free block missing from the free set");
        if (b->next && b->next->free) throw Error("pool: two adjacent free blocks were not merged");
      } else {
        ++active;
        allocated += b->size;
        auto a = active_.find(b->ptr);
        if (a == active_.end() || a->second != b) throw Error("pool: live block missing from the active map");
      }
    }
    if (covered != sz->second) throw Error("pool: blocks do not cover their segment");
  }
  if (free_blocks != free_small_.size() + free_large_.size()) throw Error("pool: stray entries in the free sets");
  if (active != active_.size() || active != stats_.active_blocks) throw Error("pool: active block count mismatch");
  if (reserved != stats_.reserved_bytes) throw Error("pool: reserved bytes mismatch");
  if (allocated != stats_.allocated_bytes) throw Error("pool: allocated bytes mismatch");
  if (stats_.segments != segments_.size()) throw Error("pool: segment count mismatch");
}

}  // namespace tensor_ops
