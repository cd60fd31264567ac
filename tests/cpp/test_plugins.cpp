// Plugin loading and dispatch through the plugin ABI, with the mock backends
// of mock_plugin.cpp: a usable one (lower priority than the CPU), one whose
// runtime is "missing", one built for another ABI version.
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend_scope.h"
#include "core/env.h"
#include "host_buffer.h"
#include "scoped_env.h"
#include "status_of.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "tensor_ops/registry.h"
#include "tensor_ops/stream.h"
#include "thrown_message.h"

#ifndef TENSOR_OPS_TEST_PLUGIN_DIR
#error "TENSOR_OPS_TEST_PLUGIN_DIR must name the directory of the mock plugins"
#endif

namespace tensor_ops {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using testing::BackendScope;
using testing::HostBuffer;
using testing::ScopedEnv;
using testing::status_of;
using testing::thrown_message;

const std::string kPluginDir = TENSOR_OPS_TEST_PLUGIN_DIR;
const Device kMock{"mock", 0};

// A function the mock plugin exports for the tests, from the copy the
// registry loaded.
template <class Fn>
Fn mock_symbol(const char* name) {
  const std::string path = kPluginDir + "/libtensor_ops_mock.so";
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  EXPECT_NE(handle, nullptr) << "mock plugin not loaded: " << path;
  if (!handle) return nullptr;
  auto fn = reinterpret_cast<Fn>(dlsym(handle, name));
  EXPECT_NE(fn, nullptr) << name;
  dlclose(handle);  // drops only the reference RTLD_NOLOAD took
  return fn;
}

// The last op call the mock's kernel received.
to_op_call mock_last_call() {
  auto fn = mock_symbol<const to_op_call* (*)()>("tensor_ops_mock_last_call");
  return fn ? *fn() : to_op_call{};
}

// Copies the mock has made of one kind (0 host->device, 1 device->host).
uint64_t mock_copies(int32_t kind) {
  auto fn = mock_symbol<uint64_t (*)(int32_t)>("tensor_ops_mock_copies");
  return fn ? fn(kind) : 0;
}

// stream_wait calls the mock has seen; the last one's streams.
struct MockWaits {
  uint64_t count = 0;
  void* consumer = nullptr;
  void* producer = nullptr;
};
MockWaits mock_waits() {
  MockWaits w;
  auto fn = mock_symbol<uint64_t (*)(void**, void**)>("tensor_ops_mock_waits");
  if (fn) w.count = fn(&w.consumer, &w.producer);
  return w;
}

void* handle(uintptr_t v) { return reinterpret_cast<void*>(v); }

class PluginTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { Registry::instance().load_plugins_from(kPluginDir); }
  void TearDown() override { Registry::instance().set_backend("auto"); }

  Registry& reg_ = Registry::instance();
  ScopedEnv backend_env_{"TENSOR_OPS_BACKEND", std::nullopt};
  ScopedEnv priority_env_{"TENSOR_OPS_PRIORITY", std::nullopt};
};

TEST_F(PluginTest, TheMocksWereBuiltIntoTheirDirectory) {
  for (const char* name : {"mock", "mockbroken", "mockbadabi", "mockv1"})
    EXPECT_TRUE(std::filesystem::exists(kPluginDir + "/libtensor_ops_" + name + ".so")) << name;
}

TEST_F(PluginTest, MockIsUsableBelowTheCpu) {
  const std::optional<BackendStatus> mock = status_of("mock");
  ASSERT_TRUE(mock.has_value());
  EXPECT_TRUE(mock->compiled);
  EXPECT_TRUE(mock->usable);
  EXPECT_EQ(mock->reason, "");
  EXPECT_EQ(mock->priority, 10);
  EXPECT_THAT(mock->library, EndsWith("/libtensor_ops_mock.so"));
  // Usable names come in priority order: the CPU (50) before the mock (10),
  // so the mock is never the default.
  const std::vector<std::string> usable = reg_.usable_names();
  const auto cpu = std::find(usable.begin(), usable.end(), "cpu");
  const auto mock_pos = std::find(usable.begin(), usable.end(), "mock");
  ASSERT_NE(mock_pos, usable.end());
  EXPECT_LT(cpu, mock_pos);
  EXPECT_EQ(reg_.active().name(), usable.front());
  EXPECT_NE(reg_.active().name(), "mock");
}

