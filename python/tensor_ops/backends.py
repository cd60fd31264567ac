"""Backends and devices: what is compiled, what is usable, and selection."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List, Tuple

from . import _C

_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "accelerator", 3: "other"}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device of one backend."""

    backend: str
    device_type: str
    device_id: int
    device_name: str
    total_memory_bytes: int
    compute_capability: str
    driver_version: str
    is_available: bool
    vendor: str = ""
    properties: Dict[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


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
    return out


def backends() -> List[BackendStatus]:
    """Every backend tensor_ops knows: compiled or not, usable or not, and why."""
    return [BackendStatus(**{**b, "ops": tuple(b.get("ops", ()))}) for b in _C.backends()]


def get_backend() -> str:
    """Name of the backend host arrays run on now (raises if the selection,
    e.g. TENSOR_OPS_BACKEND, names a backend that cannot run)."""
    return _C.active_backend()


def set_backend(name: str | None) -> None:
    """Selects the backend for host arrays; None or "auto" restores automatic
    selection. Unknown or unusable names raise."""
    _C.set_backend("auto" if name is None else str(name))


@contextlib.contextmanager
def use(name: str) -> Iterator[str]:
    """`with tensor_ops.use("cpu"):` runs host arrays on that backend in this
    thread for the block."""
    _C.push_scope(str(name))
    try:
        yield name
    finally:
        _C.pop_scope()


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
