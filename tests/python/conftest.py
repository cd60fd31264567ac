"""Shared pieces of the Python tests: float64 references, dtypes, seeds."""
import math
import os
import zlib

import numpy as np
import pytest

# The CPU conformance tests must exercise the CPU kernels even where a GPU
# backend would win the automatic choice; device tests select theirs with
# tensor_ops.use(...).
os.environ.setdefault("TENSOR_OPS_BACKEND", "cpu")

try:
    import ml_dtypes
except ImportError:  # bfloat16 numpy arrays need ml_dtypes
    ml_dtypes = None

try:
    import torch
except ImportError:
    torch = None

import tensor_ops

DTYPES = ["float32", "float16", "bfloat16"]

# Elementwise tolerance: |got - ref| <= RTOL * |ref| + ATOL * max|ref|.
# fp32: the 1e-5 relative; fp16/bf16: one rounding of the output
# (2^-11, 2^-8 relative) plus fp32 math, with headroom for denormals.
RTOL = {"float32": 1e-5, "float16": 2 ** -10, "bfloat16": 2 ** -7}
ATOL = {"float32": 1e-6, "float16": 1e-4, "bfloat16": 1e-3}
# Below the format's smallest subnormal a value rounds to zero: that is exact.
FLOOR = {"float32": 1e-44, "float16": 2.0 ** -24, "bfloat16": 1e-38}


def np_dtype(name):
    if name == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("numpy bfloat16 needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def to64(a):
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().to(torch.float64).cpu().numpy()
    return np.asarray(a).astype(np.float64)


def ref_rms_norm(x, w, eps=1e-6):
    x, w = to64(x), to64(w)
    if x.size == 0:
        return x.copy()
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def ref_silu(x):
    x = to64(x)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def ref_gelu(x, approximate="none"):
    x = to64(x)
    if approximate == "tanh":
        u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
        with np.errstate(over="ignore"):
            return x / (1.0 + np.exp(-2.0 * u))
    return 0.5 * x * _erfc(-x / math.sqrt(2.0))


def assert_close(got, ref, dtype, what="", scale=None):
    """|got - ref| <= RTOL |ref| + ATOL scale + FLOOR elementwise; scale: the
    magnitude of the terms the result sums (default max |ref|; a result that
    cancels, such as attention's weighted mean of v, needs the terms', max |v|)."""
    got64 = to64(got)
    assert got64.shape == ref.shape, f"{what}: shape {got64.shape} != {ref.shape}"
    if ref.size == 0:
        return
    if scale is None:
        scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0))
    tol = RTOL[dtype] * np.abs(ref) + ATOL[dtype] * max(scale, 1e-30) + FLOOR[dtype]
    err = np.abs(got64 - ref)
    bad = ~(err <= tol) & ~(np.isnan(got64) & np.isnan(ref))
    if bad.any():
        i = np.flatnonzero(bad.ravel())[0]
        raise AssertionError(
            f"{what}: {bad.sum()} of {ref.size} elements off; first at flat index {i}: "
            f"got {got64.ravel()[i]!r}, ref {ref.ravel()[i]!r}, max rel err "
            f"{float(np.max(err / (np.abs(ref) + 1e-30))):.3g}"
        )


def assert_within(got64, ref, tol, what=""):
    """Every |got64 - ref| <= tol (float64 arrays); else the count and the
    first element off, with its bound."""
    bad = ~(np.abs(got64 - ref) <= tol)
    if bad.any():
        i = np.flatnonzero(bad.ravel())[0]
        raise AssertionError(f"{what}: {bad.sum()} of {ref.size} elements off; first at flat index {i}: got "
                             f"{got64.ravel()[i]!r}, ref {ref.ravel()[i]!r}, allowed {tol.ravel()[i]:.3g}")


BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def bits(y, dtype):
    """y's stored bits (numpy / tensor_ops arrays of dtype), for bitwise comparisons."""
    return np.ascontiguousarray(np.asarray(y)).view(BITS[dtype])


@pytest.fixture
def restore_threads():
    """The CPU pool's thread count as it was before the test."""
    n = tensor_ops._C.cpu_num_threads()
    yield
    tensor_ops._C.cpu_set_num_threads(n)


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("TENSOR_OPS_TEST_SEED", "0")) + zlib.crc32(request.node.nodeid.encode()) % 65536
    print(f"seed={seed}")  # shown when the test fails
    return np.random.default_rng(seed)


@pytest.fixture(params=tensor_ops._C.cpu_supported_isas())
def cpu_isa(request):
    tensor_ops._C.cpu_set_isa(request.param)
    yield request.param
    tensor_ops._C.cpu_set_isa("auto")


class Target:
    """Where an op runs: the CPU backend at one ISA level, or a device backend."""

    def __init__(self, name, backend, ops):
        self.name, self.backend, self.ops = name, backend, ops

    def require(self, *ops):
        """Skips (with the reason shown) when the backend has no kernel for an op."""
        missing = [op for op in ops if op not in self.ops]
        if missing:
            pytest.skip(f"backend {self.backend!r} has no kernel for {', '.join(missing)}")

    def __repr__(self):
        return self.name


def _targets():
    usable = {b.name: b for b in tensor_ops.backends() if b.usable}
    out = [("cpu-" + isa, "cpu", isa) for isa in tensor_ops._C.cpu_supported_isas()]
    return out + [(name, name, None) for name in usable if name != "cpu"]


@pytest.fixture(params=_targets(), ids=lambda t: t[0])
def target(request):
    """Every CPU ISA level this machine runs, then every other usable backend
    (selected with tensor_ops.use: numpy inputs are staged to its device)."""
    name, backend, isa = request.param
    ops = {b.name: b for b in tensor_ops.backends()}[backend].ops
    if isa is not None:
        tensor_ops._C.cpu_set_isa(isa)
        try:
            yield Target(name, backend, ops)
        finally:
            tensor_ops._C.cpu_set_isa("auto")
    else:
        with tensor_ops.use(backend):
            yield Target(name, backend, ops)
