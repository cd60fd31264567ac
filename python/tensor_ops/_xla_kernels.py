"""The JAX kernels behind tensor_ops.xla: one jitted function per op
family, traced once per shape, dtype and static option. Inputs arrive
checked (xla.py); 16-bit floats are computed in fp32 and rounded once."""
from __future__ import annotations

import functools
import math
import os
import sys
from typing import Any, List

from .errors import BackendUnavailableError


# A process forked after JAX started its runtime in the parent (a DataLoader
# fork worker, multiprocessing's 'fork') cannot use it: JAX's threads do not
# survive fork, and the child's first op hung forever. As the native plugins
# whose runtime does not survive fork, the shim is then unusable, with why.
_FORKED_REASON = ""


def _jax_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", None))
    except Exception:  # noqa: BLE001 - another jax: imported counts as started
        return True


def _after_fork_in_child() -> None:
    global _FORKED_REASON
    if not _FORKED_REASON and _jax_started():
        _FORKED_REASON = (f"xla backend: this process was forked (pid {os.getpid()}) after JAX started in its parent, "
                          f"and JAX does not survive fork; use the 'spawn' or 'forkserver' start method for "
                          f"workers that run XLA")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _jax():
    if _FORKED_REASON:
        raise BackendUnavailableError(_FORKED_REASON)
    try:
        import jax
    except ImportError as e:
        raise BackendUnavailableError("xla backend: jax not installed (pip install jax jaxlib)") from e
    return jax


def _mods():
    jax = _jax()
    return jax, jax.numpy, jax.lax


def _jit(*static):
    """jax.jit on first call (not at import: jax is optional)."""

    def deco(fn):
        holder: List[Any] = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not holder:
                holder.append(_jax().jit(fn, static_argnames=static))
            return holder[0](*args, **kwargs)

        return call

    return deco


def _acc(a):
    """fp32 for 16-bit floats; float32 and float64 compute as they are."""
    jnp = _jax().numpy
    return a.astype(jnp.float32) if a.dtype.itemsize < 4 else a


def _rms(xf, wf, eps):
    _, jnp, lax = _mods()
    return xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * wf


def _act(xf, act: str):
    jax, jnp, lax = _mods()
    if act == "silu":
        return xf * jax.nn.sigmoid(xf)
    if act == "tanh":
        u = math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf * xf * xf)
        return 0.5 * xf * (1.0 + jnp.tanh(u))
    return 0.5 * xf * lax.erfc(-xf * (1.0 / math.sqrt(2.0)))  # erfc keeps the negative tail accurate


def _act_grad(xf, act: str):
    """d act / dx in torch's formulas, not through autodiff: jax's vjp of
    x * sigmoid(x) adds dy * sigmoid(x) to x * (dy * sigmoid'(x)), which is
    NaN (inf + 0 * inf) for dy = inf at x = 0 where torch's dy * act'(x) is
    inf; the special values then follow torch's."""
    jax, jnp, lax = _mods()
    if act == "silu":
        s = jax.nn.sigmoid(xf)
        return s * (1.0 + xf * (1.0 - s))
    if act == "tanh":
        k = math.sqrt(2.0 / math.pi)
        x_sq = xf * xf
        t = jnp.tanh(k * (xf + 0.044715 * x_sq * xf))
        return 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * (k * (1.0 + 3.0 * 0.044715 * x_sq))
    cdf = 0.5 * lax.erfc(-xf * (1.0 / math.sqrt(2.0)))
    return cdf + xf * (1.0 / math.sqrt(2.0 * math.pi)) * jnp.exp(-0.5 * xf * xf)


@_jit()
def rms_norm(x, w, eps, offset):
    return _rms(_acc(x), _acc(w) + offset, eps).astype(x.dtype)


@_jit("act")
def activation(x, act):
    return _act(_acc(x), act).astype(x.dtype)


@_jit("act")
def glu(g, u, act):
    return (_act(_acc(g), act) * _acc(u)).astype(g.dtype)


