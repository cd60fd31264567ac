"""tensor_ops.torch: custom ops (schema, fake kernels, autograd), modules,
prepare_model / validate_model, the factory API, and a small Llama-style
model prepared at O1 / O2 / O3 against the same model in plain torch."""
import copy
import functools
import json
import math
import os
import subprocess
import sys

import pytest
import numpy as np

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tensor_ops  # noqa: E402
import tensor_ops.torch as tt  # noqa: E402
from tensor_ops.torch import custom_ops, factory  # noqa: E402


# ---- the model the acceptance tests, the DDP test and the benchmark share ----

class GatedMLP(nn.Module):
    """An HF-style gated MLP (gate / up / down Linear, act_fn): what prepare_model turns into a SwiGLU."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(hidden, inter), nn.Linear(hidden, inter), nn.Linear(inter, hidden)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rope_ref(x, cos, sin):
    """NeoX rotary embedding of x [B, H, S, D] with tables [S, D / 2]."""
    half = cos.shape[-1]
    c, s = cos[None, None], sin[None, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


class LlamaAttention(nn.Module):
    def __init__(self, E, H, Hkv):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, E // H
        self.q_proj = nn.Linear(E, H * self.D, bias=False)
        self.k_proj = nn.Linear(E, Hkv * self.D, bias=False)
        self.v_proj = nn.Linear(E, Hkv * self.D, bias=False)
        self.o_proj = nn.Linear(H * self.D, E, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.H, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.Hkv, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.Hkv, self.D).transpose(1, 2)
        q, k = rope_ref(q, cos[:S], sin[:S]), rope_ref(k, cos[:S], sin[:S])
        g = self.H // self.Hkv
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(B, S, -1))


class LlamaMLP(nn.Module):
    """HF LlamaMLP's structure and names."""

    def __init__(self, E, FF):
        super().__init__()
        self.gate_proj = nn.Linear(E, FF, bias=False)
        self.up_proj = nn.Linear(E, FF, bias=False)
        self.down_proj = nn.Linear(FF, E, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, E, H, Hkv, FF):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(E, eps=1e-6)
        self.self_attn = LlamaAttention(E, H, Hkv)
        self.post_attention_layernorm = nn.RMSNorm(E, eps=1e-6)
        self.mlp = LlamaMLP(E, FF)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab=96, E=64, H=4, Hkv=2, FF=160, layers=2, max_pos=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, E)
        self.layers = nn.ModuleList(LlamaBlock(E, H, Hkv, FF) for _ in range(layers))
        self.norm = nn.RMSNorm(E, eps=1e-6)
        self.lm_head = nn.Linear(E, vocab, bias=False)
        D = E // H
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def tiny_llama(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyLlama(**kw)


def rel_err(got, ref):
    ref = ref.detach().double()
    return ((got.detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ---- registration -----------------------------------------------------------

def test_importing_tensor_ops_does_not_import_torch():
    code = "import sys, tensor_ops; assert 'torch' not in sys.modules; import tensor_ops.torch; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_every_op_is_a_torch_op():
    core = set(tensor_ops.ops.__all__) | {"rms_norm", "silu", "gelu"}
    assert set(custom_ops.OPS) == core
    for name in core:
        assert hasattr(torch.ops.tensor_ops, name), name


def _opcheck_cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape, grad=True):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    def n(*shape):
        return r(*shape, grad=False)

    cos, sin = n(16, 4), n(16, 4)
    q, k, v = r(2, 4, 5, 8), r(2, 2, 7, 8), r(2, 2, 7, 8)
    out, lse = custom_ops.OPS["attention"](q.detach(), k.detach(), v.detach())
    logits, target = r(6, 11), torch.tensor([1, 2, -100, 4, 5, 0])
    return {
        "rms_norm": (r(3, 8), r(8), 1e-6),
        "layer_norm": (r(3, 8), r(8), r(8), 1e-5),
        "add_rms_norm": (r(3, 8), r(3, 8), r(8), 1e-6),
        "silu": (r(3, 8),),
        "gelu": (r(3, 8), "tanh"),
        "softmax": (r(3, 5, 8), 1, 0.5, False),
        "log_softmax": (r(3, 8), -1, 1.0, True),
        "swiglu": (r(3, 8), r(3, 8)),
        "geglu": (r(3, 8), r(3, 8), "tanh"),
        "rope": (r(2, 5, 3, 8), cos, sin, torch.randint(0, 16, (2, 5), generator=g), False),
        "attention": (q, k, v, True, 0.3),
        "cross_entropy": (logits, target, -100, "mean"),
        "cross_entropy_with_grad": (logits, target, -100, "none"),
        "linear": (r(2, 3, 8), r(5, 8), r(5)),
        "rms_norm_backward": (n(3, 8), n(3, 8), n(8), 1e-6),
        "layer_norm_backward": (n(3, 8), n(3, 8), n(8), 1e-5),
        "silu_backward": (n(3, 8), n(3, 8)),
        "gelu_backward": (n(3, 8), n(3, 8), "none"),
        "swiglu_backward": (n(3, 8), n(3, 8), n(3, 8)),
        "geglu_backward": (n(3, 8), n(3, 8), n(3, 8), "none"),
        "softmax_backward": (n(3, 8), torch.softmax(n(3, 8), 0), 0, 1.0),
        "log_softmax_backward": (n(3, 8), torch.log_softmax(n(3, 8), -1), -1, 1.0),
        "rope_backward": (n(2, 5, 3, 8), cos, sin, None, True),
        "attention_backward": (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, False, None),
    }


@pytest.mark.parametrize("name", sorted(_opcheck_cases()))
def test_opcheck(name):
    """Schema, autograd registration, fake kernel vs real (shapes, strides,
    dtypes) and AOT dispatch with dynamic shapes: torch's own custom op check."""
    torch.library.opcheck(custom_ops.OPS[name], _opcheck_cases()[name])


def test_fake_kernels_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 5, 8, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 7, 8, dtype=torch.bfloat16)
        out, lse = custom_ops.OPS["attention"](q, k, k, True, None)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
        logits, target = torch.empty(6, 11, dtype=torch.float16), torch.zeros(6, dtype=torch.int64)
        for reduction, shape in [("mean", ()), ("sum", ()), ("none", (6,))]:
            loss, dl = custom_ops.OPS["cross_entropy_with_grad"](logits, target, -100, reduction)
            assert loss.shape == shape and loss.dtype == torch.float32
            assert dl.shape == logits.shape and dl.dtype == torch.float16
            assert custom_ops.OPS["cross_entropy"](logits, target, -100, reduction).shape == shape
        y = custom_ops.OPS["softmax"](torch.empty(3, 5, 8), 1, 1.0, False)
        assert y.shape == (3, 5, 8)


# ---- values and gradients against torch autograd ------------------------------

@pytest.fixture(params=["function", "custom_op"])
def eager_path(request, monkeypatch):
    """Eager calls through the autograd.Function (the default) or through the
    torch custom op and its registered autograd."""
    monkeypatch.setattr(tt.functional, "EAGER_FUNCTIONS", request.param == "function")
    return request.param


def causal_mask(rows, cols):
    return torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows)


def ref_softmax(x, dim, scale, causal, log=False):
    s = x * scale
    if causal:
        s = s.masked_fill(~causal_mask(*s.shape[-2:]), float("-inf"))
    return torch.log_softmax(s, dim) if log else torch.softmax(s, dim)


def ref_rope(x, cos, sin, pos, interleaved):  # x [B, S, H, D], pos [B, S]
    c, s = cos[pos][:, :, None, :], sin[pos][:, :, None, :]
    half = c.shape[-1]
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def ref_attention(q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~causal_mask(*s.shape[-2:]), float("-inf"))
    return torch.softmax(s, -1) @ v


def _pos():
    return torch.tensor([[3, 0, 7, 1, 2], [5, 5, 9, 4, 0]])


