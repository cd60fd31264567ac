"""A user's script calling every public op, checked with `mypy --strict`
(tests/python/test_typing.py): the package is typed (py.typed, annotated
signatures, generated stubs for tensor_ops._C). It also runs."""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

import tensor_ops


def main() -> None:
    rng = np.random.default_rng(0)
    x: npt.NDArray[np.float32] = rng.standard_normal((4, 64)).astype(np.float32)
    w = np.ones(64, np.float32)
    b = np.zeros(64, np.float32)

    y = tensor_ops.rms_norm(x, w, 1e-6)
    tensor_ops.rms_norm(x, w, out=np.empty_like(x))
    tensor_ops.silu(x)
    tensor_ops.gelu(x, "tanh")
    tensor_ops.layer_norm(x, w, b, 1e-5)
    normed, residual = tensor_ops.add_rms_norm(x, x, w)
    dx, dw = tensor_ops.rms_norm_backward(y, x, w)
    dx, dw, db = tensor_ops.layer_norm_backward(y, x, w, bias=True)
    s = tensor_ops.softmax(x, -1, 1.0, causal=False, causal_alignment="top_left")
    tensor_ops.log_softmax(x)
    tensor_ops.softmax_backward(y, s)
    tensor_ops.log_softmax_backward(y, tensor_ops.log_softmax(x))
    tensor_ops.silu_backward(y, x)
    tensor_ops.gelu_backward(y, x, "none")
    tensor_ops.swiglu(x, x)
    tensor_ops.geglu(x, x, "tanh")
    dgate, dup = tensor_ops.swiglu_backward(y, x, x)
    tensor_ops.geglu_backward(y, x, x)

    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    angles = np.outer(np.arange(8), np.ones(8)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    r = tensor_ops.rope(q.transpose(0, 2, 1, 3).copy(), cos, sin)
    tensor_ops.rope_backward(r, cos, sin, np.arange(8, dtype=np.int64), interleaved=False)
    out, lse = tensor_ops.attention(q, q, q, causal=True, return_lse=True)
    dq, dk, dv = tensor_ops.attention_backward(out, q, q, q, out, lse, causal=True)

    target = np.arange(4, dtype=np.int64)
    loss = tensor_ops.cross_entropy(x, target, reduction="sum", label_smoothing=0.1)
    loss, dlogits = tensor_ops.cross_entropy_with_grad(x.copy(), target, inplace=True)
    tensor_ops.fused_linear_cross_entropy(x, rng.standard_normal((10, 64)).astype(np.float32), target)
    tensor_ops.linear(x, rng.standard_normal((10, 64)).astype(np.float32), np.zeros(10, np.float32))
    tensor_ops.linear(x[:1], np.ones((3, 64), np.float32), out=np.empty((1, 3), np.float32))

    names: list[str] = [b.name for b in tensor_ops.backends() if b.usable]
    with tensor_ops.use("cpu"):
        t = tensor_ops.from_numpy(x, device="cpu")
        tensor_ops.silu(t)
    include: str = tensor_ops.get_include()
    cmake: str = tensor_ops.cmake_dir()
    print(names, include, cmake, float(np.asarray(loss).sum()), dq.shape, dk.shape, dv.shape)


if __name__ == "__main__":
    main()
