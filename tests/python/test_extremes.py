"""Activations and their backward at special values (inf, -inf, NaN, +-0,
huge finite) against torch's CPU answer, on every backend usable here: the
CPU kernels (vector body and scalar tail), OpenCL and the XLA shim. Same
NaN positions, same infinities, other values within the dtype's tolerance
(the sign of a zero is not compared: torch's own vector and scalar paths
disagree on it). Plus: a causal softmax row with no visible column is 0
(log_softmax: -inf) on every backend."""
import math

import numpy as np
import pytest

import tensor_ops
from conftest import DTYPES, np_dtype

torch = pytest.importorskip("torch")
F = torch.nn.functional

TORCH_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
RTOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}
ATOL = {"float32": 1e-6, "float16": 1e-4, "bfloat16": 1e-3}


def specials(dtype):
    big = float(torch.finfo(TORCH_DT[dtype]).max) * 0.9
    vals = [math.inf, -math.inf, math.nan, 0.0, -0.0, big, -big, 1e4, -1e4, 100.0, -100.0, 20.0, -20.0, 1.5, -1.5]
    return np.array(vals, dtype=np.float64)


def _act(name, approximate):
    if name == "silu":
        return F.silu
    return lambda t: F.gelu(t, approximate=approximate)


# The ops under test: name -> (number of array inputs, tensor_ops call, torch reference on float tensors).
def _torch_bwd(f, xs, dy, wrt):
    ts = [x.detach().clone().requires_grad_(True) for x in xs]
    y = f(*ts)
    return torch.autograd.grad(y, [ts[i] for i in wrt], dy)


def _ops():
    ops = {}
    for act, approximate in [("silu", "none"), ("gelu", "none"), ("gelu", "tanh")]:
        key = act if approximate == "none" else "gelu_tanh"
        f = _act(act, approximate)
        if act == "silu":
            ops[key] = (1, lambda x: tensor_ops.silu(x), lambda x, f=f: (f(x),))
            ops[key + "_backward"] = (2, lambda dy, x: tensor_ops.silu_backward(dy, x),
                                      lambda dy, x, f=f: _torch_bwd(f, [x], dy, [0]))
            glu, glu_bwd = (lambda g, u: tensor_ops.swiglu(g, u)), (lambda dy, g, u: tensor_ops.swiglu_backward(dy, g, u))
            gname = "swiglu"
        else:
            ops[key] = (1, lambda x, a=approximate: tensor_ops.gelu(x, a), lambda x, f=f: (f(x),))
            ops[key + "_backward"] = (2, lambda dy, x, a=approximate: tensor_ops.gelu_backward(dy, x, a),
                                      lambda dy, x, f=f: _torch_bwd(f, [x], dy, [0]))
            glu = lambda g, u, a=approximate: tensor_ops.geglu(g, u, a)
            glu_bwd = lambda dy, g, u, a=approximate: tensor_ops.geglu_backward(dy, g, u, a)
            gname = "geglu" if approximate == "none" else "geglu_tanh"
        ops[gname] = (2, glu, lambda g, u, f=f: (f(g) * u,))
        ops[gname + "_backward"] = (3, glu_bwd, lambda dy, g, u, f=f: _torch_bwd(lambda a, b: f(a) * b, [g, u], dy, [0, 1]))
    return ops


OPS = _ops()


def _inputs(n_in, dtype):
    """Every combination of special values over the inputs (a backward's dy
    too), each repeated 16 times (whole vector lanes)."""
    s = specials(dtype)
    # a gated backward's dy: fewer values (15^3 combinations would be slow)
    dy = np.array([1.0, -2.0, math.inf, -math.inf, math.nan, 0.0, s[5]])
    grids = np.meshgrid(*([dy] if n_in == 3 else []), *([s] * min(n_in, 2)), indexing="ij")
    return [np.repeat(g.ravel(), 16) for g in grids]


