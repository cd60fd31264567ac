"""fused_linear_cross_entropy (numpy and torch) against float64 torch:
F.linear then F.cross_entropy, autograd."""
import tracemalloc

import numpy as np
import pytest

import tensor_ops
from tensor_ops import linear_cross_entropy as lce

torch = pytest.importorskip("torch")
F = torch.nn.functional
tt = pytest.importorskip("tensor_ops.torch")
from tensor_ops.torch import linear_cross_entropy as tlce  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402


def _data(rng, n=37, h=16, v=50, bias=True, ignored=(3, 11)):
    hidden = rng.standard_normal((n, h)).astype(np.float32)
    weight = (rng.standard_normal((v, h)) * 0.3).astype(np.float32)
    b = rng.standard_normal(v).astype(np.float32) if bias else None
    target = rng.integers(0, v, n)
    target[[i for i in ignored if i < n]] = -100
    return hidden, weight, target, b


def _reference(hidden, weight, target, bias, reduction, dloss=None, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """float64 (loss, grad_hidden, grad_weight, grad_bias) of sum(loss * dloss):
    F.linear then F.cross_entropy, with the cross-entropy options as torch
    expressions (softcap on the logits first, z_loss * logsumexp^2 on rows that
    count)."""
    h = torch.tensor(hidden, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    b = None if bias is None else torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    t = torch.as_tensor(target)
    z = F.linear(h, w, b)
    z = softcap * torch.tanh(z / softcap) if softcap else z
    rows = F.cross_entropy(z, t, reduction="none", label_smoothing=label_smoothing)
    rows = rows + z_loss * torch.logsumexp(z, -1) ** 2 * (t != -100)
    loss = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / (t != -100).sum()}[reduction]
    g = torch.ones_like(loss) if dloss is None else torch.as_tensor(dloss, dtype=torch.float64)
    if h.shape[0]:
        (loss * g).sum().backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (h, w) + (() if b is None else (b,))]
    return [loss.detach().numpy()] + [t.numpy() for t in grads] + ([None] if b is None else [])


