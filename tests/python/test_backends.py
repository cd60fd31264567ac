"""Backends, devices and selection."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tensor_ops


def run_py(code, **env):
    e = {k: v for k, v in os.environ.items() if k != "TENSOR_OPS_BACKEND"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)


def test_backends_lists_every_backend():
    bs = {b.name: b for b in tensor_ops.backends()}
    assert {"cpu", "cuda", "hip", "sycl", "opencl"} <= set(bs) and ({"xla", "tpu"} & set(bs))
    assert bs["cpu"].compiled and bs["cpu"].usable and bs["cpu"].reason == ""
    # The CPU backend has a kernel for every op; ops of a backend that is not compiled: none.
    cpu_ops = set(bs["cpu"].ops)
    assert len(cpu_ops) == 17 and {"rms_norm", "attention_backward", "cross_entropy", "linear"} <= cpu_ops
    for b in bs.values():
        if not b.usable:
            assert b.reason, f"{b.name} unusable without a reason"
        if not b.compiled:
            assert b.ops == ()
        assert set(b.ops) <= set(bs["cpu"].ops)
        assert set(b.to_dict()) == {"name", "compiled", "usable", "reason", "priority", "library", "ops"}


def test_devices_have_cpu_with_isa():
    ds = tensor_ops.devices()
    cpu = [d for d in ds if d.backend == "cpu"]
    assert len(cpu) == 1
    d = cpu[0]
    assert d.device_type == "cpu" and d.is_available and d.device_name
    assert d.total_memory_bytes > 1 << 28
    assert d.properties["isa"] in ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
    assert d.compute_capability == d.properties["isa"]
    dd = d.to_dict()
    for key in ["backend", "device_type", "device_id", "device_name", "total_memory_bytes",
                "compute_capability", "driver_version", "is_available", "properties"]:
        assert key in dd
    json.dumps(dd)


def test_get_backend_and_info():
    assert tensor_ops.get_backend() == "cpu"
    info = tensor_ops.get_backend_info()
    assert info["backend"] == "cpu"
    assert info["cpu"]["num_threads"] >= 1
    assert info["cpu"]["isa"] in info["cpu"]["supported_isas"]


def test_set_backend_and_use():
    tensor_ops.set_backend("cpu")
    assert tensor_ops.get_backend() == "cpu"
    tensor_ops.set_backend(None)
    with tensor_ops.use("cpu") as name:
        assert name == "cpu" and tensor_ops.get_backend() == "cpu"
    with tensor_ops.use("auto"):
        assert tensor_ops.get_backend() == "cpu"
    with pytest.raises(ValueError, match="valid backends: .*cpu"):
        tensor_ops.set_backend("nonexistent")
    with pytest.raises(ValueError):
        with tensor_ops.use("nonexistent"):
            pass
    # A plugin backend this machine cannot use (sycl is usable where its runtime is installed).
    usable = {b.name: b.usable for b in tensor_ops.backends()}
    unusable = [n for n in ("sycl", "cuda", "hip", "opencl") if not usable.get(n, True)]
    if unusable:
        with pytest.raises(RuntimeError, match="not (available|usable)"):  # not compiled, or no device
            tensor_ops.set_backend(unusable[0])
    assert tensor_ops.get_backend() == "cpu"


def test_env_backend_nonexistent_is_clear():
    r = run_py("import numpy as np, tensor_ops\n"
               "tensor_ops.silu(np.ones(4, np.float32))", TENSOR_OPS_BACKEND="nonexistent")
    assert r.returncode != 0
    assert "unknown backend 'nonexistent'" in r.stderr and "cpu" in r.stderr


def test_env_backend_cpu_and_priority():
    code = "import tensor_ops; print(tensor_ops.get_backend())"
    r = run_py(code, TENSOR_OPS_BACKEND="cpu")
    assert r.stdout.strip().endswith("cpu"), r.stderr
    usable = {b.name for b in tensor_ops.backends() if b.usable}
    r = run_py(code, TENSOR_OPS_PRIORITY="opencl,cpu")  # the first usable one in the list wins
    assert r.stdout.strip().endswith("opencl" if "opencl" in usable else "cpu"), r.stderr
    r = run_py(code, TENSOR_OPS_PRIORITY="cpu,opencl")
    assert r.stdout.strip().endswith("cpu"), r.stderr
    r = run_py(code, TENSOR_OPS_PRIORITY="cpu,bogus")
    assert r.returncode != 0 and "bogus" in r.stderr  # a typo anywhere is an error
    r = run_py(code, TENSOR_OPS_PRIORITY="bogus,cpu")
    assert r.returncode != 0 and "bogus" in r.stderr


def test_num_threads_env():
    r = run_py("import tensor_ops; print(tensor_ops.get_backend_info()['cpu']['num_threads'])",
               TENSOR_OPS_NUM_THREADS="1")
    assert r.stdout.strip().splitlines()[-1] == "1", r.stderr
    r = run_py("import numpy as np, tensor_ops\nx=np.random.rand(64,4096).astype(np.float32)\n"
               "print(abs(tensor_ops.silu(x) - x/(1+np.exp(-x))).max() < 1e-5)", TENSOR_OPS_NUM_THREADS="3")
    assert r.stdout.strip().splitlines()[-1] == "True", r.stderr


def test_cpu_isa_env():
    r = run_py("import tensor_ops; print(tensor_ops._C.cpu_active_isa())", TENSOR_OPS_CPU_ISA="baseline")
    assert r.stdout.strip().splitlines()[-1] == "baseline", r.stderr


def test_cpu_set_isa_errors():
    with pytest.raises(ValueError, match="unknown CPU ISA"):
        tensor_ops._C.cpu_set_isa("sse9")
    if "avx512" not in tensor_ops._C.cpu_supported_isas():
        with pytest.raises(NotImplementedError, match="cannot run"):
            tensor_ops._C.cpu_set_isa("avx512")


def test_cli_main_job():
    r = subprocess.run([sys.executable, "-m", "tensor_ops", "--quick", "--no-compile"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Devices" in out and "Selected backend: cpu" in out
    for op in ["rms_norm", "silu", "gelu"]:
        assert op in out
    assert "FAIL" not in out
