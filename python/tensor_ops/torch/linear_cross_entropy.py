"""Fused linear cross-entropy for torch: torch.ops.tensor_ops.fused_linear_cross_entropy
(a custom op with a fake kernel, so torch.compile(fullgraph=True) traces it,
and autograd), the function fused_linear_cross_entropy and the module
FusedLinearCrossEntropyLoss (Liger's LigerFusedLinearCrossEntropyLoss
conventions). The algorithm is Note [chunked linear cross-entropy] in
tensor_ops.linear_cross_entropy, with torch's GEMMs (MKL / oneDNN on the CPU,
cuBLAS on GPUs) writing into preallocated chunks.

With reduction "mean" or "sum" the forward computes the gradients (the loop
needs the logits' gradient while the chunk is in its buffer, so they cost one
pass) and saves them; the backward scales them by grad_output. With "none"
the gradient of each row's loss depends on grad_output per row, which the
forward cannot know: the forward computes the losses alone and the backward
runs the loop again (one logits GEMM more) with the rows' dlogits scaled.

The cross-entropy's options beyond ignore_index (label_smoothing, z_loss,
softcap, as tensor_ops.cross_entropy's) are schema arguments of both ops and
reach the loop through chunked's **options.
"""
from __future__ import annotations

import types
from typing import Optional, Tuple

import torch
from torch import nn

from tensor_ops import linear_cross_entropy as _lce
from tensor_ops.errors import UnsupportedError

from . import forward_ad
from .custom_ops import loss_scaled
from .modules import _widened_gemm, half_mm, widens

Tensor = torch.Tensor


def _linear(h_c, weight, bias, out):
    if widens(h_c, weight, bias):
        _widened_gemm(h_c, weight, bias, False, out.dtype, out=out)  # Note [half GEMMs in fp32]
    elif bias is None:
        torch.mm(h_c, weight.t(), out=out)
    else:
        torch.addmm(bias, h_c, weight.t(), out=out)


def _accumulator(acc, dtype, chunk: int, rows: int = _lce.ACC_ROWS):
    """add(a, b): acc [V, H] += a @ b for a [V, <= chunk] and b [<= chunk, H]
    (a chunk's dlogits.T and hidden rows): one addmm_ into acc when the dtypes
    agree. fp16 / bf16 into fp32 (torch's CPU addmm takes one dtype) go
    through fp32 buffers made here, once: b whole, a a block of acc's rows at
    a time, so no fp32 copy of a whole chunk's dlogits exists."""
    if dtype == acc.dtype:
        return acc.addmm_
    rows = min(rows, acc.shape[0])
    a_acc = acc.new_empty((rows, chunk))
    b_acc = acc.new_empty((chunk, acc.shape[1]))

    def add(a, b):
        k = b.shape[0]
        b_acc[:k].copy_(b)
        for r in range(0, acc.shape[0], rows):
            m = min(rows, acc.shape[0] - r)
            blk = a_acc[:m, :k]
            blk.copy_(a[r:r + m])
            acc[r:r + m].addmm_(blk, b_acc[:k])
    return add


TORCH = types.SimpleNamespace(
    float32=torch.float32,
    acc_dtype=lambda dt: torch.float32 if dt in (torch.float16, torch.bfloat16) else dt,
    cast=lambda x, dtype: x.to(dtype),
    empty=lambda shape, dtype, like: torch.empty(shape, dtype=dtype, device=like.device),
    zeros=lambda shape, dtype, like: torch.zeros(shape, dtype=dtype, device=like.device),
    linear=_linear,
    mm=lambda a, b, out: half_mm(a, b, out=out),
    accumulator=_accumulator,
)


def _absent(hidden):
    """The placeholder output of a gradient not computed (custom ops return no None)."""
    return hidden.new_empty((0,))