# name: (ours, reference, input shapes); every input gets a gradient
GRAD_CASES = {
    "rms_norm": (lambda x, w: tt.rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (33,), w, 1e-6),
                 [(4, 33), (33,)]),
    "layer_norm": (lambda x, w, b: tt.layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (33,), w, b, 1e-5),
                   [(4, 33), (33,), (33,)]),
    "layer_norm_no_bias": (lambda x, w: tt.layer_norm(x, w, None, 1e-5),
                           lambda x, w: F.layer_norm(x, (33,), w, None, 1e-5), [(4, 33), (33,)]),
    "add_rms_norm": (lambda x, r, w: torch.cat(tt.add_rms_norm(x, r, w, 1e-6)),
                     lambda x, r, w: torch.cat([F.rms_norm(x + r, (33,), w, 1e-6), x + r]),
                     [(4, 33), (4, 33), (33,)]),
    "silu": (tt.silu, F.silu, [(4, 33)]),
    "gelu": (tt.gelu, F.gelu, [(4, 33)]),
    "gelu_tanh": (lambda x: tt.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"), [(4, 33)]),
    "softmax_dim1": (lambda x: tt.softmax(x, 1, 0.7), lambda x: ref_softmax(x, 1, 0.7, False), [(3, 9, 5)]),
    "softmax_causal": (lambda x: tt.softmax(x, -1, 1.0, True), lambda x: ref_softmax(x, -1, 1.0, True), [(2, 6, 9)]),
    "log_softmax": (lambda x: tt.log_softmax(x, -1, 0.5), lambda x: ref_softmax(x, -1, 0.5, False, True),
                    [(3, 17)]),
    "swiglu": (tt.swiglu, lambda g, u: F.silu(g) * u, [(4, 33), (4, 33)]),
    "geglu": (lambda g, u: tt.geglu(g, u, "tanh"), lambda g, u: F.gelu(g, approximate="tanh") * u,
              [(4, 33), (4, 33)]),
    "rope": (lambda x: tt.rope(x, *_tables(x), _pos(), False), lambda x: ref_rope(x, *_tables(x), _pos(), False),
             [(2, 5, 3, 12)]),
    "rope_interleaved": (lambda x: tt.rope(x, *_tables(x), _pos(), True),
                         lambda x: ref_rope(x, *_tables(x), _pos(), True), [(2, 5, 3, 12)]),
    "attention_gqa_causal": (lambda q, k, v: tt.attention(q, k, v, True),
                             lambda q, k, v: ref_attention(q, k, v, True, 1 / math.sqrt(16)),
                             [(2, 4, 7, 16), (2, 2, 7, 16), (2, 2, 7, 16)]),
    "attention_scale": (lambda q, k, v: tt.attention(q, k, v, False, 0.3),
                        lambda q, k, v: ref_attention(q, k, v, False, 0.3),
                        [(1, 2, 5, 8), (1, 2, 9, 8), (1, 2, 9, 8)]),
}


def _tables(x):
    inv = 1.0 / 10000 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 12)
    ang = torch.arange(10, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(x.dtype), ang.sin().to(x.dtype)


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_values_and_gradients_match_torch(name, eager_path):
    ours, ref, shapes = GRAD_CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    xs = [torch.randn(s) for s in shapes]
    a = [x.clone().requires_grad_() for x in xs]
    b = [x.double().requires_grad_() for x in xs]
    y, y_ref = ours(*a), ref(*b)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    assert rel_err(y, y_ref) < 1e-5, f"{name} forward"
    dy = torch.randn(y.shape)
    y.backward(dy)
    y_ref.backward(dy.double())
    for i, (ga, gb) in enumerate(zip(a, b)):
        assert rel_err(ga.grad, gb.grad) < 1e-4, f"{name} grad of input {i}"


@pytest.mark.parametrize("loss", ["pow2", "sum"])
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "silu", "gelu", "softmax_causal", "swiglu", "attention_scale"])
def test_second_derivatives_raise_rather_than_miss_terms(name, loss, eager_path):
    """Note [first-order gradients]: our backward kernels record no autograd,
    so differentiating a gradient through them (create_graph=True, then a
    gradient penalty's backward) raises; before, the penalty's gradient
    silently lacked their terms. With a sum() loss the incoming gradient is a
    constant and only the saved inputs require grad: that case was still
    silent (torch's once_differentiable looks at the incoming gradient only).
    First-order gradients with create_graph=True still work."""
    ours, ref, shapes = GRAD_CASES[name]
    torch.manual_seed(3)
    xs = [torch.randn(s).requires_grad_() for s in shapes]
    y = ours(*xs)
    grads = torch.autograd.grad(y.pow(2).sum() if loss == "pow2" else y.sum(), xs, create_graph=True)
    assert all(g is not None for g in grads)
    with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
        sum(g.pow(2).sum() for g in grads).backward()
    # the same through autograd.grad with explicit inputs (a gradient penalty, a
    # Hessian-vector product): autograd prunes what does not reach the inputs,
    # and the mark on a fresh leaf was pruned: a wrong gradient, silently
    # (where torch's second derivative w.r.t. that input is 0, as layer_norm's
    # bias's, ours may give None instead)
    rs = [x.detach().double().requires_grad_() for x in xs]
    y_ref = ref(*rs)
    g_ref = torch.autograd.grad(y_ref.pow(2).sum() if loss == "pow2" else y_ref.sum(), rs, create_graph=True)
    for i in range(len(xs)):
        want, = torch.autograd.grad(sum(g.pow(2).sum() for g in g_ref), [rs[i]], retain_graph=True, allow_unused=True)
        y = ours(*xs)
        grads = torch.autograd.grad(y.pow(2).sum() if loss == "pow2" else y.sum(), xs, create_graph=True)
        if want is None or not want.any():
            got, = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), [xs[i]], allow_unused=True)
            assert got is None or not got.any()
            continue
        with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
            torch.autograd.grad(sum(g.pow(2).sum() for g in grads), [xs[i]], allow_unused=True)


def test_torch_func_second_derivatives_raise():
    """torch.func's grad of grad / jacrev of jacrev through our backward
    kernels raises (it gave zeros: a GELU Hessian diagonal of 0 where torch's
    is [-0.05, 0.73, ...]); one level (grad, jacrev, vmap of grad) still works."""
    from torch.func import grad, jacrev, vmap

    x = torch.randn(6)
    with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
        jacrev(jacrev(lambda a: tt.gelu(a).sum()))(x)
    with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
        grad(lambda a: grad(lambda b: tt.silu(b).sum())(a).sum())(x)
    # A grad of a vjp (a Hessian-vector product): the vjp's backward runs at the
    # outer grad's level, which the interpreter stack does not tell from a plain
    # grad; it gave zeros. Now the backward op's refusal raises. Also through the
    # op API (tensor_ops.gelu on functorch's tensors: Note [ops that autograd would record]).
    v = torch.randn(6)
    for f in (tt.gelu, tensor_ops.gelu, lambda a: tt.rms_norm(a, torch.ones(6))):
        with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
            grad(lambda a: torch.func.vjp(f, a)[1](v)[0].sum())(x)
        with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
            torch.func.vjp(grad(lambda a: f(a).sum()), x)[1](v)
    assert rel_err(grad(lambda a: tensor_ops.gelu(a).sum())(x), grad(lambda a: F.gelu(a).sum())(x)) < 1e-5
    assert rel_err(grad(lambda a: tt.silu(a).sum())(x), grad(lambda a: F.silu(a).sum())(x)) < 1e-5
    xs = torch.randn(3, 6)
    assert rel_err(vmap(grad(lambda a: tt.gelu(a).sum()))(xs), vmap(grad(lambda a: F.gelu(a).sum()))(xs)) < 1e-5


def test_torch_func_cross_entropy():
    """Cross-entropy under torch.func: a grad of a vjp raises (dlogits is
    the forward kernel's, not differentiable: it gave zeros), and per-sample
    gradients (vmap of grad) are torch's (they raised on a float() of a
    batched tensor)."""
    from torch.func import grad, vjp, vmap

    torch.manual_seed(0)
    x, tgt = torch.randn(3, 5), torch.tensor([1, 2, 3])
    for f in (lambda t: tt.cross_entropy(t, tgt), lambda t: tensor_ops.cross_entropy(t, tgt)):
        with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
            grad(lambda t: vjp(f, t)[1](torch.tensor(1.0))[0].pow(2).sum())(x)
        assert rel_err(grad(f)(x), grad(lambda t: F.cross_entropy(t, tgt))(x)) < 1e-5
    per_sample = vmap(grad(lambda t, y: tt.cross_entropy(t[None], y[None])))(x, tgt)
    want = vmap(grad(lambda t, y: F.cross_entropy(t[None], y[None])))(x, tgt)
    assert rel_err(per_sample, want) < 1e-5


def test_backward_ops_refuse_derivatives_when_used():
    """A backward op called where autograd records (its input requires grad)
    gives outputs that raise when differentiated, eager and compiled; a
    compiled graph whose loss does not use them still trains (the refusal
    is deferred to run time: zero incoming gradients give zeros)."""
    from tensor_ops.torch import functional as TF

    x = torch.randn(4, 8, requires_grad=True)

    def g(a):
        return TF.gelu(a), TF.gelu_backward(torch.ones_like(a), a)

    y, d = g(x)
    with pytest.raises(RuntimeError, match="gelu_backward's output was differentiated"):
        d.sum().backward()
    compiled = torch.compile(g, fullgraph=True, backend="aot_eager")
    y, d = compiled(x)
    y.sum().backward()
    xr = x.detach().clone().requires_grad_()
    F.gelu(xr).sum().backward()
    assert rel_err(x.grad, xr.grad) < 1e-5
    y, d = compiled(x)
    with pytest.raises(RuntimeError, match="gelu_backward's output was differentiated"):
        (y.sum() + d.sum()).backward()
    # a zero incoming gradient contributes zeros, eager as compiled
    x.grad = None
    y, d = g(x)
    (y.sum() + 0 * d.sum()).backward()
    assert rel_err(x.grad, xr.grad) < 1e-5