TEST_F(PluginTest, BrokenMockIsListedWithItsReason) {
  const std::optional<BackendStatus> s = status_of("mockbroken");
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->compiled);
  EXPECT_FALSE(s->usable);
  EXPECT_THAT(s->reason, HasSubstr("mock runtime missing"));
  EXPECT_THAT(thrown_message<BackendUnavailable>([&] { reg_.require("mockbroken"); }),
              HasSubstr("mock runtime missing"));
  EXPECT_THROW(reg_.set_backend("mockbroken"), BackendUnavailable);
  EXPECT_THROW(reg_.push_scope("mockbroken"), BackendUnavailable);
}

TEST_F(PluginTest, WrongAbiMockIsListedWithTheVersions) {
  const std::optional<BackendStatus> s = status_of("mockbadabi");
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->compiled);
  EXPECT_FALSE(s->usable);
  EXPECT_THAT(s->reason, HasSubstr("ABI version 999"));
  EXPECT_THAT(s->reason, HasSubstr("expects " + std::to_string(TENSOR_OPS_PLUGIN_ABI_MIN_VERSION) + " to " +
                                   std::to_string(TENSOR_OPS_PLUGIN_ABI_VERSION)));
  EXPECT_THAT(s->library, EndsWith("/libtensor_ops_mockbadabi.so"));
  EXPECT_EQ(reg_.find("mockbadabi"), nullptr);
  EXPECT_THAT(thrown_message<BackendUnavailable>([&] { reg_.require("mockbadabi"); }), HasSubstr("ABI version"));
}

// Each mocknull_<entry> plugin's table has that entry NULL (mock_plugin.cpp):
// refused when loaded, listed with the entry named, never called.
TEST_F(PluginTest, MalformedTablesAreListedUnusableWithTheNullEntry) {
  const std::vector<std::string> entries = split_list(TENSOR_OPS_MOCK_NULL_ENTRIES);
  ASSERT_EQ(entries.size(), 12u);
  for (const std::string& entry : entries) {
    SCOPED_TRACE(entry);
    const std::string name = "mocknull_" + entry;
    const std::string path = kPluginDir + "/libtensor_ops_" + name + ".so";
    const std::optional<BackendStatus> s = status_of(name);
    ASSERT_TRUE(s.has_value());
    EXPECT_TRUE(s->compiled);
    EXPECT_FALSE(s->usable);
    EXPECT_THAT(s->reason, HasSubstr("plugin table from " + path + " has NULL '" + entry + "'"));
    EXPECT_EQ(s->library, path);
    EXPECT_EQ(reg_.find(name), nullptr);
    EXPECT_THAT(thrown_message<BackendUnavailable>([&] { reg_.require(name); }), HasSubstr("NULL '" + entry + "'"));
  }
  HostBuffer x(DType::Float32, 4), y(DType::Float32, 4);  // the CPU still runs
  silu(x.tensor({4}), y.tensor({4}));
}

TEST_F(PluginTest, LoadingTwiceChangesNothing) {
  const std::vector<BackendStatus> before = reg_.status();
  reg_.load_plugins_from(kPluginDir);
  const std::vector<BackendStatus> after = reg_.status();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].name, before[i].name);
    EXPECT_EQ(after[i].usable, before[i].usable);
    EXPECT_EQ(after[i].reason, before[i].reason);
  }
}

