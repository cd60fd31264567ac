// Strict parsing of the TENSOR_OPS_* environment (core/env.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <climits>
#include <string>
#include <vector>

#include "core/env.h"
#include "cpu/cpu_backend.h"
#include "cpu/thread_pool.h"
#include "scoped_env.h"

namespace tensor_ops {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using testing::ScopedEnv;

TEST(ParseLong, AcceptsWholeNumbersOnly) {
  long v = 0;
  EXPECT_TRUE(parse_long("4", &v));
  EXPECT_EQ(v, 4);
  EXPECT_TRUE(parse_long("-1", &v));
  EXPECT_EQ(v, -1);
  EXPECT_TRUE(parse_long("+12", &v));
  EXPECT_EQ(v, 12);
  EXPECT_TRUE(parse_long("0", &v));
  EXPECT_EQ(v, 0);
  for (const char* bad : {"", "4abc", "abc", "4 ", " 4", "4.0", "0x10", "-", "+", "1e3", "99999999999999999999999",
                          "-99999999999999999999999"}) {
    v = 77;
    EXPECT_FALSE(parse_long(bad, &v)) << "'" << bad << "'";
    EXPECT_EQ(v, 77) << "'" << bad << "' must leave the output alone";
  }
  EXPECT_FALSE(parse_long(nullptr, &v));
}

TEST(EnvironmentWarnings, BadNumThreadsAndIsaAreReportedWithTheValuesUsed) {
  // The variables are read once per process, at the first call below (ctest
  // runs each test in a process of its own).
  ScopedEnv threads("TENSOR_OPS_NUM_THREADS", "4abc"), isa("TENSOR_OPS_CPU_ISA", "garbage");
  const std::vector<std::string> w = environment_warnings();
  const std::string cpus = std::to_string(cpu::default_num_threads());
  EXPECT_THAT(w, Contains(AllOf(HasSubstr("TENSOR_OPS_NUM_THREADS='4abc'"), HasSubstr("whole number"),
                                HasSubstr("using " + cpus + " (the CPUs"))));
  EXPECT_THAT(w, Contains(AllOf(HasSubstr("TENSOR_OPS_CPU_ISA='garbage'"), HasSubstr("unknown CPU ISA level"),
                                HasSubstr("using '" + cpu::active_isa() + "'"))));
  EXPECT_EQ(environment_warnings().size(), w.size()) << "each variable warns once";
}

}  // namespace
}  // namespace tensor_ops