def test_op_api_with_requires_grad_arguments():
    """Note [ops that autograd would record]: numpy arguments beside a
    torch tensor that requires grad are read as torch tensors; a Parameter
    under no_grad / inference_mode records nothing."""
    x = torch.randn(3, 8, requires_grad=True)
    y = tensor_ops.rms_norm(x, np.ones(8, np.float32))
    assert y.grad_fn is not None
    torch.testing.assert_close(y, F.rms_norm(x, (8,), torch.ones(8), 1e-6))
    w = torch.nn.Parameter(torch.rand(8) + 0.5)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            assert not tensor_ops.rms_norm(torch.randn(3, 8), w).requires_grad
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"out=ndarray\[3, 8\]"):
        tensor_ops.rms_norm(x, w, out=np.empty((3, 8), np.float32))


def test_gradient_penalty_through_a_prepared_model_raises(eager_path):
    """A WGAN-GP / R1 penalty's gradient w.r.t. the parameters through a
    prepared Linear -> GELU -> Linear: raised, not 0.531 for torch's 0.597."""
    torch.manual_seed(0)
    got, _ = tt.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)), "O1")
    xi = torch.randn(5, 8, requires_grad=True)
    g, = torch.autograd.grad(got(xi).sum(), xi, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative through this op's backward kernel"):
        torch.autograd.grad((g.norm(2, dim=1) - 1).pow(2).mean(), list(got.parameters()), allow_unused=True)


@pytest.mark.parametrize("shape", [(2, 6, 9), (1, 4, 2)])
def test_causal_log_softmax_masked_columns_get_no_gradient(shape, eager_path):
    """A causal log_softmax's masked columns (and a row that sees none, when
    rows > cols) do not reach the output, so their gradient is 0, as torch's
    masked_fill(-inf) then log_softmax gives; the backward gave them dy."""
    torch.manual_seed(5)
    x = torch.randn(shape)
    dy = torch.randn(shape)
    a, b = x.clone().requires_grad_(), x.double().requires_grad_()
    tt.log_softmax(a, -1, 1.0, True).backward(dy)
    ref_softmax(b, -1, 1.0, True, log=True).backward(dy.double())
    masked = ~causal_mask(*shape[-2:])
    assert (a.grad[..., masked] == 0).all()
    assert rel_err(a.grad, torch.nan_to_num(b.grad)) < 1e-5


def test_torch_func_transforms_over_prepared_modules():
    """Note [torch.func]: vmap (with and without gradients recorded), grad,
    jacrev and per-sample gradients (vmap of grad) over a prepared model give
    torch's answers; they raised (the ctx-style Function, the direct lane
    reading functorch's wrappers)."""
    from torch.func import functional_call, grad, jacrev, vmap

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.SiLU(),
                        nn.RMSNorm(16), nn.Linear(16, 1))
    got, _ = tt.prepare_model(copy.deepcopy(ref), "O1")
    x = torch.randn(6, 8)
    for m in (ref, got):
        m.zero_grad()
    runs = {
        "vmap": lambda m: vmap(m)(x[:, None]),
        "vmap no_grad": lambda m: torch.no_grad()(lambda: vmap(m)(x[:, None]))(),
        "grad": lambda m: grad(lambda xi: m(xi).sum())(x),
        "jacrev": lambda m: jacrev(lambda xi: m(xi).sum(0))(x),
        "per-sample grads": lambda m: vmap(grad(lambda p, xi: functional_call(m, p, (xi[None],)).sum()),
                                           in_dims=(None, 0))(dict(m.named_parameters()), x)["0.weight"],
    }
    for name, run in runs.items():
        torch.testing.assert_close(run(got), run(ref), rtol=1e-5, atol=1e-6, msg=name)
    xs = torch.randn(5, 3, 16)
    torch.testing.assert_close(vmap(lambda t: tt.softmax(t, -1))(xs), torch.softmax(xs, -1))
    # the op API too (it raised: functorch's tensors have no data the core reads)
    torch.testing.assert_close(vmap(tensor_ops.gelu)(xs), F.gelu(xs))
    torch.testing.assert_close(vmap(lambda t: tensor_ops.rms_norm(t, torch.ones(16)))(xs),
                               F.rms_norm(xs, (16,), torch.ones(16), 1e-6))


