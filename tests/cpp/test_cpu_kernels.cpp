// The CPU kernels through the public op API: every ISA level this CPU runs x
// every dtype against float64 references computed from the same (rounded)
// inputs; layouts (strided, in place, empty); NaN propagation; the argument
// checks of ops.cpp and Tensor; and that threading does not change results.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TENSOR_OPS_TEST_AMX 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/cpu_backend.h"
#include "host_buffer.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "thrown_message.h"

namespace tensor_ops {
namespace {

using ::testing::HasSubstr;
using testing::HostBuffer;
using testing::thrown_message;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kEps = 1e-6;
constexpr double kPi = 3.14159265358979323846;

enum class Op { RmsNorm, Silu, GeluErf, GeluTanh };
const Op kAllOps[] = {Op::RmsNorm, Op::Silu, Op::GeluErf, Op::GeluTanh};
const DType kAllDTypes[] = {DType::Float32, DType::Float16, DType::BFloat16};

const char* op_label(Op op) {
  switch (op) {
    case Op::RmsNorm: return "rms_norm";
    case Op::Silu: return "silu";
    case Op::GeluErf: return "gelu(none)";
    case Op::GeluTanh: return "gelu(tanh)";
  }
  return "?";
}

// weight is read by rms_norm only.
void run_op(Op op, const Tensor& x, const Tensor& weight, const Tensor& out) {
  switch (op) {
    case Op::RmsNorm: rms_norm(x, weight, out, kEps); break;
    case Op::Silu: silu(x, out); break;
    case Op::GeluErf: gelu(x, out, "none"); break;
    case Op::GeluTanh: gelu(x, out, "tanh"); break;
  }
}

double unary_reference(Op op, double x) {
  switch (op) {
    case Op::Silu: return x / (1 + std::exp(-x));
    case Op::GeluErf: return 0.5 * x * std::erfc(-x / std::sqrt(2.0));
    case Op::GeluTanh: {
      const double u = std::sqrt(2 / kPi) * (x + 0.044715 * x * x * x);
      return x / (1 + std::exp(-2 * u));
    }
    case Op::RmsNorm: break;
  }
  return kNaN;
}

// The float64 result for rows x cols elements of x (row stride ld), row-major.
std::vector<double> reference(Op op, const HostBuffer& x, int64_t rows, int64_t cols, int64_t ld,
                              const HostBuffer& weight) {
  std::vector<double> ref(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    double scale = 1;
    if (op == Op::RmsNorm) {
      double ss = 0;
      for (int64_t c = 0; c < cols; ++c) ss += double(x.get(r * ld + c)) * x.get(r * ld + c);
      scale = 1 / std::sqrt(ss / double(cols) + kEps);
    }
    for (int64_t c = 0; c < cols; ++c) {
      const double v = x.get(r * ld + c);
      ref[size_t(r * cols + c)] = op == Op::RmsNorm ? v * scale * weight.get(c) : unary_reference(op, v);
    }
  }
  return ref;
}

// |got - ref| <= rtol |ref| + floor * max|ref| + atol. rtol is fp32's 1e-5,
// or one ulp of the 16-bit format (rounding the output costs half of it, the
// fp32 math a little more); atol covers float16 denormal outputs.
struct Tolerance {
  double rtol, floor, atol;
};

Tolerance tolerance_for(DType dt) {
  switch (dt) {
    case DType::Float32: return {1e-5, 1e-6, 0};
    case DType::Float16: return {0x1p-10, 1e-6, 0x1p-24};
    case DType::BFloat16: return {0x1p-7, 1e-6, 0};
  }
  return {};
}

::testing::AssertionResult matches_reference(const HostBuffer& y, int64_t rows, int64_t cols, int64_t ld,
                                             const std::vector<double>& ref) {
  const Tolerance tol = tolerance_for(y.dtype());
  double max_ref = 0;
  for (double r : ref)
    if (std::isfinite(r)) max_ref = std::max(max_ref, std::fabs(r));
  const double atol = tol.floor * max_ref + tol.atol;
  int64_t bad = 0, first_r = 0, first_c = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double got = y.get(r * ld + c), want = ref[size_t(r * cols + c)];
      const bool ok = std::isnan(want) ? std::isnan(got) : std::fabs(got - want) <= tol.rtol * std::fabs(want) + atol;
      if (!ok && bad++ == 0) first_r = r, first_c = c;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  const double got = y.get(first_r * ld + first_c), want = ref[size_t(first_r * cols + first_c)];
  return ::testing::AssertionFailure() << bad << " of " << rows * cols << " elements off; first at [" << first_r
                                       << ", " << first_c << "]: got " << got << ", want " << want << ", |err| "
                                       << std::fabs(got - want) << ", allowed "
                                       << tol.rtol * std::fabs(want) + atol;
}

// Fills x with test inputs for op: rms_norm rows at three magnitudes (so eps
// matters in some), the activations over [-12, 12] with a few special values.
void fill_input(Op op, HostBuffer& x, int64_t rows, int64_t cols, int64_t ld, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-12.0f, 12.0f);
  const float row_scale[] = {1.0f, 30.0f, 0.01f};
  const float specials[] = {0.0f, -0.0f, 1e-3f, -1e-3f, 20.0f, -20.0f, 60.0f, -60.0f};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float v;
      if (op == Op::RmsNorm)
        v = normal(rng) * row_scale[r % 3];
      else
        v = c < 8 && cols >= 64 ? specials[c] : uniform(rng);
      x.set(r * ld + c, v);
    }
}

