"""bfloat16 widening and narrowing inside the CPU ops, bit for bit, at every
ISA level this CPU runs (issue 22). The C++ test (tests/cpp/test_bf16_rounding.cpp)
checks the conversions alone on every fp32 pattern class; these check that
the ops' own loads and stores (registers, partial registers, the fp32 row
buffers of rope and the backward ops) round the same way.

Reference narrowing: ml_dtypes' float32 -> bfloat16 cast (round to nearest,
ties to even) for numbers; a NaN stays NaN with its sign and top payload
bits and the quiet bit set."""
import numpy as np
import pytest

import tensor_ops
from tensor_ops import _C

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
LEVELS = ["baseline", "avx2", "avx512", "avx512_bf16", "amx"]


@pytest.fixture(params=LEVELS)
def isa(request):
    if request.param not in _C.cpu_supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    _C.cpu_set_isa(request.param)
    yield request.param
    _C.cpu_set_isa("auto")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def from_bits(u: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(u, dtype=np.uint16).view(BF16)


def reference_narrow(f32: np.ndarray) -> np.ndarray:
    f32 = np.ascontiguousarray(f32, dtype=np.float32)
    u = f32.view(np.uint32)
    nan = np.isnan(f32)
    with np.errstate(over="ignore", invalid="ignore"):
        numbers = bits(np.where(nan, 0, f32).astype(BF16))
    return np.where(nan, (u >> 16).astype(np.uint16) | np.uint16(0x40), numbers)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str, inputs: np.ndarray):
    got, want = bits(got).ravel() if got.dtype == BF16 else got.ravel(), want.ravel()
    bad = np.flatnonzero(got != want)
    if bad.size:
        shown = ", ".join(f"0x{inputs.ravel()[i]:08x} -> 0x{got[i]:04x} (want 0x{want[i]:04x})" for i in bad[:6])
        pytest.fail(f"{what}: {bad.size} of {got.size} elements differ: {shown}")


def test_reference_narrow_agrees_with_the_definition():
    # ties to even, overflow to inf, NaN quieted with its payload
    u = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x7F800001, 0xFFC12345],
                 dtype=np.uint32)
    assert reference_narrow(u.view(np.float32)).tolist() == [0x3F80, 0x3F82, 0x7F80, 0x7F7F, 0x0000, 0x0002,
                                                            0x7FC0, 0xFFC1]


def test_every_bf16_value_passes_through_an_op_exactly(isa):
    # residual_out = bf16(x + (-0.0)) is x for every x (-0 + -0 = -0), a NaN
    # quieted: all 65536 patterns widened and narrowed in the op's lanes. An
    # odd row length puts patterns in every lane position of the partial
    # register at each row's end.
    pad = 5
    u = np.concatenate([np.arange(65536, dtype=np.uint32), np.zeros(pad, np.uint32)]).astype(np.uint16)
    x = from_bits(u).reshape(3, -1)
    r = np.full_like(x, -0.0)
    w = np.ones(x.shape[1], BF16)
    with np.errstate(all="ignore"):
        _, res = tensor_ops.add_rms_norm(x, r, w)
    is_nan = ((u & 0x7F80) == 0x7F80) & ((u & 0x7F) != 0)
    want = np.where(is_nan, u | 0x40, u).astype(np.uint16)
    assert_bits_equal(res, want, f"{isa}: add_rms_norm residual of every bf16 value", u.astype(np.uint32))


def sums(n: int, rng) -> tuple:
    """bf16 pairs whose fp32 sums need rounding: random patterns plus a
    smaller addend (ties, just off ties, overflow, NaN, inf)."""
    a = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    af = from_bits(a).astype(np.float32)
    scale = np.ldexp(np.float32(1), -rng.integers(1, 25, n)).astype(np.float32)
    with np.errstate(all="ignore"):
        b = (af * scale * rng.uniform(-1, 1, n).astype(np.float32)).astype(BF16)
        # a quarter exactly half a bf16 ulp of a (a tie), same sign or not
        tie = np.ldexp(np.float32(1), (np.frexp(af)[1] - 9)).astype(np.float32) * rng.choice([-1, 1], n)
        b = np.where(np.arange(n) % 4 == 1, tie.astype(BF16), b)
    edges_a = np.array([0x7F7F, 0x7F7F, 0xFF7F, 0x3F80, 0x3F81, 0x0080, 0x7F81, 0x7F80, 0x7F80, 0x0001],
                       dtype=np.uint16)
    edges_b = np.array([0x7B00, 0x7AFF, 0xFB00, 0x3B80, 0x3B80, 0x8001, 0x3F80, 0x3F80, 0xFF80, 0x0001],
                       dtype=np.uint16)
    a = np.concatenate([a, edges_a])
    b = np.concatenate([bits(b), edges_b])
    # not both NaN: which payload a NaN + NaN keeps is the CPU's choice
    one_nan = ~np.isnan(from_bits(a).astype(np.float32)) | ~np.isnan(from_bits(b).astype(np.float32))
    return from_bits(a[one_nan]), from_bits(b[one_nan])


def test_op_narrowing_rounds_to_nearest_even(isa):
    rng = np.random.default_rng(22)
    a, b = sums(1 << 18, rng)
    n = a.size - a.size % 7
    x, r = a[:n].reshape(7, -1), b[:n].reshape(7, -1)
    w = np.ones(x.shape[1], BF16)
    with np.errstate(all="ignore"):
        _, res = tensor_ops.add_rms_norm(x, r, w)
        exact = x.astype(np.float32) + r.astype(np.float32)  # the fp32 sum the kernel rounds
    want = reference_narrow(exact)
    got = bits(res)
    nan = np.isnan(exact)
    # inf + -inf makes a NaN of the CPU's choosing: NaN is all that is asked there
    both_inf = np.isinf(x.astype(np.float32)) & np.isinf(r.astype(np.float32))
    assert np.isnan(res.astype(np.float32)[nan]).all()
    keep = ~both_inf
    assert_bits_equal(got[keep], want[keep], f"{isa}: add_rms_norm residual of x + r (seed 22)",
                      exact.view(np.uint32)[keep])


@pytest.mark.parametrize("head_dim", [6, 22, 64])
def test_rope_buffers_round_like_the_lanes(isa, head_dim):
    # rope converts through fp32 row buffers; with sin = 0 each output is
    # x * cos (exact in fp32: 8-bit mantissas) narrowed once.
    rng = np.random.default_rng(head_dim)
    half, heads = head_dim // 2, 3
    seq = 65536 // (heads * head_dim) + 1
    u = rng.integers(0, 1 << 16, (1, seq, heads, head_dim), dtype=np.uint32).astype(np.uint16)
    u.flat[:40] = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F] * 5  # zeros, subnormals, extremes
    x = from_bits(u)
    xf = x.astype(np.float32)
    x = np.where(np.isfinite(xf), x, np.zeros_like(x))  # inf * 0 from the other half would be NaN
    cos = rng.uniform(0.5, 1.0, (seq, half)).astype(BF16)
    sin = np.zeros((seq, half), BF16)
    got = tensor_ops.rope(x, cos, sin)
    x1, x2 = x[..., :half].astype(np.float32), x[..., half:].astype(np.float32)
    c = cos.astype(np.float32)[None, :, None, :]
    s = np.float32(0)
    want = reference_narrow(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))
    assert_bits_equal(got, want, f"{isa}: rope head_dim {head_dim}", x.astype(np.float32).view(np.uint32))