def _refuse_tangents(name: str, tensors) -> None:
    """torch.ops.tensor_ops.<name> called on tensors with tangents (Note
    [forward-mode AD]): these custom ops have no forward-mode rule, and torch
    would hand back no tangent; tensor_ops.torch.fused_linear_cross_entropy
    computes one."""
    if (torch.autograd.forward_ad._current_level >= 0 and not torch.compiler.is_compiling()
            and forward_ad.has_tangent(tensors)):
        raise UnsupportedError(
            f"torch.ops.tensor_ops.{name}: forward-mode AD (a tangent on an argument) is not supported "
            f"by this op; call tensor_ops.torch.fused_linear_cross_entropy, which carries tangents")


@torch.library.custom_op("tensor_ops::fused_linear_cross_entropy", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
             reduction: str, chunk_size: int, with_grad: bool, label_smoothing: float, z_loss: float,
             softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(float32 loss, grad_hidden, grad_weight, grad_bias) of the reduced loss;
    without with_grad the gradients are empty, and grad_bias is empty without
    a bias."""
    _refuse_tangents("fused_linear_cross_entropy", (hidden, weight, bias))
    hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
    losses, gh, gw, gb = _lce.chunked(TORCH, hidden, weight, target, bias, ignore_index, chunk_size, with_grad,
                                      label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    loss, scale = _lce.reduce(losses, target, ignore_index, reduction)
    if not with_grad:
        return loss, _absent(hidden), _absent(hidden), _absent(hidden)
    if scale != 1.0:  # the mean's 1 / n_valid, once at the end
        gh.mul_(scale), gw.mul_(scale)
        if gb is not None:
            gb.mul_(scale)
    gw = gw.to(weight.dtype)  # fp32 accumulators back to the inputs' dtype
    gb = _absent(hidden) if gb is None else gb.to(weight.dtype)
    return loss, gh, gw, gb


@_forward.register_fake
def _(hidden, weight, target, bias, ignore_index, reduction, chunk_size, with_grad, label_smoothing, z_loss, softcap):
    loss = hidden.new_empty(hidden.shape[:1] if reduction == "none" else (), dtype=torch.float32)
    if not with_grad:
        return loss, _absent(hidden), _absent(hidden), _absent(hidden)
    gb = _absent(hidden) if bias is None else bias.new_empty(bias.shape)
    return loss, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), gb


@torch.library.custom_op("tensor_ops::fused_linear_cross_entropy_backward", mutates_args=())
def _backward_rows(dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                   ignore_index: int, chunk_size: int, label_smoothing: float, z_loss: float,
                   softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of sum(loss rows * dloss) for
    reduction "none": the loop again, each row's dlogits scaled by its dloss."""
    _refuse_tangents("fused_linear_cross_entropy_backward", (dloss, hidden, weight, bias))
    hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
    _, gh, gw, gb = _lce.chunked(TORCH, hidden, weight, target, bias, ignore_index, chunk_size, True,
                                 dloss_rows=dloss.contiguous(), label_smoothing=label_smoothing, z_loss=z_loss,
                                 softcap=softcap)
    return gh, gw.to(weight.dtype), _absent(hidden) if gb is None else gb.to(weight.dtype)


@_backward_rows.register_fake
def _(dloss, hidden, weight, target, bias, ignore_index, chunk_size, label_smoothing, z_loss, softcap):
    gb = _absent(hidden) if bias is None else bias.new_empty(bias.shape)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), gb


def _setup(ctx, inputs, output):
    hidden, weight, target, bias, ignore_index, reduction, chunk_size, with_grad, *ctx.options = inputs
    _, gh, gw, gb = output
    ctx.mark_non_differentiable(gh, gw, gb)
    ctx.set_materialize_grads(False)  # else autograd fills zeros of gh, gw and gb for the backward to ignore
    ctx.has_bias, ctx.reduction, ctx.scaled = bias is not None, reduction, False
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias)
        ctx.ignore_index, ctx.chunk_size = ignore_index, chunk_size
    else:
        ctx.save_for_backward(gh, gw, gb)


