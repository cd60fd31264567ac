"""tensor_ops: ML kernels on every accelerator behind one API.

Ops take numpy arrays, torch tensors or any DLPack producer (zero-copy) and
return the caller's kind of array. Host arrays run on the selected backend
(see backends(), set_backend(), use()).
"""
from __future__ import annotations

from . import _C, _checks
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
# The seed guides' API: named tensor pools, hardware detection, configuration.
from .errors import ArgumentTypeError, CUDANotAvailableError, KernelLaunchError, MemoryAllocationError
from .pools import allocate_tensor, clear_pool, get_memory_stats, pool_stats, return_to_pool, set_pool_limits
from .hardware import HardwareDetector, HardwareProfile, HardwareType, backend_info, detect_hardware
from .config import TensorOpsConfig, configure, get_config
from .linear_cross_entropy import fused_linear_cross_entropy
from ._sdk import cmake_dir, get_include
from ._types import Approximate, Array

__version__ = "0.1.0"


from ._optable import invoke as _invoke


def rms_norm(x: Array, weight: Array, eps: float = 1e-6, *, offset: float = 0.0, out: Array | None = None) -> Array:
    """x / sqrt(mean(x**2, last dim) + eps) * (offset + weight), accumulated in
    fp32; offset + weight is formed in fp32 inside the kernel (Gemma's
    (1 + weight): offset=1.0)."""
    return _invoke("rms_norm", (x, weight), (eps if type(eps) is float else _checks.real("eps", eps, nonneg=True),
                                             offset if type(offset) is float else _checks.real("offset", offset)),
                   out)


def silu(x: Array, *, out: Array | None = None) -> Array:
    """x * sigmoid(x)."""
    return _invoke("silu", (x,), (), out)


def gelu(x: Array, approximate: Approximate = "none", *, out: Array | None = None) -> Array:
    """GELU: approximate="none" uses erf, "tanh" the tanh approximation."""
    return _invoke("gelu", (x,), (_checks.choice("approximate", approximate, ("none", "tanh")),), out)


# Every op routes XLA arrays (jax, torch_xla) to the XLA shim, and host arrays
# too while the shim is selected (use("xla"), set_backend, TENSOR_OPS_BACKEND).
from . import _xla_route as _route

for _name in _route.ROUTED:
    globals()[_name] = _route.routed(_name, globals()[_name])
del _name
_route.note_torch()

__all__ = [
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
    "ArgumentTypeError",
    "UnsupportedError",
    "BackendUnavailableError",
    "OutOfMemoryError",
    "DeviceError",
    "MemoryAllocationError",
    "KernelLaunchError",
    "CUDANotAvailableError",
    "allocate_tensor",
    "return_to_pool",
    "clear_pool",
    "set_pool_limits",
    "pool_stats",
    "get_memory_stats",
    "HardwareDetector",
    "HardwareProfile",
    "HardwareType",
    "backend_info",
    "detect_hardware",
    "TensorOpsConfig",
    "configure",
    "get_config",
    "fused_linear_cross_entropy",
    "cmake_dir",
    "get_include",
]
# Extended, not concatenated: mypy reads `__all__ +=` (--strict exports only
# what __all__ names).
__all__ += _ops_all

# Malformed TENSOR_OPS_* variables (TENSOR_OPS_NUM_THREADS=4abc, ...) are
# not fatal: the core uses a default and says so here, once, at import.
def _log_environment_warnings() -> None:
    import logging

    for warning in _C.environment_warnings():
        logging.getLogger("tensor_ops").warning("%s", warning)


_log_environment_warnings()
