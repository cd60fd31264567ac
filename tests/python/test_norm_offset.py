"""rms_norm's weight offset (issue 24: Gemma's x / rms * (1 + weight) in the
kernel): y = x * rstd * (offset + w), offset + w formed in fp32. Forward and
backward on every target x dtype x odd sizes against float64; offset 0 is the
plain norm bit for bit; the torch op's autograd, torch.compile, the XLA shim,
and HF Gemma's RMSNorm (the C ABI's 2-scalar form: tests/c/test_c_api.c)."""
import numpy as np
import pytest

import tensor_ops as to
from conftest import DTYPES, assert_close, bits, np_dtype, to64, torch

HIDDEN = [1, 7, 64, 333, 4095]
OFFSETS = [1.0, -0.5]


def make(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def ref_rms_norm_offset(x, w, eps, offset):
    x = to64(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (offset + to64(w))


def ref_rms_norm_offset_backward(dy, x, w, eps, offset):
    """(dx, dweight) in float64: x_hat = x * rstd, g = dy * (offset + w),
    dx = rstd * (g - x_hat * mean(g * x_hat)), dweight = sum over rows of dy * x_hat."""
    dy, x = to64(dy).reshape(-1, x.shape[-1]), to64(x).reshape(-1, x.shape[-1])
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    xh = x * rstd
    g = dy * (offset + to64(w))
    dx = rstd * (g - xh * (g * xh).mean(-1, keepdims=True))
    return dx, (dy * xh).sum(0)


def grad_close(got, ref, dtype, what):
    # Gradients mix several rounded terms (as test_ops_llm's grad_close): four
    # times the forward tolerance, relative to the largest magnitude (at least 1).
    from conftest import ATOL, FLOOR, RTOL

    got64 = to64(got).reshape(ref.shape)
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1.0)
    tol = 4 * (RTOL[dtype] * np.abs(ref) + ATOL[dtype] * scale) + FLOOR[dtype]
    bad = ~(np.abs(got64 - ref) <= tol)
    assert not bad.any(), f"{what}: {bad.sum()} of {ref.size} off; max err {np.max(np.abs(got64 - ref)):.3g}"


# ---- the op on every target -------------------------------------------------

@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(offset, hidden, dtype, target, rng):
    target.require("rms_norm")
    x, w = make(rng, (2, 3, hidden), dtype, 3), make(rng, (hidden,), dtype, 0.1)
    assert_close(to.rms_norm(x, w, 1e-6, offset=offset), ref_rms_norm_offset(x, w, 1e-6, offset), dtype,
                 f"offset {offset}")


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("hidden", [1, 7, 333, 4095])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(offset, hidden, dtype, target, rng):
    target.require("rms_norm_backward")
    x, w, dy = make(rng, (5, hidden), dtype), make(rng, (hidden,), dtype, 0.1), make(rng, (5, hidden), dtype)
    dx, dw = to.rms_norm_backward(dy, x, w, 1e-6, offset=offset)
    ref_dx, ref_dw = ref_rms_norm_offset_backward(dy, x, w, 1e-6, offset)
    grad_close(dx, ref_dx, dtype, "dx")
    grad_close(dw, ref_dw, dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_zero_is_the_plain_norm_bit_for_bit(dtype, target, rng):
    target.require("rms_norm", "rms_norm_backward")
    x, w, dy = make(rng, (4, 333), dtype, 3), make(rng, (333,), dtype), make(rng, (4, 333), dtype)
    w[::7] = -0.0  # a -0.0 weight stays -0.0 (w + 0.0 would make it +0.0, and flip the output's zero)
    plain = to.rms_norm(x, w, 1e-6)
    assert np.array_equal(bits(to.rms_norm(x, w, 1e-6, offset=0.0), dtype), bits(plain, dtype))
    assert np.array_equal(bits(to.rms_norm(x, w, 1e-6, offset=-0.0), dtype), bits(plain, dtype))
    pdx, pdw = to.rms_norm_backward(dy, x, w, 1e-6)
    dx, dw = to.rms_norm_backward(dy, x, w, 1e-6, offset=0.0)
    assert np.array_equal(bits(dx, dtype), bits(pdx, dtype)) and np.array_equal(bits(dw, dtype), bits(pdw, dtype))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_offset_is_added_in_fp32(dtype, target, rng):
    """offset + w is formed in fp32 from the stored 16-bit w: closer to the
    float64 reference than the old way, 1 + w rounded to the 16-bit dtype
    first and passed as the weight (|w| ~ 0.02: 1 + w needs more bits)."""
    target.require("rms_norm")
    x, w = make(rng, (8, 256), dtype, 3), make(rng, (256,), dtype, 0.02)
    ref = ref_rms_norm_offset(x, w, 1e-6, 1.0)
    got = to.rms_norm(x, w, 1e-6, offset=1.0)
    old = to.rms_norm(x, (1.0 + to64(w)).astype(np.float32).astype(np_dtype(dtype)), 1e-6)
    assert_close(got, ref, dtype, "fp32 offset")
    assert np.abs(to64(got) - ref).mean() < np.abs(to64(old) - ref).mean()


def test_in_place_and_out(rng):
    x, w = make(rng, (4, 33), "float32", 2), make(rng, (33,), "float32", 0.1)
    ref = to.rms_norm(x, w, 1e-6, offset=1.0)
    out = np.empty_like(x)
    assert to.rms_norm(x, w, 1e-6, offset=1.0, out=out) is out and np.array_equal(out, ref)
    to.rms_norm(x, w, 1e-6, offset=1.0, out=x)
    assert np.array_equal(x, ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_offset_must_be_finite(bad, rng):
    x, w = make(rng, (2, 8), "float32"), make(rng, (8,), "float32")
    with pytest.raises(to.InvalidArgumentError, match="offset must be finite"):
        to.rms_norm(x, w, offset=bad)
    with pytest.raises(to.InvalidArgumentError, match="offset must be finite"):
        to.rms_norm_backward(x, x, w, offset=bad)


@pytest.mark.parametrize("bad", ["1", None, True, [1.0]])
def test_offset_must_be_a_real_number(bad, rng):
    x, w = make(rng, (2, 8), "float32"), make(rng, (8,), "float32")
    with pytest.raises(TypeError, match="offset"):
        to.rms_norm(x, w, offset=bad)


def test_offset_accepts_ints_and_numpy_scalars(rng):
    x, w = make(rng, (2, 8), "float32"), make(rng, (8,), "float32")
    ref = to.rms_norm(x, w, offset=1.0)
    assert np.array_equal(to.rms_norm(x, w, offset=1), ref)
    assert np.array_equal(to.rms_norm(x, w, offset=np.float32(1)), ref)


# ---- torch: the custom op, autograd, torch.compile ---------------------------

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


@needs_torch
@pytest.mark.parametrize("eager_functions", [True, False], ids=["function", "custom_op"])
@pytest.mark.parametrize("offset", OFFSETS)
def test_torch_autograd_float64_reference(offset, eager_functions, monkeypatch):
    """The gradient of x and of the weight through the torch op (the
    autograd.Function, and the custom op's registered autograd) against
    float64 autograd of x * rstd * (offset + w)."""
    from tensor_ops.torch import functional as tf

    monkeypatch.setattr(tf, "EAGER_FUNCTIONS", eager_functions)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 37, generator=g, requires_grad=True)
    w = (torch.randn(37, generator=g) * 0.1).requires_grad_()
    dy = torch.randn(3, 5, 37, generator=g)
    y = tf.rms_norm(x, w, 1e-6, offset)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w64)
    y64.backward(dy.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


@needs_torch
def test_torch_custom_op_opcheck():
    """torch.library.opcheck: schema, fake kernel, autograd registration."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 19, generator=g, requires_grad=True)
    w = torch.randn(19, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.tensor_ops.rms_norm.default, (x, w, 1e-6, 1.0))
    torch.library.opcheck(torch.ops.tensor_ops.rms_norm_backward.default, (x.detach(), x.detach(), w.detach(), 1e-6,
                                                                            -0.5))


@needs_torch
@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # float32 inputs: our kernels take no float64
def test_torch_gradcheck_float32_finite_differences():
    """gradcheck's finite differences in float32 (our kernels take no
    float64): loose tolerances, but it checks the offset enters dx."""
    from tensor_ops.torch import functional as tf

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, generator=g, requires_grad=True)
    w = (torch.randn(9, generator=g) * 0.1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: tf.rms_norm(a, b, 1e-6, 1.0), (x, w), eps=1e-2, atol=2e-2,
                                    rtol=2e-2)


class _GemmaLikeNorm(torch.nn.Module if torch is not None else object):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x):
        from tensor_ops.torch import functional as tf

        return tf.rms_norm(x, self.weight, 1e-6, 1.0)


@needs_torch
def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(3)
    m = _GemmaLikeNorm(48)
    x = torch.randn(2, 7, 48, requires_grad=True)
    eager = m(x)
    eager.sum().backward()
    gx, gw = x.grad.clone(), m.weight.grad.clone()
    x.grad, m.weight.grad = None, None
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, eager, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, gx, rtol=0, atol=0)
    torch.testing.assert_close(m.weight.grad, gw, rtol=0, atol=0)
    torch._dynamo.reset()


# ---- the XLA shim ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_xla_shim(dtype, rng):
    jnp = pytest.importorskip("jax.numpy")
    from tensor_ops import xla

    x, w, dy = make(rng, (3, 65), dtype, 3), make(rng, (65,), dtype, 0.1), make(rng, (3, 65), dtype)
    jx, jw, jdy = (jnp.asarray(a) for a in (x, w, dy))
    for offset in OFFSETS:
        assert_close(np.asarray(xla.rms_norm(jx, jw, 1e-6, offset=offset)), ref_rms_norm_offset(x, w, 1e-6, offset),
                     dtype, f"xla offset {offset}")
        dx, dw = xla.rms_norm_backward(jdy, jx, jw, 1e-6, offset=offset)
        ref_dx, ref_dw = ref_rms_norm_offset_backward(dy, x, w, 1e-6, offset)
        grad_close(np.asarray(dx), ref_dx, dtype, "xla dx")
        grad_close(np.asarray(dw), ref_dw, dtype, "xla dweight")
    # Through the top-level op (jax arrays are routed to the shim), offset 0 bit for bit.
    assert np.array_equal(bits(np.asarray(to.rms_norm(jx, jw, offset=0.0)), dtype),
                          bits(np.asarray(xla.rms_norm(jx, jw)), dtype))
    with pytest.raises(to.InvalidArgumentError, match="offset must be finite"):
        xla.rms_norm(jx, jw, offset=float("nan"))


# ---- HF Gemma's RMSNorm ------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_rms_norm_module(dtype):
    """prepare_model's Gemma RMSNorm against HF's own forward: float32 within
    1e-5 relative; bfloat16 within one bf16 rounding of HF's, and (nearly)
    always HF's bits, which the old per-call (1 + weight) rounded to bf16 was
    not."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from tensor_ops.torch import functional as tf, hf

    dt = getattr(torch, dtype)
    torch.manual_seed(4)
    m = GemmaRMSNorm(256, eps=1e-6).to(dt)
    with torch.no_grad():
        m.weight.copy_(torch.randn(256) * 0.05)
    x = (torch.randn(4, 9, 256) * 3).to(dt)
    with torch.no_grad():
        ref = m(x)
        counts = __import__("collections").Counter()
        assert hf._swap_norm(m, "norm", [], counts) and type(m).__name__ == "TensorOpsGemmaRMSNorm"
        got = m(x)
        old = tf.rms_norm(x, (m.weight.float() + 1.0).to(dt), 1e-6)  # the previous forward
    err = (got.double() - ref.double()).abs()
    old_err = (old.double() - ref.double()).abs()
    if dtype == "float32":
        assert (err.max() / ref.double().abs().max()).item() < 1e-5
    else:
        ulp = ref.double().abs() * 2 ** -7 + 1e-30
        assert bool((err <= ulp).all()), err.max()
        assert err.sum() < old_err.sum(), (err.sum(), old_err.sum())
        # Measured: all 9216 elements equal to HF's bf16 bits (the old way: 76%).
        same, old_same = (got == ref).float().mean().item(), (old == ref).float().mean().item()
        assert same > 0.99 and old_same < 0.9, (same, old_same)
