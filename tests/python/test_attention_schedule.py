"""The CPU attention backward has two schedules (attention_flash.h): fused,
one (batch, kv head) item per thread with five tile products, and two phases
(dK / dV per key tile, then dQ per row tile) when there are fewer items than
threads. The choice depends on the thread count; the results must not."""
import numpy as np
import pytest

import tensor_ops as to
from conftest import np_dtype
from tensor_ops import _C


# (batch, q heads, kv heads, Lq, Lk, head_dim): odd sizes, GQA, Lq != Lk,
# several row / key tiles, head_dim not a multiple of 16
SHAPES = [(1, 4, 1, 37, 53, 24), (2, 6, 2, 100, 70, 64), (1, 2, 2, 5, 130, 16), (3, 3, 3, 50, 50, 8),
          (1, 1, 1, 1, 200, 1)]


@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_backward_same_bits_at_any_thread_count(shape, causal, dtype, restore_threads):
    B, Hq, Hkv, Lq, Lk, D = shape
    rng = np.random.default_rng(7)
    npd = np_dtype(dtype)
    q, do = (rng.standard_normal((B, Hq, Lq, D)).astype(npd) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, Lk, D)).astype(npd) for _ in range(2))
    al = "top_left" if causal == "top_left" else "bottom_right"
    out, lse = to.attention(q, k, v, causal=bool(causal), return_lse=True, causal_alignment=al)
    results = {}
    # 1 thread: fused; more threads than (batch x kv heads) items: two phases
    for threads in [1, 2, 3, 16]:
        _C.cpu_set_num_threads(threads)
        results[threads] = [np.asarray(g).view(np.uint16 if dtype == "bfloat16" else np.uint32)
                            for g in to.attention_backward(do, q, k, v, out, lse, causal=bool(causal),
                                                           causal_alignment=al)]
    for threads, grads in results.items():
        for name, a, b in zip(["dq", "dk", "dv"], results[1], grads):
            assert np.array_equal(a, b), f"{name} differs between 1 and {threads} threads, shape {shape}"
