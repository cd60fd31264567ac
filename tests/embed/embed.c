/* A C application using the installed tensor_ops through its C ABI. */
#include <math.h>
#include <stdio.h>
#include <tensor_ops/tensor_ops.h>

int main(void) {
  if (to_abi_version() != TENSOR_OPS_C_ABI_VERSION) {
    fprintf(stderr, "FAIL: library C ABI %u, header %u\n", to_abi_version(), TENSOR_OPS_C_ABI_VERSION);
    return 1;
  }
  float x[4] = {-2.0f, -0.5f, 0.0f, 3.0f}, y[4] = {0};
  const int64_t shape[1] = {4};
  to_tensor_h tx = NULL, ty = NULL;
  if (to_tensor_create(x, TO_FLOAT32, 1, shape, NULL, "cpu", &tx) != TO_OK ||
      to_tensor_create(y, TO_FLOAT32, 1, shape, NULL, NULL, &ty) != TO_OK || to_silu(tx, ty) != TO_OK) {
    fprintf(stderr, "FAIL: %s\n", to_last_error());
    return 1;
  }
  for (int i = 0; i < 4; ++i) {
    const double want = x[i] / (1.0 + exp(-(double)x[i]));
    if (fabs(y[i] - want) > 1e-5) {
      fprintf(stderr, "FAIL: silu(%g) = %g, want %g\n", x[i], y[i], want);
      return 1;
    }
  }
  to_tensor_destroy(tx);
  to_tensor_destroy(ty);
  printf("embed_c: OK\n");
  return 0;
}
