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


# ---- issue 17: lenient arguments, unclear errors, lazy torch views, uint16 as bf16 ----

def _x():
    return np.random.default_rng(0).standard_normal((4, 8)).astype(f32)


@pytest.mark.parametrize("call, match", [
    (lambda x: tensor_ops.softmax(x, scale="2"), "scale must be a real number, got str"),
    (lambda x: tensor_ops.log_softmax(x, scale=None), "scale must be a real number"),
    (lambda x: tensor_ops.softmax(x, causal="False"), "causal must be a bool, got str"),
    (lambda x: tensor_ops.softmax(x, causal=1.0), "causal must be a bool"),
    (lambda x: tensor_ops.softmax(x, dim=1.0), "dim must be an integer, got float"),
    (lambda x: tensor_ops.softmax_backward(x, x, scale="1"), "scale must be a real number"),
    (lambda x: tensor_ops.cross_entropy(x, np.zeros(4, np.int64), ignore_index=1.5),
     "ignore_index must be an integer, got float"),
    (lambda x: tensor_ops.cross_entropy(x, np.zeros(4, np.int64), reduction=None), "reduction must be one of"),
    (lambda x: tensor_ops.rms_norm(x, np.ones(8, f32), eps=True), "eps must be a real number, got bool"),
    (lambda x: tensor_ops.gelu(x, approximate=None), "approximate must be one of"),
    (lambda x: tensor_ops.attention(x[None, None], x[None, None], x[None, None], causal="yes"),
     "causal must be a bool"),
    (lambda x: tensor_ops.attention(x[None, None], x[None, None], x[None, None], scale="0.5"),
     "scale must be a real number"),
    (lambda x: tensor_ops.rope(x[None, :, None, :], np.ones((4, 4), f32), np.ones((4, 4), f32), interleaved="no"),
     "interleaved must be a bool"),
    (lambda x: tensor_ops.empty((2.5, 4)), r"shape\[0\] must be an integer, got float"),
    (lambda x: tensor_ops.zeros("4"), "must be an integer, got str"),
    (lambda x: tensor_ops.empty((-1, 4)), r"shape\[0\] must be >= 0"),
    (lambda x: tensor_ops.set_backend(""), "must not be empty"),
    (lambda x: tensor_ops.set_backend(3), "must be a str"),
])
def test_strict_arguments(call, match):
    """Values of the wrong type are refused, not converted (float('2'),
    int(1.5), bool('False'))."""
    with pytest.raises((TypeError, ValueError), match=match):
        call(_x())


def test_strict_argument_classes():
    x = _x()
    with pytest.raises(TypeError):
        tensor_ops.softmax(x, scale="2")
    with pytest.raises(TypeError):
        tensor_ops.cross_entropy(x, np.zeros(4, np.int64), ignore_index=1.5)
    with pytest.raises(ValueError):
        tensor_ops.set_backend("")
    with pytest.raises(ValueError):
        with tensor_ops.use(" "):
            pass


def test_numpy_integer_scalars_are_integers():
    x = _x()
    np.testing.assert_allclose(tensor_ops.softmax(x, np.int64(0)), tensor_ops.softmax(x, 0))
    np.testing.assert_allclose(tensor_ops.softmax(x, dim=np.int32(-1), scale=np.float32(2.0)),
                               tensor_ops.softmax(x, scale=2.0), rtol=1e-6)
    assert tensor_ops.empty((np.int64(2), 3)).shape == (2, 3)


@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, None])
def test_softmax_not_an_array(value):
    with pytest.raises(TypeError, match="must be an array"):
        tensor_ops.softmax(value)
    with pytest.raises(TypeError, match="must be an array"):
        tensor_ops.log_softmax(value, dim=0)


def test_attention_head_dim_zero():
    q = np.zeros((1, 1, 2, 0), f32)
    with pytest.raises(ValueError, match=r"head_dim >= 1, got shape \(1, 1, 2, 0\)"):
        tensor_ops.attention(q, q, q)
    with pytest.raises(ValueError, match="head_dim >= 1"):
        tensor_ops.attention_backward(q, q, q, q, q, np.zeros((1, 1, 2), f32))


