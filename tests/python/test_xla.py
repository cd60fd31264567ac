"""The XLA shim (tensor_ops.xla) on jax's CPU device: every op x dtype x odd
sizes and edges against the float64 references of the native conformance
tests; jax arrays in, jax arrays of the same dtype out; jit composition;
devices; routing; the torch_xla path's math on CPU tensors."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA shim needs jax (pip install jax jaxlib)")
import jax.numpy as jnp  # noqa: E402

import tensor_ops  # noqa: E402
from tensor_ops import _xla_route, xla  # noqa: E402
from conftest import DTYPES, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu, to64, torch  # noqa: E402
from test_ops_llm import (  # noqa: E402  (one set of references for native and shim)
    ATTN_SHAPES, alignment, make, ref_attention, ref_cross_entropy, ref_layer_norm, ref_rope, ref_softmax, rope_tables)

HIDDEN = [1, 7, 4095, 8193]


def jx(a):
    return jnp.asarray(a)


def check(got, ref, dtype, what, like=None):
    """got is a jax array of the input's dtype and matches ref."""
    assert isinstance(got, jax.Array), f"{what}: got {type(got).__name__}, not a jax array"
    if like is not None:
        assert got.dtype == like.dtype, f"{what}: dtype {got.dtype} != input {like.dtype}"
    assert_close(got, ref, dtype, what)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(hidden, dtype, rng):
    x, w = make(rng, (3, hidden), dtype, 3), make(rng, (hidden,), dtype)
    check(xla.rms_norm(jx(x), jx(w)), ref_rms_norm(x, w, 1e-6), dtype, "rms_norm", x)
    check(xla.rms_norm(jx(x), jx(w), 0.5), ref_rms_norm(x, w, 0.5), dtype, "eps=0.5", x)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations(hidden, dtype, rng):
    x = make(rng, (3, hidden), dtype, 4)
    check(xla.silu(jx(x)), ref_silu(x), dtype, "silu", x)
    check(xla.gelu(jx(x)), ref_gelu(x), dtype, "gelu", x)
    check(xla.gelu(jx(x), "tanh"), ref_gelu(x, "tanh"), dtype, "gelu tanh", x)


def test_activation_tails():
    x = np.array([-100.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 100.0], np.float32)
    check(xla.silu(jx(x)), ref_silu(x), "float32", "silu tails")
    check(xla.gelu(jx(x)), ref_gelu(x), "float32", "gelu tails")
    check(xla.gelu(jx(x), "tanh"), ref_gelu(x, "tanh"), "float32", "gelu tanh tails")


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(hidden, dtype, rng):
    x, w, b = make(rng, (3, hidden), dtype, 3), make(rng, (hidden,), dtype), make(rng, (hidden,), dtype)
    check(xla.layer_norm(jx(x), jx(w), jx(b)), ref_layer_norm(x, w, b, 1e-5), dtype, "with bias", x)
    check(xla.layer_norm(jx(x), jx(w)), ref_layer_norm(x, w, None, 1e-5), dtype, "no bias", x)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(hidden, dtype, rng):
    x, r, w = make(rng, (2, 3, hidden), dtype), make(rng, (2, 3, hidden), dtype), make(rng, (hidden,), dtype)
    y, res = xla.add_rms_norm(jx(x), jx(r), jx(w))
    s = (to64(x) + to64(r)).astype(np.float32).astype(np_dtype(dtype))  # the stored residual
    check(res, to64(s), dtype, "residual", x)
    check(y, ref_rms_norm(s, w, 1e-6), dtype, "normed", x)