TEST_F(PluginTest, DevicesIncludeTheMockDevice) {
  const std::vector<DeviceRecord> devices = reg_.devices();
  auto on = [](const char* backend) { return [backend](const DeviceRecord& d) { return d.backend == backend; }; };
  const auto mock = std::find_if(devices.begin(), devices.end(), on("mock"));
  ASSERT_NE(mock, devices.end());
  EXPECT_EQ(mock->device_id, 0);
  EXPECT_STREQ(mock->info.name, "Mock Device");
  EXPECT_EQ(mock->info.device_type, TO_DEVICE_OTHER);
  EXPECT_STREQ(mock->info.properties, "kind=mock");
  EXPECT_EQ(std::count_if(devices.begin(), devices.end(), on("mockbroken")), 0);
}

// Host data with a device backend selected is staged: copied to its device
// 0, computed there, copied back.
TEST_F(PluginTest, HostDataIsStagedThroughTheSelectedMock) {
  const uint32_t seed = 4242;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-8.0f, 8.0f);
  const int64_t rows = 2, cols = 64;
  HostBuffer x(DType::Float32, rows * cols), y(DType::Float32, rows * cols);
  for (int64_t i = 0; i < x.size(); ++i) x.set(i, dist(rng));
  for (int64_t i = 0; i < y.size(); ++i) y.set(i, std::numeric_limits<float>::quiet_NaN());
  const Tensor tx = x.tensor({rows, cols}), ty = y.tensor({rows, cols});
  const uint64_t to_device = mock_copies(0), to_host = mock_copies(1);
  {
    BackendScope scope("mock");
    EXPECT_EQ(reg_.active().name(), "mock");
    EXPECT_EQ(backend_for(tx), "mock");
    silu(tx, ty);
  }
  for (int64_t i = 0; i < x.size(); ++i) {
    const double v = x.get(i), want = v / (1 + std::exp(-v));
    ASSERT_NEAR(y.get(i), want, 1e-6 * std::max(1.0, std::fabs(want))) << "element " << i;
  }
  const to_op_call call = mock_last_call();
  EXPECT_NE(call.inputs[0].data, x.data());  // the kernel saw device copies
  EXPECT_NE(call.outputs[0].data, y.data());
  EXPECT_EQ(call.inputs[0].device_id, 0);
  EXPECT_EQ(mock_copies(0) - to_device, 1u);
  EXPECT_EQ(mock_copies(1) - to_host, 1u);

  // In place, through the staging copies.
  reg_.set_backend("mock");
  silu(tx, tx);
  for (int64_t i = 0; i < x.size(); ++i) ASSERT_EQ(x.bits(i), y.bits(i)) << "element " << i;
  reg_.set_backend("auto");
  EXPECT_NE(reg_.active().name(), "mock");
  EXPECT_NE(backend_for(tx), "mock");
}

TEST_F(PluginTest, StagingChecks) {
  HostBuffer x(DType::Float32, 4 * 8), w(DType::Float32, 4), y(DType::Float32, 4 * 8);
  BackendScope scope("mock");
  // Staging takes contiguous tensors only (Python retries with copies).
  EXPECT_THAT(thrown_message<LayoutError>([&] { silu(x.tensor({4, 4}, {8, 1}), y.tensor({4, 4})); }),
              HasSubstr("staging to mock:0"));
  EXPECT_THROW(silu(x.tensor({4, 4}), y.tensor({4, 4}, {8, 1})), LayoutError);
  // An op the mock lacks fails before anything is copied.
  const uint64_t to_device = mock_copies(0);
  const std::string msg =
      thrown_message<Unsupported>([&] { rms_norm(x.tensor({8, 4}), w.tensor({4}), y.tensor({8, 4})); });
  EXPECT_THAT(msg, HasSubstr("rms_norm"));
  EXPECT_THAT(msg, HasSubstr("'mock'"));
  EXPECT_EQ(mock_copies(0), to_device);
  // The kernel's own error comes through after staging.
  HostBuffer h(DType::Float16, 8), hy(DType::Float16, 8);
  EXPECT_THAT(thrown_message<Unsupported>([&] { silu(h.tensor({8}), hy.tensor({8})); }), HasSubstr("float32 only"));
}

