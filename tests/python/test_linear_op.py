"""tensor_ops.linear (out = x weight^T + bias, made for a few rows of x:
decode) against float64 on every target that has the kernel (the others
refuse it by name); its argument errors; results whose bits depend on
neither the thread count nor the rows around them (Note [linear rows]); and
tensor_ops.torch.Linear, which prepare_model swaps in for nn.Linear."""
import numpy as np
import pytest

import tensor_ops
from conftest import assert_within, bits, DTYPES, FLOOR, np_dtype, RTOL, to64, torch
from tensor_ops import _C

ROWS = [1, 2, 3, 4, 5, 16]
SIZES = [1, 7, 63, 64, 65, 513]  # K and N: below, at and past a register / block / cache line


def make(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def ref_linear(x, w, b=None):
    y = to64(x) @ to64(w).T
    return y if b is None else y + to64(b)


def assert_linear_close(y, x, w, b, dtype, what):
    """|y - ref| within the output's rounding (conftest's RTOL) plus the
    fp32 accumulation's bound: (K / 4 + 4) units of 2^-24 times the sum of
    |x_k w_k| (sums of four or more lanes, each over K / lanes products,
    then their reduction). A sum that cancels to near 0 is judged by the
    magnitudes that went into it, not by its own."""
    got, ref = to64(y), ref_linear(x, w, b)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    absdot = np.abs(to64(x)) @ np.abs(to64(w)).T + (0 if b is None else np.abs(to64(b)))
    k = to64(x).shape[-1]
    tol = RTOL[dtype] * np.abs(ref) + (k / 4 + 4) * 2.0 ** -24 * absdot + FLOOR[dtype]
    assert_within(got, ref, tol, what)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_against_float64(dtype, bias, target, rng):
    target.require("linear")
    for m in ROWS:
        for k in SIZES:
            x = make(rng, (m, k), dtype)
            for n in SIZES:
                w = make(rng, (n, k), dtype)
                b = make(rng, (n,), dtype) if bias else None
                y = tensor_ops.linear(x, w, b)
                assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == (m, n)
                assert_linear_close(y, x, w, b, dtype, f"linear {dtype} x {x.shape} w {w.shape} bias {bias} {target}")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_against_float64(dtype, bias, target, rng):
    target.require("linear")
    tdt = getattr(torch, dtype)
    for lead, k, n in [((1,), 513, 65), ((2, 1), 64, 7), ((3, 5), 63, 513), ((16,), 65, 64), ((1, 1, 1), 7, 1)]:
        x = torch.from_numpy(make(rng, (*lead, k), "float32")).to(tdt)
        w = torch.nn.Parameter(torch.from_numpy(make(rng, (n, k), "float32")).to(tdt))  # a Parameter, as in a model
        b = torch.from_numpy(make(rng, (n,), "float32")).to(tdt) if bias else None
        with torch.no_grad():  # inference (with grad on, the op records it: Note [ops that autograd would record])
            y = tensor_ops.linear(x, w, b)
        assert type(y) is torch.Tensor and y.dtype == tdt and y.shape == (*lead, n) and not y.requires_grad
        assert_linear_close(y, x, w, b, dtype, f"linear torch {dtype} x {tuple(x.shape)} w {tuple(w.shape)}")


def test_strided_x_and_weight_and_out(rng):
    x = make(rng, (3, 2, 40), "float32")[:, 0, 5:38]  # rows 80 apart, 33 wide
    w = make(rng, (9, 70), "float32")[::2, 3:36]  # every other row: row stride 140
    b = make(rng, (5,), "float32")
    out = np.zeros((3, 8), np.float32)[:, 1:6]
    got = tensor_ops.linear(x, w, b, out=out)
    assert got is out
    assert_linear_close(out, x, w, b, "float32", "strided")
    if torch is not None:  # a transposed weight (tied embeddings): the general lane copies it
        wt = torch.from_numpy(make(rng, (33, 5), "float32")).t()
        assert_linear_close(tensor_ops.linear(torch.from_numpy(np.ascontiguousarray(x)), wt), x, wt, None, "float32",
                            "transposed weight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_rows_and_empty_k(dtype, rng):
    npd = np_dtype(dtype)
    w, b = make(rng, (5, 7), dtype), make(rng, (5,), dtype)
    assert tensor_ops.linear(np.empty((0, 7), npd), w, b).shape == (0, 5)
    # K = 0: a sum of nothing, out = the bias (or zeros)
    w0 = np.empty((5, 0), npd)
    y = tensor_ops.linear(np.empty((3, 0), npd), w0, b)
    assert y.shape == (3, 5) and np.array_equal(to64(y), np.broadcast_to(to64(b), (3, 5)))
    y = tensor_ops.linear(np.empty((2, 0), npd), w0)
    assert y.shape == (2, 5) and not to64(y).any()
    if torch is not None:
        tdt = getattr(torch, dtype)
        y = tensor_ops.linear(torch.empty(4, 0, dtype=tdt), torch.empty(5, 0, dtype=tdt), torch.ones(5, dtype=tdt))
        assert y.shape == (4, 5) and bool((y == 1).all())
        assert tensor_ops.linear(torch.empty(0, 3, dtype=tdt), torch.ones(2, 3, dtype=tdt)).shape == (0, 2)


def test_bad_arguments_name_the_shapes_and_dtypes():
    x, w = np.ones((2, 7), np.float32), np.ones((5, 7), np.float32)
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"weight must be \[out_features, 7\].*float32\[2, 7\].*"
                                                              r"float32\[5, 8\]"):
        tensor_ops.linear(x, np.ones((5, 8), np.float32))
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"weight must be \[out_features, 7\].*float32\[35\]"):
        tensor_ops.linear(x, np.ones(35, np.float32))
    with pytest.raises(tensor_ops.DTypeError, match=r"weight has dtype float16 but x has float32"):
        tensor_ops.linear(x, w.astype(np.float16))
    with pytest.raises(tensor_ops.DTypeError, match=r"bias has dtype float16 but x has float32"):
        tensor_ops.linear(x, w, np.ones(5, np.float16))
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"bias must have shape \[5\] to match weight "
                                                              r"float32\[5, 7\], got float32\[4\]"):
        tensor_ops.linear(x, w, np.ones(4, np.float32))
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"out has shape \[2, 6\] but x float32\[2, 7\] and "
                                                              r"weight float32\[5, 7\] give \[2, 5\]"):
        tensor_ops.linear(x, w, out=np.empty((2, 6), np.float32))
    with pytest.raises(tensor_ops.InvalidArgumentError, match=r"at least 1 dimension"):
        tensor_ops.linear(np.ones((), np.float32), w)
    with pytest.raises(tensor_ops.DTypeError, match="int32"):
        tensor_ops.linear(x.astype(np.int32), w.astype(np.int32))
    buf = np.ones((3, 7), np.float32)
    with pytest.raises(tensor_ops.InvalidArgumentError, match="overlaps an input"):
        tensor_ops.linear(buf[:2], w, out=buf[1:, :5])  # out's first row is x's second
    if torch is not None:
        with pytest.raises(tensor_ops.DTypeError, match=r"weight has dtype bfloat16 but x has float32"):
            tensor_ops.linear(torch.ones(2, 7), torch.ones(5, 7, dtype=torch.bfloat16))
        with pytest.raises(tensor_ops.InvalidArgumentError, match=r"weight must be \[out_features, 7\]"):
            tensor_ops.linear(torch.ones(1, 7), torch.ones(5, 6))