@pytest.mark.parametrize("shape", [(3, 1), (2, 7), (2, 4095), (1, 8193), (2, 3, 5, 9), (6,)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(shape, dtype, rng):
    x = make(rng, shape, dtype, 4)
    check(xla.softmax(jx(x), scale=0.5), ref_softmax(x, 0.5), dtype, "softmax", x)
    check(xla.log_softmax(jx(x)), ref_softmax(x, log=True), dtype, "log_softmax", x)
    if len(shape) >= 2:
        check(xla.softmax(jx(x), causal=True), ref_softmax(x, causal=True), dtype, "causal", x)
        got = xla.log_softmax(jx(x), scale=2.0, causal=True)
        assert isinstance(got, jax.Array) and got.dtype == x.dtype
        check_masked_log(got, x, 2.0, dtype)
        check(xla.softmax(jx(x), dim=0), np.moveaxis(ref_softmax(np.moveaxis(x, 0, -1)), -1, 0), dtype, "dim0", x)


def check_masked_log(got, x, scale, dtype):
    """Masked entries are exactly -inf (the reference gives NaN on fully
    masked rows); the rest matches."""
    ref = ref_softmax(x, scale, causal=True, log=True)
    keep = np.isfinite(ref)
    g = to64(got)
    assert (g[~keep] == -np.inf).all(), "log causal: masked entries must be -inf"
    assert_close(np.where(keep, g, 0.0), np.where(keep, ref, 0.0), dtype, "log causal")


def test_softmax_causal_fully_masked_rows():
    x = jnp.ones((4, 2), jnp.float32)  # 4 queries, 2 keys: rows 0, 1 see nothing
    y = np.asarray(xla.softmax(x, causal=True))
    np.testing.assert_array_equal(y[:2], 0)
    np.testing.assert_allclose(y[3], [0.5, 0.5])
    ly = np.asarray(xla.log_softmax(x, causal=True))
    assert np.all(ly[:2] == -np.inf) and ly[2, 1] == -np.inf
    np.testing.assert_allclose(ly[3], np.log([0.5, 0.5]), rtol=1e-6)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["swiglu", "geglu", "geglu_tanh"])
def test_gated(act, hidden, dtype, rng):
    g, u = make(rng, (3, hidden), dtype, 3), make(rng, (3, hidden), dtype)
    if act == "swiglu":
        got, ref = xla.swiglu(jx(g), jx(u)), ref_silu(g) * to64(u)
    else:
        approx = "tanh" if act == "geglu_tanh" else "none"
        got, ref = xla.geglu(jx(g), jx(u), approx), ref_gelu(g, approx) * to64(u)
    check(got, ref, dtype, act, g)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(2, 5, 3, 8, 8), (1, 7, 2, 64, 32), (3, 1, 1, 6, 2), (1, 3, 5, 130, 128)])
def test_rope(dims, interleaved, dtype, rng):
    B, S, H, D, R = dims
    x = make(rng, (B, S, H, D), dtype)
    cos, sin = rope_tables(S + 5, R, dtype)
    pos = rng.integers(0, S + 5, size=(B, S)).astype(np.int32)
    check(xla.rope(jx(x), jx(cos), jx(sin), jx(pos), interleaved), ref_rope(x, cos, sin, pos, interleaved),
          dtype, "rope", x)
    default = ref_rope(x, cos, sin, np.arange(S)[None, :], interleaved)
    check(xla.rope(jx(x), jx(cos), jx(sin), interleaved=interleaved), default, dtype, "default positions", x)
    check(xla.rope(jx(x), jx(cos), jx(sin), jx(np.arange(S)), interleaved), default, dtype, "1-d positions", x)
    check(xla.rope_backward(jx(x), jx(cos), jx(sin), jx(pos), interleaved),
          ref_rope(x, cos, sin, pos, interleaved, inverse=True), dtype, "inverse", x)


def test_rope_bad_positions():
    x = jnp.ones((1, 2, 1, 4), jnp.float32)
    cos, sin = (jx(t) for t in rope_tables(3, 4, "float32"))
    with pytest.raises(ValueError, match="position"):
        xla.rope(x, cos, sin, jnp.array([[0, 5]]))
    with pytest.raises(ValueError, match="rotary_dim"):
        xla.rope(x, *(jx(t) for t in rope_tables(3, 6, "float32")))
    with pytest.raises(TypeError, match="int32 or int64"):
        xla.rope(x, cos, sin, jnp.array([[0.0, 1.0]]))
    # Under jit the values are unknown at trace time: a bad position reads NaN.
    y = jax.jit(lambda p: xla.rope(x, cos, sin, p))(jnp.array([[0, 5]]))
    assert np.isnan(np.asarray(y)[0, 1]).all() and np.isfinite(np.asarray(y)[0, 0]).all()


@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention(shape, causal, dtype, rng):
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = make(rng, (B, Hq, Lq, D), dtype), make(rng, (B, Hkv, Lk, D), dtype), make(rng, (B, Hkv, Lk, D), dtype)
    al = alignment(causal)
    out, lse = xla.attention(jx(q), jx(k), jx(v), causal=bool(causal), return_lse=True, causal_alignment=al)
    check(out, ref_attention(q, k, v, causal, 1 / math.sqrt(D)), dtype, "attention", q)
    assert lse.dtype == jnp.float32 and lse.shape == (B, Hq, Lq)
    check(xla.attention(jx(q), jx(k), jx(v), bool(causal), scale=0.3, causal_alignment=al),
          ref_attention(q, k, v, causal, 0.3), dtype, "scale", q)


