/* The C ABI from a C11 program: results, status codes and messages for bad
 * input, the backend listing, and the thread-local last error. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "tensor_ops/tensor_ops.h"

static int failures = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                            \
    }                                                                        \
  } while (0)

/* A call's status must be `want` and the message must contain `text`. */
#define EXPECT_ERROR(call, want, text)                                                                     \
  do {                                                                                                     \
    to_status got_ = (call);                                                                               \
    if (got_ != (want) || strstr(to_last_error(), (text)) == NULL) {                                       \
      fprintf(stderr, "%s:%d: %s\n  gave %s \"%s\"\n  want %s with \"%s\"\n", __FILE__, __LINE__, #call, \
              to_status_name(got_), to_last_error(), to_status_name(want), (text));                        \
      ++failures;                                                                                          \
    }                                                                                                      \
  } while (0)

#define EXPECT_OK(call) EXPECT_ERROR(call, TO_OK, "")

static to_tensor_h make(void* data, int32_t dtype, int32_t ndim, const int64_t* shape, const int64_t* strides,
                        const char* device) {
  to_tensor_h t = NULL;
  if (to_tensor_create(data, dtype, ndim, shape, strides, device, &t) != TO_OK) {
    fprintf(stderr, "to_tensor_create failed: %s\n", to_last_error());
    ++failures;
  }
  return t;
}

static void test_version_and_names(void) {
  CHECK(to_abi_version() == TENSOR_OPS_C_ABI_VERSION);
  CHECK(strcmp(to_status_name(TO_ERR_INVALID_ARGUMENT), "TO_ERR_INVALID_ARGUMENT") == 0);
  CHECK(strcmp(to_status_name((to_status)99), "TO_ERR_UNKNOWN") == 0);
  CHECK(to_op_count() == TO_OP_COUNT);
  CHECK(strcmp(to_op_name(TO_OP_rms_norm), "rms_norm") == 0);
  CHECK(to_op_name(-1) == NULL && to_op_name(TO_OP_COUNT) == NULL);
  int32_t op = -1;
  EXPECT_OK(to_op_id("cross_entropy", &op));
  CHECK(op == TO_OP_cross_entropy);
  EXPECT_ERROR(to_op_id("no_such_op", &op), TO_ERR_INVALID_ARGUMENT, "unknown op 'no_such_op'");
  EXPECT_ERROR(to_op_id(NULL, &op), TO_ERR_INVALID_ARGUMENT, "name is NULL");
}

static void test_backends(void) {
  int32_t n = 0, cpu = -1;
  EXPECT_OK(to_backend_count(&n));
  CHECK(n >= 1);
  for (int32_t i = 0; i < n; ++i) {
    char name[64], reason[1024];
    int32_t usable = -1;
    EXPECT_OK(to_backend_name(i, name, sizeof(name)));
    EXPECT_OK(to_backend_usable(i, &usable));
    EXPECT_OK(to_backend_reason(i, reason, sizeof(reason)));
    CHECK(usable == 0 || usable == 1);
    CHECK(usable == (reason[0] == '\0'));
    if (strcmp(name, "cpu") == 0) cpu = i;
  }
  CHECK(cpu >= 0);
  int32_t usable = 0;
  EXPECT_OK(to_backend_usable(cpu, &usable));
  CHECK(usable == 1);
  char small[2];
  EXPECT_ERROR(to_backend_name(cpu, small, sizeof(small)), TO_ERR_INVALID_ARGUMENT, "too small, need 4");
  CHECK(strcmp(small, "c") == 0);
  EXPECT_ERROR(to_backend_name(n, small, sizeof(small)), TO_ERR_INVALID_ARGUMENT, "outside");
  EXPECT_ERROR(to_backend_name(cpu, NULL, 8), TO_ERR_INVALID_ARGUMENT, "buf is NULL");
  EXPECT_ERROR(to_backend_count(NULL), TO_ERR_INVALID_ARGUMENT, "count is NULL");

  int32_t devices = 0, id = -1;
  EXPECT_OK(to_device_count(&devices));
  CHECK(devices >= 1);
  char backend[64];
  to_device_info info;
  int found_cpu = 0;
  for (int32_t i = 0; i < devices; ++i) {
    EXPECT_OK(to_device_get(i, backend, sizeof(backend), &id, &info));
    if (strcmp(backend, "cpu") == 0) found_cpu = info.device_type == TO_DEVICE_CPU && id == 0 && info.is_available;
  }
  CHECK(found_cpu);
  EXPECT_ERROR(to_device_get(-1, backend, sizeof(backend), &id, &info), TO_ERR_INVALID_ARGUMENT, "outside");

  EXPECT_OK(to_set_backend("cpu"));
  char active[64];
  EXPECT_OK(to_active_backend(active, sizeof(active)));
  CHECK(strcmp(active, "cpu") == 0);
  EXPECT_ERROR(to_set_backend("no_such_backend"), TO_ERR_INVALID_ARGUMENT, "unknown backend 'no_such_backend'");
  EXPECT_OK(to_set_backend(NULL));
}

