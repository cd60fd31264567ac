"""The small-call path from torch (issue 21): outputs made in C++ through the
DLPack exchange API, torch tensors read through it, and the functional layer
taking autograd only when a gradient is recorded."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import tensor_ops  # noqa: E402
from tensor_ops import _C  # noqa: E402
from tensor_ops.errors import LayoutError  # noqa: E402
from tensor_ops.torch import functional as TF  # noqa: E402

HAS_EXCHANGE = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.skipif(not HAS_EXCHANGE, reason="this torch has no __dlpack_c_exchange_api__")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (3, 17), (2, 5, 33)])
def test_binding_makes_torch_outputs(dtype, shape):
    x = torch.randn(*shape).to(dtype)
    w = torch.rand(shape[-1]).to(dtype) + 0.5
    y = _C.silu(x, None)
    assert type(y) is torch.Tensor and y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y.float(), F.silu(x.float()).to(dtype).float(), rtol=2e-2, atol=2e-2)
    y = _C.rms_norm(x, w, None, 1e-6)
    torch.testing.assert_close(y.float(), F.rms_norm(x.float(), (shape[-1],), w.float(), 1e-6), rtol=2e-2, atol=2e-2)
    out, res = _C.add_rms_norm(x, x, w, None, None, 1e-6)
    assert out.data_ptr() != res.data_ptr() or x.numel() == 0
    torch.testing.assert_close(res.float(), (x + x).float(), rtol=1e-2, atol=1e-2)


def test_binding_writes_given_output_and_returns_none():
    x = torch.randn(4, 8)
    o = torch.empty_like(x)
    assert _C.silu(x, o) is None
    torch.testing.assert_close(o, F.silu(x))


def test_binding_refuses_to_make_numpy_outputs():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(LayoutError):
        _C.silu(x, None)


@pytest.mark.skipif(not HAS_EXCHANGE, reason="this torch has no __dlpack_c_exchange_api__")
def test_views_read_at_their_offset_and_strides():
    base = torch.randn(6, 40)
    for x in (base[2:, 3:], base.t(), base[:, ::2], base[1]):
        torch.testing.assert_close(tensor_ops.silu(x), F.silu(x))
        torch.testing.assert_close(TF.softmax(x), torch.softmax(x, -1))


def test_lazy_negative_view_and_parameters():
    x = torch.randn(3, 16)
    torch.testing.assert_close(tensor_ops.silu(torch._neg_view(x)), F.silu(-x))
    p = torch.nn.Parameter(torch.rand(16) + 0.5)
    torch.testing.assert_close(tensor_ops.rms_norm(x, p.detach()), F.rms_norm(x, (16,), p.detach(), 1e-6))
    with torch.no_grad():
        torch.testing.assert_close(TF.rms_norm(x, p, 1e-6), F.rms_norm(x, (16,), p, 1e-6))


def test_sparse_and_nested_still_refused_with_shapes():
    x = torch.randn(3, 8)
    with pytest.raises(tensor_ops.UnsupportedError, match=r"\(3, 8\)"):
        tensor_ops.silu(x.to_sparse())


def test_functional_records_autograd_only_when_needed():
    x = torch.randn(4, 32)
    w = torch.rand(32) + 0.5
    y = TF.rms_norm(x, w, 1e-6)
    assert y.grad_fn is None and not y.requires_grad
    wg = w.clone().requires_grad_()
    y = TF.rms_norm(x, wg, 1e-6)
    assert y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    ref = w.clone().requires_grad_()
    F.rms_norm(x, (32,), ref, 1e-6).sum().backward()
    torch.testing.assert_close(wg.grad, ref.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert TF.silu(x.requires_grad_()).grad_fn is None


def test_large_outputs_still_come_from_the_pool_path():
    # 32 MiB and up: the binding refuses to make it (LayoutError) and the
    # Python layer allocates; the answer is the same.
    x = torch.randn(2048, 4097)
    torch.testing.assert_close(tensor_ops.silu(x), F.silu(x))


def test_parameters_as_peers_take_the_fast_path():
    # A module's weight is an nn.Parameter (requires_grad off under no_grad /
    # inference): the op must not drop to the general path for it.
    x = torch.randn(2, 16)
    p = torch.nn.Parameter(torch.rand(16) + 0.5, requires_grad=False)
    from tensor_ops import _optable
    y = _optable._fast(_optable.TABLE["rms_norm"], (x, p), (1e-6,))
    assert y is not None
    torch.testing.assert_close(y, F.rms_norm(x, (16,), p, 1e-6))


@pytest.mark.skipif(not HAS_EXCHANGE, reason="this torch has no __dlpack_c_exchange_api__")
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_bindings_make_torch_outputs(dtype):
    """The backward ops' bindings make their outputs like the input each is
    shaped after (dweight like the weight, in the weight's dtype)."""
    x, dy = torch.randn(5, 24).to(dtype), torch.randn(5, 24).to(dtype)
    w = torch.nn.Parameter((torch.rand(24) + 0.5).to(dtype))
    dx, dw = _C.rms_norm_backward(dy, x, w, None, None, 1e-6)
    assert type(dx) is torch.Tensor and dx.shape == x.shape and dw.shape == w.shape and dw.dtype == dtype
    ref_dx, ref_dw = tensor_ops.rms_norm_backward(dy.numpy() if dtype != torch.bfloat16 else dy.float().numpy(),
                                                  x.float().numpy() if dtype == torch.bfloat16 else x.numpy(),
                                                  w.detach().float().numpy() if dtype == torch.bfloat16
                                                  else w.detach().numpy(), 1e-6)
    torch.testing.assert_close(dx.float(), torch.from_numpy(np.asarray(ref_dx, np.float32)), rtol=3e-2, atol=3e-2)
    y = torch.softmax(x.float(), -1).to(dtype)
    d = _C.softmax_backward(dy, y, None, 1.0, False)
    torch.testing.assert_close(d.float(), (y.float() * (dy.float() - (dy.float() * y.float()).sum(-1, True))),
                               rtol=3e-2, atol=3e-2)
    d = _C.activation_backward(dy, x, None, "silu", "none")
    xf = x.float().requires_grad_()
    F.silu(xf).backward(dy.float())
    torch.testing.assert_close(d.float(), xf.grad, rtol=3e-2, atol=3e-2)
    dg, du = _C.glu_backward(dy, x, x, None, None, "silu", "none")
    assert dg.shape == du.shape == x.shape and dg.data_ptr() != du.data_ptr()


def test_ops_that_autograd_would_record_record_it():
    """Note [ops that autograd would record]: the op API on a torch tensor
    that requires grad, with grad mode on, records the gradient (it was read
    as its data: no grad_fn, and behind a residual add the weight's gradient
    was silently missing); under no_grad it reads the data as before."""
    x = torch.randn(4, 32, dtype=torch.float64).float().requires_grad_()
    w = torch.nn.Parameter(torch.rand(32) + 0.5)
    y = tensor_ops.rms_norm(x, w)
    assert y.grad_fn is not None
    (x + y).square().sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (xr + F.rms_norm(xr, (32,), wr, 1e-6)).square().sum().backward()
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        y = tensor_ops.rms_norm(x, w)
        assert not y.requires_grad and y.grad_fn is None
        torch.testing.assert_close(y, F.rms_norm(x, (32,), w, 1e-6))
        torch.testing.assert_close(tensor_ops.swiglu(x, x), F.silu(x) * x)
    # linear and a few ops with options, against torch's gradients
    wl = torch.randn(5, 32, requires_grad=True)
    for ours, ref in [(lambda a: tensor_ops.linear(a, wl), lambda a: F.linear(a, wl)),
                      (lambda a: tensor_ops.gelu(a, "tanh"), lambda a: F.gelu(a, approximate="tanh")),
                      (lambda a: tensor_ops.softmax(a, dim=0), lambda a: torch.softmax(a, 0)),
                      (lambda a: tensor_ops.layer_norm(a, w, None, 1e-5), lambda a: F.layer_norm(a, (32,), w, None))]:
        g1 = torch.autograd.grad(ours(x).sin().sum(), x)[0]
        g2 = torch.autograd.grad(ref(x).sin().sum(), x)[0]
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)
    # out= records nothing: refused, with what requires grad
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"out=Tensor\[4, 32\].*Parameter\[32\]"):
        tensor_ops.rms_norm(x, w, out=torch.empty(4, 32))
    # a backward op: the gradients, which refuse to be differentiated
    dx, dw, db = tensor_ops.layer_norm_backward(torch.ones(4, 32), x, w, bias=False)
    assert db is None and dw.shape == (32,) and dx.requires_grad
    with pytest.raises(RuntimeError, match="second derivative"):
        dx.sum().backward()


