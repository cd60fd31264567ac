// The registry as a process without plugins sees it: the built-in CPU
// backend, the accelerator backends this build knows but did not compile, and
// backend selection (scope > set_backend > TENSOR_OPS_BACKEND >
// TENSOR_OPS_PRIORITY > priority). Plugin loading is in test_plugins.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend_scope.h"
#include "cpu/cpu_backend.h"
#include "scoped_env.h"
#include "status_of.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "tensor_ops/registry.h"
#include "thrown_message.h"

namespace tensor_ops {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::BackendScope;
using testing::ScopedEnv;
using testing::status_of;
using testing::thrown_message;

const char* const kAccelerators[] = {"cuda", "hip", "sycl", "opencl"};

// An accelerator backend this build did not compile (a build with a vendor
// compiler may have compiled them all; tests that need one skip then).
std::optional<std::string> uncompiled_accelerator() {
  for (const char* name : kAccelerators) {
    const std::optional<BackendStatus> s = status_of(name);
    if (s && !s->compiled) return std::string(name);
  }
  return std::nullopt;
}

#define TENSOR_OPS_REQUIRE_UNCOMPILED(var)                                                  \
  const std::optional<std::string> var##_opt = uncompiled_accelerator();                   \
  if (!var##_opt) GTEST_SKIP() << "every accelerator backend was compiled in this build"; \
  const std::string var = *var##_opt

// Every test starts on automatic selection with the selection variables unset.
class RegistryTest : public ::testing::Test {
 protected:
  void TearDown() override { Registry::instance().set_backend("auto"); }

  Registry& reg_ = Registry::instance();
  ScopedEnv backend_env_{"TENSOR_OPS_BACKEND", std::nullopt};
  ScopedEnv priority_env_{"TENSOR_OPS_PRIORITY", std::nullopt};
};

TEST_F(RegistryTest, StatusListsTheBuiltInCpu) {
  const std::vector<BackendStatus> all = reg_.status();
  EXPECT_EQ(std::count_if(all.begin(), all.end(), [](const BackendStatus& s) { return s.name == "cpu"; }), 1);
  const std::optional<BackendStatus> cpu = status_of("cpu");
  ASSERT_TRUE(cpu.has_value());
  EXPECT_TRUE(cpu->compiled);
  EXPECT_TRUE(cpu->usable);
  EXPECT_EQ(cpu->reason, "");
  EXPECT_EQ(cpu->priority, 50);
  EXPECT_EQ(cpu->library, "built-in");
  // Usable backends come first, highest priority first.
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.front().name, reg_.usable_names().front());
}

TEST_F(RegistryTest, StatusListsEveryAcceleratorWithAReason) {
  for (const char* name : kAccelerators) {
    SCOPED_TRACE(name);
    const std::optional<BackendStatus> s = status_of(name);
    ASSERT_TRUE(s.has_value());
    if (!s->compiled) {
      EXPECT_FALSE(s->usable);
      EXPECT_THAT(s->reason, HasSubstr("not compiled"));
    }
    EXPECT_EQ(s->usable, s->reason.empty()) << s->reason;
  }
}

TEST_F(RegistryTest, DevicesHaveTheCpu) {
  const std::vector<DeviceRecord> devices = reg_.devices();
  const auto cpu =
      std::find_if(devices.begin(), devices.end(), [](const DeviceRecord& d) { return d.backend == "cpu"; });
  ASSERT_NE(cpu, devices.end());
  EXPECT_EQ(cpu->device_id, 0);
  EXPECT_GT(std::string(cpu->info.name).size(), 0u);
  EXPECT_EQ(cpu->info.device_type, TO_DEVICE_CPU);
  EXPECT_EQ(cpu->info.is_available, 1);
  EXPECT_GT(cpu->info.total_memory_bytes, 0u);
  const std::string props = cpu->info.properties;
  EXPECT_THAT(props, HasSubstr("isa=" + cpu::active_isa() + "\n"));
  EXPECT_THAT(props, HasSubstr("supported_isas=baseline"));
  EXPECT_EQ(std::string(cpu->info.compute_capability), cpu::active_isa());
}

TEST_F(RegistryTest, FindAndNames) {
  ASSERT_NE(reg_.find("cpu"), nullptr);
  EXPECT_EQ(reg_.find("cpu")->name(), "cpu");
  EXPECT_EQ(reg_.find("nonexistent"), nullptr);
  const std::vector<std::string> known = reg_.known_names();
  EXPECT_THAT(known, Contains("cpu"));
  for (const char* name : kAccelerators) EXPECT_THAT(known, Contains(name));
  EXPECT_THAT(reg_.usable_names(), Contains("cpu"));
  TENSOR_OPS_REQUIRE_UNCOMPILED(missing);
  EXPECT_EQ(reg_.find(missing), nullptr);  // known, but no plugin was loaded
  EXPECT_THAT(reg_.usable_names(), Not(Contains(missing)));
}

TEST_F(RegistryTest, CpuBackendObject) {
  Backend& cpu = reg_.require("cpu");
  EXPECT_TRUE(cpu.usable());
  EXPECT_EQ(cpu.priority(), 50);
  EXPECT_EQ(cpu.device_count(), 1);
  EXPECT_EQ(cpu.library(), "built-in");
  EXPECT_EQ(cpu.table().abi_version, TENSOR_OPS_PLUGIN_ABI_VERSION);
  // The CPU backend implements every declared op; ids past the list are empty.
  int n_ops = 0;
#define TENSOR_OPS_OP(name, id, n_in, n_out) ++n_ops;
#include "tensor_ops/ops.def"
#undef TENSOR_OPS_OP
  for (int op = 0; op < n_ops; ++op) EXPECT_NE(cpu.table().kernels[op], nullptr) << op_name(OpId(op));
  EXPECT_EQ(cpu.table().kernels[n_ops], nullptr);
}

TEST_F(RegistryTest, CheckThrowsTheClassOfTheStatusWithTheBackendsMessage) {
  Backend& cpu = reg_.require("cpu");
  EXPECT_NO_THROW(cpu.check(TO_OK, "noop"));
  // A failing call leaves its message in last_error(); check() quotes it.
  to_device_info info{};
  const to_status st = cpu.table().device_info(7, &info);
  ASSERT_EQ(st, TO_ERR_INVALID_ARGUMENT);
  const std::string msg = thrown_message<InvalidArgument>([&] { cpu.check(st, "device_info"); });
  EXPECT_THAT(msg, HasSubstr("cpu: device_info: "));
  EXPECT_THAT(msg, HasSubstr("asked for 7"));

  EXPECT_THROW(cpu.check(TO_ERR_UNSUPPORTED, "x"), Unsupported);
  EXPECT_THROW(cpu.check(TO_ERR_BACKEND_UNAVAILABLE, "x"), BackendUnavailable);
  EXPECT_THROW(cpu.check(TO_ERR_OUT_OF_MEMORY, "x"), OutOfMemory);
  EXPECT_THROW(cpu.check(TO_ERR_DEVICE, "x"), DeviceError);
  try {
    cpu.check(TO_ERR_INTERNAL, "x");
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), TO_ERR_INTERNAL);
  }
}

