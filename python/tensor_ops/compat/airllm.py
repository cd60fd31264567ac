"""airllm's tensor_ops module (its backend guide) on tensor_ops:
`from airllm import tensor_ops` becomes
`from tensor_ops.compat import airllm as tensor_ops`, and the per-backend
modules `import tensor_ops_cuda` / `_opencl` / `_cpp` become
`from tensor_ops.compat.airllm import cuda as tensor_ops_cuda` (opencl, cpp).

The guide's workflow scripts are commands here:
    python -m tensor_ops.compat.airllm test_capabilities
    python -m tensor_ops.compat.airllm detect_and_benchmark [--quick]
(see docs/migration.md). numpy only: this module does not import torch."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

import tensor_ops
from tensor_ops import _C
from tensor_ops.errors import BackendUnavailableError


def rms_norm(x, weight, eps: float = 1e-6):
    return tensor_ops.rms_norm(x, weight, eps)


def silu(x):
    return tensor_ops.silu(x)


def gelu(x):
    return tensor_ops.gelu(x)


def get_backend() -> str:
    """The backend host arrays run on now (tensor_ops' name: cuda, hip,
    sycl, opencl, cpu)."""
    return tensor_ops.get_backend()


def _usable() -> List[str]:
    return [b.name for b in sorted(tensor_ops.backends(), key=lambda b: -b.priority) if b.usable]


def get_backend_info() -> Dict[str, Any]:
    """active_backend, available_backends (best first), backend_priority,
    configuration (the environment variables and applied config that steer
    the choice), then everything tensor_ops.get_backend_info() has."""
    config = tensor_ops.get_config()
    return {
        "active_backend": tensor_ops.get_backend(),
        "available_backends": _usable(),
        "backend_priority": [b.name for b in sorted(tensor_ops.backends(), key=lambda b: -b.priority)],
        "configuration": {
            "TENSOR_OPS_BACKEND": os.environ.get("TENSOR_OPS_BACKEND"),
            "TENSOR_OPS_PRIORITY": os.environ.get("TENSOR_OPS_PRIORITY"),
            "TENSOR_OPS_NUM_THREADS": os.environ.get("TENSOR_OPS_NUM_THREADS"),
            "config": None if config is None else config.to_dict(),
        },
        **tensor_ops.get_backend_info(),
    }


def _device_backend_info(name: str) -> Dict[str, Any]:
    info = tensor_ops.backend_info(name)
    if not info["available"]:
        raise BackendUnavailableError(f"{name} is not available here: {info['reason']}")
    return info


def get_cuda_info() -> Dict[str, Any]:
    """tensor_ops.backend_info("cuda"): device_count, devices, device_name,
    compute_capability, total_memory_gb, ... (raises where CUDA is not usable)."""
    return _device_backend_info("cuda")


def get_opencl_info() -> Dict[str, Any]:
    """tensor_ops.backend_info("opencl"), as get_cuda_info."""
    return _device_backend_info("opencl")


def get_optimization_info() -> Dict[str, Any]:
    """The C++ CPU backend's facts: has_simd (a vector ISA beyond the
    baseline is active), has_avx (AVX2 or AVX-512 kernels run: both imply
    AVX; tensor_ops has no AVX-only kernels), has_avx2, has_avx512, has_fma,
    has_openmp (False: tensor_ops parallelises with its own thread pool,
    `threads` of them, TENSOR_OPS_NUM_THREADS), simd_level, supported_isas."""
    info = tensor_ops.backend_info("cpu")
    active = _C.cpu_active_isa()
    return {
        "has_simd": active != "baseline",
        "has_avx": info["has_avx2"] or info["has_avx512"],
        "has_avx2": info["has_avx2"],
        "has_avx512": info["has_avx512"],
        "has_fma": info["has_fma"],
        "has_f16c": info["has_f16c"],
        "has_openmp": False,
        "threads": info["threads"],
        "parallelism": "tensor_ops thread pool (TENSOR_OPS_NUM_THREADS)",
        "simd_level": active,
        "supported_isas": info["supported_isas"],
    }


class BackendModule:
    """airllm's per-backend module (tensor_ops_cuda, ...): the ops pinned to
    one tensor_ops backend (raising if it cannot run here), and its info
    function."""

    def __init__(self, backend: str, info_name: str, info):
        self.backend = backend
        setattr(self, info_name, info)

    def _run(self, op, *args):
        with tensor_ops.use(self.backend):
            return op(*args)

    def rms_norm(self, x, weight, eps: float = 1e-6):
        return self._run(tensor_ops.rms_norm, x, weight, eps)

    def silu(self, x):
        return self._run(tensor_ops.silu, x)

    def gelu(self, x):
        return self._run(tensor_ops.gelu, x)

    def __repr__(self) -> str:
        return f"<airllm backend module on tensor_ops {self.backend!r}>"


cuda = BackendModule("cuda", "get_cuda_info", get_cuda_info)
opencl = BackendModule("opencl", "get_opencl_info", get_opencl_info)
cpp = BackendModule("cpu", "get_optimization_info", get_optimization_info)


def _print_capabilities() -> None:
    print("== Capabilities")
    for b in sorted(tensor_ops.backends(), key=lambda b: -b.priority):
        state = "usable" if b.usable else ("compiled, unusable" if b.compiled else "not compiled")
        print(f"{b.name:8} {state:20} {b.reason or ''}")
    print("optimization info:", json.dumps(get_optimization_info()))
    print("active backend:", get_backend())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensor_ops.compat.airllm",
                                description="airllm's backend workflow scripts on tensor_ops")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("test_capabilities", help="what tensor_ops was built with and can use here")
    bench = sub.add_parser("detect_and_benchmark",
                           help="detect, show the build, test every usable backend against numpy float64, benchmark")
    bench.add_argument("--quick", action="store_true", help="small shape, few repetitions")
    args = p.parse_args(argv)
    _print_capabilities()
    if args.command == "test_capabilities":
        return 0
    from tensor_ops import __main__ as check  # the correctness table and benchmark of `python -m tensor_ops`

    print("\n== Build: tensor_ops is built once by `pip install .` with every backend whose toolkit was found "
          "(compiled column above); no per-backend build step")
    return check.main(["--quick"] if args.quick else [])


if __name__ == "__main__":
    sys.exit(main())