def test_out_may_not_alias_an_input():
    buf = np.ones((2, 7), np.float32)
    with pytest.raises(tensor_ops.InvalidArgumentError, match="overlaps an input"):
        tensor_ops.linear(buf, np.ones((7, 7), np.float32), out=buf)  # not even exactly in place


def test_backends_without_the_kernel_refuse_it_by_name():
    """Every usable backend lists linear or refuses it (NotImplementedError
    naming the op and the backend): never another backend's answer."""
    lacking = [b.name for b in tensor_ops.backends() if b.usable and "linear" not in b.ops]
    assert "linear" in {b.name: b for b in tensor_ops.backends()}["cpu"].ops
    if not lacking:
        pytest.skip("every usable backend here has a linear kernel")
    x, w = np.ones((1, 8), np.float32), np.ones((3, 8), np.float32)
    for name in lacking:
        with tensor_ops.use(name):
            with pytest.raises(NotImplementedError, match=f"op linear is not implemented by backend '{name}'"):
                tensor_ops.linear(x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_at_any_thread_count(dtype, restore_threads):
    rng = np.random.default_rng(3)
    x, w, b = make(rng, (5, 300), dtype), make(rng, (1000, 300), dtype), make(rng, (1000,), dtype)
    results = {}
    for threads in [1, 2, 3]:  # 1000 rows of w: dozens of items, split differently per thread count
        _C.cpu_set_num_threads(threads)
        results[threads] = bits(tensor_ops.linear(x, w, b), dtype)
    for threads, got in results.items():
        assert np.array_equal(got, results[1]), f"linear {dtype} differs between 1 and {threads} threads"


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_element_does_not_depend_on_the_rows_around_it(dtype):
    """Each output element is one chain (Note [linear rows]): the same bits
    whether its row of x is alone or one of a batch, and wherever its row
    of w falls in a block (batch-invariant decode)."""
    rng = np.random.default_rng(4)
    x, w = make(rng, (7, 129), dtype), make(rng, (37, 129), dtype)
    full = bits(tensor_ops.linear(x, w), dtype)
    for r in range(7):
        assert np.array_equal(bits(tensor_ops.linear(x[r:r + 1], w), dtype), full[r:r + 1]), f"row {r} of x"
    for j in [0, 5, 8, 33, 36]:
        assert np.array_equal(bits(tensor_ops.linear(x, w[j:j + 3]), dtype), full[:, j:j + 3]), f"rows {j} of w"


# ---- tensor_ops.torch: the op and the Linear module -------------------------------------------------

pytestmark_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


@pytestmark_torch
def test_torch_op_gradients_match_f_linear():
    import tensor_ops.torch as tt

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 9, generator=g, requires_grad=True)
    w = torch.randn(4, 9, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True)
    y = tt.linear(x, w, b)
    (y * torch.arange(24.0).view(3, 2, 4)).sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    ref = torch.nn.functional.linear(x, w, b)
    (ref * torch.arange(24.0).view(3, 2, 4)).sum().backward()
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    for got, t in zip(grads, (x, w, b)):
        assert torch.allclose(got, t.grad, rtol=1e-5, atol=1e-5)


