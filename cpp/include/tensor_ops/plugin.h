/* The backend plugin boundary: plain C, versioned.
 *
 * Every backend (the built-in CPU one included) is a table of function
 * pointers. A plugin is a shared library named libtensor_ops_<name>.so beside
 * the core library that exports `tensor_ops_backend_v1`, returning its table.
 * The core validates all arguments before a kernel sees them, so kernels trust
 * their input. Functions return a to_status; on failure the backend's
 * last_error() gives a message (thread-local in the backend).
 */
#ifndef TENSOR_OPS_PLUGIN_H
#define TENSOR_OPS_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2 appended stream_wait to the table; the core still loads version-1
 * tables (they end at kernels[]) and reads nothing past them. */
#define TENSOR_OPS_PLUGIN_ABI_VERSION 2u
#define TENSOR_OPS_PLUGIN_ABI_MIN_VERSION 1u
#define TENSOR_OPS_MAX_OPS 64
#define TENSOR_OPS_MAX_DIMS 8
#define TENSOR_OPS_MAX_OP_TENSORS 8

typedef enum to_status {
  TO_OK = 0,
  TO_ERR_INVALID_ARGUMENT = 1,
  TO_ERR_UNSUPPORTED = 2,
  TO_ERR_BACKEND_UNAVAILABLE = 3,
  TO_ERR_OUT_OF_MEMORY = 4,
  TO_ERR_DEVICE = 5,
  TO_ERR_INTERNAL = 6
} to_status;

/* Float types carry data; the integer types only index (targets, positions). */
typedef enum to_dtype { TO_FLOAT32 = 0, TO_FLOAT16 = 1, TO_BFLOAT16 = 2, TO_INT32 = 3, TO_INT64 = 4 } to_dtype;

typedef enum to_device_type {
  TO_DEVICE_CPU = 0,
  TO_DEVICE_GPU = 1,
  TO_DEVICE_ACCELERATOR = 2,
  TO_DEVICE_OTHER = 3
} to_device_type;

/* A strided view; strides are in elements. `data` is a pointer on host and
 * pointer-addressed devices (CUDA, HIP, SYCL USM); on OpenCL it is a cl_mem
 * handle. Element 0 is at byte `byte_offset` from `data` (always 0 where the
 * core can move the pointer itself). A tensor with no elements may come with
 * data NULL (the core allocates nothing for it on a device); a kernel may
 * still receive one, e.g. attention with no keys. */
typedef struct to_tensor {
  void* data;
  uint64_t byte_offset;
  int32_t dtype;
  int32_t ndim;
  int64_t shape[TENSOR_OPS_MAX_DIMS];
  int64_t strides[TENSOR_OPS_MAX_DIMS];
  int32_t device_id;
} to_tensor;

/* One op invocation. Row-wise ops receive 2-D views [rows, cols] with
 * strides [row_stride, 1] (the core collapses higher ranks). */
typedef struct to_op_call {
  int32_t op;
  int32_t n_inputs;
  int32_t n_outputs;
  to_tensor inputs[TENSOR_OPS_MAX_OP_TENSORS];
  to_tensor outputs[TENSOR_OPS_MAX_OP_TENSORS];
  double scalars[4];
  int64_t ints[8];
  /* The queue the kernel runs on, a backend handle (cudaStream_t,
   * hipStream_t): the caller's, when a framework passed one (the core sets
   * it per thread, see tensor_ops/stream.h); NULL the default stream. */
  void* stream;
} to_op_call;

typedef struct to_device_info {
  char name[256];
  char vendor[128];
  char driver_version[128];
  char compute_capability[64];
  int32_t device_type; /* to_device_type */
  uint64_t total_memory_bytes;
  int32_t is_available;
  /* "key=value" lines: backend-specific facts (ISA level, compute units...) */
  char properties[2048];
} to_device_info;

typedef to_status (*to_kernel_fn)(const to_op_call* call);

/* to_backend_v1.flags */
#define TO_BACKEND_HANDLE_MEMORY 1u /* device memory is a handle (cl_mem) + byte_offset, not a pointer */
/* The backend keeps working in a child forked after it initialised (it holds
 * no threads or driver state that fork() breaks, or resets them itself with
 * pthread_atfork). Without this flag the core reports the backend unusable in
 * such a child, with the reason, instead of calling into a vendor runtime
 * (CUDA, OpenCL, SYCL) that fork() left without its threads. */
#define TO_BACKEND_FORK_SAFE 2u
/* cross_entropy reads scalars[1..3] (label_smoothing, z_loss, softcap); the
 * core refuses those options on a backend without this flag (older plugins
 * read only scalars[0] and ints[0..1]). */
#define TO_BACKEND_CE_OPTIONS 4u
/* rms_norm and rms_norm_backward read scalars[1], the weight offset (y = x *
 * rstd * (offset + w), Gemma's 1 + w); the core refuses a nonzero offset on a
 * backend without this flag (older plugins read only scalars[0]). */
#define TO_BACKEND_NORM_OFFSET 8u

typedef struct to_backend_v1 {
  uint32_t abi_version; /* TENSOR_OPS_PLUGIN_ABI_VERSION */
  const char* name;
  uint32_t flags; /* TO_BACKEND_* */
  /* Probes the vendor runtime. TO_OK: usable. Otherwise writes why not. */
  to_status (*init)(char* reason, size_t reason_len);
  /* Default rank when several are usable; higher runs first. */
  int32_t (*priority)(void);
  int32_t (*device_count)(void);
  to_status (*device_info)(int32_t device, to_device_info* out);
  to_status (*mem_info)(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes);
  to_status (*allocate)(int32_t device, size_t bytes, void** ptr);
  void (*deallocate)(int32_t device, void* ptr, size_t bytes);
  /* kind: 0 host->device, 1 device->host, 2 device->device. Offsets are in
   * bytes from dst / src (host pointers are passed with offset 0). Blocking,
   * and ordered after kernels already launched on the default stream. */
  to_status (*copy)(int32_t device, void* dst, uint64_t dst_offset, const void* src, uint64_t src_offset,
                    size_t bytes, int32_t kind);
  to_status (*memset)(int32_t device, void* dst, uint64_t offset, int32_t value, size_t bytes);
  to_status (*synchronize)(int32_t device);
  const char* (*last_error)(void);
  /* Indexed by op id (ops.def); NULL means the op is unsupported here. */
  to_kernel_fn kernels[TENSOR_OPS_MAX_OPS];

  /* ---- ABI 2: read only when abi_version >= 2 (a version-1 table ends above) ---- */

  /* Makes work queued later on `consumer` wait, on the device, for the work
   * queued so far on `producer` (an event recorded on one, waited on by the
   * other; the host does not wait). Stream handles as in to_op_call.stream,
   * NULL the legacy default stream; the special handles a runtime defines
   * (CUDA's cudaStreamLegacy 0x1, cudaStreamPerThread 0x2) pass through.
   * NULL: the backend has no streams (its work is ordered on the host). */
  to_status (*stream_wait)(int32_t device, void* consumer, void* producer);
} to_backend_v1;

typedef const to_backend_v1* (*to_backend_entry_fn)(void);
#define TENSOR_OPS_PLUGIN_ENTRY "tensor_ops_backend_v1"

#ifdef __cplusplus
}
#endif
#endif