def _ln(xf, wf, bf, eps):
    _, jnp, lax = _mods()
    # m = x0 + mean(x - x0), x0 the row's first element (the CPU's Note
    # [layer_norm's mean]): a row of one value normalises to exactly 0. m is
    # a float, up to half an ulp of |m| off; the deviations d = x - m are
    # (nearly) exact, so their mean c is m's error and the row is normalised
    # as (d - c) with variance mean(d^2) - c^2 (the CPU's Note [layer_norm's
    # corrected mean]): [1e8, 1e8 + 8, 1e8 + 16, 1e8 - 8] gave [0, 0.82, 1.63,
    # -0.82] with m rounded to 1e8 (exact: [-0.45, 0.45, 1.34, -1.34]).
    x0 = xf[..., :1]
    m = x0 + jnp.mean(xf - x0, axis=-1, keepdims=True)
    d = xf - m
    c = jnp.mean(d, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(d * d, axis=-1, keepdims=True) - c * c, 0.0)
    y = (d - c) * lax.rsqrt(var + eps) * wf
    return y if bf is None else y + bf


@_jit()
def layer_norm(x, w, b, eps):
    return _ln(_acc(x), _acc(w), None if b is None else _acc(b), eps).astype(x.dtype)


@_jit("kn")
def linear(x, w, b, kn):
    """x @ w.T + b (kn: x @ w + b), products accumulated in fp32, x's dtype."""
    jnp = _jax().numpy
    y = jnp.matmul(x, w if kn else w.T, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + _acc(b)
    return y.astype(x.dtype)


@_jit()
def add_rms_norm(x, r, w, eps):
    s = (_acc(x) + _acc(r)).astype(x.dtype)  # normalise the residual as stored
    return _rms(_acc(s), _acc(w), eps).astype(x.dtype), s


def _causal_keep(rows: int, cols: int, mode: int = 1):
    """[rows, cols] True where key j is visible to query i: j <= i + cols -
    rows (mode 1, bottom-right aligned) or j <= i (mode 2, top-left)."""
    jnp = _jax().numpy
    i = jnp.arange(rows)[:, None]
    j = jnp.arange(cols)[None, :]
    return j <= i + (0 if mode == 2 else cols - rows)


def _masked_softmax(v, keep, log: bool):
    """softmax / log_softmax of v along the last dim; keep=None keeps all.
    A row with nothing kept gives zeros (log: -inf), as the native kernels;
    a row that sees a NaN or +inf, or only -inf, is NaN, as the native
    kernels and torch (x - max is NaN there): the shim gave 0, or kept the
    NaN row's other values as they were in log_softmax."""
    jnp = _jax().numpy
    ninf = -jnp.inf
    if keep is not None:
        v = jnp.where(keep, v, ninf)
    m = jnp.max(v, axis=-1, keepdims=True, initial=ninf)
    seen = jnp.ones(m.shape, bool) if keep is None else jnp.any(keep, axis=-1, keepdims=True)
    bad = seen & ~jnp.isfinite(m)  # NaN (max propagates it), +inf, or every seen value -inf
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(v - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    if log:
        out = v - m - jnp.log(jnp.where(s > 0, s, 1.0))
        out = out if keep is None else jnp.where(keep, out, ninf)
    else:
        out = jnp.where(s > 0, e / jnp.where(s > 0, s, 1.0), 0.0)
    return jnp.where(bad, jnp.nan, out)


@_jit("causal", "log")
def softmax(x, scale, causal, log):
    # scale (x - x's extreme), not scale x - max(scale x): XLA fuses the
    # latter's product into the subtraction (an FMA, no way to stop it from
    # here), which leaves the exact product's distance to the rounded max,
    # up to half an ulp of it, and e^ of that under- or overflowed once
    # |scale x| passed ~2^31 (a row of 1e10 at scale 0.7 came out all 0).
    # Here the extreme element gives exactly 0 (its max for scale >= 0, its
    # min below), and the product has nothing to fuse into.
    # A row whose extreme is not finite (NaN, inf, nothing kept) takes
    # scale x as before.
    jnp = _jax().numpy
    xf = _acc(x)
    keep = _causal_keep(*x.shape[-2:], causal) if causal else None
    hi = xf if keep is None else jnp.where(keep, xf, -jnp.inf)
    lo = xf if keep is None else jnp.where(keep, xf, jnp.inf)
    # initial: a row of width 0 has no extreme (reductions without one raised)
    ext = jnp.where(scale >= 0, jnp.max(hi, axis=-1, keepdims=True, initial=-jnp.inf),
                    jnp.min(lo, axis=-1, keepdims=True, initial=jnp.inf))
    v = (xf - jnp.where(jnp.isfinite(ext), ext, 0.0)) * scale
    return _masked_softmax(v, keep, log).astype(x.dtype)


@_jit("interleaved")
def rope(x, cos, sin, pos, interleaved):
    jnp = _jax().numpy
    xf = _acc(x)
    half = cos.shape[1]
    # [B or 1, S, 1, half]; an out-of-range position reads NaN.
    c = jnp.take(_acc(cos), pos, axis=0, mode="fill", fill_value=jnp.nan)[:, :, None, :]
    s = jnp.take(_acc(sin), pos, axis=0, mode="fill", fill_value=jnp.nan)[:, :, None, :]
    rest = xf[..., 2 * half:]
    if interleaved:
        pairs = xf[..., : 2 * half].reshape(xf.shape[:-1] + (half, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        rot = jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(xf.shape[:-1] + (2 * half,))
    else:
        a, b = xf[..., :half], xf[..., half: 2 * half]
        rot = jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return jnp.concatenate([rot, rest], axis=-1).astype(x.dtype)


def _attn(qf, kf, vf, scale, causal):
    """out, lse in the accumulation dtype; q heads grouped over kv heads
    (q head h reads kv head h // (Hq // Hkv)) without repeating k and v."""
    jax, jnp, lax = _mods()
    B, Hq, Lq, D = qf.shape
    Hkv, Lk = kf.shape[1], kf.shape[2]
    qg = qf.reshape(B, Hkv, Hq // Hkv, Lq, D)
    # Full fp32 unless the user set jax_default_matmul_precision (tpu.precision
    # of a TensorOpsConfig); jit's cache key includes that setting.
    hi = lax.Precision.HIGHEST if jax.config.jax_default_matmul_precision is None else None
    r = jnp.einsum("bhgqd,bhkd->bhgqk", qg, kf, precision=hi)
    keep = _causal_keep(Lq, Lk, causal) if causal else None
    # scale (r - r's extreme), as softmax (XLA fuses scale r - max(scale r) into an FMA, whose
    # rounding left NaN or inf once |scale q k| was large: q, k ~1e5 gave NaN outputs).
    hi_r = r if keep is None else jnp.where(keep, r, -jnp.inf)
    lo_r = r if keep is None else jnp.where(keep, r, jnp.inf)
    ext = jnp.where(scale >= 0, jnp.max(hi_r, axis=-1, keepdims=True, initial=-jnp.inf),
                    jnp.min(lo_r, axis=-1, keepdims=True, initial=jnp.inf))
    ext = jnp.where(jnp.isfinite(ext), ext, 0.0)
    s = (r - ext) * scale
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    lsum = jnp.sum(p, axis=-1, keepdims=True)
    # A row that sees no key is 0 with lse -inf; a NaN score (a NaN in q or k) makes the row NaN,
    # lse included, as torch's SDPA (it came out 0 / -inf, as if the row saw nothing).
    empty = lsum == 0
    safe = jnp.where(empty, 1.0, lsum)
    out = jnp.einsum("bhgqk,bhkd->bhgqd", p, vf, precision=hi) / safe
    out = jnp.where(empty, 0.0, out)
    lse = jnp.where(empty[..., 0], -jnp.inf, (ext[..., 0] * scale + m[..., 0]) + jnp.log(safe[..., 0]))
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)


@_jit("causal")
def attention(q, k, v, scale, causal):
    jnp = _jax().numpy
    out, lse = _attn(_acc(q), _acc(k), _acc(v), scale, causal)
    return out.astype(q.dtype), lse.astype(jnp.float32)


@_jit("ignore_index", "label_smoothing", "z_loss", "softcap")
def cross_entropy(logits, target, ignore_index, label_smoothing=0.0, z_loss=0.0, softcap=0.0):
    """Per-row loss (float32) and the gradient of their sum (logits' dtype);
    the options as tensor_ops.cross_entropy's (softcap 0: none)."""
    jax, jnp, _ = _mods()
    x = _acc(logits)
    if softcap:
        th = jnp.tanh(x / softcap)
        lg, dz = softcap * th, 1 - th * th
    else:
        lg, dz = x, 1.0
    C = lg.shape[1]
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    m = jnp.max(lg, axis=-1, keepdims=True)
    e = jnp.exp(lg - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lsum = jnp.log(s)[:, 0]
    lse = m[:, 0] + lsum
    picked = jnp.take_along_axis(lg, t[:, None], axis=1, mode="fill", fill_value=jnp.nan)[:, 0]
    # (m - picked) + log(sum), not lse - picked: at |m| past ~1e4 fp32's m + log(sum) rounds log(sum)
    # away (four equal logits of 1e8 gave 0 for log 4); the CPU kernel does the same in double.
    rows = (1 - label_smoothing) * ((m[:, 0] - picked) + lsum) + z_loss * lse * lse
    if label_smoothing:
        rows = rows + label_smoothing * ((m[:, 0] - jnp.mean(lg, axis=-1)) + lsum)
    loss = jnp.where(valid, rows, 0.0)
    grad = e / s * (1 + 2 * z_loss * lse)[:, None] - label_smoothing / C
    grad = (grad - (1 - label_smoothing) * jax.nn.one_hot(t, C, dtype=lg.dtype)) * dz
    grad = jnp.where(valid[:, None], grad, 0.0)
    return loss.astype(jnp.float32), grad


def _vjp(fn, primals, cotangent):
    """Gradients of fn at primals (computed in the accumulation dtype), each
    cast back to its primal's dtype."""
    jax = _jax()
    _, pullback = jax.vjp(fn, *[_acc(p) for p in primals])
    return tuple(g.astype(p.dtype) for g, p in zip(pullback(_acc(cotangent)), primals))


@_jit()
def rms_norm_backward(dy, x, w, eps, offset):
    return _vjp(lambda a, b: _rms(a, b + offset, eps), (x, w), dy)


@_jit("bias")
def layer_norm_backward(dy, x, w, eps, bias):
    jnp = _jax().numpy
    dx, dw = _vjp(lambda a, b: _ln(a, b, None, eps), (x, w), dy)
    db = jnp.sum(_acc(dy), axis=tuple(range(dy.ndim - 1))).astype(w.dtype) if bias else None  # 0 columns too
    return dx, dw, db


@_jit("act")
def act_backward(dy, x, act):
    return (_acc(dy) * _act_grad(_acc(x), act)).astype(x.dtype)


@_jit("act")
def glu_backward(dy, g, u, act):
    d, gf, uf = _acc(dy), _acc(g), _acc(u)
    return (d * uf * _act_grad(gf, act)).astype(g.dtype), (d * _act(gf, act)).astype(u.dtype)


@_jit("log")
def softmax_backward(dy, y, scale, log):
    jnp = _jax().numpy
    g, p = _acc(dy), _acc(y)
    if log:
        dx = scale * (g - jnp.exp(p) * jnp.sum(g, axis=-1, keepdims=True))
    else:
        dx = scale * p * (g - jnp.sum(g * p, axis=-1, keepdims=True))
    return dx.astype(y.dtype)


@_jit("causal")
def attention_backward(dout, q, k, v, scale, causal):
    # Recomputes the forward (the XLA way) instead of reading out and lse.
    return _vjp(lambda a, b, c: _attn(a, b, c, scale, causal)[0], (q, k, v), dout)
