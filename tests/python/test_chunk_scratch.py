"""The CPU backend reuses each calling thread's chunk scratch across calls,
unzeroed (cpu_backend.cpp, Note [chunk scratch]): a kernel must write every
scratch element before it reads it. Each op runs on clean data, then on data
full of NaN and infinities (which leave such values in the scratch), then on
the clean data again: the second result must equal the first bit for bit."""
import numpy as np
import pytest

import tensor_ops
from tensor_ops import _C

from conftest import np_dtype


def _poison(*arrays):
    out = []
    for a in arrays:
        p = a.copy()
        if p.dtype.kind == "f" or str(p.dtype) == "bfloat16":
            flat = p.reshape(-1)
            flat[0::3] = np.nan
            flat[1::3] = np.inf
            flat[2::3] = -np.inf
        out.append(p)
    return out


def _cases(dt, rng):
    f = np_dtype(dt)

    def r(*shape):
        return rng.standard_normal(shape).astype(f)

    x, res, w, b = r(7, 300), r(7, 300), r(300), r(300)
    target = rng.integers(0, 300, 7)
    cos, sin = r(16, 12), r(16, 12)
    q, k, v = r(1, 8, 1, 40), r(1, 2, 70, 40), r(1, 2, 70, 40)
    qp = r(2, 4, 19, 24)
    kp, vp = r(2, 2, 19, 24), r(2, 2, 19, 24)
    dy = r(7, 300)
    y = tensor_ops.softmax(x)
    return {
        "layer_norm": (lambda x, w, b: tensor_ops.layer_norm(x, w, b), (x, w, b)),
        "add_rms_norm": (lambda x, res, w: tensor_ops.add_rms_norm(x, res, w), (x, res, w)),
        "softmax": (lambda x: tensor_ops.softmax(x), (x,)),
        "softmax_backward": (lambda dy, y: tensor_ops.softmax_backward(dy, y), (dy, y)),
        "cross_entropy": (lambda x: tensor_ops.cross_entropy_with_grad(x, target), (x,)),
        "rope": (lambda x, c, s: tensor_ops.rope(x, c, s), (r(2, 5, 3, 32), cos, sin)),
        "attention decode": (lambda q, k, v: tensor_ops.attention(q, k, v, causal=True), (q, k, v)),
        "attention prefill": (lambda q, k, v: tensor_ops.attention(q, k, v, causal=True), (qp, kp, vp)),
        "rms_norm_backward": (lambda dy, x, w: tensor_ops.rms_norm_backward(dy, x, w), (dy, x, w)),
        "layer_norm_backward": (lambda dy, x, w: tensor_ops.layer_norm_backward(dy, x, w), (dy, x, w)),
    }


def _bits(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [np.asarray(o).copy() for o in outs]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_results_do_not_depend_on_an_earlier_call(dt, threads, rng):
    old = _C.cpu_num_threads()
    _C.cpu_set_num_threads(threads)
    try:
        for name, (fn, args) in _cases(dt, rng).items():
            first = _bits(fn(*args))
            with np.errstate(invalid="ignore", over="ignore"):
                try:
                    fn(*_poison(*args))
                except (ValueError, RuntimeError):
                    pass  # a refusal is fine: only what it leaves behind matters
            again = _bits(fn(*args))
            for a, b in zip(first, again):
                assert a.tobytes() == b.tobytes(), f"{name} {dt}: result changed after a call on NaN / inf data"
    finally:
        _C.cpu_set_num_threads(old)