def test_fused_linear_activation_under_bf16_autocast():
    """Linear + activation (prepare_model_with_custom_kernels) under CPU bf16
    autocast: the forward's GEMM runs in bf16 on fp32 parameters, and the
    backward gives fp32 gradients close to torch's own under the same
    autocast (it raised: bf16 dh times the fp32 weight)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8))
    got, _ = tt.prepare_model_with_custom_kernels(copy.deepcopy(ref), "O1")
    x = torch.randn(4, 16)
    for m in (ref, got):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
    for p, q in zip(ref.parameters(), got.parameters()):
        assert q.grad.dtype == p.dtype == torch.float32
        assert rel_err(q.grad, p.grad) < 2e-2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_value_and_gradient(reduction, eager_path):
    torch.manual_seed(1)
    logits = torch.randn(7, 13)
    target = torch.randint(0, 13, (7,))
    target[3] = -100
    a, b = logits.clone().requires_grad_(), logits.double().requires_grad_()
    loss, ref = tt.cross_entropy(a, target, reduction=reduction), F.cross_entropy(b, target, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert rel_err(loss, ref) < 1e-5
    g = torch.rand(loss.shape) + 0.5
    loss.backward(g)
    ref.backward(g.double())
    assert rel_err(a.grad, b.grad) < 1e-5
    # the loss-only op (what torch.ops.tensor_ops.cross_entropy is when called directly) agrees
    c = logits.clone().requires_grad_()
    torch.ops.tensor_ops.cross_entropy(c, target, -100, reduction).backward(g)
    assert rel_err(c.grad, b.grad) < 1e-5


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_cross_entropy_ignored_rows_at_an_infinite_scale(reduction, eager_path):
    """Note [ignored rows at an infinite loss scale]: HF's sum / num_items_in_batch
    with every label ignored divides by 0; torch's gradients stay 0 (finite),
    ours were 0 * inf = NaN on every ignored row."""
    torch.manual_seed(2)
    logits = torch.randn(6, 11)
    for target in (torch.full((6,), -100), torch.tensor([1, -100, 2, -100, 3, 4])):
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        scale = torch.tensor(0.0) if reduction != "none" else torch.tensor([0.0, 1, 0, 1, 0, 0])
        (tt.cross_entropy(a, target, reduction=reduction) / scale).sum().backward()
        (F.cross_entropy(b, target, reduction=reduction) / scale).sum().backward()
        ignored = target == -100
        assert torch.count_nonzero(a.grad[ignored]) == 0 and torch.count_nonzero(b.grad[ignored]) == 0
        # the rows that count are infinite in both (torch has NaN at the target: -inf + inf)
        assert torch.equal(a.grad.isfinite().all(1), b.grad.isfinite().all(1)), (a.grad, b.grad)


def test_cross_entropy_backward_uses_the_forward_gradient(monkeypatch, eager_path):
    calls = []
    fused = tensor_ops.cross_entropy_with_grad
    monkeypatch.setattr(tensor_ops, "cross_entropy_with_grad", lambda *a, **k: calls.append(1) or fused(*a, **k))
    logits = torch.randn(5, 9, requires_grad=True)
    tt.cross_entropy(logits, torch.randint(0, 9, (5,))).backward()
    assert len(calls) == 1 and logits.grad is not None
    with torch.no_grad():  # no gradient wanted: the loss-only kernel, no dlogits written
        tt.cross_entropy(logits, torch.randint(0, 9, (5,)))
    assert len(calls) == 1


def test_cross_entropy_backward_hands_back_the_forward_gradient(monkeypatch, eager_path):
    """A plain loss.backward() (incoming gradient 1) passes the forward's
    dlogits on as it is: no multiply and no second [N, C] buffer; any other
    gradient scales a copy, so a dlogits the caller holds stays as it was."""
    made = []
    fused = tensor_ops.cross_entropy_with_grad
    monkeypatch.setattr(tensor_ops, "cross_entropy_with_grad", lambda *a, **k: made.append(fused(*a, **k)) or made[-1])
    torch.manual_seed(2)
    x, w = torch.randn(6, 5, requires_grad=True), torch.randn(5, 11)
    target = torch.randint(0, 11, (6,))
    logits = x @ w
    seen = []
    logits.register_hook(lambda g: seen.append(g))
    tt.cross_entropy(logits, target).backward()
    assert seen[0].data_ptr() == made[0][1].data_ptr()
    ref = x.detach().double().requires_grad_()
    F.cross_entropy(ref @ w.double(), target).backward()
    assert rel_err(x.grad, ref.grad) < 1e-5
    # a gradient other than 1, through the op whose dlogits the caller sees
    logits2 = torch.randn(6, 11, requires_grad=True)
    loss, dl = tt.cross_entropy_with_grad(logits2, target)
    before = dl.clone()
    (loss * 0.25).backward()
    assert torch.equal(dl, before)
    assert torch.allclose(logits2.grad, before * 0.25)


def test_cross_entropy_leaf_gradient_is_the_forward_buffer(monkeypatch, eager_path):
    """Note [the gradient handed over]: in eager mode logits.grad of a leaf is
    the buffer the forward wrote (autograd is handed the only reference, so
    it does not copy); a second backward through a retained graph computes
    it again, and the gradients add up."""
    made = []  # the data pointers of the forward's dlogits (a reference kept here would make autograd copy)
    fused = tensor_ops.cross_entropy_with_grad
    monkeypatch.setattr(tensor_ops, "cross_entropy_with_grad",
                        lambda *a, **k: (lambda r: made.append(r[1].data_ptr()) or r)(fused(*a, **k)))
    torch.manual_seed(3)
    logits = torch.randn(6, 11, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    loss = tt.cross_entropy(logits, target)
    loss.backward(retain_graph=True)
    if eager_path == "function":
        assert logits.grad.data_ptr() == made[0]
    ref = logits.detach().double().requires_grad_()
    F.cross_entropy(ref, target).backward()
    assert rel_err(logits.grad, ref.grad) < 1e-5
    first = logits.grad.clone()
    loss.backward(torch.tensor(0.5))
    assert rel_err(logits.grad, 1.5 * first) < 1e-6


def test_attention_lse_is_float32_and_differentiable(eager_path):
    """lse records its gradient (Note [the log-sum-exp's gradient]); it was
    non-differentiable, and a loss using it lost that term silently."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    out, lse = tt.attention(q, q, q, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (1, 2, 4)
    assert out.requires_grad and lse.requires_grad
    lse.sum().backward()
    assert q.grad.dtype == torch.bfloat16 and bool(q.grad.abs().sum() > 0)


def test_strided_inputs_and_gradients(eager_path):
    torch.manual_seed(2)
    x = torch.randn(33, 4).t().requires_grad_()  # [4, 33], not contiguous
    w = torch.randn(33, requires_grad=True)
    y = tt.rms_norm(x, w, 1e-6)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    assert rel_err(y, F.rms_norm(x64, (33,), w64, 1e-6)) < 1e-5
    y.sum().backward()  # an expanded (stride 0) incoming gradient
    F.rms_norm(x64, (33,), w64, 1e-6).sum().backward()
    assert rel_err(x.grad, x64.grad) < 1e-4 and rel_err(w.grad, w64.grad) < 1e-4
    q = torch.randn(2, 5, 4, 8).transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
    assert rel_err(tt.attention(q, q, q, True), ref_attention(q.double(), q.double(), q.double(), True,
                                                              1 / math.sqrt(8))) < 1e-5


def test_ops_compile_fullgraph():
    def f(x, w, gate, up, logits, target):
        h = tt.rms_norm(x, w, 1e-6) + tt.layer_norm(x, w, None, 1e-5)
        s = tt.softmax(h, -1, 0.5) + tt.swiglu(gate, up) + tt.gelu(gate, "tanh")
        a = tt.attention(s[None, None], s[None, None], s[None, None], True)
        return a.sum() + tt.cross_entropy(logits, target)

    torch.manual_seed(3)
    args = [torch.randn(6, 16, requires_grad=True), torch.randn(16, requires_grad=True),
            torch.randn(6, 16, requires_grad=True), torch.randn(6, 16, requires_grad=True),
            torch.randn(6, 10, requires_grad=True), torch.randint(0, 10, (6,))]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    grads = torch.autograd.grad(got, args[:5])
    ref = f(*args)
    ref_grads = torch.autograd.grad(ref, args[:5])
    assert rel_err(got, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-6


# ---- modules --------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: (nn.RMSNorm(24, eps=1e-5), tt.RMSNorm(24, eps=1e-5)),
    lambda: (nn.RMSNorm((3, 8)), tt.RMSNorm((3, 8))),
    lambda: (nn.RMSNorm(24, elementwise_affine=False), tt.RMSNorm(24, elementwise_affine=False)),
    lambda: (nn.LayerNorm(24), tt.LayerNorm(24)),
    lambda: (nn.LayerNorm(24, bias=False), tt.LayerNorm(24, bias=False)),
    lambda: (nn.LayerNorm((3, 8), eps=1e-3), tt.LayerNorm((3, 8), eps=1e-3)),
    lambda: (nn.LayerNorm(24, elementwise_affine=False), tt.LayerNorm(24, elementwise_affine=False)),
], ids=["rms", "rms_2d", "rms_no_affine", "ln", "ln_no_bias", "ln_2d", "ln_no_affine"])
def test_norm_modules_load_torch_state_dict(make):
    torch.manual_seed(4)
    theirs, ours = make()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    assert ours.load_state_dict(theirs.state_dict()) is not None
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(5, *theirs.normalized_shape)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, ref = ours(xa), theirs(xb)
    assert rel_err(y, ref) < 1e-5
    dy = torch.randn(y.shape)
    y.backward(dy)
    ref.backward(dy)
    assert rel_err(xa.grad, xb.grad) < 1e-4
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-4


def test_rms_norm_module_in_bf16_and_default_eps():
    torch.manual_seed(5)
    theirs = nn.RMSNorm(64).to(torch.bfloat16)  # eps=None: finfo(bf16).eps
    ours = tt.RMSNorm(64).to(torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = ours(x)
    assert y.dtype == torch.bfloat16 and rel_err(y, theirs(x)) < 2e-2


def test_activation_modules():
    x = torch.randn(3, 10)
    assert rel_err(tt.SiLU()(x), F.silu(x)) < 1e-6
    assert rel_err(tt.GELU("tanh")(x), F.gelu(x, approximate="tanh")) < 1e-6
    assert rel_err(tt.GELU()(x), F.gelu(x)) < 1e-6


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_swiglu_loads_hf_mlp_state_dict(activation):
    torch.manual_seed(6)
    hf = LlamaMLP(16, 40)
    if activation == "gelu_tanh":
        hf.act_fn = nn.GELU(approximate="tanh")
    ours = tt.SwiGLU(16, 40, activation=activation)
    ours.load_state_dict(hf.state_dict())
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())
    x = torch.randn(2, 3, 16)
    assert rel_err(ours(x), hf(x)) < 1e-5
    with pytest.raises(ValueError, match="activation"):
        tt.SwiGLU(16, 40, activation="relu")


def test_attention_module_matches_sdpa():
    torch.manual_seed(7)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(tt.Attention(causal=True)(q, k, v), ref) < 1e-5
    assert "causal=True" in repr(tt.Attention(causal=True))


# ---- prepare_model ------------------------------------------------------------------

@pytest.mark.parametrize("text,level", [("O2", 2), ("o0", 0), ("balanced", 2), ("AGGRESSIVE", 3), ("none", 0),
                                        ("Conservative", 1), ("3", 3), (1, 1)])
def test_optimization_level_from_string(text, level):
    assert tt.OptimizationLevel.from_string(text) == level


def test_optimization_level_rejects_unknown():
    with pytest.raises(ValueError, match="O0 .none."):
        tt.OptimizationLevel.from_string("O4")
    assert tt.OptimizationLevel.BALANCED is tt.OptimizationLevel.O2


def test_float64_models_stay_on_torch_and_say_so():
    """Our kernels take float32 / float16 / bfloat16. A float64 model is left
    as it is, with a warning (it was swapped, then raised DTypeError at its
    first call); a model cast to float64 after prepare_model runs torch's own
    forward in the swapped norms and activations."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.SiLU(),
                        nn.RMSNorm(16))
    x = torch.randn(3, 8, dtype=torch.float64)
    got, result = tt.prepare_model(copy.deepcopy(ref).double(), "O1")
    assert result.success and any("float64" in w for w in result.warnings), result.warnings
    assert all(type(m).__module__.startswith("torch.") for m in got.modules())
    torch.testing.assert_close(got(x), ref.double()(x), rtol=0, atol=0)
    got, result = tt.prepare_model(copy.deepcopy(ref).float(), "O1")
    assert not any("float64" in w for w in result.warnings)
    got.double()
    y = got(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ref(x), rtol=1e-12, atol=1e-12)


def test_prepare_o0_places_only():
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 8))
    ref = model(ids)
    prepared, result = tt.prepare_model(model, "O0")
    assert result.success and result.level is tt.OptimizationLevel.O0
    assert len(result.optimizations_applied) == 1 and "device placement: cpu" in result.optimizations_applied[0]
    assert result.metrics["modules_replaced"] == 0
    assert not any(type(m).__module__.startswith("tensor_ops") for m in prepared.modules())
    assert torch.equal(prepared(ids), ref)


def test_prepare_o1_reports_each_swap():
    model = tiny_llama()
    n_params = sum(p.numel() for p in model.parameters())
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    prepared, result = tt.prepare_model(model, tt.OptimizationLevel.O1)
    assert prepared is model and result.success and result.warnings == []
    # every nn.Linear (7 per layer, lm_head) too: its few-row (decode) calls run our linear kernel
    assert result.optimizations_applied[1:] == ["Linear -> tensor_ops.torch.Linear x15",
                                                "LlamaMLP -> tensor_ops.torch.SwiGLU x2",
                                                "RMSNorm -> tensor_ops.torch.RMSNorm x5"]
    m = result.metrics
    assert m["parameters"] == n_params and m["modules_replaced"] == 22 and m["time_s"] > 0
    assert m["replacements"] == {"RMSNorm -> tensor_ops.torch.RMSNorm": 5, "LlamaMLP -> tensor_ops.torch.SwiGLU": 2,
                                 "Linear -> tensor_ops.torch.Linear": 15}
    assert m["backend"] == "cpu" and m["dtype"] == "torch.float32" and m["parameter_bytes"] == 4 * n_params
    assert list(prepared.state_dict()) == keys
    n_tensors = len(list(model.parameters())) + len(list(model.buffers()))
    assert result.optimizations_applied[0] == f"device placement: cpu (backend cpu), moved 0 of {n_tensors} " \
                                              "parameter/buffer tensors"
    assert json.loads(json.dumps(result.to_dict()))["level"] == "O1"
    # the same Parameter objects: an optimizer built before preparing still trains the model
    assert all(p is params[n] for n, p in prepared.named_parameters())
    assert isinstance(prepared.layers[0].mlp, tt.SwiGLU) and isinstance(prepared.norm, tt.RMSNorm)
    _, again = tt.prepare_model(prepared, "O1")
    assert again.metrics["modules_replaced"] == 0 and "no module" in again.warnings[0]


class LlamaRMSNorm(nn.Module):
    """HF's LlamaRMSNorm (computes in fp32, casts back)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


def test_prepare_o1_swaps_hf_norms_activations_and_warns_on_odd_mlps():
    torch.manual_seed(8)
    odd = LlamaMLP(8, 16)
    odd.dropout = nn.Dropout(0.0)
    relu = LlamaMLP(8, 16)
    relu.act_fn = nn.ReLU()
    model = nn.Sequential(LlamaRMSNorm(8), nn.LayerNorm(8), nn.GELU("tanh"), nn.SiLU(), odd, relu)
    with torch.no_grad():
        model[0].weight.normal_()
    x = torch.randn(3, 8)
    ref = model[1:4](model[0](x))
    w0 = model[0].weight
    _, result = tt.prepare_model(model, "conservative")
    assert result.metrics["replacements"] == {
        "LlamaRMSNorm -> tensor_ops.torch.HFRMSNorm": 1, "LayerNorm -> tensor_ops.torch.LayerNorm": 1,
        "GELU -> tensor_ops.torch.GELU": 1, "SiLU -> tensor_ops.torch.SiLU": 2,  # one inside the skipped MLP
        "Linear -> tensor_ops.torch.Linear": 6}  # the skipped MLPs' Linears
    assert model[0].weight is w0 and model[0].eps == 1e-6
    assert rel_err(model[1:4](model[0](x)), ref) < 1e-5
    assert len(result.warnings) == 2
    assert "4 (LlamaMLP)" in result.warnings[0] and "dropout" in result.warnings[0]
    assert "5 (LlamaMLP)" in result.warnings[1] and "ReLU" in result.warnings[1]
    assert type(model[4]) is LlamaMLP and type(model[5]) is LlamaMLP
    broken = LlamaRMSNorm(4)
    broken.variance_epsilon = None
    _, result = tt.prepare_model(nn.Sequential(broken), "O1")
    assert type(broken) is LlamaRMSNorm and "float variance_epsilon" in result.warnings[0]


def test_prepare_o3_reduced_precision_and_compile():
    model = tiny_llama(layers=1)
    ids = torch.randint(0, 96, (2, 8))
    ref = model(ids)
    prepared, result = tt.prepare_model(model, "O3", compile_options={"backend": "aot_eager", "fullgraph": True},
                                        example_inputs=(ids,))
    assert result.success and result.level is tt.OptimizationLevel.O3
    assert any("reduced precision" in s and "torch.bfloat16" in s for s in result.optimizations_applied)
    assert result.optimizations_applied[-1] == "torch.compile (backend=aot_eager, fullgraph=True)"
    assert result.metrics["dtype"] == "torch.bfloat16" and result.metrics["warmup_s"] > 0
    no_bf16 = tt.get_backend("cpu").get_device_info().properties.get("has_avx512_bf16") == "0"
    # the swapped Linears compute bf16 GEMMs in fp32 where the CPU has no bf16 GEMM (Note [half GEMMs in fp32])
    widened = tt.modules.half_gemm_in_fp32(torch.bfloat16)
    assert widened == no_bf16 or "TENSOR_OPS_HALF_GEMM" in os.environ
    assert any("without bf16 instructions" in w for w in result.warnings) == (no_bf16 and not widened)
    assert any("bfloat16 GEMMs of the Linear / Conv1D modules computed in float32" in s
               for s in result.optimizations_applied) == widened
    out = prepared(ids)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 5e-2
    x = torch.randn(2, 8)  # floating inputs are cast on entry
    norm, result = tt.prepare_model(nn.RMSNorm(8), "O3", compile_options={"backend": "eager"})
    assert isinstance(norm, tt.RMSNorm) and result.metrics["modules_replaced"] == 1
    assert norm(x).dtype == torch.bfloat16
    mlp, result = tt.prepare_model(LlamaMLP(8, 16), "O1")  # the model itself replaced (and its 3 Linears swapped)
    assert isinstance(mlp, tt.SwiGLU) and result.metrics["modules_replaced"] == 4


def test_prepare_reports_a_failing_example_and_undoes_compile():
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU())
    _, result = tt.prepare_model(model, "O2", compile_options={"backend": "eager"},
                                 example_inputs=(torch.randn(2, 5),))
    assert not result.success
    assert "failed on example_inputs" in result.warnings[0] and result.warnings[1] == "torch.compile undone"
    assert model(torch.randn(2, 4)).shape == (2, 4)


