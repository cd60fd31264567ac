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

// y = x / sqrt(mean(x^2, last dim) + eps) * (offset + weight), the factor
// computed in fp32 as float(offset) + float(weight) (Gemma's 1 + w: offset 1).
// scalars[0] eps, [1] offset (backends with TO_BACKEND_NORM_OFFSET only; a
// zero offset is the plain norm, bit for bit).
void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, double eps = 1e-6, double offset = 0);
// y = x * sigmoid(x)
void silu(const Tensor& x, const Tensor& out);
// approximate: "none" (erf) or "tanh"
void gelu(const Tensor& x, const Tensor& out, const std::string& approximate = "none");

// Activations for activation_backward and the gated units (glu).
enum class Activation : int64_t { Silu = 0, Gelu = 1, GeluTanh = 2 };
Activation activation_from_name(const std::string& name, const std::string& approximate = "none");

// Row-wise ops work on the last dimension. Kernel argument layouts:
// layer_norm: in x, weight, bias? -> y; scalars[0] eps; ints[0] has_bias.
void layer_norm(const Tensor& x, const Tensor& weight, const Tensor* bias, const Tensor& out, double eps);
// rms_norm_backward: in dy, x, weight -> dx, dweight; scalars[0] eps, [1] offset (as rms_norm's:
// dx uses offset + weight; dweight, the sum of dy * x_hat, does not depend on it).
void rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& dx,
                       const Tensor& dweight, double eps, double offset = 0);
// layer_norm_backward: in dy, x, weight -> dx, dweight, dbias?; eps; ints[0] has_bias.
void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& dx,
                         const Tensor& dweight, const Tensor* dbias, double eps);
// add_rms_norm: in x, residual, weight -> y = rms_norm(x + residual), residual_out = x + residual.
void add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& out,
                  const Tensor& residual_out, double eps);
// The causal mask of softmax and attention (their ints[0]): query i of Lq sees key j of Lk when
// j <= i + Lk - Lq (bottom-right aligned: the last query sees every key; a query with no visible key
// gives a zero row, lse -inf) or j <= i (top-left: torch SDPA's is_causal; every query sees key 0).
// 0 and 1 kept their meaning when top-left was added.
constexpr int kCausalNone = 0, kCausalBottomRight = 1, kCausalTopLeft = 2;
// softmax: in x -> y = softmax(scale * x) (log_softmax when ints[1]); scalars[0] scale;
// ints[0] causal mode over the last two dims (rows = queries, cols = keys).
void softmax(const Tensor& x, const Tensor& out, double scale, int causal, bool log);
// softmax_backward: in dy, y -> dx; scalars[0] scale; ints[1] log.
void softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx, double scale, bool log);
// activation_backward: in dy, x -> dx; ints[0] activation.
void activation_backward(const Tensor& dy, const Tensor& x, const Tensor& dx, Activation act);
// glu: in gate, up -> y = act(gate) * up; ints[0] activation (swiglu, geglu).
void glu(const Tensor& gate, const Tensor& up, const Tensor& out, Activation act);
// glu_backward: in dy, gate, up -> dgate, dup; ints[0] activation.
void glu_backward(const Tensor& dy, const Tensor& gate, const Tensor& up, const Tensor& dgate, const Tensor& dup,
                  Activation act);
// rope: in x [B, S, H, D], cos [P, R/2], sin [P, R/2], positions int64 [B or 1, S] -> y;
// ints[0] interleaved (GPT-J) else NeoX; ints[1] inverse (rotate by -angle: the backward).
void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions, const Tensor& out,
          bool interleaved, bool inverse);
// attention: in q [B, Hq, Lq, D], k, v [B, Hkv, Lk, D] -> out [B, Hq, Lq, D], lse float32 [B, Hq, Lq];
// scalars[0] scale; ints[0] causal mode (kCausal*).
void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
               int causal, double scale);
// attention_backward: in dout, q, k, v, out, lse -> dq, dk, dv; scale, causal mode.
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, int causal,
                        double scale);
// cross_entropy: in logits [N, C], target int32/int64 [N] -> loss float32 [N], dlogits? [N, C]
// (its gradient times grad_scale, 0 on ignored rows; dlogits may be logits itself: in place).
// With z = softcap * tanh(logits / softcap) (softcap > 0, else z = logits), lse = logsumexp(z):
// loss = (1 - label_smoothing) (lse - z[t]) + label_smoothing (lse - mean(z)) + z_loss * lse^2.
// ints[0] ignore_index; ints[1] has_grad; scalars[0] grad_scale, [1] label_smoothing, [2] z_loss,
// [3] softcap (backends with TO_BACKEND_CE_OPTIONS only).
void cross_entropy(const Tensor& logits, const Tensor& target, const Tensor& loss, const Tensor* dlogits,
                   int64_t ignore_index, double grad_scale, double label_smoothing = 0, double z_loss = 0,
                   double softcap = 0);
// How linear's weight is stored: NK [out_features N, in_features K] (nn.Linear, F.linear: x weight^T)
// or KN [K, N] (transformers' Conv1D: x weight). The value is linear's ints[1].
enum class WeightLayout : int64_t { NK = 0, KN = 1 };
// linear: in x [..., K], weight [N, K] (NK) or [K, N] (KN), bias? [N] -> out [..., N] = x weight^T
// (NK) or x weight (KN) (+ bias), fp32 accumulation; ints[0] has_bias, ints[1] the WeightLayout.
// Kernels get x, weight and out as rows ([M, K], weight's rows as stored, [M, N]). For a few rows
// of x (decode); each output element is summed in one fixed order (no split of K).
void linear(const Tensor& x, const Tensor& weight, const Tensor* bias, const Tensor& out,
            WeightLayout layout = WeightLayout::NK);

// Name of the backend an op with these tensors would run on.
std::string backend_for(const Tensor& x);

}  // namespace tensor_ops