TEST_F(RegistryTest, RequireUnknownNameListsTheValidBackends) {
  const std::string msg = thrown_message<InvalidArgument>([&] { reg_.require("nonexistent"); });
  EXPECT_THAT(msg, HasSubstr("'nonexistent'"));
  EXPECT_THAT(msg, HasSubstr("cpu"));
  EXPECT_THAT(msg, HasSubstr("cuda"));
}

TEST_F(RegistryTest, RequireUncompiledBackendSaysWhy) {
  TENSOR_OPS_REQUIRE_UNCOMPILED(missing);
  const std::string msg = thrown_message<BackendUnavailable>([&] { reg_.require(missing); });
  EXPECT_THAT(msg, HasSubstr("'" + missing + "'"));
  EXPECT_THAT(msg, HasSubstr("not compiled"));
  EXPECT_THAT(msg, HasSubstr("usable backends: "));
  EXPECT_THAT(msg, HasSubstr("cpu"));
}

TEST_F(RegistryTest, AutoSelectsTheHighestPriorityUsableBackend) {
  const std::vector<std::string> usable = reg_.usable_names();
  ASSERT_FALSE(usable.empty());
  EXPECT_EQ(reg_.active().name(), usable.front());
  EXPECT_EQ(reg_.selected_name(), usable.front());
  if (usable.size() == 1) {
    EXPECT_EQ(usable.front(), "cpu");
  }
}

TEST_F(RegistryTest, SetBackendValidatesTheName) {
  reg_.set_backend("cpu");
  EXPECT_EQ(reg_.active().name(), "cpu");
  EXPECT_THROW(reg_.set_backend("nonexistent"), InvalidArgument);
  EXPECT_EQ(reg_.active().name(), "cpu");
  EXPECT_NO_THROW(reg_.set_backend("auto"));
  EXPECT_NO_THROW(reg_.set_backend(""));
  EXPECT_EQ(reg_.active().name(), reg_.usable_names().front());
  TENSOR_OPS_REQUIRE_UNCOMPILED(missing);
  EXPECT_THROW(reg_.set_backend(missing), BackendUnavailable);
}

