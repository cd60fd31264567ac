#include "tensor_ops/device_memory.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>

#include "backend_resource.h"
#include "caching_pool.h"
#include "failing_resource.h"
#include "host_resource.h"
#include "limiting_resource.h"
#include "stats_resource.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/registry.h"

namespace tensor_ops {

namespace {

std::mutex memories_mutex;

std::string human(uint64_t b) {
  char buf[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::snprintf(buf, sizeof(buf), u ? "%.2f %s" : "%.0f %s", v, units[u]);
  return buf;
}

// Requests from this size on are checked against free memory before trying.
constexpr size_t kCheckedRequest = size_t(1) << 20;

}  // namespace

DeviceMemory& DeviceMemory::of(const Device& device) {
  static auto* memories = new std::map<std::string, DeviceMemory*>();  // never freed: see header
  std::lock_guard<std::mutex> lock(memories_mutex);
  const std::string key = device.str();
  auto it = memories->find(key);
  if (it != memories->end()) return *it->second;
  DeviceMemory* m;
  if (device.is_host()) {
    m = new DeviceMemory(device, std::make_unique<HostResource>(), false);
  } else {
    Backend& b = Registry::instance().require(device.backend);
    if (device.id < 0 || device.id >= b.device_count())
      throw InvalidArgument("device " + key + " does not exist (" + b.name() + " has " +
                            std::to_string(b.device_count()) + " devices)");
    const bool handles = b.table().flags & TO_BACKEND_HANDLE_MEMORY;
    m = new DeviceMemory(device, std::make_unique<BackendResource>(b.table(), device.id), handles);
  }
  (*memories)[key] = m;
  return *m;
}

DeviceMemory::DeviceMemory(Device device, std::unique_ptr<MemoryResource> raw, bool handle_memory)
    : device_(std::move(device)), handle_memory_(handle_memory), raw_(std::move(raw)) {
  failing_ = std::make_unique<FailingResource>(*raw_);
  limit_ = std::make_unique<LimitingResource>(*failing_);
  pool_ = std::make_unique<CachingPool>(*limit_, !handle_memory_);
  stats_ = std::make_unique<StatsResource>(*pool_);
}

void DeviceMemory::inject_failures(uint64_t every_nth, uint64_t above_bytes) {
  auto* f = static_cast<FailingResource*>(failing_.get());
  f->fail_every(every_nth);
  f->fail_above(above_bytes);
}

void DeviceMemory::throw_oom(size_t bytes, double margin, const std::string& why) {
  ++num_ooms_;
  const MemInfo info = raw_->mem_info();
  const PoolStats ps = pool_->stats();
  std::string msg = "out of memory on " + device_.str() + ": tried to allocate " + human(bytes) + " (" +
                    std::to_string(bytes) + " bytes";
  if (margin > 1.0) {
    const double want = double(bytes) * margin;  // clamped: a cast past 2^64 is undefined
    msg += ", " + human(want < 1.8e19 ? uint64_t(want) : UINT64_MAX) + " with safety margin " +
           std::to_string(margin).substr(0, 4);
  }
  msg += "); device free " + human(info.free) + " of " + human(info.total) + " total; tensor_ops reserved " +
         human(ps.reserved_bytes) + ", allocated " + human(ps.allocated_bytes) + ", cached " +
         human(pool_->cached_bytes()) + " in free segments";
  if (limit_->limit()) {
    char fraction[32];
    std::snprintf(fraction, sizeof fraction, "%.3g", fraction_);  // 3.55e-05 for a 5 MiB cap, not 0.000
    msg += ", limit " + human(limit_->limit()) + " (memory fraction " + fraction + ")";
  }
  msg += ". " + why +
         " Try empty_cache(), a smaller batch size, or set_memory_fraction() with a larger fraction "
         "(tensor_ops.empty_cache() / tensor_ops.set_memory_fraction() in Python, DeviceMemory's in C++).";
  throw OutOfMemory(msg);
}

std::shared_ptr<void> DeviceMemory::allocate(size_t bytes, double safety_margin) {
  if (!(safety_margin >= 1.0) || !std::isfinite(safety_margin))
    throw InvalidArgument("safety_margin must be a finite number >= 1.0, got " + std::to_string(safety_margin));
  if (bytes == 0) return std::shared_ptr<void>(nullptr, [](void*) {});
  if (bytes >= kCheckedRequest) {
    const MemInfo info = raw_->mem_info();
    // Every free byte the pool holds, whole free segments and free blocks in
    // partly used ones alike (cached_bytes() counted only the former, so a
    // request the pool could serve from a free block was refused under a
    // cap); what cannot fit after all fails below, with the same message.
    const PoolStats ps = pool_->stats();
    const uint64_t cached = ps.reserved_bytes - std::min(ps.allocated_bytes, ps.reserved_bytes);
    double available = double(info.free) + double(cached);
    if (limit_->limit()) {
      const double headroom = double(limit_->limit()) - double(limit_->used()) + double(cached);
      available = std::min(available, headroom);
    }
    if (double(bytes) * safety_margin > available)
      throw_oom(bytes, safety_margin, "The request exceeds what the device can give.");
  }
  void* p;
  try {
    p = stats_->allocate(bytes);
  } catch (const OutOfMemory&) {
    ++num_retries_;
    pool_->release_cached();
    try {
      p = stats_->allocate(bytes);
    } catch (const OutOfMemory& e) {
      throw_oom(bytes, 1.0, std::string("The allocation failed after freeing the cache (") + e.what() + ").");
    }
  }
  StatsResource* s = stats_.get();
  return std::shared_ptr<void>(p, [s, bytes](void* q) { s->deallocate(q, bytes); });
}

Tensor DeviceMemory::empty(const std::vector<int64_t>& shape, DType dtype, double safety_margin) {
  Tensor probe(reinterpret_cast<void*>(uintptr_t(64)), dtype, shape);  // validates shape and size
  auto block = allocate(size_t(probe.nbytes()), safety_margin);
  // No elements, no block: host tensors get an aligned non-null address
  // (DLPack consumers dislike NULL), device ones NULL (on a handle-memory
  // backend any other value would be taken for a cl_mem and crash it).
  void* data = block.get()              ? block.get()
               : device_.is_host()      ? reinterpret_cast<void*>(uintptr_t(64))
                                        : nullptr;
  return Tensor(data, dtype, shape, {}, device_, block);
}

void DeviceMemory::empty_cache() { pool_->release_cached(); }

void DeviceMemory::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    throw InvalidArgument("memory fraction must be in (0, 1], got " + std::to_string(fraction));
  const MemInfo info = raw_->mem_info();
  fraction_ = fraction;
  limit_->set_limit(fraction >= 1.0 ? 0 : uint64_t(double(info.total) * fraction));
}

std::map<std::string, uint64_t> DeviceMemory::stats() const {
  const PoolStats p = pool_->stats();
  const AllocStats a = stats_->stats();
  const MemInfo info = raw_->mem_info();
  return {
      {"allocated_bytes.all.current", p.allocated_bytes},
      {"allocated_bytes.all.peak", p.allocated_peak},
      {"requested_bytes.all.current", a.current_bytes},
      {"requested_bytes.all.peak", a.peak_bytes},
      {"reserved_bytes.all.current", p.reserved_bytes},
      {"reserved_bytes.all.peak", p.reserved_peak},
      {"cached_bytes", pool_->cached_bytes()},
      {"allocation.all.current", p.active_blocks},
      {"allocation.all.allocated", a.num_allocs},
      {"allocation.all.freed", a.num_frees},
      {"segment.all.current", p.segments},
      {"segment.all.allocated", p.upstream_allocs},
      {"segment.all.freed", p.upstream_frees},
      {"cache_hits", p.cache_hits},
      {"cache_misses", p.cache_misses},
      {"num_alloc_retries", num_retries_.load()},
      {"num_ooms", num_ooms_.load()},
      {"limit_bytes", limit_->limit()},
      {"device_free_bytes", info.free},
      {"device_total_bytes", info.total},
  };
}

void DeviceMemory::reset_peak_stats() {
  pool_->reset_peaks();
  stats_->reset_peak();
}

}  // namespace tensor_ops
