"""Backends and devices: what is compiled, what is usable, and selection."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Dict, Iterator, List, Tuple

from . import _C
from . import _xla_route as _route
from . import xla as _xla
from .errors import ArgumentTypeError, BackendUnavailableError, InvalidArgumentError

# The XLA shim's names are the Python layer's: the core accepts them in
# TENSOR_OPS_BACKEND / TENSOR_OPS_PRIORITY and leaves those arrays to us.
_C.set_external_backends(list(_xla.NAMES))

_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "accelerator", 3: "other"}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device of one backend. The fields after device_name are optional
    (the seed guide's DeviceInfo is built with keywords, often without them)."""

    backend: str
    device_type: str
    device_id: int
    device_name: str
    total_memory_bytes: int = 0
    compute_capability: str = ""
    driver_version: str = ""
    is_available: bool = True
    vendor: str = ""
    properties: Dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def total_memory_gb(self) -> float:
        return self.total_memory_bytes / float(1 << 30)

    @property
    def total_memory_mb(self) -> float:
        return self.total_memory_bytes / float(1 << 20)

    def to_dict(self) -> Dict[str, Any]:
        """The fields, plus total_memory_gb and total_memory_mb."""
        return {**dataclasses.asdict(self), "total_memory_gb": self.total_memory_gb,
                "total_memory_mb": self.total_memory_mb}


@dataclasses.dataclass(frozen=True)
class BackendStatus:
    """A backend as the registry sees it: compiled in, usable here, and why not."""

    name: str
    compiled: bool
    usable: bool
    reason: str
    priority: int
    library: str
    ops: Tuple[str, ...] = ()  # the ops it has kernels for

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _parse_properties(text: str) -> Dict[str, str]:
    props = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key.strip()] = value.strip()
    return props


def devices() -> List[DeviceInfo]:
    """Every device of every usable backend, best backend first."""
    out = []
    for d in _C.devices():
        out.append(
            DeviceInfo(
                backend=d["backend"],
                device_type=_DEVICE_TYPES.get(d["device_type"], "other"),
                device_id=d["device_id"],
                device_name=d["device_name"],
                total_memory_bytes=int(d["total_memory_bytes"]),
                compute_capability=d["compute_capability"],
                driver_version=d["driver_version"],
                is_available=d["is_available"],
                vendor=d["vendor"],
                properties=_parse_properties(d["properties"]),
            )
        )
    return out + [DeviceInfo(**d) for d in _xla.xla_devices()]


def backends() -> List[BackendStatus]:
    """Every backend tensor_ops knows: compiled or not, usable or not, and why."""
    native = _native_backends()
    return native + [_shim_status(native)]


def _native_backends() -> List[BackendStatus]:
    return [BackendStatus(**{**b, "ops": tuple(b["ops"])}) for b in _C.backends()]


def _shim_status(native: List[BackendStatus]) -> BackendStatus:
    """The XLA shim (python, jax) as a backend: it registers as "tpu" on a TPU
    host and as "xla" elsewhere; it has every op (ops are listed by kernel
    name, as the native backends' are: the CPU backend has them all)."""
    kernel_ops = next((b.ops for b in native if b.name == "cpu"), ())
    return BackendStatus(**_xla.backend_status(), ops=tuple(kernel_ops))


def _require_shim(name: str) -> BackendStatus:
    """The shim's status; raises when it cannot run."""
    native = _native_backends()
    status = _shim_status(native)
    if not status.usable:
        usable = ", ".join(b.name for b in native if b.usable)
        raise BackendUnavailableError(f"backend '{name}' is not usable: {status.reason} (usable backends: {usable})")
    return status


def get_backend() -> str:
    """Name of the backend host arrays run on now (raises if the selection,
    e.g. TENSOR_OPS_BACKEND, names a backend that cannot run)."""
    name = _C.selected_backend()
    if _route.is_name(name):
        return _require_shim(name).name
    return name


def set_backend(name: str | None) -> None:
    """Selects the backend for host arrays; None or "auto" restores automatic
    selection. "xla" / "tpu" select the XLA shim (tensor_ops.xla). Unknown or
    unusable names raise."""
    global _set_name
    name = "auto" if name is None else _backend_name(name)
    if _route.is_name(name):
        _require_shim(name)
    _C.set_backend(name)
    _set_name = name


_set_name = "auto"  # the last set_backend() selection ("auto": none)


def last_set_backend() -> str:
    """The last set_backend() selection ("auto" for none), which a failed
    TensorOpsConfig.apply() restores."""
    return _set_name


def _backend_name(name) -> str:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"a backend name must be a str, got {type(name).__name__} {name!r}")
    if not name.strip():
        raise InvalidArgumentError(f"a backend name must not be empty, got {name!r}; "
                                   "use None or 'auto' for automatic selection")
    return name


# Note [use() per context] (python/src/registry.cpp): the use() scopes of
# the current context (thread, asyncio task), innermost last; the binding
# mirrors them into the core before each op.
class _Scope:
    """One use() block: its backend, and whether it has not ended yet."""

    __slots__ = ("name", "active")

    def __init__(self, name: str):
        self.name, self.active = name, True


_SCOPES: contextvars.ContextVar[Tuple[_Scope, ...]] = contextvars.ContextVar("tensor_ops_use", default=())
_C.set_scope_var(_SCOPES)


@contextlib.contextmanager
def use(name: str) -> Iterator[str]:
    """`with tensor_ops.use("cpu"):` runs host arrays on that backend for the
    block ("xla" / "tpu": on the XLA shim), in this thread or asyncio task
    (a context variable: other tasks and threads keep their own selection)."""
    name = _backend_name(name)
    if _route.is_name(name):
        _require_shim(name)
    _C.check_scope(name)
    entry = _Scope(name)
    token = _SCOPES.set(_SCOPES.get() + (entry,))
    try:
        yield name
    finally:
        # The block has ended wherever its entry is seen: in the context that
        # entered it (reset below, or, when the block ended in another
        # context, a generator resumed on another thread, at that context's
        # next op) and in the contexts copied while it ran (a task created
        # in the block): every mirror is rebuilt without it.
        entry.active = False
        try:
            _SCOPES.reset(token)
        except ValueError:
            pass
        _C.scopes_changed()


def get_backend_info() -> Dict[str, Any]:
    """The selected backend, its devices and the state of every backend."""
    name = get_backend()
    info: Dict[str, Any] = {
        "backend": name,
        "devices": [d.to_dict() for d in devices() if d.backend == name],
        "backends": [b.to_dict() for b in backends()],
    }
    if name == "cpu":
        info["cpu"] = {
            "isa": _C.cpu_active_isa(),
            "supported_isas": list(_C.cpu_supported_isas()),
            "num_threads": _C.cpu_num_threads(),
        }
    from .hardware import backend_info  # airllm's flat keys: simd_level, has_avx2, threads, device_name...

    info.update({k: v for k, v in backend_info(name).items() if k not in info})
    return info
