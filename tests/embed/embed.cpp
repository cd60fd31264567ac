// A C++ application using the installed tensor_ops: rms_norm on host data
// through the C++ API, and the backend listing.
#include <tensor_ops/errors.h>
#include <tensor_ops/ops.h>
#include <tensor_ops/registry.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

int main() {
  namespace fs = std::filesystem;
  const fs::path loaded = fs::canonical(tensor_ops::core_library_dir());
  const fs::path installed = fs::canonical(TENSOR_OPS_INSTALLED_LIBDIR);
  std::printf("libtensor_ops.so loaded from %s\n", loaded.c_str());
  if (loaded != installed) {
    std::fprintf(stderr, "FAIL: expected the installed library in %s\n", installed.c_str());
    return 1;
  }
  // Plugins load from beside the installed core (usable or not on this machine).
  for (const tensor_ops::BackendStatus& s : tensor_ops::Registry::instance().status()) {
    std::printf("backend %-8s usable=%d %s %s\n", s.name.c_str(), int(s.usable), s.library.c_str(),
                s.reason.c_str());
    if (!s.library.empty() && s.library != "built-in" && fs::canonical(s.library).parent_path() != installed) {
      std::fprintf(stderr, "FAIL: plugin %s loaded from outside %s\n", s.library.c_str(), installed.c_str());
      return 1;
    }
  }

  const int64_t rows = 3, cols = 5;
  std::vector<float> x(rows * cols), w(cols), y(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[size_t(i)] = float(i % 7) - 3.0f;
  for (int64_t j = 0; j < cols; ++j) w[size_t(j)] = 0.5f + 0.25f * float(j);
  using tensor_ops::DType;
  using tensor_ops::Tensor;
  tensor_ops::rms_norm(Tensor(x.data(), DType::Float32, {rows, cols}), Tensor(w.data(), DType::Float32, {cols}),
                       Tensor(y.data(), DType::Float32, {rows, cols}), 1e-6);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < cols; ++j) ss += double(x[size_t(r * cols + j)]) * x[size_t(r * cols + j)];
    const double inv = 1.0 / std::sqrt(ss / double(cols) + 1e-6);
    for (int64_t j = 0; j < cols; ++j) {
      const double want = x[size_t(r * cols + j)] * inv * w[size_t(j)];
      if (std::fabs(y[size_t(r * cols + j)] - want) > 1e-5 * (1 + std::fabs(want))) {
        std::fprintf(stderr, "FAIL: y[%lld, %lld] = %g, want %g\n", (long long)r, (long long)j,
                     double(y[size_t(r * cols + j)]), want);
        return 1;
      }
    }
  }
  // Errors are C++ exceptions of the tensor_ops hierarchy.
  try {
    tensor_ops::rms_norm(Tensor(x.data(), DType::Float32, {rows, cols}), Tensor(w.data(), DType::Float32, {cols}),
                         Tensor(y.data(), DType::Float32, {rows, cols}), -1.0);
    std::fprintf(stderr, "FAIL: a negative eps was accepted\n");
    return 1;
  } catch (const tensor_ops::InvalidArgument& e) {
    std::printf("negative eps -> InvalidArgument: %s\n", e.what());
  }
  std::printf("embed_cpp: OK\n");
  return 0;
}
