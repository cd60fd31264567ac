"""tensor_ops.linear with weight_layout="kn" (weight [K, N], out = x weight
+ bias: transformers' Conv1D, GPT-2) against float64; its argument errors;
bits that depend on neither the thread count nor the rows around them (Note
[linear kn]); the torch op (autograd, fake kernel, torch.compile); and
tensor_ops.torch.Conv1D, which prepare_model swaps in for GPT-2's Conv1D
modules (decode on our kernel, logits and greedy tokens as before)."""
import copy

import numpy as np
import pytest

import tensor_ops
from conftest import assert_within, bits, DTYPES, FLOOR, np_dtype, RTOL, to64, torch
from tensor_ops import _C

ROWS = [0, 1, 3, 16]
SIZES = [1, 7, 33, 4097]  # K and N: below and past a register, a tile (64 columns), an item
SHAPES = [(k, n) for k in SIZES for n in SIZES if k * n < 4097 * 4097]

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def make(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def assert_kn_close(y, x, w, b, dtype, what):
    """|y - x @ w (+ b)| within the output's rounding (conftest's RTOL) plus
    the fp32 accumulation's bound for one chain over K (Note [linear kn]):
    (K + 4) units of 2^-24 times the sum of |x_k w_k|."""
    x64, w64 = to64(x), to64(w)
    ref = x64 @ w64 + (0 if b is None else to64(b))
    got = to64(y)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    absdot = np.abs(x64) @ np.abs(w64) + (0 if b is None else np.abs(to64(b)))
    tol = RTOL[dtype] * np.abs(ref) + (x64.shape[-1] + 4) * 2.0 ** -24 * absdot + FLOOR[dtype]
    assert_within(got, ref, tol, what)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_against_float64(dtype, bias, target, rng):
    target.require("linear")
    for k, n in SHAPES:
        w = make(rng, (k, n), dtype)
        b = make(rng, (n,), dtype) if bias else None
        for m in ROWS:
            x = make(rng, (m, k), dtype)
            y = tensor_ops.linear(x, w, b, weight_layout="kn")
            assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == (m, n)
            assert_kn_close(y, x, w, b, dtype, f"linear kn {dtype} x {x.shape} w {w.shape} bias {bias} {target}")


@needs_torch
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_against_float64_and_out(dtype, bias, rng):
    tdt = getattr(torch, dtype)
    for lead, k, n in [((1,), 4097, 33), ((2, 1), 33, 7), ((3, 5), 7, 4097), ((16,), 1, 1), ((0, 3), 33, 7)]:
        x = torch.from_numpy(make(rng, (*lead, k), "float32")).to(tdt)
        w = torch.nn.Parameter(torch.from_numpy(make(rng, (k, n), "float32")).to(tdt))  # a Parameter, as in a model
        b = torch.from_numpy(make(rng, (n,), "float32")).to(tdt) if bias else None
        with torch.no_grad():  # inference (with grad on, the op records it: Note [ops that autograd would record])
            y = tensor_ops.linear(x, w, b, weight_layout="kn")
            assert type(y) is torch.Tensor and y.dtype == tdt and y.shape == (*lead, n) and not y.requires_grad
            assert_kn_close(y, x, w, b, dtype, f"linear kn torch {dtype} x {tuple(x.shape)} w {tuple(w.shape)}")
            out = torch.empty(*lead, n, dtype=tdt)
            assert tensor_ops.linear(x, w, b, weight_layout="kn", out=out) is out
            assert torch.equal(bits_t(out), bits_t(y))
        assert tensor_ops.linear(x, w, b, weight_layout="kn").requires_grad


def bits_t(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_strided_x_out_and_padded_weight_rows(rng):
    """x and out with rows apart, and a weight whose rows are padded (a
    column slice: rows contiguous, row stride past N), read in place."""
    x = make(rng, (3, 2, 40), "float32")[:, 0, 5:38]  # rows 80 apart, 33 wide
    w = make(rng, (33, 70), "float32")[:, 3:12]  # [33, 9], row stride 70
    b = make(rng, (9,), "float32")
    out = np.zeros((3, 12), np.float32)[:, 1:10]
    assert tensor_ops.linear(x, w, b, weight_layout="kn", out=out) is out
    assert_kn_close(out, x, w, b, "float32", "strided")


@needs_torch
def test_a_transposed_weight_view_is_copied_and_right(rng):
    """A [K, N] weight that is a transposed view of an [N, K] tensor has no
    contiguous rows: the op layer copies it (the general lane's contiguous
    retry), the answer is the same; a module should pass weights as stored,
    naming their layout, to avoid that copy."""
    stored = torch.from_numpy(make(rng, (9, 33), "float32"))  # [N, K]
    x = torch.from_numpy(make(rng, (2, 33), "float32"))
    y = tensor_ops.linear(x, stored.t(), weight_layout="kn")
    assert_kn_close(y, x, stored.t(), None, "float32", "transposed view")
    torch.testing.assert_close(y, tensor_ops.linear(x, stored), rtol=1e-5, atol=1e-5)  # the same weight as nk
    np_view = stored.numpy().T
    assert_kn_close(tensor_ops.linear(x.numpy(), np_view, weight_layout="kn"), x, np_view, None, "float32", "np view")


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_k_gives_the_bias(dtype, rng):
    npd = np_dtype(dtype)
    w0, b = np.empty((0, 5), npd), make(rng, (5,), dtype)
    y = tensor_ops.linear(np.empty((3, 0), npd), w0, b, weight_layout="kn")
    assert y.shape == (3, 5) and np.array_equal(to64(y), np.broadcast_to(to64(b), (3, 5)))
    y = tensor_ops.linear(np.empty((2, 0), npd), w0, weight_layout="kn")
    assert y.shape == (2, 5) and not to64(y).any()


def test_bad_arguments_name_the_shapes_and_dtypes():
    x, w = np.ones((2, 7), np.float32), np.ones((7, 5), np.float32)
    with pytest.raises(tensor_ops.InvalidArgumentError,
                       match=r"weight must be \[7, out_features\] \(weight_layout kn: x @ weight\) to match x "
                             r"float32\[2, 7\], got float32\[5, 7\]"):
        tensor_ops.linear(x, np.ones((5, 7), np.float32), weight_layout="kn")
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"weight must be \[7, out_features\].*float32\[35\]"):
        tensor_ops.linear(x, np.ones(35, np.float32), weight_layout="kn")
    with pytest.raises(tensor_ops.DTypeError, match=r"weight has dtype float16 but x has float32"):
        tensor_ops.linear(x, w.astype(np.float16), weight_layout="kn")
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"bias must have shape \[5\] to match weight "
                                                              r"float32\[7, 5\], got float32\[7\]"):
        tensor_ops.linear(x, w, np.ones(7, np.float32), weight_layout="kn")
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"out has shape \[2, 7\] but x float32\[2, 7\] and "
                                                              r"weight float32\[7, 5\] give \[2, 5\]"):
        tensor_ops.linear(x, w, weight_layout="kn", out=np.empty((2, 7), np.float32))
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"weight_layout must be one of 'nk', 'kn', got 'km'"):
        tensor_ops.linear(x, w, weight_layout="km")
    with pytest.raises(TypeError, match=r"weight_layout must be one of 'nk', 'kn', got int 1"):
        tensor_ops.linear(x, w, weight_layout=1)
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"weight_layout must be 0 .* or 1 .*got 2"):
        _C.linear(x, w, None, np.empty((2, 5), np.float32), 2)  # the binding: the core checks the value


