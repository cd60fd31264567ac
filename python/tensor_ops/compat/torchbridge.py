"""TorchBridge's API (its backend selection guide) on tensor_ops: replace
every `torchbridge...` import with `tensor_ops.compat.torchbridge`
(docs/migration.md)."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from tensor_ops.errors import InvalidArgumentError
from tensor_ops.torch.factory import BackendFactory as _OurFactory, BackendType
from tensor_ops.torch.prepare import OptimizationLevel, validate_model

from . import _backend
from ._backend import TensorOpsBackend, unavailable_reason
from .kernel_pytorch import NVIDIAConfig, StrictConfig


class TorchBridgeBackend(TensorOpsBackend):
    """A guide backend whose prepare_model without a level takes it from its
    TorchBridgeConfig preset (for_training / for_inference / ...)."""

    def prepare_model(self, model: nn.Module, optimization_level=None) -> nn.Module:
        if optimization_level is None and isinstance(self.config, TorchBridgeConfig):
            optimization_level = self.config.optimization_level
        return self._prepare(model, optimization_level)


class CUDABackend(TorchBridgeBackend):
    BACKEND_NAME = "cuda"
    REGISTRY_NAME = "cuda"


class ROCmBackend(TorchBridgeBackend):
    BACKEND_NAME = "rocm"
    REGISTRY_NAME = "hip"


class XPUBackend(TorchBridgeBackend):
    BACKEND_NAME = "xpu"
    REGISTRY_NAME = "sycl"


class TPUBackend(TorchBridgeBackend):
    """Torch tensors on XLA devices need torch_xla; without it every device
    call raises saying so."""

    BACKEND_NAME = "tpu"
    REGISTRY_NAME = "xla"


class OpenCLBackend(TorchBridgeBackend):
    BACKEND_NAME = "opencl"
    REGISTRY_NAME = "opencl"


class CPUBackend(TorchBridgeBackend):
    BACKEND_NAME = "cpu"
    REGISTRY_NAME = "cpu"


_CLASSES = {c.BACKEND_NAME: c for c in (CUDABackend, ROCmBackend, XPUBackend, TPUBackend, OpenCLBackend, CPUBackend)}
_BY_REGISTRY = {c.REGISTRY_NAME: c for c in _CLASSES.values()}


def detect_best_backend() -> str:
    """The best backend torch tensors can use here, by TorchBridge's names
    (cuda, rocm, xpu, tpu, cpu; opencl is tensor_ops' own)."""
    return _BY_REGISTRY[_OurFactory.list_available_backends()[0]].BACKEND_NAME


class BackendFactory:
    @staticmethod
    def create(name: Union[str, BackendType, None] = None, config: Any = None, device_id: int = 0) -> TensorOpsBackend:
        """The backend by TorchBridge's name (or any tensor_ops name / alias;
        None: detect_best_backend()). Hardware that is not here gives a
        backend whose is_available is False and whose device calls raise with
        the reason (no CPU fallback). Unknown names raise ValueError."""
        t = BackendType.from_string(detect_best_backend() if name is None else name)
        cls = _CLASSES[detect_best_backend()] if t is BackendType.AUTO else _BY_REGISTRY[t.value]
        return cls(config, device_id)

    @staticmethod
    def is_available(name: Union[str, BackendType]) -> bool:
        return BackendFactory.create(name).is_available

    @staticmethod
    def get_all_backend_info() -> Dict[str, Dict[str, Any]]:
        return _backend.all_backend_info(_CLASSES)


def list_available_backends() -> List[str]:
    return [_BY_REGISTRY[n].BACKEND_NAME for n in _OurFactory.list_available_backends()]


# ---- configuration ---------------------------------------------------------------------------------


class AMDArchitecture(str, enum.Enum):
    AUTO = "auto"
    CDNA2 = "cdna2"
    CDNA3 = "cdna3"
    RDNA2 = "rdna2"
    RDNA3 = "rdna3"


@dataclasses.dataclass
class AMDConfig(StrictConfig):
    architecture: AMDArchitecture = AMDArchitecture.AUTO
    device_id: int = 0
    enable_matrix_cores: bool = True
    memory_pool_size_gb: float = 0.0
    precision: str = "float32"


@dataclasses.dataclass
class IntelConfig(StrictConfig):
    device_id: int = 0
    enable_ipex: bool = False
    enable_onednn: bool = True
    enable_amx: bool = True
    precision: str = "float32"


@dataclasses.dataclass
class TPUConfig(StrictConfig):
    precision: str = "bfloat16"
    enable_xla_cache: bool = True
    cache_max_size: int = 100
    compilation_mode: str = "torch_xla"


@dataclasses.dataclass
class HardwareConfig(StrictConfig):
    nvidia: NVIDIAConfig = dataclasses.field(default_factory=NVIDIAConfig)
    amd: AMDConfig = dataclasses.field(default_factory=AMDConfig)
    intel: IntelConfig = dataclasses.field(default_factory=IntelConfig)
    tpu: TPUConfig = dataclasses.field(default_factory=TPUConfig)


@dataclasses.dataclass
class TorchBridgeConfig(StrictConfig):
    """The presets set the optimization level prepare_model uses when called
    without one on a backend created with this config: training O1 (fused
    modules, no compile, full precision), inference O2 (+ torch.compile),
    development O0 (device placement only)."""

    optimization_level: OptimizationLevel = OptimizationLevel.O1
    hardware: HardwareConfig = dataclasses.field(default_factory=HardwareConfig)

    @classmethod
    def for_training(cls) -> "TorchBridgeConfig":
        return cls(OptimizationLevel.O1)

    @classmethod
    def for_inference(cls) -> "TorchBridgeConfig":
        return cls(OptimizationLevel.O2)

    @classmethod
    def for_development(cls) -> "TorchBridgeConfig":
        return cls(OptimizationLevel.O0)


# ---- validation ------------------------------------------------------------------------------------


@dataclasses.dataclass
class ValidationResults:
    passed: int
    total_tests: int
    results: Dict[str, Dict[str, Any]]


class UnifiedValidator:
    """validate_model(model, input_shape=..., sample_input=..., backends=...):
    tensor_ops.torch.validate_model, one test per backend (default: every one
    torch tensors can use here): the prepared model against the original."""

    def __init__(self, config: Any = None):
        self.config = config

    def validate_model(self, model: nn.Module, input_shape: Optional[Sequence[int]] = None, sample_input=None,
                       backends: Optional[Sequence[str]] = None) -> ValidationResults:
        if sample_input is None:
            if input_shape is None:
                raise InvalidArgumentError("validate_model needs input_shape or sample_input")
            sample_input = torch.randn(*input_shape)
        names = None if backends is None else [str(BackendType.from_string(b)) for b in backends]
        r = validate_model(model, sample_input, backends=names)
        return ValidationResults(r.passed, r.total, r.results)



__all__ = [
    "BackendFactory", "detect_best_backend", "list_available_backends", "TorchBridgeBackend", "CUDABackend",
    "ROCmBackend", "XPUBackend", "TPUBackend", "OpenCLBackend", "CPUBackend", "TorchBridgeConfig", "HardwareConfig",
    "NVIDIAConfig", "AMDConfig", "AMDArchitecture", "IntelConfig", "TPUConfig", "UnifiedValidator",
    "ValidationResults", "OptimizationLevel", "unavailable_reason",
]