def _close(got, ref, what, rtol=1e-5):
    """Within the issue's 1e-5 (fp32): relative to the reference's largest entry."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, what
    scale = max(np.abs(ref).max(initial=0.0), 1e-30)
    assert np.abs(got - ref).max(initial=0.0) <= rtol * scale, f"{what}: max error {np.abs(got - ref).max()}"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_torch_matches_float64(rng, reduction, bias, chunk_size):
    hidden, weight, target, b = _data(rng, bias=bias)
    ref_dloss = rng.standard_normal(len(target)) if reduction == "none" else 1.7
    want = _reference(hidden, weight, target, b, reduction, ref_dloss)
    h, w = torch.tensor(hidden, requires_grad=True), torch.tensor(weight, requires_grad=True)
    bb = None if b is None else torch.tensor(b, requires_grad=True)
    loss = tt.fused_linear_cross_entropy(h, w, torch.as_tensor(target), bb, reduction=reduction,
                                         chunk_size=chunk_size)
    assert loss.dtype == torch.float32
    (loss * torch.as_tensor(ref_dloss, dtype=torch.float32)).sum().backward()
    _close(loss.detach(), want[0], "loss")
    _close(h.grad, want[1], "grad_hidden")
    _close(w.grad, want[2], "grad_weight")
    if bias:
        _close(bb.grad, want[3], "grad_bias")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_numpy_matches_float64(rng, reduction, bias):
    hidden, weight, target, b = _data(rng, bias=bias)
    loss, gh, gw, gb = tensor_ops.fused_linear_cross_entropy(hidden, weight, target, b, reduction=reduction,
                                                              chunk_size=5)
    want = _reference(hidden, weight, target, b, reduction)  # "none": gradients of the sum, as cross_entropy_with_grad
    _close(loss, want[0], "loss")
    _close(gh, want[1], "grad_hidden")
    _close(gw, want[2], "grad_weight")
    assert gh.dtype == gw.dtype == np.float32
    if bias:
        _close(gb, want[3], "grad_bias")
    else:
        assert gb is None


CE_OPTIONS = [dict(label_smoothing=0.1), dict(z_loss=1e-2), dict(softcap=2.0),
              dict(label_smoothing=0.2, z_loss=1e-2, softcap=5.0)]


@pytest.mark.parametrize("options", CE_OPTIONS, ids=["smooth", "zloss", "softcap", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_numpy_options_match_float64(rng, options, reduction):
    hidden, weight, target, b = _data(rng)
    loss, gh, gw, gb = tensor_ops.fused_linear_cross_entropy(hidden, weight, target, b, reduction=reduction,
                                                              chunk_size=7, **options)
    want = _reference(hidden, weight, target, b, reduction, **options)
    for got, ref, what in zip([loss, gh, gw, gb], want, ["loss", "grad_hidden", "grad_weight", "grad_bias"]):
        _close(got, ref, what)


@pytest.mark.parametrize("options", CE_OPTIONS, ids=["smooth", "zloss", "softcap", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_options_match_float64(rng, options, reduction):
    hidden, weight, target, b = _data(rng)
    ref_dloss = rng.standard_normal(len(target)) if reduction == "none" else 0.6
    want = _reference(hidden, weight, target, b, reduction, ref_dloss, **options)
    h, w, bb = (torch.tensor(a, requires_grad=True) for a in (hidden, weight, b))
    module = tt.FusedLinearCrossEntropyLoss(reduction=reduction, chunk_size=8, **options)
    loss = module(w, h, torch.as_tensor(target), bb)
    (loss * torch.as_tensor(ref_dloss, dtype=torch.float32)).sum().backward()
    for got, ref, what in zip([loss.detach(), h.grad, w.grad, bb.grad], want,
                              ["loss", "grad_hidden", "grad_weight", "grad_bias"]):
        _close(got, ref, what)


def test_numpy_weight_gradient_blocks(rng):
    # V larger than the row block numpy's accumulation works in
    hidden, weight, target, b = _data(rng, n=9, h=4, v=2100)
    _, _, gw, gb = tensor_ops.fused_linear_cross_entropy(hidden, weight, target, b, chunk_size=4)
    want = _reference(hidden, weight, target, b, "mean")
    _close(gw, want[2], "grad_weight")
    _close(gb, want[3], "grad_bias")


def test_bfloat16_within_torchs_own_error(rng):
    """bf16: our error against float64 no larger than torch's bf16
    F.linear + F.cross_entropy's (grad_weight accumulates in fp32)."""
    hidden, weight, target, _ = _data(rng, n=300, h=64, v=500, bias=False)
    weight *= 0.3
    want = _reference(hidden, weight, target, None, "mean")

    def errors(fn):
        h = torch.tensor(hidden, dtype=torch.bfloat16, requires_grad=True)
        w = torch.tensor(weight, dtype=torch.bfloat16, requires_grad=True)
        loss = fn(h, w)
        loss.backward()
        return [np.linalg.norm(np.float64(got) - ref) / np.linalg.norm(ref)
                for got, ref in zip([loss.detach().double(), h.grad.double(), w.grad.double()], want)]

    t = torch.as_tensor(target)
    ours = errors(lambda h, w: tt.fused_linear_cross_entropy(h, w, t, chunk_size=16))
    theirs = errors(lambda h, w: F.cross_entropy(F.linear(h, w), t))
    for what, o, r in zip(["loss", "grad_hidden", "grad_weight"], ours, theirs):
        assert o <= 1.25 * r + 1e-6, f"{what}: ours {o:.3g}, torch bf16 {r:.3g}"


@pytest.mark.parametrize("reduction, expected", [("mean", float("nan")), ("sum", 0.0)])
def test_all_targets_ignored(rng, reduction, expected):
    hidden, weight, target, b = _data(rng, n=6)
    target[:] = -100
    h, w, bb = (torch.tensor(a, requires_grad=True) for a in (hidden, weight, b))
    loss = tt.fused_linear_cross_entropy(h, w, torch.as_tensor(target), bb, reduction=reduction, chunk_size=4)
    ref = F.cross_entropy(F.linear(torch.tensor(hidden), torch.tensor(weight), torch.tensor(b)),
                          torch.as_tensor(target), reduction=reduction)
    np.testing.assert_equal(loss.item(), ref.item())
    np.testing.assert_equal(float(expected), loss.item())
    loss.backward()
    for g in (h.grad, w.grad, bb.grad):
        assert torch.count_nonzero(g) == 0
    np_loss, gh, gw, gb = tensor_ops.fused_linear_cross_entropy(hidden, weight, target, b, reduction=reduction)
    np.testing.assert_equal(float(expected), float(np_loss))
    assert not gh.any() and not gw.any() and not gb.any()


