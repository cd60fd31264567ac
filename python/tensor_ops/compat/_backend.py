"""The seed guides' backend object (KernelPyTorch's BaseBackend, TorchBridge's
backends) over tensor_ops.torch's Backend.

Note [guide backends are loud, not silent]: a guide backend for hardware that
is not here can be created (the guides loop over backends and test
is_available), reports is_available False, and raises BackendUnavailableError
with the registry's reason from everything that needs the device. The guides'
projects fell back to the CPU instead; tensor_ops never runs a model anywhere
but where it was asked (docs/migration.md, intended differences)."""
from __future__ import annotations

import abc
import dataclasses
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

import tensor_ops
from tensor_ops import BackendUnavailableError, DeviceInfo
from tensor_ops.errors import InvalidArgumentError
from tensor_ops.pools import get_memory_stats as _pool_memory_stats
from tensor_ops.torch import factory as _factory
from tensor_ops.torch.fused_linear import prepare_model_with_custom_kernels as _custom_kernels
from tensor_ops.torch.optim import fuse_optimizer
from tensor_ops.torch.prepare import OptimizationLevel, OptimizationResult as _OurResult, prepare_model as _prepare

_log = logging.getLogger("tensor_ops")
_MB = float(1 << 20)

# The level a guide call without one gets: ours (O1: fused modules, no
# torch.compile); the guides leave it to each backend.
DEFAULT_LEVEL = OptimizationLevel.O1


@dataclasses.dataclass
class OptimizationResult(_OurResult):
    """tensor_ops.torch's OptimizationResult plus the guide's `model` field."""

    model: Optional[nn.Module] = None

    @classmethod
    def of(cls, ours: _OurResult, model: nn.Module) -> "OptimizationResult":
        return cls(**{f.name: getattr(ours, f.name) for f in dataclasses.fields(ours)}, model=model)

    def to_dict(self) -> Dict[str, Any]:
        """The fields but the model (its repr under 'model')."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        return {**d, "level": self.level.name, "model": repr(self.model)}


def unavailable_reason(registry_name: str) -> Optional[str]:
    """Why torch tensors cannot run on this tensor_ops backend here, or None."""
    name = _factory._resolve(registry_name)
    status = _factory._status(name)
    if status is None:
        return f"backend {name!r} is not registered with tensor_ops (not compiled in)"
    if not status.usable:
        return status.reason or "not usable"
    return _factory.torch_reason(name)


class BaseBackend(abc.ABC):
    """The guide's abstract interface (KernelPyTorch v0.4.8 BaseBackend)."""

    BACKEND_NAME: str = "base"

    @abc.abstractmethod
    def _setup_environment(self) -> None: ...

    @abc.abstractmethod
    def _check_availability(self) -> bool: ...

    @abc.abstractmethod
    def _get_device_info(self, device_id: int = 0) -> DeviceInfo: ...

    @abc.abstractmethod
    def prepare_model(self, model: nn.Module, optimization_level=None) -> nn.Module: ...

    @abc.abstractmethod
    def optimize_for_inference(self, model: nn.Module, sample_input=None, dtype=None) -> nn.Module: ...

    @abc.abstractmethod
    def optimize_for_training(self, model: nn.Module, optimizer=None, dtype=None): ...