def test_attention_lse_and_masked_rows():
    q, k, v = jnp.ones((1, 1, 4, 2)), jnp.ones((1, 1, 2, 2)), jnp.arange(4.0).reshape(1, 1, 2, 2)
    out, lse = xla.attention(q, k, v, causal=True, scale=1.0, return_lse=True)
    out, lse = np.asarray(out)[0, 0], np.asarray(lse)[0, 0]
    np.testing.assert_array_equal(out[:2], 0)  # queries 0, 1 see no key
    assert np.all(lse[:2] == -np.inf)
    np.testing.assert_allclose(out[3], [1.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(lse[2:], [2.0, 2.0 + math.log(2.0)], rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 7, 4095, 8193])
def test_cross_entropy(C, dtype, rng):
    N = 6
    logits = make(rng, (N, C), dtype, 3)
    target = rng.integers(0, C, size=N).astype(np.int32)
    target[2] = -100
    loss_rows, grad, n = ref_cross_entropy(logits, target)
    got = xla.cross_entropy(jx(logits), jx(target))
    assert isinstance(got, jax.Array) and got.dtype == jnp.float32 and got.shape == ()
    assert abs(float(got) - loss_rows.sum() / n) <= 1e-5 * abs(loss_rows.sum() / n) + 1e-6
    assert abs(float(xla.cross_entropy(jx(logits), jx(target), reduction="sum")) - loss_rows.sum()) <= \
        1e-5 * abs(loss_rows.sum()) + 1e-6
    assert_close(xla.cross_entropy(jx(logits), jx(target), reduction="none"), loss_rows, "float32", "per row")
    loss, dl = xla.cross_entropy_with_grad(jx(logits), jx(target))
    check(dl, grad / n, dtype, "dlogits", logits)
    with pytest.raises(ValueError, match="target"):
        bad = target.copy()
        bad[0] = C
        xla.cross_entropy(jx(logits), jx(bad))


def test_cross_entropy_all_ignored_is_nan():
    loss, dl = xla.cross_entropy_with_grad(jnp.ones((2, 3)), jnp.array([-100, -100]))
    assert np.isnan(float(loss)) and not np.asarray(dl).any()


# ---- backward ops: against the native CPU ops (themselves checked against
# torch autograd in test_ops_llm) --------------------------------------------


def close_to_native(got, native, dtype, what, factor=4):
    ref = to64(native)
    assert isinstance(got, jax.Array)
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1.0)
    from conftest import ATOL, FLOOR, RTOL
    tol = factor * (RTOL[dtype] * np.abs(ref) + ATOL[dtype] * scale) + FLOOR[dtype]
    err = np.abs(to64(got) - ref)
    assert (err <= tol).all(), f"{what}: max err {err.max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_ops_match_native(dtype, rng):
    x, w, b, dy, u = (make(rng, s, dtype) for s in [(3, 77), (77,), (77,), (3, 77), (3, 77)])
    for got, nat, what in [
        (xla.rms_norm_backward(jx(dy), jx(x), jx(w)), tensor_ops.rms_norm_backward(dy, x, w), "rms"),
        (xla.layer_norm_backward(jx(dy), jx(x), jx(w))[:2], tensor_ops.layer_norm_backward(dy, x, w)[:2], "ln"),
        (xla.swiglu_backward(jx(dy), jx(x), jx(u)), tensor_ops.swiglu_backward(dy, x, u), "swiglu"),
        (xla.geglu_backward(jx(dy), jx(x), jx(u), "tanh"), tensor_ops.geglu_backward(dy, x, u, "tanh"), "geglu"),
    ]:
        for i, (g, n) in enumerate(zip(got, nat)):
            assert g.dtype == x.dtype
            close_to_native(g, n, dtype, f"{what}[{i}]")
    close_to_native(xla.layer_norm_backward(jx(dy), jx(x), jx(w))[2], tensor_ops.layer_norm_backward(dy, x, w)[2],
                    dtype, "ln db")
    assert xla.layer_norm_backward(jx(dy), jx(x), jx(w), bias=False)[2] is None
    close_to_native(xla.silu_backward(jx(dy), jx(x)), tensor_ops.silu_backward(dy, x), dtype, "silu")
    close_to_native(xla.gelu_backward(jx(dy), jx(x)), tensor_ops.gelu_backward(dy, x), dtype, "gelu")
    for log in (False, True):
        y = (tensor_ops.log_softmax if log else tensor_ops.softmax)(x, scale=0.7)
        fn, nat = (xla.log_softmax_backward, tensor_ops.log_softmax_backward) if log else \
            (xla.softmax_backward, tensor_ops.softmax_backward)
        close_to_native(fn(jx(dy), jx(y), scale=0.7), nat(dy, y, scale=0.7), dtype, f"softmax log={log}")
        close_to_native(fn(jx(dy), jx(y), dim=0), np.moveaxis(nat(np.moveaxis(dy, 0, -1), np.moveaxis(y, 0, -1)),
                                                               -1, 0), dtype, f"softmax dim0 log={log}")