def test_all_targets_ignored_at_an_infinite_scale(rng):
    """HF's sum / num_items_in_batch with num_items_in_batch 0: torch's
    gradients stay 0, ours were NaN (Note [ignored rows at an infinite loss
    scale], custom_ops.py)."""
    hidden, weight, target, b = _data(rng, n=6)
    target[:] = -100
    h, w, bb = (torch.tensor(a, requires_grad=True) for a in (hidden, weight, b))
    loss = tt.fused_linear_cross_entropy(h, w, torch.as_tensor(target), bb, reduction="sum", chunk_size=4)
    (loss / torch.tensor(0.0)).backward()
    for g in (h.grad, w.grad, bb.grad):
        assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(reduction):
    h = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    t = torch.zeros(0, dtype=torch.int64)
    loss = tt.fused_linear_cross_entropy(h, w, t, reduction=reduction)
    ref = F.cross_entropy(F.linear(h, w), t, reduction=reduction)
    assert loss.shape == ref.shape
    np.testing.assert_equal(loss.detach().numpy(), ref.detach().numpy())
    loss.sum().backward()
    assert h.grad.shape == (0, 8) and torch.count_nonzero(w.grad) == 0
    np_loss, gh, gw, _ = tensor_ops.fused_linear_cross_entropy(h.detach().numpy(), w.detach().numpy(), t.numpy(),
                                                               reduction=reduction)
    np.testing.assert_equal(np.asarray(np_loss), ref.detach().numpy())
    assert gh.shape == (0, 8) and not gw.any()


def test_no_logits_larger_than_a_chunk(rng, monkeypatch):
    seen = []
    real = lce.cross_entropy_with_grad

    def spy(logits, *args, **kwargs):
        seen.append(tuple(logits.shape))
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(lce, "cross_entropy_with_grad", spy)
    hidden, weight, target, b = _data(rng, n=37)
    h = torch.tensor(hidden, requires_grad=True)
    tt.fused_linear_cross_entropy(h, torch.tensor(weight), torch.as_tensor(target), chunk_size=8).backward()
    assert seen == [(8, 50)] * 4 + [(5, 50)]


class _LargeAllocations(TorchDispatchMode):
    """Records every aten op's output that is new memory (not an input's
    storage) of at least nbytes."""

    def __init__(self, nbytes):
        super().__init__()
        self.nbytes, self.seen = nbytes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given
                    and t.untyped_storage().nbytes() >= self.nbytes):
                self.seen.append(f"{func}: {list(t.shape)} {t.dtype}")
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_torch_loop_allocates_one_chunk_block(rng, dtype, bias):
    """The loop's only allocation of [chunk, V] size is the logits buffer:
    the gradient overwrites it, and bf16's fp32 accumulation of grad_weight
    converts dlogits a block of rows at a time (it made a [V, chunk] fp32
    copy per chunk, twice the buffer). H < chunk / 2 keeps grad_weight
    (fp32 [V, H]) under the threshold."""
    n, h, v, chunk = 64, 4, 3000, 16
    hidden, weight, target, b = _data(rng, n=n, h=h, v=v, bias=bias)
    hidden, weight = torch.tensor(hidden, dtype=dtype), torch.tensor(weight, dtype=dtype)
    b = None if b is None else torch.tensor(b, dtype=dtype)
    mode = _LargeAllocations(chunk * v * hidden.element_size())
    with mode:
        losses, gh, gw, gb = lce.chunked(tlce.TORCH, hidden, weight, torch.as_tensor(target), b, -100, chunk, True)
    assert len(mode.seen) == 1 and f"[{chunk}, {v}]" in mode.seen[0], mode.seen
    want = _reference(hidden.double().numpy(), weight.double().numpy(), target, None if b is None else
                      b.double().numpy(), "sum")
    if dtype == torch.float32:
        _close(gw, want[2], "grad_weight")
        _close(gh, want[1], "grad_hidden")
    else:  # fp32 accumulation of bf16 products: bf16 rounding of the chunks' dlogits only
        _close(gw, want[2], "grad_weight", rtol=2e-2)