def _backward(ctx, dloss, *_):
    if ctx.reduction == "none":
        hidden, weight, target, bias = ctx.saved_tensors
        gh, gw, gb = _backward_rows(dloss, hidden, weight, target, bias, ctx.ignore_index, ctx.chunk_size,
                                    *ctx.options)
    else:
        # Scaled in place, as Liger does: a [V, H] copy would add a weight's
        # size to the peak. So the graph's gradients serve one backward only.
        if ctx.scaled:
            raise RuntimeError("fused_linear_cross_entropy: a second backward through the same graph "
                               "(retain_graph=True) is not supported: the first scaled the saved gradients in place")
        ctx.scaled = True
        gh, gw, gb = ctx.saved_tensors
        g = dloss.to(gh.dtype)  # Note [ignored rows at an infinite loss scale] (custom_ops.py)
        gh, gw, gb = (loss_scaled(t, g, private=True) for t in (gh, gw, gb))
    return gh, gw, None, (gb if ctx.has_bias else None), None, None, None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                               ignore_index: int = -100, reduction: str = "mean",
                               chunk_size: Optional[int] = None, *, label_smoothing: float = 0.0,
                               z_loss: float = 0.0, softcap: Optional[float] = None) -> Tensor:
    """cross_entropy(hidden @ weight.T + bias, target) (float32), differentiable
    with respect to hidden, weight and bias, without the [N, V] logits:
    hidden [..., H] (leading dims flattened), weight [V, H], target [...],
    bias [V] or None. chunk_size: rows per chunk (default
    tensor_ops.linear_cross_entropy.default_chunk_size). label_smoothing,
    z_loss and softcap as tensor_ops.cross_entropy's."""
    device = hidden.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device) and hidden.dtype != torch.float64:
        # Under autocast the logits GEMM runs in the autocast dtype, as F.linear's would (a custom
        # op gets no autocast cast of its own: it ran in fp32, slower, and with torch's fp16 overflow
        # pattern under GradScaler changed); the gradients reach fp32 parameters through the casts.
        dt = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    hidden2, target1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    ignore_index, reduction, chunk_size = _lce.check_args(hidden2, weight, target1, bias, ignore_index, reduction,
                                                          chunk_size)
    label_smoothing, z_loss, softcap = _lce.check_ce_options(label_smoothing, z_loss, softcap)
    compiling = torch.compiler.is_compiling()
    if (torch.autograd.forward_ad._current_level >= 0 and (compiling or forward_ad.has_tangent((hidden, weight, bias)))
            or not compiling and torch._C._functorch.peek_interpreter_stack() is not None
            and forward_ad.jvp_transform()):
        # tangents (Note [forward-mode AD]): the logits in torch's GEMM, cross-entropy in torch's ops
        loss = forward_ad.reference("cross_entropy", (torch.nn.functional.linear(hidden2, weight, bias), target1,
                                                      ignore_index, reduction, label_smoothing, z_loss, softcap))
        return loss.view(target.shape) if reduction == "none" else loss
    # Gradients only when something will take them; "none" computes them in the backward.
    with_grad = reduction != "none" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss = _forward(hidden2, weight, target1, bias, ignore_index, reduction, chunk_size, with_grad,
                    label_smoothing, z_loss, softcap)[0]
    return loss.view(target.shape) if reduction == "none" else loss


class FusedLinearCrossEntropyLoss(nn.Module):
    """The loss of a language-model head, Liger's LigerFusedLinearCrossEntropyLoss
    calling convention: forward(lin_weight, _input, target, bias=None)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", chunk_size: Optional[int] = None, *,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None):
        super().__init__()
        ignore_index, reduction, chunk_size = _lce.check_options(ignore_index, reduction, chunk_size)
        self.ignore_index, self.reduction, self.chunk_size = ignore_index, reduction, chunk_size
        self.label_smoothing, self.z_loss, self.softcap = _lce.check_ce_options(label_smoothing, z_loss, softcap)

    def forward(self, lin_weight: Tensor, _input: Tensor, target: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return fused_linear_cross_entropy(_input, lin_weight, target, bias, self.ignore_index, self.reduction,
                                          self.chunk_size, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                          softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, chunk_size={self.chunk_size}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}")


__all__ = ["FusedLinearCrossEntropyLoss", "fused_linear_cross_entropy"]
