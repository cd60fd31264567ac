"""The op API beyond the first three: norms, softmax, gated units, RoPE,
attention, cross-entropy and linear, forward and backward. Inputs: numpy arrays,
torch tensors, DLPack producers or tensor_ops.Tensor; outputs come back in
the caller's kind of array, on the caller's device."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _C, _checks
from ._arrays import Arg, bump_version, check_out, empty_like, run
from ._optable import invoke
from ._types import Approximate, Array, CausalAlignment, Reduction
from .errors import InvalidArgumentError


def _eps(eps) -> float:
    return eps if type(eps) is float else _checks.real("eps", eps, nonneg=True)


def _approx(approximate) -> str:
    return _checks.choice("approximate", approximate, ("none", "tanh"))


def layer_norm(x: Array, weight: Array, bias: Array | None = None, eps: float = 1e-5, *,
               out: Array | None = None) -> Array:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim."""
    return invoke("layer_norm", (x, weight, bias), (_eps(eps),), out)


def add_rms_norm(x: Array, residual: Array, weight: Array, eps: float = 1e-6) -> tuple[Array, Array]:
    """Fused residual add + RMSNorm in one pass: returns
    (rms_norm(x + residual, weight), x + residual)."""
    return invoke("add_rms_norm", (x, residual, weight), (_eps(eps),))


def rms_norm_backward(dy: Array, x: Array, weight: Array, eps: float = 1e-6, *,
                      offset: float = 0.0) -> tuple[Array, Array]:
    """Gradients of rms_norm (with its offset): (dx, dweight)."""
    return invoke("rms_norm_backward", (dy, x, weight),
                  (_eps(eps), offset if type(offset) is float else _checks.real("offset", offset)))


def layer_norm_backward(dy: Array, x: Array, weight: Array, eps: float = 1e-5, *,
                        bias: bool = True) -> tuple[Array, Array, Array | None]:
    """Gradients of layer_norm: (dx, dweight, dbias) (dbias None without bias)."""
    g, a, w = Arg(dy, "dy"), Arg(x, "x"), Arg(weight, "weight")
    dx, dw = empty_like(a), empty_like(w)
    db = empty_like(w) if bias else None
    run(_C.layer_norm_backward, [g, a, w], [dx, dw, db], _eps(eps))
    return dx, dw, db


def _moved(x, dim):
    """x with `dim` moved last, and the function that moves it back."""
    ndim = len(x.shape)
    dim = _checks.integer("dim", dim)
    if ndim == 0:  # torch's rule: a 0-d array is a row of one (dim -1 or 0)
        if dim not in (-1, 0):
            raise InvalidArgumentError(f"dim {dim} is out of range for a 0-d array (-1 or 0)")
        return x.reshape((1,)), lambda y: y.reshape(())
    if not -ndim <= dim < ndim:
        raise InvalidArgumentError(f"dim {dim} is out of range for an array of shape {tuple(x.shape)}")
    dim %= ndim
    if dim == ndim - 1:
        return x, lambda y: y
    if isinstance(x, np.ndarray):
        return np.moveaxis(x, dim, -1), lambda y: np.moveaxis(y, -1, dim)
    if hasattr(x, "movedim"):
        return x.movedim(dim, -1), lambda y: y.movedim(-1, dim)
    raise ValueError("dim != -1 needs a numpy array or torch tensor")


CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


def causal_mode(causal, causal_alignment: str) -> int:
    """The kernels' causal mode: 0 none, 1 bottom-right, 2 top-left (causal
    a bool: 'False' or 1 are refused, not read as truth values)."""
    _checks.choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)
    return 0 if not _checks.flag("causal", causal) else (1 if causal_alignment == "bottom_right" else 2)


def _softmax(x, dim, scale, causal, log, causal_alignment="bottom_right"):
    if dim == -1 and type(scale) is float and type(causal) is bool and getattr(x, "ndim", 0) >= 1:
        return invoke("softmax", (x,), (scale, causal_mode(causal, causal_alignment), log))
    Arg(x, "x")  # a TypeError for what is not an array, before its shape is read
    scale, causal = _checks.real("scale", scale), _checks.flag("causal", causal)
    if causal and not len(x.shape):
        raise InvalidArgumentError("causal softmax: x must have at least 2 dimensions, got a 0-d array")
    xm, back = _moved(x, dim)
    if causal and _checks.integer("dim", dim) % len(x.shape) != len(x.shape) - 1:
        raise InvalidArgumentError("causal softmax works on the last dim only")
    a = Arg(xm, "x")
    out = empty_like(a)
    run(_C.softmax, [a], [out], scale, causal_mode(causal, causal_alignment), log)
    return back(out)