class TensorOpsBackend(BaseBackend):
    """A guide backend on one tensor_ops backend (REGISTRY_NAME). Every model
    call returns what the guide shows; the OptimizationResult of the last one
    is `last_result` (our own prepare_model returns it alongside)."""

    REGISTRY_NAME: str = "cpu"

    def __init__(self, config: Any = None, device_id: int = 0):
        self.config = config
        self._device_id = int(device_id)
        self.last_result: Optional[OptimizationResult] = None
        self._levels: "weakref.WeakKeyDictionary[nn.Module, OptimizationLevel]" = weakref.WeakKeyDictionary()
        self._setup_environment()

    # ---- availability (Note [guide backends are loud, not silent]) ----

    def _setup_environment(self) -> None:
        self._reason = unavailable_reason(self.REGISTRY_NAME)

    def _check_availability(self) -> bool:
        self._reason = unavailable_reason(self.REGISTRY_NAME)
        return self._reason is None

    def _ours(self) -> _factory.Backend:
        if not self._check_availability():
            raise BackendUnavailableError(f"the {self.BACKEND_NAME} backend (tensor_ops {self.REGISTRY_NAME!r}) is "
                                          f"not available here: {self._reason}")
        return _factory.BackendFactory.create(self.REGISTRY_NAME, self._device_id)

    @property
    def is_available(self) -> bool:
        return self._check_availability()

    @property
    def device_count(self) -> int:
        return self._ours().device_count if self.is_available else 0

    @property
    def device(self) -> torch.device:
        return self._ours().device

    @property
    def devices(self) -> List[torch.device]:
        ours = self._ours()
        return [torch.device(ours.device.type, i) if ours.device.type != "cpu" else ours.device
                for i in range(ours.device_count)]

    @property
    def compute_capability(self) -> Optional[str]:
        """The device's compute capability as tensor_ops reports it ("9.0",
        "gfx90a", the CPU's ISA)."""
        return self.get_device_info().compute_capability or None

    # ---- device info ----

    def _get_device_info(self, device_id: int = 0) -> DeviceInfo:
        return self._ours().get_device_info(device_id)

    def get_device_info(self, device_id: Optional[int] = None) -> DeviceInfo:
        return self._get_device_info(self._device_id if device_id is None else int(device_id))

    def get_device_info_dict(self, device_id: Optional[int] = None) -> Dict[str, Any]:
        return self.get_device_info(device_id).to_dict()

    def set_device(self, device_id: int) -> None:
        n = self.device_count
        if not 0 <= int(device_id) < n:
            raise InvalidArgumentError(f"{self.BACKEND_NAME} has {n} device(s); device_id {device_id} is out of range")
        self._device_id = int(device_id)

    # ---- tensors, sync, memory ----

    def to_device(self, obj):
        return self._ours().to_device(obj)

    def synchronize(self) -> None:
        self._ours().synchronize()

    def empty_cache(self) -> None:
        self._ours().empty_cache()

    def get_memory_stats(self) -> Dict[str, Any]:
        """tensor_ops' pool statistics for the device (torch's keys), with
        allocated_gb / reserved_gb and the guide's 'allocated' / 'reserved' /
        'max_allocated' in MiB."""
        ours = self._ours()
        stats = _pool_memory_stats(ours._pool_device())
        stats.update({"allocated": stats["allocated_bytes.all.current"] / _MB,
                      "reserved": stats["reserved_bytes.all.current"] / _MB,
                      "max_allocated": stats["allocated_bytes.all.peak"] / _MB})
        return stats

    def __enter__(self):
        self._scope = self._ours()
        self._scope.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        scope, self._scope = self._scope, None
        try:
            scope.empty_cache()  # the guide: "Cache automatically cleared"
        finally:
            scope.__exit__(*exc)

    # ---- models ----

    def _prepare(self, model: nn.Module, level, how: Callable = _prepare, **kwargs) -> nn.Module:
        level = DEFAULT_LEVEL if level is None else OptimizationLevel.from_string(level)
        model, result = how(model, level, backend=self._ours(), **kwargs)
        self.last_result = OptimizationResult.of(result, model)
        self._levels[model] = level
        return model

    def prepare_model(self, model: nn.Module, optimization_level=None) -> nn.Module:
        """tensor_ops.torch.prepare_model(model, level) on this backend;
        returns the model (the OptimizationResult is self.last_result)."""
        return self._prepare(model, optimization_level)

    def prepare_model_with_custom_kernels(self, model: nn.Module, optimization_level=None) -> nn.Module:
        """prepare_model plus Linear + GELU / SiLU fusion in nn.Sequentials (FusingSequential)."""
        return self._prepare(model, optimization_level, _custom_kernels)

    def _ensure_prepared(self, model: nn.Module) -> nn.Module:
        # A model this backend prepared keeps its level (no second compile).
        if model in self._levels:
            self.last_result = OptimizationResult(True, self._levels[model], [], [], {}, model)
            return model
        return self._prepare(model, None)

    def optimize_for_inference(self, model: nn.Module, sample_input=None, dtype=None) -> nn.Module:
        """eval(), gradients off, `dtype` if given, prepared (once); with
        sample_input the prepared model runs once (a failure is in last_result)."""
        model.eval().requires_grad_(False)
        if dtype is not None:
            model.to(dtype)
        if sample_input is not None and model not in self._levels:
            model = self._prepare(model, None, example_inputs=(self.to_device(sample_input),))
        else:
            model = self._ensure_prepared(model)
        self.last_result.optimizations_applied.insert(0, "inference mode: eval(), requires_grad off"
                                                      + (f", {dtype}" if dtype is not None else ""))
        return model

    def optimize_for_training(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                              dtype=None) -> Union[nn.Module, Tuple[nn.Module, torch.optim.Optimizer]]:
        """train(), `dtype` if given, prepared (once). Without an optimizer,
        the model; with one, (model, optimizer): a default torch Adam / AdamW
        on CPU or CUDA parameters becomes the same optimizer with fused=True
        (same param groups, hyperparameters and state), any other is returned
        as given; last_result.optimizations_applied says which and why."""
        model.train()
        if dtype is not None:
            model.to(dtype)
        model = self._ensure_prepared(model)
        self.last_result.optimizations_applied.insert(0, "training mode: train()")
        if optimizer is None:
            return model
        optimizer, note = fuse_optimizer(optimizer)
        self.last_result.optimizations_applied.append(note)
        _log.info("optimize_for_training: %s", note)
        return model, optimizer

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tensor_ops backend {self.REGISTRY_NAME!r}, available={self.is_available})"


