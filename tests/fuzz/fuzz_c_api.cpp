// libFuzzer target on the C ABI. Each input decodes to one op call: an op id
// (valid or not), tensor counts, and per tensor a dtype, rank, shape, strides,
// device, and where its memory lies (its own buffer, or inside another
// tensor's, to make overlaps), plus scalars, ints, NULL and destroyed handles.
// The harness keeps its side of the contract: every view it describes lies
// inside memory it owns and is aligned for its dtype (misaligned data is
// refused when a tensor is made: the bad-input matrix checks that), so any
// sanitizer report is the library's. It also checks that
//   - every call returns a defined status, with a message exactly when it failed;
//   - nothing outside the output views changes (no stray writes that ASan
//     cannot see because they land inside a live buffer).
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tensor_ops/tensor_ops.h"

namespace {

constexpr int64_t kMaxElements = 4096;  // per view that may run (keeps each run fast)

#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz_c_api: check failed: %s (last error: %s)\n", #cond,     \
                   to_last_error());                                                      \
      __builtin_trap();                                                                   \
    }                                                                                     \
  } while (0)

int64_t pick_dim(FuzzedDataProvider& in) {
  static const int64_t special[] = {0, 1, 2, 3, 4, 5, 7, 8, 16, 33, -1, INT64_C(1) << 31, INT64_C(1) << 40,
                                    std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) return in.PickValueInArray(special);
  return in.ConsumeIntegralInRange<int64_t>(0, 9);
}

int64_t pick_stride(FuzzedDataProvider& in) {
  static const int64_t special[] = {0, -1, INT64_C(1) << 40, INT64_C(1) << 62, std::numeric_limits<int64_t>::min(),
                                    std::numeric_limits<int64_t>::max()};
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) return in.PickValueInArray(special);
  return in.ConsumeIntegralInRange<int64_t>(-3, 40);
}

double pick_scalar(FuzzedDataProvider& in) {
  static const double special[] = {0.0, 1e-6, 1e-5, 0.5, 1.0, -1.0, -1e-6, 1e300, -1e300, 5e-324,
                                   std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                                   -std::numeric_limits<double>::infinity()};
  if (in.ConsumeBool()) return in.PickValueInArray(special);
  return in.ConsumeFloatingPoint<double>();
}

int64_t pick_int(FuzzedDataProvider& in) {
  static const int64_t special[] = {0, 1, 2, 3, 7, -1, -100, std::numeric_limits<int64_t>::min(),
                                    std::numeric_limits<int64_t>::max()};
  if (in.ConsumeBool()) return in.PickValueInArray(special);
  return in.ConsumeIntegral<int64_t>();
}

size_t item_size(int32_t dtype) { return dtype == TO_FLOAT16 || dtype == TO_BFLOAT16 ? 2 : dtype == TO_INT64 ? 8 : 4; }

struct View {
  bool null = false, destroyed = false, null_shape = false;
  int32_t dtype = TO_FLOAT32, ndim = 0;
  int64_t shape[9] = {}, strides[9] = {};
  bool has_strides = false;
  std::string device = "cpu";
  int buffer = 0;        // which buffer
  int64_t byte_at = 0;   // where element 0 lies, from the buffer's origin
  // Element offsets reached, relative to element 0, and the element count;
  // `backed` is false when the view is too large for the harness to back.
  int64_t lo = 0, hi = 0, count = 0;
  bool backed = true;
};

// lo / hi / count of a view. backed = false for anything beyond the
// harness's limits (then the op is not run). Contiguous strides as the
// library makes them (0-size dims counted as 1).
void measure(View& v) {
  bool zero = false;
  for (int i = 0; i < v.ndim; ++i) {
    if (v.shape[i] < 0) {
      v.backed = false;
      return;
    }
    zero = zero || v.shape[i] == 0;
  }
  if (zero) return;  // no elements: no memory is touched, whatever the rest says
  v.count = 1;
  for (int i = 0; i < v.ndim; ++i)
    if (v.shape[i] > kMaxElements || __builtin_mul_overflow(v.count, v.shape[i], &v.count) || v.count > kMaxElements) {
      v.backed = false;
      return;
    }
  int64_t s = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    const int64_t st = v.has_strides ? v.strides[i] : s;
    s *= v.shape[i];
    if (v.shape[i] == 1) continue;
    int64_t ext;
    if (__builtin_mul_overflow(st, v.shape[i] - 1, &ext) || ext > kMaxElements * 16 || ext < -kMaxElements * 16) {
      v.backed = false;
      return;
    }
    (ext < 0 ? v.lo : v.hi) += ext;
  }
}