def test_numpy_peak_is_gradients_and_one_chunk_block(rng):
    """tracemalloc (numpy reports its buffers) over the numpy form: the peak
    above the returned gradients is one [chunk, V] block plus the weight
    accumulation's [ACC_ROWS, H] product buffer, not a second block for the
    logits' gradient."""
    n, h, v, chunk = 64, 4, 8000, 16
    hidden, weight, target, b = _data(rng, n=n, h=h, v=v)
    tensor_ops.fused_linear_cross_entropy(hidden, weight, target, b, chunk_size=chunk)  # first-call caches
    tracemalloc.start()
    try:
        _, gh, gw, gb = tensor_ops.fused_linear_cross_entropy(hidden, weight, target, b, chunk_size=chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    block = chunk * v * 4
    extra = peak - gh.nbytes - gw.nbytes - gb.nbytes
    assert block <= extra < block + lce.ACC_ROWS * h * 4 + 4 * v * 4, (extra, block)


def test_no_gradient_work_without_grad(rng, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("gradients computed for a loss nobody differentiates")

    monkeypatch.setattr(lce, "cross_entropy_with_grad", refuse)
    hidden, weight, target, b = _data(rng)
    args = [torch.tensor(hidden), torch.tensor(weight), torch.as_tensor(target), torch.tensor(b)]
    want = _reference(hidden, weight, target, b, "mean")[0]
    _close(tt.fused_linear_cross_entropy(*args), want, "loss")
    args[0].requires_grad_()
    with torch.no_grad():
        _close(tt.fused_linear_cross_entropy(*args), want, "loss")


def test_module_liger_conventions(rng):
    hidden, weight, target, b = _data(rng, n=24)
    module = tt.FusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum", chunk_size=5)
    assert "reduction='sum'" in repr(module)
    h = torch.tensor(hidden, requires_grad=True)
    loss = module(torch.tensor(weight), h.view(4, 6, 16), torch.as_tensor(target).view(4, 6), torch.tensor(b))
    loss.backward()
    want = _reference(hidden, weight, target, b, "sum")
    _close(loss.detach(), want[0], "loss")
    _close(h.grad, want[1], "grad_hidden")


def test_torch_compile_fullgraph_dynamic(rng):
    """fullgraph with dynamic shapes: the option checks' math.isfinite broke the graph."""
    torch._dynamo.reset()
    hidden, weight, target, _ = _data(rng, n=26)
    h, w, t = torch.tensor(hidden).requires_grad_(), torch.tensor(weight), torch.as_tensor(target)
    f = torch.compile(lambda a, b, c: tt.fused_linear_cross_entropy(a, b, c, label_smoothing=0.1),
                      fullgraph=True, dynamic=True, backend="aot_eager")
    _close(f(h, w, t).detach(), tt.fused_linear_cross_entropy(h, w, t, label_smoothing=0.1).detach(), "loss")


def test_torch_compile_fullgraph(rng):
    torch._dynamo.reset()
    hidden, weight, target, _ = _data(rng, n=26)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 50)
            self.loss = tt.FusedLinearCrossEntropyLoss(chunk_size=8)

        def forward(self, x, t):
            return self.loss(self.proj.weight, torch.tanh(x), t, self.proj.bias)

    torch.manual_seed(0)
    model = Head()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, t = torch.tensor(hidden).view(2, 13, 16).requires_grad_(), torch.as_tensor(target).view(2, 13)
    loss = compiled(x, t)
    loss.backward()
    grads = [x.grad.clone(), model.proj.weight.grad.clone(), model.proj.bias.grad.clone()]
    x.grad = None
    model.zero_grad()
    F.cross_entropy(model.proj(torch.tanh(x)).view(-1, 50), t.view(-1)).backward()
    for got, ref in zip(grads, [x.grad, model.proj.weight.grad, model.proj.bias.grad]):
        _close(got, ref, "gradient", rtol=1e-5)


def test_default_chunk_size():
    assert lce.default_chunk_size(4096, 2048, 32000) == 256  # Liger's: logits chunk ~ hidden's size
    assert lce.default_chunk_size(10, 2048, 32000) == 10  # never more than N
    assert lce.default_chunk_size(4096, 256, 128256) == 32  # the GEMM floor
    assert lce.default_chunk_size(0, 8, 5) == 1


def test_bad_arguments():
    h, w, t = torch.zeros(4, 8), torch.zeros(5, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"hidden \[4, 8\], weight \[5, 7\]"):
        tt.fused_linear_cross_entropy(h, torch.zeros(5, 7), t)
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"target \[3\]"):
        tt.fused_linear_cross_entropy(h, w, t[:3])
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"bias must be \[5\]"):
        tt.fused_linear_cross_entropy(h, w, t, torch.zeros(4))
    with pytest.raises(tensor_ops.DTypeError, match="float64"):
        tt.fused_linear_cross_entropy(h, w.double(), t)
    with pytest.raises(tensor_ops.InvalidArgumentError, match="reduction"):
        tt.fused_linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(tensor_ops.InvalidArgumentError, match="softcap must be > 0"):
        tt.fused_linear_cross_entropy(h, w, t, softcap=0.0)
    with pytest.raises(tensor_ops.InvalidArgumentError, match="label_smoothing"):
        tt.FusedLinearCrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(tensor_ops.InvalidArgumentError, match="chunk_size must be >= 1, got 0"):
        tt.FusedLinearCrossEntropyLoss(chunk_size=0)
    with pytest.raises(tensor_ops.ArgumentTypeError, match="chunk_size"):
        tt.fused_linear_cross_entropy(h, w, t, chunk_size=2.0)
    with pytest.raises(tensor_ops.DTypeError, match="numpy arrays"):
        tensor_ops.fused_linear_cross_entropy(h, w, t)
    with pytest.raises(tensor_ops.InvalidArgumentError, match="z_loss must be >= 0, got -1.0"):  # before any chunk
        tensor_ops.fused_linear_cross_entropy(h.numpy()[:0], w.numpy(), t.numpy()[:0], z_loss=-1.0)
    with pytest.raises(tensor_ops.InvalidArgumentError, match="no classes"):
        tensor_ops.fused_linear_cross_entropy(h.numpy(), np.zeros((0, 8), np.float32), t.numpy())