def test_backends_without_the_kernel_refuse_it_by_name():
    lacking = [b.name for b in tensor_ops.backends() if b.usable and "linear" not in b.ops]
    if not lacking:
        pytest.skip("every usable backend here has a linear kernel")
    x, w = np.ones((1, 8), np.float32), np.ones((8, 3), np.float32)
    for name in lacking:
        with tensor_ops.use(name):
            with pytest.raises(NotImplementedError, match=f"op linear is not implemented by backend '{name}'"):
                tensor_ops.linear(x, w, weight_layout="kn")


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_at_any_thread_count(dtype, restore_threads):
    rng = np.random.default_rng(3)
    x, w, b = make(rng, (5, 300), dtype), make(rng, (300, 1001), dtype), make(rng, (1001,), dtype)
    results = {}
    for threads in [1, 2, 3]:  # 1001 columns: 16 items of 64, split differently per thread count
        _C.cpu_set_num_threads(threads)
        results[threads] = bits(tensor_ops.linear(x, w, b, weight_layout="kn"), dtype)
    for threads, got in results.items():
        assert np.array_equal(got, results[1]), f"linear kn {dtype} differs between 1 and {threads} threads"


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_element_does_not_depend_on_the_rows_or_columns_around_it(dtype, cpu_isa):
    """Each output element is one chain over k in its own lane (Note [linear
    kn]): the same bits whether its row of x is alone or one of a batch, and
    wherever its column falls in a tile, a register or an item."""
    rng = np.random.default_rng(4)
    x, w = make(rng, (7, 129), dtype), make(rng, (129, 301), dtype)
    full = bits(tensor_ops.linear(x, w, weight_layout="kn"), dtype)
    for r in range(7):
        got = bits(tensor_ops.linear(x[r:r + 1], w, weight_layout="kn"), dtype)
        assert np.array_equal(got, full[r:r + 1]), f"row {r} of x ({cpu_isa})"
    for j, width in [(0, 3), (5, 17), (60, 9), (64, 64), (250, 51)]:
        got = bits(tensor_ops.linear(x, np.ascontiguousarray(w[:, j:j + width]), weight_layout="kn"), dtype)
        assert np.array_equal(got, full[:, j:j + width]), f"columns {j}..{j + width} of w ({cpu_isa})"