void fill(HostBuffer& b, float v) {
  for (int64_t i = 0; i < b.size(); ++i) b.set(i, v);
}

// n values uniform in [-1, 1) (at least one element allocated).
HostBuffer uniform_buffer(DType dt, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  HostBuffer b(dt, std::max<int64_t>(n, 1));
  for (int64_t i = 0; i < n; ++i) b.set(i, dist(rng));
  return b;
}

HostBuffer make_weight(DType dt, int64_t cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  HostBuffer w(dt, std::max<int64_t>(cols, 1));
  for (int64_t i = 0; i < w.size(); ++i) w.set(i, dist(rng));
  return w;
}

std::string case_name(Op op, DType dt, int64_t rows, int64_t cols) {
  return std::string(op_label(op)) + " " + dtype_name(dt) + "[" + std::to_string(rows) + ", " +
         std::to_string(cols) + "]";
}

// Parameters: ISA level x dtype. Levels this CPU lacks are skipped.
class KernelTest : public ::testing::TestWithParam<std::tuple<std::string, DType>> {
 protected:
  void SetUp() override {
    const std::vector<std::string> levels = cpu::supported_isas();
    if (std::find(levels.begin(), levels.end(), isa()) == levels.end())
      GTEST_SKIP() << "this CPU cannot run the " << isa() << " kernels";
    cpu::set_isa(isa());
    ASSERT_EQ(cpu::active_isa(), isa());
  }
  void TearDown() override { cpu::set_isa("auto"); }

  const std::string& isa() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }

  // Runs op over every hidden size and a few row counts, checking each result.
  void check_against_reference(Op op) {
    const uint32_t seed = 1234 + uint32_t(op);
    SCOPED_TRACE("seed=" + std::to_string(seed));
    std::mt19937 rng(seed);
    for (int64_t cols : {1, 7, 64, 4095, 4096, 8193})
      for (int64_t rows : {1, 3, 33}) {
        SCOPED_TRACE(case_name(op, dtype(), rows, cols));
        HostBuffer x(dtype(), rows * cols), y(dtype(), rows * cols);
        HostBuffer w = make_weight(dtype(), cols, rng);
        fill_input(op, x, rows, cols, cols, rng);
        fill(y, kNaN);
        run_op(op, x.tensor({rows, cols}), w.tensor({cols}), y.tensor({rows, cols}));
        EXPECT_TRUE(matches_reference(y, rows, cols, cols, reference(op, x, rows, cols, cols, w)));
      }
  }
};

TEST_P(KernelTest, RmsNormMatchesReference) { check_against_reference(Op::RmsNorm); }
TEST_P(KernelTest, SiluMatchesReference) { check_against_reference(Op::Silu); }
TEST_P(KernelTest, GeluErfMatchesReference) { check_against_reference(Op::GeluErf); }
TEST_P(KernelTest, GeluTanhMatchesReference) { check_against_reference(Op::GeluTanh); }

// Rows further apart than their length, read from one strided view (2-D and
// a collapsible 3-D one) and written to another; the gaps stay untouched.
TEST_P(KernelTest, StridedRows) {
  const uint32_t seed = 99;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (Op op : kAllOps)
    for (int64_t cols : {64, 4095}) {
      const int64_t rows = 6, ldx = cols + 3, ldy = cols + 5;
      SCOPED_TRACE(case_name(op, dtype(), rows, cols));
      HostBuffer x(dtype(), rows * ldx), y(dtype(), rows * ldy);
      HostBuffer w = make_weight(dtype(), cols, rng);
      fill_input(op, x, rows, cols, ldx, rng);
      const std::vector<double> ref = reference(op, x, rows, cols, ldx, w);

      fill(y, kNaN);
      run_op(op, x.tensor({rows, cols}, {ldx, 1}), w.tensor({cols}), y.tensor({rows, cols}, {ldy, 1}));
      EXPECT_TRUE(matches_reference(y, rows, cols, ldy, ref));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = cols; c < ldy; ++c) ASSERT_TRUE(std::isnan(y.get(r * ldy + c))) << "gap written at row " << r;

      fill(y, kNaN);
      run_op(op, x.tensor({2, 3, cols}, {3 * ldx, ldx, 1}), w.tensor({cols}),
             y.tensor({2, 3, cols}, {3 * ldy, ldy, 1}));
      EXPECT_TRUE(matches_reference(y, rows, cols, ldy, ref));
    }
}

