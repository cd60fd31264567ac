"""Device memory: pool statistics, cache control, OOM-protected allocation,
and tensor_ops.Tensor (data resident on any device, owned by a pool block)."""
from __future__ import annotations

import contextlib
from typing import Dict, Sequence

import numpy as np

from . import _C
from . import _checks
from ._arrays import check_numpy_dtype, consumer_stream

Tensor = _C.Tensor


def _device(device) -> str:
    if device is None:
        from .config import default_device  # an applied TensorOpsConfig's OpenCL device choice

        device = default_device()
    return "" if device is None else str(device)


def dtype_name(dtype) -> str:
    """float32 / float16 / bfloat16 from a string, numpy or torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype).replace("torch.", "")
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    return {"half": "float16", "float": "float32", "bf16": "bfloat16", "f32": "float32", "f16": "float16"}.get(
        name, name
    )


def memory_stats(device=None) -> Dict[str, int]:
    """The pool's statistics for a device (default: the active backend's),
    with torch's keys: allocated_bytes.all.current/peak, reserved_bytes.all.*,
    num_ooms, num_alloc_retries, cache_hits, ..."""
    return dict(_C.memory_stats(_device(device)))


def empty_cache(device=None) -> None:
    """Returns cached, unused blocks of the device's pool to the device."""
    _C.empty_cache(_device(device))


def set_memory_fraction(fraction: float, device=None) -> None:
    """Caps what the device's pool may reserve at fraction * total memory."""
    _C.set_memory_fraction(_checks.real("fraction", fraction), _device(device))  # no float("0.5")


def reset_peak_memory_stats(device=None) -> None:
    _C.reset_peak_memory_stats(_device(device))


def empty(shape: Sequence[int], dtype="float32", device=None) -> Tensor:
    """An uninitialised Tensor from the device's pool."""
    return _C.empty(list(_checks.shape("shape", shape)), dtype_name(dtype), _device(device))


def zeros(shape: Sequence[int], dtype="float32", device=None) -> Tensor:
    t = empty(shape, dtype, device)
    _C.zero_(t)
    return t


def allocate_with_oom_protection(shape: Sequence[int], dtype="float32", safety_margin: float = 1.2,
                                 device=None) -> Tensor:
    """empty() that first checks shape x itemsize x safety_margin against the
    device's free memory plus the pool cache; on failure frees the cache and
    retries once, then raises OutOfMemoryError with the numbers."""
    margin = _checks.real("safety_margin", safety_margin, nonneg=True)
    return _C.empty(list(_checks.shape("shape", shape)), dtype_name(dtype), _device(device), margin)


def from_numpy(array, device=None) -> Tensor:
    """A Tensor on `device` holding a copy of a host array (numpy, or any
    host DLPack producer)."""
    a = np.ascontiguousarray(array)
    check_numpy_dtype(a.dtype, "array")
    if a.dtype.name == "bfloat16":
        return _C.from_host(a.view(np.uint16), _device(device), True)
    return _C.from_host(a, _device(device))


def _tensor_numpy(self) -> np.ndarray:
    """A numpy array: a zero-copy view on the host, a copy from a device."""
    bits = self._host_bits()
    if self.dtype == "float16":
        return bits.view(np.float16)
    if self.dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise TypeError("a bfloat16 Tensor to numpy needs the ml_dtypes package") from e
        return bits.view(ml_dtypes.bfloat16)
    return bits


Tensor.numpy = _tensor_numpy


def _tensor_array(self, dtype=None, copy=None) -> np.ndarray:
    """np.asarray(t) / np.array(t): the data as numpy, as t.numpy() gives it
    (np.asarray made a 0-d object array holding the Tensor, silently)."""
    if copy is False and self.device != "cpu":
        raise ValueError(f"a Tensor on {self.device} cannot become a numpy array without a copy (copy=False)")
    a = self.numpy()
    if dtype is not None and np.dtype(dtype) != a.dtype:
        if copy is False:
            raise ValueError(f"a {self.dtype} Tensor cannot become {np.dtype(dtype)} without a copy (copy=False)")
        return a.astype(dtype)
    return a.copy() if copy and self.device == "cpu" else a


Tensor.__array__ = _tensor_array


@contextlib.contextmanager
def use_stream(stream: int, device):
    """Within the block, this thread's ops on `device` ("cuda:0", "hip:0")
    run on `stream` (a cudaStream_t / hipStream_t as an int; 0 the default)
    and its Tensors are exported for consumers as produced on it. torch
    tensors always use torch's current stream."""
    dev = str(device)
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
        raise TypeError(f"use_stream: stream must be a stream handle (an int >= 0), got {stream!r}")
    previous = _C._exchange_stream(dev, stream)
    try:
        yield
    finally:
        _C._exchange_stream(dev, previous)


_export_dlpack = Tensor.__dlpack__


def _tensor_dlpack(self, *, stream=None, max_version=None, dl_device=None, copy=None):
    """DLPack export with the spec's stream semantics: the consumer's stream
    (None: the default, 1 / 2 CUDA's legacy / per-thread default stream, 0
    ROCm's default, a handle otherwise) waits, on the device, for the work
    queued on ours; -1 skips that. Host / OpenCL / SYCL data takes None or -1."""
    dl_type, _ = self.__dlpack_device__()
    consumer = consumer_stream(dl_type, stream)
    if consumer is not None:
        device = self.device
        producer = _C._current_stream(device)
        if consumer != producer and _C._has_streams(device):
            _C._stream_wait(device, consumer, producer)
    return _export_dlpack(self, max_version=max_version, dl_device=dl_device, copy=copy)


Tensor.__dlpack__ = _tensor_dlpack
