// Ops called from many threads at once give the results they give alone: on
// the CPU (one shared thread pool), on two backends at once (the CPU and the
// mock plugin, host data staged to the mock device through its pool), and
// through the C ABI (handles created and destroyed concurrently, per-thread
// last error).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend_scope.h"
#include "cpu/cpu_backend.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "tensor_ops/registry.h"
#include "tensor_ops/tensor_ops.h"

#ifndef TENSOR_OPS_TEST_PLUGIN_DIR
#error "TENSOR_OPS_TEST_PLUGIN_DIR must name the directory of the mock plugins"
#endif

namespace tensor_ops {
namespace {

using testing::BackendScope;

constexpr int kThreads = 8;
constexpr int kIterations = 40;

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-3.0f, 3.0f);
  std::vector<float> v(n);
  for (float& f : v) f = d(rng);
  return v;
}

Tensor view(std::vector<float>& v, std::vector<int64_t> shape) { return Tensor(v.data(), DType::Float32, shape); }

// One thread's work: rms_norm, softmax and silu on its own data, large enough
// for the pool to split, checked bitwise against the same calls made alone.
struct Work {
  static constexpr int64_t rows = 64, cols = 1024;
  uint32_t seed;
  std::vector<float> x, w, y_rms, y_soft, y_silu;
  explicit Work(uint32_t s)
      : seed(s), x(random_floats(rows * cols, s)), w(random_floats(cols, s + 1000)), y_rms(x.size()),
        y_soft(x.size()), y_silu(x.size()) {}
  void run() {
    rms_norm(view(x, {rows, cols}), view(w, {cols}), view(y_rms, {rows, cols}), 1e-6);
    softmax(view(x, {rows, cols}), view(y_soft, {rows, cols}), 0.7, false, false);
    silu(view(x, {rows, cols}), view(y_silu, {rows, cols}));
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs body(thread_index) on kThreads threads released at once.
template <class F>
void on_threads(F body) {
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      body(t);
    });
  for (std::thread& th : threads) th.join();
}

class Concurrency : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { Registry::instance().load_plugins_from(TENSOR_OPS_TEST_PLUGIN_DIR); }
};

TEST_F(Concurrency, CpuOpsFromEightThreadsMatchSerialResults) {
  BackendScope cpu("cpu");
  std::vector<Work> expected, got;
  for (int t = 0; t < kThreads; ++t) {
    expected.emplace_back(uint32_t(t + 1));
    expected.back().run();
    got.emplace_back(uint32_t(t + 1));
  }
  std::atomic<int> mismatches{0};
  on_threads([&](int t) {
    BackendScope scope("cpu");
    for (int i = 0; i < kIterations; ++i) {
      std::fill(got[size_t(t)].y_rms.begin(), got[size_t(t)].y_rms.end(), 0.0f);
      got[size_t(t)].run();
      if (!same_bits(got[size_t(t)].y_rms, expected[size_t(t)].y_rms) ||
          !same_bits(got[size_t(t)].y_soft, expected[size_t(t)].y_soft) ||
          !same_bits(got[size_t(t)].y_silu, expected[size_t(t)].y_silu))
        mismatches.fetch_add(1);
    }
  });
  EXPECT_EQ(mismatches.load(), 0) << "seeds 1.." << kThreads;
}