TEST_P(KernelTest, InPlaceEqualsOutOfPlace) {
  const uint32_t seed = 7;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (Op op : kAllOps)
    for (int64_t ld : {int64_t(1000), int64_t(1003)}) {  // contiguous, then strided rows
      const int64_t rows = 5, cols = 1000;
      SCOPED_TRACE(case_name(op, dtype(), rows, cols) + " row stride " + std::to_string(ld));
      HostBuffer x(dtype(), rows * ld), y(dtype(), rows * ld);
      HostBuffer w = make_weight(dtype(), cols, rng);
      fill_input(op, x, rows, cols, ld, rng);
      run_op(op, x.tensor({rows, cols}, {ld, 1}), w.tensor({cols}), y.tensor({rows, cols}, {ld, 1}));
      const Tensor tx = x.tensor({rows, cols}, {ld, 1});
      run_op(op, tx, w.tensor({cols}), tx);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          ASSERT_EQ(x.bits(r * ld + c), y.bits(r * ld + c)) << "row " << r << " col " << c;
    }
}

TEST_P(KernelTest, NaNStaysInItsRow) {
  const int64_t rows = 4, cols = 100, nan_row = 2, nan_col = 37;
  const uint32_t seed = 5;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (Op op : kAllOps) {
    SCOPED_TRACE(op_label(op));
    HostBuffer x(dtype(), rows * cols), y(dtype(), rows * cols);
    HostBuffer w = make_weight(dtype(), cols, rng);
    fill_input(op, x, rows, cols, cols, rng);
    x.set(nan_row * cols + nan_col, kNaN);
    run_op(op, x.tensor({rows, cols}), w.tensor({cols}), y.tensor({rows, cols}));
    std::vector<double> ref = reference(op, x, rows, cols, cols, w);
    // rms_norm: the whole row is NaN; the activations: that element only.
    for (int64_t c = 0; c < cols; ++c)
      if (op == Op::RmsNorm || c == nan_col) {
        EXPECT_TRUE(std::isnan(y.get(nan_row * cols + c))) << "col " << c;
        ASSERT_TRUE(std::isnan(ref[size_t(nan_row * cols + c)]));
      }
    EXPECT_TRUE(matches_reference(y, rows, cols, cols, ref));
  }
}

// A wide input split over the worker threads gives the bits that one call
// per row (too small to split) gives.
TEST_P(KernelTest, ThreadedResultsEqualRowByRow) {
  if (cpu::num_threads() < 2) GTEST_SKIP() << "one worker thread; set TENSOR_OPS_NUM_THREADS to test splitting";
  const int64_t rows = 512, cols = 4096;
  const uint32_t seed = 512;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (Op op : kAllOps) {
    SCOPED_TRACE(op_label(op));
    HostBuffer x(dtype(), rows * cols), whole(dtype(), rows * cols), by_row(dtype(), rows * cols);
    HostBuffer w = make_weight(dtype(), cols, rng);
    fill_input(op, x, rows, cols, cols, rng);
    run_op(op, x.tensor({rows, cols}), w.tensor({cols}), whole.tensor({rows, cols}));
    for (int64_t r = 0; r < rows; ++r)
      run_op(op, x.tensor({cols}, {}, {}, r * cols), w.tensor({cols}), by_row.tensor({cols}, {}, {}, r * cols));
    for (int64_t i = 0; i < rows * cols; ++i)
      ASSERT_EQ(whole.bits(i), by_row.bits(i)) << "row " << i / cols << " col " << i % cols;
  }
}

