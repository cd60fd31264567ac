"""Forward-mode AD through tensor_ops (Note [forward-mode AD],
python/tensor_ops/torch/forward_ad.py): torch.func.jvp / jacfwd and
torch.autograd.forward_ad's dual tensors give torch's tangents through every
forward op and every way in (tensor_ops.torch.functional, the op API,
torch.ops.tensor_ops, the modules). The tangent was dropped without a word
(forward_ad: the result had none) or torch.func.jvp raised "Cannot access
data pointer"."""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.autograd.forward_ad as fwAD  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tensor_ops  # noqa: E402
import tensor_ops.torch as tt  # noqa: E402


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _attn(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # bottom-right aligned (ours): query i sees keys j <= i + Lk - Lq
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq).logical_not(), float("-inf"))
    return torch.softmax(s, -1) @ v


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    x, w, b = r(3, 16), r(16), r(16)
    q, k, v = r(1, 4, 5, 8), r(1, 2, 7, 8), r(1, 2, 7, 8)
    target = torch.tensor([1, 0, 15])
    lin_w = r(6, 16)
    # name: (ours(name_space, *tensors), reference in float64, the tensors)
    return {
        "rms_norm": (lambda ns, x, w: ns.rms_norm(x, w, eps=1e-6), lambda x, w: _rms(x, w, 1e-6), (x, w)),
        "layer_norm": (lambda ns, x, w, b: ns.layer_norm(x, w, b, eps=1e-5),
                       lambda x, w, b: F.layer_norm(x, (16,), w, b, 1e-5), (x, w, b)),
        "add_rms_norm": (lambda ns, x, res, w: ns.add_rms_norm(x, res, w, eps=1e-6)[0],
                         lambda x, res, w: _rms(x + res, w, 1e-6), (x, r(3, 16), w)),
        "silu": (lambda ns, x: ns.silu(x), F.silu, (x,)),
        "gelu": (lambda ns, x: ns.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh"), (x,)),
        "swiglu": (lambda ns, a, c: ns.swiglu(a, c), lambda a, c: F.silu(a) * c, (x, r(3, 16))),
        "geglu": (lambda ns, a, c: ns.geglu(a, c), lambda a, c: F.gelu(a) * c, (x, r(3, 16))),
        "softmax": (lambda ns, x: ns.softmax(x, -1, scale=0.5), lambda x: torch.softmax(0.5 * x, -1), (x,)),
        "log_softmax": (lambda ns, x: ns.log_softmax(x, 0), lambda x: torch.log_softmax(x, 0), (x,)),
        "attention": (lambda ns, q, k, v: ns.attention(q, k, v, causal=True),
                      lambda q, k, v: _attn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), True),
                      (q, k, v)),
        "cross_entropy": (lambda ns, z: ns.cross_entropy(z, target, label_smoothing=0.1),
                          lambda z: F.cross_entropy(z, target, label_smoothing=0.1), (x,)),
        "linear": (lambda ns, x, w: ns.linear(x, w), F.linear, (x, lin_w)),
    }


CASES = _cases()
WAYS = {"functional": tt.functional, "op API": tensor_ops, "torch.ops": torch.ops.tensor_ops}


def _reference_tangent(ref, primals, tangents):
    return torch.func.jvp(ref, tuple(p.double() for p in primals), tuple(t.double() for t in tangents))


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("name", list(CASES))
def test_jvp_and_dual_tensors(name, way):
    if way == "torch.ops" and name in ("linear",):
        pytest.skip("torch.ops.tensor_ops has no linear op")
    ours, ref, primals = CASES[name]
    ns = WAYS[way]
    if way == "torch.ops":  # every argument positional, as the schema takes them
        ns = _PositionalOps()
    tangents = tuple(torch.randn_like(p) for p in primals)
    want_y, want_t = _reference_tangent(ref, primals, tangents)
    y, t = torch.func.jvp(lambda *a: ours(ns, *a), primals, tangents)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(t.double(), want_t, rtol=1e-4, atol=1e-5)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, tg) for p, tg in zip(primals, tangents)]
        got = fwAD.unpack_dual(ours(ns, *duals))
        assert got.tangent is not None, f"{way} {name}: the tangent was dropped"
        torch.testing.assert_close(got.primal.double(), want_y, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.tangent.double(), want_t, rtol=1e-4, atol=1e-5)
        # a tangent on one argument only (the others plain)
        partial = [duals[0]] + list(primals[1:])
        one = fwAD.unpack_dual(ours(ns, *partial)).tangent
    _, want_one = _reference_tangent(ref, primals, (tangents[0],) + tuple(torch.zeros_like(p) for p in primals[1:]))
    torch.testing.assert_close(one.double(), want_one, rtol=1e-4, atol=1e-5)