def softmax(x: Array, dim: int = -1, scale: float = 1.0, causal: bool = False, *,
            causal_alignment: CausalAlignment = "bottom_right") -> Array:
    """softmax(scale * x) along dim, numerically stable. causal masks
    [..., i, j] for j > i + (cols - rows) (causal_alignment "bottom_right")
    or j > i ("top_left"); a row that sees no column is all 0 (torch's
    masked softmax gives NaN there), on every backend."""
    return _softmax(x, dim, scale, causal, False, causal_alignment)


def log_softmax(x: Array, dim: int = -1, scale: float = 1.0, causal: bool = False, *,
                causal_alignment: CausalAlignment = "bottom_right") -> Array:
    """log(softmax(scale * x)) along dim; a causal row that sees no column
    is all -inf (the log of softmax's 0)."""
    return _softmax(x, dim, scale, causal, True, causal_alignment)


def _softmax_bwd(dy, y, dim, scale, log):
    if dim == -1 and type(scale) is float and getattr(y, "ndim", 0) >= 1:
        return invoke("softmax_backward", (dy, y), (scale, log))
    Arg(dy, "dy"), Arg(y, "y")
    if tuple(dy.shape) != tuple(y.shape):  # before _moved, which reshapes a 0-d one
        raise InvalidArgumentError(f"softmax_backward: dy has shape {list(dy.shape)} but y has {list(y.shape)}")
    scale = _checks.real("scale", scale)
    dym, _ = _moved(dy, dim)
    ym, back = _moved(y, dim)
    return back(invoke("softmax_backward", (dym, ym), (scale, log)))


def softmax_backward(dy: Array, y: Array, dim: int = -1, scale: float = 1.0) -> Array:
    """Gradient of y = softmax(scale * x) given y."""
    return _softmax_bwd(dy, y, dim, scale, False)


def log_softmax_backward(dy: Array, y: Array, dim: int = -1, scale: float = 1.0) -> Array:
    return _softmax_bwd(dy, y, dim, scale, True)


def _act_bwd(dy, x, act, approximate):
    return invoke("activation_backward", (dy, x), (act, _approx(approximate)))


def silu_backward(dy: Array, x: Array) -> Array:
    """d silu(x) * dy."""
    return _act_bwd(dy, x, "silu", "none")


def gelu_backward(dy: Array, x: Array, approximate: Approximate = "none") -> Array:
    return _act_bwd(dy, x, "gelu", approximate)


def _glu(gate, up, act, approximate, out):
    return invoke("glu", (gate, up), (act, _approx(approximate)), out)


def swiglu(gate: Array, up: Array, *, out: Array | None = None) -> Array:
    """silu(gate) * up in one pass."""
    return _glu(gate, up, "silu", "none", out)


def geglu(gate: Array, up: Array, approximate: Approximate = "none", *, out: Array | None = None) -> Array:
    """gelu(gate) * up in one pass."""
    return _glu(gate, up, "gelu", approximate, out)


def _glu_bwd(dy, gate, up, act, approximate):
    return invoke("glu_backward", (dy, gate, up), (act, _approx(approximate)))


