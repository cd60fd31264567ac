"""Property-based tests (hypothesis): for every op, over shapes, strides
(negative, zero, overlapping, padded, transposed), dtypes, torch's view bits
and arguments (good and bad), the answer is the float64 reference's or a
tensor_ops error (a TensorOpsError subclass): never a crash, another
exception type or a silently wrong answer. The example count is bounded for
CI (TENSOR_OPS_HYPOTHESIS_EXAMPLES, default 60 per op)."""
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tensor_ops  # noqa: E402
from conftest import ATOL, FLOOR, RTOL, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu, to64, torch  # noqa: E402
from test_ops_llm import ref_attention, ref_cross_entropy, ref_layer_norm, ref_rope, ref_softmax  # noqa: E402

EXAMPLES = int(os.environ.get("TENSOR_OPS_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

LAYOUTS = ["contiguous", "reversed", "step2", "broadcast", "overlapping", "transposed"]
DTYPES = ["float32", "float16", "bfloat16"]


def layout(values64, dtype, kind):
    """An array holding values64 (as dtype) laid out as `kind`, and the values
    it holds (a broadcast or overlapping view holds fewer distinct ones)."""
    base = values64.astype(np.float32).astype(np_dtype(dtype))
    shape = base.shape
    if kind == "reversed" and base.ndim:
        return np.ascontiguousarray(base[..., ::-1])[..., ::-1]
    if kind == "step2" and base.ndim:
        wide = np.zeros(shape[:-1] + (2 * shape[-1],), base.dtype)
        wide[..., ::2] = base
        return wide[..., ::2]
    if kind == "broadcast" and base.ndim >= 2:
        return np.broadcast_to(base[:1], shape)
    if kind == "overlapping" and base.ndim >= 2 and shape[-1] >= 2:
        flat = np.ascontiguousarray(base).reshape(-1)
        rows = int(np.prod(shape[:-1]))
        strides = [0] * (len(shape) - 2) + [base.itemsize, base.itemsize]
        need = rows + shape[-1] - 1
        flat = np.resize(flat, max(need, 1))
        if len(shape) > 2:  # keep it simple: overlap only the last two dims
            return np.broadcast_to(np.lib.stride_tricks.as_strided(flat, shape[-2:], strides[-2:]), shape)
        return np.lib.stride_tricks.as_strided(flat, shape, strides)
    if kind == "transposed" and base.ndim >= 2:
        return np.asfortranarray(base)
    return base


def close_abs(got, ref, dtype, what):
    """Gradients and losses mix rounded O(1) terms, so cancellation leaves an
    O(eps) absolute error however small the result: four times the forward
    tolerance, against max(|ref|, 1) (as grad_close in test_ops_llm)."""
    got64 = to64(got)
    assert got64.shape == ref.shape, f"{what}: shape {got64.shape} != {ref.shape}"
    scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0))
    tol = 4 * (RTOL[dtype] * np.abs(ref) + ATOL[dtype] * max(scale, 1.0)) + FLOOR[dtype]
    bad = ~(np.abs(got64 - ref) <= tol) & ~(np.isnan(got64) & np.isnan(ref))
    assert not bad.any(), f"{what}: {bad.sum()} of {ref.size} off; max err {np.max(np.abs(got64 - ref)):.3g}"


def check(fn, ref, dtype, what, absolute=False):
    """fn() equals ref() (each a tuple of arrays) or raises a TensorOpsError."""
    try:
        got = fn()
    except tensor_ops.TensorOpsError:
        return
    want = ref()
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            continue
        (close_abs if absolute else assert_close)(g, np.asarray(w, np.float64), dtype, f"{what} output {i}")


shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple)
scalars = st.one_of(st.floats(-4, 4, allow_nan=False), st.sampled_from([0.0, 1e-6, -1.0, float("nan"), float("inf")]),
                    st.integers(-3, 3), st.sampled_from(["2", None, True, 1 + 2j]))


def vals(draw, shape, lo=-4.0, hi=4.0):
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return np.random.default_rng(seed).uniform(lo, hi, shape)


@SETTINGS
@given(st.data(), st.sampled_from(["rms_norm", "layer_norm", "silu", "gelu", "gelu_tanh", "softmax", "log_softmax",
                                   "swiglu", "geglu", "add_rms_norm"]),
       st.sampled_from(DTYPES), shapes, st.sampled_from(LAYOUTS))
