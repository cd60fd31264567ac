/* The tensor_ops C ABI: plain C (C99 or later, or C++), stable across
 * compilers and usable from any language with a C FFI.
 *
 * - Tensors are opaque handles (to_tensor_h) describing memory the caller
 *   owns: data pointer + dtype + shape + strides (in elements) + device. A
 *   handle never owns or copies the data; destroy it with to_tensor_destroy.
 * - Every function that can fail returns a to_status (plugin.h): TO_OK, or an
 *   error class. Nothing throws across this boundary. On failure,
 *   to_last_error() gives the message (thread-local); a successful call
 *   clears it to "".
 * - NULL where a handle or an out-pointer is required, and handles that are
 *   not live (never created, or already destroyed, unless a newer handle
 *   has since been given the same address), give TO_ERR_INVALID_ARGUMENT.
 * - Ops validate everything (dtypes, shapes, devices, layouts, overlaps,
 *   sizes, eps) before a kernel runs, and run where the data lives (host data
 *   on the active backend). Outputs are caller-provided.
 * - Thread safety: every function may be called from any thread at once; a
 *   handle must not be destroyed while another thread is using it.
 */
#ifndef TENSOR_OPS_TENSOR_OPS_H
#define TENSOR_OPS_TENSOR_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "tensor_ops/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TENSOR_OPS_API __attribute__((visibility("default")))

/* Bumped on any incompatible change of this header's functions or types. */
#define TENSOR_OPS_C_ABI_VERSION 1u

typedef struct to_tensor_handle* to_tensor_h;

/* Op ids, shared with the plugin ABI (ops.def): TO_OP_rms_norm, TO_OP_silu... */
typedef enum to_op {
#define TENSOR_OPS_OP(name, id, n_in, n_out) TO_OP_##name = id,
#include "tensor_ops/ops.def"
#undef TENSOR_OPS_OP
  TO_OP_COUNT
} to_op;

/* Activations of to_glu, to_glu_backward and to_activation_backward. */
typedef enum to_activation {
  TO_ACTIVATION_SILU = 0,
  TO_ACTIVATION_GELU = 1,     /* erf form */
  TO_ACTIVATION_GELU_TANH = 2 /* tanh approximation */
} to_activation;

/* ---- library ------------------------------------------------------------ */

/* TENSOR_OPS_C_ABI_VERSION of the loaded library. */
TENSOR_OPS_API uint32_t to_abi_version(void);
/* Message of this thread's last failed call ("" after a success). Valid until
 * the thread's next tensor_ops call. Never NULL. */
TENSOR_OPS_API const char* to_last_error(void);
/* "TO_OK", "TO_ERR_INVALID_ARGUMENT", ...; "TO_ERR_UNKNOWN" for other values. */
TENSOR_OPS_API const char* to_status_name(to_status status);

/* ---- tensors ------------------------------------------------------------ */

/* A view of caller memory. dtype: a to_dtype. ndim in [0, TENSOR_OPS_MAX_DIMS];
 * shape has ndim entries (may be NULL when ndim is 0); strides in elements,
 * NULL for row-major contiguous. device: NULL, "cpu" or "host" for host
 * memory, else "<backend>:<id>" ("cuda:0", "opencl:1"; "<backend>" means id 0).
 * data may be NULL only for a tensor with no elements, and must be aligned to
 * the dtype's size. */
TENSOR_OPS_API to_status to_tensor_create(void* data, int32_t dtype, int32_t ndim, const int64_t* shape,
                                          const int64_t* strides, const char* device, to_tensor_h* out);
/* Frees the handle (not the data). NULL is accepted and does nothing. */
TENSOR_OPS_API to_status to_tensor_destroy(to_tensor_h tensor);
/* Reads a handle back; every out-pointer may be NULL. shape and strides need
 * room for TENSOR_OPS_MAX_DIMS entries. */