def swiglu_backward(dy: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of swiglu."""
    return _glu_bwd(dy, gate, up, "silu", "none")


def geglu_backward(dy: Array, gate: Array, up: Array, approximate: Approximate = "none") -> tuple[Array, Array]:
    return _glu_bwd(dy, gate, up, "gelu", approximate)


def _positions_for(x: Arg, positions, seq: int):
    if positions is None:
        pos = np.arange(seq, dtype=np.int64)[None, :]
        if x.kind == "torch":
            import torch

            return Arg(torch.from_numpy(pos).to(x.array.device), "positions")
        if x.kind == "tensor_ops":
            return Arg(_C.from_host(pos, x.array.device), "positions")
        return Arg(pos, "positions")
    p = Arg(positions, "positions")
    shape = tuple(p.array.shape)
    if len(shape) == 1:
        p = Arg(positions[None, :] if p.kind != "tensor_ops" else positions, "positions")
    return p


def _cast_table(t, x: Arg, name: str):
    """cos / sin in x's dtype (a float64 table is cast, not refused)."""
    if isinstance(t, np.ndarray) and x.kind == "numpy" and t.dtype != x.original.dtype:
        t = t.astype(x.original.dtype)
    a = Arg(t, name)
    if a.kind == "torch" and x.kind == "torch" and a.array.dtype != x.array.dtype:
        return Arg(a.array.to(x.array.dtype), name)
    return a


def _rope(x, cos, sin, positions, interleaved, inverse):
    # The call as the kernel takes it (tables in x's dtype, positions
    # [batch, seq]) goes straight to the op table; the rest is adapted here.
    dt = getattr(x, "dtype", None)
    if (dt is not None and type(interleaved) is bool and getattr(positions, "ndim", 0) == 2
            and getattr(cos, "dtype", None) == dt and getattr(sin, "dtype", None) == dt and getattr(x, "ndim", 0) == 4):
        return invoke("rope", (x, cos, sin, positions), (interleaved, inverse))
    a = Arg(x, "x")
    shape = tuple(a.array.shape)
    if len(shape) != 4:
        raise ValueError(f"rope: x must be [batch, seq, heads, head_dim], got shape {shape}")
    c, s = _cast_table(cos, a, "cos"), _cast_table(sin, a, "sin")
    p = _positions_for(a, positions, shape[1])
    out = empty_like(a)
    run(_C.rope, [a, c, s, p], [out], _checks.flag("interleaved", interleaved), inverse)
    return out


def rope(x: Array, cos: Array, sin: Array, positions: Array | None = None, interleaved: bool = False) -> Array:
    """Rotary embedding of x [batch, seq, heads, head_dim] with cos/sin tables
    [max_position, rotary_dim / 2]; positions [seq] or [batch, seq] (default
    0..seq-1). interleaved=False: GPT-NeoX (rotate halves); True: GPT-J
    (rotate pairs). Dims past rotary_dim pass through."""
    return _rope(x, cos, sin, positions, interleaved, False)


def rope_backward(dy: Array, cos: Array, sin: Array, positions: Array | None = None,
                  interleaved: bool = False) -> Array:
    """The gradient of rope: rotation by the opposite angle."""
    return _rope(dy, cos, sin, positions, interleaved, True)


def _scale(scale, shape):
    if len(shape) != 4 or shape[3] < 1:
        raise InvalidArgumentError(f"attention: q must be [batch, heads, seq, head_dim] with head_dim >= 1, "
                                   f"got shape {tuple(shape)}")
    return 1.0 / math.sqrt(shape[3]) if scale is None else _checks.real("scale", scale)


def attention(q: Array, k: Array, v: Array, causal: bool = False, scale: float | None = None, *,
              return_lse: bool = False, causal_alignment: CausalAlignment = "bottom_right") -> Any:
    """softmax(scale * q k^T) v, memory-efficient (online softmax), layout
    [batch, heads, seq, head_dim]; k/v may have fewer heads (grouped-query:
    kv heads divide q heads). causal_alignment "bottom_right" (the default):
    query i sees keys j <= i + Lk - Lq (the last query sees every key; when
    Lq > Lk the first Lq - Lk queries see none: their output is 0 and their
    lse -inf, with zero gradients); "top_left" (torch SDPA's is_causal):
    j <= i. With return_lse, also the float32 log-sum-exp [batch, heads,
    seq] the backward needs."""
    shape = tuple(Arg(q, "q").array.shape)
    scale, causal = _scale(scale, shape), _checks.flag("causal", causal)
    out, lse = invoke("attention", (q, k, v), (causal_mode(causal, causal_alignment), scale))
    return (out, lse) if return_lse else out


def attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, causal: bool = False,
                       scale: float | None = None, *,
                       causal_alignment: CausalAlignment = "bottom_right") -> tuple[Array, Array, Array]:
    """(dq, dk, dv) of attention, given its out and lse."""
    ad, aq, ak, av, ao, al = (Arg(t, n) for t, n in
                              [(dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse")])
    dq, dk, dv = empty_like(aq), empty_like(ak), empty_like(av)
    run(_C.attention_backward, [ad, aq, ak, av, ao, al], [dq, dk, dv],
        causal_mode(_checks.flag("causal", causal), causal_alignment), _scale(scale, tuple(aq.array.shape)))
    return dq, dk, dv


def _host_values(arg: Arg):
    a = arg.array
    if arg.kind == "tensor_ops":
        return a.numpy()
    return a


def _ce_options(label_smoothing, z_loss, softcap):
    """The option scalars as the core takes them (softcap None -> 0: none)."""
    ls = _checks.real("label_smoothing", label_smoothing, nonneg=True)
    if ls > 1:
        raise InvalidArgumentError(f"cross_entropy: label_smoothing must be in [0, 1], got {ls}")
    z = _checks.real("z_loss", z_loss, nonneg=True)
    cap = 0.0
    if softcap is not None:
        cap = _checks.real("softcap", softcap)
        if cap <= 0:
            raise InvalidArgumentError(f"cross_entropy: softcap must be > 0 (or None for none), got {cap}")
    return ls, z, cap


def _ce(logits, target, ignore_index, reduction, grad, label_smoothing=0.0, z_loss=0.0, softcap=None,
        inplace=False):
    _checks.choice("reduction", reduction, ("mean", "sum", "none"))
    ignore_index = _checks.int64("ignore_index", ignore_index)
    options = _ce_options(label_smoothing, z_loss, softcap)
    inplace = _checks.flag("inplace", inplace)
    lg, tg = Arg(logits, "logits"), Arg(target, "target")
    n_valid = int((_host_values(tg) != ignore_index).sum())
    # The gradient of the reduced loss: mean divides by the rows that count.
    scale = (1.0 / n_valid if n_valid else 0.0) if reduction == "mean" else 1.0
    loss = empty_like(lg, tuple(lg.array.shape)[:1], "float32")
    if inplace and lg.kind == "dlpack":
        raise InvalidArgumentError("cross_entropy_with_grad: inplace=True needs numpy, torch or tensor_ops logits "
                                   f"(the gradient is written into them), got {type(logits).__name__}")
    if inplace and grad:
        if getattr(logits, "requires_grad", False):
            raise InvalidArgumentError(
                f"cross_entropy_with_grad: inplace=True writes the gradient into logits (shape "
                f"{tuple(logits.shape)}, dtype {logits.dtype}), which require grad: autograd would use the "
                "overwritten values; pass logits.detach() or inplace=False")
        check_out(logits, "logits")  # the rest of what an out= must be
    # In place: the logits as given (numpy bfloat16 included), torch's without its autograd view.
    dlogits = ((lg.original if lg.kind == "numpy" else lg.array) if inplace else empty_like(lg)) if grad else None
    run(_C.cross_entropy, [lg, tg], [loss, dlogits], int(ignore_index), float(scale), *options)
    if inplace:
        dlogits = logits
        bump_version(logits)
    if reduction == "none":
        return loss, dlogits
    total = (loss.numpy() if lg.kind == "tensor_ops" else loss).sum()
    if reduction == "sum":
        return total, dlogits
    return (total / n_valid if n_valid else total * float("nan")), dlogits


def cross_entropy(logits: Array, target: Array, ignore_index: int = -100, reduction: Reduction = "mean", *,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None) -> Any:
    """Cross-entropy of logits [N, C] against class indices [N]
    (ignore_index rows count for nothing). label_smoothing as torch's;
    z_loss adds z_loss * logsumexp^2 per row (PaLM); softcap replaces the
    logits by softcap * tanh(logits / softcap) first (Gemma 2)."""
    return _ce(logits, target, ignore_index, reduction, False, label_smoothing, z_loss, softcap)[0]


def cross_entropy_with_grad(logits: Array, target: Array, ignore_index: int = -100, reduction: Reduction = "mean",
                            *, label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                            inplace: bool = False) -> tuple[Any, Array]:
    """(loss, dlogits) in one pass: the gradient of the reduced loss is
    written while the row is in cache. inplace=True writes it into the
    logits' own buffer and returns logits as dlogits (Liger's memory
    saving: no second [N, C] array). Options as cross_entropy."""
    return _ce(logits, target, ignore_index, reduction, True, label_smoothing, z_loss, softcap, inplace)


WEIGHT_LAYOUTS = ("nk", "kn")


def linear(x: Array, weight: Array, bias: Array | None = None, *, weight_layout: str = "nk",
           out: Array | None = None) -> Array:
    """x @ weight.T + bias (torch.nn.functional.linear's op): x [..., K],
    weight [N, K], bias [N] (optional), one dtype -> [..., N]; with
    weight_layout="kn", weight is [K, N] and the op is x @ weight + bias
    (transformers' Conv1D, GPT-2). Made for a few rows of x (decode: batch x
    new tokens; many rows work, slower than a GEMM library): weight read
    once, in place, with fp32 accumulation, and every output element summed
    in one fixed order, the same bits on any number of threads. K = 0 gives
    the bias (or zeros). A weight whose rows are not contiguous (a
    transposed view) is copied first: pass the weight as it is stored, with
    the layout that names it."""
    kn = _checks.choice("weight_layout", weight_layout, WEIGHT_LAYOUTS) == "kn"
    return invoke("linear", (x, weight, bias), (1,) if kn else (), out)  # 1: WeightLayout::KN


__all__ = [
    "layer_norm", "add_rms_norm", "rms_norm_backward", "layer_norm_backward", "softmax", "log_softmax",
    "softmax_backward", "log_softmax_backward", "silu_backward", "gelu_backward", "swiglu", "geglu",
    "swiglu_backward", "geglu_backward", "rope", "rope_backward", "attention", "attention_backward",
    "cross_entropy", "cross_entropy_with_grad", "linear",
]
