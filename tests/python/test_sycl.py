"""The SYCL backend (libtensor_ops_sycl.so) on whatever SYCL device the
runtime finds (in CI: the Intel OpenCL CPU device): rms_norm, silu and gelu
x dtype x odd sizes and edges against float64 references, host arrays staged
through the device pool and Tensors resident on the device, device facts,
and a clear error for ops it does not implement. Skipped, with the
backend's reason, where the sycl backend cannot run."""
import numpy as np
import pytest

import tensor_ops
from conftest import DTYPES, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu

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
    assert _status.priority == (80 if any(d.device_type == "gpu" for d in ds) else 35)


def test_every_op_has_a_kernel():
    ops = ["rms_norm", "silu", "gelu", "layer_norm", "rms_norm_backward", "layer_norm_backward", "add_rms_norm",
           "softmax", "softmax_backward", "activation_backward", "glu", "glu_backward", "rope", "attention",
           "attention_backward", "cross_entropy"]
    assert sorted(_status.ops) == sorted(ops)
