"""The op set as functions on torch tensors: differentiable, traceable by
torch.compile (no graph break), cheap in eager mode (see Note [two ways in]
in custom_ops)."""
from __future__ import annotations

from typing import Optional

import torch

from . import forward_ad
from .custom_ops import DIRECT, FUNCTIONS, FUNCTIONS_FUNC, LOWERED, OPS, direct_lane, lse_with_gradient

# Plain tensors in eager mode take the autograd.Function (or, with no
# gradient to record, the kernel itself); tests turn this off to drive the
# custom ops in eager mode too.
EAGER_FUNCTIONS = True


_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_tracing_state = torch._C._get_tracing_state  # torch.jit.trace under way: not None


# Note [torch.func]
# Under torch.func's transforms the tensors are functorch's wrappers, of type
# torch.Tensor, which the direct lane cannot read. A call that records a
# gradient (grad, jacrev, vjp) takes the Function with a separate
# setup_context (the ctx-style one is refused there; the check costs only
# this branch); under vmap a call takes the custom op, which torch batches
# by running it per sample. Both are found where they cost nothing on the
# common path: the gradient branch, and the direct lane's refusal.
_functorch_level = torch._C._functorch.peek_interpreter_stack
_VMAP = torch._C._functorch.TransformType.Vmap
_fwad = torch.autograd.forward_ad  # ._current_level: the dual level, -1 outside one


def _transformed(name: str, args, level, grad: bool):
    """A call under torch.func's transforms (Note [torch.func]): with a jvp
    among them, torch's ops (Note [forward-mode AD]); a gradient to record
    outside vmap, the Function with a setup_context; else the custom op."""
    if forward_ad.jvp_transform():
        return forward_ad.reference(name, args)
    if grad and level.key() != _VMAP:
        return FUNCTIONS_FUNC[name].apply(*args)
    return OPS[name](*args)


def _run(name: str, *args):
    """The op `name` on args, every argument given (Functions take no defaults)."""
    # Tracing (torch.compile, torch.jit.trace: the tracer records dispatcher
    # ops only), tensor subclasses (FakeTensor, DTensor...) and meta tensors
    # (shapes only: the fake kernel) take the custom op.
    if (EAGER_FUNCTIONS and type(args[0]) is _Tensor and not _is_compiling() and not args[0].is_meta
            and _tracing_state() is None):
        if _fwad._current_level >= 0 and forward_ad.has_tangent(args):  # Note [forward-mode AD]
            return forward_ad.reference(name, args)
        function = FUNCTIONS.get(name)
        # autograd.Function.apply costs ~10 us even when nothing needs a
        # gradient: only a call that records one takes it.
        if function is not None and _is_grad_enabled():
            for a in args:
                if isinstance(a, _Tensor) and a.requires_grad:
                    level = _functorch_level()
                    if level is not None:  # Note [torch.func]
                        return _transformed(name, args, level, True)
                    return function.apply(*args)
        lowered = LOWERED.get(name)
        if lowered is not None:
            try:
                y = direct_lane(lowered, args)
            except RuntimeError:
                level = _functorch_level()
                if level is None:
                    raise
                return _transformed(name, args, level, False)  # Note [torch.func]
            if y is not None:
                return y
        level = _functorch_level()
        if level is not None:
            return _transformed(name, args, level, False)
        return getattr(DIRECT, name)(*args)
    return OPS[name](*args)


