"""Every bad input is a clear exception (or a correct result), never a crash."""
import numpy as np
import pytest

import tensor_ops
from conftest import torch

f32 = np.float32


def x_w(rows=2, cols=8, dtype=f32):
    return np.ones((rows, cols), dtype), np.ones(cols, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8, np.complex64, np.bool_, np.uint8])
def test_wrong_dtype(dtype):
    x = np.ones((2, 8), dtype)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        tensor_ops.silu(x)
    with pytest.raises(TypeError):
        tensor_ops.rms_norm(x, np.ones(8, dtype))


def test_mixed_dtypes():
    x, w = x_w()
    with pytest.raises(TypeError, match=r"float16.*float32|float32.*float16"):
        tensor_ops.rms_norm(x, w.astype(np.float16))
    with pytest.raises(TypeError):
        tensor_ops.silu(x, out=np.empty((2, 8), np.float16))


def test_weight_shape_mismatch():
    x, _ = x_w()
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        tensor_ops.rms_norm(x, np.ones(7, f32))
    with pytest.raises(ValueError):
        tensor_ops.rms_norm(x, np.ones((1, 8), f32))
    with pytest.raises(ValueError):
        tensor_ops.rms_norm(x, np.ones((), f32))


def test_zero_dim_rms_norm():
    with pytest.raises(ValueError, match="0-d"):
        tensor_ops.rms_norm(np.array(1.0, f32), np.ones(1, f32))


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), -float("inf")])
def test_bad_eps(eps):
    x, w = x_w()
    with pytest.raises(ValueError, match="eps"):
        tensor_ops.rms_norm(x, w, eps=eps)


def test_eps_not_a_number():
    x, w = x_w()
    with pytest.raises(TypeError):
        tensor_ops.rms_norm(x, w, eps="small")


@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, None, "x", object()])
def test_not_an_array(value):
    with pytest.raises(TypeError, match="must be an array"):
        tensor_ops.silu(value)
    with pytest.raises(TypeError):
        tensor_ops.rms_norm(value, np.ones(2, f32))


def test_out_mismatch():
    x, w = x_w()
    with pytest.raises(ValueError, match="shape"):
        tensor_ops.silu(x, out=np.empty((2, 9), f32))
    with pytest.raises(ValueError, match="shape"):
        tensor_ops.rms_norm(x, w, out=np.empty((8, 2), f32))
    ro = np.empty((2, 8), f32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        tensor_ops.silu(x, out=ro)


def test_out_overlap():
    buf = np.ones(20, f32)
    with pytest.raises(ValueError, match="overlap"):
        tensor_ops.silu(buf[:16], out=buf[4:20])
    x, w = x_w()
    with pytest.raises(ValueError, match="overlap"):
        tensor_ops.rms_norm(x, w, out=np.lib.stride_tricks.as_strided(w, shape=x.shape, strides=(0, 4)))


def test_out_non_collapsible():
    x = np.ones((4, 8), f32)
    out = np.empty((8, 4), f32).T
    with pytest.raises(ValueError, match="rows"):
        tensor_ops.silu(x, out=out)


def test_gelu_bad_approximate():
    x, _ = x_w()
    with pytest.raises(ValueError, match="approximate"):
        tensor_ops.gelu(x, approximate="fast")
    with pytest.raises(TypeError):
        tensor_ops.gelu(x, approximate=1)


def test_too_many_dims():
    x = np.ones((1,) * 9 + (4,), f32)
    with pytest.raises(ValueError, match="dimensions"):
        tensor_ops.silu(x)


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_torch_errors():
    with pytest.raises(TypeError):
        tensor_ops.silu(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        tensor_ops.rms_norm(torch.ones(2, 4), torch.ones(5))
    with pytest.raises(TypeError):
        tensor_ops.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.bfloat16))


def test_errors_leave_library_usable():
    x, w = x_w()
    for bad in [lambda: tensor_ops.rms_norm(x, w, eps=-1), lambda: tensor_ops.silu(np.ones(3, np.float64))]:
        with pytest.raises((TypeError, ValueError)):
            bad()
    np.testing.assert_allclose(tensor_ops.rms_norm(x, w), np.ones((2, 8)), rtol=1e-5)


def test_error_classes():
    assert issubclass(tensor_ops.DTypeError, TypeError)
    assert issubclass(tensor_ops.InvalidArgumentError, ValueError)
    assert issubclass(tensor_ops.UnsupportedError, NotImplementedError)
    assert issubclass(tensor_ops.BackendUnavailableError, RuntimeError)
    assert issubclass(tensor_ops.OutOfMemoryError, tensor_ops.TensorOpsError)