TEST_F(PluginTest, SelectionVariablesReachTheMock) {
  {
    ScopedEnv env("TENSOR_OPS_PRIORITY", "mock,cpu");
    EXPECT_EQ(reg_.active().name(), "mock");
  }
  {
    ScopedEnv env("TENSOR_OPS_PRIORITY", "mockbroken,cpu");
    EXPECT_EQ(reg_.active().name(), "cpu");
  }
  {
    ScopedEnv env("TENSOR_OPS_BACKEND", "mock");
    EXPECT_EQ(reg_.active().name(), "mock");
  }
  {
    ScopedEnv env("TENSOR_OPS_BACKEND", "mockbroken");
    EXPECT_THROW(reg_.active(), BackendUnavailable);
  }
}

TEST_F(PluginTest, SiluOnMockDeviceDataRunsTheMockKernel) {
  const uint32_t seed = 7011;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-8.0f, 8.0f);
  const int64_t rows = 3, cols = 5, ld = 8;  // strided rows exercise the view the core passes
  HostBuffer x(DType::Float32, rows * ld), y(DType::Float32, rows * cols);
  for (int64_t i = 0; i < x.size(); ++i) x.set(i, dist(rng));
  for (int64_t i = 0; i < y.size(); ++i) y.set(i, std::numeric_limits<float>::quiet_NaN());
  const Tensor tx = x.tensor({rows, cols}, {ld, 1}, kMock), ty = y.tensor({rows, cols}, {}, kMock);

  EXPECT_EQ(backend_for(tx), "mock");
  silu(tx, ty);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double v = x.get(r * ld + c);
      const double want = v / (1 + std::exp(-v));
      EXPECT_NEAR(y.get(r * cols + c), want, 1e-6 * std::max(1.0, std::fabs(want))) << "row " << r << " col " << c;
    }

  const to_op_call call = mock_last_call();
  EXPECT_EQ(call.op, int32_t(OpId::silu));
  EXPECT_EQ(call.n_inputs, 1);
  EXPECT_EQ(call.n_outputs, 1);
  EXPECT_EQ(call.inputs[0].data, x.data());
  EXPECT_EQ(call.inputs[0].ndim, 2);
  EXPECT_EQ(call.inputs[0].strides[0], ld);
  EXPECT_EQ(call.outputs[0].strides[0], cols);
  EXPECT_EQ(call.outputs[0].device_id, 0);
}

TEST_F(PluginTest, MockReceivesCollapsedRows) {
  HostBuffer x(DType::Float32, 2 * 3 * 4), y(DType::Float32, 2 * 3 * 4);
  for (int64_t i = 0; i < x.size(); ++i) x.set(i, float(i) / 8);
  silu(x.tensor({2, 3, 4}, {}, kMock), y.tensor({2, 3, 4}, {}, kMock));
  const to_op_call call = mock_last_call();
  EXPECT_EQ(call.inputs[0].shape[0], 6);
  EXPECT_EQ(call.inputs[0].shape[1], 4);
  EXPECT_EQ(call.inputs[0].strides[0], 4);
  EXPECT_EQ(call.inputs[0].strides[1], 1);
  EXPECT_FLOAT_EQ(y.get(23), float(23.0 / 8 / (1 + std::exp(-23.0 / 8))));
}

TEST_F(PluginTest, KernelErrorsCarryTheBackendsMessage) {
  HostBuffer x(DType::Float16, 4), y(DType::Float16, 4);
  const std::string msg =
      thrown_message<Unsupported>([&] { silu(x.tensor({4}, {}, kMock), y.tensor({4}, {}, kMock)); });
  EXPECT_THAT(msg, HasSubstr("mock: silu: "));
  EXPECT_THAT(msg, HasSubstr("float32 only"));
}