// With only the CPU usable, precedence shows through a bad TENSOR_OPS_BACKEND:
// active() throws unless something ranked above the variable chose a backend.
TEST_F(RegistryTest, SetBackendOutranksTheEnvironmentUntilAuto) {
  ScopedEnv env("TENSOR_OPS_BACKEND", "bogus");
  EXPECT_THROW(reg_.active(), InvalidArgument);
  reg_.set_backend("cpu");
  EXPECT_EQ(reg_.active().name(), "cpu");
  // A rejected name keeps the earlier choice.
  EXPECT_THROW(reg_.set_backend("nonexistent"), InvalidArgument);
  EXPECT_EQ(reg_.active().name(), "cpu");
  reg_.set_backend("auto");
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { reg_.active(); }), HasSubstr("bogus"));
}

TEST_F(RegistryTest, ScopesNestOutrankTheEnvironmentAndAreThreadLocal) {
  ScopedEnv env("TENSOR_OPS_BACKEND", "bogus");
  {
    BackendScope outer("cpu");
    EXPECT_EQ(reg_.active().name(), "cpu");
    {
      BackendScope inner("cpu");
      EXPECT_EQ(reg_.active().name(), "cpu");
    }
    EXPECT_EQ(reg_.active().name(), "cpu");
    // Another thread has its own (empty) scope stack, so it sees the variable.
    bool other_thread_threw = false;
    std::thread([&] {
      try {
        reg_.active();
      } catch (const InvalidArgument&) {
        other_thread_threw = true;
      }
    }).join();
    EXPECT_TRUE(other_thread_threw);
  }
  EXPECT_THROW(reg_.active(), InvalidArgument);
  EXPECT_NO_THROW(reg_.pop_scope());  // popping an empty stack does nothing
}

TEST_F(RegistryTest, SetScopesReplacesThisThreadsStackAndCheckScopeValidates) {
  // What the Python binding mirrors from use()'s context variable.
  EXPECT_THROW(reg_.check_scope("nonexistent"), InvalidArgument);
  EXPECT_NO_THROW(reg_.check_scope("cpu"));
  EXPECT_NO_THROW(reg_.check_scope("auto"));
  reg_.set_scopes({"auto", "cpu"});
  EXPECT_EQ(reg_.active().name(), "cpu");
  std::string other_thread;
  std::thread([&] {
    reg_.set_scopes({"cpu"});  // another thread's stack, its own
    other_thread = reg_.active().name();
    reg_.set_scopes({});
  }).join();
  EXPECT_EQ(other_thread, "cpu");
  EXPECT_EQ(reg_.active().name(), "cpu");  // this thread's still there
  reg_.set_scopes({});
  EXPECT_NO_THROW(reg_.pop_scope());  // empty
}

TEST_F(RegistryTest, PushScopeRejectsBadNamesAndPushesNothing) {
  ScopedEnv env("TENSOR_OPS_BACKEND", "bogus");
  EXPECT_THROW(reg_.push_scope("nonexistent"), InvalidArgument);
  if (const std::optional<std::string> missing = uncompiled_accelerator()) {
    EXPECT_THROW(reg_.push_scope(*missing), BackendUnavailable);
  }
  // Nothing was pushed: active() still fails on the variable, not the scope.
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { reg_.active(); }), HasSubstr("'bogus'"));
}

TEST_F(RegistryTest, BackendVariableForcesABackend) {
  {
    ScopedEnv env("TENSOR_OPS_BACKEND", "cpu");
    EXPECT_EQ(reg_.active().name(), "cpu");
  }
  {
    ScopedEnv env("TENSOR_OPS_BACKEND", "auto");
    EXPECT_EQ(reg_.active().name(), reg_.usable_names().front());
  }
  if (const std::optional<std::string> missing = uncompiled_accelerator()) {
    ScopedEnv env("TENSOR_OPS_BACKEND", *missing);
    EXPECT_THAT(thrown_message<BackendUnavailable>([&] { reg_.active(); }), HasSubstr("not compiled"));
  }
  {
    ScopedEnv env("TENSOR_OPS_BACKEND", "bogus");
    const std::string msg = thrown_message<InvalidArgument>([&] { reg_.active(); });
    EXPECT_THAT(msg, HasSubstr("'bogus'"));
    EXPECT_THAT(msg, HasSubstr("valid backends: cpu"));
    for (const char* name : kAccelerators) EXPECT_THAT(msg, HasSubstr(name));
  }
}

