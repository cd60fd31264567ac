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


@pytest.mark.skipif("amx" not in _C.cpu_supported_isas(), reason="this CPU (or its kernel) runs no amx level")
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_attention_leaves_torchs_tiles_alone(threads, restore_threads):
    """Our AMX kernels run on torch's OpenMP threads, beside torch's own AMX
    kernels (bf16 SDPA and matmul through oneDNN). torch's results between
    and around our forward and backward calls stay bit for bit what they are
    without them, and nothing faults. torch 2.13's kernels configure their
    tiles on every call, so this would pass even if ours left them released;
    ctest's CpuAmx test checks that ours put a caller's configuration back."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import tensor_ops.torch as tt

    torch.manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    _C.cpu_set_num_threads(threads)
    try:
        q, k, v = (torch.randn(2, 4, 96, 64, dtype=torch.bfloat16) for _ in range(3))
        a, b = torch.randn(128, 256, dtype=torch.bfloat16), torch.randn(256, 192, dtype=torch.bfloat16)

        def torch_side():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True), a @ b

        want = torch_side()
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        for _ in range(3):
            got = torch_side()
            tt.attention(qg, kg, vg, causal=True).float().sum().backward()  # forward and backward on AMX
            got2 = torch_side()
            for w, g, g2 in zip(want, got, got2):
                assert torch.equal(w, g) and torch.equal(w, g2)
    finally:
        torch.set_num_threads(old)
