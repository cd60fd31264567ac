"""Every tensor_ops op as a torch custom op, torch.ops.tensor_ops.<name>: the
real kernel, a fake kernel (shapes and dtypes only) so torch.compile traces
through without a graph break, and autograd through our backward kernels.

Note [contiguous inputs]: the kernels take dense row-major data; a strided
input would be copied by the op layer anyway, so each op calls .contiguous()
(a no-op for dense tensors) rather than going through the op layer's
refuse-and-retry path (softmax along an inner dim still takes it: the op
layer moves that dim last, then copies).
Gradients arriving from autograd are often strided (expanded by sum(),
transposed by a matmul), so the backward ops do the same.

Note [fake layouts]: each fake kernel returns what the real one returns,
strides included: new_empty is row-major, as the op layer's outputs are;
softmax along an inner dim returns the moved-back view the op layer returns.
"""
from typing import Optional, Tuple

import torch

import tensor_ops as _to

Tensor = torch.Tensor


def _op(name):
    return torch.library.custom_op(f"tensor_ops::{name}", mutates_args=())


def _c(t):
    return None if t is None else t.contiguous()


def _like(x):
    return x.new_empty(x.shape)


# ---- backward kernels (ops of their own, so compiled backward graphs call them)

@_op("rms_norm_backward")
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    return _to.rms_norm_backward(_c(dy), _c(x), _c(weight), eps)


@rms_norm_backward.register_fake
def _(dy, x, weight, eps=1e-6):
    return _like(x), _like(weight)