// linear against float64 sums of the stored values, with and without bias;
// then each row of x alone gives the bits it gives in the batch, whatever
// the threads (Note [linear rows]).
TEST_P(KernelTest, LinearMatchesReferenceAndIsBatchInvariant) {
  const uint32_t seed = 77;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  auto random = [&](int64_t n) { return uniform_buffer(dtype(), n, rng); };
  for (int64_t M : {1, 3, 5, 16})
    for (int64_t K : {1, 7, 64, 513})
      for (int64_t N : {1, 9, 65, 300})
        for (bool with_bias : {false, true}) {
          SCOPED_TRACE("linear " + std::string(dtype_name(dtype())) + " M " + std::to_string(M) + " K " +
                       std::to_string(K) + " N " + std::to_string(N) + (with_bias ? " bias" : ""));
          HostBuffer x = random(M * K), w = random(N * K), b = random(N), y(dtype(), M * N), row(dtype(), N);
          const Tensor tb = b.tensor({N});
          linear(x.tensor({M, K}), w.tensor({N, K}), with_bias ? &tb : nullptr, y.tensor({M, N}));
          std::vector<double> ref(size_t(M * N));
          for (int64_t r = 0; r < M; ++r)
            for (int64_t n = 0; n < N; ++n) {
              double s = with_bias ? b.get(n) : 0.0;
              for (int64_t k = 0; k < K; ++k) s += double(x.get(r * K + k)) * w.get(n * K + k);
              ref[size_t(r * N + n)] = s;
            }
          EXPECT_TRUE(matches_reference(y, M, N, N, ref));
          for (int64_t r = 0; r < M; ++r) {
            linear(x.tensor({1, K}, {}, {}, r * K), w.tensor({N, K}), with_bias ? &tb : nullptr, row.tensor({1, N}));
            for (int64_t n = 0; n < N; ++n) ASSERT_EQ(row.bits(n), y.bits(r * N + n)) << "row " << r << " col " << n;
          }
        }
}

// linear with a [K, N] weight (WeightLayout::KN, Note [linear kn]) against
// float64 sums, with and without bias, the weight's rows padded (a row
// stride past N) or not; each row of x alone gives the batch's bits, and one
// thread gives the bits of all of them.
TEST_P(KernelTest, LinearKnMatchesReferenceAndIsBatchAndThreadInvariant) {
  const uint32_t seed = 78;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  auto random = [&](int64_t n) { return uniform_buffer(dtype(), n, rng); };
  const int threads = cpu::num_threads();
  for (int64_t M : {1, 3, 5, 16})
    for (int64_t K : {1, 7, 64, 513})
      for (int64_t N : {1, 9, 65, 300})
        for (int64_t pad : {0, 3}) {
          const bool with_bias = (M + N + pad) % 2 == 1;
          SCOPED_TRACE("linear kn " + std::string(dtype_name(dtype())) + " M " + std::to_string(M) + " K " +
                       std::to_string(K) + " N " + std::to_string(N) + " pad " + std::to_string(pad) +
                       (with_bias ? " bias" : ""));
          const int64_t ws = N + pad;
          HostBuffer x = random(M * K), w = random(K * ws), b = random(N), y(dtype(), M * N), row(dtype(), N),
                     one(dtype(), M * N);
          const Tensor tb = b.tensor({N}), tw = w.tensor({K, N}, {ws, 1});
          const Tensor* bias = with_bias ? &tb : nullptr;
          linear(x.tensor({M, K}), tw, bias, y.tensor({M, N}), WeightLayout::KN);
          std::vector<double> ref(size_t(M * N));
          for (int64_t r = 0; r < M; ++r)
            for (int64_t n = 0; n < N; ++n) {
              double s = with_bias ? b.get(n) : 0.0;
              for (int64_t k = 0; k < K; ++k) s += double(x.get(r * K + k)) * w.get(k * ws + n);
              ref[size_t(r * N + n)] = s;
            }
          EXPECT_TRUE(matches_reference(y, M, N, N, ref));
          for (int64_t r = 0; r < M; ++r) {
            linear(x.tensor({1, K}, {}, {}, r * K), tw, bias, row.tensor({1, N}), WeightLayout::KN);
            for (int64_t n = 0; n < N; ++n) ASSERT_EQ(row.bits(n), y.bits(r * N + n)) << "row " << r << " col " << n;
          }
          cpu::set_num_threads(1);
          linear(x.tensor({M, K}), tw, bias, one.tensor({M, N}), WeightLayout::KN);
          cpu::set_num_threads(threads);
          for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(one.bits(i), y.bits(i)) << "1 thread, element " << i;
        }
}