def _torch_once(name, arrays, dtype):
    n_in, _, ref = OPS[name]
    gated = name.startswith(("swiglu", "geglu"))
    tdt = torch.float32 if gated else TORCH_DT[dtype]
    ts = [torch.from_numpy(a.astype(np.float32)).to(TORCH_DT[dtype]).to(tdt) for a in arrays]
    outs = ref(*ts)
    return [o.detach().to(TORCH_DT[dtype]).to(torch.float64).numpy() for o in outs]


def torch_reference(name, arrays, dtype):
    """torch's answer, from its scalar code: each distinct combination of
    inputs on a one-element tensor. torch's vector code depends on the CPU:
    its AVX-512 erf GELU gives NaN at +inf in float32 / float16 / bfloat16
    (torch 2.13; its scalar code and its float64 give +inf, as its AVX2
    code does), so a reference from whole vectors would change with the
    machine. A single activation (or its backward) runs in the dtype
    itself; a gated unit's composite rounds its intermediate products to 16
    bits where tensor_ops computes in fp32 and rounds once, so it runs in
    float32 on the rounded inputs and is rounded at the end."""
    n = len(arrays[0])
    cols = None
    for i in range(n):
        if i and all(a[i] == a[i - 1] or (np.isnan(a[i]) and np.isnan(a[i - 1])) for a in arrays):
            for c in cols:
                c.append(c[-1])
            continue
        outs = _torch_once(name, [a[i : i + 1] for a in arrays], dtype)
        cols = [[] for _ in outs] if cols is None else cols
        for c, o in zip(cols, outs):
            c.append(o[0])
    return [np.array(c, dtype=np.float64) for c in cols]


def test_reference_is_torch_scalar_code():
    """The reference above is torch's scalar code even where its vector
    code differs (the case that made it so): gelu(+inf) is +inf."""
    x = np.array([np.inf, 1.5, -np.inf], dtype=np.float64)
    (y,) = torch_reference("gelu", [x], "float32")
    assert y[0] == np.inf and abs(y[1] - 1.5 * 0.5 * (1 + math.erf(1.5 / math.sqrt(2)))) < 1e-6


def check(name, dtype, got, ref, where):
    got = [np.asarray(g, dtype=np.float64) for g in (got if isinstance(got, tuple) else (got,))]
    assert len(got) == len(ref)
    for k, (g, r) in enumerate(zip(got, ref)):
        what = f"{name} output {k} {dtype} on {where}"
        bad = np.isnan(g) != np.isnan(r)
        bad |= np.isinf(r) & (g != r)
        bad |= np.isinf(g) & (g != r)
        fin = np.isfinite(g) & np.isfinite(r)
        with np.errstate(invalid="ignore"):
            bad |= fin & ~(np.abs(g - r) <= RTOL[dtype] * np.abs(r) + ATOL[dtype])
        assert not bad.any(), f"{what}: {int(bad.sum())} mismatches, first got {g[bad][:6]} torch {r[bad][:6]} at {np.flatnonzero(bad)[:6]}"


def _args(name, dtype):
    return _inputs(OPS[name][0], dtype)


def _cast(arrays, dtype):
    return [a.astype(np.float32).astype(np_dtype(dtype)) for a in arrays]


def _run_numpy(name, arrays, dtype):
    out = OPS[name][1](*_cast(arrays, dtype))
    return tuple(np.asarray(o).astype(np.float64) for o in (out if isinstance(out, tuple) else (out,)))


def _run_tail(name, arrays, dtype):
    """Each combination alone (an array of one element: the scalar tail)."""
    n = len(arrays[0])
    picks = range(0, n, 16)
    outs = None
    for i in picks:
        got = _run_numpy(name, [a[i : i + 1] for a in arrays], dtype)
        outs = [[] for _ in got] if outs is None else outs
        for o, g in zip(outs, got):
            o.append(g[0])
    return tuple(np.array(o) for o in outs), [a[::16] for a in arrays]


