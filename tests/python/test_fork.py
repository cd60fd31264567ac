"""fork() after tensor_ops ran (issue 17, item 1).

The child of a fork has only the forking thread: the CPU thread pool must
start new workers there (it hung), and a plugin whose vendor runtime cannot
survive fork (OpenCL: PoCL runs threads) must say so instead of hanging. Each
case runs in its own process group with a timeout, so a hang fails the test
and leaves no stuck worker behind.
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import tensor_ops

TIMEOUT_S = 120
# Enough elements that silu splits over the pool's workers in the parent.
BIG = 1 << 20


def _run(code, **env):
    """Runs code in a fresh interpreter; returns (returncode, stdout, stderr).
    A hang past TIMEOUT_S kills the whole process group and fails the test."""
    e = {**os.environ, "TENSOR_OPS_NUM_THREADS": "2", **env}
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=e, start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"hung for {TIMEOUT_S} s (a forked child waiting on the parent's thread pool?)\n"
                    f"stdout:\n{out}\nstderr:\n{err}")
    return p.returncode, out, err


# The parent runs a multi-threaded op before forking (TENSOR_OPS_NUM_THREADS=2).
PARENT_PRELUDE = f"""
    import numpy as np
    import tensor_ops
    assert tensor_ops._C.cpu_num_threads() == 2, tensor_ops._C.cpu_num_threads()
    big = np.linspace(-8, 8, {BIG}, dtype=np.float32)
    ref = big / (1 + np.exp(-big.astype(np.float64)))
    assert np.allclose(tensor_ops.silu(big), ref, rtol=1e-5, atol=1e-6)
"""


def test_dataloader_fork_workers_run_ops_after_the_parent_did():
    pytest.importorskip("torch")
    code = PARENT_PRELUDE + """
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            x = np.linspace(-4, 4, 1 << 18, dtype=np.float32) + i  # big enough for the pool
            w = np.ones(x.shape[-1], np.float32)
            return torch.from_numpy(tensor_ops.silu(x)), torch.from_numpy(tensor_ops.rms_norm(x[None], w)[0])

    loader = DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    n = 0
    for s, r in loader:
        for j in range(s.shape[0]):
            i = n + j
            x = np.linspace(-4, 4, 1 << 18, dtype=np.float64) + i
            assert np.allclose(s[j].numpy(), x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6), i
            assert np.allclose(r[j].numpy(), x / np.sqrt(np.mean(x * x) + 1e-6), rtol=1e-5, atol=1e-6), i
        n += s.shape[0]
    assert n == 8, n
    print("ok")
    """
    rc, out, err = _run(code)
    assert rc == 0 and out.strip().endswith("ok"), err


def test_os_fork_child_runs_cpu_ops_and_the_parent_still_does():
    code = PARENT_PRELUDE + """
    import os
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            for _ in range(3):  # each a parallel region on the child's new workers
                assert np.allclose(tensor_ops.silu(big), ref, rtol=1e-5, atol=1e-6)
            tensor_ops._C.cpu_set_num_threads(1)
            assert np.allclose(tensor_ops.silu(big), ref, rtol=1e-5, atol=1e-6)
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert np.allclose(tensor_ops.silu(big), ref, rtol=1e-5, atol=1e-6)
    print("ok")
    """
    rc, out, err = _run(code)
    assert rc == 0 and out.strip().endswith("ok"), err


# OpenCL (PoCL runs threads) may work in the child or refuse; the XLA shim,
# once JAX started in the parent, must refuse (its first op hung forever).
@pytest.mark.parametrize("backend, allowed", [("opencl", ("child 0", "child 2")), ("xla", ("child 2",))])
def test_backend_in_a_forked_child_is_a_clear_error_not_a_hang(backend, allowed):
    s = next((b for b in tensor_ops.backends() if b.name == backend), None)
    if s is None or not s.usable:
        pytest.skip(f"{backend} is not usable here: {s.reason if s else 'not listed'}")
    code = f"""
    import os
    import numpy as np
    import tensor_ops
    x = np.linspace(-4, 4, 4096, dtype=np.float32)
    with tensor_ops.use({backend!r}):
        tensor_ops.silu(x)
    pid = os.fork()
    if pid == 0:
        status = 3
        try:
            with tensor_ops.use({backend!r}):
                tensor_ops.silu(x)
            status = 0  # works
        except tensor_ops.BackendUnavailableError as e:
            msg = str(e)
            status = 2 if ("fork" in msg and "'spawn'" in msg) else 4
            print(msg, flush=True)
        finally:
            os._exit(status)  # not sys.exit: JAX's own exit handlers crash in a forked child
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
    """
    rc, out, err = _run(code, TENSOR_OPS_BACKEND="cpu")
    assert rc == 0, err
    assert out.strip().splitlines()[-1] in allowed, out + err