TENSOR_OPS_API to_status to_tensor_info(to_tensor_h tensor, void** data, int32_t* dtype, int32_t* ndim,
                                        int64_t* shape, int64_t* strides);

/* ---- backends and devices ------------------------------------------------ */
/* Strings are copied into caller buffers, NUL-terminated; a buffer too small
 * gives TO_ERR_INVALID_ARGUMENT (the message says the size needed) and holds
 * the truncated text. */

/* Backends known to this build, compiled or not, in priority order. */
TENSOR_OPS_API to_status to_backend_count(int32_t* count);
TENSOR_OPS_API to_status to_backend_name(int32_t index, char* buf, size_t buf_len);
TENSOR_OPS_API to_status to_backend_usable(int32_t index, int32_t* usable);
/* Why the backend cannot run ("" when usable). */
TENSOR_OPS_API to_status to_backend_reason(int32_t index, char* buf, size_t buf_len);
/* Devices of the usable backends. */
TENSOR_OPS_API to_status to_device_count(int32_t* count);
TENSOR_OPS_API to_status to_device_get(int32_t index, char* backend, size_t backend_len, int32_t* device_id,
                                       to_device_info* info);
/* The backend host data runs on, for every thread; NULL, "" or "auto" returns
 * to automatic selection. */
TENSOR_OPS_API to_status to_set_backend(const char* name);
TENSOR_OPS_API to_status to_active_backend(char* buf, size_t buf_len);

/* ---- ops ------------------------------------------------------------------ */
/* Booleans are int32_t (nonzero: true). Optional tensors may be NULL. */

TENSOR_OPS_API int32_t to_op_count(void);
/* The op's name, or NULL for an unknown id. */
TENSOR_OPS_API const char* to_op_name(int32_t op);
TENSOR_OPS_API to_status to_op_id(const char* name, int32_t* op);

/* Any op by id, without building a call struct. inputs / outputs in the order
 * of the typed functions below (optional ones NULL); the counts must match
 * exactly:
 *   op                   in  out  scalars        ints
 *   rms_norm              2   1   eps            -              (2 scalars: [, offset]:
 *                                 y = x * rstd * (offset + weight), Gemma's offset 1)
 *   silu                  1   1   -              -
 *   gelu                  1   1   -              approximate_tanh
 *   layer_norm            3   1   eps            -              (bias optional)
 *   rms_norm_backward     3   2   eps            -              (2 scalars: [, offset])
 *   layer_norm_backward   3   3   eps            -              (dbias optional)
 *   add_rms_norm          3   2   eps            -
 *   softmax               1   1   scale          causal, log
 *   softmax_backward      2   1   scale          log
 *   activation_backward   2   1   -              activation
 *   glu                   2   1   -              activation
 *   glu_backward          3   2   -              activation
 *   rope                  4   1   -              interleaved, inverse
 *   attention             3   2   scale          causal
 *   attention_backward    6   3   scale          causal
 *   cross_entropy         2   2   grad_scale     ignore_index   (dlogits optional; 4 scalars:
 *                                 [, label_smoothing, z_loss, softcap])
 *   linear                3   1   -              [weight_layout] (bias optional; weight_layout 0:
 *                                 weight [N, K], x weight^T, the default; 1: weight [K, N], x weight)
 * scalars / ints may be NULL when their count is 0. */
TENSOR_OPS_API to_status to_op_run(int32_t op, const to_tensor_h* inputs, int32_t n_inputs, const to_tensor_h* outputs,
                                   int32_t n_outputs, const double* scalars, int32_t n_scalars, const int64_t* ints,
                                   int32_t n_ints);