def test_second_backward_refused(rng):
    # the forward's gradients are scaled in place by the first backward
    hidden, weight, target, _ = _data(rng, n=8)
    h = torch.tensor(hidden, requires_grad=True)
    loss = tt.fused_linear_cross_entropy(h, torch.tensor(weight), torch.as_tensor(target))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_with_the_xla_shim_selected_it_says_so():
    """Under use("xla") the fused linear cross-entropy (numpy and torch forms)
    raises UnsupportedError naming the shim, as linear does; it leaked the
    core's internal ExternalBackendSelected."""
    pytest.importorskip("jax")
    import tensor_ops
    from tensor_ops.errors import UnsupportedError

    h, w, t = np.ones((4, 8), np.float32), np.ones((5, 8), np.float32), np.array([0, 1, 2, 3])
    with tensor_ops.use("xla"):
        with pytest.raises(UnsupportedError, match="XLA shim"):
            tensor_ops.fused_linear_cross_entropy(h, w, t)
    assert np.isfinite(tensor_ops.fused_linear_cross_entropy(h, w, t)[0])


def test_torch_form_follows_autocast():
    """Under torch.autocast the fused linear cross-entropy's GEMM runs in the
    autocast dtype, as F.linear's does (a custom op gets no autocast cast: it
    ran in fp32, another answer than the model's own head under autocast);
    the gradients reach the fp32 parameters in fp32."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from tensor_ops.torch import fused_linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(12, 32, requires_grad=True)
    W = (torch.randn(50, 32) * 0.5).requires_grad_()
    target = torch.randint(0, 50, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, W).float(), target)
        got = fused_linear_cross_entropy(h, W, target)
    exact = F.cross_entropy(F.linear(h.double(), W.double()), target)
    gw_want, = torch.autograd.grad(want, W)
    gw, gh = torch.autograd.grad(got, (W, h))
    assert gw.dtype == gh.dtype == torch.float32
    # bf16 logits: as far from the fp32 / float64 answer as torch's own under autocast, and close to it
    assert abs(got.item() - want.item()) < 2e-3 * abs(want.item())
    assert abs(got.item() - exact.item()) > 1e-6  # not the fp32 GEMM's answer
    torch.testing.assert_close(gw, gw_want, rtol=3e-2, atol=3e-3)
