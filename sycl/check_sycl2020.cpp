// Compile-only check that the kernel bodies (kernels/*.sycl without their
// oneAPI entry points) are SYCL 2020: each template is called from a plain
// parallel_for lambda with local_accessor memory, as an ahead-of-time SYCL
// compiler (icpx -fsycl, AdaptiveCpp) would build them, for all three storage
// types. Built by the project's C++ compiler against the runtime's headers
// (target tensor_ops_sycl_check_sycl2020, not built by default; .ci/sycl
// builds it); never run: without a SYCL device compiler there is no device code.
#define TO_SYCL2020_ONLY 1
#include "kernels/common.sycl"
#include "kernels/norm.sycl"
#include "kernels/activation.sycl"
#include "kernels/softmax.sycl"
#include "kernels/rope.sycl"
#include "kernels/attention.sycl"

template <typename T>
void submit_all(sycl::queue& q) {
  q.submit([&](sycl::handler& h) {
    sycl::local_accessor<float, 1> wa(TO_MAX_GROUP, h), wb(TO_MAX_GROUP, h);
    T* t = nullptr;
    float* f = nullptr;
    long* n = nullptr;
    int* flag = nullptr;
    h.parallel_for(sycl::nd_range<1>{64, 64}, [=](sycl::nd_item<1> it) {
      float* a = &wa[0];
      float* b = &wb[0];
      norm_row<T>(it, t, t, t, t, 1, 1, 1, 0.0f, 1.0f, 0, 0);
      add_rms_norm_row<T>(it, t, t, t, t, t, 1, 1, 1, 1, 1, 0.0f);
      norm_backward_row<T>(it, t, t, t, t, f, 1, 1, 1, 1, 0.0f, 1.0f, 1);
      norm_backward_columns<T>(it, t, t, f, t, t, 1, 1, 1, 1, 1);
      eltwise<T>(it, t, t, t, t, t, 1, 1, 1, 1, 1, 1, 1, 0, 0);
      softmax_row<T>(it, t, t, 1, 1, 1, 1.0f, 0, 0, 1);
      softmax_backward_row<T>(it, t, t, t, 1, 1, 1, 1, 1.0f, 0);
      cross_entropy_row<T>(it, t, n, f, t, flag, 1, 1, -100, 1, 1.0f, 0.0f, 0.0f, 0.0f);
      rope_item<T>(it, t, t, t, n, t, flag, 1, 1, 1, 2, 1, 1, 1, 1, 0, 0);
      attention_row<T>(it, a, t, t, t, t, f, 1, 1, 1, 1, 1, 1.0f, 0);
      attention_delta<T>(it, t, t, f, 1, 1);
      attention_dq_row<T>(it, a, t, t, t, t, f, f, t, 1, 1, 1, 1, 1, 1.0f, 0);
      attention_dkv_row<T>(it, a, b, t, t, t, t, f, f, t, t, 1, 1, 1, 1, 1, 1.0f, 0);
    });
  });
}

int main() {
  sycl::queue q;
  submit_all<float>(q);
  submit_all<sycl::half>(q);
  submit_all<bf16_bits>(q);
  return 0;
}
