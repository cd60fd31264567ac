"""The XLA shim: tensor_ops' op set written in JAX, for TPUs (and any XLA device).

jax arrays in, jax arrays out, same dtype. fp16/bf16 inputs are computed in
fp32 and rounded once at the end, as the native kernels do; matmuls ask for
full fp32 precision (TPUs default to bf16 passes). Every op is jit-compiled
(cached per shape, dtype and static option) and composes inside a caller's
jax.jit; jax.grad differentiates through it. Arguments are checked before
tracing with the native ops' rules and error types. torch tensors on an XLA
device take the torch ops path in _xla_torch (unverified here).

jax is imported on first use, so importing tensor_ops stays cheap.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Optional

import numpy as np

from . import _checks
from . import _xla_kernels as _k
from ._xla_kernels import _jax
from .errors import ArgumentTypeError, BackendUnavailableError, DTypeError, InvalidArgumentError, UnsupportedError
from .ops import causal_mode

NAMES = ("xla", "tpu")  # both select the shim; "tpu" is the name users know


# ---- array kinds ------------------------------------------------------------


def is_jax_array(x) -> bool:
    jax = sys.modules.get("jax")  # no jax imported: x cannot be a jax array
    return jax is not None and isinstance(x, jax.Array)


def is_torch_xla(x) -> bool:
    # The "xla" device type exists only once torch_xla is imported.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.is_xla


def is_xla_array(x) -> bool:
    """A jax array (tracers included) or a torch tensor on an XLA device."""
    if type(x) is np.ndarray:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):  # the common case: cheap (no jax ABC check)
        return x.is_xla
    return is_jax_array(x)


# ---- argument checks (the core's rules and messages) -------------------------


def _as_jax(x):
    if is_jax_array(x):
        return x
    if is_torch_xla(x):  # only the forward ops have a torch_xla path
        raise UnsupportedError("this op has no torch_xla path in tensor_ops.xla; differentiate the forward op "
                               "with torch autograd")
    return _jax().numpy.asarray(x)


def _float(op: str, name: str, a, like=None):
    dt = a.dtype
    if not _jax().numpy.issubdtype(dt, np.floating):
        raise DTypeError(f"{op}: {name} has dtype {dt}; tensor_ops ops take float32, float16 or bfloat16")
    if like is not None and dt != like.dtype:
        raise DTypeError(f"{op}: {name} has dtype {dt} but x has {like.dtype}")


def _same_shape(op: str, name: str, a, x):
    if a.shape != x.shape:
        raise InvalidArgumentError(f"{op}: {name} has shape {list(a.shape)} but x has {list(x.shape)}")


def _vector(op: str, name: str, w, x):
    _float(op, name, w, x)
    cols = x.shape[-1] if x.ndim else 1
    if w.ndim != 1 or w.shape[0] != cols:
        raise InvalidArgumentError(f"{op}: {name} must have shape [{cols}] to match x {list(x.shape)}, "
                                   f"got {list(w.shape)}")


def _rank(op: str, x, n: int):
    if x.ndim < n:
        raise InvalidArgumentError(f"{op}: x must have at least {n} dimension(s), got shape {list(x.shape)}")


def _constant(op: str, name: str, value) -> None:
    """Scalars (eps, scale, offset) are compile-time constants of the ops: a
    jax tracer there (an argument of jax.jit, a value jax.grad differentiates)
    is refused in words (it raised ConcretizationTypeError, or "must be a
    real number" of a real number)."""
    if not _concrete(value):
        raise ArgumentTypeError(
            f"{op}: {name} is traced by jax ({type(value).__name__}); tensor_ops takes {name} as a constant: "
            f"under jax.jit mark it static (static_argnums / static_argnames) or close over a Python float; "
            f"a {name} to differentiate is not supported")


def _offset(op: str, offset) -> float:
    """rms_norm's weight offset, as the kernels take it: -0.0 for none (w +
    -0.0 is w bit for bit; +0.0 would turn a -0.0 weight into +0.0)."""
    _constant(op, "offset", offset)
    if isinstance(offset, (bool, str, bytes)) or not hasattr(offset, "__float__"):
        raise TypeError(f"{op}: offset must be a real number, got {type(offset).__name__}")
    offset = float(offset)
    if not math.isfinite(offset):
        raise InvalidArgumentError(f"{op}: offset must be finite, got {offset}")
    return offset or -0.0


def _eps(op: str, eps) -> float:
    _constant(op, "eps", eps)
    if isinstance(eps, (str, bytes)) or not hasattr(eps, "__float__"):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise InvalidArgumentError(f"{op}: eps must be finite and >= 0, got {eps}")
    return eps


def _scale(op: str, scale) -> float:
    # the native ops' checks (_checks.real): no float('2'), no bool
    _constant(op, "scale", scale)
    return _checks.real(f"{op}: scale", scale)


def _approx(approximate) -> str:
    if not isinstance(approximate, str):
        raise TypeError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if approximate not in ("none", "tanh"):
        raise InvalidArgumentError(f"gelu: approximate must be 'none' or 'tanh', got '{approximate}'")
    return approximate


def _index(op: str, name: str, a):
    if a.dtype not in (np.int32, np.int64):
        raise DTypeError(f"{op}: {name} must be int32 or int64, got dtype {a.dtype}")


def _concrete(a) -> bool:
    # Values can be checked only outside a trace; inside one, bad indices
    # give NaN (gathers use mode="fill") rather than a silently clamped value.
    core = sys.modules.get("jax.core")
    return not (core is not None and isinstance(a, core.Tracer))


# ---- the op API ---------------------------------------------------------------


def _tx():
    from . import _xla_torch

    return _xla_torch


def rms_norm(x, weight, eps: float = 1e-6, *, offset: float = 0.0):
    """x / sqrt(mean(x**2, last dim) + eps) * (offset + weight), offset +
    weight formed in fp32."""
    offset = _offset("rms_norm", offset)
    if is_torch_xla(x):
        return _tx().rms_norm(x, weight, eps, offset)
    x, weight = _as_jax(x), _as_jax(weight)
    _float("rms_norm", "x", x)
    if x.ndim < 1:
        raise InvalidArgumentError("rms_norm: x must have at least 1 dimension (it normalises the last); "
                                   "got a 0-d tensor")
    _vector("rms_norm", "weight", weight, x)
    return _k.rms_norm(x, weight, _eps("rms_norm", eps), offset)


def _unary(op: str, x, act: str):
    x = _as_jax(x)
    _float(op, "x", x)
    return _k.activation(x, act)


def silu(x):
    """x * sigmoid(x)."""
    return _tx().silu(x) if is_torch_xla(x) else _unary("silu", x, "silu")


def gelu(x, approximate: str = "none"):
    """GELU: approximate="none" uses erf, "tanh" the tanh approximation."""
    approximate = _approx(approximate)
    if is_torch_xla(x):
        return _tx().gelu(x, approximate)
    return _unary("gelu", x, "gelu" if approximate == "none" else "tanh")


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(biased var + eps) * weight + bias over the last dim."""
    if is_torch_xla(x):
        return _tx().layer_norm(x, weight, bias, eps)
    x, weight = _as_jax(x), _as_jax(weight)
    _float("layer_norm", "x", x)
    _rank("layer_norm", x, 1)
    _vector("layer_norm", "weight", weight, x)
    if bias is not None:
        bias = _as_jax(bias)
        _vector("layer_norm", "bias", bias, x)
    return _k.layer_norm(x, weight, bias, _eps("layer_norm", eps))


def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """(rms_norm(x + residual, weight), x + residual); the sum is rounded to
    x's dtype before it is normalised (what a later layer reads)."""
    if is_torch_xla(x):
        return _tx().add_rms_norm(x, residual, weight, eps)
    x, residual, weight = _as_jax(x), _as_jax(residual), _as_jax(weight)
    _float("add_rms_norm", "x", x)
    _rank("add_rms_norm", x, 1)
    _float("add_rms_norm", "residual", residual, x)
    _same_shape("add_rms_norm", "residual", residual, x)
    _vector("add_rms_norm", "weight", weight, x)
    return _k.add_rms_norm(x, residual, weight, _eps("add_rms_norm", eps))


def _softmax(op: str, x, dim, scale, causal, log, causal_alignment):
    mode = causal_mode(causal, causal_alignment)
    if not is_torch_xla(x):
        x = _as_jax(x)
        _float(op, "x", x)
    dim = _checks.integer("dim", dim)  # numpy integers too
    if x.ndim == 0:  # torch's rule: a 0-d array is a row of one (dim -1 or 0)
        if dim not in (-1, 0):
            raise InvalidArgumentError(f"dim {dim!r} is out of range for a 0-d array (-1 or 0)")
        return _softmax(op, x.reshape((1,)), -1, scale, causal, log, causal_alignment).reshape(())
    if not -x.ndim <= dim < x.ndim:
        raise InvalidArgumentError(f"dim {dim!r} is out of range for an array of shape {tuple(x.shape)}")
    dim %= x.ndim
    if causal:
        if dim != x.ndim - 1:
            raise InvalidArgumentError("causal softmax works on the last dim only")
        _rank(op, x, 2)
    scale = _scale(op, scale)
    if is_torch_xla(x):
        return _tx().softmax(x, dim, scale, mode, log)
    if dim == x.ndim - 1:
        return _k.softmax(x, scale, mode, log)
    jnp = _jax().numpy
    return jnp.moveaxis(_k.softmax(jnp.moveaxis(x, dim, -1), scale, False, log), -1, dim)


def softmax(x, dim: int = -1, scale: float = 1.0, causal: bool = False, *, causal_alignment: str = "bottom_right"):
    """softmax(scale * x) along dim. causal masks [..., i, j] for
    j > i + (cols - rows) ("bottom_right") or j > i ("top_left"); a fully
    masked row gives zeros."""
    return _softmax("softmax", x, dim, scale, causal, False, causal_alignment)


def log_softmax(x, dim: int = -1, scale: float = 1.0, causal: bool = False, *,
                causal_alignment: str = "bottom_right"):
    """log(softmax(scale * x)) along dim; masked entries are -inf."""
    return _softmax("log_softmax", x, dim, scale, causal, True, causal_alignment)


def _glu(op: str, gate, up, act: str):
    gate, up = _as_jax(gate), _as_jax(up)
    _float(op, "gate", gate)
    _float(op, "up", up, gate)
    _same_shape(op, "up", up, gate)
    return _k.glu(gate, up, act)


def swiglu(gate, up):
    """silu(gate) * up."""
    return _tx().glu(gate, up, "silu") if is_torch_xla(gate) else _glu("glu", gate, up, "silu")


def geglu(gate, up, approximate: str = "none"):
    """gelu(gate) * up."""
    act = "gelu" if _approx(approximate) == "none" else "tanh"
    return _tx().glu(gate, up, act) if is_torch_xla(gate) else _glu("glu", gate, up, act)


def linear(x, weight, bias=None, *, weight_layout: str = "nk"):
    """x @ weight.T + bias (weight [N, K]; weight_layout "kn": weight [K, N],
    x @ weight + bias), products accumulated in fp32, in x's dtype: the
    native op's contract."""
    kn = _checks.choice("weight_layout", weight_layout, ("nk", "kn")) == "kn"
    if is_torch_xla(x):
        F = sys.modules["torch"].nn.functional
        y = F.linear(x.float(), (weight.t() if kn else weight).float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    x, weight = _as_jax(x), _as_jax(weight)
    _float("linear", "x", x)
    _float("linear", "weight", weight, x)
    _rank("linear", x, 1)
    k = x.shape[-1]
    if weight.ndim != 2 or weight.shape[0 if kn else 1] != k:
        raise InvalidArgumentError(f"linear: weight must be [{'K, N' if kn else 'N, K'}] with K = {k} (x has shape "
                                   f"{list(x.shape)}), got {list(weight.shape)}")
    if bias is not None:
        bias = _as_jax(bias)
        _float("linear", "bias", bias, x)
        n = weight.shape[1 if kn else 0]
        if bias.ndim != 1 or bias.shape[0] != n:
            raise InvalidArgumentError(f"linear: bias must have shape [{n}], got {list(bias.shape)}")
    return _k.linear(x, weight, bias, kn)


def _positions(positions, B: int, S: int):
    jnp = _jax().numpy
    if positions is None:
        return jnp.arange(S, dtype=jnp.int32)[None, :]
    p = _as_jax(positions)
    _index("rope", "positions", p)
    if p.ndim == 1:
        p = p[None, :]
    if p.ndim != 2 or p.shape[0] not in (B, 1) or p.shape[1] != S:
        raise InvalidArgumentError(f"rope: positions must be [batch or 1, seq] = [{B} or 1, {S}], "
                                   f"got shape {list(np.shape(positions))}")
    return p


def _rope(x, cos, sin, positions, interleaved, inverse):
    if is_torch_xla(x):
        return _tx().rope(x, cos, sin, positions, interleaved, inverse)
    x = _as_jax(x)
    _float("rope", "x", x)
    if x.ndim != 4:
        raise InvalidArgumentError(f"rope: x must be [batch, seq, heads, head_dim], got shape {list(x.shape)}")
    B, S, _, D = x.shape
    # Tables take x's dtype first, as the native op layer does.
    cos, sin = _as_jax(cos), _as_jax(sin)
    _float("rope", "cos", cos)
    _float("rope", "sin", sin)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    if cos.ndim != 2 or sin.shape != cos.shape:
        raise InvalidArgumentError(f"rope: cos and sin must both be [max_position, rotary_dim / 2], got cos "
                                   f"{list(cos.shape)}, sin {list(sin.shape)}")
    half = cos.shape[1]
    if half < 1 or 2 * half > D:
        raise InvalidArgumentError(f"rope: rotary_dim = 2 * {half} must be in [2, head_dim = {D}]")
    pos = _positions(positions, B, S)
    if _concrete(pos) and pos.size and not (0 <= int(pos.min()) and int(pos.max()) < cos.shape[0]):
        raise InvalidArgumentError(f"rope: a position is outside the cos/sin tables [0, {cos.shape[0]})")
    return _k.rope(x, cos, -sin if inverse else sin, pos, _checks.flag("interleaved", interleaved))


def rope(x, cos, sin, positions=None, interleaved: bool = False):
    """Rotary embedding of x [batch, seq, heads, head_dim] with tables
    [max_position, rotary_dim / 2]; positions [seq] or [batch, seq] (default
    0..seq-1). interleaved=False: NeoX halves; True: GPT-J pairs."""
    return _rope(x, cos, sin, positions, interleaved, False)


def rope_backward(dy, cos, sin, positions=None, interleaved: bool = False):
    """The gradient of rope: rotation by the opposite angle."""
    return _rope(dy, cos, sin, positions, interleaved, True)


def _attention_args(op: str, q, k, v, scale):
    q, k, v = _as_jax(q), _as_jax(k), _as_jax(v)
    _float(op, "q", q)
    _float(op, "k", k, q)
    _float(op, "v", v, q)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise InvalidArgumentError(f"{op}: q, k, v must be [batch, heads, seq, head_dim], got q "
                                   f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise InvalidArgumentError(f"{op}: k and v must be [{q.shape[0]}, kv_heads, kv_seq, {q.shape[3]}], "
                                   f"got k {list(k.shape)}, v {list(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise InvalidArgumentError(f"{op}: kv heads ({k.shape[1]}) must divide q heads ({q.shape[1]})")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else _scale(op, scale)
    return q, k, v, scale


def attention(q, k, v, causal: bool = False, scale: Optional[float] = None, *, return_lse: bool = False,
              causal_alignment: str = "bottom_right"):
    """softmax(scale * q k^T) v; q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] with
    Hkv dividing Hq (grouped-query); scale defaults to 1/sqrt(D); causal is
    aligned as causal_alignment says (tensor_ops.attention's). return_lse adds the float32 log-sum-exp [B, Hq, Lq].
    Scores are materialised per call ([B, Hq, Lq, Lk] fp32): XLA fuses the
    rest, but very long sequences want a flash kernel (Pallas) instead."""
    mode = causal_mode(causal, causal_alignment)
    if is_torch_xla(q):
        out, lse = _tx().attention(q, k, v, mode, scale)
        return (out, lse) if return_lse else out
    q, k, v, scale = _attention_args("attention", q, k, v, scale)
    out, lse = _k.attention(q, k, v, scale, mode)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out=None, lse=None, causal: bool = False, scale: Optional[float] = None, *,
                       causal_alignment: str = "bottom_right"):
    """(dq, dk, dv) of attention; out and lse are accepted for the native
    signature but recomputed."""
    q, k, v, scale = _attention_args("attention_backward", q, k, v, scale)
    dout = _as_jax(dout)
    _float("attention_backward", "dout", dout, q)
    _same_shape("attention_backward", "dout", dout, q)
    return _k.attention_backward(dout, q, k, v, scale, causal_mode(causal, causal_alignment))


def _ce_args(logits, target, reduction):
    if reduction not in ("mean", "sum", "none"):
        raise InvalidArgumentError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    logits, target = _as_jax(logits), _as_jax(target)
    _float("cross_entropy", "logits", logits)
    if logits.ndim != 2:
        raise InvalidArgumentError(f"cross_entropy: logits must be [N, C], got shape {list(logits.shape)}")
    if target.dtype not in (np.int32, np.int64):
        raise DTypeError(f"cross_entropy: target must be int32 or int64 class indices, got dtype {target.dtype}")
    N, C = logits.shape
    if target.ndim != 1 or target.shape[0] != N:
        raise InvalidArgumentError(f"cross_entropy: target must be [{N}], got shape {list(target.shape)}")
    if N and not C:
        raise InvalidArgumentError(f"cross_entropy: logits have no classes: shape {list(logits.shape)}")
    return logits, target


def _ce_options(label_smoothing, z_loss, softcap):
    from ._checks import real
    ls, z = real("label_smoothing", label_smoothing, nonneg=True), real("z_loss", z_loss, nonneg=True)
    if ls > 1:
        raise InvalidArgumentError(f"cross_entropy: label_smoothing must be in [0, 1], got {ls}")
    cap = 0.0 if softcap is None else real("softcap", softcap)
    if softcap is not None and cap <= 0:
        raise InvalidArgumentError(f"cross_entropy: softcap must be > 0 (or None for none), got {cap}")
    return ls, z, cap


def _ce(logits, target, ignore_index, reduction, label_smoothing=0.0, z_loss=0.0, softcap=None):
    jnp = _jax().numpy
    ignore_index = _checks.int64("ignore_index", ignore_index)  # as the native op: no int(1.5), int64
    ls, zl, cap = _ce_options(label_smoothing, z_loss, softcap)
    logits, target = _ce_args(logits, target, reduction)
    if _concrete(target) and target.size:
        t = np.asarray(target)
        bad = (t != ignore_index) & ((t < 0) | (t >= logits.shape[1]))
        if bad.any():
            raise InvalidArgumentError(f"cross_entropy: target {int(t[bad][0])} is outside [0, {logits.shape[1]}) "
                                       f"and is not ignore_index ({ignore_index})")
    if not -2 ** 31 <= ignore_index < 2 ** 31:
        # past int32 it matches no target (the check above refused any target outside the classes): as
        # natively, no row is ignored; jax takes the argument as int32
        ignore_index = -2 ** 31
    rows, grad = _k.cross_entropy(logits, target, ignore_index, ls, zl, cap)
    if reduction == "none":
        return rows, grad.astype(logits.dtype)
    total = jnp.sum(rows)
    if reduction == "sum":
        return total, grad.astype(logits.dtype)
    n = jnp.sum(target != ignore_index)
    # No valid row: the loss is NaN (0/0) and the gradient zero, as natively.
    return total / n, (grad / jnp.maximum(n, 1)).astype(logits.dtype)


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean", *,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None):
    """Cross-entropy of logits [N, C] against class indices [N]; the loss is
    float32 (as the native op); mean is over rows whose target is not
    ignore_index (NaN when there is none). Options as tensor_ops.cross_entropy."""
    if is_torch_xla(logits):
        ls, zl, cap = _ce_options(label_smoothing, z_loss, softcap)
        return _tx().cross_entropy(logits, target, ignore_index, reduction, ls, zl, cap)
    return _ce(logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap)[0]


def cross_entropy_with_grad(logits, target, ignore_index: int = -100, reduction: str = "mean", *,
                            label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                            inplace: bool = False):
    """(loss, dlogits): dlogits is the gradient of the reduced loss. XLA
    arrays are immutable: inplace=True is refused."""
    if inplace is not False:
        raise UnsupportedError("cross_entropy_with_grad: inplace=True cannot write into an XLA array (they are "
                               "immutable); use inplace=False")
    return _ce(logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap)


def rms_norm_backward(dy, x, weight, eps: float = 1e-6, *, offset: float = 0.0):
    """(dx, dweight) of rms_norm (with its offset)."""
    offset = _offset("rms_norm_backward", offset)
    dy, x, weight = _as_jax(dy), _as_jax(x), _as_jax(weight)
    _float("rms_norm_backward", "x", x)
    _rank("rms_norm_backward", x, 1)
    _vector("rms_norm_backward", "weight", weight, x)
    _float("rms_norm_backward", "dy", dy, x)
    _same_shape("rms_norm_backward", "dy", dy, x)
    return _k.rms_norm_backward(dy, x, weight, _eps("rms_norm_backward", eps), offset)


def layer_norm_backward(dy, x, weight, eps: float = 1e-5, *, bias: bool = True):
    """(dx, dweight, dbias) of layer_norm (dbias None without bias)."""
    dy, x, weight = _as_jax(dy), _as_jax(x), _as_jax(weight)
    _float("layer_norm_backward", "x", x)
    _rank("layer_norm_backward", x, 1)
    _vector("layer_norm_backward", "weight", weight, x)
    _float("layer_norm_backward", "dy", dy, x)
    _same_shape("layer_norm_backward", "dy", dy, x)
    return _k.layer_norm_backward(dy, x, weight, _eps("layer_norm_backward", eps), bool(bias))


def _softmax_bwd(dy, y, dim, scale, log):
    jnp = _jax().numpy
    dy, y = _as_jax(dy), _as_jax(y)
    _float("softmax_backward", "y", y)
    _float("softmax_backward", "dy", dy, y)
    _same_shape("softmax_backward", "dy", dy, y)
    dim = _checks.integer("dim", dim)  # numpy integers too
    if y.ndim == 0 and dim in (-1, 0):  # a row of one, as softmax
        return _softmax_bwd(dy.reshape((1,)), y.reshape((1,)), -1, scale, log).reshape(())
    if y.ndim == 0 or not -y.ndim <= dim < y.ndim:
        raise InvalidArgumentError(f"dim {dim!r} is out of range for an array of shape {tuple(y.shape)}")
    scale = _scale("softmax_backward", scale)
    dx = _k.softmax_backward(jnp.moveaxis(dy, dim, -1), jnp.moveaxis(y, dim, -1), scale, log)
    return jnp.moveaxis(dx, -1, dim)


def softmax_backward(dy, y, dim: int = -1, scale: float = 1.0):
    """Gradient of y = softmax(scale * x) given y."""
    return _softmax_bwd(dy, y, dim, scale, False)


def log_softmax_backward(dy, y, dim: int = -1, scale: float = 1.0):
    return _softmax_bwd(dy, y, dim, scale, True)


def _act_bwd(dy, x, act):
    dy, x = _as_jax(dy), _as_jax(x)
    _float("activation_backward", "x", x)
    _float("activation_backward", "dy", dy, x)
    _same_shape("activation_backward", "dy", dy, x)
    return _k.act_backward(dy, x, act)


def silu_backward(dy, x):
    return _act_bwd(dy, x, "silu")


def gelu_backward(dy, x, approximate: str = "none"):
    return _act_bwd(dy, x, "gelu" if _approx(approximate) == "none" else "tanh")


def _glu_bwd(dy, gate, up, act):
    dy, gate, up = _as_jax(dy), _as_jax(gate), _as_jax(up)
    _float("glu_backward", "gate", gate)
    for name, a in (("up", up), ("dy", dy)):
        _float("glu_backward", name, a, gate)
        _same_shape("glu_backward", name, a, gate)
    return _k.glu_backward(dy, gate, up, act)


def swiglu_backward(dy, gate, up):
    return _glu_bwd(dy, gate, up, "silu")


def geglu_backward(dy, gate, up, approximate: str = "none"):
    return _glu_bwd(dy, gate, up, "gelu" if _approx(approximate) == "none" else "tanh")


# Every op of tensor_ops' API, by name: what the top level routes here.
OPS: Dict[str, Any] = {f.__name__: f for f in (
    rms_norm, silu, gelu, layer_norm, add_rms_norm, softmax, log_softmax, swiglu, geglu, rope, attention,
    cross_entropy, cross_entropy_with_grad, linear, rms_norm_backward, layer_norm_backward, softmax_backward,
    log_softmax_backward, silu_backward, gelu_backward, swiglu_backward, geglu_backward, rope_backward,
    attention_backward)}


# ---- devices and backend status ------------------------------------------------

_VENDORS = {"tpu": "Google", "cuda": "NVIDIA", "rocm": "AMD"}


def _platform_version(device) -> str:
    try:
        return str(device.client.platform_version)
    except AttributeError:
        return ""


def xla_devices() -> List[Dict[str, Any]]:
    """jax's devices as DeviceInfo fields; [] without jax or when no XLA
    platform initialises. backend is "tpu" on a TPU host, else "xla"."""
    try:
        jax = _jax()
        name = "tpu" if jax.default_backend() == "tpu" else "xla"
        devs = jax.devices()
    except (BackendUnavailableError, RuntimeError):
        return []
    import jaxlib

    out = []
    for i, d in enumerate(devs):
        try:
            stats = d.memory_stats() or {}
        except Exception:  # a platform without memory stats (CPU) may raise instead of returning None
            stats = {}
        platform = d.platform
        out.append(dict(
            backend=name,
            device_type=platform if platform in ("cpu", "tpu") else "gpu",
            device_id=i,
            device_name=str(d.device_kind),
            total_memory_bytes=int(stats.get("bytes_limit", 0)),
            compute_capability=str(getattr(d, "compute_capability", "") or ""),
            driver_version=_platform_version(d),
            is_available=True,
            vendor=_VENDORS.get(platform, ""),
            properties={"platform": platform, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                        "jax_device_id": str(d.id), "process_index": str(d.process_index)},
        ))
    return out


def backend_status() -> Dict[str, Any]:
    """The shim as BackendStatus fields: usable when jax imports and finds a
    device. It runs host arrays only when selected (never by default)."""
    status = dict(name="xla", compiled=True, usable=False, reason="", priority=0, library="")
    try:
        jax = _jax()
        status["name"] = "tpu" if jax.default_backend() == "tpu" else "xla"
        n = len(jax.devices())
    except BackendUnavailableError as e:
        status["reason"] = "jax not installed" if "not installed" in str(e) else str(e)
        return status
    except RuntimeError as e:
        status["reason"] = f"jax found no usable XLA platform: {e}"
        return status
    status["library"] = f"jax {jax.__version__} ({jax.default_backend()}, {n} device(s))"
    status["usable"] = n > 0
    status["reason"] = "" if n else "jax reports no devices"
    return status