def _mlp(dtype=None):
    torch.manual_seed(6)
    # ReLU: prepare_model leaves it (and its bits) to torch
    return torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.ReLU(), torch.nn.Linear(70, 20, bias=False)).to(dtype)


@pytestmark_torch
@pytest.mark.parametrize("dtype", DTYPES)
def test_prepared_linear_runs_our_kernel_for_a_few_rows_only(dtype, monkeypatch):
    import tensor_ops.torch as tt
    from tensor_ops.torch import modules

    tdt = getattr(torch, dtype)
    model, ref_model = _mlp(tdt), _mlp(tdt)
    _, result = tt.prepare_model(model, "O1")
    assert result.metrics["replacements"]["Linear -> tensor_ops.torch.Linear"] == 2
    assert type(model[0]) is tt.Linear and type(model[2]) is tt.Linear
    assert list(model.state_dict()) == list(ref_model.state_dict())
    rows = []
    real = tensor_ops.ops.linear
    monkeypatch.setattr(tensor_ops.ops, "linear", lambda x, w, b: rows.append(x.numel() // x.shape[-1]) or real(x, w, b))
    m = modules.linear_max_rows(tdt)  # 16, or 4 for a half dtype torch multiplies natively here
    assert m == (modules.LINEAR_MAX_ROWS_NATIVE_HALF if tdt != torch.float32 and not modules.half_gemm_in_fp32(tdt)
                 else modules.LINEAR_MAX_ROWS)
    with torch.no_grad():
        for shape, n in [((1, 33), 1), ((2, 1, 33), 2), ((m, 33), m), ((2, m // 2, 33), m)]:
            rows.clear()
            x = torch.randn(shape).to(tdt)
            h = model[0](x)
            assert rows == [n] and h.shape == (*shape[:-1], 70)
            assert_linear_close(h, x, model[0].weight, model[0].bias, dtype, f"prepared Linear {shape}")
            rows.clear()
            assert model(x).shape == (*shape[:-1], 20) and rows == [n, n]
        rows.clear()
        x = torch.randn(m + 1, 33).to(tdt)  # one row more: torch's GEMM
        assert torch.equal(model(x), ref_model(x)) and rows == []
    x = torch.randn(2, 33).to(tdt)
    y = model(x)  # the weights require grad: F.linear, recorded by autograd
    assert rows == [] and y.requires_grad and torch.equal(y, ref_model(x))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # F.linear casts under autocast
        assert torch.equal(model(x), ref_model(x)) and rows == []


@pytestmark_torch
def test_prepared_linear_falls_back_where_the_backend_has_no_kernel():
    import tensor_ops.torch as tt

    lacking = [b.name for b in tensor_ops.backends() if b.usable and b.name != "cpu" and "linear" not in b.ops]
    if not lacking:
        pytest.skip("no usable backend without a linear kernel here")
    model = tt.Linear(8, 3)
    x = torch.randn(1, 8)
    with torch.no_grad(), tensor_ops.use(lacking[0]):
        assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))


@pytestmark_torch
def test_prepared_linear_compiles_without_a_graph_break():
    import tensor_ops.torch as tt

    model, _ = tt.prepare_model(_mlp(), "O1")
    x = torch.randn(1, 33)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        ref = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, model[0].weight, model[0].bias)),
                                         model[2].weight)
        assert torch.equal(compiled(x), ref)  # traced: torch's F.linear


@pytestmark_torch
def test_linear_is_a_torch_op_with_a_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tensor_ops.torch as tt

    with FakeTensorMode():
        y = tt.OPS["linear"](torch.empty(2, 3, 8, dtype=torch.bfloat16), torch.empty(5, 8, dtype=torch.bfloat16))
        assert y.shape == (2, 3, 5) and y.dtype == torch.bfloat16
