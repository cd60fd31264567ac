"""The factory API: backend objects for torch users, built on the registry's
own view (tensor_ops.backends(), devices(), use(), memory_stats()); nothing
here detects hardware a second way."""
from __future__ import annotations

import contextlib
import enum
import importlib.util
from typing import Any, Dict, List, Optional, Union

import torch

import tensor_ops
from tensor_ops.torch.optim import fuse_optimizer
from tensor_ops import BackendStatus, BackendUnavailableError, DeviceInfo
from tensor_ops.errors import UnsupportedError


class BackendType(str, enum.Enum):
    """Backend names with their vendor aliases (NVIDIA is CUDA, AMD and ROCM
    are HIP, INTEL and XPU are SYCL, TPU is XLA, the JAX / torch_xla shim)."""

    AUTO = "auto"
    CUDA = "cuda"
    NVIDIA = "cuda"
    HIP = "hip"
    AMD = "hip"
    ROCM = "hip"
    SYCL = "sycl"
    INTEL = "sycl"
    XPU = "sycl"
    OPENCL = "opencl"
    CPU = "cpu"
    XLA = "xla"
    TPU = "xla"

    @classmethod
    def from_string(cls, name: Union[str, "BackendType"]) -> "BackendType":
        """A member from its name, alias or value, case-insensitive."""
        if isinstance(name, cls):
            return name
        if not isinstance(name, str):
            raise TypeError(f"backend must be a name or a BackendType, got {type(name).__name__}")
        key = name.strip().lower()
        for member_name, member in cls.__members__.items():
            if key in (member_name.lower(), member.value):
                return member
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(_valid_names())}")

    def __str__(self) -> str:
        return self.value


def _valid_names() -> List[str]:
    return sorted({n.lower() for n in BackendType.__members__} | {m.value for m in BackendType})


# Where a backend's torch tensors live. HIP devices are "cuda" in ROCm builds
# of torch; OpenCL has no torch device, so its tensors stay on the host and
# tensor_ops stages them through its pool.
_TORCH_DEVICE_TYPE = {"cpu": "cpu", "cuda": "cuda", "hip": "cuda", "sycl": "xpu", "opencl": "cpu", "xla": "xla",
                      "tpu": "xla"}
# The XLA shim registers as "tpu" on a TPU host and as "xla" elsewhere.
_REGISTRY_NAMES = {BackendType.XLA: ("xla", "tpu")}


def _status(name: str) -> Optional[BackendStatus]:
    return next((b for b in tensor_ops.backends() if b.name == name), None)


def torch_reason(name: str) -> Optional[str]:
    """Why torch tensors cannot run on backend `name`, or None when they can.
    The XLA shim runs jax arrays; torch reaches XLA devices only through
    torch_xla."""
    if name in ("xla", "tpu") and importlib.util.find_spec("torch_xla") is None:
        return ("the XLA shim runs jax arrays; torch tensors reach XLA devices only through torch_xla, "
                "which is not installed")
    return None


def _xpu_holds(backend: "Backend") -> bool:
    """Whether torch tensors for SYCL backend's device live on torch's xpu
    device: torch built with XPU sees a device there and the SYCL device is
    no CPU. Else host tensors (torch without XPU raised "Torch not compiled
    with XPU enabled" at model.to for a SYCL device that is Intel's CPU
    OpenCL runtime)."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return False
    found = [d for d in tensor_ops.devices() if d.backend == backend.name]
    return backend.device_id < len(found) and found[backend.device_id].device_type != "cpu"


def _resolve(backend: Union[str, BackendType, None]) -> str:
    """A registry name for a name, alias or BackendType; AUTO (or None) is the
    registry's automatic choice for host arrays."""
    t = BackendType.from_string("auto" if backend is None else backend)
    if t is BackendType.AUTO:
        with tensor_ops.use("auto"):
            return tensor_ops.get_backend()
    names = _REGISTRY_NAMES.get(t, (t.value,))
    registered = {b.name for b in tensor_ops.backends()}
    return next((n for n in names if n in registered), names[0])


