// A backend plugin for the tests, built three times (tests/cpp/CMakeLists.txt):
//   mock        usable, priority 10, one device, silu for float32 only;
//   mockbroken  init() fails as if its vendor runtime were missing;
//   mockbadabi  its table claims an ABI version the core does not speak;
//   mockv1      an ABI-1 table (before stream_wait): still loads, no streams;
//   mocknull_<entry>  the table's <entry> (a required function, or name) is
//               NULL: the core must refuse it with the reason, not crash.
// Its "device memory" is host memory, so tests can read what a kernel wrote.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tensor_ops/ops.h"
#include "tensor_ops/plugin.h"

#ifndef TENSOR_OPS_MOCK_NAME
#error "TENSOR_OPS_MOCK_NAME must name the plugin"
#endif
#ifndef TENSOR_OPS_MOCK_ABI_VERSION
#define TENSOR_OPS_MOCK_ABI_VERSION TENSOR_OPS_PLUGIN_ABI_VERSION
#endif

namespace {

thread_local std::string last_error_text;
// What tests inspect: the last call a kernel received on this thread (the
// views the core built) and the copies made, by kind (0 host->device,
// 1 device->host, 2 on device). Thread-safe: the concurrency tests run ops on
// the mock from several threads (under ThreadSanitizer in CI).
thread_local to_op_call last_call{};
std::atomic<uint64_t> copies[3] = {0, 0, 0};
// stream_wait calls: how many, and the last one's streams (single-threaded tests).
uint64_t waits = 0;
void* last_wait[2] = {nullptr, nullptr};

to_status mock_init(char* reason, size_t reason_len) {
#ifdef TENSOR_OPS_MOCK_BROKEN
  std::snprintf(reason, reason_len, "mock runtime missing (libmockrt.so.1 not found)");
  return TO_ERR_BACKEND_UNAVAILABLE;
#else
  (void)reason;
  (void)reason_len;
  return TO_OK;
#endif
}

int32_t mock_priority() { return 10; }
int32_t mock_device_count() { return 1; }

to_status mock_device_info(int32_t device, to_device_info* out) {
  if (device != 0) {
    last_error_text = "mock has one device (0), asked for " + std::to_string(device);
    return TO_ERR_INVALID_ARGUMENT;
  }
  *out = to_device_info{};
  std::snprintf(out->name, sizeof(out->name), "Mock Device");
  std::snprintf(out->vendor, sizeof(out->vendor), "tensor_ops tests");
  out->device_type = TO_DEVICE_OTHER;
  out->total_memory_bytes = uint64_t(1) << 30;
  out->is_available = 1;
  std::snprintf(out->properties, sizeof(out->properties), "kind=mock");
  return TO_OK;
}

to_status mock_mem_info(int32_t, uint64_t* free_bytes, uint64_t* total_bytes) {
  *free_bytes = *total_bytes = uint64_t(1) << 30;
  return TO_OK;
}

to_status mock_allocate(int32_t, size_t bytes, void** ptr) {
  *ptr = bytes ? std::malloc(bytes) : nullptr;
  if (bytes && !*ptr) {
    last_error_text = "mock allocation of " + std::to_string(bytes) + " bytes failed";
    return TO_ERR_OUT_OF_MEMORY;
  }
  return TO_OK;
}

void mock_deallocate(int32_t, void* ptr, size_t) { std::free(ptr); }

to_status mock_copy(int32_t, void* dst, uint64_t dst_offset, const void* src, uint64_t src_offset, size_t bytes,
                    int32_t kind) {
  ++copies[kind];
  if (bytes) std::memcpy(static_cast<char*>(dst) + dst_offset, static_cast<const char*>(src) + src_offset, bytes);
  return TO_OK;
}

to_status mock_memset(int32_t, void* dst, uint64_t offset, int32_t value, size_t bytes) {
  if (bytes) std::memset(static_cast<char*>(dst) + offset, value, bytes);
  return TO_OK;
}

to_status mock_synchronize(int32_t) { return TO_OK; }
const char* mock_last_error() { return last_error_text.c_str(); }

#if TENSOR_OPS_MOCK_ABI_VERSION >= 2
// A handle of 0xbad is a stream the "runtime" rejects.
to_status mock_stream_wait(int32_t, void* consumer, void* producer) {
  if (consumer == reinterpret_cast<void*>(0xbad) || producer == reinterpret_cast<void*>(0xbad)) {
    last_error_text = "mockStreamWaitEvent returned 400 (invalid resource handle)";
    return TO_ERR_DEVICE;
  }
  ++waits;
  last_wait[0] = consumer;
  last_wait[1] = producer;
  return TO_OK;
}
#endif

to_status mock_silu(const to_op_call* c) {
  last_call = *c;
  const to_tensor &x = c->inputs[0], &y = c->outputs[0];
  if (x.dtype != TO_FLOAT32) {
    last_error_text = "mock silu takes float32 only, got dtype id " + std::to_string(x.dtype);
    return TO_ERR_UNSUPPORTED;
  }
  const auto* xd = static_cast<const float*>(x.data);
  auto* yd = static_cast<float*>(y.data);
  for (int64_t r = 0; r < x.shape[0]; ++r)
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      const float v = xd[r * x.strides[0] + i];
      yd[r * y.strides[0] + i] = v / (1.0f + std::exp(-v));
    }
  return TO_OK;
}

to_backend_v1 make_table() {
  to_backend_v1 t{};
  t.abi_version = TENSOR_OPS_MOCK_ABI_VERSION;
  t.name = TENSOR_OPS_MOCK_NAME;
  t.init = mock_init;
  t.priority = mock_priority;
  t.device_count = mock_device_count;
  t.device_info = mock_device_info;
  t.mem_info = mock_mem_info;
  t.allocate = mock_allocate;
  t.deallocate = mock_deallocate;
  t.copy = mock_copy;
  t.memset = mock_memset;
  t.synchronize = mock_synchronize;
  t.last_error = mock_last_error;
  t.kernels[int(tensor_ops::OpId::silu)] = mock_silu;
#if TENSOR_OPS_MOCK_ABI_VERSION >= 2
  t.stream_wait = mock_stream_wait;
#endif
#ifdef TENSOR_OPS_MOCK_NULL_ENTRY
  t.TENSOR_OPS_MOCK_NULL_ENTRY = nullptr;
#endif
  return t;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const to_backend_v1* tensor_ops_backend_v1() {
  static const to_backend_v1 table = make_table();
  return &table;
}

extern "C" __attribute__((visibility("default"))) const to_op_call* tensor_ops_mock_last_call() {
  return &last_call;
}

extern "C" __attribute__((visibility("default"))) uint64_t tensor_ops_mock_copies(int32_t kind) {
  return copies[kind].load();
}

// stream_wait calls so far; the last one's consumer and producer streams.
extern "C" __attribute__((visibility("default"))) uint64_t tensor_ops_mock_waits(void** consumer, void** producer) {
  *consumer = last_wait[0];
  *producer = last_wait[1];
  return waits;
}