def test_one_table_drives_the_ops():
    """Every op the table names is a binding, and the public functions run
    through it: the table's binding sees the call."""
    from tensor_ops import _optable

    for name, entry in _optable.TABLE.items():
        assert entry.fn is getattr(_C, name), name
        assert all(0 <= i < len(entry.arrays) or i == _optable.LSE for i in entry.like), name
    seen = []
    real = _optable.TABLE["silu"]
    _optable.TABLE["silu"] = real._replace(fn=lambda *a, **k: seen.append(len(a)) or real.fn(*a, **k))
    try:
        tensor_ops.silu(np.ones(3, np.float32))
        tensor_ops.silu(torch.ones(3))
    finally:
        _optable.TABLE["silu"] = real
    assert len(seen) == 2


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_rope_and_attention_on_the_table_lane(kind):
    """rope with tables in x's dtype and [batch, seq] positions, and
    attention (its float32 lse made beside the output), take the table's
    fast lane and give the general path's answer."""
    from tensor_ops import _optable

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 3, 8), dtype=np.float32)
    ang = rng.standard_normal((16, 4)).astype(np.float32)
    cos, sin, pos = np.cos(ang), np.sin(ang), np.array([[0, 3, 4, 9, 15], [1, 1, 2, 3, 5]], np.int64)
    q = rng.standard_normal((2, 4, 3, 8), dtype=np.float32)
    k = rng.standard_normal((2, 2, 6, 8), dtype=np.float32)
    v = rng.standard_normal((2, 2, 6, 8), dtype=np.float32)
    conv = (lambda a: torch.from_numpy(a)) if kind == "torch" else (lambda a: a)
    fast = _optable._fast(_optable.TABLE["rope"], tuple(map(conv, (x, cos, sin, pos))), (False, False))
    assert fast is not None
    general = tensor_ops.rope(x, cos.astype(np.float64), sin, pos)  # float64 tables: the adapting path
    np.testing.assert_allclose(np.asarray(fast), general, rtol=1e-6, atol=1e-6)
    made = _optable._fast(_optable.TABLE["attention"], tuple(map(conv, (q, k, v))), (1, 0.35))
    if kind == "torch":
        assert made is not None and made[1].dtype == torch.float32 and tuple(made[1].shape) == (2, 4, 3)
    out, lse = tensor_ops.attention(conv(q), conv(k), conv(v), causal=True, scale=0.35, return_lse=True)
    qt, kt, vt = (torch.from_numpy(a).double() for a in (q, k, v))
    kt, vt = kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1)
    s = (qt @ kt.transpose(-1, -2)) * 0.35
    mask = torch.ones(3, 6, dtype=torch.bool).tril(6 - 3)
    s = s.masked_fill(~mask, float("-inf"))
    np.testing.assert_allclose(np.asarray(out), (torch.softmax(s, -1) @ vt).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), torch.logsumexp(s, -1).numpy(), rtol=1e-5, atol=1e-5)


