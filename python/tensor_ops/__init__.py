"""tensor_ops: ML kernels on every accelerator behind one API.

Ops take numpy arrays, torch tensors or any DLPack producer (zero-copy) and
return the caller's kind of array. Host arrays run on the selected backend
(see backends(), set_backend(), use()).
"""
from __future__ import annotations

from . import _C
from ._arrays import Arg, call, empty_like
from .backends import (
    BackendStatus,
    DeviceInfo,
    backends,
    devices,
    get_backend,
    get_backend_info,
    set_backend,
    use,
)
from .ops import *  # noqa: F401,F403  (the op set beyond the first three)
from .ops import __all__ as _ops_all
from .memory import (
    Tensor,
    allocate_with_oom_protection,
    empty,
    empty_cache,
    from_numpy,
    memory_stats,
    reset_peak_memory_stats,
    set_memory_fraction,
    zeros,
)
from .errors import (
    BackendUnavailableError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    OutOfMemoryError,
    TensorOpsError,
    UnsupportedError,
)

__version__ = "0.1.0"


def _unary(fn, x, out, *extra):
    a = Arg(x, "x")
    if out is None:
        out = empty_like(a)
    return call(fn, [a], out, *extra)


def rms_norm(x, weight, eps: float = 1e-6, *, out=None):
    """x / sqrt(mean(x**2, last dim) + eps) * weight, accumulated in fp32."""
    a, w = Arg(x, "x"), Arg(weight, "weight")
    if isinstance(eps, (str, bytes)) or not hasattr(eps, "__float__"):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if out is None:
        out = empty_like(a)
    return call(_C.rms_norm, [a, w], out, float(eps))


def silu(x, *, out=None):
    """x * sigmoid(x)."""
    return _unary(_C.silu, x, out)


def gelu(x, approximate: str = "none", *, out=None):
    """GELU: approximate="none" uses erf, "tanh" the tanh approximation."""
    if not isinstance(approximate, str):
        raise TypeError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _unary(_C.gelu, x, out, approximate)


__all__ = _ops_all + [
    "Tensor",
    "empty",
    "zeros",
    "from_numpy",
    "allocate_with_oom_protection",
    "memory_stats",
    "empty_cache",
    "set_memory_fraction",
    "reset_peak_memory_stats",
    "rms_norm",
    "silu",
    "gelu",
    "devices",
    "backends",
    "get_backend",
    "get_backend_info",
    "set_backend",
    "use",
    "DeviceInfo",
    "BackendStatus",
    "TensorOpsError",
    "InvalidArgumentError",
    "DTypeError",
    "UnsupportedError",
    "BackendUnavailableError",
    "OutOfMemoryError",
    "DeviceError",
]
