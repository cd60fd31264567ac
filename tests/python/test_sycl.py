"""The SYCL backend (libtensor_ops_sycl.so) on whatever SYCL device the
runtime finds (in CI: the Intel OpenCL CPU device): rms_norm, silu and gelu
x dtype x odd sizes and edges against float64 references, host arrays staged
through the device pool and Tensors resident on the device, device facts.
The LLM op set's conformance runs in test_ops_llm.py (the sycl target); here
is what is particular to this backend's kernels (data-dependent index errors
through a device flag, attention key blocks and work-group sizes, the norm
backward's per-column pass and the scratch memory that threads share,
in-place and resident chains), against the CPU backend. Skipped, with the
backend's reason, where the sycl backend cannot run."""
import math
import threading

import numpy as np
import pytest

import tensor_ops
from conftest import ATOL, DTYPES, FLOOR, RTOL, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu, to64
from test_ops_llm import ref_attention, rope_tables

_status = {b.name: b for b in tensor_ops.backends()}.get("sycl")
pytestmark = pytest.mark.skipif(
    _status is None or not _status.usable,
    reason=f"sycl backend not usable: {_status.reason if _status else 'unknown to this build'}")

HIDDEN = [1, 7, 64, 4095, 8193]


@pytest.fixture
def sycl():
    with tensor_ops.use("sycl"):
        yield


def make(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(hidden, dtype, sycl, rng):
    x, w = make(rng, (5, hidden), dtype, 3), make(rng, (hidden,), dtype)
    y = tensor_ops.rms_norm(x, w, 1e-6)
    assert type(y) is np.ndarray and y.dtype == x.dtype
    assert_close(y, ref_rms_norm(x, w, 1e-6), dtype, "rms_norm")


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations(hidden, dtype, sycl, rng):
    x = make(rng, (3, hidden), dtype, 4)
    assert_close(tensor_ops.silu(x), ref_silu(x), dtype, "silu")
    assert_close(tensor_ops.gelu(x), ref_gelu(x), dtype, "gelu")
    assert_close(tensor_ops.gelu(x, "tanh"), ref_gelu(x, "tanh"), dtype, "gelu tanh")


def test_tails_and_specials(sycl):
    x = np.array([-100.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 100.0], np.float32)
    assert_close(tensor_ops.silu(x), ref_silu(x), "float32", "silu")
    assert_close(tensor_ops.gelu(x), ref_gelu(x), "float32", "gelu")
    assert_close(tensor_ops.gelu(x, "tanh"), ref_gelu(x, "tanh"), "float32", "gelu tanh")
    for v in [-3.0, -5.0, -6.5, -9.0]:  # one element each: the tolerance is relative to the tiny result
        one = np.array([v], np.float32)
        assert_close(tensor_ops.gelu(one, "tanh"), ref_gelu(one, "tanh"), "float32", f"gelu tanh {v}")
        assert_close(tensor_ops.silu(one * 8), ref_silu(one * 8), "float32", f"silu {v * 8}")
    special = tensor_ops.silu(np.array([np.nan, np.inf], np.float32))
    assert np.isnan(special[0]) and special[1] == np.inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_edges(dtype, sycl, rng):
    base = make(rng, (4, 40), dtype)
    x = base[:, 3:36]  # rows with a stride: the core stages them
    w = make(rng, (33,), dtype)
    assert_close(tensor_ops.rms_norm(x, w), ref_rms_norm(x, w), dtype, "strided rms_norm")
    assert_close(tensor_ops.silu(x), ref_silu(x), dtype, "strided silu")
    assert tensor_ops.silu(np.ones((0, 8), np_dtype(dtype))).shape == (0, 8)
    one = np.full((1, 1), 2.0, np_dtype(dtype))
    assert_close(tensor_ops.rms_norm(one, np.ones(1, np_dtype(dtype))), ref_rms_norm(one, np.ones(1)), dtype, "1x1")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_resident_tensors_chain(dtype, rng):
    x, w = make(rng, (6, 515), dtype), make(rng, (515,), dtype)
    tx = tensor_ops.from_numpy(x, device="sycl:0")
    tw = tensor_ops.from_numpy(w, device="sycl:0")
    ty = tensor_ops.silu(tensor_ops.rms_norm(tx, tw))  # no host round trip between the ops
    assert isinstance(ty, tensor_ops.Tensor) and ty.device.startswith("sycl")
    # fp32 chain reference: the intermediate is rounded to dtype on the device.
    mid = ref_rms_norm(x, w).astype(np.float32).astype(np_dtype(dtype))
    assert_close(ty.numpy(), ref_silu(mid), dtype, "chain")
    assert tensor_ops.memory_stats("sycl:0")["reserved_bytes.all.current"] > 0


def test_devices_report_sycl_facts():
    ds = [d for d in tensor_ops.devices() if d.backend == "sycl"]
    assert ds
    for d in ds:
        assert d.device_name and d.vendor and d.total_memory_bytes > 0
        assert d.device_type in ("cpu", "gpu", "accelerator")
        assert d.properties["backend"] in ("opencl", "level_zero", "cuda", "hip", "native_cpu", "other")
        assert d.properties["fp16"] in ("0", "1") and d.properties["fp64"] in ("0", "1")
        assert d.properties["platform"] and int(d.properties["compute_units"]) > 0
        assert int(d.properties["max_work_group_size"]) >= 1
        assert all(int(n) > 0 for n in d.properties["sub_group_sizes"].split(","))
        assert "JIT" in d.properties["kernels"]
    assert _status.priority == (80 if any(d.device_type == "gpu" for d in ds) else 35)


def test_every_op_has_a_kernel():
    ops = ["rms_norm", "silu", "gelu", "layer_norm", "rms_norm_backward", "layer_norm_backward", "add_rms_norm",
           "softmax", "softmax_backward", "activation_backward", "glu", "glu_backward", "rope", "attention",
           "attention_backward", "cross_entropy"]
    assert sorted(_status.ops) == sorted(ops)


# ---- the LLM op set: what is particular to the SYCL kernels -----------------


def on_cpu(fn, *args):
    with tensor_ops.use("cpu"):
        return fn(*[a.numpy() if isinstance(a, tensor_ops.Tensor) else a for a in args])


def close(got, ref, dtype, what, factor=1):
    """got (a resident Tensor or an array) within factor x the forward
    tolerance of ref (the CPU backend's result, or a float64 reference)."""
    got64 = to64(got.numpy() if isinstance(got, tensor_ops.Tensor) else got)
    ref = to64(ref.numpy() if isinstance(ref, tensor_ops.Tensor) else ref)
    assert got64.shape == ref.shape, what
    scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0))
    tol = factor * (RTOL[dtype] * np.abs(ref) + ATOL[dtype] * max(scale, 1e-30)) + FLOOR[dtype]
    with np.errstate(invalid="ignore"):  # inf - inf
        bad = ~(np.abs(got64 - ref) <= tol) & ~(got64 == ref)  # equal infinities are fine
    assert not bad.any(), f"{what}: {bad.sum()} of {ref.size} off; max err {np.max(np.abs(got64 - ref)):.3g}"