static void test_rms_norm_values(void) {
  enum { ROWS = 3, COLS = 7 };
  float x[ROWS * COLS], w[COLS], y[ROWS * COLS];
  for (int i = 0; i < ROWS * COLS; ++i) x[i] = (float)((i * 37) % 11) - 5.0f;
  for (int j = 0; j < COLS; ++j) w[j] = 0.5f + 0.125f * (float)j;
  const int64_t shape[2] = {ROWS, COLS}, wshape[1] = {COLS};
  to_tensor_h tx = make(x, TO_FLOAT32, 2, shape, NULL, "cpu");
  to_tensor_h tw = make(w, TO_FLOAT32, 1, wshape, NULL, NULL);
  to_tensor_h ty = make(y, TO_FLOAT32, 2, shape, NULL, "host");
  const double eps = 1e-5;
  EXPECT_OK(to_rms_norm(tx, tw, ty, eps));
  for (int r = 0; r < ROWS; ++r) {
    double ss = 0;
    for (int j = 0; j < COLS; ++j) ss += (double)x[r * COLS + j] * x[r * COLS + j];
    const double inv = 1.0 / sqrt(ss / COLS + eps);
    for (int j = 0; j < COLS; ++j) {
      const double want = x[r * COLS + j] * inv * w[j];
      if (fabs(y[r * COLS + j] - want) > 1e-5 * (1.0 + fabs(want))) {
        fprintf(stderr, "rms_norm y[%d][%d] = %.8g, want %.8g\n", r, j, y[r * COLS + j], want);
        ++failures;
      }
    }
  }
  /* The same through the generic entry point. */
  float y2[ROWS * COLS];
  to_tensor_h ty2 = make(y2, TO_FLOAT32, 2, shape, NULL, NULL);
  const to_tensor_h in[2] = {tx, tw}, out[1] = {ty2};
  EXPECT_OK(to_op_run(TO_OP_rms_norm, in, 2, out, 1, &eps, 1, NULL, 0));
  CHECK(memcmp(y, y2, sizeof(y)) == 0);
  EXPECT_ERROR(to_op_run(TO_OP_rms_norm, in, 1, out, 1, &eps, 1, NULL, 0), TO_ERR_INVALID_ARGUMENT,
               "rms_norm takes 2 inputs, got 1");
  EXPECT_ERROR(to_op_run(TO_OP_rms_norm, in, 2, out, 1, NULL, 0, NULL, 0), TO_ERR_INVALID_ARGUMENT,
               "takes 1 scalars, got 0");
  EXPECT_ERROR(to_op_run(TO_OP_rms_norm, in, 2, out, 1, NULL, 1, NULL, 0), TO_ERR_INVALID_ARGUMENT,
               "scalars is NULL");
  EXPECT_ERROR(to_op_run(99, in, 2, out, 1, &eps, 1, NULL, 0), TO_ERR_INVALID_ARGUMENT, "unknown op id 99");

  /* Reading a handle back. */
  void* data = NULL;
  int32_t dtype = -1, ndim = -1;
  int64_t sh[TENSOR_OPS_MAX_DIMS], st[TENSOR_OPS_MAX_DIMS];
  EXPECT_OK(to_tensor_info(tx, &data, &dtype, &ndim, sh, st));
  CHECK(data == x && dtype == TO_FLOAT32 && ndim == 2 && sh[0] == ROWS && sh[1] == COLS && st[0] == COLS &&
        st[1] == 1);
  to_tensor_destroy(tx);
  to_tensor_destroy(tw);
  to_tensor_destroy(ty);
  to_tensor_destroy(ty2);
}

