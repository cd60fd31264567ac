"""Note [half GEMMs in fp32] (tensor_ops/torch/modules.py): the prepared
Linear / Conv1D / Linear + activation compute bfloat16 / float16 GEMMs in
fp32 where torch's half GEMM is slow. Checked here: the results against a
float64 reference (forward and gradients, both weight layouts, the
column-sliced path for large weights), that the rounding is one rounding of
the fp32 product, the policy and its override, what prepare_model reports,
that a prepared half model's logits stay within torch's own half error, and
torch.compile(fullgraph=True) through it."""
import copy

import pytest

torch = pytest.importorskip("torch")

from tensor_ops.torch import modules, prepare_model  # noqa: E402
from tensor_ops.torch.fused_linear import linear_activation  # noqa: E402

HALF = [torch.bfloat16, torch.float16]
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.fixture
def policy(monkeypatch):
    """Sets TENSOR_OPS_HALF_GEMM for one test (the decision is cached per dtype)."""
    monkeypatch.setattr(modules, "_HALF_POLICY", {})

    def set_mode(mode):
        monkeypatch.setenv("TENSOR_OPS_HALF_GEMM", mode)
        modules._HALF_POLICY.clear()

    return set_mode


def ref_linear(x, w, b, kn):
    """float64 x @ w.T + b (kn: x @ w + b) and the bound of its rounding:
    the output's half rounding plus fp32 accumulation over K."""
    x64, w64 = x.double(), w.double()
    wt = w64 if kn else w64.t()
    y = x64 @ wt + (0 if b is None else b.double())
    absdot = x64.abs() @ wt.abs() + (0 if b is None else b.double().abs())
    return y, absdot * (x.shape[-1] + 4) * 2.0 ** -24


def make(shape, dtype, g):
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 1, 1), (17, 33, 65), (40, 256, 300)])
@pytest.mark.parametrize("sliced", [False, True])
def test_forward_against_float64(policy, monkeypatch, dtype, kn, bias, rows, k, n, sliced):
    policy("fp32")
    if sliced:  # a few output columns per slice: the large-weight path
        monkeypatch.setattr(modules, "_WIDEN_CHUNK_BYTES", 4 * k * 7)
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = make((2, rows, k), dtype, g)
    w = make((k, n) if kn else (n, k), dtype, g)
    b = make((n,), dtype, g) if bias else None
    y = modules.widened_linear(x, w, b, "kn" if kn else "nk")
    assert y is not None and y.dtype == dtype and y.shape == (2, rows, n)
    ref, acc = ref_linear(x, w, b, kn)
    err = (y.double() - ref).abs()
    tol = EPS[dtype] * ref.abs() + acc + 1e-30
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize("dtype", HALF)
def test_one_rounding_of_the_fp32_product(policy, dtype):
    """The result is the fp32 GEMM rounded once to the half dtype (not a
    half product, not rounded twice)."""
    policy("fp32")
    g = torch.Generator().manual_seed(5)
    x, w, b = make((64, 96), dtype, g), make((80, 96), dtype, g), make((80,), dtype, g)
    y = modules.widened_linear(x, w, b)
    expect = torch.addmm(b.float(), x.float(), w.float().t()).to(dtype)
    assert torch.equal(y, expect)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kn", [False, True])