def dev(a):
    return tensor_ops.from_numpy(np.ascontiguousarray(a), device="sycl:0")


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_indices_in_the_data(dtype, sycl, rng):
    """A position or target out of range is found by the kernel (a device
    flag) and raised as InvalidArgumentError; the device stays usable."""
    x = make(rng, (2, 3, 2, 8), dtype)
    cos, sin = rope_tables(4, 8, dtype)
    for idx in (np.int64, np.int32):
        for bad in (4, -1, 2 ** 31 - 1):
            pos = np.array([[0, 1, 2], [3, bad, 0]], idx)
            with pytest.raises(tensor_ops.InvalidArgumentError, match=r"position is outside the cos/sin tables \[0, 4\)"):
                tensor_ops.rope(x, cos, sin, pos)
            with pytest.raises(tensor_ops.InvalidArgumentError, match="position"):
                tensor_ops.rope(dev(x), dev(cos), dev(sin), dev(pos))
    good = np.array([[0, 1, 2], [3, 3, 0]], np.int32)
    assert_close(tensor_ops.rope(x, cos, sin, good), to64(on_cpu(tensor_ops.rope, x, cos, sin, good)), dtype, "after")
    logits = make(rng, (3, 7), dtype)
    for idx in (np.int64, np.int32):
        for bad in (7, -5):
            tg = np.array([0, bad, -100], idx)
            with pytest.raises(tensor_ops.InvalidArgumentError,
                               match=r"target is outside \[0, 7\) and is not the ignore_index -100"):
                tensor_ops.cross_entropy(logits, tg)
            with pytest.raises(tensor_ops.InvalidArgumentError, match="target"):
                tensor_ops.cross_entropy_with_grad(dev(logits), dev(tg))
        # The same index is fine when it is the ignore_index.
        tg = np.array([0, -5, 3], idx)
        loss, grad = tensor_ops.cross_entropy_with_grad(logits, tg, ignore_index=-5, reduction="none")
        ref_loss, ref_grad = on_cpu(lambda a, b: tensor_ops.cross_entropy_with_grad(a, b, -5, "none"), logits, tg)
        assert loss[1] == 0 and not np.any(to64(grad[1]))
        close(loss, ref_loss, "float32", "loss")
        close(grad, ref_grad, dtype, "grad")