TEST_F(PluginTest, OpsTheMockLacksAreUnsupported) {
  HostBuffer x(DType::Float32, 8), w(DType::Float32, 4), y(DType::Float32, 8);
  const Tensor tx = x.tensor({2, 4}, {}, kMock), tw = w.tensor({4}, {}, kMock), ty = y.tensor({2, 4}, {}, kMock);
  const std::string msg = thrown_message<Unsupported>([&] { rms_norm(tx, tw, ty); });
  EXPECT_THAT(msg, HasSubstr("rms_norm"));
  EXPECT_THAT(msg, HasSubstr("'mock'"));
  EXPECT_THAT(thrown_message<Unsupported>([&] { gelu(tx, ty); }), HasSubstr("gelu"));
}

// The mock's table lacks TO_BACKEND_NORM_OFFSET: a nonzero rms_norm weight
// offset is refused by the core with the backend's name (an older plugin
// would read only scalars[0] and silently drop it).
TEST_F(PluginTest, WeightOffsetNeedsTheBackendsFlag) {
  HostBuffer x(DType::Float32, 8), w(DType::Float32, 4), y(DType::Float32, 8), dw(DType::Float32, 4);
  const Tensor tx = x.tensor({2, 4}, {}, kMock), tw = w.tensor({4}, {}, kMock), ty = y.tensor({2, 4}, {}, kMock),
               tdw = dw.tensor({4}, {}, kMock);
  std::string msg = thrown_message<Unsupported>([&] { rms_norm(tx, tw, ty, 1e-6, 1.0); });
  EXPECT_THAT(msg, HasSubstr("rms_norm: backend 'mock' does not implement the weight offset"));
  msg = thrown_message<Unsupported>([&] { rms_norm_backward(tx, tx, tw, ty, tdw, 1e-6, -0.5); });
  EXPECT_THAT(msg, HasSubstr("rms_norm_backward: backend 'mock' does not implement the weight offset"));
}

TEST_F(PluginTest, MockDeviceChecks) {
  HostBuffer x(DType::Float32, 4), y(DType::Float32, 4);
  // One device: mock:1 does not exist.
  EXPECT_THAT(thrown_message<InvalidArgument>([&] {
                silu(x.tensor({4}, {}, Device{"mock", 1}), y.tensor({4}, {}, Device{"mock", 1}));
              }),
              HasSubstr("mock has 1 devices"));
  // Tensors of one call share a device.
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { silu(x.tensor({4}, {}, kMock), y.tensor({4})); }),
              HasSubstr("out is on cpu but x is on mock:0"));
  EXPECT_THROW(silu(x.tensor({4}, {}, Device{"mockbroken", 0}), y.tensor({4}, {}, Device{"mockbroken", 0})),
               BackendUnavailable);
}

}  // namespace
}  // namespace tensor_ops