@pytest.mark.parametrize("dtype, match", [
    (object, "dtype object"),
    ("U3", "dtype <U3"),
    ("S2", "dtype |S2"),
    ("f4,f4", "structured dtype"),
    (">f4", "byte-swapped dtype >f4"),
    (">f2", "byte-swapped dtype >f2"),
    (np.uint16, "uint16 array is not read as bfloat16"),
])
def test_unreadable_numpy_dtypes_are_named(dtype, match):
    x = np.zeros((2, 4), dtype)
    for fn in (tensor_ops.silu, tensor_ops.softmax, lambda a: tensor_ops.rms_norm(a, np.ones(4, f32))):
        with pytest.raises(TypeError, match=match):
            fn(x)
    with pytest.raises(TypeError, match=match):
        tensor_ops.from_numpy(x)


def test_uint16_is_not_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = ml_dtypes.bfloat16
    with pytest.raises(TypeError, match="uint16"):
        tensor_ops.rms_norm(np.zeros((2, 8), np.uint16), np.ones(8, bf))
    with pytest.raises(TypeError, match="uint16"):
        tensor_ops.silu(np.ones((2, 8), bf), out=np.zeros((2, 8), np.uint16))
    with pytest.raises(TypeError, match="uint16"):
        tensor_ops.swiglu(np.ones((2, 8), bf), np.ones((2, 8), bf), out=np.zeros((2, 8), np.uint16))
    with pytest.raises(TypeError, match="uint16"):
        tensor_ops.add_rms_norm(np.ones((2, 8), bf), np.zeros((2, 8), np.uint16), np.ones(8, bf))


needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@needs_torch
def test_out_requiring_grad_is_refused():
    out = torch.zeros(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        tensor_ops.silu(torch.randn(4, 8), out=out)
    with pytest.raises(ValueError, match="requires grad"):
        tensor_ops.swiglu(torch.randn(4, 8), torch.randn(4, 8), out=out)
    assert (out == 0).all()


@needs_torch
def test_out_inference_tensor_outside_inference_mode_is_refused():
    """torch refuses an in-place update of an inference tensor outside
    inference mode; out= wrote it. Inside inference mode it is written."""
    x = torch.randn(4, 8)
    with torch.inference_mode():
        out = torch.zeros(4, 8)
    for call in (lambda: tensor_ops.silu(x, out=out), lambda: tensor_ops.swiglu(x, x, out=out),
                 lambda: tensor_ops.rms_norm(x, torch.ones(8), 1e-6, out=out)):
        with pytest.raises(ValueError, match="inference tensor"):
            call()
    assert (out == 0).all()
    with torch.inference_mode():
        tensor_ops.silu(x, out=out)
    assert torch.allclose(out, torch.nn.functional.silu(x))


@needs_torch
@pytest.mark.parametrize("make", [
    lambda t: torch._neg_view(t),
    lambda t: torch.complex(torch.zeros_like(t), t).conj().imag,
], ids=["neg_view", "conj_imag"])
def test_lazy_negation_is_resolved(make):
    """The negative bit is applied, not ignored: every entry point (fast
    path, general path, every argument) gives -x's answer."""
    t = torch.randn(4, 8)
    v = make(t)
    assert v.is_neg()
    neg = -t
    w = torch.rand(8) + 0.5
    torch.testing.assert_close(tensor_ops.silu(v), torch.nn.functional.silu(neg))
    torch.testing.assert_close(tensor_ops.gelu(v), torch.nn.functional.gelu(neg))
    torch.testing.assert_close(tensor_ops.rms_norm(v, w), torch.nn.functional.rms_norm(neg, (8,), w, 1e-6))
    torch.testing.assert_close(tensor_ops.rms_norm(t, make(w)), torch.nn.functional.rms_norm(t, (8,), -w, 1e-6))
    torch.testing.assert_close(tensor_ops.softmax(v), torch.softmax(neg, -1))
    torch.testing.assert_close(tensor_ops.swiglu(v, t), torch.nn.functional.silu(neg) * t)
    torch.testing.assert_close(tensor_ops.swiglu(t, v), torch.nn.functional.silu(t) * neg)
    torch.testing.assert_close(tensor_ops.layer_norm(v, w),
                               torch.nn.functional.layer_norm(neg, (8,), w, None, 1e-5))
    y, r = tensor_ops.add_rms_norm(v, t, w)
    torch.testing.assert_close(r, torch.zeros_like(t))
    torch.testing.assert_close(tensor_ops.silu(v.clone().requires_grad_(False)), torch.nn.functional.silu(neg))


@needs_torch
def test_lazy_negation_out_is_refused():
    t = torch.randn(4, 8)
    out = torch._neg_view(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="negative or conjugate bit"):
        tensor_ops.silu(t, out=out)


@needs_torch
def test_sparse_and_nested_tensors_are_refused():
    with pytest.raises(NotImplementedError, match="sparse_coo"):
        tensor_ops.silu(torch.randn(4, 4).to_sparse())
    with pytest.raises(NotImplementedError, match="sparse_coo"):
        tensor_ops.rms_norm(torch.randn(4, 4).to_sparse(), torch.ones(4))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(NotImplementedError, match="nested"):
        tensor_ops.silu(nested)
    with pytest.raises(NotImplementedError, match="nested"):
        tensor_ops.softmax(nested)


@needs_torch
def test_torch_layer_does_not_offer_the_xla_shim_without_torch_xla():
    """validate_model on a CPU machine with jax: every backend it tries runs."""
    import importlib.util

    import tensor_ops.torch as tt

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed: the shim is driven through it")
    assert not {"xla", "tpu"} & set(tt.list_available_backends())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU())
    v = tt.validate_model(model, torch.randn(2, 8))
    assert v.results and all(r["passed"] for r in v.results.values()), v.results