def test_gradients_against_float64(policy, dtype, kn):
    policy("fp32")
    g = torch.Generator().manual_seed(11)
    k, n = 48, 40
    x = make((3, 7, k), dtype, g).requires_grad_()
    w = make((k, n) if kn else (n, k), dtype, g).requires_grad_()
    b = make((n,), dtype, g).requires_grad_()
    dy = make((3, 7, n), dtype, g)
    y = modules.widened_linear(x, w, b, "kn" if kn else "nk")
    assert y.grad_fn is not None
    y.backward(dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = x64 @ (w64 if kn else w64.t()) + b64
    y64.backward(dy.double())
    for got, ref, name in ((x.grad, x64.grad, "dx"), (w.grad, w64.grad, "dw"), (b.grad, b64.grad, "db")):
        assert got.dtype == dtype and got.shape == ref.shape, name
        scale = ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= 4 * EPS[dtype] * scale, name


def test_policy_and_override(policy):
    policy("native")
    x = torch.randn(4, 8).to(torch.bfloat16)
    w = torch.randn(5, 8).to(torch.bfloat16)
    assert modules.widened_linear(x, w, None) is None
    policy("fp32")
    assert modules.widened_linear(x, w, None) is not None
    assert modules.widened_linear(x.float(), w.float(), None) is None  # fp32 is torch's
    assert modules.widened_linear(x, w.float(), None) is None  # mixed dtypes: torch's (its error)
    policy("sometimes")
    with pytest.raises(ValueError, match="TENSOR_OPS_HALF_GEMM"):
        modules.widened_linear(x, w, None)
    policy("auto")
    has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert modules.half_gemm_in_fp32(torch.bfloat16) == (not has_bf16)
    assert modules.half_gemm_in_fp32(torch.float32) is False


@pytest.mark.parametrize("mode", ["fp32", "native"])
def test_prepared_model_reports_and_matches(policy, mode):
    """A prepared bf16 MLP says what it does with its GEMMs, and its output
    stays within torch's own bf16 error of the fp32 model's."""
    policy(mode)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with torch.no_grad():
        ref = model(x).double()
        half = copy.deepcopy(model).to(torch.bfloat16)
        torch_err = (half(x.bfloat16()).double() - ref).abs().max().item()
        prepared, result = prepare_model(copy.deepcopy(half), "O1")
        ours_err = (prepared(x.bfloat16()).double() - ref).abs().max().item()
    said = any("GEMMs of the Linear / Conv1D modules computed in float32" in a for a in result.optimizations_applied)
    assert said == (mode == "fp32")
    assert ours_err <= 1.5 * torch_err + 1e-3, (ours_err, torch_err)


def test_linear_activation_and_its_backward(policy):
    policy("fp32")
    g = torch.Generator().manual_seed(3)
    x = make((20, 32), torch.bfloat16, g).requires_grad_()
    w = make((48, 32), torch.bfloat16, g).requires_grad_()
    b = make((48,), torch.bfloat16, g).requires_grad_()
    y = linear_activation(x, w, b, "silu")
    y.sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = torch.nn.functional.silu(x64 @ w64.t() + b64)
    y64.sum().backward()
    assert (y.double() - y64).abs().max().item() <= 4 * EPS[torch.bfloat16] * y64.abs().max().item()
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert (got.double() - ref).abs().max().item() <= 8 * EPS[torch.bfloat16] * ref.abs().max().item()


def test_compiles_without_graph_break(policy):
    policy("fp32")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)).to(torch.bfloat16)
    prepared, _ = prepare_model(copy.deepcopy(model), "O1")
    x = torch.randn(24, 32).to(torch.bfloat16).requires_grad_()
    eager = prepared(x)
    compiled = torch.compile(prepared, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert torch.equal(y, eager)
    y.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(0, 16, 8), (20, 0, 4), (20, 16, 0), (16, 8)])  # rows, K, N; a 1-D input
def test_edges_match_torch(policy, shape):
    """Empty rows, an empty inner dim (the output is the bias), no output
    columns, and a 1-D input: as torch's F.linear on the same values,
    gradients included."""
    policy("fp32")
    g = torch.Generator().manual_seed(7)
    k, n = shape[-2], shape[-1]
    x = make(shape[:-1], torch.bfloat16, g).requires_grad_()
    w = make((n, k), torch.bfloat16, g).requires_grad_()
    b = make((n,), torch.bfloat16, g).requires_grad_()
    y = modules.widened_linear(x, w, b)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    ref = torch.nn.functional.linear(x32, w32, b32)
    assert y.shape == ref.shape and torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    ref.sum().backward()
    for got, want in ((x.grad, x32.grad), (w.grad, w32.grad), (b.grad, b32.grad)):
        assert got.shape == want.shape and torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)