def test_prepare_warns_when_a_host_backend_is_not_the_active_one():
    for name in tt.list_available_backends():
        b = tt.BackendFactory.create(name)
        _, result = tt.prepare_model(nn.SiLU(), "O0", backend=b)
        expected = b.device.type == "cpu" and name != tensor_ops.get_backend()
        assert any("host tensors run on the active backend" in w for w in result.warnings) == expected, name
        with b:
            _, result = tt.prepare_model(nn.SiLU(), "O0", backend=b)
        assert result.warnings == []


def test_prepare_unusable_backend_raises():
    unusable = [b.name for b in tensor_ops.backends() if not b.usable]
    if not unusable:
        pytest.skip("every backend is usable here")
    with pytest.raises(tensor_ops.BackendUnavailableError, match=unusable[0]):
        tt.prepare_model(nn.SiLU(), "O1", backend=unusable[0])


# ---- the factory ------------------------------------------------------------------------

def test_backend_type_aliases():
    B = tt.BackendType
    assert B.NVIDIA is B.CUDA and B.AMD is B.HIP and B.ROCM is B.HIP
    assert B.INTEL is B.SYCL and B.XPU is B.SYCL and B.TPU is B.XLA
    assert B.from_string("NVIDIA") is B.CUDA and B.from_string("rocm") is B.HIP and B.from_string("cpu") is B.CPU
    with pytest.raises(ValueError, match="valid names: .*cuda.*nvidia"):
        B.from_string("metal")


def test_factory_reflects_the_registry():
    statuses = {b.name: b for b in tensor_ops.backends()}
    assert tt.list_available_backends() == tt.BackendFactory.list_available_backends()
    drivable = {n for n, b in statuses.items() if b.usable and factory.torch_reason(n) is None}
    assert set(tt.list_available_backends()) == drivable
    with tensor_ops.use("auto"):
        assert tt.detect_best_backend().value == tensor_ops.get_backend()
    info = {i["name"]: i for i in tt.BackendFactory.get_all_backend_info()}
    assert set(info) == set(statuses)
    for name, i in info.items():
        assert i["usable"] == statuses[name].usable and i["reason"] == statuses[name].reason
        assert len(i["devices"]) == sum(d.backend == name for d in tensor_ops.devices())


def test_staging_backends_hold_host_tensors_and_refuse_another_device():
    """A SYCL backend without torch XPU holds host tensors (its device was
    xpu:0: prepare_model failed in model.to with "Torch not compiled with
    XPU enabled"); a host-staging backend with device_id 1 refuses `with b:`
    and prepare_model in words (device 0 ran while device 1 was reported)."""
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        assert factory.Backend("sycl").device == torch.device("cpu")
    for name in ("opencl", "sycl"):
        b = factory.Backend(name, device_id=1)
        with pytest.raises(tensor_ops.UnsupportedError, match=f"{name}:1: torch tensors on the host run on {name}:0"):
            with b:
                pass
        with pytest.raises(tensor_ops.UnsupportedError, match="device_id 1 cannot be selected"):
            tt.prepare_model(nn.Linear(4, 4), "O1", backend=b)
    with factory.Backend("cpu"):  # device 0 (and the CPU) as before
        pass


def test_factory_errors():
    with pytest.raises(ValueError, match="unknown backend 'metal'; valid names"):
        tt.BackendFactory.create("metal")
    for b in tensor_ops.backends():
        if not b.usable:
            with pytest.raises(tensor_ops.BackendUnavailableError, match=f"'{b.name}' is not usable: .+"):
                tt.BackendFactory.create(b.name)
    shim = next(b for b in tensor_ops.backends() if b.name in ("xla", "tpu"))
    if shim.usable and factory.torch_reason(shim.name) is None:  # jax and torch_xla: TPU resolves to the shim
        assert tt.BackendFactory.create(tt.BackendType.TPU).name == shim.name
    elif shim.usable:  # jax only: torch cannot drive it (issue 17 item 11)
        with pytest.raises(tensor_ops.BackendUnavailableError, match="not usable from torch: .*torch_xla"):
            tt.BackendFactory.create(tt.BackendType.TPU)
        assert shim.name not in tt.list_available_backends()
    else:
        with pytest.raises(tensor_ops.BackendUnavailableError, match="is not usable: .+"):
            tt.BackendFactory.create(tt.BackendType.TPU)
    with pytest.raises(ValueError, match="out of range"):
        tt.BackendFactory.create("cpu", device_id=5)


