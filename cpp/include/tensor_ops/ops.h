#pragma once
// The op API. Every check lives in ops.cpp; backends receive validated,
// collapsed views. Outputs are caller-provided (the Python layer allocates
// them with the caller's framework).
#include <string>

#include "tensor_ops/tensor.h"

namespace tensor_ops {

enum class OpId : int32_t {
#define TENSOR_OPS_OP(name, id, n_in, n_out) name = id,
#include "tensor_ops/ops.def"
#undef TENSOR_OPS_OP
};

const char* op_name(OpId op);

// y = x / sqrt(mean(x^2, last dim) + eps) * weight
void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, double eps = 1e-6);
// y = x * sigmoid(x)
void silu(const Tensor& x, const Tensor& out);
// approximate: "none" (erf) or "tanh"
void gelu(const Tensor& x, const Tensor& out, const std::string& approximate = "none");

// Name of the backend an op with these tensors would run on.
std::string backend_for(const Tensor& x);

}  // namespace tensor_ops