# ---- tensor_ops.torch: the op, and Conv1D ------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("bias", [False, True])
def test_torch_op_gradients_match_x_at_weight(bias):
    import tensor_ops.torch as tt

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 9, generator=g, requires_grad=True)
    w = torch.randn(9, 4, generator=g, requires_grad=True)  # [K, N]
    b = torch.randn(4, generator=g, requires_grad=True) if bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    scale = torch.arange(24.0).view(3, 2, 4)
    for call in (lambda: tt.linear(x, w, b, "kn"), lambda: tt.OPS["linear"](x, w, b, "kn")):  # Function, custom op
        y = call()
        (y * scale).sum().backward()
        grads = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        ref = x @ w + (0 if b is None else b)
        (ref * scale).sum().backward()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        for got, t in zip(grads, leaves):
            assert got.shape == t.shape
            torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-5)
            t.grad = None


@needs_torch
def test_torch_op_has_a_fake_kernel_for_the_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tensor_ops.torch as tt

    with FakeTensorMode():
        y = tt.OPS["linear"](torch.empty(2, 3, 8, dtype=torch.bfloat16), torch.empty(8, 5, dtype=torch.bfloat16),
                             None, "kn")
        assert y.shape == (2, 3, 5) and y.dtype == torch.bfloat16
        assert tt.OPS["linear"](torch.empty(2, 8), torch.empty(5, 8)).shape == (2, 5)