// rms_norm's weight offset (Gemma's 1 + w): the forward against float64 with
// offset + w; offset 0 is the plain norm bit for bit (-0.0 weights included);
// the backward's dweight does not depend on the offset, and its dx is the
// float32 kernel's on float32 copies with the weight offset + w (exact here:
// weights are multiples of 1/64), rounded to the dtype.
TEST_P(KernelTest, RmsNormWeightOffset) {
  const uint32_t seed = 4321;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> steps(-128, 128);
  const int64_t rows = 3;
  for (int64_t cols : {1, 7, 64, 4095, 8193}) {
    SCOPED_TRACE(case_name(Op::RmsNorm, dtype(), rows, cols));
    HostBuffer x(dtype(), rows * cols), dy(dtype(), rows * cols), w(dtype(), cols), y(dtype(), rows * cols),
        plain(dtype(), rows * cols);
    fill_input(Op::RmsNorm, x, rows, cols, cols, rng);
    fill_input(Op::RmsNorm, dy, rows, cols, cols, rng);
    for (int64_t c = 0; c < cols; ++c) w.set(c, c % 5 == 0 ? -0.0f : float(steps(rng)) / 64);
    rms_norm(x.tensor({rows, cols}), w.tensor({cols}), plain.tensor({rows, cols}), kEps);
    rms_norm(x.tensor({rows, cols}), w.tensor({cols}), y.tensor({rows, cols}), kEps, 0.0);
    for (int64_t i = 0; i < y.size(); ++i) ASSERT_EQ(y.bits(i), plain.bits(i)) << "offset 0, element " << i;
    HostBuffer dx0(dtype(), rows * cols), dw0(dtype(), cols);
    rms_norm_backward(dy.tensor({rows, cols}), x.tensor({rows, cols}), w.tensor({cols}), dx0.tensor({rows, cols}),
                      dw0.tensor({cols}), kEps);
    for (double offset : {1.0, -0.5}) {
      SCOPED_TRACE("offset " + std::to_string(offset));
      HostBuffer w_off(dtype(), cols), x32(DType::Float32, rows * cols), dy32(DType::Float32, rows * cols),
          w32(DType::Float32, cols);
      for (int64_t c = 0; c < cols; ++c) w_off.set(c, float(offset) + w.get(c)), w32.set(c, w_off.get(c));
      for (int64_t i = 0; i < x.size(); ++i) x32.set(i, x.get(i)), dy32.set(i, dy.get(i));
      rms_norm(x.tensor({rows, cols}), w.tensor({cols}), y.tensor({rows, cols}), kEps, offset);
      EXPECT_TRUE(matches_reference(y, rows, cols, cols, reference(Op::RmsNorm, x, rows, cols, cols, w_off)));
      HostBuffer dx(dtype(), rows * cols), dw(dtype(), cols), dx32(DType::Float32, rows * cols),
          dw32(DType::Float32, cols);
      rms_norm_backward(dy.tensor({rows, cols}), x.tensor({rows, cols}), w.tensor({cols}), dx.tensor({rows, cols}),
                        dw.tensor({cols}), kEps, offset);
      rms_norm_backward(dy32.tensor({rows, cols}), x32.tensor({rows, cols}), w32.tensor({cols}),
                        dx32.tensor({rows, cols}), dw32.tensor({cols}), kEps);
      for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(dw.bits(c), dw0.bits(c)) << "dweight " << c;
      HostBuffer want(dtype(), rows * cols);
      for (int64_t i = 0; i < dx.size(); ++i) want.set(i, dx32.get(i));
      for (int64_t i = 0; i < dx.size(); ++i) ASSERT_EQ(dx.bits(i), want.bits(i)) << "dx element " << i;
    }
  }
}

std::string kernel_test_name(const ::testing::TestParamInfo<KernelTest::ParamType>& info) {
  return std::get<0>(info.param) + "_" + dtype_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllIsasAllDTypes, KernelTest,
                         ::testing::Combine(::testing::Values("baseline", "avx2", "avx512", "avx512_bf16", "amx"),
                                            ::testing::ValuesIn(kAllDTypes)),
                         kernel_test_name);