def test_row_ops(data, op, dtype, shape, kind):
    draw = data.draw
    x = layout(vals(draw, shape), dtype, kind)
    w = layout(vals(draw, shape[-1:], 0.5, 2.0), dtype, "contiguous")
    y = layout(vals(draw, shape), dtype, draw(st.sampled_from(LAYOUTS)))
    eps = draw(st.one_of(st.just(1e-6), scalars))
    if op == "rms_norm":
        check(lambda: tensor_ops.rms_norm(x, w, eps), lambda: ref_rms_norm(x, w, eps), dtype, op)
    elif op == "layer_norm":
        check(lambda: tensor_ops.layer_norm(x, w, y[..., 0, :] if len(shape) > 1 else w, eps),
              lambda: ref_layer_norm(x, w, y[..., 0, :] if len(shape) > 1 else w, eps), dtype, op)
    elif op == "silu":
        check(lambda: tensor_ops.silu(x), lambda: ref_silu(x), dtype, op)
    elif op in ("gelu", "gelu_tanh"):
        a = "tanh" if op == "gelu_tanh" else draw(st.sampled_from(["none", "none", "erf", None, 0]))
        check(lambda: tensor_ops.gelu(x, approximate=a), lambda: ref_gelu(x, a), dtype, op)
    elif op in ("softmax", "log_softmax"):
        dim = draw(st.one_of(st.integers(-4, 3), st.sampled_from([np.int64(-1), 1.0, "0"])))
        scale = draw(st.one_of(st.just(1.0), scalars))
        causal = draw(st.sampled_from([False, True, "False", 0]))
        fn = getattr(tensor_ops, op)

        def ref():
            x64 = np.moveaxis(to64(x), dim, -1)
            if x64.size == 0:
                return np.moveaxis(x64, -1, dim)
            return np.moveaxis(ref_softmax(x64, scale, causal, op == "log_softmax"), -1, dim)

        check(lambda: fn(x, dim, scale, causal), ref, dtype, op)
    elif op == "swiglu":
        check(lambda: tensor_ops.swiglu(x, y), lambda: ref_silu(x) * to64(y), dtype, op)
    elif op == "geglu":
        check(lambda: tensor_ops.geglu(x, y), lambda: ref_gelu(x) * to64(y), dtype, op)
    else:
        check(lambda: tensor_ops.add_rms_norm(x, y, w, eps),
              lambda: (ref_rms_norm(to64(x) + to64(y), w, eps), to64(x) + to64(y)), dtype, op)


@SETTINGS
@given(st.data(), st.sampled_from(DTYPES), st.integers(0, 3), st.integers(1, 3), st.integers(0, 5),
       st.integers(0, 5), st.sampled_from([1, 2, 3, 8]), st.sampled_from([1, 2]))
def test_attention(data, dtype, batch, kv_heads, lq, lk, head_dim, group):
    draw = data.draw
    q = layout(vals(draw, (batch, kv_heads * group, lq, head_dim)), dtype, draw(st.sampled_from(LAYOUTS)))
    k = layout(vals(draw, (batch, kv_heads, lk, head_dim)), dtype, "contiguous")
    v = layout(vals(draw, (batch, kv_heads, lk, head_dim)), dtype, draw(st.sampled_from(LAYOUTS)))
    causal = draw(st.sampled_from([False, True, "True"]))
    scale = draw(st.one_of(st.none(), scalars))
    s = 1.0 / np.sqrt(head_dim) if scale is None else scale
    def ref():
        if q.size == 0 or lk == 0:  # no visible key: zeros (documented in tensor_ops.attention)
            return np.zeros(q.shape)
        return ref_attention(q, k, v, causal, s)

    check(lambda: tensor_ops.attention(q, k, v, causal, scale), ref, dtype, "attention")


@SETTINGS
@given(st.data(), st.sampled_from(DTYPES), st.integers(0, 6), st.integers(1, 7),
       st.sampled_from([-100, 0, 2, 1.5, "x"]))
def test_cross_entropy(data, dtype, n, c, ignore_index):
    draw = data.draw
    logits = layout(vals(draw, (n, c)), dtype, draw(st.sampled_from(LAYOUTS)))
    target = np.array(draw(st.lists(st.sampled_from(list(range(c)) + [-100, 2]), min_size=n, max_size=n)), np.int64)

    def ref():
        if isinstance(ignore_index, (str, float)):  # refused before the data is read
            raise AssertionError(f"ignore_index={ignore_index!r} was accepted")
        if ((target < 0) | (target >= c))[target != ignore_index].any():
            raise AssertionError("an out-of-range target was accepted")
        loss, _, _ = ref_cross_entropy(logits, target, ignore_index)
        return (loss,)

    check(lambda: tensor_ops.cross_entropy(logits, target, ignore_index, "none"), ref, "float32", "cross_entropy",
          absolute=True)


@SETTINGS
@given(st.data(), st.sampled_from(DTYPES), st.integers(0, 2), st.integers(0, 4), st.integers(1, 3),
       st.sampled_from([2, 4, 6]), st.booleans())
