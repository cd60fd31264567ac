"""Conformance of the LLM op set on every target (the CPU backend at every ISA
level this machine runs, then every other usable backend) x dtype x odd sizes
and edges, against float64 references; gradients against torch autograd in
float64. A backend without a kernel for an op is skipped with that reason."""
import math

import numpy as np
import pytest

import tensor_ops as to
from conftest import ATOL, DTYPES, FLOOR, RTOL, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu, to64, torch

HIDDEN = [1, 7, 64, 4095, 8193]


def make(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def ref_layer_norm(x, w, b, eps):
    x = to64(x)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    out = (x - mu) / np.sqrt(var + eps) * to64(w)
    return out + to64(b) if b is not None else out


def alignment(causal):
    """causal False / True (bottom-right) / "top_left" -> causal_alignment."""
    return "top_left" if causal == "top_left" else "bottom_right"


def ref_softmax(x, scale=1.0, causal=False, log=False):
    v = to64(x) * scale
    if causal:
        rows, cols = v.shape[-2:]
        i = np.arange(rows)[:, None]
        j = np.arange(cols)[None, :]
        v = np.where(j > i + (0 if causal == "top_left" else cols - rows), -np.inf, v)
    m = np.max(v, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(v - m)
    s = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (v - m - np.log(s)) if log else np.where(s > 0, e / s, 0)


def ref_attention(q, k, v, causal, scale):
    q, k, v = to64(q), to64(k), to64(v)
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
    s = q @ np.swapaxes(k, -1, -2) * scale
    p = ref_softmax(s, 1.0, causal)
    return p @ v


def ref_rope(x, cos, sin, pos, interleaved, inverse=False):
    x = to64(x).copy()
    c, s = to64(cos)[pos], to64(sin)[pos]  # [B or 1, S, half]
    c, s = c[:, :, None, :], s[:, :, None, :]
    if inverse:
        s = -s
    half = c.shape[-1]
    if interleaved:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = a * c - b * s, b * c + a * s
    return x


def ref_cross_entropy(logits, target, ignore_index=-100):
    lg = to64(logits)
    m = lg.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[:, 0]
    valid = target != ignore_index
    t = np.where(valid, target, 0)
    loss = np.where(valid, lse - lg[np.arange(len(t)), t], 0.0)
    p = np.exp(lg - lse[:, None])
    grad = p.copy()
    grad[np.arange(len(t)), t] -= 1
    grad[~valid] = 0
    return loss, grad, valid.sum()


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(hidden, dtype, target, rng):
    target.require("layer_norm")
    x, w, b = make(rng, (3, hidden), dtype, 3), make(rng, (hidden,), dtype), make(rng, (hidden,), dtype)
    assert_close(to.layer_norm(x, w, b, 1e-5), ref_layer_norm(x, w, b, 1e-5), dtype, "with bias")
    assert_close(to.layer_norm(x, w, None, 1e-5), ref_layer_norm(x, w, None, 1e-5), dtype, "no bias")


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(hidden, dtype, target, rng):
    target.require("add_rms_norm")
    x, r, w = make(rng, (2, 3, hidden), dtype), make(rng, (2, 3, hidden), dtype), make(rng, (hidden,), dtype)
    y, res = to.add_rms_norm(x, r, w, 1e-6)
    s = (to64(x) + to64(r)).astype(np.float32).astype(np_dtype(dtype))  # the stored residual
    assert_close(res, to64(s), dtype, "residual")
    assert_close(y, ref_rms_norm(s, w, 1e-6), dtype, "normed")


@pytest.mark.parametrize("shape", [(3, 1), (2, 7), (4, 64), (2, 4095), (1, 8193), (2, 3, 5, 9)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(shape, dtype, target, rng):
    target.require("softmax")
    x = make(rng, shape, dtype, 4)
    assert_close(to.softmax(x, scale=0.5), ref_softmax(x, 0.5), dtype, "softmax")
    assert_close(to.log_softmax(x), ref_softmax(x, log=True), dtype, "log_softmax")
    if len(shape) >= 2:
        assert_close(to.softmax(x, causal=True), ref_softmax(x, causal=True), dtype, "causal")
        assert_close(to.softmax(x, dim=0), np.moveaxis(ref_softmax(np.moveaxis(x, 0, -1)), -1, 0), dtype, "dim0")


def test_softmax_causal_fully_masked_rows(target):
    target.require("softmax")
    x = np.ones((4, 2), np.float32)  # 4 queries, 2 keys: rows 0, 1 see nothing
    y = to.softmax(x, causal=True)
    np.testing.assert_array_equal(y[:2], 0)
    np.testing.assert_allclose(y[3], [0.5, 0.5])


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["swiglu", "geglu", "geglu_tanh"])
def test_gated(act, hidden, dtype, target, rng):
    target.require("glu")
    g, u = make(rng, (3, hidden), dtype, 3), make(rng, (3, hidden), dtype)
    if act == "swiglu":
        got, ref = to.swiglu(g, u), ref_silu(g) * to64(u)
    else:
        approx = "tanh" if act == "geglu_tanh" else "none"
        got, ref = to.geglu(g, u, approx), ref_gelu(g, approx) * to64(u)
    assert_close(got, ref, dtype, act)


def rope_tables(max_pos, rot_dim, dtype):
    inv = 1.0 / 10000 ** (np.arange(0, rot_dim, 2) / rot_dim)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np_dtype(dtype)), np.sin(ang).astype(np_dtype(dtype))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(2, 5, 3, 8, 8), (1, 7, 2, 64, 32), (3, 1, 1, 6, 2), (1, 3, 5, 130, 128)])