NAMES = sorted(OPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_cpu_matches_torch_at_special_values(name, dtype):
    arrays = _args(name, dtype)
    with tensor_ops.use("cpu"):
        check(name, dtype, _run_numpy(name, arrays, dtype), torch_reference(name, arrays, dtype), "cpu (vector lanes)")
        got, small = _run_tail(name, arrays, dtype)
        check(name, dtype, got, torch_reference(name, small, dtype), "cpu (scalar tail)")


def _backend_usable(name):
    for b in tensor_ops.backends():
        if b.name == name:
            return b.usable, b.reason
    return False, f"{name} is not listed"


OPENCL_USABLE, OPENCL_REASON = _backend_usable("opencl")


@pytest.mark.skipif(not OPENCL_USABLE, reason=f"opencl is not usable here: {OPENCL_REASON}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_opencl_matches_torch_at_special_values(name, dtype):
    arrays = _args(name, dtype)
    with tensor_ops.use("opencl"):
        check(name, dtype, _run_numpy(name, arrays, dtype), torch_reference(name, arrays, dtype), "opencl")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_xla_matches_torch_at_special_values(name, dtype):
    jnp = pytest.importorskip("jax.numpy")
    arrays = _args(name, dtype)
    xs = [jnp.asarray(a) for a in _cast(arrays, dtype)]
    out = OPS[name][1](*xs)
    got = tuple(np.asarray(o).astype(np.float64) for o in (out if isinstance(out, tuple) else (out,)))
    check(name, dtype, got, torch_reference(name, arrays, dtype), "xla")


# ---- a causal softmax row with no visible column ---------------------------

def _empty_row_softmax(log):
    # 3 query rows over 2 keys, bottom-right aligned: row 0 sees no key.
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    return tensor_ops.log_softmax(x, causal=True) if log else tensor_ops.softmax(x, causal=True)


@pytest.mark.parametrize("log", [False, True])
def test_causal_softmax_row_with_no_visible_column_is_documented_value_on_every_backend(log):
    expect = -np.inf if log else 0.0
    backends = ["cpu"] + (["opencl"] if OPENCL_USABLE else [])
    for b in backends:
        with tensor_ops.use(b):
            y = np.asarray(_empty_row_softmax(log), dtype=np.float64)
        assert np.all(y[0] == expect), f"{b}: row 0 = {y[0]}, documented {expect}"
        assert np.all(np.isfinite(y[1:]) | (y[1:] == expect)), f"{b}: {y}"
    try:
        import jax.numpy as jnp
    except ImportError:
        return
    x = jnp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2))
    y = np.asarray(tensor_ops.log_softmax(x, causal=True) if log else tensor_ops.softmax(x, causal=True))
    assert np.all(y[0] == expect), f"xla: row 0 = {y[0]}, documented {expect}"


@pytest.mark.parametrize("log", [False, True])
def test_scaled_softmax_of_huge_values_is_finite_on_every_target(log, target):
    """softmax(x, scale) with |scale x| past ~2^31, where scale x is inexact
    in fp32: the max is taken of rounded products, so a product fused into
    the subtraction (x * scale - m as one FMA) exceeded the max by up to half
    an ulp of it and e^ overflowed (NaN on the CPU, inf on OpenCL). The
    float64 answer: uniform rows, and [0.5, 0.5, 0, 0, 0]."""
    x = np.array([[1e10] * 5, [4e10, 4e10, 3.9e10, 0.0, 1.0], [-7e12, -7e12, 3.0, 3.0, 3.0]], np.float32)
    scale = 0.7
    x64 = x.astype(np.float64) * np.float32(scale).astype(np.float64)
    z = x64 - x64.max(-1, keepdims=True)
    want = z - np.log(np.exp(z).sum(-1, keepdims=True)) if log else np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    got = np.asarray(tensor_ops.log_softmax(x, scale=scale) if log else tensor_ops.softmax(x, scale=scale),
                     dtype=np.float64)
    assert np.all(np.isfinite(got) | (got == want)), f"{target}: {got}"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(target))


