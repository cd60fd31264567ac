"""Arrays in and out: caller's type back, zero-copy, strided input, out=."""
import numpy as np
import pytest

import tensor_ops
from conftest import assert_close, ml_dtypes, ref_gelu, ref_rms_norm, ref_silu, torch

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def test_numpy_in_numpy_out(rng):
    x = rng.standard_normal((4, 32)).astype(np.float32)
    y = tensor_ops.silu(x)
    assert type(y) is np.ndarray and y.dtype == np.float32


def test_zero_copy_numpy(rng):
    x = rng.standard_normal((4, 32)).astype(np.float32)
    assert tensor_ops._C.data_ptr(x) == x.ctypes.data
    out = np.empty_like(x)
    y = tensor_ops.silu(x, out=out)
    assert y is out


@needs_torch
def test_torch_in_torch_out_zero_copy(rng):
    x = torch.from_numpy(rng.standard_normal((4, 32)).astype(np.float32))
    assert tensor_ops._C.data_ptr(x) == x.data_ptr()
    y = tensor_ops.gelu(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    out = torch.empty_like(x)
    assert tensor_ops.silu(x, out=out) is out
    assert tensor_ops._C.data_ptr(out) == out.data_ptr()


@needs_torch
def test_torch_requires_grad_input(rng):
    x = torch.randn(3, 16, requires_grad=True)
    y = tensor_ops.silu(x)
    assert_close(y, ref_silu(x), "float32")


@needs_torch
def test_torch_bfloat16_zero_copy():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert tensor_ops._C.data_ptr(x) == x.data_ptr()
    assert tensor_ops.silu(x).dtype == torch.bfloat16


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
def test_numpy_bfloat16(rng):
    x = rng.standard_normal((3, 40)).astype(ml_dtypes.bfloat16)
    y = tensor_ops.silu(x)
    assert y.dtype == x.dtype
    assert tensor_ops._C.data_ptr(x.view(np.uint16)) == x.ctypes.data
    assert_close(y, ref_silu(x.astype(np.float32)), "bfloat16")


class Producer:
    """A minimal DLPack producer that is neither numpy nor torch."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_generic_dlpack_producer(rng):
    x = rng.standard_normal((2, 17)).astype(np.float32)
    p = Producer(x)
    assert tensor_ops._C.data_ptr(p) == x.ctypes.data
    y = tensor_ops.silu(p)
    assert_close(y, ref_silu(x), "float32")


def test_in_place(rng):
    x = rng.standard_normal((3, 50)).astype(np.float32)
    ref = ref_silu(x)
    y = tensor_ops.silu(x, out=x)
    assert y is x
    assert_close(x, ref, "float32")
    x = rng.standard_normal((3, 50)).astype(np.float32)
    w = rng.standard_normal(50).astype(np.float32)
    ref = ref_rms_norm(x, w)
    tensor_ops.rms_norm(x, w, out=x)
    assert_close(x, ref, "float32")


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[:, ::2],  # strided last dim
        lambda a: a.T,  # transposed
        lambda a: a[::2],  # row stride 2x
        lambda a: a[:, 1:],  # rows with padding
        lambda a: a[::-1],  # negative row stride
    ],
)
def test_non_contiguous_numpy(view, rng):
    base = rng.standard_normal((6, 40)).astype(np.float32)
    x = view(base)
    w = rng.standard_normal(x.shape[-1]).astype(np.float32)
    assert_close(tensor_ops.silu(x), ref_silu(x), "float32")
    assert_close(tensor_ops.gelu(x), ref_gelu(x), "float32")
    assert_close(tensor_ops.rms_norm(x, w), ref_rms_norm(x, w), "float32")


@needs_torch
def test_non_contiguous_torch(rng):
    base = torch.randn(8, 6, 10)
    for x in [base.transpose(0, 2), base[:, ::2, 1:], base.permute(1, 0, 2)]:
        w = torch.randn(x.shape[-1])
        assert_close(tensor_ops.rms_norm(x, w), ref_rms_norm(x, w), "float32")
        assert_close(tensor_ops.gelu(x, "tanh"), ref_gelu(x, "tanh"), "float32")
    w = torch.randn(20)[::2]  # strided weight
    x = torch.randn(3, 10)
    assert_close(tensor_ops.rms_norm(x, w), ref_rms_norm(x, w), "float32")


def test_readonly_input_ok(rng):
    x = rng.standard_normal((2, 9)).astype(np.float32)
    x.flags.writeable = False
    assert_close(tensor_ops.silu(x), ref_silu(x), "float32")


def test_misaligned_contiguous_numpy_inputs_are_copied():
    """A contiguous numpy array whose start is not element-aligned (np.frombuffer
    at an odd offset: a file with a header) is copied once, like a strided one;
    it was refused with a LayoutError (the contiguous retry handed it back as
    it was)."""
    raw = b"HDR" + np.arange(12, dtype=np.float32).tobytes()
    x = np.frombuffer(raw, np.float32, offset=3).reshape(3, 4)
    assert x.flags.c_contiguous and not x.flags.aligned
    ref = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(tensor_ops.silu(x), tensor_ops.silu(ref))
    np.testing.assert_array_equal(tensor_ops.rms_norm(x, np.ones(4, np.float32), 1e-6),
                                  tensor_ops.rms_norm(ref, np.ones(4, np.float32), 1e-6))
    np.testing.assert_array_equal(tensor_ops.softmax(x), tensor_ops.softmax(ref))
    t = np.frombuffer(b"X" + np.array([0, 3, 1], np.int64).tobytes(), np.int64, offset=1)
    assert tensor_ops.cross_entropy(ref, t) == tensor_ops.cross_entropy(ref, np.array([0, 3, 1]))