#ifdef TENSOR_OPS_TEST_AMX
struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
__attribute__((target("amx-tile"))) void load_tile_config(const TileConfig* c) { _tile_loadconfig(c); }
__attribute__((target("amx-tile"))) void store_tile_config(TileConfig* c) { _tile_storeconfig(c); }
__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// The amx level's attention runs on whatever thread calls it, torch's
// OpenMP workers included, whose own AMX kernels may keep their tile
// configuration loaded between calls: the forward and the backward put the
// caller's configuration back (AmxTileScope), and leave the tiles released
// where none was loaded.
TEST(CpuAmx, AttentionKeepsTheCallersTileConfiguration) {
  const std::vector<std::string> levels = cpu::supported_isas();
  if (std::find(levels.begin(), levels.end(), "amx") == levels.end()) GTEST_SKIP() << "this CPU runs no amx level";
  struct Restore {  // the process's level and threads back, on every way out (a failed ASSERT returns early)
    int threads = cpu::num_threads();
    ~Restore() {
      cpu::set_num_threads(threads);
      cpu::set_isa("auto");
    }
  } restore;
  cpu::set_isa("amx");
  cpu::set_num_threads(1);  // the kernels run on this thread
  const int64_t B = 1, H = 2, L = 40, D = 32, n = B * H * L * D;  // 80 packed rows: the AMX row tiles
  std::vector<HostBuffer> bufs;
  for (int i = 0; i < 8; ++i) bufs.emplace_back(DType::BFloat16, n);  // q k v out dout dq dk dv
  std::mt19937 gen(7);
  std::normal_distribution<float> dist;
  for (int i = 0; i < 5; ++i)
    for (int64_t j = 0; j < n; ++j) bufs[size_t(i)].set(j, dist(gen));
  HostBuffer lse(DType::Float32, B * H * L);
  auto t4 = [&](int i) { return bufs[size_t(i)].tensor({B, H, L, D}); };
  TileConfig mine{};
  mine.palette = 1;
  for (int i = 0; i < 8; ++i) mine.colsb[i] = 32, mine.rows[i] = 8;
  for (bool loaded : {true, false}) {
    if (loaded) load_tile_config(&mine);
    attention(t4(0), t4(1), t4(2), t4(3), lse.tensor({B, H, L}), kCausalNone, 0.2);
    attention_backward(t4(4), t4(0), t4(1), t4(2), t4(3), lse.tensor({B, H, L}), t4(5), t4(6), t4(7), kCausalNone,
                       0.2);
    TileConfig now{};
    store_tile_config(&now);
    if (loaded)
      EXPECT_EQ(std::memcmp(&now, &mine, sizeof now), 0) << "the caller's tile configuration was not put back";
    else
      EXPECT_EQ(now.palette, 0) << "the tiles were left configured";
    release_tiles();
  }
  for (int64_t j = 0; j < n; ++j) ASSERT_TRUE(std::isfinite(bufs[5].get(j))) << "dq element " << j;
}
#endif

TEST(CpuIsa, LevelsAndSelection) {
  const std::vector<std::string> levels = cpu::supported_isas();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), "baseline");
  cpu::set_isa("baseline");
  EXPECT_EQ(cpu::active_isa(), "baseline");
  cpu::set_isa("auto");
  EXPECT_EQ(cpu::active_isa(), levels.back());
  EXPECT_THAT(thrown_message<InvalidArgument>([] { cpu::set_isa("sse9"); }), HasSubstr("'sse9'"));
  for (const char* level : {"avx2", "avx512", "avx512_bf16", "amx"}) {
    if (std::find(levels.begin(), levels.end(), level) == levels.end()) {
      EXPECT_THROW(cpu::set_isa(level), Unsupported) << level;
    }
  }
  EXPECT_EQ(cpu::active_isa(), levels.back());  // a refused level changes nothing
  EXPECT_GE(cpu::num_threads(), 1);
}

TEST(CpuOps, EmptyTensorsAreANoOp) {
  for (DType dt : kAllDTypes)
    for (Op op : kAllOps) {
      SCOPED_TRACE(std::string(op_label(op)) + " " + dtype_name(dt));
      HostBuffer x(dt, 64), w(dt, 64), y(dt, 64);
      fill(x, 1.0f);
      fill(w, 1.0f);
      fill(y, -7.0f);
      run_op(op, x.tensor({0, 64}), w.tensor({64}), y.tensor({0, 64}));
      run_op(op, x.tensor({2, 0, 64}), w.tensor({64}), y.tensor({2, 0, 64}));
      run_op(op, x.tensor({4, 0}), w.tensor({0}), y.tensor({4, 0}));
      run_op(op, Tensor(nullptr, dt, {0, 64}), w.tensor({64}), Tensor(nullptr, dt, {0, 64}));
      for (int64_t i = 0; i < y.size(); ++i) ASSERT_EQ(y.get(i), -7.0f) << "element " << i << " written";
    }
}

TEST(CpuOps, CpuDeviceTensorsRunOnTheCpu) {
  float x[3] = {-1.0f, 0.0f, 2.0f}, y[3] = {kNaN, kNaN, kNaN};
  const Device cpu0{"cpu", 0};
  silu(Tensor(x, DType::Float32, {3}, {}, cpu0), Tensor(y, DType::Float32, {3}, {}, cpu0));
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(y[i], unary_reference(Op::Silu, x[i]), 1e-6) << i;
  // Host and cpu:0 tensors are different devices to the checks.
  EXPECT_THROW(silu(Tensor(x, DType::Float32, {3}), Tensor(y, DType::Float32, {3}, {}, cpu0)), InvalidArgument);
}