static void test_bad_input(void) {
  float x[8] = {0}, w[4] = {1, 1, 1, 1}, y[8];
  uint16_t h[4] = {0};
  const int64_t shape[2] = {2, 4}, wshape[1] = {4};
  to_tensor_h tx = make(x, TO_FLOAT32, 2, shape, NULL, NULL);
  to_tensor_h tw = make(w, TO_FLOAT32, 1, wshape, NULL, NULL);
  to_tensor_h ty = make(y, TO_FLOAT32, 2, shape, NULL, NULL);
  to_tensor_h th = make(h, TO_FLOAT16, 1, wshape, NULL, NULL);

  EXPECT_ERROR(to_rms_norm(NULL, tw, ty, 1e-6), TO_ERR_INVALID_ARGUMENT, "rms_norm: x is NULL");
  EXPECT_ERROR(to_rms_norm(tx, tw, NULL, 1e-6), TO_ERR_INVALID_ARGUMENT, "rms_norm: out is NULL");
  EXPECT_ERROR(to_rms_norm(tx, th, ty, 1e-6), TO_ERR_INVALID_ARGUMENT, "weight has dtype float16 but x has float32");
  EXPECT_ERROR(to_rms_norm(tx, tw, ty, -1.0), TO_ERR_INVALID_ARGUMENT, "eps must be finite and >= 0");
  EXPECT_ERROR(to_rms_norm(tx, tw, ty, NAN), TO_ERR_INVALID_ARGUMENT, "eps must be finite");
  EXPECT_ERROR(to_rms_norm(tx, tx, ty, 1e-6), TO_ERR_INVALID_ARGUMENT, "weight must have shape [4]");
  EXPECT_ERROR(to_glu(tx, tx, ty, 7), TO_ERR_INVALID_ARGUMENT, "activation");

  /* A destroyed handle, and something that was never a handle. */
  to_tensor_h gone = make(x, TO_FLOAT32, 2, shape, NULL, NULL);
  EXPECT_OK(to_tensor_destroy(gone));
  EXPECT_ERROR(to_silu(gone, ty), TO_ERR_INVALID_ARGUMENT, "silu: x is not a live tensor handle");
  EXPECT_ERROR(to_tensor_destroy(gone), TO_ERR_INVALID_ARGUMENT, "not a live tensor handle");
  EXPECT_ERROR(to_silu((to_tensor_h)(void*)x, ty), TO_ERR_INVALID_ARGUMENT, "not a live tensor handle");
  EXPECT_OK(to_tensor_destroy(NULL));

  /* Bad descriptions are refused when the handle is made. */
  to_tensor_h t = (to_tensor_h)(void*)x;
  EXPECT_ERROR(to_tensor_create(x, 9, 2, shape, NULL, NULL, &t), TO_ERR_INVALID_ARGUMENT, "dtype 9");
  CHECK(t == NULL);
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 9, shape, NULL, NULL, &t), TO_ERR_INVALID_ARGUMENT, "ndim 9");
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, NULL, NULL, NULL, &t), TO_ERR_INVALID_ARGUMENT, "shape is NULL");
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, shape, NULL, NULL, NULL), TO_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_ERROR(to_tensor_create(NULL, TO_FLOAT32, 2, shape, NULL, NULL, &t), TO_ERR_INVALID_ARGUMENT,
               "null data pointer");
  const int64_t negative[2] = {2, -4};
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, negative, NULL, NULL, &t), TO_ERR_INVALID_ARGUMENT,
               "negative dimension");
  const int64_t huge[2] = {INT64_C(1) << 40, INT64_C(1) << 30};
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, huge, NULL, NULL, &t), TO_ERR_INVALID_ARGUMENT, "overflows");
  const int64_t huge_strides[2] = {INT64_C(1) << 62, 1};
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, shape, huge_strides, NULL, &t), TO_ERR_INVALID_ARGUMENT,
               "overflow");
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, shape, NULL, "cuda:x", &t), TO_ERR_INVALID_ARGUMENT,
               "bad device id");
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, shape, NULL, "cpu:1", &t), TO_ERR_INVALID_ARGUMENT,
               "CPU device other than 0");
  /* A zero-size tensor may have no data. */
  const int64_t empty[2] = {0, 4};
  to_tensor_h te = NULL;
  EXPECT_OK(to_tensor_create(NULL, TO_FLOAT32, 2, empty, NULL, NULL, &te));
  EXPECT_OK(to_silu(te, te));
  to_tensor_destroy(te);

  /* Devices that do not exist, or whose backend cannot run here. */
  /* An unknown backend is refused where the tensor is made, not at the first op. */
  EXPECT_ERROR(to_tensor_create(x, TO_FLOAT32, 2, shape, NULL, "nosuch:0", &t), TO_ERR_INVALID_ARGUMENT,
               "unknown backend 'nosuch'");
  to_tensor_h tz = make(x, TO_FLOAT32, 2, shape, NULL, "cuda:0"); /* known, usable or not */
  EXPECT_ERROR(to_silu(tx, tz), TO_ERR_INVALID_ARGUMENT, "out is on cuda:0 but x is on cpu");
  to_tensor_destroy(tz);
  int32_t n = 0;
  to_backend_count(&n);
  for (int32_t i = 0; i < n; ++i) {
    char name[64], device[80];
    int32_t usable = 1;
    to_backend_name(i, name, sizeof(name));
    to_backend_usable(i, &usable);
    if (usable) continue;
    snprintf(device, sizeof(device), "%s:0", name);
    to_tensor_h td = make(x, TO_FLOAT32, 2, shape, NULL, device);
    EXPECT_ERROR(to_silu(td, td), TO_ERR_BACKEND_UNAVAILABLE, "is not");
    to_tensor_destroy(td);
  }

  /* A success clears the message. */
  EXPECT_ERROR(to_rms_norm(tx, tw, ty, -1.0), TO_ERR_INVALID_ARGUMENT, "eps");
  EXPECT_OK(to_silu(tx, ty));
  CHECK(to_last_error()[0] == '\0');
  to_tensor_destroy(tx);
  to_tensor_destroy(tw);
  to_tensor_destroy(ty);
  to_tensor_destroy(th);
}