def test_rope(dims, interleaved, dtype, target, rng):
    target.require("rope")
    B, S, H, D, R = dims
    x = make(rng, (B, S, H, D), dtype)
    cos, sin = rope_tables(S + 5, R, dtype)
    pos = rng.integers(0, S + 5, size=(B, S)).astype(np.int64)
    assert_close(to.rope(x, cos, sin, pos, interleaved), ref_rope(x, cos, sin, pos, interleaved), dtype, "rope")
    default = ref_rope(x, cos, sin, np.arange(S)[None, :], interleaved)
    assert_close(to.rope(x, cos, sin, interleaved=interleaved), default, dtype, "default positions")
    assert_close(to.rope(x, cos, sin, np.arange(S), interleaved), default, dtype, "1-d positions")
    back = to.rope_backward(x, cos, sin, pos, interleaved)
    assert_close(back, ref_rope(x, cos, sin, pos, interleaved, inverse=True), dtype, "inverse")


def test_rope_bad_position(target):
    target.require("rope")
    x = np.ones((1, 2, 1, 4), np.float32)
    cos, sin = rope_tables(3, 4, "float32")
    with pytest.raises(ValueError, match="position"):
        to.rope(x, cos, sin, np.array([[0, 5]]))
    with pytest.raises(ValueError, match="rotary_dim"):
        to.rope(x, *rope_tables(3, 6, "float32"))
    with pytest.raises(TypeError, match="int32 or int64"):
        to.rope(x, cos, sin, np.array([[0.0, 1.0]]))


