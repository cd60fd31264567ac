// Streams: the device queue an op's kernels run on. A framework's stream
// (torch's current stream, the stream a DLPack consumer names) reaches the
// plugins through to_op_call.stream; producers and consumers are ordered
// with stream_wait (an event, no host wait). Backends without streams
// (CPU, OpenCL, SYCL here) ignore both.
#ifndef TENSOR_OPS_STREAM_H
#define TENSOR_OPS_STREAM_H

#include "tensor_ops/tensor.h"

namespace tensor_ops {

// For the life of the scope, this thread's ops whose data lives on `device`
// run on `stream` (a backend handle: cudaStream_t, hipStream_t; NULL the
// default). Scopes nest; host data staged to a device keeps the default.
class StreamScope {
 public:
  StreamScope(const Device& device, void* stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Device device_;
  void* previous_;
};

// The stream this thread's ops on `device` run on now (NULL: the default).
void* current_stream(const Device& device);
// Replaces it, returning the previous one (the Python binding's scope).
void* exchange_stream(const Device& device, void* stream);

// Whether device's backend has streams (plugin ABI >= 2 with stream_wait).
bool has_streams(const Device& device);

// Work queued later on `consumer` waits for the work queued so far on
// `producer` (both handles on `device`). Unsupported for a backend without
// streams; DeviceError when the vendor call fails.
void stream_wait(const Device& device, void* consumer, void* producer);

}  // namespace tensor_ops

#endif