@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Lq", [7, 12])
def test_attention_backward_matches_native(Lq, causal, dtype, rng):
    B, Hq, Hkv, Lk, D = 2, 4, 2, 9, 16
    q, k, v = make(rng, (B, Hq, Lq, D), dtype), make(rng, (B, Hkv, Lk, D), dtype), make(rng, (B, Hkv, Lk, D), dtype)
    do = make(rng, (B, Hq, Lq, D), dtype)
    kw = {"causal": bool(causal), "causal_alignment": alignment(causal)}
    out, lse = tensor_ops.attention(q, k, v, return_lse=True, **kw)
    native = tensor_ops.attention_backward(do, q, k, v, out, lse, **kw)
    got = xla.attention_backward(jx(do), jx(q), jx(k), jx(v), **kw)
    # The native backward reads the rounded out (flash style); the shim
    # recomputes it: in 16-bit they differ by that rounding.
    for g, n, what in zip(got, native, ["dq", "dk", "dv"]):
        close_to_native(g, n, dtype, what, 4 if dtype == "float32" else 12)


# ---- edges, jit, errors ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_single_element(dtype):
    dt = np_dtype(dtype)
    for shape in [(0, 8), (1, 1)]:
        x, w = jnp.ones(shape, dt), jnp.ones(shape[-1:], dt)
        for y in [xla.rms_norm(x, w), xla.silu(x), xla.gelu(x), xla.layer_norm(x, w, w), xla.softmax(x),
                  xla.log_softmax(x), xla.swiglu(x, x), xla.geglu(x, x), *xla.add_rms_norm(x, x, w)]:
            assert isinstance(y, jax.Array) and y.shape == shape and y.dtype == dt
    one = np.asarray(xla.softmax(jnp.full((1, 1), 3.0, dt)), np.float32)
    assert one[0, 0] == 1.0
    assert float(np.asarray(xla.layer_norm(jnp.full((1, 1), 5.0, dt), jnp.ones(1, dt)), np.float32)[0, 0]) == 0.0
    q = jnp.ones((1, 2, 0, 4), dt)
    assert xla.attention(q, jnp.ones((1, 2, 3, 4), dt), jnp.ones((1, 2, 3, 4), dt)).shape == q.shape
    out = xla.attention(jnp.ones((1, 2, 3, 4), dt), jnp.ones((1, 2, 0, 4), dt), jnp.ones((1, 2, 0, 4), dt))
    assert not np.asarray(out, np.float32).any()  # no key: zeros, as natively
    assert xla.rope(jnp.ones((1, 0, 2, 4), dt), jnp.ones((3, 2), dt), jnp.ones((3, 2), dt)).shape == (1, 0, 2, 4)
    assert float(xla.cross_entropy(jnp.ones((0, 8), dt), jnp.zeros(0, jnp.int32), reduction="sum")) == 0.0


def test_jit_composition_and_grad(rng):
    x, w = jx(make(rng, (4, 33), "float32")), jx(make(rng, (33,), "float32"))

    def block(a):
        h = xla.rms_norm(a, w)
        return xla.softmax(xla.swiglu(h, a), causal=True)

    eager = block(x)
    jitted = jax.jit(block)(x)
    assert isinstance(jitted, jax.Array)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-7)
    g = jax.grad(lambda a: xla.rms_norm(a, w).sum())(x)
    dx, _ = xla.rms_norm_backward(jnp.ones_like(x), x, w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(dx), rtol=1e-5, atol=1e-6)
    bf = jax.jit(lambda a: xla.gelu(a, "tanh"))(x.astype(jnp.bfloat16))
    assert bf.dtype == jnp.bfloat16


def test_errors_match_native():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(TypeError):
        xla.swiglu(x, x.astype(jnp.float16))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        xla.silu(jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="shape"):
        xla.swiglu(x, jnp.ones((2, 9)))
    with pytest.raises(ValueError, match="weight"):
        xla.rms_norm(x, jnp.ones(7))
    with pytest.raises(ValueError, match="eps"):
        xla.layer_norm(x, jnp.ones(8), eps=-1.0)
    with pytest.raises(ValueError, match="approximate"):
        xla.gelu(x, "fast")
    with pytest.raises(ValueError, match="dim"):
        xla.softmax(x, dim=5)
    with pytest.raises(ValueError, match="last dim"):
        xla.softmax(x, dim=0, causal=True)
    with pytest.raises(ValueError, match="kv heads"):
        xla.attention(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="reduction"):
        xla.cross_entropy(x, jnp.zeros(2, jnp.int32), reduction="avg")
    with pytest.raises(TypeError, match="int32 or int64"):
        xla.cross_entropy(x, jnp.zeros(2, jnp.float32))
    assert issubclass(tensor_ops.InvalidArgumentError, ValueError)


# ---- devices, status, array kinds --------------------------------------------