def test_rope(data, dtype, batch, seq, heads, head_dim, interleaved):
    draw = data.draw
    x = layout(vals(draw, (batch, seq, heads, head_dim)), dtype, draw(st.sampled_from(LAYOUTS)))
    half = draw(st.integers(1, head_dim // 2))
    ang = vals(draw, (8, half), 0, 6.3)
    cos, sin = np.cos(ang).astype(np_dtype(dtype)), np.sin(ang).astype(np_dtype(dtype))
    pos = np.array(draw(st.lists(st.integers(0, 9), min_size=seq, max_size=seq)), np.int64)

    def ref():
        if x.size == 0:  # nothing to compute, nothing read
            return to64(x)
        if (pos >= 8).any():
            raise AssertionError("a position past the table was accepted")
        return ref_rope(x, cos, sin, pos[None, :], interleaved)

    check(lambda: tensor_ops.rope(x, cos, sin, pos, interleaved), ref, dtype, "rope")


needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def torch_view(t, kind):
    """t (a torch tensor) as a view of kind, and the values the view holds."""
    if kind == "neg":
        return torch._neg_view(-t)  # holds t's values behind the negative bit
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "expanded" and t.dim() >= 2:
        return t[:1].expand(t.shape)
    if kind == "step2" and t.dim() >= 1:
        wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


@needs_torch
@SETTINGS
@given(st.data(), st.sampled_from(["rms_norm", "silu", "gelu", "softmax", "swiglu", "layer_norm", "rms_norm_backward",
                                   "silu_backward", "softmax_backward", "swiglu_backward"]),
       st.sampled_from(DTYPES), shapes, st.sampled_from(["plain", "neg", "transposed", "expanded", "step2"]))
def test_torch_views_and_backwards(data, op, dtype, shape, kind):
    """torch tensors with view bits and strides, forward ops and backward ops
    against torch's own float64 autograd."""
    draw = data.draw
    F = torch.nn.functional
    dt = getattr(torch, TORCH_DTYPES[dtype])
    mk = lambda s, lo=-3.0, hi=3.0: torch.from_numpy(vals(draw, s, lo, hi)).to(dt)  # noqa: E731
    x, y, w = mk(shape), mk(shape), mk(shape[-1:], 0.5, 2.0)
    xv, yv = torch_view(x.clone(), kind), torch_view(y.clone(), draw(st.sampled_from(["plain", "neg", "step2"])))
    x, y = xv.resolve_neg().to(torch.float64), yv.resolve_neg().to(torch.float64)  # the values the views hold
    w64 = w.to(torch.float64)
    n = shape[-1]
    fwd = {
        "rms_norm": (lambda: tensor_ops.rms_norm(xv, w), lambda: F.rms_norm(x, (n,), w64, 1e-6)),
        "layer_norm": (lambda: tensor_ops.layer_norm(xv, w), lambda: F.layer_norm(x, (n,), w64, None, 1e-5)),
        "silu": (lambda: tensor_ops.silu(xv), lambda: F.silu(x)),
        "gelu": (lambda: tensor_ops.gelu(xv), lambda: F.gelu(x)),
        "softmax": (lambda: tensor_ops.softmax(xv), lambda: torch.softmax(x, -1)),
        "swiglu": (lambda: tensor_ops.swiglu(xv, yv), lambda: F.silu(x) * y),
    }
    if op in fwd:
        ours, ref = fwd[op]
        check(ours, lambda: ref().numpy(), dtype, op)
        return
    xg = x.clone().requires_grad_(True)
    if op == "rms_norm_backward":
        wg = w64.clone().requires_grad_(True)
        F.rms_norm(xg, (n,), wg, 1e-6).backward(y)
        check(lambda: tensor_ops.rms_norm_backward(yv, xv, w), lambda: (xg.grad.numpy(), wg.grad.numpy()), dtype, op,
              absolute=True)
    elif op == "silu_backward":
        F.silu(xg).backward(y)
        check(lambda: tensor_ops.silu_backward(yv, xv), lambda: xg.grad.numpy(), dtype, op, absolute=True)
    elif op == "softmax_backward":
        p = torch.softmax(x, -1)
        pv = torch_view(p.to(dt), kind)
        p64 = pv.resolve_neg().to(torch.float64)
        ref = p64 * (y - (y * p64).sum(-1, keepdim=True))
        check(lambda: tensor_ops.softmax_backward(yv, pv), lambda: ref.numpy(), dtype, op, absolute=True)
    else:
        ug = y.clone().requires_grad_(True)
        dy = mk(shape)
        (F.silu(xg) * ug).backward(dy.to(torch.float64))
        check(lambda: tensor_ops.swiglu_backward(dy, xv, yv), lambda: (xg.grad.numpy(), ug.grad.numpy()), dtype, op,
              absolute=True)