def _lane_calls(monkeypatch):
    """(binding calls, DIRECT calls) as functional ops run: the direct lane
    calls the table's binding; the fallback calls the plain kernel."""
    from tensor_ops import _optable
    from tensor_ops.torch import custom_ops

    seen = {"binding": 0, "direct": 0}
    for name, entry in list(_optable.TABLE.items()):
        def counted(*a, _fn=entry.fn, **k):
            seen["binding"] += 1
            return _fn(*a, **k)
        monkeypatch.setitem(_optable.TABLE, name, entry._replace(fn=counted))
    for name in TF.LOWERED:
        impl = getattr(custom_ops.DIRECT, name)

        def plain(*a, _impl=impl):
            seen["direct"] += 1
            return _impl(*a)
        monkeypatch.setattr(custom_ops.DIRECT, name, plain)
    return seen


def test_direct_lane_runs_the_binding_for_plain_calls(monkeypatch):
    """Note [direct lane]: a plain call with nothing to differentiate runs the
    op table's binding once, not the public op; its answer is torch's."""
    seen = _lane_calls(monkeypatch)
    x, u = torch.randn(3, 40), torch.randn(3, 40)
    w, b = torch.rand(40) + 0.5, torch.randn(40)
    cases = [
        (lambda: TF.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (40,), w, 1e-6)),
        (lambda: TF.rms_norm(x, w, 1e-6, 1.0), lambda: F.rms_norm(x, (40,), w + 1, 1e-6)),
        (lambda: TF.layer_norm(x, w, b, 1e-5), lambda: F.layer_norm(x, (40,), w, b, 1e-5)),
        (lambda: TF.layer_norm(x, w, None, 1e-5), lambda: F.layer_norm(x, (40,), w, None, 1e-5)),
        (lambda: TF.add_rms_norm(x, u, w, 1e-6), lambda: (F.rms_norm(x + u, (40,), w, 1e-6), x + u)),
        (lambda: TF.silu(x), lambda: F.silu(x)),
        (lambda: TF.gelu(x, "tanh"), lambda: F.gelu(x, approximate="tanh")),
        (lambda: TF.swiglu(x, u), lambda: F.silu(x) * u),
        (lambda: TF.geglu(x, u, "none"), lambda: F.gelu(x) * u),
        (lambda: TF.softmax(x, -1, 0.5), lambda: torch.softmax(0.5 * x, -1)),
        (lambda: TF.log_softmax(x), lambda: torch.log_softmax(x, -1)),
        (lambda: TF.softmax(x, -1, 1.0, True), lambda: torch.softmax(x.masked_fill(
            ~torch.ones(3, 40, dtype=torch.bool).tril(37), float("-inf")), -1)),
    ]
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    sdpa = F.scaled_dot_product_attention
    cases += [
        (lambda: TF.attention(q, k, v), lambda: sdpa(q, k, v, enable_gqa=True)),
        (lambda: TF.attention(q, k, v, True, 0.3, causal_alignment="top_left"),
         lambda: sdpa(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)),
        (lambda: TF.attention(q, k, v, True),
         lambda: sdpa(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool).tril(2), enable_gqa=True)),
    ]
    for ours, ref in cases:
        before = dict(seen)
        torch.testing.assert_close(ours(), ref(), rtol=1e-5, atol=1e-5)
        assert seen["binding"] - before["binding"] == 1 and seen["direct"] == before["direct"]