TEST(CpuOps, ZeroDimActivationsAreOneElement) {
  float x = -1.5f, y = 0;
  silu(Tensor(&x, DType::Float32, {}), Tensor(&y, DType::Float32, {}));
  EXPECT_NEAR(y, -1.5 / (1 + std::exp(1.5)), 1e-6);
}

// --- argument checks (ops.cpp and the Tensor constructor) ---

class OpErrors : public ::testing::Test {
 protected:
  std::vector<float> xs_ = std::vector<float>(256, 1.0f), ws_ = std::vector<float>(64, 1.0f),
                     ys_ = std::vector<float>(256, 0.0f);
  Tensor x_{xs_.data(), DType::Float32, {3, 64}};
  Tensor w_{ws_.data(), DType::Float32, {64}};
  Tensor y_{ys_.data(), DType::Float32, {3, 64}};
};

TEST_F(OpErrors, WeightMustMatchTheLastDimension) {
  std::vector<float> w65(65, 1.0f);
  const std::string msg =
      thrown_message<InvalidArgument>([&] { rms_norm(x_, Tensor(w65.data(), DType::Float32, {65}), y_); });
  EXPECT_THAT(msg, HasSubstr("[64]"));
  EXPECT_THAT(msg, HasSubstr("float32[65]"));
  EXPECT_THROW(rms_norm(x_, Tensor(ws_.data(), DType::Float32, {1, 64}), y_), InvalidArgument);
  EXPECT_THROW(rms_norm(x_, Tensor(ws_.data(), DType::Float32, {}), y_), InvalidArgument);
}

// A [K, N] weight (WeightLayout::KN): its first dim must be x's last; the
// message names the layout and both shapes. A layout other than 0 or 1 is refused.
TEST_F(OpErrors, LinearKnWeightShapeAndLayout) {
  std::vector<float> w(64 * 5, 1.0f), y(3 * 5, 0.0f);
  const Tensor out(y.data(), DType::Float32, {3, 5});
  EXPECT_NO_THROW(linear(x_, Tensor(w.data(), DType::Float32, {64, 5}), nullptr, out, WeightLayout::KN));
  const std::string msg = thrown_message<InvalidArgument>(
      [&] { linear(x_, Tensor(w.data(), DType::Float32, {5, 64}), nullptr, out, WeightLayout::KN); });
  EXPECT_THAT(msg, HasSubstr("[64, out_features]"));
  EXPECT_THAT(msg, HasSubstr("kn"));
  EXPECT_THAT(msg, HasSubstr("float32[5, 64]"));
  EXPECT_THAT(msg, HasSubstr("float32[3, 64]"));
  EXPECT_THAT(thrown_message<InvalidArgument>([&] {
                linear(x_, Tensor(w.data(), DType::Float32, {64, 5}), nullptr, out, WeightLayout(2));
              }),
              HasSubstr("got 2"));
}

TEST_F(OpErrors, MixedDTypes) {
  std::vector<uint16_t> h(256);
  const std::string msg =
      thrown_message<DTypeError>([&] { rms_norm(x_, Tensor(h.data(), DType::Float16, {64}), y_); });
  EXPECT_THAT(msg, HasSubstr("float16"));
  EXPECT_THAT(msg, HasSubstr("float32"));
  EXPECT_THROW(silu(x_, Tensor(h.data(), DType::BFloat16, {3, 64})), DTypeError);
  EXPECT_THROW(rms_norm(x_, w_, Tensor(h.data(), DType::Float16, {3, 64})), DTypeError);
}

TEST_F(OpErrors, RmsNormNeedsAtLeastOneDimension) {
  float s = 1.0f, o = 0.0f;
  EXPECT_THAT(thrown_message<InvalidArgument>(
                  [&] { rms_norm(Tensor(&s, DType::Float32, {}), w_, Tensor(&o, DType::Float32, {})); }),
              HasSubstr("0-d"));
}

TEST_F(OpErrors, EpsMustBeFiniteAndNonNegative) {
  for (double eps : {-1e-6, double(kNaN), std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(eps);
    EXPECT_THAT(thrown_message<InvalidArgument>([&] { rms_norm(x_, w_, y_, eps); }), HasSubstr("eps"));
  }
  EXPECT_NO_THROW(rms_norm(x_, w_, y_, 0.0));
}

TEST_F(OpErrors, OutMustMatchX) {
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { silu(x_, Tensor(ys_.data(), DType::Float32, {64, 3})); }),
              HasSubstr("out has shape [64, 3] but x has [3, 64]"));
  EXPECT_THROW(rms_norm(x_, w_, Tensor(ys_.data(), DType::Float32, {192})), InvalidArgument);
  EXPECT_THROW(rms_norm(x_, Tensor(ws_.data(), DType::Float32, {64}, {}, Device{"cpu", 0}), y_), InvalidArgument);
}