def test_devices_and_status():
    ds = xla.xla_devices()
    assert ds, "jax lists at least its CPU device"
    infos = [tensor_ops.DeviceInfo(**d) for d in ds]  # DeviceInfo-compatible
    expected = "tpu" if jax.default_backend() == "tpu" else "xla"
    assert all(d.backend == expected and d.is_available for d in infos)
    assert {d.device_type for d in infos} <= {"cpu", "gpu", "tpu"}
    assert infos[0].properties["jax"] == jax.__version__ and infos[0].properties["platform"]
    assert [d.device_id for d in infos] == list(range(len(infos)))
    st = tensor_ops.BackendStatus(**xla.backend_status())
    assert st.name == expected and st.usable and st.reason == "" and "jax" in st.library


def test_status_without_jax(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # `import jax` now fails
    st = xla.backend_status()
    assert not st["usable"] and st["reason"] == "jax not installed" and st["name"] == "xla"
    assert xla.xla_devices() == []
    with pytest.raises(RuntimeError, match="jax not installed"):
        xla.silu(np.ones(3, np.float32))


def test_is_xla_array():
    x = jnp.ones(3)
    assert xla.is_xla_array(x) and not xla.is_xla_array(np.ones(3)) and not xla.is_xla_array(3.0)
    if torch is not None:
        assert not xla.is_xla_array(torch.ones(3))
    seen = []
    jax.jit(lambda a: seen.append(xla.is_xla_array(a)) or a)(x)  # a tracer counts
    assert seen == [True]


# ---- routing (what the top level uses once integrated) ------------------------


def test_routing_wrapper(monkeypatch):
    calls = []

    def native(x, weight, eps=1e-6, *, out=None):
        # As the native ops do: the core refuses host arrays while the shim is selected.
        if tensor_ops._C.external_selected():
            raise tensor_ops.errors.ExternalBackendSelected("shim selected")
        calls.append("native")
        return "native"

    op = _xla_route.routed("rms_norm", native)
    x, w = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32), np.ones(5, np.float32)
    monkeypatch.delenv("TENSOR_OPS_BACKEND", raising=False)
    assert op(x, w) == "native"
    y = op(jx(x), jx(w))  # a jax array in: the shim, a jax array out
    assert isinstance(y, jax.Array)
    with pytest.raises(ValueError, match="immutable"):
        op(jx(x), jx(w), out=np.empty_like(x))
    for select in ["env", "scope", "set"]:
        if select == "env":
            monkeypatch.setenv("TENSOR_OPS_BACKEND", "tpu")
            got = op(x, w)
        elif select == "scope":
            with tensor_ops.use("xla"):
                got = op(x, w)
                with tensor_ops.use("cpu"):  # an inner native scope wins
                    assert op(x, w) == "native"
        else:
            tensor_ops.set_backend("xla")
            try:
                got = op(x, w)
            finally:
                tensor_ops.set_backend(None)
        assert type(got) is np.ndarray and got.flags.writeable, select
        assert_close(got, ref_rms_norm(x, w), "float32", select)
        monkeypatch.delenv("TENSOR_OPS_BACKEND", raising=False)
    with tensor_ops.use("xla"):
        out = np.empty_like(x)
        assert op(x, w, out=out) is out
        assert_close(out, ref_rms_norm(x, w), "float32", "out=")
        with pytest.raises(TypeError, match="float64"):
            op(x.astype(np.float64), w.astype(np.float64))
    assert calls == ["native", "native"]


def test_routing_rope_tables():
    rope = tensor_ops.rope
    xr = np.random.default_rng(1).standard_normal((1, 3, 2, 8)).astype(np.float16)
    cos, sin = rope_tables(5, 8, "float32")
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)  # float64 tables: cast to x's dtype, as natively
    with tensor_ops.use("xla"):
        got = rope(xr, cos, sin=sin)
    assert got.dtype == np.float16
    assert_close(got, ref_rope(xr, cos.astype(np.float16), sin.astype(np.float16), np.arange(3)[None], False),
                 "float16", "routed rope")


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_routing_torch_cpu_and_bf16():
    op = tensor_ops.add_rms_norm
    x = torch.randn(3, 9, dtype=torch.bfloat16)
    w = torch.ones(9, dtype=torch.bfloat16)
    with tensor_ops.use("tpu"):
        y, res = op(x, x, w)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and res.dtype == torch.bfloat16
    s = (to64(x) * 2).astype(np.float32).astype(np_dtype("bfloat16"))
    assert_close(y, ref_rms_norm(s, w), "bfloat16", "torch bf16 routed")
    ce = tensor_ops.cross_entropy
    with tensor_ops.use("xla"):
        loss = ce(np.zeros((2, 3), np.float32), np.array([0, 2], np.int64))
    assert isinstance(loss, np.float32) and abs(float(loss) - math.log(3)) < 1e-6


