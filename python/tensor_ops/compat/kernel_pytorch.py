"""KernelPyTorch's API (the v0.3.3 selection guide, the v0.4.8 unification
guide, the v0.4.3 NVIDIA page) on tensor_ops: a migrating user replaces every
`kernel_pytorch...` import with `tensor_ops.compat.kernel_pytorch`
(docs/migration.md has the table and the intended differences)."""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

import tensor_ops
from tensor_ops import errors as _errors
from tensor_ops.backends import DeviceInfo
from tensor_ops.hardware import HardwareDetector as _OurDetector, HardwareProfile, HardwareType
from tensor_ops.torch import functional as _ops
from tensor_ops.torch.factory import BackendFactory as _OurFactory, BackendType, torch_reason
from tensor_ops.torch.flash_attention import FlashAttention as _FlashAttention
from tensor_ops.torch.prepare import OptimizationLevel, ValidationResult, validate_model

from . import _backend
from ._backend import (
    BaseBackend, BaseOptimizer, OptimizationResult, OptimizationStrategy, TensorOpsBackend, fuse_optimizer,
    unavailable_reason,
)

# ---- configuration (kernel_pytorch.core.config) ----------------------------------------------------
# Every field the guides set is accepted; which ones act is in docs/migration.md.


class StrictConfig:
    """A misspelt field raises AttributeError instead of being stored and ignored."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}; fields: "
                                 f"{', '.join(self.__dataclass_fields__)}")
        object.__setattr__(self, name, value)


class NVIDIAArchitecture(str, enum.Enum):
    AUTO = "auto"
    VOLTA = "volta"
    TURING = "turing"
    AMPERE = "ampere"
    ADA = "ada"
    HOPPER = "hopper"
    BLACKWELL = "blackwell"


class TPUVersion(str, enum.Enum):
    AUTO = "auto"
    V4 = "v4"
    V5E = "v5e"
    V5P = "v5p"
    V6E = "v6e"
    V7 = "v7"


class TPUTopology(str, enum.Enum):
    SINGLE = "single"
    POD = "pod"
    SUPERPOD = "superpod"


@dataclasses.dataclass
class NVIDIAConfig(StrictConfig):
    architecture: NVIDIAArchitecture = NVIDIAArchitecture.AUTO
    device_id: int = 0
    fp8_enabled: bool = False
    flash_attention_enabled: bool = True
    flash_attention_version: str = "3"
    tensor_core_version: int = 4
    memory_pool_init_mb: int = 0
    memory_growth_enabled: bool = True
    max_memory_fraction: float = 1.0  # acts: the device pool's cap (set_memory_fraction)
    precision: str = "float32"
    allow_fp32: bool = True
    cudnn_benchmark: bool = False  # acts: torch.backends.cudnn.benchmark
    enable_oom_protection: bool = True


@dataclasses.dataclass
class TPUConfig(StrictConfig):
    version: TPUVersion = TPUVersion.AUTO
    topology: TPUTopology = TPUTopology.SINGLE
    compilation_mode: str = "torch_xla"
    enable_xla_cache: bool = True
    cache_max_size: int = 100
    precision: str = "bfloat16"
    mixed_precision: bool = True
    memory_fraction: float = 0.9
    allocation_history_retention_seconds: float = 3600.0
    monitoring_interval_seconds: float = 1.0
    monitoring_duration_seconds: float = 60.0


@dataclasses.dataclass
class HardwareConfig(StrictConfig):
    nvidia: NVIDIAConfig = dataclasses.field(default_factory=NVIDIAConfig)
    tpu: TPUConfig = dataclasses.field(default_factory=TPUConfig)


@dataclasses.dataclass
class KernelConfig(StrictConfig):
    enabled: bool = True  # prepare_model's fused modules (O1 and up) are always on


@dataclasses.dataclass
class KernelPyTorchConfig(StrictConfig):
    hardware: HardwareConfig = dataclasses.field(default_factory=HardwareConfig)
    kernel: KernelConfig = dataclasses.field(default_factory=KernelConfig)


# ---- backends (kernel_pytorch.backends, .nvidia, .tpu) -------------------------------------------


class CPUBackend(TensorOpsBackend):
    BACKEND_NAME = "cpu"
    REGISTRY_NAME = "cpu"


class NVIDIABackend(TensorOpsBackend):
    """CUDA through tensor_ops' CUDA plugin; config.hardware.nvidia's
    max_memory_fraction and cudnn_benchmark act when it is available."""

    BACKEND_NAME = "nvidia"
    REGISTRY_NAME = "cuda"

    def _setup_environment(self) -> None:
        super()._setup_environment()
        nv = getattr(getattr(self.config, "hardware", None), "nvidia", None)
        if nv is not None and self._reason is None:
            self._device_id = nv.device_id
            torch.backends.cudnn.benchmark = bool(nv.cudnn_benchmark)
            if nv.max_memory_fraction < 1.0:
                tensor_ops.set_memory_fraction(nv.max_memory_fraction, f"cuda:{nv.device_id}")

    @property
    def is_cuda_available(self) -> bool:
        return self.is_available

    @property
    def compute_capability(self):
        """(major, minor), as torch.cuda.get_device_capability."""
        cc = self.get_device_info().compute_capability
        major, _, minor = cc.partition(".")
        return int(major), int(minor or 0)


class AMDBackend(TensorOpsBackend):
    BACKEND_NAME = "amd"
    REGISTRY_NAME = "hip"


class IntelBackend(TensorOpsBackend):
    BACKEND_NAME = "intel"
    REGISTRY_NAME = "sycl"


class TPUBackend(TensorOpsBackend):
    """XLA devices for torch tensors: needs torch_xla (tensor_ops' XLA shim
    itself runs jax arrays); without it every device call raises saying so."""

    BACKEND_NAME = "tpu"
    REGISTRY_NAME = "xla"


class OpenCLBackend(TensorOpsBackend):
    BACKEND_NAME = "opencl"
    REGISTRY_NAME = "opencl"


_CLASSES = {"nvidia": NVIDIABackend, "amd": AMDBackend, "tpu": TPUBackend, "intel": IntelBackend,
            "opencl": OpenCLBackend, "cpu": CPUBackend}
_BY_REGISTRY = {cls.REGISTRY_NAME: cls for cls in _CLASSES.values()}


def _class_of(backend: Union[str, BackendType, None]) -> type:
    t = BackendType.from_string("auto" if backend is None else backend)  # unknown names raise, listing ours
    if t is BackendType.AUTO:
        return _CLASSES[detect_best_backend()]
    return _BY_REGISTRY[t.value]


def _guide_name(registry_name: str) -> str:
    cls = _BY_REGISTRY.get(registry_name) or (TPUBackend if registry_name == "tpu" else None)
    return cls.BACKEND_NAME if cls is not None else registry_name


def list_available_backends() -> List[str]:
    """The backends torch tensors can use here, best first, by the guide's
    names (nvidia, amd, intel, tpu, cpu; opencl is tensor_ops' own)."""
    return [_guide_name(n) for n in _OurFactory.list_available_backends()]


def detect_best_backend() -> str:
    """tensor_ops' automatic choice among those, by the guide's name."""
    return list_available_backends()[0]


class HardwareDetector(_OurDetector):
    """tensor_ops.HardwareDetector; get_optimal_backend() answers with the
    guide's backend names (nvidia, amd, intel, tpu, cpu) as the guide's
    callers compare them."""

    def get_optimal_backend(self, profile: Optional[HardwareProfile] = None) -> str:
        return _guide_name(super().get_optimal_backend(profile))


class BackendFactory:
    @staticmethod
    def create(backend_type: Union[str, BackendType, None] = BackendType.AUTO, config: Any = None,
               device_id: int = 0) -> TensorOpsBackend:
        """The guide's backend for a name or BackendType (AUTO: the best one
        torch tensors can use). Hardware that is not here gives a backend whose
        is_available is False and whose device calls raise (no CPU fallback)."""
        return _class_of(backend_type)(config, device_id)

    @staticmethod
    def is_available(backend_type: Union[str, BackendType]) -> bool:
        return unavailable_reason(_class_of(backend_type).REGISTRY_NAME) is None

    @staticmethod
    def list_available_backends():
        return list_available_backends()

    @staticmethod
    def get_all_backend_info() -> Dict[str, Dict[str, Any]]:
        return _backend.all_backend_info(_CLASSES)


def get_backend(backend_type: Union[str, BackendType, None] = None, config: Any = None,
                device_id: int = 0) -> TensorOpsBackend:
    """The named backend, or (None) the one tensor_ops runs host arrays on
    now: the best available unless TENSOR_OPS_BACKEND / set_backend() /
    use() chose another, as tensor_ops.torch.get_backend()."""
    return BackendFactory.create(tensor_ops.get_backend() if backend_type is None else backend_type, config,
                                 device_id)


class CPUOptimizer(BaseOptimizer):
    def __init__(self, config: Any = None):
        super().__init__(CPUBackend(config))


class NVIDIAOptimizer(BaseOptimizer):
    def __init__(self, config: Any = None):
        super().__init__(NVIDIABackend(config))


class AMDOptimizer(BaseOptimizer):
    def __init__(self, config: Any = None):
        super().__init__(AMDBackend(config))


class IntelOptimizer(BaseOptimizer):
    def __init__(self, config: Any = None):
        super().__init__(IntelBackend(config))


_OPTIMIZERS = {"cpu": CPUOptimizer, "nvidia": NVIDIAOptimizer, "amd": AMDOptimizer, "intel": IntelOptimizer}


def get_optimizer(backend_type: Union[str, BackendType, None] = None, config: Any = None) -> BaseOptimizer:
    """The optimizer of that backend (default: the best available one)."""
    backend = get_backend(backend_type, config)
    cls = _OPTIMIZERS.get(backend.BACKEND_NAME)
    return cls(config) if cls is not None else BaseOptimizer(backend)


# ---- the NVIDIA page: memory manager, device manager, FlashAttention3, errors -----------------------

NVIDIABackendError = _errors.TensorOpsError
CUDANotAvailableError = _errors.BackendUnavailableError
CUDADeviceError = _errors.DeviceError
KernelLaunchError = _errors.DeviceError
MemoryAllocationError = _errors.MemoryAllocationError
OutOfMemoryError = _errors.OutOfMemoryError
FP8CompilationError = _errors.UnsupportedError
InvalidComputeCapabilityError = _errors.UnsupportedError
FlashAttentionError = _errors.InvalidArgumentError
ModelOptimizationError = _errors.TensorOpsError
InvalidArchitectureError = _errors.InvalidArgumentError
ConfigurationError = _errors.InvalidArgumentError


class MemoryManager:
    """The NVIDIA page's memory manager on one device's tensor_ops pool
    (NVIDIAMemoryManager is this on cuda:<device_id>). A torch dtype gives
    torch tensors (zero-copy views of pool memory)."""

    def __init__(self, device: str = "cpu"):
        self.device = str(device)
        name = self.device.partition(":")[0]
        reason = unavailable_reason(name)
        if reason is not None:
            raise CUDANotAvailableError(f"no {self.device} for the memory manager: {reason}")

    def allocate_with_oom_protection(self, shape: Sequence[int], dtype=torch.float32, safety_margin: float = 1.2):
        t = tensor_ops.allocate_with_oom_protection(shape, dtype, safety_margin, device=self.device)
        return torch.from_dlpack(t) if _is_torch_dtype(dtype) else t

    def allocate_tensor(self, shape: Sequence[int], dtype=torch.float32, pool_id: str = "default"):
        return tensor_ops.allocate_tensor(shape, dtype, pool_id=pool_id, device=self.device)

    def return_to_pool(self, tensor, pool_id: str = "default") -> None:
        tensor_ops.return_to_pool(tensor, pool_id)

    def clear_pool(self, pool_id: Optional[str] = None) -> None:
        tensor_ops.clear_pool(pool_id)

    def get_memory_stats(self) -> Dict[str, Any]:
        """tensor_ops.get_memory_stats(device): torch's keys plus
        allocated_gb, reserved_gb, peak_allocated_gb and the named pools."""
        return tensor_ops.get_memory_stats(self.device)


def _is_torch_dtype(dtype) -> bool:
    return isinstance(dtype, torch.dtype)


class NVIDIAMemoryManager(MemoryManager):
    def __init__(self, config: Any = None, device_id: int = 0):
        super().__init__(f"cuda:{device_id}")


class CUDADeviceManager:
    """CUDA devices as tensor_ops' registry lists them (device_count 0 where
    there is none)."""

    def __init__(self, config: Any = None):
        self._devices = [d for d in tensor_ops.devices() if d.backend == "cuda"]

    @property
    def device_count(self) -> int:
        return len(self._devices)

    def get_device_properties(self, device_id: int = 0) -> Dict[str, Any]:
        if not 0 <= device_id < len(self._devices):
            raise _errors.InvalidArgumentError(
                f"{len(self._devices)} CUDA device(s); device_id {device_id} is out of range")
        d = self._devices[device_id]
        return {"name": d.device_name, "compute_capability": d.compute_capability,
                "total_memory_gb": d.total_memory_gb, "total_memory_bytes": d.total_memory_bytes,
                "driver_version": d.driver_version, **d.properties}

    def get_gpu_utilization(self, device_id: int = 0) -> Dict[str, Any]:
        """torch.cuda.utilization / memory_usage (NVML, through pynvml)."""
        self.get_device_properties(device_id)
        return {"gpu_utilization_percent": torch.cuda.utilization(device_id),
                "memory_utilization_percent": torch.cuda.memory_usage(device_id)}


class FlashAttention3(_FlashAttention):
    """KernelPyTorch's FlashAttention3 on tensor_ops' attention: forward(x,
    attention_mask=None, return_attention_weights=False) returns (output,
    weights), weights None unless asked for (then the softmax probabilities
    [batch, heads, L, L] are computed explicitly). attention_mask is
    tensor_ops' FlashAttention's: [batch, Lk] key padding, or bool /
    additive broadcastable to [batch, heads, Lq, Lk]."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 causal: bool = False, config: Any = None):
        super().__init__(embed_dim, num_heads, dropout=dropout, causal=causal, bias=bias)
        self.config = config

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                return_attention_weights: bool = False):
        if not return_attention_weights:
            return super().forward(x, attention_mask), None
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :] if attention_mask.dim() == 2 else attention_mask
            if mask.dtype != torch.bool and not mask.is_floating_point():
                mask = mask != 0
            scores = scores + (torch.zeros_like(scores).masked_fill(~mask, float("-inf"))
                               if mask.dtype == torch.bool else mask.to(acc))
        if self.causal:
            n = scores.shape[-1]
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        weights = _ops.softmax(scores, -1)
        probs = F.dropout(weights, self.dropout, True) if self.training and self.dropout else weights
        out = torch.matmul(probs, v.to(acc)).to(x.dtype)
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim)), weights


# ---- validation (kernel_pytorch.validation.unified_validator) --------------------------------------


class UnifiedValidator:
    """validate_nvidia_compatibility / validate_tpu_compatibility(model,
    sample_input=None): tensor_ops.torch.validate_model on that backend (an
    unavailable backend counts as failed, with the reason)."""

    def __init__(self, config: Any = None):
        self.config = config

    @staticmethod
    def _sample(model: nn.Module, sample_input):
        if sample_input is not None:
            return sample_input
        first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            raise _errors.InvalidArgumentError(
                "no sample_input given and the model has no nn.Linear to infer an input shape from")
        return torch.randn(2, first.in_features)

    def validate_nvidia_compatibility(self, model: nn.Module, sample_input=None) -> ValidationResult:
        return validate_model(model, self._sample(model, sample_input), backends=["cuda"])

    def validate_tpu_compatibility(self, model: nn.Module, sample_input=None) -> ValidationResult:
        return validate_model(model, self._sample(model, sample_input), backends=["xla"])


__all__ = [
    "NVIDIAArchitecture", "TPUVersion", "TPUTopology", "NVIDIAConfig", "TPUConfig", "HardwareConfig",
    "KernelConfig", "KernelPyTorchConfig",
    "BaseBackend", "TensorOpsBackend", "CPUBackend", "NVIDIABackend", "AMDBackend", "IntelBackend", "TPUBackend",
    "OpenCLBackend", "BackendFactory", "BackendType", "get_backend", "detect_best_backend",
    "list_available_backends", "OptimizationLevel", "OptimizationResult", "DeviceInfo",
    "BaseOptimizer", "CPUOptimizer", "NVIDIAOptimizer", "AMDOptimizer", "IntelOptimizer", "get_optimizer",
    "OptimizationStrategy", "fuse_optimizer",
    "HardwareDetector", "HardwareProfile", "HardwareType",
    "NVIDIABackendError", "CUDANotAvailableError", "CUDADeviceError", "KernelLaunchError", "MemoryAllocationError",
    "OutOfMemoryError", "FP8CompilationError", "InvalidComputeCapabilityError", "FlashAttentionError",
    "ModelOptimizationError", "InvalidArchitectureError", "ConfigurationError",
    "MemoryManager", "NVIDIAMemoryManager", "CUDADeviceManager", "FlashAttention3", "UnifiedValidator",
    "torch_reason",
]