@_op("layer_norm_backward")
def layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias); dbias is computed whether or not there is a bias."""
    return _to.layer_norm_backward(_c(dy), _c(x), _c(weight), eps, bias=True)


@layer_norm_backward.register_fake
def _(dy, x, weight, eps=1e-5):
    return _like(x), _like(weight), _like(weight)


@_op("silu_backward")
def silu_backward(dy: Tensor, x: Tensor) -> Tensor:
    return _to.silu_backward(_c(dy), _c(x))


@silu_backward.register_fake
def _(dy, x):
    return _like(x)


@_op("gelu_backward")
def gelu_backward(dy: Tensor, x: Tensor, approximate: str = "none") -> Tensor:
    return _to.gelu_backward(_c(dy), _c(x), approximate)


@gelu_backward.register_fake
def _(dy, x, approximate="none"):
    return _like(x)


@_op("swiglu_backward")
def swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    return _to.swiglu_backward(_c(dy), _c(gate), _c(up))


@swiglu_backward.register_fake
def _(dy, gate, up):
    return _like(gate), _like(gate)


@_op("geglu_backward")
def geglu_backward(dy: Tensor, gate: Tensor, up: Tensor, approximate: str = "none") -> Tuple[Tensor, Tensor]:
    return _to.geglu_backward(_c(dy), _c(gate), _c(up), approximate)


@geglu_backward.register_fake
def _(dy, gate, up, approximate="none"):
    return _like(gate), _like(gate)


def _softmax_like(y, dim):
    m = y.movedim(dim, -1)
    return m.new_empty(m.shape).movedim(-1, dim)


@_op("softmax_backward")
def softmax_backward(dy: Tensor, y: Tensor, dim: int = -1, scale: float = 1.0) -> Tensor:
    return _to.softmax_backward(_c(dy), _c(y), dim, scale)


@softmax_backward.register_fake
def _(dy, y, dim=-1, scale=1.0):
    return _softmax_like(y, dim)


@_op("log_softmax_backward")
def log_softmax_backward(dy: Tensor, y: Tensor, dim: int = -1, scale: float = 1.0) -> Tensor:
    return _to.log_softmax_backward(_c(dy), _c(y), dim, scale)


@log_softmax_backward.register_fake
def _(dy, y, dim=-1, scale=1.0):
    return _softmax_like(y, dim)


@_op("rope_backward")
def rope_backward(dy: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor] = None,
                  interleaved: bool = False) -> Tensor:
    return _to.rope_backward(_c(dy), _c(cos), _c(sin), _c(positions), interleaved)


@rope_backward.register_fake
def _(dy, cos, sin, positions=None, interleaved=False):
    return _like(dy)


@_op("attention_backward")
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       causal: bool = False, scale: Optional[float] = None) -> Tuple[Tensor, Tensor, Tensor]:
    return _to.attention_backward(_c(dout), _c(q), _c(k), _c(v), _c(out), _c(lse), causal, scale)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal=False, scale=None):
    return _like(q), _like(k), _like(v)


# ---- forward ops, each with its autograd

@_op("rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return _to.rms_norm(_c(x), _c(weight), eps)


@rms_norm.register_fake
def _(x, weight, eps=1e-6):
    return _like(x)


def _save_x_w_eps(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_bwd(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, x, weight, ctx.eps)
    return dx, dw, None


rms_norm.register_autograd(_rms_norm_bwd, setup_context=_save_x_w_eps)


@_op("layer_norm")
def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    return _to.layer_norm(_c(x), _c(weight), _c(bias), eps)


@layer_norm.register_fake
def _(x, weight, bias=None, eps=1e-5):
    return _like(x)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.has_bias = eps, bias is not None


def _layer_norm_bwd(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw, db = layer_norm_backward(dy, x, weight, ctx.eps)
    return dx, dw, (db if ctx.has_bias else None), None


layer_norm.register_autograd(_layer_norm_bwd, setup_context=_layer_norm_setup)


@_op("add_rms_norm")
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """(rms_norm(x + residual, weight), x + residual) in one pass."""
    return _to.add_rms_norm(_c(x), _c(residual), _c(weight), eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps=1e-6):
    return _like(x), _like(x)


def _add_rms_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[2])  # the sum the norm read, and the weight
    ctx.eps = inputs[3]


def _add_rms_norm_bwd(ctx, dy, dsum):
    s, weight = ctx.saved_tensors
    ds, dw = rms_norm_backward(dy, s, weight, ctx.eps)
    if dsum is not None:
        ds = ds + dsum
    return ds, ds, dw, None


add_rms_norm.register_autograd(_add_rms_norm_bwd, setup_context=_add_rms_norm_setup)


@_op("silu")
def silu(x: Tensor) -> Tensor:
    return _to.silu(_c(x))


@silu.register_fake
def _(x):
    return _like(x)


def _save_x(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1] if len(inputs) > 1 else "none"


silu.register_autograd(lambda ctx, dy: silu_backward(dy, ctx.saved_tensors[0]), setup_context=_save_x)


@_op("gelu")
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return _to.gelu(_c(x), approximate)


@gelu.register_fake
def _(x, approximate="none"):
    return _like(x)


gelu.register_autograd(lambda ctx, dy: (gelu_backward(dy, ctx.saved_tensors[0], ctx.approximate), None),
                       setup_context=_save_x)


def _save_y(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.dim, ctx.scale = inputs[1], inputs[2]


@_op("softmax")
def softmax(x: Tensor, dim: int = -1, scale: float = 1.0, causal: bool = False) -> Tensor:
    """softmax(scale * x) along dim; causal masks [..., i, j] for j > i + cols - rows."""
    return _to.softmax(_c(x), dim, scale, causal)


@softmax.register_fake
def _(x, dim=-1, scale=1.0, causal=False):
    return _softmax_like(x, dim)


softmax.register_autograd(
    lambda ctx, dy: (softmax_backward(dy, ctx.saved_tensors[0], ctx.dim, ctx.scale), None, None, None),
    setup_context=_save_y)


@_op("log_softmax")
def log_softmax(x: Tensor, dim: int = -1, scale: float = 1.0, causal: bool = False) -> Tensor:
    return _to.log_softmax(_c(x), dim, scale, causal)


@log_softmax.register_fake
def _(x, dim=-1, scale=1.0, causal=False):
    return _softmax_like(x, dim)


log_softmax.register_autograd(
    lambda ctx, dy: (log_softmax_backward(dy, ctx.saved_tensors[0], ctx.dim, ctx.scale), None, None, None),
    setup_context=_save_y)


def _save_gate_up(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2] if len(inputs) > 2 else "none"


@_op("swiglu")
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up in one pass."""
    return _to.swiglu(_c(gate), _c(up))


@swiglu.register_fake
def _(gate, up):
    return _like(gate)


swiglu.register_autograd(lambda ctx, dy: swiglu_backward(dy, *ctx.saved_tensors), setup_context=_save_gate_up)


@_op("geglu")
def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """gelu(gate) * up in one pass."""
    return _to.geglu(_c(gate), _c(up), approximate)