class Backend:
    """One usable backend and one of its devices, for torch code: where
    tensors go (device, to_device), what the device is (get_device_info),
    its memory pool, and model preparation. `with backend:` runs host arrays
    on it (tensor_ops.use)."""

    def __init__(self, name: str, device_id: int = 0):
        self.name = name
        self.type = BackendType.from_string(name)
        self.device_id = int(device_id)
        self._scopes: List[contextlib.AbstractContextManager] = []

    @property
    def is_available(self) -> bool:
        status = _status(self.name)
        return status is not None and status.usable

    @property
    def device_count(self) -> int:
        return sum(d.backend == self.name for d in tensor_ops.devices())

    @property
    def device(self) -> torch.device:
        kind = _TORCH_DEVICE_TYPE[self.name]
        if kind == "xpu" and not _xpu_holds(self):
            kind = "cpu"  # host tensors, staged to the SYCL device as OpenCL's are
        return torch.device(kind) if kind == "cpu" else torch.device(kind, self.device_id)

    def _check_host_device(self) -> None:
        """Host tensors run on a staging backend's first device (the registry
        stages host arrays to <name>:0): another device_id would be reported
        (get_device_info, get_memory_stats) while device 0 ran."""
        if self.device_id != 0 and self.name != "cpu" and self.device.type == "cpu":
            raise UnsupportedError(
                f"{self.name}:{self.device_id}: torch tensors on the host run on {self.name}:0 (host arrays are "
                f"staged to a backend's first device), so device_id {self.device_id} cannot be selected for them; "
                f"order the devices so that the one wanted is first ("
                + ("OCL_ICD_VENDORS: the OpenCL ICD list" if self.name == "opencl" else
                   "ONEAPI_DEVICE_SELECTOR" if self.name == "sycl" else "the backend's device selection")
                + f"), or keep data on it with tensor_ops.from_numpy(x, device='{self.name}:{self.device_id}')")

    def get_device_info(self, device_id: Optional[int] = None) -> DeviceInfo:
        i = self.device_id if device_id is None else device_id
        found = [d for d in tensor_ops.devices() if d.backend == self.name]
        if not 0 <= i < len(found):
            raise ValueError(f"{self.name} has {len(found)} device(s); device_id {i} is out of range")
        return found[i]

    def info(self) -> Dict[str, Any]:
        """tensor_ops.backend_info(name): availability, ops, devices, and the
        CPU's simd_level / has_avx2 / has_avx512 / has_fma / threads or a
        device's name, compute capability and memory."""
        return tensor_ops.backend_info(self.name)

    def _require_torch(self) -> None:
        reason = torch_reason(self.name)
        if reason is not None:
            raise BackendUnavailableError(f"backend {self.name!r} cannot hold torch tensors here: {reason}")

    def to_device(self, obj):
        """A tensor or module on this backend's torch device (modules move in
        place, as Module.to does)."""
        self._require_torch()
        return obj.to(self.device)

    def synchronize(self) -> None:
        """Waits for the device's queued work. tensor_ops kernels on host
        arrays return when done; device tensors run on torch's stream."""
        module = getattr(torch, self.device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()

    def empty_cache(self) -> None:
        """Returns cached blocks of tensor_ops' pool (and of torch's caching
        allocator, where the device has one) to the device."""
        tensor_ops.empty_cache(self._pool_device())
        module = getattr(torch, self.device.type, None)
        if self.device.type != "cpu" and module is not None and hasattr(module, "empty_cache"):
            module.empty_cache()

    def get_memory_stats(self) -> Dict[str, int]:
        """tensor_ops' pool statistics for the device (torch's key names)."""
        return tensor_ops.memory_stats(self._pool_device())

    def prepare_model(self, model: torch.nn.Module, level="O1", **kwargs):
        """prepare_model(model, level, backend=self): (model, OptimizationResult)."""
        from .prepare import prepare_model

        return prepare_model(model, level, backend=self, **kwargs)

    def optimize_for_inference(self, model: torch.nn.Module, level="O2", **kwargs):
        """eval(), gradients off, then prepare_model at `level`."""
        model.eval().requires_grad_(False)
        model, result = self.prepare_model(model, level, **kwargs)
        result.optimizations_applied.insert(0, "inference mode: eval(), requires_grad off")
        return model, result

    def optimize_for_training(self, model: torch.nn.Module, level="O1", optimizer=None, **kwargs):
        """train(), then prepare_model at `level` (the swapped modules keep the
        same Parameter objects, so an optimizer may be built before or after):
        (model, result). Given an optimizer (as `optimizer=` or in place of
        the level: optimize_for_training(model, opt)), returns (model,
        optimizer, result) with the fastest correct optimizer: torch's fused
        kernel for a default Adam / AdamW (the same object switched in place:
        groups, hyperparameters, state and attached LR schedulers kept), else
        the one given; result.optimizations_applied says which."""
        if isinstance(level, torch.optim.Optimizer):
            level, optimizer = "O1", level
        model.train()
        model, result = self.prepare_model(model, level, **kwargs)
        result.optimizations_applied.insert(0, "training mode: train()")
        if optimizer is None:
            return model, result
        optimizer, note = fuse_optimizer(optimizer)
        result.optimizations_applied.append(note)
        return model, optimizer, result

    def _pool_device(self) -> str:
        self._require_torch()  # the XLA shim has no tensor_ops pool; torch_xla owns that memory
        return f"{self.name}:{self.device_id}"

    def __enter__(self) -> "Backend":
        self._check_host_device()
        scope = tensor_ops.use(self.name)
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(self, *exc) -> None:
        self._scopes.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"Backend(name={self.name!r}, device={self.device}, available={self.is_available})"


class BackendFactory:
    @staticmethod
    def create(backend: Union[str, BackendType] = BackendType.AUTO, device_id: int = 0) -> Backend:
        """The backend with this name or alias (AUTO: the registry's choice).
        Unknown names raise ValueError; a backend that cannot run here raises
        BackendUnavailableError with the registry's reason."""
        name = _resolve(backend)
        status = _status(name)
        if status is None:
            known = ", ".join(b.name for b in tensor_ops.backends())
            raise BackendUnavailableError(
                f"backend {name!r} is not registered with tensor_ops (registered: {known})")
        if not status.usable:
            raise BackendUnavailableError(f"backend {name!r} is not usable: {status.reason}")
        reason = torch_reason(name)
        if reason is not None:
            raise BackendUnavailableError(f"backend {name!r} is not usable from torch: {reason}")
        backend = Backend(name, device_id)
        backend.get_device_info()  # device_id in range
        return backend

    @staticmethod
    def list_available_backends() -> List[str]:
        """Backends torch tensors can run on here, highest registry priority
        first (the XLA shim only with torch_xla: see torch_reason)."""
        usable = [b for b in tensor_ops.backends() if b.usable and torch_reason(b.name) is None]
        return [b.name for b in sorted(usable, key=lambda b: -b.priority)]

    @staticmethod
    def get_all_backend_info() -> List[Dict[str, Any]]:
        """Every backend the registry knows, usable or not (with the reason),
        its devices and where its torch tensors live."""
        devs = tensor_ops.devices()
        return [{**b.to_dict(), "torch_device_type": Backend(b.name).device.type if b.name in _TORCH_DEVICE_TYPE else None,
                 "devices": [d.to_dict() for d in devs if d.backend == b.name]} for b in tensor_ops.backends()]


def get_backend(backend: Union[str, BackendType, None] = None, device_id: int = 0) -> Backend:
    """The backend host arrays run on now (or the named one)."""
    return BackendFactory.create(tensor_ops.get_backend() if backend is None else backend, device_id)


def optimize_for_training(model: torch.nn.Module, optimizer=None, level="O1", backend=None, **kwargs):
    """Backend.optimize_for_training on the current (or the named) backend:
    (model, result), or (model, optimizer, result) given an optimizer (a
    default Adam / AdamW switched in place to torch's fused kernel)."""
    return get_backend(backend).optimize_for_training(model, level, optimizer, **kwargs)


def detect_best_backend() -> BackendType:
    """The registry's automatic choice: the best usable backend."""
    return BackendType.from_string(_resolve(BackendType.AUTO))


def list_available_backends() -> List[str]:
    return BackendFactory.list_available_backends()