def test_layer_norm_of_a_constant_row_is_its_bias_on_every_target(target):
    """A row of one value normalises to exactly 0, so the output is the bias:
    the mean summed in fp32 lanes was an ulp off, and that ulp divided by
    sqrt(eps) gave up to 0.68 for a row of 12345.678 (the CPU backend)."""
    for c in (1.7, 1000.3, 12345.678, -3.0e4):
        for cols in (1, 7, 512, 4099):
            x = np.full((3, cols), c, np.float32)
            w, b = np.linspace(0.5, 2.0, cols, dtype=np.float32), np.linspace(-1.0, 1.0, cols, dtype=np.float32)
            y = np.asarray(tensor_ops.layer_norm(x, w, b, 1e-5), dtype=np.float32)
            assert np.array_equal(y, np.broadcast_to(b, y.shape)), f"{target}: c={c} cols={cols}: {y[0, :4]}"


@pytest.mark.parametrize("offset", [1e3, 1e5, -3e5])
def test_layer_norm_far_from_zero_as_accurate_as_torch(offset, target):
    """Note [layer_norm's corrected mean] (CPU): rows x = offset + N(0, 1)
    normalised against float64: the fp32 mean was a few ulps of |mean| off
    (at 1e5, 8e-3 of the spread in every output; torch's Welford 2.4e-3).
    Every target is held to a few half-ulps of a float mean (3e-5 of |offset|
    relative to the spread: 0.018 at 3e5); the CPU kernel to 1e-5 (the mean
    split in two floats)."""
    rng = np.random.default_rng(7)
    for cols in (7, 512, 4099):
        x = (offset + rng.standard_normal((4, cols))).astype(np.float32)
        w, b = np.ones(cols, np.float32), np.zeros(cols, np.float32)
        x64 = x.astype(np.float64)
        want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
        got = np.asarray(tensor_ops.layer_norm(x, w, b, 1e-5), dtype=np.float64)
        err = np.abs(got - want).max() / np.abs(want).max()
        bound = 1e-5 if target.backend == "cpu" else 3 * abs(offset) * 2.0 ** -24 + 1e-4
        assert err < bound, f"{target}: cols={cols} error {err:.2e}"


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("causal", [0, 1, 2])
def test_softmax_negative_scale_on_every_target(log, causal, target):
    """scale < 0 on rows whose visible length is no multiple of the vector
    width: OpenCL's padding lanes (-inf) became +inf after the scale, and every
    row was NaN."""
    rng = np.random.default_rng(3)
    for shape in ((1, 1), (40, 17), (17, 40), (3, 9)):
        x = rng.standard_normal(shape).astype(np.float32)
        for scale in (-1.0, -0.001, -3.5):
            z = x.astype(np.float64) * scale
            rows, cols = shape
            keep = np.ones(shape, bool)
            if causal:
                off = 0 if causal == 2 else cols - rows
                keep = np.arange(cols)[None, :] <= np.arange(rows)[:, None] + off
            zm = np.where(keep, z, -np.inf)
            m = zm.max(-1, keepdims=True)
            seen = np.isfinite(m)
            e = np.where(keep, np.exp(zm - np.where(seen, m, 0)), 0.0)
            s = e.sum(-1, keepdims=True)
            if log:
                want = np.where(keep & seen, zm - np.where(seen, m, 0) - np.log(np.where(s > 0, s, 1)), -np.inf)
            else:
                want = np.where(seen, e / np.where(s > 0, s, 1), 0.0)
            f = tensor_ops.log_softmax if log else tensor_ops.softmax
            got = np.asarray(f(x, scale=scale, causal=bool(causal)) if causal != 2 else
                             f(x, scale=scale, causal=True, causal_alignment="top_left"), dtype=np.float64)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{target} {shape} scale={scale}")