def rms_norm(x, weight, eps: float = 1e-6, offset: float = 0.0):
    """x / sqrt(mean(x**2, last dim) + eps) * (offset + weight), accumulated in
    fp32, offset + weight formed in fp32 (Gemma's 1 + w: offset=1.0)."""
    return _run("rms_norm", x, weight, eps, offset)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim."""
    return _run("layer_norm", x, weight, bias, eps)


def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """(rms_norm(x + residual, weight), x + residual) in one pass."""
    return _run("add_rms_norm", x, residual, weight, eps)


def silu(x):
    return _run("silu", x)


def gelu(x, approximate: str = "none"):
    return _run("gelu", x, approximate)


def softmax(x, dim: int = -1, scale: float = 1.0, causal: bool = False):
    """softmax(scale * x) along dim; causal (last dim only) masks [..., i, j]
    for j > i + cols - rows."""
    return _run("softmax", x, dim, scale, causal)


def log_softmax(x, dim: int = -1, scale: float = 1.0, causal: bool = False):
    return _run("log_softmax", x, dim, scale, causal)


def linear(x, weight, bias=None, weight_layout: str = "nk"):
    """x @ weight.T + bias (F.linear), or x @ weight + bias with
    weight_layout="kn" (weight [K, N], transformers' Conv1D), on our few-row
    kernel (see tensor_ops.linear)."""
    return _run("linear", x, weight, bias, weight_layout)


def swiglu(gate, up):
    """silu(gate) * up in one pass."""
    return _run("swiglu", gate, up)


def geglu(gate, up, approximate: str = "none"):
    """gelu(gate) * up in one pass."""
    return _run("geglu", gate, up, approximate)


def rope(x, cos, sin, positions=None, interleaved: bool = False):
    """Rotary embedding of x [batch, seq, heads, head_dim] with cos/sin tables
    [max_position, rotary_dim / 2] (no gradient); positions [seq] or
    [batch, seq], default 0..seq-1."""
    return _run("rope", x, cos, sin, positions, interleaved)


def attention(q, k, v, causal: bool = False, scale: Optional[float] = None, *, return_lse: bool = False,
              causal_alignment: str = "bottom_right"):
    """softmax(scale * q k^T) v on [batch, heads, seq, head_dim] (grouped-query
    k/v allowed); causal_alignment "bottom_right" (query i sees keys j <= i +
    Lk - Lq; a query that sees none gives a zero row with zero gradients) or
    "top_left" (j <= i, SDPA's is_causal); with return_lse also the float32
    log-sum-exp [batch, heads, seq], differentiable with respect to q and k
    (Note [the log-sum-exp's gradient])."""
    out, lse = _run("attention", q, k, v, causal, scale, causal_alignment)
    if not return_lse:
        return out
    # Note [the log-sum-exp's gradient]: the kernels' lse (not one torch's ops made: forward-mode AD's);
    # under torch.func (vmap) the wrapped tensors do not show requires_grad: wrapped there too, but not
    # under a jvp transform (torch's ops made that lse, and LseGrad has no forward rule)
    if torch.is_grad_enabled() and not lse.requires_grad:
        level = _functorch_level()
        if (q.requires_grad or k.requires_grad or level is not None) and not (
                level is not None and forward_ad.jvp_transform()):
            lse = lse_with_gradient(lse, q, k, causal, scale, causal_alignment)
    return out, lse


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean", *,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None):
    """The float32 cross-entropy of logits [N, C] against class indices [N].
    When logits need a gradient, the forward pass also writes it (the fused
    kernel) and the backward only scales it. label_smoothing as
    F.cross_entropy's; z_loss adds z_loss * logsumexp^2 per row (PaLM);
    softcap: logits -> softcap * tanh(logits / softcap) first (Gemma 2)."""
    args = (logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap)
    if torch.is_grad_enabled() and logits.requires_grad and not (
            EAGER_FUNCTIONS and type(logits) is _Tensor and not _is_compiling()):
        return _run("cross_entropy_with_grad", *args)[0]  # traced: the fused op (eager: Note [the gradient handed over])
    return _run("cross_entropy", *args)


def cross_entropy_with_grad(logits, target, ignore_index: int = -100, reduction: str = "mean", *,
                            label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None):
    """(float32 loss, dlogits of the reduced loss) in one pass; options as cross_entropy."""
    return _run("cross_entropy_with_grad", logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap)


def rms_norm_backward(dy, x, weight, eps: float = 1e-6, offset: float = 0.0):
    return _run("rms_norm_backward", dy, x, weight, eps, offset)


def layer_norm_backward(dy, x, weight, eps: float = 1e-5):
    """(dx, dweight, dbias)."""
    return _run("layer_norm_backward", dy, x, weight, eps)


def silu_backward(dy, x):
    return _run("silu_backward", dy, x)


def gelu_backward(dy, x, approximate: str = "none"):
    return _run("gelu_backward", dy, x, approximate)


def swiglu_backward(dy, gate, up):
    return _run("swiglu_backward", dy, gate, up)


def geglu_backward(dy, gate, up, approximate: str = "none"):
    return _run("geglu_backward", dy, gate, up, approximate)


def softmax_backward(dy, y, dim: int = -1, scale: float = 1.0):
    return _run("softmax_backward", dy, y, dim, scale)


def log_softmax_backward(dy, y, dim: int = -1, scale: float = 1.0):
    return _run("log_softmax_backward", dy, y, dim, scale)


def rope_backward(dy, cos, sin, positions=None, interleaved: bool = False):
    return _run("rope_backward", dy, cos, sin, positions, interleaved)


def attention_backward(dout, q, k, v, out, lse, causal: bool = False, scale: Optional[float] = None, *,
                       causal_alignment: str = "bottom_right"):
    return _run("attention_backward", dout, q, k, v, out, lse, causal, scale, causal_alignment)
