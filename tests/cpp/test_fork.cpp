// fork() after tensor_ops ran (Note [fork] in core/registry.cpp and
// cpu/thread_pool.h): the child runs CPU ops on a fresh thread pool, and a
// plugin that is not TO_BACKEND_FORK_SAFE (the mock) is unusable there with
// the reason. Each child has an alarm, so a hang fails the test instead of
// hanging ctest.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cpu/cpu_backend.h"
#include "host_buffer.h"
#include "status_of.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "tensor_ops/registry.h"
#include "thrown_message.h"

#ifndef TENSOR_OPS_TEST_PLUGIN_DIR
#error "TENSOR_OPS_TEST_PLUGIN_DIR must name the directory of the mock plugins"
#endif

namespace tensor_ops {
namespace {

using ::testing::HasSubstr;
using testing::HostBuffer;
using testing::status_of;
using testing::thrown_message;

// Enough elements that silu splits over the pool (TENSOR_OPS_NUM_THREADS=4).
constexpr int64_t kElements = int64_t(1) << 20;

// Runs silu over kElements on the active backend; "" when every value is right.
std::string run_silu() {
  HostBuffer x(DType::Float32, kElements), y(DType::Float32, kElements);
  for (int64_t i = 0; i < kElements; ++i) x.set(i, float(i % 17) - 8.0f);
  silu(x.tensor({kElements}), y.tensor({kElements}));
  for (int64_t i = 0; i < kElements; ++i) {
    const float v = x.get(i), want = v / (1.0f + std::exp(-v));
    if (std::fabs(y.get(i) - want) > 1e-5f * (1.0f + std::fabs(want)))
      return "silu element " + std::to_string(i) + ": got " + std::to_string(y.get(i)) + ", want " +
             std::to_string(want);
  }
  return "";
}

// Forks; the child runs `body` (its message on failure) under a 60 s alarm
// and exits. Returns what the parent saw.
std::string in_child(const std::function<std::string()>& body) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    alarm(60);
    std::string problem;
    try {
      problem = body();
    } catch (const std::exception& e) {
      problem = std::string("threw: ") + e.what();
    }
    if (!problem.empty()) std::fprintf(stderr, "child: %s\n", problem.c_str());
    std::fflush(nullptr);
    _exit(problem.empty() ? 0 : 1);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return "waitpid failed";
  if (WIFSIGNALED(status))
    return "child killed by signal " + std::to_string(WTERMSIG(status)) +
           (WTERMSIG(status) == SIGALRM ? " (it hung for 60 s)" : "");
  return WEXITSTATUS(status) == 0 ? "" : "child failed (its message is above)";
}

class ForkTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Registry::instance().load_plugins_from(TENSOR_OPS_TEST_PLUGIN_DIR);
    ASSERT_EQ(cpu::num_threads(), 4) << "ctest sets TENSOR_OPS_NUM_THREADS=4";
    ASSERT_EQ(run_silu(), "");  // the pool's workers have run a region
  }
};

TEST_F(ForkTest, ChildRunsCpuOpsOnANewPool) {
  EXPECT_EQ(in_child([] {
              std::string p = run_silu();
              return p.empty() ? run_silu() : p;  // a second region reuses the child's workers
            }),
            "");
  EXPECT_EQ(run_silu(), "");  // the parent's pool still works
}

TEST_F(ForkTest, ChildCanResizeThePool) {
  EXPECT_EQ(in_child([] {
              cpu::set_num_threads(2);
              std::string p = run_silu();
              cpu::set_num_threads(4);
              return p.empty() ? run_silu() : p;
            }),
            "");
}

// A fork while another thread runs parallel regions: the child inherits no
// half-run region and no held lock.
TEST_F(ForkTest, ForkWhileAnotherThreadRunsOps) {
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    while (!stop.load()) run_silu();
  });
  for (int i = 0; i < 3; ++i) EXPECT_EQ(in_child(run_silu), "");
  stop = true;
  busy.join();
}

TEST_F(ForkTest, PluginWithoutForkSafeIsUnusableInTheChild) {
  ASSERT_TRUE(status_of("mock").has_value() && status_of("mock")->usable);
  Registry::instance().set_backend("mock");
  EXPECT_EQ(in_child([]() -> std::string {
              const auto s = status_of("mock");
              if (!s || s->usable) return "mock still usable after fork";
              if (s->reason.find("before fork()") == std::string::npos ||
                  s->reason.find("'spawn'") == std::string::npos)
                return "reason does not explain the fork: " + s->reason;
              const std::string thrown =
                  thrown_message<BackendUnavailable>([] { Registry::instance().active(); });
              if (thrown.find("mock runtime was initialised in the parent") == std::string::npos)
                return "set_backend('mock') then an op: " + thrown;
              if (status_of("cpu")->usable != true) return "cpu unusable after fork";
              Registry::instance().set_backend("cpu");
              return run_silu();
            }),
            "");
  EXPECT_TRUE(status_of("mock")->usable);  // the parent keeps it
  Registry::instance().set_backend("auto");
}

}  // namespace
}  // namespace tensor_ops
