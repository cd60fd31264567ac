"""Cross-entropy's options on every target (CPU ISA levels, then every other
usable backend) x dtype: label_smoothing (torch's), z_loss (PaLM), logit
softcapping (Gemma 2) and the in-place gradient, against a float64 reference
that is itself checked against torch autograd; edges: vocab 1, every target
ignored, no rows, odd vocab sizes, huge and -inf logits."""
import numpy as np
import pytest

import tensor_ops as to
from conftest import ATOL, DTYPES, FLOOR, RTOL, assert_close, np_dtype, to64, torch

OPTIONS = [
    dict(),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(softcap=3.0),
    dict(label_smoothing=0.2, z_loss=1e-2, softcap=5.0),
]
OPTION_IDS = ["plain", "smooth", "zloss", "softcap", "all"]


def make(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def ref_ce(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Per-row loss and d(loss row)/d(logits), float64, written out by hand."""
    x = to64(logits)
    N, C = x.shape
    if softcap:
        th = np.tanh(x / softcap)
        z, dz = softcap * th, 1 - th * th
    else:
        z, dz = x, np.ones_like(x)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = z.max(-1, keepdims=True) if C else np.zeros((N, 1))
        lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
        valid = target != ignore_index
        t = np.where(valid, target, 0)
        zt = z[np.arange(N), t]
        loss = (1 - label_smoothing) * (lse - zt) + z_loss * lse * lse
        if label_smoothing:
            loss = loss + label_smoothing * (lse - z.mean(-1))
        p = np.exp(z - lse[:, None])
        g = p * (1 + 2 * z_loss * lse)[:, None] - label_smoothing / C
        g[np.arange(N), t] -= 1 - label_smoothing
        g *= dz
    loss = np.where(valid, loss, 0.0)
    g[~valid] = 0
    return loss, g, int(valid.sum())


def grad_close(got, ref, dtype, what):
    """assert_close with an absolute floor of ATOL: a gradient element is a
    difference of O(1) terms (p - 1), so fp32 leaves O(eps) absolute error
    even where the result is small."""
    got64 = to64(got)
    assert got64.shape == ref.shape, f"{what}: shape {got64.shape} != {ref.shape}"
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1.0)
    bad = ~(np.abs(got64 - ref) <= RTOL[dtype] * np.abs(ref) + ATOL[dtype] * scale + FLOOR[dtype])
    assert not bad.any(), f"{what}: {bad.sum()} of {ref.size} off; max err {np.max(np.abs(got64 - ref)):.3g}"


def call(target, fn, *args, **kw):
    """fn(*args, **kw); a backend that refuses the options must say so clearly (then skipped with that reason)."""
    try:
        return fn(*args, **kw)
    except to.UnsupportedError as e:
        if target.backend != "cpu" and "does not implement label_smoothing" in str(e):
            pytest.skip(f"{target.backend}: {e}")
        raise


@pytest.mark.parametrize("opts", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 7, 33, 4095, 8193])
def test_options(C, dtype, opts, target, rng):
    target.require("cross_entropy")
    N = 7
    logits = make(rng, (N, C), dtype, 3)
    tg = rng.integers(0, C, size=N).astype(np.int64)
    tg[2] = -100
    rows_ref, grad_ref, n = ref_ce(logits, tg, **opts)
    rows = call(target, to.cross_entropy, logits, tg, reduction="none", **opts)
    assert_close(rows, rows_ref, "float32", "loss rows")
    mean = call(target, to.cross_entropy, logits, tg, **opts)
    assert abs(float(mean) - rows_ref.sum() / n) <= 1e-5 * abs(rows_ref.sum() / n) + 1e-6
    loss, dl = call(target, to.cross_entropy_with_grad, logits, tg.astype(np.int32), reduction="sum", **opts)
    grad_close(dl, grad_ref, dtype, "dlogits (sum)")
    assert abs(float(loss) - rows_ref.sum()) <= 1e-5 * abs(rows_ref.sum()) + 1e-5
    # In place: the gradient lands in the logits' own buffer; under the XLA
    # shim a host buffer is written back, an XLA array (immutable) is refused.
    buf = logits.copy()
    if target.backend == "xla":
        jnp = pytest.importorskip("jax.numpy")
        with pytest.raises(to.UnsupportedError, match="immutable"):
            to.cross_entropy_with_grad(jnp.asarray(buf), tg, inplace=True, **opts)
    loss_i, dl_i = call(target, to.cross_entropy_with_grad, buf, tg, reduction="mean", inplace=True, **opts)
    assert dl_i is buf
    grad_close(buf, grad_ref / n, dtype, "dlogits (in place, mean)")
    assert float(loss_i) == pytest.approx(float(mean), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("opts", OPTIONS, ids=OPTION_IDS)
def test_edges(opts, target, rng):
    target.require("cross_entropy")
    # every target ignored: the mean is NaN (as torch's), the gradient zero
    x = make(rng, (4, 9), "float32")
    ign = np.full(4, -100, np.int64)
    loss, dl = call(target, to.cross_entropy_with_grad, x, ign, **opts)
    assert np.isnan(float(loss)) and not np.asarray(dl).any()
    assert float(call(target, to.cross_entropy, x, ign, reduction="sum", **opts)) == 0
    # no rows
    loss, dl = call(target, to.cross_entropy_with_grad, np.ones((0, 9), np.float32), np.zeros(0, np.int64),
                    reduction="sum", **opts)
    assert float(loss) == 0 and dl.shape == (0, 9)
    # huge logits (1e4), and -inf logits away from the target
    x = make(rng, (5, 37), "float32") * np.float32(1e4)
    if "label_smoothing" not in opts:  # a -inf logit makes the smoothed loss +inf, as in torch
        x[:, 5:9] = -np.inf
    tg = np.array([0, 1, 36, 20, 3], np.int64)
    rows_ref, grad_ref, _ = ref_ce(x, tg, **opts)
    rows, dl = call(target, to.cross_entropy_with_grad, x, tg, reduction="none", **opts)
    assert_close(rows, rows_ref, "float32", "huge loss rows")
    grad_close(dl, grad_ref, "float32", "huge dlogits")


def test_vocab_one(target):
    target.require("cross_entropy")
    x = np.array([[2.5], [-1.0]], np.float32)
    tg = np.zeros(2, np.int64)
    for opts in OPTIONS:
        rows_ref, grad_ref, _ = ref_ce(x, tg, **opts)
        rows, dl = call(target, to.cross_entropy_with_grad, x, tg, reduction="none", **opts)
        assert_close(rows, rows_ref, "float32", f"vocab 1 {opts}")
        grad_close(dl, grad_ref, "float32", f"vocab 1 dlogits {opts}")


@pytest.mark.parametrize("bad", [dict(label_smoothing=-0.1), dict(label_smoothing=1.5), dict(z_loss=-1.0),
                                 dict(z_loss=float("inf")), dict(softcap=0.0), dict(softcap=-2.0)])
def test_bad_options(bad):
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=next(iter(bad))):
        to.cross_entropy(x, np.zeros(2, np.int64), **bad)


def test_bad_option_types():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="label_smoothing"):
        to.cross_entropy(x, np.zeros(2, np.int64), label_smoothing="0.1")
    with pytest.raises(TypeError, match="inplace"):
        to.cross_entropy_with_grad(x, np.zeros(2, np.int64), inplace=1)


@pytest.mark.skipif(torch is None, reason="the reference is checked against torch autograd")
@pytest.mark.parametrize("opts", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_is_torch(opts, reduction, rng):
    """The float64 reference above against torch autograd (F.cross_entropy with
    label_smoothing, the z-loss and softcap written as torch expressions)."""
    F = torch.nn.functional
    N, C = 6, 11
    x = make(rng, (N, C), "float32", 3)
    tg = rng.integers(0, C, size=N).astype(np.int64)
    tg[1] = -100
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tt = torch.tensor(tg)
    cap = opts.get("softcap")
    z = cap * torch.tanh(xt / cap) if cap else xt
    rows = F.cross_entropy(z, tt, ignore_index=-100, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0))
    rows = rows + opts.get("z_loss", 0.0) * torch.logsumexp(z, -1) ** 2 * (tt != -100)
    n = int((tg != -100).sum())
    out = rows.sum() / n if reduction == "mean" else rows.sum() if reduction == "sum" else rows
    (out if reduction != "none" else out.sum()).backward()
    rows_ref, grad_ref, _ = ref_ce(x, tg, **opts)
    np.testing.assert_allclose(rows.detach().numpy(), rows_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(xt.grad.numpy(), grad_ref / (n if reduction == "mean" else 1), rtol=1e-10, atol=1e-12)
    # and ours against torch's loss for the plain and smoothed cases through F.cross_entropy itself
    got = to.cross_entropy(x, tg, reduction=reduction, **opts)
    assert_close(np.asarray(got, np.float64).reshape(np.shape(out.detach().numpy())), out.detach().numpy(),
                 "float32", "vs torch")


def test_inplace_torch_and_bf16(rng):
    if torch is None:
        pytest.skip("needs torch")
    x = torch.randn(5, 130, dtype=torch.bfloat16) * 2
    tg = torch.randint(0, 130, (5,))
    ref = x.double().requires_grad_()
    torch.nn.functional.cross_entropy(ref, tg, label_smoothing=0.1).backward()
    buf = x.clone()
    loss, dl = to.cross_entropy_with_grad(buf, tg, label_smoothing=0.1, inplace=True)
    assert dl is buf
    grad_close(buf, ref.grad.numpy(), "bfloat16", "torch bf16 in place")


def test_in_place_writes_are_seen_by_autograd():
    """An in-place write into a torch tensor (out=, cross_entropy_with_grad's
    inplace=True) counts in its version, as torch's own in-place ops: a graph
    that saved the tensor refuses to backpropagate (it used the overwritten
    values silently); logits that require grad are refused for inplace=True."""
    if torch is None:
        pytest.skip("torch is not installed")
    w, x = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    y = (w * x).sum()
    to.silu(torch.randn(3, 5), out=x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    logits = torch.randn(3, 5)
    y = (w * logits).sum()
    to.cross_entropy_with_grad(logits, torch.tensor([0, 1, 2]), inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    leaf = torch.randn(3, 5, requires_grad=True)
    before = leaf.detach().clone()
    with pytest.raises(to.InvalidArgumentError, match=r"inplace=True.*\(3, 5\).*require grad"):
        to.cross_entropy_with_grad(leaf, torch.tensor([0, 1, 2]), inplace=True)
    assert torch.equal(leaf.detach(), before)


def test_huge_logits_keep_log_sum(target):
    """Four equal logits of 1e15 / 1e19 / 1e20: the loss is log 4, label
    smoothing or not, as torch's fp32 gives; the CPU kernel's
    (m + log(sum)) - z lost log(sum) to m's rounding even in double (0 at
    1e19, 1.375 at 1e15), and label smoothing's term did the same."""
    for big in (1e15, 1e19, 1e20):
        logits = np.full((2, 4), big, np.float32)
        for ls in (0.0, 0.1):
            got = call(target, to.cross_entropy, logits, np.array([1, 3]), label_smoothing=ls, reduction="none")
            np.testing.assert_allclose(np.asarray(got, np.float64), [np.log(4)] * 2, rtol=1e-6)
