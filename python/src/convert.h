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

// _C._exchange_stream, _current_stream, _has_streams, _stream_wait.
void init_streams(nanobind::module_& m);

}  // namespace tensor_ops::python
