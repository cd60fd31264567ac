#pragma once
// nanobind ndarray (numpy buffer, DLPack: torch, jax, ...) -> tensor_ops::Tensor, zero-copy.
#include <nanobind/ndarray.h>

#include "tensor_ops/tensor.h"

namespace tensor_ops::python {

// as_bfloat16: the array holds bfloat16 bits viewed as uint16 (numpy has no
// bfloat16 of its own; the Python layer passes ml_dtypes arrays this way).
Tensor to_tensor(const nanobind::ndarray<nanobind::ro>& a, const char* arg, bool as_bfloat16 = false);
// A tensor_ops.Tensor as is, or any array nanobind can import (buffer, DLPack).
Tensor to_tensor(nanobind::handle h, const char* arg, bool as_bfloat16 = false);

// DLPack's names for a tensor's dtype and device type. A device DLPack has
// no name for (a backend other than host, cuda, hip, opencl, sycl) raises
// BufferError, the spec's answer to "cannot export".
nanobind::dlpack::dtype dl_dtype(DType t);

// out as a Tensor; or, out being None, a new torch tensor like `like` (a
// plain CPU torch tensor) returned in `made` (Note [outputs made in C++]);
// LayoutError when none can be made here.
Tensor output(nanobind::handle out, nanobind::handle like, const Tensor& tlike, const char* arg, bool as_bfloat16,
              nanobind::object& made);
// The same with the new tensor's shape and dtype given (attention's lse).
Tensor output(nanobind::handle out, nanobind::handle like, const Tensor& tlike, std::vector<int64_t> shape,
              DType dtype, const char* arg, bool as_bfloat16, nanobind::object& made);
int32_t dl_device_type(const Device& d);

// Tensor.__dlpack__: a "dltensor" capsule whose data stays alive (the
// tensor's owner) until the consumer's deleter runs, or until the capsule
// dies unconsumed. Safe whatever the consumer does: see the note in convert.cpp.
nanobind::object dlpack_capsule(const Tensor& t);

// _C._exchange_stream, _current_stream, _has_streams, _stream_wait.
void init_streams(nanobind::module_& m);
// Mirrors tensor_ops.use()'s context variable into the core's per-thread
// scope stack (Note [use() per context], registry.cpp); with the GIL.
void sync_scope();

}  // namespace tensor_ops::python