def test_cpu_backend_object():
    b = tt.BackendFactory.create(tt.BackendType.CPU)
    assert b.name == "cpu" and b.type is tt.BackendType.CPU and b.is_available and b.device_count == 1
    assert b.device == torch.device("cpu")
    info = b.get_device_info()
    assert isinstance(info, tensor_ops.DeviceInfo) and info.to_dict()["backend"] == "cpu"
    assert info == [d for d in tensor_ops.devices() if d.backend == "cpu"][0]
    assert tt.get_backend().name == tensor_ops.get_backend()
    t = b.to_device(torch.ones(2))
    assert t.device.type == "cpu"
    b.synchronize()
    b.empty_cache()
    stats = b.get_memory_stats()
    assert stats["device_total_bytes"] == info.total_memory_bytes and "allocated_bytes.all.current" in stats
    with b as entered:
        assert entered is b and tensor_ops.get_backend() == "cpu"
        with b:
            assert tensor_ops.get_backend() == "cpu"
    assert "cpu" in repr(b)


def test_backend_optimize_for_inference_and_training():
    b = tt.get_backend("cpu")
    model, result = b.optimize_for_inference(tiny_llama(layers=1), level="O1")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert result.optimizations_applied[0].startswith("inference mode")
    assert result.metrics["modules_replaced"] == 12  # 3 RMSNorm, 1 SwiGLU, 8 Linear
    model, result = b.optimize_for_training(nn.Sequential(nn.LayerNorm(4)).eval())
    assert model.training and result.optimizations_applied[0].startswith("training mode")


# ---- validate_model -------------------------------------------------------------------------

def test_validate_model():
    model = tiny_llama(layers=1)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 96, (2, 8))
    v = tt.validate_model(model, ids)
    assert list(v.results) == tt.list_available_backends()
    assert v.passed == sum(r["passed"] for r in v.results.values()) and v.total == len(v.results)
    for r in v.results.values():  # another backend may lack an op: then it says which
        assert r["passed"] or r.get("error") or r["max_rel_error"] > r["tolerance"]
    r = v.results["cpu"]
    assert r["passed"] and r["max_rel_error"] < r["tolerance"] == 1e-4 and r["max_abs_error"] >= 0
    assert all(type(m).__module__ != "tensor_ops.torch.modules" for m in model.modules())
    assert all(torch.equal(t, keys[k]) for k, t in model.state_dict().items())
    assert tt.validate_model(model, ids, backends=["cpu"]).all_passed
    unusable = [b.name for b in tensor_ops.backends() if not b.usable]
    if unusable:
        v = tt.validate_model(model, (ids,), backends=["cpu", unusable[0]])
        assert (v.passed, v.total) == (1, 2) and "not usable" in v.results[unusable[0]]["error"]
    v = tt.validate_model(model, {"ids": ids}, backends=["cpu"], level="O3", compile_options={"backend": "eager"})
    assert v.all_passed and v.results["cpu"]["tolerance"] == 4e-2
    with pytest.raises(ValueError, match="unknown backend"):
        tt.validate_model(model, ids, backends=["metal"])


# ---- acceptance: a small Llama-style model ---------------------------------------------------

def test_llama_o1_same_logits_and_gradients():
    model = tiny_llama()
    prepared, result = tt.prepare_model(copy.deepcopy(model), "O1")
    assert result.metrics["modules_replaced"] == 22
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(9))
    target = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(10))
    logits, ref = prepared(ids), model(ids)
    assert rel_err(logits, ref) < 1e-5
    F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    F.cross_entropy(ref.flatten(0, 1), target.flatten()).backward()
    ref_grads = dict(model.named_parameters())
    for name, p in prepared.named_parameters():
        assert rel_err(p.grad, ref_grads[name].grad) < 1e-4, name


def test_llama_o1_bf16_logits_within_bf16_tolerance():
    model = tiny_llama().to(torch.bfloat16)
    prepared, _ = tt.prepare_model(copy.deepcopy(model), "O1")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(11))
    assert rel_err(prepared(ids), model.double()(ids)) < 3e-2


def test_llama_o1_has_no_graph_break():
    prepared, _ = tt.prepare_model(tiny_llama(), "O1")
    explanation = torch._dynamo.explain(prepared)(torch.randint(0, 96, (2, 8)))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def test_llama_o2_compiles_fullgraph_with_inductor():
    """One real inductor compile (forward and backward; the slowest test)."""
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(12))
    target = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(13))
    prepared, result = tt.prepare_model(copy.deepcopy(model), "O2", compile_options={"fullgraph": True})
    assert result.optimizations_applied[-1] == "torch.compile (fullgraph=True)"
    logits = prepared(ids)
    ref = model(ids)
    assert rel_err(logits, ref) < 1e-5
    tt.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    F.cross_entropy(ref.flatten(0, 1), target.flatten()).backward()
    ref_grads = dict(model.named_parameters())
    for name, p in prepared.named_parameters():
        assert rel_err(p.grad, ref_grads[name].grad) < 1e-4, name


# ---- what a PyTorch user does with a prepared model (each raised or differed before)

@pytest.mark.parametrize("grad", [False, True])
def test_silu_inplace_module_writes_its_input(grad):
    """nn.SiLU(inplace=True) prepared writes x and returns it, as torch's
    (it returned a new tensor and left x alone: h = fc(x); act(h); h)."""
    torch.manual_seed(0)
    fc = nn.Linear(8, 8)
    ref_act, act = nn.SiLU(inplace=True), copy.deepcopy(nn.SiLU(inplace=True))
    act, _ = tt.prepare_model(act, "O1")
    assert type(act) is tt.SiLU
    x = torch.randn(4, 8)
    with torch.set_grad_enabled(grad):
        h_ref, h = fc(x), fc(x)
        y_ref, y = ref_act(h_ref), act(h)
    assert y is h and y_ref is h_ref
    assert rel_err(h, h_ref) < 1e-6
    if grad:
        h.sum().backward()  # torch's in-place op recorded the gradient
        assert fc.weight.grad is not None


def test_prepared_model_cast_to_float64_runs():
    """A model prepared, then cast to float64: the swapped gated MLP and
    RMSNorm run torch's arithmetic (the MLP raised DTypeError, HF-style
    RMSNorms recursed forever)."""
    torch.manual_seed(0)

    MLP = functools.partial(GatedMLP, 16, 32)

    ref = nn.Sequential(nn.RMSNorm(16), MLP(), nn.LayerNorm(16), nn.GELU())
    got, result = tt.prepare_model(copy.deepcopy(ref), "O1")
    assert any("SwiGLU" in a for a in result.optimizations_applied), result.optimizations_applied
    ref.double(), got.double()
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(got(x), ref(x)) < 1e-12