ATTN_SYCL = [  # B, Hq, Hkv, Lq, Lk, D: several key blocks, head dims past 4 x 64 work-items, Lq > Lk
    (1, 2, 1, 3, 200, 100),
    (1, 1, 1, 70, 70, 256),
    (2, 2, 2, 5, 3, 300),
    (1, 4, 2, 40, 17, 24),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ATTN_SYCL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_blocks_and_wide_heads(shape, causal, dtype, sycl, rng):
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v, do = (make(rng, (B, h, n, D), dtype) for h, n in [(Hq, Lq), (Hkv, Lk), (Hkv, Lk), (Hq, Lq)])
    out, lse = tensor_ops.attention(q, k, v, causal, return_lse=True)
    close(out, ref_attention(q, k, v, causal, 1 / math.sqrt(D)), dtype, "out")
    ref_out, ref_lse = on_cpu(lambda *a: tensor_ops.attention(*a, causal, return_lse=True), q, k, v)
    close(lse, ref_lse, "float32", "lse", 4)
    if causal and Lq > Lk:  # the first Lq - Lk queries see no key
        assert np.all(lse[:, :, :Lq - Lk] == -np.inf) and not np.any(to64(out[:, :, :Lq - Lk]))
    grads = tensor_ops.attention_backward(do, q, k, v, out, lse, causal)
    ref = on_cpu(lambda *a: tensor_ops.attention_backward(*a, causal), do, q, k, v, out, lse)
    for name, g, r in zip(["dq", "dk", "dv"], grads, ref):
        close(g, r, dtype, name, 4 if dtype == "float32" else 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 300])
def test_norm_backward_columns(rows, dtype, sycl, rng):
    """dweight / dbias sum over every row (a per-column pass after the rows);
    no rows: zeros."""
    cols = 1000
    x, dy, w = make(rng, (rows, cols), dtype, 2), make(rng, (rows, cols), dtype), make(rng, (cols,), dtype)
    got = tensor_ops.rms_norm_backward(dy, x, w) + tensor_ops.layer_norm_backward(dy, x, w)
    ref = on_cpu(tensor_ops.rms_norm_backward, dy, x, w) + on_cpu(tensor_ops.layer_norm_backward, dy, x, w)
    for name, g, r in zip(["rms dx", "rms dw", "ln dx", "ln dw", "ln db"], got, ref):
        if rows == 0 and name[-2:] in ("dw", "db"):
            assert not np.any(to64(g)), name
        close(g, r, dtype, name, 4)
    dx, dw, db = tensor_ops.layer_norm_backward(dy, x, w, bias=False)
    assert db is None
    close(dx, ref[2], dtype, "ln dx without bias", 4)
    close(dw, ref[3], dtype, "ln dw without bias", 4)


def test_threads_share_scratch(sycl, rng):
    """The norm and attention backwards keep temporaries in one per-device
    scratch block (grown on demand): host threads calling them at once must
    each get their own results, bit for bit (the kernels are deterministic)."""
    cases = []
    for rows in (3, 500, 40):
        x, dy, w = make(rng, (rows, 257), "float32"), make(rng, (rows, 257), "float32"), make(rng, (257,), "float32")
        cases.append((tensor_ops.layer_norm_backward, (dy, x, w)))
    for lq in (5, 300):
        q, k, v, do = (make(rng, (1, 2, lq, 16), "float32") for _ in range(4))
        out, lse = tensor_ops.attention(q, k, v, return_lse=True)
        cases.append((tensor_ops.attention_backward, (do, q, k, v, out, lse)))
    expected = [[a.copy() for a in fn(*args)] for fn, args in cases]
    errors = []

    def worker(i):
        try:
            with tensor_ops.use("sycl"):
                for _ in range(4):
                    fn, args = cases[i]
                    for g, e in zip(fn(*args), expected[i]):
                        np.testing.assert_array_equal(g, e)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("dtype", DTYPES)