# ---- the torch_xla path's math, on CPU tensors (no XLA device here) ----------


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_math_on_cpu(dtype, rng):
    from tensor_ops import _xla_torch as tx

    tdt = getattr(torch, dtype)
    t = lambda a: torch.from_numpy(to64(a)).to(tdt)  # noqa: E731
    x, w, b = make(rng, (3, 77), dtype, 3), make(rng, (77,), dtype), make(rng, (77,), dtype)
    assert_close(tx.rms_norm(t(x), t(w), 1e-6), ref_rms_norm(x, w), dtype, "rms")
    assert_close(tx.silu(t(x)), ref_silu(x), dtype, "silu")
    assert_close(tx.gelu(t(x), "tanh"), ref_gelu(x, "tanh"), dtype, "gelu")
    assert_close(tx.layer_norm(t(x), t(w), t(b), 1e-5), ref_layer_norm(x, w, b, 1e-5), dtype, "ln")
    assert_close(tx.glu(t(x), t(x), "silu"), ref_silu(x) * to64(x), dtype, "swiglu")
    sm = make(rng, (4, 2), dtype)  # rows 0, 1 fully masked
    assert_close(tx.softmax(t(sm), -1, 0.5, True, False), ref_softmax(sm, 0.5, True), dtype, "softmax")
    check_masked_log(tx.softmax(t(sm), -1, 1.0, True, True), sm, 1.0, dtype)
    B, S, H, D, R = 2, 5, 3, 10, 8
    xr = make(rng, (B, S, H, D), dtype)
    cos, sin = rope_tables(S + 2, R, dtype)
    pos = rng.integers(0, S + 2, size=(B, S))
    for inter in (False, True):
        assert_close(tx.rope(t(xr), t(cos), t(sin), torch.from_numpy(pos), inter, False),
                     ref_rope(xr, cos, sin, pos, inter), dtype, f"rope {inter}")
    q, k, v = make(rng, (1, 4, 6, 8), dtype), make(rng, (1, 2, 3, 8), dtype), make(rng, (1, 2, 3, 8), dtype)
    for mode, causal in ((1, True), (2, "top_left")):
        out, lse = tx.attention(t(q), t(k), t(v), mode, None)
        assert_close(out, ref_attention(q, k, v, causal, 1 / math.sqrt(8)), dtype, f"attention {causal}")
    tgt = np.array([1, -100, 0])
    loss_rows, _, n = ref_cross_entropy(x[:, :7], tgt)
    got = float(tx.cross_entropy(t(x[:, :7]), torch.from_numpy(tgt), -100, "mean"))
    assert abs(got - loss_rows.sum() / n) < 1e-5 * abs(loss_rows.sum() / n) + 1e-6


# ---- the top level: routing to the shim -----------------------------------------


def run_py(code, **env):
    e = {k: v for k, v in os.environ.items() if k != "TENSOR_OPS_BACKEND"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)