@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_of_prepared_modules(grad):
    """torch.jit.trace records dispatcher ops only: a prepared module traces
    through the custom ops (the direct lane gave constants or no data
    dependence)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.RMSNorm(16), nn.Linear(16, 4))
    got, _ = tt.prepare_model(copy.deepcopy(ref), "O1")
    x = torch.randn(2, 8)
    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(got, x)
    with torch.no_grad():
        assert rel_err(traced(x), ref(x)) < 1e-5
        x2 = torch.randn(2, 8) + 1  # another input: the trace follows it (no constant baked in)
        assert rel_err(traced(x2), ref(x2)) < 1e-5


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_jit_trace_of_fused_linear_activation(act, rows, grad):
    """The fused Linear + activation (FusedLinearGELU / SiLU, prepare_model_with_custom_kernels,
    GPT-2's c_fc + GELU at O1) traced with torch.jit.trace: the activation written over the GEMM's
    output in place (tensor_ops.gelu(out=h)) is no dispatcher op, and the trace held the plain
    Linear (1.9 off for GELU) when no gradient was recorded."""
    torch.manual_seed(0)
    m = (tt.FusedLinearSiLU(16, 8) if act == "silu" else
         tt.FusedLinearGELU(16, 8, approximate="tanh" if act == "gelu_tanh" else "none")).eval()
    torch_act = (F.silu if act == "silu" else
                 functools.partial(F.gelu, approximate="tanh" if act == "gelu_tanh" else "none"))
    x = torch.randn(rows, 16) * 3
    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(m, (x,))
    with torch.no_grad():
        for inp in (x, torch.randn(rows, 16) * 3 + 1):
            assert rel_err(traced(inp), torch_act(F.linear(inp, m.weight, m.bias))) < 1e-5


def test_inference_mode_inputs_train_a_head():
    """Note [inference tensors saved for backward]: features made under
    torch.inference_mode feed a trainable RMSNorm / LayerNorm (the weight's
    gradient): ours saved the inference tensor and raised, torch's RMSNorm
    trains. Through the module, the functional op and torch.ops."""
    torch.manual_seed(0)
    with torch.inference_mode():
        feats = torch.randn(4, 16) * 2
    for ref in (nn.RMSNorm(16), nn.LayerNorm(16)):
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
        got, _ = tt.prepare_model(copy.deepcopy(ref), "O1")
        assert type(got) is not type(ref)
        ref(feats.clone()).square().sum().backward()
        got(feats).square().sum().backward()
        assert rel_err(got.weight.grad, ref.weight.grad) < 1e-5
    w = torch.ones(16, requires_grad=True)
    for y in (tt.rms_norm(feats, w, 1e-6), torch.ops.tensor_ops.rms_norm(feats, w, 1e-6)):
        (g,) = torch.autograd.grad(y.sum(), w)
        assert torch.isfinite(g).all()


def test_attention_masks_as_torch_and_hf_read_them():
    """SDPA refuses an integer attn_mask, as torch does (0 / 1 integers were
    added to the scores: nothing masked); FlashAttention reads a 2-d 0. / 1.
    float mask as HF's keep mask (it was added: padded keys attended), and a
    float mask with other values (0 / -inf) stays additive."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 8)
    with pytest.raises(TypeError, match="attn_mask must be bool .* or floating"):
        tt.scaled_dot_product_attention(q, q, q, torch.ones(3, 3, dtype=torch.long))
    fa = tt.FlashAttention(16, 2).eval()
    x = torch.randn(2, 5, 16)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, 3:] = False
    with torch.no_grad():
        want = fa(x, keep)
        for mask in (keep.long(), keep.float(), keep.to(torch.bfloat16),
                     torch.zeros(2, 5).masked_fill(~keep, float("-inf")), (1 - keep.float()) * -1e9):
            assert torch.allclose(fa(x, mask), want, atol=1e-6), mask.dtype
        # decided without a Python branch on the mask's data: one graph (a bool() of it broke fullgraph)
        torch._dynamo.reset()
        compiled = torch.compile(fa, fullgraph=True, backend="eager")
        for mask in (keep.float(), (1 - keep.float()) * -1e9):
            assert torch.allclose(compiled(x, mask), want, atol=1e-6)


def test_sdpa_value_head_dim_and_float64_as_torch():
    """v's head dim other than q's was refused without a mask (taken with
    one), float64 refused: both as torch's SDPA now, with gradients."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 6)
    for dt in (torch.float32, torch.float64):
        a, b, c = (t.to(dt).requires_grad_() for t in (q, k, v))
        for causal in (False, True):
            got = tt.scaled_dot_product_attention(a, b, c, is_causal=causal)
            want = F.scaled_dot_product_attention(a, b, c, is_causal=causal)
            assert got.dtype == dt and (got - want).abs().max() < (1e-5 if dt == torch.float32 else 1e-12)
            g = torch.autograd.grad(got.sum(), (a, b, c))
            w = torch.autograd.grad(want.sum(), (a, b, c))
            assert all((x - y).abs().max() < (1e-5 if dt == torch.float32 else 1e-12) for x, y in zip(g, w))


def test_scripted_hf_rms_norm_matches_eager_and_multi_dim_norms_check_shapes():
    """HFRMSNorm's TorchScript branch: eps=None is float32's (as eager; 1e-6
    put a script 0.74 off at x ~ 1e-3) and a multi-dim normalized_shape
    averages every normalized dim (the last only: 0.71 off). A norm over
    (4, 8) refuses an input not ending in (4, 8), as torch (the fold gave
    another layout's answer for [2, 8, 4])."""
    torch.manual_seed(0)
    for shape, x in ((64, torch.randn(2, 64) * 1e-3), ((4, 16), torch.randn(3, 4, 16))):
        m = tt.HFRMSNorm(shape)
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
        assert (torch.jit.script(m)(x) - m(x)).abs().max() < 1e-5
        assert (m(x) - nn.RMSNorm(shape)(x) * m.weight).abs().max() < 1e-5
    for cls in (tt.LayerNorm, tt.RMSNorm):
        m = cls((4, 8))
        for bad in (torch.randn(2, 8, 4), torch.randn(2, 32)):
            with pytest.raises(ValueError, match=r"expected input with shape \[\*, 4, 8\]"):
                m(bad)


def test_functional_and_fused_linear_edges_as_torch():
    """A shape where a tensor belongs (F.layer_norm's order) is an
    ArgumentTypeError naming it (AttributeError 'tuple' has no 'contiguous');
    FusedLinearGELU with in_features 0 gives gelu(bias) and a 0-d input
    torch's error (reshape / IndexError before)."""
    x, w = torch.randn(3, 5), torch.ones(5)
    for call in (lambda: tt.layer_norm(x, (5,), w), lambda: tt.rms_norm(x, [1.0] * 5)):
        with pytest.raises(TypeError, match="expected a torch.Tensor, got"):
            call()
    m = tt.FusedLinearGELU(0, 4)
    with torch.no_grad():
        m.bias.uniform_(-1, 1)
    assert torch.allclose(m(torch.randn(2, 0)), F.gelu(m.bias).expand(2, 4))
    with pytest.raises(RuntimeError, match="at least 1D"):
        tt.FusedLinearSiLU(1, 4)(torch.tensor(1.0))


def test_meta_tensors_take_the_fake_kernels():
    """Meta tensors (shape inference, init_empty_weights-style models): the
    functional ops and prepared modules give meta outputs of torch's shapes,
    and prepare_model leaves a meta model on meta, saying so."""
    x = torch.randn(2, 8, device="meta")
    w = torch.ones(8, device="meta")
    assert tt.silu(x).shape == (2, 8) and tt.silu(x).is_meta
    assert tt.layer_norm(x, w, w).shape == (2, 8)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU())
    got, result = tt.prepare_model(model, "O1")
    assert any("meta device" in w for w in result.warnings), result.warnings
    y = got(x)
    assert y.is_meta and y.shape == (2, 8)