def test_resident_llm_chain(dtype, rng):
    """A decoder block's ops on Tensors resident on the device, no host round
    trip between them; each result against the CPU backend on the same inputs."""
    B, S, H, Hkv, D, F = 2, 9, 4, 2, 16, 96
    hid = H * D
    x, r, w = dev(make(rng, (B, S, hid), dtype)), dev(make(rng, (B, S, hid), dtype)), dev(make(rng, (hid,), dtype))
    y, res = tensor_ops.add_rms_norm(x, r, w)
    for g, c, n in zip((y, res), on_cpu(tensor_ops.add_rms_norm, x, r, w), ("normed", "residual")):
        close(g, c, dtype, n)
    assert isinstance(y, tensor_ops.Tensor) and y.device.startswith("sycl")
    q = dev(make(rng, (B, S, H, D), dtype))
    cos, sin = (dev(t) for t in rope_tables(S, D, dtype))
    pos = dev(np.arange(S, dtype=np.int32)[None, :].repeat(B, 0))
    qr = tensor_ops.rope(q, cos, sin, pos, True)
    close(qr, on_cpu(lambda *a: tensor_ops.rope(*a, True), q, cos, sin, pos), dtype, "rope")
    qh = dev(np.swapaxes(qr.numpy(), 1, 2))  # [B, H, S, D]
    k, v = dev(make(rng, (B, Hkv, S, D), dtype)), dev(make(rng, (B, Hkv, S, D), dtype))
    o, lse = tensor_ops.attention(qh, k, v, True, return_lse=True)
    close(o, on_cpu(lambda *a: tensor_ops.attention(*a, True), qh, k, v), dtype, "attention")
    grads = tensor_ops.attention_backward(o, qh, k, v, o, lse, True)
    for g, c, n in zip(grads, on_cpu(lambda *a: tensor_ops.attention_backward(*a, True), o, qh, k, v, o, lse),
                       ("dq", "dk", "dv")):
        close(g, c, dtype, n, 4 if dtype == "float32" else 8)
    gate, up = dev(make(rng, (B * S, F), dtype, 2)), dev(make(rng, (B * S, F), dtype))
    h = tensor_ops.swiglu(gate, up)
    close(h, on_cpu(tensor_ops.swiglu, gate, up), dtype, "swiglu")
    dg, du = tensor_ops.swiglu_backward(h, gate, up)
    for g, c, n in zip((dg, du), on_cpu(tensor_ops.swiglu_backward, h, gate, up), ("dgate", "dup")):
        close(g, c, dtype, n, 4)
    p = tensor_ops.log_softmax(h, scale=0.5)
    close(p, on_cpu(lambda a: tensor_ops.log_softmax(a, scale=0.5), h), dtype, "log_softmax")
    dp = tensor_ops.log_softmax_backward(h, p, scale=0.5)
    close(dp, on_cpu(lambda a, b: tensor_ops.log_softmax_backward(a, b, scale=0.5), h, p), dtype, "dlog_softmax", 4)
    tg = dev(rng.integers(0, F, size=B * S).astype(np.int64))
    loss, dl = tensor_ops.cross_entropy_with_grad(h, tg, reduction="none")
    cl, cd = on_cpu(lambda a, b: tensor_ops.cross_entropy_with_grad(a, b, reduction="none"), h, tg)
    close(loss, cl, "float32", "loss")
    close(dl, cd, dtype, "dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place(dtype, rng):
    """out = x on the device: layer_norm and swiglu overwrite their input."""
    x, w, b = make(rng, (5, 333), dtype, 2), make(rng, (333,), dtype), make(rng, (333,), dtype)
    u = make(rng, (5, 333), dtype)
    tx = dev(x)
    tensor_ops.layer_norm(tx, dev(w), dev(b), out=tx)
    close(tx, on_cpu(tensor_ops.layer_norm, x, w, b), dtype, "layer_norm in place")
    tg = dev(x)
    tensor_ops.swiglu(tg, dev(u), out=tg)
    close(tg, on_cpu(tensor_ops.swiglu, x, u), dtype, "swiglu in place")


def test_attention_empty_sides(sycl, rng):
    """No queries: dk, dv are zeros; no keys: out zeros, lse -inf, dq zeros."""
    q0, k, v = np.ones((1, 2, 0, 8), np.float32), make(rng, (1, 1, 5, 8), "float32"), make(rng, (1, 1, 5, 8), "float32")
    dq, dk, dv = tensor_ops.attention_backward(q0, q0, k, v, q0, np.ones((1, 2, 0), np.float32))
    assert dq.shape == q0.shape and not np.any(dk) and not np.any(dv)
    q, k0 = make(rng, (1, 2, 3, 8), "float32"), np.ones((1, 1, 0, 8), np.float32)
    out, lse = tensor_ops.attention(q, k0, k0, return_lse=True)
    assert not np.any(out) and np.all(lse == -np.inf)
    dq, dk, dv = tensor_ops.attention_backward(q, q, k0, k0, out, lse)
    assert not np.any(dq) and dk.shape == dv.shape == k0.shape