@pytest.mark.parametrize("where", ["k", "q"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 2, 9, 11, 16), (1, 8, 2, 64, 300, 64), (1, 8, 2, 1, 300, 64)])
def test_attention_nan_reaches_the_rows_that_see_it(shape, where, dtype, target, rng):
    """A NaN in q or k makes every score of the rows that see it NaN, so
    those rows (and their lse) are NaN, as torch's SDPA gives; the others are
    as before. The CPU kernels dropped a NaN key (its probability masked to 0
    by a score > -inf test) and gave a NaN query's row 0 with lse -inf; the
    other backends' lse was -inf."""
    target.require("attention")
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = make(rng, (B, Hq, Lq, D), dtype), make(rng, (B, Hkv, Lk, D), dtype), make(rng, (B, Hkv, Lk, D), dtype)
    if where == "k":
        k[0, 1, Lk // 2, 3] = np.nan  # kv head 1: q heads Hq // Hkv .. 2 Hq // Hkv - 1 see it
        nan_heads = list(range(Hq // Hkv, 2 * Hq // Hkv))
    else:
        q[0, 2, Lq - 1, 0] = np.nan
        nan_heads = [2]
    for causal in (False, True):
        out, lse = to.attention(q, k, v, causal=causal, return_lse=True)
        out64 = to64(out)
        for h in range(Hq):
            rows = np.isnan(out64[0, h]).all(-1)
            if h not in nan_heads:
                assert not rows.any() and np.isfinite(lse[0, h]).all(), (causal, h)
                continue
            if where == "q":
                want = np.arange(Lq) == Lq - 1
            else:  # the rows whose causal window reaches key Lk // 2 (bottom-right)
                want = np.ones(Lq, bool) if not causal else (np.arange(Lq) + Lk - Lq >= Lk // 2)
            np.testing.assert_array_equal(rows, want, err_msg=f"causal {causal} head {h}")
            np.testing.assert_array_equal(np.isnan(lse[0, h]), want)
            assert np.isfinite(out64[0, h][~want]).all()


ATTN_SHAPES = [  # B, Hq, Hkv, Lq, Lk, D
    (1, 1, 1, 1, 1, 1),
    (2, 4, 2, 7, 9, 16),
    (1, 3, 3, 65, 65, 8),
    (1, 8, 1, 5, 130, 64),
    (2, 2, 2, 9, 4, 32),
    (1, 4, 2, 37, 300, 40),  # the amx level: two 256-key blocks, the second partial; head_dim padded to 64
]


@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention(shape, causal, dtype, target, rng):
    target.require("attention")
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = make(rng, (B, Hq, Lq, D), dtype), make(rng, (B, Hkv, Lk, D), dtype), make(rng, (B, Hkv, Lk, D), dtype)
    al = alignment(causal)
    out, lse = to.attention(q, k, v, causal=bool(causal), return_lse=True, causal_alignment=al)
    assert lse.dtype == np.float32 and lse.shape == (B, Hq, Lq)
    # Each output is a weighted mean of v's rows, which may cancel: the error
    # is measured against |v| (fp32: 2.0e-6 at an output of 0.0097, |v| up to 4.5).
    v_scale = float(np.max(np.abs(to64(v)), initial=0.0))
    assert_close(out, ref_attention(q, k, v, causal, 1 / math.sqrt(D)), dtype, "attention", scale=v_scale)
    assert_close(to.attention(q, k, v, bool(causal), scale=0.3, causal_alignment=al),
                 ref_attention(q, k, v, causal, 0.3), dtype, "scale", scale=v_scale)
    # a negative scale (the amx level folds only a positive one into its exp)
    assert_close(to.attention(q, k, v, bool(causal), scale=-0.2, causal_alignment=al),
                 ref_attention(q, k, v, causal, -0.2), dtype, "negative scale", scale=v_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 7, 4095, 8193])
def test_cross_entropy(C, dtype, target, rng):
    target.require("cross_entropy")
    N = 6
    logits = make(rng, (N, C), dtype, 3)
    target = rng.integers(0, C, size=N).astype(np.int64)
    target[2] = -100
    loss_rows, grad, n = ref_cross_entropy(logits, target)
    got = to.cross_entropy(logits, target)
    assert abs(float(got) - loss_rows.sum() / n) <= 1e-5 * abs(loss_rows.sum() / n) + 1e-6
    loss, dl = to.cross_entropy_with_grad(logits, target, reduction="mean")
    assert_close(dl, grad / n, dtype, "dlogits")
    rows, _ = to.cross_entropy_with_grad(logits, target.astype(np.int32), reduction="none")
    assert_close(rows, loss_rows, "float32", "per row")
    with pytest.raises(ValueError, match="target"):
        bad = target.copy()
        bad[0] = C
        to.cross_entropy(logits, bad)


# ---- gradients vs torch autograd (float64) ---------------------------------

needs_torch = pytest.mark.skipif(torch is None, reason="gradient references use torch autograd")


def t64(a):
    return torch.tensor(to64(a), dtype=torch.float64, requires_grad=True)


def grad_close(got, ref_tensor, dtype, what, factor=4, scale=None):
    # Gradients mix several rounded terms: four times the forward tolerance;
    # scale: the magnitude of those terms where they cancel (default max |ref|).
    ref = ref_tensor.detach().numpy()
    got64 = to64(got)
    if scale is None:
        scale = float(np.max(np.abs(ref), initial=0.0))
    # max(scale, 1): inputs are O(1), so cancellation leaves O(eps) absolute error.
    tol = factor * (RTOL[dtype] * np.abs(ref) + ATOL[dtype] * max(scale, 1.0)) + FLOOR[dtype]
    bad = ~(np.abs(got64 - ref) <= tol)
    assert not bad.any(), f"{what}: {bad.sum()} of {ref.size} off; max err {np.max(np.abs(got64 - ref)):.3g}"


@needs_torch
@pytest.mark.parametrize("hidden", [1, 7, 4095])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_grads(hidden, dtype, target, rng):
    target.require("rms_norm_backward", "layer_norm_backward")
    F = torch.nn.functional
    x, w, b, dy = (make(rng, s, dtype) for s in [(3, hidden), (hidden,), (hidden,), (3, hidden)])
    tx, tw = t64(x), t64(w)
    F.rms_norm(tx, (hidden,), tw, 1e-6).backward(torch.tensor(to64(dy)))
    dx, dw = to.rms_norm_backward(dy, x, w, 1e-6)
    # dx = (w dy - y mean(w dy y)) / rms: terms of size |w dy| / rms cancel
    # (hidden 1, x = -0.030: terms ~60, dx -0.068, fp32 error 8e-6).
    rms = np.sqrt(np.mean(to64(x) ** 2, axis=-1, keepdims=True) + 1e-6)
    terms = float(np.max(np.abs(to64(w) * to64(dy)) / rms, initial=0.0))
    grad_close(dx, tx.grad, dtype, "rms dx", scale=max(terms, float(np.max(np.abs(tx.grad.numpy()), initial=0.0))))
    grad_close(dw, tw.grad, dtype, "rms dw")
    tx, tw, tb = t64(x), t64(w), t64(b)
    F.layer_norm(tx, (hidden,), tw, tb, 1e-5).backward(torch.tensor(to64(dy)))
    dx, dw, db = to.layer_norm_backward(dy, x, w, 1e-5)
    grad_close(dx, tx.grad, dtype, "ln dx")
    grad_close(dw, tw.grad, dtype, "ln dw")
    grad_close(db, tb.grad, dtype, "ln db")


@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_and_gated_grads(dtype, target, rng):
    target.require("activation_backward", "glu_backward")
    F = torch.nn.functional
    x, u, dy = (make(rng, (5, 77), dtype, 3) for _ in range(3))
    for name, f, ours in [
        ("silu", F.silu, lambda: to.silu_backward(dy, x)),
        ("gelu", F.gelu, lambda: to.gelu_backward(dy, x)),
        ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"), lambda: to.gelu_backward(dy, x, "tanh")),
    ]:
        tx = t64(x)
        f(tx).backward(torch.tensor(to64(dy)))
        grad_close(ours(), tx.grad, dtype, name)
    for name, f, ours in [
        ("swiglu", F.silu, lambda: to.swiglu_backward(dy, x, u)),
        ("geglu", F.gelu, lambda: to.geglu_backward(dy, x, u)),
    ]:
        tg, tu = t64(x), t64(u)
        (f(tg) * tu).backward(torch.tensor(to64(dy)))
        dg, du = ours()
        grad_close(dg, tg.grad, dtype, name + " dgate")
        grad_close(du, tu.grad, dtype, name + " dup")


@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_grads(dtype, target, rng):
    target.require("softmax", "softmax_backward")
    x, dy = make(rng, (4, 33), dtype, 2), make(rng, (4, 33), dtype)
    for log in [False, True]:
        tx = t64(x)
        (torch.log_softmax(0.7 * tx, -1) if log else torch.softmax(0.7 * tx, -1)).backward(torch.tensor(to64(dy)))
        y = to.log_softmax(x, scale=0.7) if log else to.softmax(x, scale=0.7)
        dx = to.log_softmax_backward(dy, y, scale=0.7) if log else to.softmax_backward(dy, y, scale=0.7)
        grad_close(dx, tx.grad, dtype, f"log={log}")


@needs_torch
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES[1:5])
def test_attention_grads(shape, causal, dtype, target, rng):
    target.require("attention", "attention_backward")
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = make(rng, (B, Hq, Lq, D), dtype), make(rng, (B, Hkv, Lk, D), dtype), make(rng, (B, Hkv, Lk, D), dtype)
    do = make(rng, (B, Hq, Lq, D), dtype)
    al = alignment(causal)
    out, lse = to.attention(q, k, v, causal=bool(causal), return_lse=True, causal_alignment=al)
    dq, dk, dv = to.attention_backward(do, q, k, v, out, lse, causal=bool(causal), causal_alignment=al)
    tq, tk, tv = t64(q), t64(k), t64(v)
    g = Hq // Hkv
    s = tq @ tk.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(D)
    if causal:
        mask = torch.ones(Lq, Lk, dtype=torch.bool).tril(0 if causal == "top_left" else Lk - Lq)
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))
    (p @ tv.repeat_interleave(g, 1)).backward(torch.tensor(to64(do)))
    # The backward reads the stored (rounded) out, as flash attention does;
    # in 16-bit that rounding reaches the gradients: a wider margin there.
    f = 4 if dtype == "float32" else 12
    grad_close(dq, tq.grad, dtype, "dq", f)
    grad_close(dk, tk.grad, dtype, "dk", f)
    grad_close(dv, tv.grad, dtype, "dv", f)


