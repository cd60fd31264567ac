"""With torch loaded, the CPU pool runs its parallel regions on torch's
OpenMP threads (Note [torch's OpenMP threads], cpp/cpu/thread_pool.cpp):
same chunks, same results; off in a forked child and with
TENSOR_OPS_TORCH_OPENMP=0."""
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensor_ops  # noqa: E402
from tensor_ops import _C  # noqa: E402
from tensor_ops import _arrays  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


@pytest.fixture
def two_threads():
    old = _C.cpu_num_threads()
    _C.cpu_set_num_threads(2)
    yield
    _C.cpu_set_num_threads(old)


def _outputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1000, generator=g)
    w = torch.rand(1000, generator=g) + 0.5
    q, k, v = (torch.randn(1, 4, 100, 32, generator=g) for _ in range(3))
    return [tensor_ops.silu(x), tensor_ops.softmax(x), tensor_ops.layer_norm(x, w, w), tensor_ops.rms_norm(x, w),
            *tensor_ops.rms_norm_backward(x, x, w), tensor_ops.attention(q, k, v, causal=True)]


def test_torch_threads_are_used_and_results_do_not_change(two_threads):
    tensor_ops.silu(torch.ones(3))  # the first torch tensor turns it on
    if not _arrays._torch_gomp()[0]:
        pytest.skip("this torch build has no libgomp of its own")
    assert _C.cpu_uses_openmp()
    on = _outputs()
    _C.cpu_set_openmp(0)
    try:
        assert not _C.cpu_uses_openmp()
        off = _outputs()
    finally:
        assert _arrays.use_torch_openmp()
    for a, b in zip(on, off):
        assert torch.equal(a, b)
    assert _C.cpu_uses_openmp()


def test_team_is_no_larger_than_torchs_thread_count(two_threads):
    """Note [team size]: on torch's threads a region's team is the smaller
    of our count and torch's (torch.set_num_threads); results do not change."""
    tensor_ops.silu(torch.ones(3))
    if not _C.cpu_uses_openmp():
        pytest.skip("torch's OpenMP not in use")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _C.cpu_region_threads() == 2
        two = _outputs()
        torch.set_num_threads(1)
        assert _C.cpu_region_threads() == 1
        one = _outputs()
        torch.set_num_threads(4)
        assert _C.cpu_region_threads() == 2  # ours is the smaller now
    finally:
        torch.set_num_threads(old)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    _C.cpu_set_openmp(0)
    try:
        torch.set_num_threads(1)
        assert _C.cpu_region_threads() == 2  # our own workers: torch's count does not apply
    finally:
        torch.set_num_threads(old)
        assert _arrays.use_torch_openmp()


def test_off_in_a_forked_child(two_threads):
    tensor_ops.silu(torch.ones(3))
    if not _C.cpu_uses_openmp():
        pytest.skip("torch's OpenMP not in use")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: our own workers again, and the ops still run
        try:
            x = np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)
            ok = not _C.cpu_uses_openmp() and np.isfinite(tensor_ops.silu(x)).all()
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 1)
    os.waitpid(pid, 0)
    assert got == b"1"


def test_environment_switch_turns_it_off():
    code = ("import torch, tensor_ops; from tensor_ops import _C; tensor_ops.silu(torch.ones(3)); "
            "print(_C.cpu_uses_openmp())")
    env = dict(os.environ, TENSOR_OPS_TORCH_OPENMP="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
