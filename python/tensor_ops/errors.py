"""The tensor_ops exception classes (the C++ core raises these through _C)."""


class TensorOpsError(Exception):
    """Base of every tensor_ops error."""


class InvalidArgumentError(TensorOpsError, ValueError):
    """A bad shape, rank, value or device."""


class DTypeError(TensorOpsError, TypeError):
    """A dtype tensor_ops does not take, or dtypes that do not match."""


class ArgumentTypeError(TensorOpsError, TypeError):
    """An argument of the wrong Python type (a str for a number, a float for
    an integer, a list for an array)."""


class LayoutError(InvalidArgumentError):
    """A strided layout the kernels cannot take as is (the op layer retries
    with a contiguous copy for inputs)."""


class UnsupportedError(TensorOpsError, NotImplementedError):
    """An op, dtype or feature a backend does not implement."""


class ExternalBackendSelected(UnsupportedError):
    """Raised by the core for host arrays while the selection names a backend
    served in Python (the XLA shim); the op wrappers catch it and run the op
    there. Seen by users only if host arrays and device tensors are mixed."""


class BackendUnavailableError(TensorOpsError, RuntimeError):
    """A backend that is not compiled in or whose runtime is missing."""


class MemoryAllocationError(TensorOpsError, RuntimeError):
    """An allocation failed or cannot be served (a bad request to a tensor
    pool, a tensor returned to a pool it did not come from)."""


class OutOfMemoryError(MemoryAllocationError):
    """A device ran out of memory."""


class DeviceError(TensorOpsError, RuntimeError):
    """A vendor runtime call failed."""


# The seed guides' names for the same failures: a kernel that fails to launch
# is a failed vendor call, and CUDA missing is one case of a backend missing.
KernelLaunchError = DeviceError
CUDANotAvailableError = BackendUnavailableError


__all__ = [
    "TensorOpsError",
    "InvalidArgumentError",
    "DTypeError",
    "ArgumentTypeError",
    "LayoutError",
    "UnsupportedError",
    "BackendUnavailableError",
    "MemoryAllocationError",
    "OutOfMemoryError",
    "DeviceError",
    "KernelLaunchError",
    "CUDANotAvailableError",
]