def test_output_layouts_are_torchs():
    """Note [elementwise layouts], Note [softmax along an inner dim]: a dense
    input in another dim order (channels_last, a transpose) keeps its layout
    through the activations, as torch's; softmax along an inner dim is
    row-major, so its .view() works. The fake kernels agree (opcheck)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    for ours, ref in ((tt.gelu, F.gelu), (tt.silu, F.silu)):
        y = ours(x)
        assert y.stride() == ref(x).stride() and rel_err(y, ref(x)) < 1e-6
    xt = torch.randn(16, 4).t()
    assert tt.silu(xt).stride() == F.silu(xt).stride()
    x3 = torch.randn(2, 5, 4)
    for ours, ref in ((tt.softmax, torch.softmax), (tt.log_softmax, torch.log_softmax)):
        y = ours(x3, 1)
        assert y.stride() == ref(x3, 1).stride()
        assert rel_err(y.view(2, 20), ref(x3, 1).view(2, 20)) < 1e-6
    for op, args in ((torch.ops.tensor_ops.silu.default, (x,)), (torch.ops.tensor_ops.gelu.default, (xt, "tanh")),
                     (torch.ops.tensor_ops.softmax.default, (x3, 1, 1.0, False))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_o3_keeps_complex_buffers():
    """O3's reduced precision casts real floating tensors only: Module.to(bf16)
    also cast a complex RoPE table (torchtitan's freqs_cis) to its real part,
    and the model's output was 0.73 off, with no warning."""

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.register_buffer("freqs_cis", torch.polar(torch.ones(4), torch.arange(4.0)))

        def forward(self, x):
            y = self.proj(x).float()
            z = torch.view_as_complex(y.reshape(*y.shape[:-1], 4, 2)) * self.freqs_cis
            return torch.view_as_real(z).flatten(-2)

    torch.manual_seed(0)
    ref = Rotary()
    got, result = tt.prepare_model(copy.deepcopy(ref), "O3", compile_options={"backend": "eager"})
    assert got.freqs_cis.dtype == torch.complex64 and torch.equal(got.freqs_cis, ref.freqs_cis)
    assert got.proj.weight.dtype == torch.bfloat16
    assert any("1 complex tensors kept" in a for a in result.optimizations_applied), result.optimizations_applied
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert rel_err(got(x), ref(x)) < 2e-2
    # still through Module.to (transformers' refusals for quantized models live in its override)
    class Refusing(Rotary):
        def to(self, *args, **kwargs):
            raise ValueError("this model refuses a dtype cast")

    with pytest.raises(ValueError, match="refuses a dtype cast"):
        tt.prepare_model(Refusing(), "O3", compile_options={"backend": "eager"})


def test_custom_kernels_follow_shared_hooked_and_wrapped_linears():
    """Note [fused in the Sequential]: prepare_model_with_custom_kernels
    fused a Linear also called outside its Sequential (its other caller got
    GELU too: 0.72 off), or watched by a hook (which saw GELU's output), or
    wrapped afterwards by an adapter (a LoRA update landed after the GELU).
    The Sequential now decides per call: each of these computes what the
    unprepared model computes, gradients included."""
    from tensor_ops.torch import prepare_model_with_custom_kernels

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.mlp = nn.Sequential(self.proj, nn.GELU())

        def forward(self, x):
            return self.mlp(x) + self.proj(x)

    class Adapter(nn.Module):  # what PEFT's LoRA does to a Linear
        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.a = nn.Parameter(torch.randn(16, 4) * 0.3)
            self.b = nn.Parameter(torch.randn(4, 16) * 0.3)

        def forward(self, x):
            return self.base_layer(x) + (x @ self.a) @ self.b

    torch.manual_seed(0)
    x = torch.randn(3, 16)
    ref = Shared()
    got, result = prepare_model_with_custom_kernels(copy.deepcopy(ref), "O1")
    assert type(got.mlp).__name__ == "FusingSequential"
    with torch.no_grad():
        assert rel_err(got(x), ref(x)) < 1e-5
    seq = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    got, _ = prepare_model_with_custom_kernels(copy.deepcopy(seq), "O1")
    seen = []
    for m in (seq, got):
        m[0].register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    with torch.no_grad():
        seq(x)
        got(x)
    assert rel_err(seen[1], seen[0]) < 1e-5  # the hook added after prepare sees the Linear's own output
    seq = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    got, _ = prepare_model_with_custom_kernels(copy.deepcopy(seq), "O1")
    torch.manual_seed(1)
    seq[0] = Adapter(seq[0])
    torch.manual_seed(1)
    got[0] = Adapter(got[0])
    want, out = seq(x), got(x)
    assert rel_err(out, want) < 1e-5
    plain = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    fused, _ = prepare_model_with_custom_kernels(copy.deepcopy(plain), "O1")
    calls = []
    real = fused[0].forward
    fused[0].forward = lambda a: calls.append(1) or real(a)  # an instance forward (accelerate's offload hooks)
    with torch.no_grad():
        assert rel_err(fused(x), plain(x)) < 1e-5 and calls == [1]
    want.square().sum().backward()
    out.square().sum().backward()
    for p, q in zip(seq.parameters(), got.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-5


def test_prepared_models_script(tmp_path):
    """Note [scripted modules]: torch.jit.script of a prepared model (it failed
    on every swapped module: a frozenset, a try block) compiles torch's own
    computation, saves, loads and matches the eager prepared model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(approximate="tanh"), nn.Linear(32, 32),
                          nn.SiLU(), nn.RMSNorm(32), nn.Linear(32, 8))
    enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    from tensor_ops.torch import prepare_model_with_custom_kernels
    fused, _ = prepare_model_with_custom_kernels(nn.Sequential(nn.Linear(16, 16), nn.GELU()), "O1")
    for ref, x in ((model, torch.randn(4, 16)), (enc.eval(), torch.randn(2, 5, 16)), (GatedMLP(16, 24), torch.randn(3, 16)),
                   (fused, torch.randn(3, 16))):
        got = ref if ref is fused else tt.prepare_model(copy.deepcopy(ref), "O1")[0]
        assert any(type(m).__module__.startswith("tensor_ops.") for m in got.modules())
        scripted = torch.jit.script(got)
        path = str(tmp_path / "m.pt")
        torch.jit.save(scripted, path)
        loaded = torch.jit.load(path)
        with torch.no_grad():
            want = got(x)
            assert rel_err(scripted(x), want) < 1e-5 and rel_err(loaded(x), want) < 1e-5


def test_sequential_subclass_with_pairs_is_named_not_fused():
    """A subclass of nn.Sequential with Linear -> GELU pairs keeps its class
    and forward (which may not be the chain) and is named in the warnings:
    nothing skipped silently."""
    from tensor_ops.torch import prepare_model_with_custom_kernels

    class Gated(nn.Sequential):
        def forward(self, x):
            return self[0](x) * torch.sigmoid(self[1](self[0](x)))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Gated(nn.Linear(8, 8), nn.GELU())
            self.plain = nn.Sequential(nn.Linear(8, 8), nn.SiLU())

        def forward(self, x):
            return self.plain(self.block(x))

    torch.manual_seed(0)
    ref = Outer()
    got, result = prepare_model_with_custom_kernels(copy.deepcopy(ref), "O1")
    assert type(got.block) is Gated and type(got.plain).__name__ == "FusingSequential"
    named = [w for w in result.warnings if "block" in w and "Gated" in w and "Linear + GELU" in w]
    assert len(named) == 1, result.warnings
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert rel_err(got(x), ref(x)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_default_eps_is_torchs(dtype):
    """nn.RMSNorm(eps=None) prepared: torch's default epsilon is its compute
    type's (float32's 1.19e-7 for half input), not the input dtype's (bf16's
    0.0078 put activations of 0.01 0.88 off)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.RMSNorm(64)).to(dtype)
    got, _ = tt.prepare_model(copy.deepcopy(ref), "O1")
    assert type(got[0]).__module__.startswith("tensor_ops")
    for scale in (1.0, 0.1, 0.01):
        x = torch.randn(4, 64, dtype=dtype) * scale
        with torch.no_grad():
            assert rel_err(got(x).float(), ref(x).float()) < 2e-2, scale


class _GatedMLP(nn.Module):
    def __init__(self, d=24, h=48):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), \
            nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_gated_mlp_with_state_of_its_own_is_kept_and_named():
    """A gated MLP holding a buffer / Parameter of its own (or state_dict
    hooks, or hooks on its act_fn) is not replaced: the replacement dropped
    them (a strict load of the old checkpoint failed) without a word."""
    torch.manual_seed(0)
    mlp = _GatedMLP()
    mlp.register_buffer("tokens_seen", torch.zeros(()))
    ref = nn.Sequential(mlp)
    got, result = tt.prepare_model(copy.deepcopy(ref), "O1")
    assert type(got[0]) is _GatedMLP
    assert any("tokens_seen" in w for w in result.warnings), result.warnings
    got.load_state_dict(ref.state_dict(), strict=True)
    hooked_act = nn.Sequential(_GatedMLP())
    calls = []
    hooked_act[0].act_fn.register_forward_hook(lambda *a: calls.append(1))
    got, result = tt.prepare_model(hooked_act, "O1")
    assert type(got[0]) is _GatedMLP and any("hooks" in w for w in result.warnings), result.warnings
    assert calls == []  # the check ran no hook
    plain, _ = tt.prepare_model(nn.Sequential(_GatedMLP()), "O1")
    assert type(plain[0]) is tt.SwiGLU


def test_swap_check_leaves_the_model_as_it_was():
    """prepare_model's check of a gated MLP runs its forward once: in train
    mode a spectral_norm on down_proj stepped its power iteration (the model
    0.19 off afterwards) and the user's hooks saw the check's input."""
    torch.manual_seed(0)
    ref = nn.Sequential(_GatedMLP())
    nn.utils.spectral_norm(ref[0].down_proj)
    ref.train()
    got = copy.deepcopy(ref)
    seen = []
    got[0].gate_proj.register_forward_hook(lambda *a: seen.append(1))
    u = got[0].down_proj.weight_u.clone()
    got, _ = tt.prepare_model(got, "O1")
    assert seen == [] and torch.equal(got[0].down_proj.weight_u, u) and got.training
    x = torch.randn(2, 24)
    assert rel_err(got(x), ref(x)) < 1e-5


def test_activation_subclasses_are_not_fused():
    """prepare_model_with_custom_kernels fused a subclass of nn.GELU / nn.SiLU
    (CLIP's QuickGELU) as the plain activation: 0.0099 / 0.44 off."""
    from tensor_ops.torch import prepare_model_with_custom_kernels

    class QuickGELU(nn.GELU):
        def forward(self, x):
            return x * torch.sigmoid(1.702 * x)

    class ScaledSiLU(nn.SiLU):
        def forward(self, x):
            return 2.0 * super().forward(x)

    torch.manual_seed(0)
    for act in (QuickGELU(), ScaledSiLU()):
        ref = nn.Sequential(nn.Linear(8, 16), act, nn.Linear(16, 4))
        got, result = prepare_model_with_custom_kernels(copy.deepcopy(ref), "O1")
        assert not any("epilogue" in a for a in result.optimizations_applied), result.optimizations_applied
        x = torch.randn(3, 8)
        with torch.no_grad():
            assert rel_err(got(x), ref(x)) < 1e-5


def test_fused_pair_runs_global_module_hooks():
    """torch's global module hooks (register_module_forward_hook) see every
    module call; the fused pair skipped them (a hook editing the GELU's
    output: 0.30 off)."""
    from tensor_ops.torch import prepare_model_with_custom_kernels

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    got, _ = prepare_model_with_custom_kernels(copy.deepcopy(ref), "O1")
    x = torch.randn(3, 8)
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o * 2 if isinstance(m, nn.GELU) else None)
    try:
        with torch.no_grad():
            assert rel_err(got(x), ref(x)) < 1e-5
    finally:
        handle.remove()


def test_encoder_fast_path_is_said():
    """nn.TransformerEncoderLayer's eval fast path runs torch's own kernels on
    the norms' weights: the swapped LayerNorms do not run there, and the
    result says so (it listed them as swapped, nothing more)."""
    m = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    _, result = tt.prepare_model(m, "O1")
    assert any("fast path" in w and "2 nn.TransformerEncoderLayer" in w for w in result.warnings), result.warnings