static void* fail_in_thread(void* arg) {
  (void)arg;
  to_status s = to_rms_norm(NULL, NULL, NULL, 0);
  return strstr(to_last_error(), "x is NULL") && s == TO_ERR_INVALID_ARGUMENT ? (void*)1 : NULL;
}

static void test_last_error_is_per_thread(void) {
  EXPECT_ERROR(to_silu(NULL, NULL), TO_ERR_INVALID_ARGUMENT, "silu: x is NULL");
  pthread_t thread;
  void* ok = NULL;
  CHECK(pthread_create(&thread, NULL, fail_in_thread, NULL) == 0);
  CHECK(pthread_join(thread, &ok) == 0);
  CHECK(ok == (void*)1);
  CHECK(strstr(to_last_error(), "silu: x is NULL") != NULL);
}

/* rms_norm and its backward through to_op_run with the weight offset (2
 * scalars: eps, offset; Gemma's 1 + w) against a double reference and against
 * the 1-scalar form given offset + w as the weight; other counts refused. */
static void test_rms_norm_offset(void) {
  enum { ROWS = 2, COLS = 5 };
  float x[ROWS * COLS], w[COLS], w1[COLS], y[ROWS * COLS], dy[ROWS * COLS];
  float dx[ROWS * COLS], dw[COLS], dx1[ROWS * COLS], dw1[COLS];
  for (int i = 0; i < ROWS * COLS; ++i) x[i] = (float)((i * 37) % 11) - 5.0f, dy[i] = 0.25f * (float)(i % 7) - 0.5f;
  for (int j = 0; j < COLS; ++j) w[j] = 0.125f * (float)j - 0.25f, w1[j] = 1.0f + w[j];  /* exact in fp32 */
  const int64_t shape[2] = {ROWS, COLS}, wshape[1] = {COLS};
  to_tensor_h tx = make(x, TO_FLOAT32, 2, shape, NULL, NULL), tw = make(w, TO_FLOAT32, 1, wshape, NULL, NULL);
  to_tensor_h tw1 = make(w1, TO_FLOAT32, 1, wshape, NULL, NULL), ty = make(y, TO_FLOAT32, 2, shape, NULL, NULL);
  to_tensor_h tdy = make(dy, TO_FLOAT32, 2, shape, NULL, NULL), tdx = make(dx, TO_FLOAT32, 2, shape, NULL, NULL);
  to_tensor_h tdw = make(dw, TO_FLOAT32, 1, wshape, NULL, NULL), tdx1 = make(dx1, TO_FLOAT32, 2, shape, NULL, NULL);
  to_tensor_h tdw1 = make(dw1, TO_FLOAT32, 1, wshape, NULL, NULL);
  const double sc[3] = {1e-5, 1.0, 0.0};
  const to_tensor_h in[2] = {tx, tw}, out[1] = {ty};
  EXPECT_OK(to_op_run(TO_OP_rms_norm, in, 2, out, 1, sc, 2, NULL, 0));
  for (int r = 0; r < ROWS; ++r) {
    double ss = 0;
    for (int j = 0; j < COLS; ++j) ss += (double)x[r * COLS + j] * x[r * COLS + j];
    const double inv = 1.0 / sqrt(ss / COLS + sc[0]);
    for (int j = 0; j < COLS; ++j) {
      const double want = x[r * COLS + j] * inv * (1.0 + w[j]);
      if (fabs(y[r * COLS + j] - want) > 1e-5 * (1.0 + fabs(want))) {
        fprintf(stderr, "rms_norm offset 1: y[%d][%d] = %.8g, want %.8g\n", r, j, y[r * COLS + j], want);
        ++failures;
      }
    }
  }
  const to_tensor_h bin[3] = {tdy, tx, tw}, bout[2] = {tdx, tdw};
  EXPECT_OK(to_op_run(TO_OP_rms_norm_backward, bin, 3, bout, 2, sc, 2, NULL, 0));
  EXPECT_OK(to_rms_norm_backward(tdy, tx, tw1, tdx1, tdw1, sc[0]));
  CHECK(memcmp(dx, dx1, sizeof(dx)) == 0 && memcmp(dw, dw1, sizeof(dw)) == 0);
  EXPECT_ERROR(to_op_run(TO_OP_rms_norm, in, 2, out, 1, sc, 3, NULL, 0), TO_ERR_INVALID_ARGUMENT,
               "takes 1 scalars, got 3");
  const double nan_offset[2] = {1e-5, NAN};
  EXPECT_ERROR(to_op_run(TO_OP_rms_norm_backward, bin, 3, bout, 2, nan_offset, 2, NULL, 0),
               TO_ERR_INVALID_ARGUMENT, "offset must be finite");
  to_tensor_destroy(tx);
  to_tensor_destroy(tw);
  to_tensor_destroy(tw1);
  to_tensor_destroy(ty);
  to_tensor_destroy(tdy);
  to_tensor_destroy(tdx);
  to_tensor_destroy(tdw);
  to_tensor_destroy(tdx1);
  to_tensor_destroy(tdw1);
}