class _PositionalOps:
    """torch.ops.tensor_ops.<op> called with the functional's keywords put in
    schema order (the dispatcher takes them as keywords too, but the Autograd
    kernel's direct lane wants them positional: both are exercised here)."""

    def __getattr__(self, name):
        op = getattr(torch.ops.tensor_ops, name)
        fn = getattr(tt.functional, name)
        import inspect

        sig = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            values = list(bound.arguments.values())
            if name == "attention":  # (q, k, v, causal, scale, causal_alignment); return_lse is the functional's
                out = op(*values[:5], values[6])
                return out[0]
            if name == "cross_entropy":
                return op(*values)
            return op(*values)

        return call


def test_rope_tangent_is_rope_of_the_tangent():
    """RoPE is linear in x: its jvp is the op itself on the tangent (our
    kernel), through every way in."""
    torch.manual_seed(0)
    x, t = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8)
    ang = torch.randn(16, 4)
    cos, sin = ang.cos(), ang.sin()
    for interleaved in (False, True):
        f = lambda a: tt.rope(a, cos, sin, interleaved=interleaved)  # noqa: E731
        y, ty = torch.func.jvp(f, (x,), (t,))
        torch.testing.assert_close(y, f(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ty, f(t), rtol=1e-5, atol=1e-6)
        with fwAD.dual_level():
            got = fwAD.unpack_dual(tensor_ops.rope(fwAD.make_dual(x, t), cos, sin, interleaved=interleaved))
        torch.testing.assert_close(got.tangent, f(t), rtol=1e-5, atol=1e-6)


def test_hessian_and_jacfwd_over_a_prepared_model():
    """jacfwd (forward mode over vmap) and hessian (jacfwd of jacrev) of a
    prepared model give torch's answers; jacrev of jacrev (no forward mode)
    still raises (Note [first-order gradients])."""
    import copy

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.GELU(),
                              torch.nn.Linear(12, 12), torch.nn.SiLU(), torch.nn.RMSNorm(12), torch.nn.Linear(12, 1))
    got, _ = tt.prepare_model(copy.deepcopy(ref), "O1")
    x = torch.randn(6)

    def scalar(m):
        return lambda a: m(a[None]).sum()

    torch.testing.assert_close(torch.func.jacfwd(lambda a: got(a[None]))(x),
                               torch.func.jacfwd(lambda a: ref(a[None]))(x), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.func.hessian(scalar(got))(x), torch.func.hessian(scalar(ref))(x),
                               rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
        torch.func.jacrev(torch.func.jacrev(scalar(got)))(x)


def test_no_tangent_inside_a_dual_level_runs_our_kernel():
    """Inside dual_level() a call without tangents is the plain call (the
    kernel's bits), and a backward op given a tangent refuses."""
    x = torch.randn(4, 33)
    w = torch.randn(33)
    plain = tensor_ops.rms_norm(x, w)
    with fwAD.dual_level():
        assert torch.equal(tensor_ops.rms_norm(x, w), plain)
        assert torch.equal(tt.rms_norm(x, w), plain)
        dual = fwAD.make_dual(x, torch.randn_like(x))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            tt.silu_backward(torch.ones_like(x), dual)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            tensor_ops.silu_backward(torch.ones_like(x), dual)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            tt.cross_entropy_with_grad(dual, torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("prepare", ["prepare_model", "prepare_model_with_custom_kernels"])
@pytest.mark.parametrize("rows", [1, 40])
def test_prepared_modules_carry_tangents(prepare, rows):
    """A prepared model's tangents, with and without grad mode: the decode
    Linear (our few-row kernel under no_grad) dropped them, and the fused
    Linear + activation raised under torch.func.jvp (its Function has no
    separate setup_context)."""
    import copy

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.SiLU(),
                              torch.nn.RMSNorm(16), torch.nn.Linear(16, 4))
    got, _ = getattr(tt, prepare)(copy.deepcopy(ref), "O2")
    x, t = torch.randn(rows, 8), torch.randn(rows, 8)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            want = torch.func.jvp(ref, (x,), (t,))[1]
            torch.testing.assert_close(torch.func.jvp(got, (x,), (t,))[1], want, rtol=1e-4, atol=1e-6)
            with fwAD.dual_level():
                tangent = fwAD.unpack_dual(got(fwAD.make_dual(x, t))).tangent
            assert tangent is not None, f"{prepare}, {rows} rows, grad mode {grad}: the tangent was dropped"
            torch.testing.assert_close(tangent, want, rtol=1e-4, atol=1e-6)


def test_per_sample_gradients_through_fused_linear_activation():
    """vmap of grad over prepare_model_with_custom_kernels' Linear + GELU
    (it raised: the ctx-style Function under torch.func)."""
    import copy

    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    got, _ = tt.prepare_model_with_custom_kernels(copy.deepcopy(ref), "O1")
    x = torch.randn(5, 8)

    def per_sample(m):
        return vmap(grad(lambda p, xi: functional_call(m, p, (xi[None],)).sum()),
                    in_dims=(None, 0))(dict(m.named_parameters()), x)

    want, have = per_sample(ref), per_sample(got)
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-5, atol=1e-6)


