"""The streaming-store paths (used for outputs larger than the caches) give
bit-identical results: a child process with TENSOR_OPS_STREAM_BYTES=1 takes
them for every size and must match this process (threshold 16 MiB)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import tensor_ops as to
from conftest import ml_dtypes

CHILD = r"""
import sys, numpy as np, tensor_ops as to
try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
out = {}
rng = np.random.default_rng(7)
dts = ["float32", "float16"] + (["bfloat16"] if ml_dtypes else [])
for dt in dts:
    npdt = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)
    for cols in (1, 7, 513, 4099):
        x = rng.standard_normal((5, cols)).astype(np.float32).astype(npdt)
        r = rng.standard_normal((5, cols)).astype(np.float32).astype(npdt)
        w = rng.standard_normal(cols).astype(np.float32).astype(npdt)
        t = rng.integers(0, cols, size=5)
        k = f"{dt}_{cols}_"
        out[k + "rms"] = to.rms_norm(x, w)
        out[k + "silu"] = to.silu(x)
        out[k + "gelu"] = to.gelu(x)
        out[k + "gelu_tanh"] = to.gelu(x, "tanh")
        y, res = to.add_rms_norm(x, r, w)
        out[k + "arn_y"], out[k + "arn_r"] = y, res
        out[k + "softmax"] = to.softmax(x)
        out[k + "swiglu"] = to.swiglu(x, r)
        out[k + "ce_grad"] = to.cross_entropy_with_grad(x, t)[1]
np.savez(sys.argv[1], **{k: v.view(np.uint8) for k, v in out.items()})
"""


def run_child(tmp_path, name, stream_bytes):
    env = dict(os.environ, TENSOR_OPS_STREAM_BYTES=str(stream_bytes))
    path = tmp_path / f"{name}.npz"
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return np.load(path)


def test_streaming_stores_match(tmp_path):
    regular = run_child(tmp_path, "regular", 0)  # 0 turns streaming off
    streamed = run_child(tmp_path, "streamed", 1)
    assert set(regular.files) == set(streamed.files) and len(regular.files) > 50
    for k in regular.files:
        np.testing.assert_array_equal(regular[k], streamed[k], err_msg=k)
