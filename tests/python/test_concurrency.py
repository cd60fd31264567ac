"""Ops called from 8 Python threads at once (the GIL is released around the
kernels) give the results they give alone, and two backends work in one
process at the same time (the CPU and OpenCL, where OpenCL is usable)."""
import threading

import numpy as np
import pytest

import tensor_ops
from conftest import ref_rms_norm, ref_silu

N_THREADS = 8
ITERATIONS = 20


def run_on_threads(body):
    """Runs body(i) on N_THREADS threads released together; re-raises the
    first failure with its thread index."""
    barrier = threading.Barrier(N_THREADS)
    errors = [None] * N_THREADS

    def target(i):
        try:
            barrier.wait()
            body(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=target, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"thread {i} failed: {e!r}") from e


def inputs(seed, rows=64, cols=1024):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, cols)).astype(np.float32), rng.standard_normal(cols).astype(np.float32)


# Large enough for the CPU backend's thread pool to split the work.
OPS = {
    "rms_norm": lambda x, w: tensor_ops.rms_norm(x, w),
    "silu": lambda x, w: tensor_ops.silu(x),
    "gelu_tanh": lambda x, w: tensor_ops.gelu(x, "tanh"),
    "softmax": lambda x, w: tensor_ops.softmax(x, scale=0.5),
    "layer_norm": lambda x, w: tensor_ops.layer_norm(x, w, w),
    "swiglu": lambda x, w: tensor_ops.swiglu(x, x * 0.5 + 1.0),
}


def test_eight_threads_match_serial_results():
    with tensor_ops.use("cpu"):
        expected = [{name: op(*inputs(seed)) for name, op in OPS.items()} for seed in range(N_THREADS)]

    def body(i):
        x, w = inputs(i)
        with tensor_ops.use("cpu"):
            for it in range(ITERATIONS):
                for name, op in OPS.items():
                    np.testing.assert_array_equal(op(x, w), expected[i][name], err_msg=f"{name}, iteration {it}")

    run_on_threads(body)


def test_eight_threads_writing_into_their_own_out():
    outs = np.zeros((N_THREADS, 64, 1024), np.float32)

    def body(i):
        x, out = inputs(i)[0], outs[i]
        for _ in range(ITERATIONS):
            assert tensor_ops.silu(x, out=out) is out

    run_on_threads(body)
    for i in range(N_THREADS):
        x, _ = inputs(i)
        np.testing.assert_allclose(outs[i], ref_silu(x), rtol=1e-5, atol=1e-6, err_msg=f"thread {i}")


def _usable(name):
    return any(b.name == name and b.usable for b in tensor_ops.backends())


@pytest.mark.skipif(not _usable("opencl"), reason="the OpenCL backend is not usable here")
def test_cpu_and_opencl_at_once():
    x, w = inputs(0, 4, 64)
    with tensor_ops.use("opencl"):
        try:
            tensor_ops.rms_norm(x, w)
            tensor_ops.silu(x)
        except tensor_ops.UnsupportedError as e:
            pytest.skip(f"OpenCL lacks an op this test uses: {e}")

    def body(i):
        backend = "opencl" if i % 2 else "cpu"
        x, w = inputs(100 + i, 16, 256)
        want_rms, want_silu = ref_rms_norm(x, w), ref_silu(x)
        with tensor_ops.use(backend):
            assert tensor_ops.get_backend() == backend
            for _ in range(ITERATIONS):
                np.testing.assert_allclose(tensor_ops.rms_norm(x, w), want_rms, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(tensor_ops.silu(x), want_silu, rtol=1e-5, atol=1e-6)

    run_on_threads(body)


def _second_backend():
    """A usable backend other than cpu (the selection must visibly change), or skip."""
    for b in tensor_ops.backends():
        if b.usable and b.name != "cpu":
            return b.name
    pytest.skip("only the cpu backend is usable here")


def test_use_is_per_asyncio_task():
    """Note [use() per context]: two asyncio tasks interleaving their use()
    blocks on one thread each see their own backend (a task inside
    use("cpu") saw the other's backend, and exits popped each other's scope)."""
    import asyncio

    other = _second_backend()
    seen = {}

    async def task(name, first):
        with tensor_ops.use(name):
            if first:
                await asyncio.sleep(0.02)  # the other task enters its block meanwhile
            seen[name, 1] = tensor_ops.get_backend()
            await asyncio.sleep(0.02 if not first else 0.04)
            seen[name, 2] = tensor_ops.get_backend()
        seen[name, 3] = tensor_ops.get_backend()

    async def main():
        await asyncio.gather(task("cpu", True), task(other, False))

    before = tensor_ops.get_backend()
    asyncio.run(main())
    assert seen["cpu", 1] == seen["cpu", 2] == "cpu", seen
    assert seen[other, 1] == seen[other, 2] == other, seen
    assert seen["cpu", 3] == seen[other, 3] == before
    assert tensor_ops.get_backend() == before


def test_use_block_ended_on_another_thread():
    """A generator's use() block resumed and ended on another thread (a thread
    pool serving a streaming response): the thread that entered it returns to
    its selection, and the other thread's own scope is untouched (it stayed on
    the block's backend for good, and the exit popped the other's scope)."""
    from concurrent.futures import ThreadPoolExecutor

    other = _second_backend()
    before = tensor_ops.get_backend()

    def stream():
        with tensor_ops.use(other):
            yield tensor_ops.get_backend()
            yield tensor_ops.get_backend()

    gen = stream()
    assert next(gen) == other

    def finish():
        with tensor_ops.use("cpu"):
            for _ in gen:
                pass
            return tensor_ops.get_backend()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(finish).result() == "cpu"
    assert tensor_ops.get_backend() == before
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    np.testing.assert_allclose(tensor_ops.silu(x), ref_silu(x), rtol=1e-5, atol=1e-6)


def test_task_created_in_a_use_block_after_it_ended():
    """A task created inside a use() block and run after the block ended runs
    where the parent does (the block is over), whatever the thread ran in
    between: it depended on whether the parent had run an op after the exit."""
    import asyncio

    other = _second_backend()
    x = np.ones((1, 8), np.float32)

    def where():
        return tensor_ops._C.backend_for(x), tensor_ops.get_backend()

    async def child(ev):
        await ev.wait()
        return where()

    async def main(op_after_exit):
        ev = asyncio.Event()
        with tensor_ops.use(other):
            assert where() == (other, other) or other == "xla"
            t = asyncio.create_task(child(ev))
        if op_after_exit:
            where()
        ev.set()
        return await t

    before = where()
    assert asyncio.run(main(False)) == asyncio.run(main(True)) == before