@dataclasses.dataclass(frozen=True)
class OptimizationStrategy:
    name: str
    description: str
    applicable_levels: List[OptimizationLevel]
    # tensor_ops does not estimate speedups: bench/ measures them (None here).
    speedup_estimate: Optional[float] = None


STRATEGIES = [
    OptimizationStrategy("device_placement", "parameters and buffers onto the backend's device",
                         [OptimizationLevel.O0, OptimizationLevel.O1, OptimizationLevel.O2, OptimizationLevel.O3]),
    OptimizationStrategy("fused_modules", "RMSNorm / LayerNorm / SiLU / GELU / gated MLPs onto tensor_ops kernels",
                         [OptimizationLevel.O1, OptimizationLevel.O2, OptimizationLevel.O3]),
    OptimizationStrategy("torch_compile", "Module.compile over the fused modules",
                         [OptimizationLevel.O2, OptimizationLevel.O3]),
    OptimizationStrategy("reduced_precision", "bfloat16 (or float16) weights, inputs cast on entry",
                         [OptimizationLevel.O3]),
]


class BaseOptimizer:
    """The guide's optimizer object: optimize(model, level, sample_input) ->
    (model, OptimizationResult) on one backend."""

    def __init__(self, backend: TensorOpsBackend):
        self.backend = backend

    def optimize(self, model: nn.Module, level=OptimizationLevel.O2, sample_input=None):
        kwargs = {} if sample_input is None else {"example_inputs": (self.backend.to_device(sample_input),)}
        model = self.backend._prepare(model, level, **kwargs)
        return model, self.backend.last_result

    def optimize_legacy(self, model: nn.Module, level=OptimizationLevel.O2, sample_input=None) -> OptimizationResult:
        return self.optimize(model, level, sample_input)[1]

    def get_available_strategies(self) -> List[OptimizationStrategy]:
        return list(STRATEGIES)


def all_backend_info(classes: Dict[str, type]) -> Dict[str, Dict[str, Any]]:
    """{guide name: {'available', 'class', 'reason', 'tensor_ops_backend', 'devices'}}."""
    out = {}
    for name, cls in classes.items():
        reason = unavailable_reason(cls.REGISTRY_NAME)
        devs = [d.to_dict() for d in tensor_ops.devices() if d.backend == _factory._resolve(cls.REGISTRY_NAME)]
        out[name] = {"available": reason is None, "class": cls.__name__, "reason": reason or "",
                     "tensor_ops_backend": cls.REGISTRY_NAME, "devices": devs if reason is None else []}
    return out
