// Pool vs malloc: median nanoseconds of one allocate + deallocate pair, from
// 256 B to 64 MiB, with the block in the pool's cache (the steady state of a
// training or inference loop). Prints a table and writes JSON to argv[1].
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/memory/caching_pool.h"
#include "core/memory/host_resource.h"
#include "core/memory/stats_resource.h"

using Clock = std::chrono::steady_clock;

template <class Alloc, class Free>
double median_pair_ns(size_t bytes, Alloc alloc, Free free_fn) {
  const int batch = bytes >= (size_t(1) << 20) ? 200 : 2000;
  std::vector<double> samples;
  for (int s = 0; s < 41; ++s) {
    auto t0 = Clock::now();
    for (int i = 0; i < batch; ++i) {
      void* p = alloc(bytes);
      static_cast<volatile char*>(p)[0] = 1;  // the block is really handed out
      free_fn(p, bytes);
    }
    auto t1 = Clock::now();
    samples.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / batch);
  }
  std::nth_element(samples.begin(), samples.begin() + 20, samples.end());
  return samples[20];
}

int main(int argc, char** argv) {
  tensor_ops::HostResource host;
  tensor_ops::CachingPool pool(host);
  tensor_ops::StatsResource stats(pool);
  std::FILE* json = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  if (json) std::fprintf(json, "[\n");
  std::printf("| size | pool (cached) ns | pool+stats ns | malloc/free ns | speedup |\n|---|---|---|---|---|\n");
  bool first = true;
  median_pair_ns(256, [&](size_t n) { return pool.allocate(n); }, [&](void* q, size_t n) { pool.deallocate(q, n); });
  for (size_t bytes = 256; bytes <= (size_t(64) << 20); bytes *= 4) {
    const double p = median_pair_ns(bytes, [&](size_t n) { return pool.allocate(n); },
                                    [&](void* q, size_t n) { pool.deallocate(q, n); });
    const double ps = median_pair_ns(bytes, [&](size_t n) { return stats.allocate(n); },
                                     [&](void* q, size_t n) { stats.deallocate(q, n); });
    const double m = median_pair_ns(bytes, [](size_t n) { return std::malloc(n); },
                                    [](void* q, size_t) { std::free(q); });
    char label[32];
    if (bytes >= (size_t(1) << 20))
      std::snprintf(label, sizeof(label), "%zu MiB", bytes >> 20);
    else if (bytes >= 1024)
      std::snprintf(label, sizeof(label), "%zu KiB", bytes >> 10);
    else
      std::snprintf(label, sizeof(label), "%zu B", bytes);
    std::printf("| %s | %.1f | %.1f | %.1f | %.2fx |\n", label, p, ps, m, m / p);
    if (json)
      std::fprintf(json, "%s  {\"bytes\": %zu, \"pool_ns\": %.2f, \"pool_stats_ns\": %.2f, \"malloc_ns\": %.2f}",
                   first ? "" : ",\n", bytes, p, ps, m);
    first = false;
  }
  if (json) {
    std::fprintf(json, "\n]\n");
    std::fclose(json);
  }
  return 0;
}