namespace tensor_ops {
namespace {

TEST_F(PluginTest, AnAbi1PluginStillLoadsWithoutStreams) {
  const std::optional<BackendStatus> s = status_of("mockv1");
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->usable) << s->reason;
  ASSERT_NE(reg_.find("mockv1"), nullptr);
  EXPECT_EQ(reg_.find("mockv1")->table().abi_version, 1u);
  const Device v1{"mockv1", 0};
  EXPECT_FALSE(has_streams(v1));
  EXPECT_THAT(thrown_message<Unsupported>([&] { stream_wait(v1, handle(0x10), nullptr); }),
              HasSubstr("mockv1:0 has no streams"));
  // Its kernels run as before; the stream field is there for them to ignore.
  HostBuffer x(DType::Float32, 4), y(DType::Float32, 4);
  for (int64_t i = 0; i < 4; ++i) x.set(i, float(i));
  silu(x.tensor({4}, {}, v1), y.tensor({4}, {}, v1));
  EXPECT_FLOAT_EQ(y.get(3), float(3.0 / (1 + std::exp(-3.0))));
}

TEST_F(PluginTest, KernelsRunOnTheThreadsStreamForTheirDevice) {
  HostBuffer x(DType::Float32, 8), y(DType::Float32, 8);
  const Tensor tx = x.tensor({2, 4}, {}, kMock), ty = y.tensor({2, 4}, {}, kMock);
  silu(tx, ty);
  EXPECT_EQ(mock_last_call().stream, nullptr) << "no stream set: the default";
  {
    StreamScope outer(kMock, handle(0x1000));
    EXPECT_EQ(current_stream(kMock), handle(0x1000));
    silu(tx, ty);
    EXPECT_EQ(mock_last_call().stream, handle(0x1000));
    {
      StreamScope inner(kMock, handle(0x2000));
      silu(tx, ty);
      EXPECT_EQ(mock_last_call().stream, handle(0x2000));
    }
    silu(tx, ty);
    EXPECT_EQ(mock_last_call().stream, handle(0x1000)) << "the inner scope restored the outer stream";
    // A stream set for another device does not leak onto this one.
    StreamScope other(Device{"mock", 1}, handle(0x3000));
    silu(tx, ty);
    EXPECT_EQ(mock_last_call().stream, handle(0x1000));
  }
  EXPECT_EQ(current_stream(kMock), nullptr);
  silu(tx, ty);
  EXPECT_EQ(mock_last_call().stream, nullptr);
}

TEST_F(PluginTest, StreamsAreThreadLocal) {
  HostBuffer x(DType::Float32, 4), y(DType::Float32, 4);
  StreamScope mine(kMock, handle(0x1000));
  void* seen = handle(1);
  std::thread([&] {
    seen = current_stream(kMock);
    silu(x.tensor({4}, {}, kMock), y.tensor({4}, {}, kMock));
  }).join();
  EXPECT_EQ(seen, nullptr);
  EXPECT_EQ(mock_last_call().stream, nullptr) << "the other thread ran on its default stream";
}

TEST_F(PluginTest, HostDataStagedToTheMockRunsOnTheDefaultStream) {
  // Staging copies are blocking on the default stream: the kernel between
  // them must be on it too, whatever stream is set for the device.
  BackendScope use("mock");
  StreamScope s(kMock, handle(0x1000));
  HostBuffer x(DType::Float32, 4), y(DType::Float32, 4);
  silu(x.tensor({4}), y.tensor({4}));
  EXPECT_EQ(mock_last_call().stream, nullptr);
}

TEST_F(PluginTest, StreamWaitReachesThePlugin) {
  EXPECT_TRUE(has_streams(kMock));
  const MockWaits before = mock_waits();
  stream_wait(kMock, handle(0x2), handle(0x1000));
  const MockWaits after = mock_waits();
  EXPECT_EQ(after.count, before.count + 1);
  EXPECT_EQ(after.consumer, handle(0x2));
  EXPECT_EQ(after.producer, handle(0x1000));
  EXPECT_THAT(thrown_message<DeviceError>([&] { stream_wait(kMock, handle(0xbad), nullptr); }),
              HasSubstr("invalid resource handle"));
  EXPECT_EQ(mock_waits().count, after.count);
}

TEST_F(PluginTest, StreamWaitNeedsAStreamBackend) {
  EXPECT_FALSE(has_streams(Device{}));
  EXPECT_FALSE(has_streams(Device{"cpu", 0}));
  EXPECT_FALSE(has_streams(Device{"mockbroken", 0}));
  EXPECT_THAT(thrown_message<Unsupported>([&] { stream_wait(Device{}, nullptr, nullptr); }), HasSubstr("host memory"));
  EXPECT_THROW(stream_wait(Device{"mockbroken", 0}, nullptr, nullptr), Unsupported);
}

}  // namespace
}  // namespace tensor_ops
