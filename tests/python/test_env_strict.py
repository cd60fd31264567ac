"""Malformed TENSOR_OPS_* environment variables (issue 17, item 8): each is
reported once at import through the "tensor_ops" logger, naming the variable,
the bad value and the value used instead; ops still run. Each case imports
tensor_ops in a fresh interpreter (the core reads the variables once)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = r"""
import json
import logging
records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.name, record.levelname, record.getMessage()))

logging.getLogger("tensor_ops").addHandler(Keep())
import numpy as np
import tensor_ops
x = np.linspace(-4, 4, 1 << 18, dtype=np.float32)
ok = bool(np.allclose(tensor_ops.silu(x), x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5, atol=1e-6))
print(json.dumps({"records": records, "threads": tensor_ops._C.cpu_num_threads(),
                  "isa": tensor_ops._C.cpu_active_isa(), "best_isa": tensor_ops._C.cpu_supported_isas()[-1],
                  "cpus": len(__import__("os").sched_getaffinity(0)), "op_ok": ok}))
"""


def _import_with(**env):
    e = {k: v for k, v in os.environ.items() if k not in ("TENSOR_OPS_NUM_THREADS", "TENSOR_OPS_CPU_ISA")}
    e.update(env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], capture_output=True, text=True, env=e,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["op_ok"], "silu gave a wrong answer"
    return out


def _warnings(out):
    return [m for name, level, m in out["records"] if name == "tensor_ops" and level == "WARNING"]


@pytest.mark.parametrize("value", ["0", "-1", "garbage", "4abc", "4 ", "2.5", "99999999999999999999999", "-99999999999999999999999"])
def test_bad_num_threads_warns_and_uses_the_cpu_count(value):
    out = _import_with(TENSOR_OPS_NUM_THREADS=value)
    assert out["threads"] == out["cpus"], f"{value!r} must not set the thread count"
    w = [m for m in _warnings(out) if "TENSOR_OPS_NUM_THREADS" in m]
    assert len(w) == 1, _warnings(out)
    assert f"TENSOR_OPS_NUM_THREADS='{value}'" in w[0] and "whole number from 1 to 1024" in w[0], w[0]
    assert f"using {out['cpus']} (the CPUs this process may run on) instead" in w[0], w[0]


def test_num_threads_above_the_limit_warns_and_uses_the_limit():
    out = _import_with(TENSOR_OPS_NUM_THREADS="5000")
    assert out["threads"] == 1024
    w = _warnings(out)
    assert len(w) == 1 and "TENSOR_OPS_NUM_THREADS='5000' is above the limit of 1024" in w[0], w
    assert "using 1024 instead" in w[0], w[0]


@pytest.mark.parametrize("value", ["3", "1", ""])
def test_good_or_empty_num_threads_is_silent(value):
    out = _import_with(TENSOR_OPS_NUM_THREADS=value)
    assert out["threads"] == (int(value) if value else out["cpus"])
    assert _warnings(out) == []


def test_bad_cpu_isa_warns_and_uses_the_best_level():
    out = _import_with(TENSOR_OPS_CPU_ISA="garbage")
    assert out["isa"] == out["best_isa"]
    w = _warnings(out)
    assert len(w) == 1, w
    assert "TENSOR_OPS_CPU_ISA='garbage' is not usable (unknown CPU ISA level 'garbage'" in w[0], w[0]
    assert f"using '{out['best_isa']}' (the best level this CPU runs) instead" in w[0], w[0]


@pytest.mark.parametrize("value", ["baseline", "auto"])
def test_good_cpu_isa_is_silent(value):
    out = _import_with(TENSOR_OPS_CPU_ISA=value)
    assert out["isa"] == (out["best_isa"] if value == "auto" else value)
    assert _warnings(out) == []


@pytest.mark.parametrize("value", ["16M", "lots", "1e6", "4096 "])
def test_bad_stream_bytes_warns_and_keeps_the_default(value):
    out = _import_with(TENSOR_OPS_STREAM_BYTES=value)
    w = [m for m in _warnings(out) if "TENSOR_OPS_STREAM_BYTES" in m]
    assert len(w) == 1, _warnings(out)
    assert f"TENSOR_OPS_STREAM_BYTES='{value}' is not a whole number of bytes; using 16777216 instead" in w[0], w[0]


@pytest.mark.parametrize("value", ["0", "1048576", ""])
def test_good_stream_bytes_is_silent(value):
    assert _import_with(TENSOR_OPS_STREAM_BYTES=value)["op_ok"]
    assert [m for m in _warnings(_import_with(TENSOR_OPS_STREAM_BYTES=value)) if "STREAM" in m] == []


@pytest.mark.parametrize("value", ["50us", "-1", "100001", "2.5"])
def test_bad_spin_us_warns_and_keeps_the_default(value):
    out = _import_with(TENSOR_OPS_SPIN_US=value)
    w = [m for m in _warnings(out) if "TENSOR_OPS_SPIN_US" in m]
    assert len(w) == 1, _warnings(out)
    assert f"TENSOR_OPS_SPIN_US='{value}' is not a whole number from 0 to 100000; using 50 instead" in w[0], w[0]


@pytest.mark.parametrize("value", ["0", "200", ""])
def test_good_spin_us_is_silent_and_ops_stay_correct(value):
    out = _import_with(TENSOR_OPS_SPIN_US=value, TENSOR_OPS_NUM_THREADS="2")
    assert out["op_ok"] and [m for m in _warnings(out) if "SPIN" in m] == []
