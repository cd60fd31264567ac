"""TensorOpsConfig: one object for the settings the seed guides spread over
flags, with presets (for_training / for_inference / for_development), a TOML
file and environment variables as alternatives.

Every field is applied by TensorOpsConfig.apply() and changes what runs; a
field left None leaves that setting as it is.

    backend                   set_backend(name); an unknown name raises, listing the valid ones
    cpu.threads               resizes the CPU kernels' thread pool (tensor_ops' own, not torch's)
    cuda.memory_fraction      set_memory_fraction() on every CUDA device's pool
    cuda.allow_tf32           torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    cuda.cudnn_benchmark      torch.backends.cudnn.benchmark
    opencl.platform           OpenCL device choice: the first device whose platform name contains this
    opencl.device             ... or the device index among those (the chosen "opencl:N" becomes the
                              default device of empty / zeros / from_numpy / allocate_tensor while the
                              active backend is opencl; host arrays still run on opencl:0)
    opencl.cache_dir          TENSOR_OPS_CACHE_DIR, the plugin's binary cache (the plugin reads it once,
                              on its first device query or build: apply() raises if it was read already)
    tpu.precision             jax_default_matmul_precision, which the XLA shim's matmuls then use
                              ("highest" / "float32", "high" / "tensorfloat32", "default" / "bfloat16")
    memory.pool_max_cached_mb / pool_max_cached_tensors
                              the bound of each named tensor pool (tensor_ops.pools)

Precedence (load()): explicit keyword arguments > environment variables >
the TOML file (the `path` argument, else $TENSOR_OPS_CONFIG) > the preset
(`preset=`) > None (leave as is). Environment variables:
TENSOR_OPS_BACKEND, TENSOR_OPS_NUM_THREADS, TENSOR_OPS_CACHE_DIR (the names
the core and plugins already read) and TENSOR_OPS_<SECTION>_<FIELD> for the
rest (TENSOR_OPS_CUDA_MEMORY_FRACTION, TENSOR_OPS_OPENCL_PLATFORM, ...).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Dict, List, Mapping, Optional

from . import _C
from .errors import InvalidArgumentError, TensorOpsError


@dataclasses.dataclass
class CPUConfig:
    threads: Optional[int] = None


@dataclasses.dataclass
class CUDAConfig:
    memory_fraction: Optional[float] = None
    allow_tf32: Optional[bool] = None
    cudnn_benchmark: Optional[bool] = None


@dataclasses.dataclass
class OpenCLConfig:
    platform: Optional[str] = None
    device: Optional[int] = None
    cache_dir: Optional[str] = None


@dataclasses.dataclass
class TPUConfig:
    precision: Optional[str] = None


@dataclasses.dataclass
class MemoryConfig:
    pool_max_cached_mb: Optional[int] = None
    pool_max_cached_tensors: Optional[int] = None


_SECTIONS = {"cpu": CPUConfig, "cuda": CUDAConfig, "opencl": OpenCLConfig, "tpu": TPUConfig, "memory": MemoryConfig}
# Environment variables the core / plugins already read, by field.
_ENV_NAMES = {("", "backend"): "TENSOR_OPS_BACKEND", ("cpu", "threads"): "TENSOR_OPS_NUM_THREADS",
              ("opencl", "cache_dir"): "TENSOR_OPS_CACHE_DIR"}
_PRECISIONS = {"highest": "highest", "float32": "highest", "high": "high", "tensorfloat32": "high",
               "bfloat16_3x": "high", "default": "default", "bfloat16": "default", "fastest": "default"}


def _env_name(section: str, field: str) -> str:
    return _ENV_NAMES.get((section, field)) or f"TENSOR_OPS_{section.upper()}_{field.upper()}"


def _parse(text: str, typ: str, where: str):
    try:
        if "bool" in typ:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if "int" in typ:
            return int(text)
        if "float" in typ:
            return float(text)
        return text
    except ValueError:
        raise InvalidArgumentError(f"{where}: cannot read {text!r} as {typ}") from None


def _check_type(where: str, value, typ: str) -> None:
    """A field's value of its declared type (bool, int, float or str): a
    TypeError naming it otherwise."""
    from . import _checks

    if "bool" in typ:
        _checks.flag(where, value)
    elif "int" in typ:
        _checks.integer(where, value)
    elif "float" in typ:
        _checks.real(where, value)
    elif "str" in typ and not isinstance(value, str):
        raise TypeError(f"{where} must be a str, got {type(value).__name__} {value!r}")


@dataclasses.dataclass
class TensorOpsConfig:
    backend: Optional[str] = None
    cpu: CPUConfig = dataclasses.field(default_factory=CPUConfig)
    cuda: CUDAConfig = dataclasses.field(default_factory=CUDAConfig)
    opencl: OpenCLConfig = dataclasses.field(default_factory=OpenCLConfig)
    tpu: TPUConfig = dataclasses.field(default_factory=TPUConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)

    # ---- presets

    @classmethod
    def for_training(cls) -> "TensorOpsConfig":
        """TF32 matmuls and cuDNN autotuning on, 90% of GPU memory, XLA
        matmuls in bf16x3 ("high"), 1 GiB per named pool."""
        return cls(cuda=CUDAConfig(memory_fraction=0.9, allow_tf32=True, cudnn_benchmark=True),
                   tpu=TPUConfig(precision="high"), memory=MemoryConfig(pool_max_cached_mb=1024))

    @classmethod
    def for_inference(cls) -> "TensorOpsConfig":
        """As training, with XLA matmuls at the device default (bf16 on TPU)
        and 2 GiB per named pool (activation buffers are reused more)."""
        return cls(cuda=CUDAConfig(memory_fraction=0.9, allow_tf32=True, cudnn_benchmark=True),
                   tpu=TPUConfig(precision="default"), memory=MemoryConfig(pool_max_cached_mb=2048))

    @classmethod
    def for_development(cls) -> "TensorOpsConfig":
        """Reproducible numbers: no TF32, no cuDNN autotuning, full fp32 XLA
        matmuls; half the GPU memory and small pools, to share the machine."""
        return cls(cuda=CUDAConfig(memory_fraction=0.5, allow_tf32=False, cudnn_benchmark=False),
                   tpu=TPUConfig(precision="highest"),
                   memory=MemoryConfig(pool_max_cached_mb=256, pool_max_cached_tensors=16))

    # ---- building

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def merged(self, values: Mapping[str, Any], where: str = "overrides") -> "TensorOpsConfig":
        """A copy with `values` ({"backend": ..., "cuda": {"allow_tf32": ...}})
        laid over it; None values do not override. Unknown keys raise."""
        out = dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s)) for s in _SECTIONS})
        for key, value in values.items():
            if key == "backend":
                if value is not None:
                    out.backend = str(value)
            elif key in _SECTIONS:
                if not isinstance(value, Mapping):
                    raise InvalidArgumentError(f"{where}: [{key}] must be a table, got {value!r}")
                section = getattr(out, key)
                fields = {f.name: f for f in dataclasses.fields(section)}
                for fk, fv in value.items():
                    if fk not in fields:
                        raise InvalidArgumentError(
                            f"{where}: unknown field {key}.{fk}; valid: {', '.join(sorted(fields))}")
                    if fv is not None:
                        if isinstance(fv, str) and fields[fk].type != "Optional[str]":
                            fv = _parse(fv, fields[fk].type, f"{where} {key}.{fk}")
                        setattr(section, fk, fv)
            else:
                raise InvalidArgumentError(
                    f"{where}: unknown key {key!r}; valid: backend, {', '.join(sorted(_SECTIONS))}")
        out.validate()
        return out

    @classmethod
    def from_file(cls, path, base: Optional["TensorOpsConfig"] = None) -> "TensorOpsConfig":
        """`base` (default: all None) with a TOML file laid over it."""
        import tomllib

        with open(path, "rb") as f:
            data = tomllib.load(f)
        return (base or cls()).merged(data, where=str(path))

    @classmethod
    def from_env(cls, base: Optional["TensorOpsConfig"] = None, environ: Optional[Mapping[str, str]] = None
                 ) -> "TensorOpsConfig":
        """`base` with every set environment variable laid over it."""
        env = os.environ if environ is None else environ
        values: Dict[str, Any] = {}
        if env.get(_env_name("", "backend")):
            values["backend"] = env[_env_name("", "backend")]
        for section, cls_ in _SECTIONS.items():
            for f in dataclasses.fields(cls_):
                name = _env_name(section, f.name)
                if env.get(name):
                    values.setdefault(section, {})[f.name] = _parse(env[name], f.type, name)
        return (base or cls()).merged(values, where="environment")

    @classmethod
    def load(cls, path=None, *, preset: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
             **overrides) -> "TensorOpsConfig":
        """preset ("training" / "inference" / "development") < TOML file
        (`path`, else $TENSOR_OPS_CONFIG) < environment < overrides."""
        env = os.environ if environ is None else environ
        presets = {"training": cls.for_training, "inference": cls.for_inference, "development": cls.for_development}
        if preset is not None and preset not in presets:
            raise InvalidArgumentError(f"unknown preset {preset!r}; valid: {', '.join(presets)}")
        config = presets[preset]() if preset else cls()
        path = path if path is not None else env.get("TENSOR_OPS_CONFIG") or None
        if path is not None:
            config = cls.from_file(path, base=config)
        config = cls.from_env(base=config, environ=env)
        return config.merged(overrides)

    def validate(self) -> None:
        """Checks values and names (backend, precision) before anything is applied."""
        if self.backend is not None and self.backend != "auto":
            from .xla import NAMES as xla_names  # the XLA shim's names, routed by set_backend where supported

            known = [b["name"] for b in _C.backends()] + [n for n in xla_names if n not in {b["name"] for b in _C.backends()}]
            if self.backend not in known:
                raise InvalidArgumentError(
                    f"unknown backend {self.backend!r}; valid backends: auto, {', '.join(known)}")
        for section in _SECTIONS:  # by type, never converted (threads=2.5 ran 2 threads, True 1)
            part = getattr(self, section)
            for f in dataclasses.fields(part):
                v = getattr(part, f.name)
                if v is not None:
                    _check_type(f"{section}.{f.name}", v, str(f.type))
        if self.cpu.threads is not None and not 1 <= int(self.cpu.threads) <= 1024:
            raise InvalidArgumentError(f"cpu.threads must be in 1..1024, got {self.cpu.threads}")
        f = self.cuda.memory_fraction
        if f is not None and not 0.0 < float(f) <= 1.0:
            raise InvalidArgumentError(f"cuda.memory_fraction must be in (0, 1], got {f}")
        if self.tpu.precision is not None and self.tpu.precision not in _PRECISIONS:
            raise InvalidArgumentError(
                f"tpu.precision {self.tpu.precision!r} is not one of {', '.join(_PRECISIONS)}")
        if self.opencl.device is not None and int(self.opencl.device) < 0:
            raise InvalidArgumentError(f"opencl.device must be >= 0, got {self.opencl.device}")
        for name in ("pool_max_cached_mb", "pool_max_cached_tensors"):
            v = getattr(self.memory, name)
            if v is not None and int(v) < 0:
                raise InvalidArgumentError(f"memory.{name} must be >= 0, got {v}")

    # ---- applying

    def opencl_device(self) -> Optional[str]:
        """"opencl:N" for opencl.platform / opencl.device (None when neither
        is set); no matching device raises, listing the devices there are."""
        oc = self.opencl
        if oc.platform is None and oc.device is None:
            return None
        from .backends import devices

        found = [d for d in devices() if d.backend == "opencl"]
        listing = "; ".join(f"opencl:{d.device_id} {d.device_name} (platform {d.properties.get('platform', '?')})"
                            for d in found) or "none (OpenCL is not usable here)"
        matching = [d for d in found if oc.platform is None
                    or oc.platform.lower() in d.properties.get("platform", "").lower()]
        index = 0 if oc.device is None else int(oc.device)
        if index >= len(matching):
            raise InvalidArgumentError(
                f"no OpenCL device {index} on a platform matching {oc.platform!r}; devices: {listing}")
        return f"opencl:{matching[index].device_id}"

    def apply(self) -> List[str]:
        """Applies every field that is set; returns what it did, one line each."""
        global _applied
        self.validate()
        # The process-wide switches are put back if a later field fails (an
        # OpenCL device that does not exist): a failed apply() changes nothing
        # it set before (it left the backend switched and the pool resized).
        from .backends import last_set_backend, set_backend

        backend_before, threads_before = last_set_backend(), _C.cpu_num_threads()
        try:
            return self._apply_all()
        except BaseException:
            if self.backend is not None:
                set_backend(backend_before)
            _C.cpu_set_num_threads(threads_before)
            raise

    def _apply_all(self) -> List[str]:
        global _applied
        done: List[str] = []
        if self.backend is not None:
            from .backends import set_backend

            set_backend(self.backend)
            done.append(f"backend: set_backend({self.backend!r})")
        if self.cpu.threads is not None:
            _C.cpu_set_num_threads(int(self.cpu.threads))
            done.append(f"cpu.threads: {_C.cpu_num_threads()} CPU kernel threads")
        done += self._apply_cuda()
        done += self._apply_opencl()
        done += self._apply_tpu()
        if self.memory.pool_max_cached_mb is not None or self.memory.pool_max_cached_tensors is not None:
            from . import pools

            mb, n = self.memory.pool_max_cached_mb, self.memory.pool_max_cached_tensors
            if mb is not None:
                pools.POOL_MAX_CACHED_BYTES = int(mb) << 20
            if n is not None:
                pools.POOL_MAX_CACHED_TENSORS = int(n)
            for pool_id in pools.pool_stats():
                pools.set_pool_limits(pool_id, None if mb is None else int(mb) << 20, n)
            done.append(f"memory: named pools cache at most {pools.POOL_MAX_CACHED_BYTES} bytes, "
                        f"{pools.POOL_MAX_CACHED_TENSORS} tensors")
        _applied = self
        return done

    def _apply_cuda(self) -> List[str]:
        done = []
        c = self.cuda
        if c.memory_fraction is not None:
            from .backends import devices

            cuda = [d for d in devices() if d.backend == "cuda"]
            from .memory import set_memory_fraction

            for d in cuda:
                set_memory_fraction(float(c.memory_fraction), f"cuda:{d.device_id}")
            done.append(f"cuda.memory_fraction: {c.memory_fraction} on {len(cuda)} CUDA device(s)"
                        + ("" if cuda else " (CUDA is not usable here: nothing to limit)"))
        if c.allow_tf32 is not None or c.cudnn_benchmark is not None:
            try:
                import torch
            except ImportError:
                return done + ["cuda.allow_tf32 / cudnn_benchmark: torch is not installed, nothing to set"]
            if c.allow_tf32 is not None:
                torch.backends.cuda.matmul.allow_tf32 = bool(c.allow_tf32)
                torch.backends.cudnn.allow_tf32 = bool(c.allow_tf32)
                done.append(f"cuda.allow_tf32: torch.backends.cuda.matmul / cudnn allow_tf32 = {c.allow_tf32}")
            if c.cudnn_benchmark is not None:
                torch.backends.cudnn.benchmark = bool(c.cudnn_benchmark)
                done.append(f"cuda.cudnn_benchmark: torch.backends.cudnn.benchmark = {c.cudnn_benchmark}")
        return done

    def _apply_opencl(self) -> List[str]:
        done = []
        oc = self.opencl
        if oc.cache_dir is not None:
            want = os.path.join(os.path.abspath(oc.cache_dir), "opencl")
            os.environ["TENSOR_OPS_CACHE_DIR"] = os.path.abspath(oc.cache_dir)
            from .backends import devices

            seen = {d.properties.get("binary_cache_dir") for d in devices() if d.backend == "opencl"}
            seen.discard(None)
            if seen and seen != {want}:
                raise TensorOpsError(
                    f"opencl.cache_dir: the OpenCL plugin already uses {', '.join(sorted(seen))} (it reads "
                    f"TENSOR_OPS_CACHE_DIR once, at its first device query); set cache_dir in the config file "
                    f"or the environment, or apply the config before any OpenCL use")
            done.append(f"opencl.cache_dir: TENSOR_OPS_CACHE_DIR={os.environ['TENSOR_OPS_CACHE_DIR']}")
        dev = self.opencl_device()
        if dev is not None:
            done.append(f"opencl.platform / device: {dev} is the default device while opencl is active")
        self._opencl_device = dev
        return done

    def _apply_tpu(self) -> List[str]:
        if self.tpu.precision is None:
            return []
        value = _PRECISIONS[self.tpu.precision]
        if "jax" not in sys.modules:
            try:
                import jax  # noqa: F401
            except ImportError:
                return [f"tpu.precision: jax is not installed, nothing to set"]
        sys.modules["jax"].config.update("jax_default_matmul_precision", value)
        return [f"tpu.precision: jax_default_matmul_precision = {value!r}"]


_applied: Optional[TensorOpsConfig] = None


def get_config() -> Optional[TensorOpsConfig]:
    """The config last applied (None if none was)."""
    return _applied


def default_device() -> Optional[str]:
    """The applied config's OpenCL device while opencl is the active backend, else None."""
    cfg = _applied
    dev = getattr(cfg, "_opencl_device", None) if cfg is not None else None
    if dev is None:
        return None
    from .backends import get_backend

    return dev if get_backend() == "opencl" else None


def configure(path=None, *, preset: Optional[str] = None, **overrides) -> TensorOpsConfig:
    """TensorOpsConfig.load(path, preset=preset, **overrides).apply(); returns the config."""
    cfg = TensorOpsConfig.load(path, preset=preset, **overrides)
    cfg.apply()
    return cfg


__all__ = ["TensorOpsConfig", "CPUConfig", "CUDAConfig", "OpenCLConfig", "TPUConfig", "MemoryConfig",
           "get_config", "default_device", "configure"]