// Names served outside the core (the Python XLA shim registers "xla", "tpu"):
// unknown until registered; then every selection path accepts them, the
// native choice stays automatic, and ops on host data are refused with
// ExternalBackendSelected so that the registering layer runs them.
TEST_F(RegistryTest, ExternalBackendsAreSelectableAndRefuseHostOps) {
  {
    ScopedEnv env("TENSOR_OPS_BACKEND", "shim");
    EXPECT_THAT(thrown_message<InvalidArgument>([&] { reg_.active(); }), HasSubstr("unknown backend 'shim'"));
  }
  reg_.set_external_backends({"shim"});
  const std::string automatic = reg_.usable_names().front();
  {
    ScopedEnv env("TENSOR_OPS_BACKEND", "shim");
    EXPECT_EQ(reg_.active().name(), automatic);
    EXPECT_EQ(reg_.selected_name(), "shim");
    EXPECT_THROW(reg_.host_backend(), ExternalBackendSelected);
    {
      BackendScope cpu("cpu");  // an inner native scope wins
      EXPECT_EQ(reg_.host_backend().name(), "cpu");
    }
  }
  {
    ScopedEnv env("TENSOR_OPS_PRIORITY", "shim,cpu");  // accepted in the order, skipped there
    EXPECT_EQ(reg_.active().name(), "cpu");
  }
  reg_.set_backend("shim");
  EXPECT_EQ(reg_.selected_name(), "shim");
  EXPECT_EQ(reg_.active().name(), automatic);
  EXPECT_THROW(reg_.host_backend(), ExternalBackendSelected);
  reg_.set_backend("cpu");
  EXPECT_EQ(reg_.host_backend().name(), "cpu");
  EXPECT_EQ(reg_.external_choice(), nullptr);
  reg_.set_backend("auto");
  {
    BackendScope shim("shim");
    EXPECT_THROW(reg_.host_backend(), ExternalBackendSelected);
    EXPECT_EQ(reg_.active().name(), automatic);
  }
  EXPECT_EQ(reg_.host_backend().name(), automatic);
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { reg_.require("bogus"); }), HasSubstr("shim"));
  reg_.set_external_backends({});
}

TEST_F(RegistryTest, PriorityVariableOrdersBackends) {
  {
    ScopedEnv env("TENSOR_OPS_PRIORITY", " cpu , cuda");  // spaces around names are fine
    EXPECT_EQ(reg_.active().name(), "cpu");
  }
  if (const std::optional<std::string> missing = uncompiled_accelerator()) {
    {
      ScopedEnv env("TENSOR_OPS_PRIORITY", *missing + ",cpu");
      EXPECT_EQ(reg_.active().name(), "cpu");  // known but unusable names are skipped
    }
    {
      ScopedEnv env("TENSOR_OPS_PRIORITY", *missing);
      EXPECT_EQ(reg_.active().name(), reg_.usable_names().front());  // none usable: default order
    }
  }
  {
    ScopedEnv env("TENSOR_OPS_PRIORITY", "cdua,cpu");
    const std::string msg = thrown_message<InvalidArgument>([&] { reg_.active(); });
    EXPECT_THAT(msg, HasSubstr("TENSOR_OPS_PRIORITY"));
    EXPECT_THAT(msg, HasSubstr("'cdua'"));
    EXPECT_THAT(msg, HasSubstr("cpu"));
  }
  {
    // TENSOR_OPS_BACKEND outranks the priority list (a bad list is not read).
    ScopedEnv priority("TENSOR_OPS_PRIORITY", "bogus");
    ScopedEnv backend("TENSOR_OPS_BACKEND", "cpu");
    EXPECT_EQ(reg_.active().name(), "cpu");
  }
}

TEST_F(RegistryTest, BackendForFollowsTheTensorsDevice) {
  float v[4] = {0, 1, 2, 3};
  reg_.set_backend("cpu");
  EXPECT_EQ(backend_for(Tensor(v, DType::Float32, {4})), "cpu");
  EXPECT_EQ(backend_for(Tensor(v, DType::Float32, {4}, {}, Device{"cpu", 0})), "cpu");
  const Tensor on_cpu1(v, DType::Float32, {4}, {}, Device{"cpu", 1});
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { backend_for(on_cpu1); }), HasSubstr("cpu:1 does not exist"));
  EXPECT_THROW(backend_for(Tensor(v, DType::Float32, {4}, {}, Device{"cpu", -1})), InvalidArgument);
  EXPECT_THROW(backend_for(Tensor(v, DType::Float32, {4}, {}, Device{"nonexistent", 0})), InvalidArgument);
  TENSOR_OPS_REQUIRE_UNCOMPILED(missing);
  EXPECT_THROW(backend_for(Tensor(v, DType::Float32, {4}, {}, Device{missing, 0})), BackendUnavailable);
}

TEST_F(RegistryTest, CoreLibraryDirHoldsTheCoreLibrary) {
  const std::string dir = core_library_dir();
  ASSERT_FALSE(dir.empty());
  EXPECT_TRUE(std::filesystem::exists(dir + "/libtensor_ops.so")) << dir;
}

TEST_F(RegistryTest, LoadingFromADirectoryWithoutPluginsChangesNothing) {
  const size_t before = reg_.status().size();
  reg_.load_plugins_from("/nonexistent/tensor_ops/plugins");
  reg_.load_plugins_from(core_library_dir());
  EXPECT_EQ(reg_.status().size(), before);
}

}  // namespace
}  // namespace tensor_ops