def test_torch_ops_take_the_direct_lane_at_the_autograd_key(monkeypatch):
    """Note [the autograd key's direct lane]: torch.ops.tensor_ops.<op> with
    nothing to differentiate runs the binding once, with torch's answer; a
    call that needs a gradient still records one through torch's autograd
    kernel; a TorchDispatchMode still sees the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tensor_ops.torch import custom_ops

    seen = _lane_calls(monkeypatch)
    seen["torch autograd"] = 0
    assert set(custom_ops.TORCH_AUTOGRAD) >= {"rms_norm", "silu", "gelu"}
    for name, torch_kernel in list(custom_ops.TORCH_AUTOGRAD.items()):
        if name not in custom_ops.LOWERED:  # the backward ops' own (silu's backward calls silu_backward)
            continue

        def counted(*a, _kernel=torch_kernel, **k):
            seen["torch autograd"] += 1
            return _kernel(*a, **k)
        monkeypatch.setitem(custom_ops.TORCH_AUTOGRAD, name, counted)
    x, w = torch.randn(3, 40), torch.rand(40) + 0.5
    for call, ref in [(lambda: torch.ops.tensor_ops.rms_norm(x, w, 1e-6, 0.0), lambda: F.rms_norm(x, (40,), w, 1e-6)),
                      (lambda: torch.ops.tensor_ops.silu(x), lambda: F.silu(x)),
                      (lambda: torch.ops.tensor_ops.gelu(x, "tanh"), lambda: F.gelu(x, approximate="tanh"))]:
        before = seen["binding"]
        torch.testing.assert_close(call(), ref(), rtol=1e-5, atol=1e-5)
        assert seen["binding"] - before == 1 and seen["direct"] == 0 and seen["torch autograd"] == 0
    xg = x.clone().requires_grad_()
    y = torch.ops.tensor_ops.silu(xg)
    assert y.grad_fn is not None and seen["torch autograd"] == 1
    y.sum().backward()
    s = torch.sigmoid(x)
    torch.testing.assert_close(xg.grad, s * (1 + x * (1 - s)), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert torch.ops.tensor_ops.silu(xg).grad_fn is None
    assert seen["torch autograd"] == 1

    class Recorded(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Recorded() as mode:
        torch.testing.assert_close(torch.ops.tensor_ops.silu(x), F.silu(x))
    assert torch.ops.tensor_ops.silu.default in mode.ops and seen["torch autograd"] == 2


def test_direct_lane_hands_what_it_does_not_take_to_the_public_op(monkeypatch):
    """A strided view, another dim, mixed dtypes, a bad option: the plain
    kernel (through the public op, which copies, converts or words the
    error), with the same answer or error as before the lane."""
    seen = _lane_calls(monkeypatch)
    x = torch.randn(40, 3)
    w = torch.rand(40) + 0.5
    before = seen["direct"]
    torch.testing.assert_close(TF.silu(x.t()), F.silu(x.t()))  # strided: the binding refuses the layout
    torch.testing.assert_close(TF.softmax(x, 0), torch.softmax(x, 0))  # not the last dim
    with pytest.raises(TypeError, match=r"float16\[40\]"):
        TF.rms_norm(x.t().contiguous(), w.half(), 1e-6)  # mixed dtypes: the public op's worded error
    with pytest.raises(ValueError, match="approximate"):
        TF.gelu(x, "fast")
    with pytest.raises(ValueError, match="40"):
        TF.rms_norm(x, w, 1e-6)  # [40, 3] against a weight of 40: the public op's error
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="causal_alignment"):
        TF.attention(q, q, q, True, causal_alignment="middle")
    with pytest.raises(ValueError, match=r"\[batch, heads, seq, head_dim\]"):
        TF.attention(q[0], q[0], q[0])
    assert seen["direct"] - before == 7


def test_direct_lane_leaves_a_selected_xla_shim_its_calls(monkeypatch):
    """With the XLA shim selected for host arrays the binding refuses
    (ExternalBackendSelected): the call goes through the public op to the shim."""
    pytest.importorskip("jax")
    from tensor_ops import _optable

    x = torch.randn(3, 40)
    with tensor_ops.use("xla"):
        assert _optable.torch_call("silu", (x,), ()) is None
        seen = _lane_calls(monkeypatch)
        torch.testing.assert_close(TF.silu(x), F.silu(x))
    assert seen["direct"] == 1


def test_large_general_lane_outputs_come_from_the_pool():
    """POOL_OUTPUT_BYTES holds for outputs the general lane makes too
    (cross_entropy_with_grad's dlogits): a pool block, reused, not a fresh
    mmap per call that the kernel page-faults in."""
    x = torch.randn(256, 32769)  # 33.6 MB of float32
    t = torch.randint(0, 32769, (256,))
    before = tensor_ops.memory_stats()["allocation.all.allocated"]
    loss, dl = tensor_ops.cross_entropy_with_grad(x, t)
    assert tensor_ops.memory_stats()["allocation.all.allocated"] > before
    ref = (torch.softmax(x.double(), -1) - F.one_hot(t, 32769).double()) / 256
    torch.testing.assert_close(dl.double(), ref, rtol=1e-5, atol=1e-9)
    y = tensor_ops.cross_entropy_with_grad(x.numpy(), t.numpy())[1]
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    np.testing.assert_allclose(y, dl.numpy(), rtol=0, atol=0)


def test_out_takes_the_fast_lane(monkeypatch):
    """Note [out= on the fast lane] (_optable.py): out= with numpy arrays or
    host torch tensors of one dtype calls the binding directly (no Arg
    conversion: it cost 6.4 / 9.4 us per silu [1, 64] against 1.9 / 3.4
    without out=); the answers, torch's version counter, and the general
    lane for what the fast one does not take are unchanged."""
    import numpy as np

    from tensor_ops import _optable

    made = []
    real_arg = _optable.Arg
    monkeypatch.setattr(_optable, "Arg", lambda *a, **k: made.append(a[1]) or real_arg(*a, **k))
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    w = np.ones(40, np.float32)
    o = np.empty_like(x)
    assert tensor_ops.silu(x, out=o) is o and made == []
    np.testing.assert_allclose(o, x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)
    tensor_ops.rms_norm(x, w, out=o)
    tensor_ops.rms_norm(x[:, :20], w[:20], out=o[:, 20:])  # row-strided views: in place on the CPU
    assert made == []
    xt, ot = torch.from_numpy(x), torch.empty(3, 40)
    version = ot._version
    assert tensor_ops.gelu(xt, out=ot) is ot and made == [] and ot._version > version
    torch.testing.assert_close(ot, F.gelu(xt), rtol=1e-5, atol=1e-6)
    tensor_ops.silu(xt, out=xt.clone())
    assert made == []
    # the general lane: mixed kinds, a dtype that differs, a transposed out (LayoutError, worded)
    tensor_ops.silu(x, out=torch.empty(3, 40))
    assert made == ["x"]
    with pytest.raises(tensor_ops.errors.LayoutError, match="strides"):
        tensor_ops.silu(xt, out=torch.empty(40, 3).t())
    with pytest.raises(tensor_ops.errors.InvalidArgumentError, match="partially overlaps"):
        b = torch.randn(4, 40)
        tensor_ops.silu(b[:3], out=b[1:])
