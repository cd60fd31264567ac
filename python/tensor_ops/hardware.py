"""Hardware detection and capability info (the seeds' HardwareDetector and
airllm's per-backend info()), read from the registry: the profile describes
the backend the registry itself picks for host arrays (same code path,
TENSOR_OPS_BACKEND / TENSOR_OPS_PRIORITY included), so the two cannot
disagree."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional

from . import _C
from .backends import DeviceInfo, backends, devices, use
from .errors import InvalidArgumentError

_GB = float(1 << 30)


class HardwareType(str, enum.Enum):
    NVIDIA_GPU = "nvidia_gpu"
    AMD_GPU = "amd_gpu"
    INTEL_GPU = "intel_gpu"
    GPU = "gpu"  # another vendor's GPU (through OpenCL)
    TPU = "tpu"
    ACCELERATOR = "accelerator"
    CPU = "cpu"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    hardware_type: HardwareType
    backend: str  # the registry's choice for host arrays
    device_name: str
    device_count: int  # devices of that backend
    total_memory_gb: float  # of device 0
    capabilities: Dict[str, Any]
    devices: List[DeviceInfo]

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["hardware_type"] = self.hardware_type.value
        return d


def _hardware_type(backend: str, dev: Optional[DeviceInfo]) -> HardwareType:
    if dev is None or dev.device_type == "cpu":
        return HardwareType.CPU
    if backend == "cuda":
        return HardwareType.NVIDIA_GPU
    if backend == "hip":
        return HardwareType.AMD_GPU
    if backend in ("xla", "tpu"):
        return HardwareType.TPU if "tpu" in dev.device_name.lower() else HardwareType.ACCELERATOR
    if dev.device_type == "gpu":
        vendor = dev.vendor.lower()
        for key, t in (("nvidia", HardwareType.NVIDIA_GPU), ("amd", HardwareType.AMD_GPU),
                       ("advanced micro", HardwareType.AMD_GPU), ("intel", HardwareType.INTEL_GPU)):
            if key in vendor:
                return t
        return HardwareType.GPU
    return HardwareType.ACCELERATOR


def _flag(props: Dict[str, str], key: str) -> bool:
    return props.get(key, "0") == "1"


def backend_info(name: Optional[str] = None) -> Dict[str, Any]:
    """What one backend (default: the active one) is and has: name,
    available, reason, priority, ops, device_count, devices; the CPU adds
    simd_level, supported_isas, has_avx2 / has_avx512 / has_fma / has_f16c /
    has_avx512_bf16 and threads; a device backend adds device_name,
    compute_capability, total_memory_gb and driver_version of device 0.
    Unknown names raise, listing the valid ones."""
    from .backends import get_backend

    name = get_backend() if name is None else str(name)
    status = next((b for b in backends() if b.name == name), None)
    if status is None:
        raise InvalidArgumentError(
            f"unknown backend {name!r}; valid backends: {', '.join(b.name for b in backends())}")
    devs = [d for d in devices() if d.backend == name]
    info: Dict[str, Any] = {"name": name, "available": status.usable, "reason": status.reason,
                            "priority": status.priority, "ops": list(status.ops), "device_count": len(devs),
                            "devices": [d.to_dict() for d in devs]}
    if name == "cpu":
        props = devs[0].properties if devs else {}
        info.update({
            "simd_level": _C.cpu_active_isa(),
            "supported_isas": list(_C.cpu_supported_isas()),
            "has_avx2": _flag(props, "has_avx2"),
            "has_avx512": _flag(props, "has_avx512"),
            "has_fma": _flag(props, "has_fma"),
            "has_f16c": _flag(props, "has_f16c"),
            "has_avx512_bf16": _flag(props, "has_avx512_bf16"),
            "threads": _C.cpu_num_threads(),
            "device_name": devs[0].device_name if devs else "CPU",
        })
    elif devs:
        d = devs[0]
        info.update({"device_name": d.device_name, "vendor": d.vendor, "compute_capability": d.compute_capability,
                     "total_memory_gb": d.total_memory_bytes / _GB, "driver_version": d.driver_version,
                     "properties": dict(d.properties)})
    return info


class HardwareDetector:
    """detect(): the HardwareProfile of the backend the registry picks for
    host arrays, computed once per detector (force_redetect=True recomputes
    it, e.g. after TENSOR_OPS_PRIORITY changed); get_optimal_backend(): that
    backend's name (of the given profile, or of detect())."""

    def __init__(self) -> None:
        self._profile: Optional[HardwareProfile] = None

    def get_optimal_backend(self, profile: Optional[HardwareProfile] = None) -> str:
        if profile is not None and not isinstance(profile, HardwareProfile):
            raise InvalidArgumentError(
                f"get_optimal_backend: profile must be a HardwareProfile (from detect()), got {type(profile).__name__}")
        return (profile or self.detect()).backend

    def detect(self, force_redetect: bool = False) -> HardwareProfile:
        if self._profile is None or force_redetect:
            self._profile = self._detect()
        return self._profile

    @staticmethod
    def _detect() -> HardwareProfile:
        with use("auto"):  # the automatic choice, whatever set_backend() said
            from .backends import get_backend

            name = get_backend()
        devs = [d for d in devices() if d.backend == name]
        first = devs[0] if devs else None
        info = backend_info(name)
        caps = {k: v for k, v in info.items() if k not in ("name", "devices", "device_name", "device_count")}
        if first is not None:
            caps = {**first.properties, **caps}
        return HardwareProfile(
            hardware_type=_hardware_type(name, first),
            backend=name,
            device_name=first.device_name if first else name,
            device_count=len(devs),
            total_memory_gb=first.total_memory_bytes / _GB if first else 0.0,
            capabilities=caps,
            devices=devs,
        )


def detect_hardware() -> HardwareProfile:
    return HardwareDetector().detect()


__all__ = ["HardwareType", "HardwareProfile", "HardwareDetector", "backend_info", "detect_hardware"]