def test_op_errors():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="kv heads"):
        to.attention(np.ones((1, 3, 2, 4), np.float32), np.ones((1, 2, 2, 4), np.float32),
                     np.ones((1, 2, 2, 4), np.float32))
    with pytest.raises(ValueError, match=r"\[batch, heads, seq, head_dim\]"):
        to.attention(x, x, x)
    with pytest.raises(TypeError):
        to.swiglu(x, x.astype(np.float16))
    with pytest.raises(ValueError, match="shape"):
        to.swiglu(x, np.ones((2, 9), np.float32))
    with pytest.raises(ValueError, match="reduction"):
        to.cross_entropy(x, np.zeros(2, np.int64), reduction="avg")
    with pytest.raises(TypeError, match="int32 or int64"):
        to.cross_entropy(x, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="dim"):
        to.softmax(x, dim=5)
    with pytest.raises(ValueError, match="bias"):
        to.layer_norm(x, np.ones(8, np.float32), np.ones(7, np.float32))
    with pytest.raises(ValueError, match="eps"):
        to.layer_norm(x, np.ones(8, np.float32), eps=-1.0)


@pytest.mark.parametrize("op", ["layer_norm", "softmax", "swiglu", "attention", "cross_entropy", "add_rms_norm"])
def test_empty_inputs(op, target):
    e = np.ones((0, 8), np.float32)
    w = np.ones(8, np.float32)
    if op == "layer_norm":
        assert to.layer_norm(e, w).shape == (0, 8)
    elif op == "softmax":
        assert to.softmax(e).shape == (0, 8)
    elif op == "swiglu":
        assert to.swiglu(e, e).shape == (0, 8)
    elif op == "add_rms_norm":
        y, r = to.add_rms_norm(e, e, w)
        assert y.shape == r.shape == (0, 8)
    elif op == "attention":
        q = np.ones((1, 2, 0, 4), np.float32)
        assert to.attention(q, np.ones((1, 2, 3, 4), np.float32), np.ones((1, 2, 3, 4), np.float32)).shape == q.shape
    else:
        loss, dl = to.cross_entropy_with_grad(e, np.zeros(0, np.int64), reduction="sum")
        assert float(loss) == 0 and dl.shape == (0, 8)