def test_fused_linear_cross_entropy_tangent():
    """The fused linear cross-entropy's tangent (it was 0 under jvp, None
    with dual tensors)."""
    torch.manual_seed(0)
    h, w, th = torch.randn(6, 16), torch.randn(20, 16), torch.randn(6, 16)
    target = torch.tensor([0, 3, -100, 19, 5, 5])
    for reduction in ("mean", "none"):
        def ref(hh):
            return F.cross_entropy(hh.double() @ w.double().t(), target, reduction=reduction)

        want = torch.func.jvp(ref, (h,), (th,))[1]
        got = torch.func.jvp(lambda hh: tt.fused_linear_cross_entropy(hh, w, target, reduction=reduction), (h,),
                             (th,))[1]
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
        with fwAD.dual_level():
            dual = fwAD.unpack_dual(tt.fused_linear_cross_entropy(fwAD.make_dual(h, th), w, target,
                                                                  reduction=reduction)).tangent
        torch.testing.assert_close(dual.double(), want, rtol=1e-4, atol=1e-6)


def test_compiled_calls_inside_a_dual_level_carry_tangents():
    """torch.compile inside forward_ad.dual_level(): traced, the op API sees
    fake tensors with no tangent; it dropped the tangent of tensor_ops.silu /
    rms_norm and of the fused linear cross-entropy."""
    torch.manual_seed(0)
    x, t, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    W, target = torch.randn(10, 16), torch.tensor([1, 2, 3, 9])
    cases = [(lambda a: tensor_ops.silu(a), F.silu),
             (lambda a: tensor_ops.rms_norm(a, w), lambda a: _rms(a, w, 1e-6)),
             (lambda a: tt.fused_linear_cross_entropy(a, W, target), lambda a: F.cross_entropy(a @ W.t(), target))]
    for ours, ref in cases:
        want = torch.func.jvp(ref, (x,), (t,))[1]
        torch._dynamo.reset()
        compiled = torch.compile(ours, backend="eager", fullgraph=False)
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(compiled(fwAD.make_dual(x, t))).tangent
        assert tangent is not None
        torch.testing.assert_close(tangent, want, rtol=1e-4, atol=1e-5)


def test_torch_ops_fused_linear_cross_entropy_refuses_a_tangent():
    """The raw custom ops have no forward-mode rule: a tangent is refused by
    name (torch handed back none), the functional form carries it."""
    h, W, target = torch.randn(4, 16), torch.randn(10, 16), torch.tensor([1, 2, 3, 9])
    with fwAD.dual_level():
        dual = fwAD.make_dual(h, torch.randn_like(h))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.ops.tensor_ops.fused_linear_cross_entropy(dual, W, target, None, -100, "mean", 4, False, 0.0, 0.0,
                                                            None)