/* cross_entropy through to_op_run with its options (4 scalars): label
 * smoothing 0.1, z-loss 0.01, softcap 2 against a double reference; the
 * 1-scalar form still works and other counts are refused. */
static void test_cross_entropy_options(void) {
  enum { N = 2, C = 5 };
  float x[N * C], loss[N], dl[N * C];
  int64_t tg[N] = {3, 0};
  for (int i = 0; i < N * C; ++i) x[i] = (float)((i * 7) % 9) * 0.5f - 2.0f;
  const int64_t shape[2] = {N, C}, nshape[1] = {N};
  to_tensor_h tx = make(x, TO_FLOAT32, 2, shape, NULL, NULL), tt = make(tg, TO_INT64, 1, nshape, NULL, NULL);
  to_tensor_h tl = make(loss, TO_FLOAT32, 1, nshape, NULL, NULL), td = make(dl, TO_FLOAT32, 2, shape, NULL, NULL);
  const to_tensor_h in[2] = {tx, tt}, out[2] = {tl, td};
  const double sc[4] = {1.0, 0.1, 0.01, 2.0};
  const int64_t ints[1] = {-100};
  EXPECT_OK(to_op_run(TO_OP_cross_entropy, in, 2, out, 2, sc, 4, ints, 1));
  for (int r = 0; r < N; ++r) {
    double z[C], m = -INFINITY, s = 0, mean = 0;
    for (int j = 0; j < C; ++j) {
      z[j] = 2.0 * tanh(x[r * C + j] / 2.0);
      m = z[j] > m ? z[j] : m;
      mean += z[j] / C;
    }
    for (int j = 0; j < C; ++j) s += exp(z[j] - m);
    const double lse = m + log(s);
    const double want = 0.9 * (lse - z[tg[r]]) + 0.1 * (lse - mean) + 0.01 * lse * lse;
    if (fabs(loss[r] - want) > 1e-5 * (1.0 + fabs(want))) {
      fprintf(stderr, "cross_entropy loss[%d] = %.8g, want %.8g\n", r, loss[r], want);
      ++failures;
    }
    for (int j = 0; j < C; ++j) {
      const double th = z[j] / 2.0;
      const double g = (exp(z[j] - lse) * (1 + 0.02 * lse) - 0.1 / C - (j == tg[r] ? 0.9 : 0.0)) * (1 - th * th);
      if (fabs(dl[r * C + j] - g) > 1e-5 * (1.0 + fabs(g))) {
        fprintf(stderr, "cross_entropy dlogits[%d][%d] = %.8g, want %.8g\n", r, j, dl[r * C + j], g);
        ++failures;
      }
    }
  }
  EXPECT_OK(to_op_run(TO_OP_cross_entropy, in, 2, out, 2, sc, 1, ints, 1));
  EXPECT_ERROR(to_op_run(TO_OP_cross_entropy, in, 2, out, 2, sc, 2, ints, 1), TO_ERR_INVALID_ARGUMENT,
               "takes 1 scalars, got 2");
  const double bad[4] = {1.0, 1.5, 0.0, 0.0};
  EXPECT_ERROR(to_op_run(TO_OP_cross_entropy, in, 2, out, 2, bad, 4, ints, 1), TO_ERR_INVALID_ARGUMENT,
               "label_smoothing must be in [0, 1]");
  to_tensor_destroy(tx);
  to_tensor_destroy(tt);
  to_tensor_destroy(tl);
  to_tensor_destroy(td);
}

int main(void) {
  test_version_and_names();
  test_backends();
  test_rms_norm_values();
  test_cross_entropy_options();
  test_rms_norm_offset();
  test_bad_input();
  test_last_error_is_per_thread();
  if (failures) {
    fprintf(stderr, "test_c_api: %d check(s) failed\n", failures);
    return 1;
  }
  printf("test_c_api: all checks passed\n");
  return 0;
}