def test_env_backend_tpu_routes_host_arrays():
    code = (
        "import numpy as np, tensor_ops\n"
        "x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)\n"
        "y = tensor_ops.rms_norm(x, np.ones(7, np.float32))\n"
        "assert type(y) is np.ndarray and y.dtype == np.float32, type(y)\n"
        "ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)\n"
        "assert np.abs(y - ref).max() < 1e-5\n"
        "names = {b.name: b for b in tensor_ops.backends()}\n"
        "assert names['xla'].usable, names\n"
        "assert any(d.backend == 'xla' for d in tensor_ops.devices())\n"
        "print('backend', tensor_ops.get_backend())\n"
    )
    r = run_py(code, TENSOR_OPS_BACKEND="tpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] in ("backend xla", "backend tpu")


def test_top_level_ops_take_jax_arrays(rng):
    x, w = make(rng, (3, 7), "bfloat16"), make(rng, (7,), "bfloat16")
    y = tensor_ops.rms_norm(jx(x), jx(w))
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16
    assert_close(y, ref_rms_norm(x, w), "bfloat16", "top-level rms_norm")
    with tensor_ops.use("xla"):
        z = tensor_ops.silu(x)
    assert type(z) is np.ndarray and z.dtype == x.dtype


def test_the_shim_checks_arguments_as_the_native_ops():
    """jax arrays on the shim get the native ops' argument checks: causal,
    interleaved must be bools ('False' was read as True), scale a real number
    (not the string '2'), ignore_index an integer (1.5 was truncated); an
    ignore_index past int32 matches no row, as natively (it overflowed jax)."""
    from tensor_ops.errors import ArgumentTypeError

    jnp = jax.numpy
    q = jnp.ones((1, 2, 3, 4), jnp.float32)
    x = jnp.ones((2, 5), jnp.float32)
    with pytest.raises(ArgumentTypeError, match="causal"):
        tensor_ops.attention(q, q, q, causal="False")
    with pytest.raises(ArgumentTypeError, match="causal"):
        tensor_ops.attention(q, q, q, causal=1)
    with pytest.raises(ArgumentTypeError, match="scale"):
        tensor_ops.softmax(x, scale="2")
    with pytest.raises(ArgumentTypeError, match="ignore_index"):
        tensor_ops.cross_entropy(x, jnp.array([0, 1], jnp.int32), ignore_index=1.5)
    cos = jnp.ones((4, 2), jnp.float32)
    with pytest.raises(ArgumentTypeError, match="interleaved"):
        tensor_ops.rope(jnp.ones((1, 3, 2, 4), jnp.float32), cos, cos, interleaved="False")
    t = np.array([0, 1], np.int32)
    want = tensor_ops.cross_entropy(np.asarray(x), t, ignore_index=2 ** 40)
    assert float(tensor_ops.cross_entropy(x, jnp.asarray(t), ignore_index=2 ** 40)) == pytest.approx(float(want))


def test_nonfinite_rows_and_large_scores_as_the_native_kernels():
    """The shim's softmax rows that see a NaN, +inf or only -inf are NaN, as
    torch's and the CPU kernel's (they were 0, or log_softmax kept the NaN
    row's other values); attention at |scale q k| ~ 1e10 is finite (the fused
    product left NaN), and a NaN in k makes the rows that see it NaN, lse
    included (they were 0 with lse -inf); cross-entropy keeps log(sum) at
    logits of 1e8 (four equal logits gave 0 for log 4)."""
    inf, nan = np.inf, np.nan
    x = np.array([[nan, 1, 2, 3], [inf, 1, 2, 3], [-inf, -inf, -inf, -inf], [1, 2, 3, 4]], np.float32)
    for op in (tensor_ops.softmax, tensor_ops.log_softmax):
        native = op(x)
        with tensor_ops.use("xla"):
            shim = op(x)
        np.testing.assert_array_equal(np.isnan(shim), np.isnan(native))
        assert np.isnan(shim[:3]).all()
        np.testing.assert_allclose(shim[3], native[3], rtol=1e-6)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(3))
    with tensor_ops.use("xla"):
        out, lse = tensor_ops.attention(q * 1e5, k * 1e5, v, return_lse=True)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        k[0, 1, 2, 3] = nan
        out, lse = tensor_ops.attention(q, k, v, return_lse=True)
    assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, 1]).all() and np.isfinite(out[0, 0]).all()
    logits = np.full((1, 4), 1e8, np.float32)
    with tensor_ops.use("xla"):
        loss = tensor_ops.cross_entropy(logits, np.array([2]), reduction="none")
    np.testing.assert_allclose(loss, [math.log(4)], rtol=1e-6)


def test_layer_norm_far_from_zero_as_accurate_as_the_cpu_kernel():
    """The shim's layer_norm (and backward) normalise about the corrected
    mean (the CPU's Note [layer_norm's corrected mean]): the float mean was
    half an ulp of |mean| off, [1e8, 1e8 + 8, 1e8 + 16, 1e8 - 8] gave
    [0, 0.82, 1.63, -0.82], and offset 1e4 + N(0, 0.1) rows 5e-3 off."""
    x = np.array([[1e8, 1e8 + 8, 1e8 + 16, 1e8 - 8]], np.float32)
    one, zero = np.ones(4, np.float32), np.zeros(4, np.float32)
    want = np.array([[-1, 1, 3, -3]]) / math.sqrt(5.0)
    got = np.asarray(tensor_ops.layer_norm(jnp.asarray(x), jnp.asarray(one), jnp.asarray(zero), 0.0))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    rng = np.random.default_rng(0)
    for offset, sd in ((1e3, 0.01), (1e4, 0.1), (3e4, 1.0)):
        x = (offset + sd * rng.standard_normal((4, 257))).astype(np.float32)
        w = np.ones(257, np.float32)
        x64 = x.astype(np.float64)
        d = x64 - x64.mean(-1, keepdims=True)
        want = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)
        got = np.asarray(tensor_ops.layer_norm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(0 * w), 1e-5))
        assert np.abs(got - want).max() < 1e-5, (offset, np.abs(got - want).max())
        dy = rng.standard_normal(x.shape).astype(np.float32)
        dx, _, _ = tensor_ops.layer_norm_backward(jnp.asarray(dy), jnp.asarray(x), jnp.asarray(w), 1e-5)
        dx_cpu, _, _ = tensor_ops.layer_norm_backward(dy, x, w, 1e-5)
        assert np.abs(np.asarray(dx) - dx_cpu).max() < 1e-3 * np.abs(dx_cpu).max(), offset


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_linear_on_jax_arrays(layout, dtype, rng):
    """linear on jax arrays is the shim's (it had none: jax float32 came back
    as numpy through DLPack, bfloat16 raised 'Unsupported dtype in DLTensor',
    and under jit / grad a ConcretizationTypeError): a jax array of x's
    dtype, fp32 accumulation, in jit and under grad."""
    nd = np_dtype(dtype)
    x = rng.standard_normal((3, 5, 37)).astype(np.float32).astype(nd)
    w = rng.standard_normal((37, 11) if layout == "kn" else (11, 37)).astype(np.float32).astype(nd)
    b = rng.standard_normal(11).astype(np.float32).astype(nd)
    want = to64(x) @ (to64(w) if layout == "kn" else to64(w).T) + to64(b)
    xj, wj, bj = jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)
    for y in (tensor_ops.linear(xj, wj, bj, weight_layout=layout),
              jax.jit(lambda a, c, d: tensor_ops.linear(a, c, d, weight_layout=layout))(xj, wj, bj)):
        assert isinstance(y, jax.Array) and y.dtype == xj.dtype and y.shape == (3, 5, 11)
        assert_close(np.asarray(y), want, dtype, "linear")
    g = jax.grad(lambda a: tensor_ops.linear(a, wj, None, weight_layout=layout).astype(jnp.float32).sum())(xj)
    gw = to64(w).sum(1 if layout == "kn" else 0)
    assert_close(np.asarray(g), np.broadcast_to(gw, x.shape), dtype, "linear grad")
    with tensor_ops.use("xla"):  # host arrays on the shim: numpy back
        y = tensor_ops.linear(x, w, b, weight_layout=layout)
    assert isinstance(y, np.ndarray)
    assert_close(y, want, dtype, "linear (shim, numpy)")
    with pytest.raises(ValueError, match="weight must be"):
        tensor_ops.linear(xj, jnp.asarray(np.ones((4, 4), nd)))