class _Conv1DModel(torch.nn.Module if torch is not None else object):
    """Two Conv1D-style projections ([in, out] weights) on the torch op."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.w1 = torch.nn.Parameter(torch.randn(33, 70, generator=g) * 0.1)
        self.b1 = torch.nn.Parameter(torch.randn(70, generator=g) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(70, 20, generator=g) * 0.1)

    def forward(self, x):
        import tensor_ops.torch as tt

        return tt.linear(torch.relu(tt.linear(x, self.w1, self.b1, "kn")), self.w2, None, "kn")


@needs_torch
def test_torch_op_compiles_fullgraph():
    torch._dynamo.reset()
    model = _Conv1DModel()
    x = torch.randn(2, 33)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    ref = torch.relu(x @ model.w1 + model.b1) @ model.w2
    torch.testing.assert_close(eager, ref.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled, eager)  # the same kernel, called from the graph


# ---- tensor_ops.torch.Conv1D and prepare_model on GPT-2 ----------------------------------------------


def _transformers():
    pytest.importorskip("transformers")
    import transformers

    return transformers


@pytest.fixture
def fp32_kn_ours():
    """modules.linear_rows takes a float32 [K, N] weight on two threads of the
    AVX2 kernels only (measured faster there): tests of that wiring run so."""
    if "avx2" not in _C.cpu_supported_isas():
        pytest.skip("fp32 [K, N] weights take our kernel on the AVX2 level only")
    old = _C.cpu_num_threads()
    _C.cpu_set_num_threads(2)
    _C.cpu_set_isa("avx2")
    yield
    _C.cpu_set_num_threads(old)
    _C.cpu_set_isa("auto")


@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d_runs_our_kernel_for_a_few_rows_only(dtype, monkeypatch, request):
    _transformers()
    if dtype == "float32":
        request.getfixturevalue("fp32_kn_ours")
    from transformers.pytorch_utils import Conv1D as HFConv1D

    import tensor_ops.torch as tt
    from tensor_ops.torch import modules

    tdt = getattr(torch, dtype)
    torch.manual_seed(8)
    conv = HFConv1D(70, 33).to(tdt)  # nf (out) 70, nx (in) 33
    with torch.no_grad():
        conv.bias.normal_()
    ref = copy.deepcopy(conv)
    conv.__class__ = tt.Conv1D
    assert isinstance(conv, HFConv1D) and tt.Conv1D is modules.Conv1D is modules.conv1d_class()
    assert list(conv.state_dict()) == list(ref.state_dict())
    calls = []
    real = tensor_ops.ops.linear
    monkeypatch.setattr(tensor_ops.ops, "linear", lambda x, w, b, **kw: calls.append((x.numel() // x.shape[-1], kw))
                        or real(x, w, b, **kw))
    m = modules.linear_max_rows(tdt)  # 16, or 4 for a half dtype torch multiplies natively here
    with torch.no_grad():
        for shape, n in [((1, 33), 1), ((2, 1, 33), 2), ((2, m // 2, 33), m)]:
            calls.clear()
            x = torch.randn(shape).to(tdt)
            y = conv(x)
            assert calls == [(n, {"weight_layout": "kn"})] and y.shape == (*shape[:-1], 70)
            assert_kn_close(y, x, conv.weight, conv.bias, dtype, f"Conv1D {shape}")
        calls.clear()
        x = torch.randn(m + 1, 33).to(tdt)  # one row more: Conv1D's own addmm
        assert torch.equal(conv(x), ref(x)) and calls == []
    x = torch.randn(2, 33).to(tdt)
    y = conv(x)  # the weights require grad: Conv1D's forward, recorded by autograd
    assert calls == [] and y.requires_grad and torch.equal(y, ref(x))


@needs_torch
def test_conv1d_pickles_by_name():
    import pickle

    import tensor_ops.torch as tt

    _transformers()
    from transformers.pytorch_utils import Conv1D as HFConv1D

    conv = HFConv1D(5, 3)
    conv.__class__ = tt.Conv1D
    back = pickle.loads(pickle.dumps(conv))
    assert type(back) is tt.Conv1D and torch.equal(back.weight, conv.weight)


def _gpt2(transformers):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    for p in model.parameters():
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


@needs_torch
def test_gpt2_prepared_decodes_on_our_kernel(monkeypatch, fp32_kn_ours):
    """GPT-2 at O1 on the CPU backend: c_attn, attn.c_proj and mlp.c_proj
    become tensor_ops.torch.Conv1D (mlp.c_fc too, which the MLP runs as the
    Linear + GELU epilogue, whose few-row GEMM is our kernel too), reported as swapped;
    every decode step's four projections per layer on our kernel (at two
    threads of the AVX2 kernels: float32 [K, N] takes torch's addmm on one,
    and on AVX-512); prefill and each
    decode step's logits within 1e-5 of the original's; greedy generation
    gives the same tokens."""
    transformers = _transformers()
    import tensor_ops.torch as tt

    original = _gpt2(transformers)
    model, result = tt.prepare_model(copy.deepcopy(original), "O1", backend="cpu")
    assert result.success
    n_layer = original.config.n_layer
    assert result.metrics["replacements"]["Conv1D -> tensor_ops.torch.Conv1D"] == 4 * n_layer
    assert f"Conv1D -> tensor_ops.torch.Conv1D x{4 * n_layer}" in result.optimizations_applied
    for block in model.transformer.h:
        assert type(block.attn.c_attn) is tt.Conv1D and type(block.attn.c_proj) is tt.Conv1D
        assert type(block.mlp.c_proj) is tt.Conv1D
        # c_fc too: the fused epilogue is the MLP's (Note [fused at the parent])
        assert type(block.mlp.c_fc) is tt.Conv1D and type(block.mlp).__name__ == "TensorOpsGPT2MLP"
    assert list(model.state_dict()) == list(original.state_dict())

    kn_calls = []
    real = tensor_ops.ops.linear
    monkeypatch.setattr(tensor_ops.ops, "linear", lambda x, w, b=None, **kw: (kw.get("weight_layout") == "kn"
                                                                           and kn_calls.append(x.shape))
                        or real(x, w, b, **kw))
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    ref_tokens, tokens = _decode_steps_on_our_kernel(original, model, prompt, n_layer, kn_calls)
    assert torch.equal(tokens, ref_tokens), (tokens, ref_tokens)


def _decode_steps_on_our_kernel(original, model, prompt, n_layer, kn_calls):
    with torch.no_grad():
        ref_out = original(prompt, use_cache=True)
        out = model(prompt, use_cache=True)
        torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
        ref_past, past = ref_out.past_key_values, out.past_key_values
        token = ref_out.logits[:, -1:].argmax(-1)
        for step in range(4):
            kn_calls.clear()
            ref_out = original(token, past_key_values=ref_past, use_cache=True)
            out = model(token, past_key_values=past, use_cache=True)
            assert len(kn_calls) == 4 * n_layer, f"decode step {step}: {len(kn_calls)} Conv1D calls on our kernel"
            torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
            ref_past, past = ref_out.past_key_values, out.past_key_values
            token = ref_out.logits[:, -1:].argmax(-1)
        ref_tokens = original.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
        tokens = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    return ref_tokens, tokens


@needs_torch
def test_conv1d_without_transformers_says_so(monkeypatch):
    """Without transformers, tensor_ops.torch imports and prepares models as
    before; only asking for Conv1D names what is missing."""
    import sys

    import tensor_ops.torch as tt
    from tensor_ops.torch import modules

    monkeypatch.setattr(modules, "_CONV1D", None)
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="pip install transformers"):
        tt.Conv1D
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    _, result = tt.prepare_model(model, "O1", backend="cpu")
    assert result.metrics["replacements"] == {"Linear -> tensor_ops.torch.Linear": 1}


@needs_torch
def test_fp32_kn_rows_take_torch_on_one_thread():
    """modules.linear_rows leaves a float32 [K, N] weight to torch's addmm on
    one thread (measured faster there) and on the AVX-512 kernels (measured
    faster on a Xeon), and takes it on two threads of the AVX2 kernels; bf16
    and the [N, K] layout are ours either way."""
    from tensor_ops.torch.modules import linear_rows
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 8, generator=g), torch.randn(8, 5, generator=g)
    old = _C.cpu_num_threads()
    isas = _C.cpu_supported_isas()
    try:
        _C.cpu_set_num_threads(1)
        assert linear_rows(x, w, None, "kn") is None
        assert linear_rows(x.bfloat16(), w.bfloat16(), None, "kn") is not None
        assert linear_rows(x, w.t().contiguous(), None) is not None
        _C.cpu_set_num_threads(2)
        if "avx512" in isas:
            _C.cpu_set_isa("avx512")
            assert linear_rows(x, w, None, "kn") is None
            assert linear_rows(x.bfloat16(), w.bfloat16(), None, "kn") is not None
        if "avx2" in isas:
            _C.cpu_set_isa("avx2")
            y = linear_rows(x, w, None, "kn")
            assert y is not None and torch.allclose(y, x @ w, rtol=1e-5, atol=1e-6)
    finally:
        _C.cpu_set_num_threads(old)
        _C.cpu_set_isa("auto")


@needs_torch
@pytest.mark.parametrize("conv1d_view", [False, True])
def test_linear_activation_few_rows_on_our_linear(monkeypatch, conv1d_view, fp32_kn_ours):
    """fused_linear.linear_activation (GPT-2's c_fc + GELU, NeoX / BERT dense +
    act) runs a few-row call without gradient on our linear kernel, on the
    weight as stored (a Conv1D's [in, out] weight arrives as its transposed
    view), inside autograd's Function too; the output and the weight's
    gradient equal torch's linear + activation."""
    from tensor_ops.torch.fused_linear import linear_activation
    calls = []
    real = tensor_ops.ops.linear

    def counting(*a, **k):
        calls.append(k.get("weight_layout", "nk"))
        return real(*a, **k)

    monkeypatch.setattr(tensor_ops.ops, "linear", counting)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 24, generator=g)
    stored = torch.randn(24, 40, generator=g) if conv1d_view else torch.randn(40, 24, generator=g)
    weight = stored.t() if conv1d_view else stored  # [out, in] as linear_activation takes it
    bias = torch.randn(40, generator=g)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias))
    with torch.no_grad():
        got = linear_activation(x, weight, bias, "gelu")
    assert calls == ["kn" if conv1d_view else "nk"]
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    w = stored.detach().clone().requires_grad_()
    got = linear_activation(x, w.t() if conv1d_view else w, bias, "gelu")
    got.sum().backward()
    w_ref = stored.detach().clone().requires_grad_()
    F = torch.nn.functional
    F.gelu(F.linear(x, w_ref.t() if conv1d_view else w_ref, bias)).sum().backward()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