def test_out_with_a_tangent_is_refused_in_words():
    """out= records no tangent (torch refuses out= under forward AD too): the
    refusal names the tangent, not 'an argument requires grad ()'."""
    x = torch.randn(3, 8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.randn_like(x))
        with pytest.raises(ValueError, match="carries a tangent"):
            tensor_ops.silu(dual, out=torch.empty(3, 8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widened_half_linear_carries_tangents(dtype, monkeypatch):
    """A prepared half-precision Linear whose GEMM is widened to fp32 (Note
    [half GEMMs in fp32]; forced here) raised under torch.func.jvp and with
    dual tensors (its Function has neither rule)."""
    import copy

    monkeypatch.setenv("TENSOR_OPS_HALF_GEMM", "fp32")
    from tensor_ops.torch import modules

    monkeypatch.setattr(modules, "_HALF_POLICY", {})
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Linear(40, 4)).to(dtype)
    got, _ = tt.prepare_model(copy.deepcopy(ref), "O1")
    x, t = torch.randn(20, 8, dtype=dtype), torch.randn(20, 8, dtype=dtype)
    ref32 = copy.deepcopy(ref).float()
    want = torch.func.jvp(lambda a: ref32(a.float()), (x,), (t,))[1]
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(torch.func.jvp(got, (x,), (t,))[1].float(), want, rtol=2e-2, atol=2e-2)
            with fwAD.dual_level():
                tangent = fwAD.unpack_dual(got(fwAD.make_dual(x, t))).tangent
            torch.testing.assert_close(tangent.float(), want, rtol=2e-2, atol=2e-2)


def test_out_lane_on_a_torch_whose_version_counter_takes_one_tensor(monkeypatch):
    """torch 2.4's torch._C._increment_version takes one tensor, not a tuple
    (pyproject allows torch>=2.4): the out= fast lane works there too."""
    from tensor_ops import _arrays

    real = torch._C._increment_version

    def one_tensor(t):
        if not isinstance(t, torch.Tensor):
            raise RuntimeError("increment_version expect a Tensor as input")
        real(t)

    monkeypatch.setattr(torch._C, "_increment_version", one_tensor)
    monkeypatch.setattr(_arrays, "_increment_version", None)
    x, o = torch.randn(3, 8), torch.empty(3, 8)
    v = o._version
    assert tensor_ops.silu(x, out=o) is o and o._version > v
    torch.testing.assert_close(o, F.silu(x))


@pytest.mark.parametrize("causal,alignment,lq,lk", [(False, "bottom_right", 5, 7), (True, "bottom_right", 5, 7),
                                                     (True, "top_left", 6, 6), (True, "bottom_right", 6, 4)])
def test_attention_lse_is_differentiable(causal, alignment, lq, lk):
    """Note [the log-sum-exp's gradient] (custom_ops.py): a loss that uses
    attention's lse (return_lse=True: merging partial attentions, a z-loss)
    lost that term of its gradients silently (lse recorded no gradient)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, lq, 8), torch.randn(2, 2, lk, 8), torch.randn(2, 2, lk, 8)
    c, cl = torch.randn(2, 4, lq, 8), torch.randn(2, 4, lq)

    def ref(q, k, v):
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        s = q @ kk.transpose(-1, -2) / math.sqrt(8)
        if causal:
            keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq if alignment == "bottom_right" else 0)
            s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        seen = torch.isfinite(lse)
        p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, lse, 0.0)[..., None]), 0.0)
        return p @ vv, torch.where(seen, lse, 0.0)

    r = [t.double().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = ref(*r)
    ((o_ref * c.double()).sum() + (lse_ref * cl.double()).sum()).backward()
    g = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = tt.attention(*g, causal=causal, causal_alignment=alignment, return_lse=True)
    seen = torch.isfinite(lse)
    ((o * c).sum() + (torch.where(seen, lse, 0.0) * cl).sum()).backward()
    for got, want in zip(g, r):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


def test_attention_lse_second_derivative_and_transforms():
    """LseGrad's backward is torch's ops on P = softmax(s): a second
    derivative through it (create_graph) matched torch's logsumexp only when
    P came from s itself (from the saved lse it was 0.13 off on 0.9);
    vmap over a call that uses lse keeps its term (the batched q showed no
    requires_grad: it was dropped); torch.func.jvp of lse works."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    c = torch.randn(1, 2, 5, 8)

    def lse_ref(qq):
        return torch.logsumexp(qq @ k.double().transpose(-1, -2) / math.sqrt(8), -1)

    qr = q.double().requires_grad_()
    g_ref, = torch.autograd.grad(lse_ref(qr).sum(), qr, create_graph=True)
    h_ref, = torch.autograd.grad((g_ref * c.double()).sum(), qr)
    qg = q.clone().requires_grad_()
    g, = torch.autograd.grad(tt.attention(qg, k, v, return_lse=True)[1].sum(), qg, create_graph=True)
    h, = torch.autograd.grad((g * c).sum(), qg)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-4, atol=1e-6)
    # vmap of a function using lse, then backward: the same as a loop
    qb = torch.randn(3, 1, 2, 5, 8, requires_grad=True)
    f = lambda x: tt.attention(x, k, v, return_lse=True)[1].sum()  # noqa: E731
    torch.func.vmap(f)(qb).sum().backward()
    looped = torch.stack([_grad_of(f, qb[i].detach()) for i in range(3)])
    torch.testing.assert_close(qb.grad, looped, rtol=1e-5, atol=1e-6)
    # forward mode through lse
    t = torch.randn_like(q)
    _, tan = torch.func.jvp(lambda x: tt.attention(x, k, v, return_lse=True)[1], (q,), (t,))
    _, want = torch.func.jvp(lambda x: lse_ref(x), (q.double(),), (t.double(),))
    torch.testing.assert_close(tan.double(), want, rtol=1e-4, atol=1e-5)


def _grad_of(f, x):
    x = x.requires_grad_()
    return torch.autograd.grad(f(x), x)[0]