@pytest.mark.parametrize("shape", [(8, 0), (0, 0), (2, 3, 0)])
def test_rows_of_width_zero(shape):
    """Rows of width 0 give empty results on the shim, as natively: softmax
    (a max with no identity) and layer_norm_backward (reshape(-1, 0)) raised."""
    x = jnp.zeros(shape, jnp.float32)
    w = jnp.ones(shape[-1], jnp.float32)
    for y in (tensor_ops.softmax(x), tensor_ops.log_softmax(x), tensor_ops.softmax(x, causal=True),
              tensor_ops.softmax(x, scale=-1.0), *tensor_ops.layer_norm_backward(x, x, w),
              jax.grad(lambda a: tensor_ops.softmax(a).sum())(x)):
        assert y is not None and y.size == 0
    dx, dw, db = tensor_ops.layer_norm_backward(x, x, w)
    assert dx.shape == shape and dw.shape == db.shape == (0,)


def test_scalar_arguments_traced_or_as_arrays():
    """eps / scale are constants of the ops: traced by jax (a jit argument, a
    differentiated temperature) they are refused in words (a raw
    ConcretizationTypeError, or "must be a real number" of a real number);
    concrete 0-d arrays (jnp.float32(0.5), np.array(0.5)) and numpy integer
    dims are taken, on the shim as natively."""
    x, w = jnp.ones((2, 8), jnp.float32), jnp.ones(8, jnp.float32)
    for f in (lambda e: tensor_ops.rms_norm(x, w, e), lambda s: tensor_ops.softmax(x, scale=s),
              lambda s: tensor_ops.attention(x[None, None], x[None, None], x[None, None], scale=s)):
        with pytest.raises(TypeError, match="is traced by jax .*static_argnums"):
            jax.jit(f)(0.5)
    with pytest.raises(TypeError, match="scale is traced by jax"):
        jax.grad(lambda s: tensor_ops.softmax(x, scale=s).sum())(0.5)
    xn = np.arange(12, dtype=np.float32).reshape(3, 4)
    want = np.asarray(tensor_ops.softmax(xn, 0, 0.5))
    for a in (xn, jnp.asarray(xn)):
        for dim, scale in ((np.int64(0), 0.5), (0, np.array(0.5)), (0, jnp.float32(0.5)), (0, np.float32(0.5))):
            np.testing.assert_allclose(np.asarray(tensor_ops.softmax(a, dim, scale)), want, rtol=1e-6)
    with pytest.raises(TypeError, match="real number"):
        tensor_ops.softmax(xn, 0, np.array([0.5]))  # not 0-d
    import ml_dtypes
    np.testing.assert_allclose(np.asarray(tensor_ops.softmax(a, 0, np.array(0.5, ml_dtypes.bfloat16))), want, rtol=1e-6)
    if torch is not None:  # the autograd route took the 0-d array for a tensor and refused it
        xg = torch.tensor(xn, requires_grad=True)
        y = tensor_ops.softmax(xg, 0, np.array(0.5))
        y.sum().backward()
        assert np.allclose(y.detach().numpy(), want, rtol=1e-6) and xg.grad is not None