@geglu.register_fake
def _(gate, up, approximate="none"):
    return _like(gate)


geglu.register_autograd(lambda ctx, dy: (*geglu_backward(dy, *ctx.saved_tensors, ctx.approximate), None),
                        setup_context=_save_gate_up)


@_op("rope")
def rope(x: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor] = None,
         interleaved: bool = False) -> Tensor:
    """Rotary embedding of x [batch, seq, heads, head_dim] with cos/sin tables
    [max_position, rotary_dim / 2]. The tables get no gradient."""
    return _to.rope(_c(x), _c(cos), _c(sin), _c(positions), interleaved)


@rope.register_fake
def _(x, cos, sin, positions=None, interleaved=False):
    return _like(x)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, positions, interleaved = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.interleaved = interleaved


def _rope_bwd(ctx, dy):
    cos, sin, positions = ctx.saved_tensors
    return rope_backward(dy, cos, sin, positions, ctx.interleaved), None, None, None, None


rope.register_autograd(_rope_bwd, setup_context=_rope_setup)


@_op("attention")
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
              scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """(softmax(scale * q k^T) v, float32 log-sum-exp [batch, heads, seq]),
    layout [batch, heads, seq, head_dim], grouped-query k/v allowed."""
    return _to.attention(_c(q), _c(k), _c(v), causal, scale, return_lse=True)


@attention.register_fake
def _(q, k, v, causal=False, scale=None):
    return _like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _attention_bwd(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale), None, None)


attention.register_autograd(_attention_bwd, setup_context=_attention_setup)


def _loss_like(logits, reduction):
    shape = logits.shape[:1] if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32)


@_op("cross_entropy_with_grad")
def cross_entropy_with_grad(logits: Tensor, target: Tensor, ignore_index: int = -100,
                            reduction: str = "mean") -> Tuple[Tensor, Tensor]:
    """(float32 loss, dlogits): the gradient of the reduced loss, written in
    the forward pass while each row is in cache."""
    loss, dlogits = _to.cross_entropy_with_grad(_c(logits), _c(target), ignore_index, reduction)
    return torch.as_tensor(loss), dlogits


@cross_entropy_with_grad.register_fake
def _(logits, target, ignore_index=-100, reduction="mean"):
    return _loss_like(logits, reduction), _like(logits)


def _scaled(dlogits, dloss, reduction):
    """The forward's dlogits times the incoming gradient of the loss."""
    g = dloss.to(dlogits.dtype)
    return dlogits * (g[:, None] if reduction == "none" else g)


def _ce_with_grad_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.reduction = inputs[3]
    ctx.mark_non_differentiable(output[1])


def _ce_with_grad_bwd(ctx, dloss, _):
    return _scaled(ctx.saved_tensors[0], dloss, ctx.reduction), None, None, None


cross_entropy_with_grad.register_autograd(_ce_with_grad_bwd, setup_context=_ce_with_grad_setup)


@_op("cross_entropy")
def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """The float32 loss alone. tensor_ops.torch.cross_entropy calls
    cross_entropy_with_grad instead whenever logits need a gradient; called
    directly with grad, this op's backward runs the fused kernel again."""
    return torch.as_tensor(_to.cross_entropy(_c(logits), _c(target), ignore_index, reduction))


@cross_entropy.register_fake
def _(logits, target, ignore_index=-100, reduction="mean"):
    return _loss_like(logits, reduction)


def _ce_setup(ctx, inputs, output):
    logits, target, ignore_index, reduction = inputs
    ctx.save_for_backward(logits, target)
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _ce_bwd(ctx, dloss):
    logits, target = ctx.saved_tensors
    _, dlogits = cross_entropy_with_grad(logits, target, ctx.ignore_index, ctx.reduction)
    return _scaled(dlogits, dloss, ctx.reduction), None, None, None


cross_entropy.register_autograd(_ce_bwd, setup_context=_ce_setup)


OPS = {op._name: op for op in [
    rms_norm, layer_norm, add_rms_norm, silu, gelu, softmax, log_softmax, swiglu, geglu, rope, attention,
    cross_entropy, cross_entropy_with_grad, rms_norm_backward, layer_norm_backward, silu_backward, gelu_backward,
    swiglu_backward, geglu_backward, softmax_backward, log_softmax_backward, rope_backward, attention_backward,
]}