TEST_F(OpErrors, OutMayNotPartiallyOverlapAnInput) {
  const Tensor shifted(xs_.data() + 1, DType::Float32, {3, 64});
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { silu(x_, shifted); }), HasSubstr("partially overlaps"));
  EXPECT_THROW(gelu(x_, shifted), InvalidArgument);
  EXPECT_THROW(rms_norm(x_, w_, shifted), InvalidArgument);
  // The same memory with another row stride is not an in-place view.
  const Tensor every_other_row(xs_.data(), DType::Float32, {2, 64}, {128, 1});
  EXPECT_THROW(silu(every_other_row, Tensor(xs_.data(), DType::Float32, {2, 64})), InvalidArgument);
  // out over the weight.
  std::vector<float> buf(3 * 64 + 64, 1.0f);
  const Tensor w_in_buf(buf.data(), DType::Float32, {64});
  EXPECT_THAT(thrown_message<InvalidArgument>(
                  [&] { rms_norm(x_, w_in_buf, Tensor(buf.data(), DType::Float32, {3, 64})); }),
              HasSubstr("overlaps an input"));
}

TEST_F(OpErrors, LayoutsTheKernelsCannotTake) {
  std::vector<float> big(1024, 1.0f), out(1024, 0.0f);
  // Leading dims that do not form one row progression.
  const Tensor gapped(big.data(), DType::Float32, {2, 3, 4}, {32, 8, 1});
  const std::string msg =
      thrown_message<LayoutError>([&] { silu(gapped, Tensor(out.data(), DType::Float32, {2, 3, 4})); });
  EXPECT_THAT(msg, HasSubstr("strides [32, 8, 1]"));
  // Strided last dimension; rows that overlap each other.
  EXPECT_THROW(silu(Tensor(big.data(), DType::Float32, {3, 4}, {8, 2}), Tensor(out.data(), DType::Float32, {3, 4})),
               LayoutError);
  EXPECT_THROW(silu(Tensor(big.data(), DType::Float32, {3, 4}, {2, 1}), Tensor(out.data(), DType::Float32, {3, 4})),
               LayoutError);
  // The same checks on out and on the weight.
  const Tensor gapped_out(out.data(), DType::Float32, {2, 3, 4}, {32, 8, 1});
  EXPECT_THROW(silu(Tensor(big.data(), DType::Float32, {2, 3, 4}), gapped_out), LayoutError);
  EXPECT_THROW(rms_norm(Tensor(big.data(), DType::Float32, {3, 4}), Tensor(out.data(), DType::Float32, {4}, {2}),
                        Tensor(out.data() + 100, DType::Float32, {3, 4})),
               LayoutError);
  // Size-1 dims may carry any stride.
  EXPECT_NO_THROW(silu(Tensor(big.data(), DType::Float32, {3, 1, 4}, {4, 999, 1}),
                       Tensor(out.data(), DType::Float32, {3, 1, 4})));
}

TEST_F(OpErrors, GeluApproximateMustBeKnown) {
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { gelu(x_, y_, "sigmoid"); }), HasSubstr("'sigmoid'"));
}

TEST(TensorErrors, ShapeChecks) {
  float v = 0;
  const int64_t big = int64_t(1) << 40;
  EXPECT_THAT(thrown_message<InvalidArgument>([&] { Tensor(&v, DType::Float32, {big, big}); }), HasSubstr("overflows"));
  EXPECT_THROW(Tensor(&v, DType::Float32, {std::numeric_limits<int64_t>::max()}), InvalidArgument);
  EXPECT_THROW(Tensor(&v, DType::Float32, {3, -1}), InvalidArgument);
  EXPECT_THROW(Tensor(&v, DType::Float32, std::vector<int64_t>(9, 1)), InvalidArgument);
  EXPECT_THROW(Tensor(&v, DType::Float32, {2, 2}, {2}), InvalidArgument);
  EXPECT_THAT(thrown_message<InvalidArgument>([] { Tensor(nullptr, DType::Float16, {2, 3}); }),
              HasSubstr("null data pointer"));
  EXPECT_NO_THROW(Tensor(nullptr, DType::Float16, {0, 3}));
  const Tensor t(&v, DType::Float32, {2, 3, 4});
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "float32[2, 3, 4]");
  EXPECT_EQ(Tensor(&v, DType::BFloat16, {2}, {}, Device{"cpu", 0}).describe(), "bfloat16[2] on cpu:0");
}

}  // namespace
}  // namespace tensor_ops
