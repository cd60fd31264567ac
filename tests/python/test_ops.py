"""Conformance: every op x every target (CPU ISA levels, then the other usable
backends) x dtype x size vs float64."""
import numpy as np
import pytest

import tensor_ops
from conftest import DTYPES, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu, to64, torch

HIDDEN = [1, 7, 64, 4095, 4096, 8193]
BATCH = {1: (), 2: (3,), 3: (2, 3), 4: (2, 1, 3)}

OPS = {
    "rms_norm": (lambda x, w: tensor_ops.rms_norm(x, w, eps=1e-6), lambda x, w: ref_rms_norm(x, w, 1e-6)),
    "silu": (lambda x, w: tensor_ops.silu(x), lambda x, w: ref_silu(x)),
    "gelu": (lambda x, w: tensor_ops.gelu(x), lambda x, w: ref_gelu(x)),
    "gelu_tanh": (lambda x, w: tensor_ops.gelu(x, approximate="tanh"), lambda x, w: ref_gelu(x, "tanh")),
}


def make(rng, shape, dtype, scale=3.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return x.astype(np_dtype(dtype))


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_numpy_conformance(op, dtype, hidden, rank, target, rng):
    shape = BATCH[rank] + (hidden,)
    x = make(rng, shape, dtype)
    w = make(rng, (hidden,), dtype, 1.0)
    target.require(op.replace("_tanh", ""))
    ours, ref = OPS[op]
    y = ours(x, w)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref(x, w), dtype, f"{op} {dtype} {shape} {target}")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("hidden", [7, 4096, 8193])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_torch_conformance(op, dtype, hidden, target, rng):
    tdt = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal((5, hidden)).astype(np.float32) * 3).to(tdt)
    w = torch.from_numpy(rng.standard_normal(hidden).astype(np.float32)).to(tdt)
    target.require(op.replace("_tanh", ""))
    ours, ref = OPS[op]
    y = ours(x, w)
    assert isinstance(y, torch.Tensor) and y.dtype == tdt and y.shape == x.shape
    assert_close(y, ref(x, w), dtype, f"{op} torch {dtype} {target}")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_functional(dtype, rng):
    tdt = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal((4, 333)).astype(np.float32)).to(tdt)
    w = torch.from_numpy(rng.standard_normal(333).astype(np.float32)).to(tdt)
    F = torch.nn.functional
    for got, want in [
        (tensor_ops.silu(x), F.silu(x.float())),
        (tensor_ops.gelu(x), F.gelu(x.float())),
        (tensor_ops.gelu(x, "tanh"), F.gelu(x.float(), approximate="tanh")),
        (tensor_ops.rms_norm(x, w, 1e-6), F.rms_norm(x.float(), (333,), w.float(), 1e-6)),
    ]:
        assert_close(got, want.double().numpy(), dtype, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_edges(op, dtype, rng):
    ours, ref = OPS[op]
    # one element, empty rows, empty hidden
    for shape in [(1,), (1, 1), (0, 16), (4, 0)]:  # noqa: one element, empty rows, empty hidden
        x = make(rng, shape, dtype)
        w = make(rng, (shape[-1],), dtype)
        y = ours(x, w)
        assert y.shape == x.shape
        assert_close(y, ref(x, w), dtype, f"{op} {shape}")


@pytest.mark.parametrize("op", ["silu", "gelu", "gelu_tanh"])
def test_zero_dim_elementwise(op):
    x = np.array(1.5, dtype=np.float32)
    y = OPS[op][0](x, None)
    assert y.shape == () and abs(float(y) - float(OPS[op][1](x, None))) < 1e-6


@pytest.mark.parametrize("dim", [-1, 0])
def test_zero_dim_softmax_is_a_row_of_one(dim, target):
    """torch's rule: softmax / log_softmax of a 0-d array along dim -1 or 0
    is 1 / 0 (and their backward 0); other dims are out of range. Ours
    refused dim 0 (numpy input: both)."""
    x = np.array(0.3, dtype=np.float32)
    assert np.asarray(tensor_ops.softmax(x, dim)).shape == ()
    assert float(tensor_ops.softmax(x, dim)) == 1.0 and float(tensor_ops.log_softmax(x, dim)) == 0.0
    assert float(tensor_ops.softmax_backward(np.array(2.0, np.float32), np.array(1.0, np.float32), dim)) == 0.0
    with pytest.raises(ValueError, match="out of range"):
        tensor_ops.softmax(x, 1)
    with pytest.raises(ValueError, match="at least 2 dimensions"):  # causal: rows and columns
        tensor_ops.softmax(x, dim, causal=True)
    for dy, y in ((np.array(1.0, np.float32), np.ones(1, np.float32)), (np.ones(1, np.float32), np.array(1.0, np.float32))):
        with pytest.raises(ValueError, match="dy has shape"):
            tensor_ops.softmax_backward(dy, y, dim)


def test_zero_dim_softmax_on_xla_and_torch():
    torch = pytest.importorskip("torch")
    import tensor_ops.torch as tt
    for dim in (-1, 0):
        t = torch.tensor(0.3, requires_grad=True)
        for f in (tt.softmax, tt.log_softmax, torch.ops.tensor_ops.softmax):
            y = f(t, dim)
            want = torch.softmax(t, dim) if f is not tt.log_softmax else torch.log_softmax(t, dim)
            assert y.shape == () and float(y) == float(want)
            (g,) = torch.autograd.grad(y * 2, t)
            assert float(g) == 0.0
    jnp = pytest.importorskip("jax.numpy")
    for dim in (-1, 0):
        assert float(tensor_ops.softmax(jnp.asarray(0.3), dim)) == 1.0
        assert float(tensor_ops.log_softmax(jnp.asarray(0.3), dim)) == 0.0
        assert float(tensor_ops.softmax_backward(jnp.asarray(2.0), jnp.asarray(1.0), dim)) == 0.0
    with pytest.raises(ValueError, match="out of range"):
        tensor_ops.softmax(jnp.asarray(0.3), 1)


@pytest.mark.parametrize("op", ["silu", "gelu", "gelu_tanh"])
def test_special_values(op):
    x = np.array([0.0, -0.0, np.nan, 1e-30, -1e-30, 20.0, -20.0, 1e4], dtype=np.float32)
    y = OPS[op][0](x, None)
    ref = OPS[op][1](x, None)
    assert np.isnan(y[2])
    fin = np.isfinite(ref)
    np.testing.assert_allclose(y[fin].astype(np.float64), ref[fin], rtol=1e-5, atol=1e-30)


def test_rms_norm_nan_row_isolated(rng):
    x = make(rng, (3, 64), "float32")
    x[1, 5] = np.nan
    y = tensor_ops.rms_norm(x, np.ones(64, np.float32))
    assert np.isnan(y[1]).all()
    assert np.isfinite(y[0]).all() and np.isfinite(y[2]).all()


def test_rms_norm_huge_eps(rng):
    x = make(rng, (2, 64), "float32")
    w = np.ones(64, np.float32)
    y = tensor_ops.rms_norm(x, w, eps=1e30)
    assert_close(y, ref_rms_norm(x, w, 1e30), "float32", "huge eps")


def test_rms_norm_zero_row():
    x = np.zeros((2, 8), np.float32)
    y = tensor_ops.rms_norm(x, np.ones(8, np.float32), eps=1e-6)
    assert (y == 0).all()


def test_large_multithreaded_matches_rowwise(rng):
    x = make(rng, (256, 4096), "float32")
    w = make(rng, (4096,), "float32")
    y = tensor_ops.rms_norm(x, w)
    rows = np.stack([tensor_ops.rms_norm(x[i], w) for i in range(0, 256, 37)])
    np.testing.assert_array_equal(y[::37], rows)
    s = tensor_ops.silu(x)
    np.testing.assert_array_equal(s[5], tensor_ops.silu(x[5]))


def test_out_in_the_other_columns_of_the_same_rows():
    """Note [row-strided overlap]: out= in the other half of each row of the
    buffer x lives in shares no element with x (the fused gate / up pattern,
    swiglu(gate, up, out=gate)); it was refused as a partial overlap. A real
    partial overlap is still refused, with both views described."""
    rng = np.random.default_rng(0)
    for mod in ("numpy", "torch"):
        if mod == "torch" and torch is None:
            continue
        b = rng.standard_normal((4, 128)).astype(np.float32)
        x_ref = b[:, :64].copy()
        up_ref = b[:, 64:].copy()
        if mod == "torch":
            b = torch.from_numpy(b)
        x, o = b[:, :64], b[:, 64:]
        tensor_ops.silu(x, out=o)
        np.testing.assert_allclose(np.asarray(o), ref_silu(to64(x_ref)), rtol=1e-6, atol=1e-7)
        b[:, 64:] = torch.from_numpy(up_ref) if mod == "torch" else up_ref
        tensor_ops.swiglu(x, o, out=x)  # gate = x, up = o: out into gate
        np.testing.assert_allclose(np.asarray(x), ref_silu(to64(x_ref)) * up_ref, rtol=1e-5, atol=1e-6)
        tensor_ops.rms_norm(b[1:, 64:], np.ones(64, np.float32) if mod == "numpy" else torch.ones(64), out=b[:-1, :64])
        with pytest.raises(tensor_ops.InvalidArgumentError, match=r"overlaps.*\[4, 64\]"):
            tensor_ops.silu(b[:, :64], out=b[:, 32:96])