/* y = x / sqrt(mean(x^2, last dim) + eps) * weight */
TENSOR_OPS_API to_status to_rms_norm(to_tensor_h x, to_tensor_h weight, to_tensor_h out, double eps);
TENSOR_OPS_API to_status to_silu(to_tensor_h x, to_tensor_h out);
TENSOR_OPS_API to_status to_gelu(to_tensor_h x, to_tensor_h out, int32_t approximate_tanh);
TENSOR_OPS_API to_status to_layer_norm(to_tensor_h x, to_tensor_h weight, to_tensor_h bias, to_tensor_h out,
                                       double eps);
TENSOR_OPS_API to_status to_rms_norm_backward(to_tensor_h dy, to_tensor_h x, to_tensor_h weight, to_tensor_h dx,
                                              to_tensor_h dweight, double eps);
TENSOR_OPS_API to_status to_layer_norm_backward(to_tensor_h dy, to_tensor_h x, to_tensor_h weight, to_tensor_h dx,
                                                to_tensor_h dweight, to_tensor_h dbias, double eps);
/* out = rms_norm(x + residual) * weight, residual_out = x + residual. */
TENSOR_OPS_API to_status to_add_rms_norm(to_tensor_h x, to_tensor_h residual, to_tensor_h weight, to_tensor_h out,
                                         to_tensor_h residual_out, double eps);
/* softmax(scale * x) over the last dim. causal: 0 none; 1 bottom-right (masks [.., i, j] for
 * j > i + cols - rows); 2 top-left (masks j > i, torch SDPA's is_causal); other values are an error. */
TENSOR_OPS_API to_status to_softmax(to_tensor_h x, to_tensor_h out, double scale, int32_t causal);
TENSOR_OPS_API to_status to_log_softmax(to_tensor_h x, to_tensor_h out, double scale, int32_t causal);
TENSOR_OPS_API to_status to_softmax_backward(to_tensor_h dy, to_tensor_h y, to_tensor_h dx, double scale,
                                             int32_t log);
TENSOR_OPS_API to_status to_activation_backward(to_tensor_h dy, to_tensor_h x, to_tensor_h dx, int32_t activation);
/* out = act(gate) * up */
TENSOR_OPS_API to_status to_glu(to_tensor_h gate, to_tensor_h up, to_tensor_h out, int32_t activation);
TENSOR_OPS_API to_status to_swiglu(to_tensor_h gate, to_tensor_h up, to_tensor_h out);
TENSOR_OPS_API to_status to_glu_backward(to_tensor_h dy, to_tensor_h gate, to_tensor_h up, to_tensor_h dgate,
                                         to_tensor_h dup, int32_t activation);
/* x [B, S, H, D], cos / sin [P, R/2], positions int32/int64 [B or 1, S]. */
TENSOR_OPS_API to_status to_rope(to_tensor_h x, to_tensor_h cos, to_tensor_h sin, to_tensor_h positions,
                                 to_tensor_h out, int32_t interleaved, int32_t inverse);
/* q [B, Hq, Lq, D], k / v [B, Hkv, Lk, D] -> out like q, lse float32 [B, Hq, Lq]. causal as softmax's
 * (0 none, 1 bottom-right, 2 top-left); a query that sees no key gets a zero row and lse -inf. */
TENSOR_OPS_API to_status to_attention(to_tensor_h q, to_tensor_h k, to_tensor_h v, to_tensor_h out, to_tensor_h lse,
                                      int32_t causal, double scale);
TENSOR_OPS_API to_status to_attention_backward(to_tensor_h dout, to_tensor_h q, to_tensor_h k, to_tensor_h v,
                                               to_tensor_h out, to_tensor_h lse, to_tensor_h dq, to_tensor_h dk,
                                               to_tensor_h dv, int32_t causal, double scale);
/* logits [N, C], target int32/int64 [N] -> loss float32 [N], dlogits [N, C] (optional). */
TENSOR_OPS_API to_status to_cross_entropy(to_tensor_h logits, to_tensor_h target, to_tensor_h loss,
                                          to_tensor_h dlogits, int64_t ignore_index, double grad_scale);

#ifdef __cplusplus
}
#endif
#endif