def test_meta_and_fake_tensors_are_named():
    """A meta tensor was "not an array tensor_ops can read" (a DTypeError) and
    a FakeTensor "has a null data pointer": both now say what they are."""
    if torch is None:
        pytest.skip("torch not installed")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(tensor_ops.UnsupportedError, match=r"meta device: shape \(8, 64\)"):
        tensor_ops.silu(torch.empty(8, 64, device="meta"))
    with FakeTensorMode():
        x = torch.randn(8, 64)
        with pytest.raises(tensor_ops.UnsupportedError, match="FakeTensor"):
            tensor_ops.rms_norm(x, torch.ones(64))
    tensor_ops.silu(torch.ones(2, 3))  # still fine


def test_tensor_ops_tensor_under_the_xla_shim_is_named():
    """A host tensor_ops.Tensor with the shim selected was refused as "mixing
    host arrays with device tensors (NoneType, Tensor)"."""
    if not any(b.name == "xla" and b.usable for b in tensor_ops.backends()):
        pytest.skip("the XLA shim is not usable here")
    t = tensor_ops.from_numpy(np.ones((4, 16), np.float32))
    with tensor_ops.use("xla"), pytest.raises(tensor_ops.UnsupportedError, match=r"not tensor_ops.Tensor \(float32\[4, 16\]"):
        tensor_ops.silu(t)


def test_ignore_index_beyond_int64_is_refused_in_words():
    """ignore_index >= 2**63 gave the binding's raw 'incompatible function
    arguments' TypeError with its signature dump."""
    logits, target = np.zeros((2, 3), np.float32), np.array([0, 1])
    for big in (2 ** 63, -2 ** 63 - 1, 2 ** 70):
        with pytest.raises(ValueError, match="ignore_index must fit in int64"):
            tensor_ops.cross_entropy(logits, target, big)
        with pytest.raises(ValueError, match="ignore_index must fit in int64"):
            tensor_ops.fused_linear_cross_entropy(np.ones((2, 4), np.float32), np.ones((3, 4), np.float32), target,
                                                  ignore_index=big)
    assert np.isfinite(tensor_ops.cross_entropy(logits, target, 2 ** 63 - 1))
