"""Calls mypy --strict must flag (tests/python/test_typing.py expects one
error per line marked `# E`)."""
from __future__ import annotations

import numpy as np

import tensor_ops

x = np.ones((2, 8), np.float32)
tensor_ops.gelu(x, "fast")  # E: not an approximation
tensor_ops.rms_norm(x, x, eps="1e-6")  # E: eps is a float
tensor_ops.softmax(x, dim="last")  # E: dim is an int
tensor_ops.cross_entropy(x, x, reduction="average")  # E: not a reduction
tensor_ops.silu(x, x)  # E: out is keyword-only
name: int = tensor_ops.get_backend()  # E: a str