// The CPU pool resized (cpu::set_num_threads, TensorOpsConfig's cpu.threads)
// while other threads run ops: every result stays bitwise what it was alone.
TEST_F(Concurrency, CpuPoolResizedWhileOpsRun) {
  BackendScope cpu("cpu");
  const int before = cpu::num_threads();
  std::vector<Work> expected, got;
  for (int t = 0; t < kThreads; ++t) {
    expected.emplace_back(uint32_t(t + 50));
    expected.back().run();
    got.emplace_back(uint32_t(t + 50));
  }
  std::atomic<int> mismatches{0};
  on_threads([&](int t) {
    BackendScope scope("cpu");
    for (int i = 0; i < kIterations; ++i) {
      if (t == 0) {
        cpu::set_num_threads(1 + i % 4);
        continue;
      }
      got[size_t(t)].run();
      if (!same_bits(got[size_t(t)].y_rms, expected[size_t(t)].y_rms) ||
          !same_bits(got[size_t(t)].y_soft, expected[size_t(t)].y_soft) ||
          !same_bits(got[size_t(t)].y_silu, expected[size_t(t)].y_silu))
        mismatches.fetch_add(1);
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(cpu::num_threads(), 1 + (kIterations - 1) % 4);
  cpu::set_num_threads(0);
  EXPECT_EQ(cpu::num_threads(), 1);  // clamped
  cpu::set_num_threads(before);
}

TEST_F(Concurrency, CpuAndMockBackendsAtOnce) {
  ASSERT_TRUE(Registry::instance().find("mock") && Registry::instance().find("mock")->usable());
  constexpr int64_t n = 4096;
  std::atomic<int> bad{0};
  std::vector<std::string> errors(kThreads);
  on_threads([&](int t) {
    // Even threads run on the CPU, odd ones on the mock device (staged).
    const char* backend = t % 2 ? "mock" : "cpu";
    BackendScope scope(backend);
    std::vector<float> x = random_floats(n, uint32_t(100 + t)), y(n);
    try {
      for (int i = 0; i < kIterations; ++i) {
        std::fill(y.begin(), y.end(), 0.0f);
        EXPECT_EQ(backend_for(view(x, {n})), backend);
        silu(view(x, {n}), view(y, {n}));
        for (int64_t j = 0; j < n; ++j) {
          const double want = double(x[size_t(j)]) / (1.0 + std::exp(-double(x[size_t(j)])));
          if (std::fabs(y[size_t(j)] - want) > 1e-5 * (1.0 + std::fabs(want))) {
            bad.fetch_add(1);
            break;
          }
        }
      }
    } catch (const Error& e) {
      errors[size_t(t)] = e.what();
      bad.fetch_add(1);
    }
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(bad.load(), 0);
}

TEST_F(Concurrency, CAbiFromEightThreads) {
  std::atomic<int> bad{0};
  on_threads([&](int t) {
    constexpr int64_t rows = 16, cols = 256;
    std::vector<float> x = random_floats(rows * cols, uint32_t(200 + t)), w = random_floats(cols, uint32_t(300 + t)),
                       y(x.size()), want(x.size());
    rms_norm(view(x, {rows, cols}), view(w, {cols}), view(want, {rows, cols}), 1e-6);
    const int64_t shape[2] = {rows, cols}, wshape[1] = {cols};
    for (int i = 0; i < kIterations; ++i) {
      to_tensor_h hx = nullptr, hw = nullptr, hy = nullptr;
      bool ok = to_tensor_create(x.data(), TO_FLOAT32, 2, shape, nullptr, "cpu", &hx) == TO_OK &&
                to_tensor_create(w.data(), TO_FLOAT32, 1, wshape, nullptr, nullptr, &hw) == TO_OK &&
                to_tensor_create(y.data(), TO_FLOAT32, 2, shape, nullptr, nullptr, &hy) == TO_OK &&
                to_rms_norm(hx, hw, hy, 1e-6) == TO_OK && std::strcmp(to_last_error(), "") == 0 && same_bits(y, want);
      // A failure on this thread leaves its own message, whatever the others do.
      const std::string eps_error = "rms_norm: eps must be finite and >= 0, got " + std::to_string(-1.0 - t);
      ok = ok && to_rms_norm(hx, hw, hy, -1.0 - t) == TO_ERR_INVALID_ARGUMENT;
      std::this_thread::yield();
      ok = ok && eps_error == to_last_error();
      ok = ok && to_tensor_destroy(hx) == TO_OK && to_tensor_destroy(hw) == TO_OK && to_tensor_destroy(hy) == TO_OK;
      if (!ok) bad.fetch_add(1);
    }
  });
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace tensor_ops