// Marks every byte of a view's elements.
void mark(const View& v, std::vector<unsigned char>& touched, int64_t base) {
  if (v.count == 0) return;
  int64_t st[9], s = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    st[i] = v.has_strides ? v.strides[i] : s;
    s *= v.shape[i];
  }
  const int64_t item = int64_t(item_size(v.dtype));
  int64_t idx[9] = {};
  for (int64_t n = 0; n < v.count; ++n) {
    int64_t off = 0;
    for (int i = 0; i < v.ndim; ++i) off += idx[i] * st[i];
    for (int64_t b = 0; b < item; ++b) touched[size_t(base + off * item + b)] = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      if (++idx[i] < v.shape[i]) break;
      idx[i] = 0;
    }
  }
}

void exercise_listing(FuzzedDataProvider& in) {
  char buf[96];
  int32_t n = 0, usable = 0, id = 0;
  const int32_t index = in.ConsumeIntegralInRange<int32_t>(-2, 8);
  const size_t len = in.ConsumeIntegralInRange<size_t>(0, sizeof(buf));
  to_device_info info;
  FUZZ_CHECK(to_backend_count(&n) == TO_OK && n >= 1);
  to_backend_name(index, len ? buf : nullptr, len);
  to_backend_usable(index, in.ConsumeBool() ? &usable : nullptr);
  to_backend_reason(index, buf, len);
  to_device_count(&n);
  to_device_get(index, buf, len, &id, in.ConsumeBool() ? &info : nullptr);
  to_active_backend(buf, len);
  int32_t op = 0;
  const std::string name = in.ConsumeRandomLengthString(24);
  to_op_id(name.c_str(), &op);
  (void)to_op_name(index);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeIntegralInRange<int>(0, 31) == 0) {
    exercise_listing(in);
    return 0;
  }
  const int32_t op = in.ConsumeIntegralInRange<int32_t>(-1, TO_OP_COUNT);
  const int32_t n_in = in.ConsumeIntegralInRange<int32_t>(0, 6), n_out = in.ConsumeIntegralInRange<int32_t>(0, 3);
  const int n_slots = n_in + n_out;
  static const char* const devices[] = {"cpu", "cpu", "cpu", "cpu", "host", "", "cpu:0", "cpu:1", "cuda:0",
                                        "nosuch:0", "opencl:3", "mock:0", ":0", "Cuda:0", "cuda:", "cuda:-1",
                                        "cuda:99999999999"};
  std::vector<View> views(static_cast<size_t>(n_slots));
  for (int i = 0; i < n_slots; ++i) {
    View& v = views[size_t(i)];
    v.null = in.ConsumeIntegralInRange<int>(0, 31) == 0;
    v.destroyed = !v.null && in.ConsumeIntegralInRange<int>(0, 63) == 0;
    v.dtype = in.ConsumeIntegralInRange<int>(0, 15) == 0 ? in.ConsumeIntegralInRange<int32_t>(-1, 6)
                                                          : in.ConsumeIntegralInRange<int32_t>(TO_FLOAT32, TO_INT64);
    v.ndim = in.ConsumeIntegralInRange<int>(0, 31) == 0 ? in.ConsumeIntegralInRange<int32_t>(-1, 9)
                                                        : in.ConsumeIntegralInRange<int32_t>(0, 4);
    const int dims = v.ndim < 0 ? 0 : v.ndim;
    v.null_shape = in.ConsumeIntegralInRange<int>(0, 63) == 0;
    for (int d = 0; d < dims; ++d) v.shape[d] = pick_dim(in);
    v.has_strides = in.ConsumeIntegralInRange<int>(0, 3) == 0;
    for (int d = 0; d < dims && v.has_strides; ++d) v.strides[d] = pick_stride(in);
    v.device = in.ConsumeIntegralInRange<int>(0, 15) == 0 ? in.PickValueInArray(devices) : "cpu";
    // Own memory, or inside an earlier view's buffer at an aligned byte offset.
    v.buffer = i > 0 && in.ConsumeIntegralInRange<int>(0, 3) == 0 ? in.ConsumeIntegralInRange<int>(0, i - 1) : i;
    if (v.ndim >= 0 && v.ndim <= 9) measure(v);
    const int64_t item = int64_t(v.dtype >= TO_FLOAT32 && v.dtype <= TO_INT64 ? item_size(v.dtype) : 4);
    v.byte_at = in.ConsumeIntegralInRange<int64_t>(0, 16) * 8 - v.lo * item;
  }
  std::vector<double> scalars(size_t(in.ConsumeIntegralInRange<int>(0, 2)));
  for (double& s : scalars) s = pick_scalar(in);
  std::vector<int64_t> ints(size_t(in.ConsumeIntegralInRange<int>(0, 3)));
  for (int64_t& v : ints) v = pick_int(in);
  const bool null_arrays = in.ConsumeIntegralInRange<int>(0, 31) == 0;

  // Buffers sized to hold every view placed in them; views past the limits
  // get a null pointer, and the op is not run when a live handle has one.
  std::vector<std::vector<unsigned char>> buffers(static_cast<size_t>(n_slots));
  for (const View& v : views) {
    const int64_t item = int64_t(item_size(v.dtype));
    const int64_t end = v.byte_at + (v.hi + 1) * item;
    auto& b = buffers[size_t(v.buffer)];
    if (v.backed && int64_t(b.size()) < end + 8) b.resize(size_t(end + 8));
  }
  const std::vector<unsigned char> fill = in.ConsumeRemainingBytes<unsigned char>();
  for (auto& b : buffers)
    for (size_t k = 0; k < b.size(); ++k) b[k] = fill.empty() ? (unsigned char)(k * 131) : fill[k % fill.size()];

  std::vector<to_tensor_h> handles(static_cast<size_t>(n_slots), nullptr);
  for (int i = 0; i < n_slots; ++i) {
    View& v = views[size_t(i)];
    if (v.null) continue;
    auto& b = buffers[size_t(v.buffer)];
    void* ptr = v.backed && v.count > 0 && !b.empty() ? b.data() + v.byte_at : nullptr;
    const to_status st = to_tensor_create(ptr, v.dtype, v.ndim, v.null_shape ? nullptr : v.shape,
                                          v.has_strides ? v.strides : nullptr, v.device.c_str(), &handles[size_t(i)]);
    FUZZ_CHECK(st >= TO_OK && st <= TO_ERR_INTERNAL);
    FUZZ_CHECK((st == TO_OK) == (to_last_error()[0] == '\0'));
    FUZZ_CHECK((st == TO_OK) == (handles[size_t(i)] != nullptr));
    if (st != TO_OK) v.null = true;
  }
  // Destroyed only now, so no later handle can reuse their addresses.
  for (int i = 0; i < n_slots; ++i)
    if (views[size_t(i)].destroyed && !views[size_t(i)].null) FUZZ_CHECK(to_tensor_destroy(handles[size_t(i)]) == TO_OK);
  bool runnable = true;
  for (const View& v : views) runnable = runnable && (v.null || v.destroyed || v.backed);
  if (!runnable) {
    for (int i = 0; i < n_slots; ++i)
      if (!views[size_t(i)].destroyed) to_tensor_destroy(handles[size_t(i)]);
    return 0;
  }

  const std::vector<std::vector<unsigned char>> before = buffers;
  const to_status st = to_op_run(op, null_arrays ? nullptr : handles.data(), n_in,
                                 null_arrays ? nullptr : handles.data() + n_in, n_out,
                                 scalars.empty() ? nullptr : scalars.data(), int32_t(scalars.size()),
                                 ints.empty() ? nullptr : ints.data(), int32_t(ints.size()));
  FUZZ_CHECK(st >= TO_OK && st <= TO_ERR_INTERNAL);
  FUZZ_CHECK(st != TO_ERR_INTERNAL);
  FUZZ_CHECK((st == TO_OK) == (to_last_error()[0] == '\0'));

  // Only bytes of live output views may have changed.
  std::vector<std::vector<unsigned char>> touched(buffers.size());
  for (size_t b = 0; b < buffers.size(); ++b) touched[b].assign(buffers[b].size(), 0);
  for (int i = n_in; i < n_slots; ++i) {
    const View& v = views[size_t(i)];
    if (!v.null && !v.destroyed) mark(v, touched[size_t(v.buffer)], v.byte_at);
  }
  for (size_t b = 0; b < buffers.size(); ++b)
    for (size_t k = 0; k < buffers[b].size(); ++k)
      if (!touched[b][k] && buffers[b][k] != before[b][k]) {
        std::fprintf(stderr, "fuzz_c_api: op %d (%s) wrote byte %zu of buffer %zu outside its outputs\n", op,
                     to_op_name(op) ? to_op_name(op) : "?", k, b);
        __builtin_trap();
      }
  for (int i = 0; i < n_slots; ++i)
    if (!views[size_t(i)].destroyed) FUZZ_CHECK(to_tensor_destroy(handles[size_t(i)]) == TO_OK);
  return 0;
}
