"""The memory API: Tensor, pool statistics, memory fraction, OOM protection."""
import gc

import numpy as np
import pytest

import tensor_ops
from conftest import assert_close, ml_dtypes, ref_rms_norm, ref_silu, torch


@pytest.fixture(autouse=True)
def clean_pool():
    tensor_ops.set_memory_fraction(1.0, "cpu")
    tensor_ops._C._inject_alloc_failures(0, 0, "cpu")
    yield
    tensor_ops.set_memory_fraction(1.0, "cpu")
    tensor_ops._C._inject_alloc_failures(0, 0, "cpu")


def test_empty_zeros_from_numpy(rng):
    t = tensor_ops.empty((3, 5), "float32")
    assert t.shape == (3, 5) and t.dtype == "float32" and t.device == "cpu" and t.nbytes == 60
    z = tensor_ops.zeros((2, 7), np.float16)
    assert z.dtype == "float16" and (z.numpy() == 0).all()
    a = rng.standard_normal((4, 9)).astype(np.float32)
    t = tensor_ops.from_numpy(a)
    np.testing.assert_array_equal(t.numpy(), a)
    assert t.numpy().ctypes.data == t.data_ptr  # host view is zero-copy


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_bfloat16_tensor(rng):
    a = rng.standard_normal((2, 8)).astype(ml_dtypes.bfloat16)
    t = tensor_ops.from_numpy(a)
    assert t.dtype == "bfloat16"
    np.testing.assert_array_equal(t.numpy().view(np.uint16), a.view(np.uint16))


def test_ops_chain_on_tensor(rng):
    a = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    t, tw = tensor_ops.from_numpy(a), tensor_ops.from_numpy(w)
    y = tensor_ops.silu(tensor_ops.rms_norm(t, tw))
    assert isinstance(y, tensor_ops.Tensor)
    assert_close(y.numpy(), ref_silu(ref_rms_norm(a, w)), "float32")


def test_dlpack_export(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    t = tensor_ops.from_numpy(a)
    v = np.from_dlpack(t)
    np.testing.assert_array_equal(v, a)
    assert t.__dlpack_device__() == (1, 0)
    if torch is not None:
        tt = torch.from_dlpack(t)
        assert tt.data_ptr() == t.data_ptr
        del t  # the torch view keeps the block alive
        np.testing.assert_array_equal(tt.numpy(), a)


def test_to_same_device_and_bad_device():
    t = tensor_ops.empty((2,), "float32")
    assert t.to("cpu") is not None
    with pytest.raises(ValueError, match="unknown backend"):
        t.to("nonexistent:0")
    with pytest.raises(ValueError, match="does not exist"):
        tensor_ops.empty((2,), "float32", device="cpu:3")
    with pytest.raises(TypeError):
        tensor_ops.empty((2,), "float64")
    with pytest.raises(ValueError):
        tensor_ops.empty((-1, 2), "float32")


def test_stats_track_allocations():
    tensor_ops.empty_cache()
    before = tensor_ops.memory_stats("cpu")
    t = tensor_ops.empty((1024, 1024), "float32")  # 4 MiB: a large block
    during = tensor_ops.memory_stats("cpu")
    assert during["allocated_bytes.all.current"] >= before["allocated_bytes.all.current"] + (4 << 20)
    assert during["reserved_bytes.all.current"] >= during["allocated_bytes.all.current"]
    del t
    after = tensor_ops.memory_stats("cpu")
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    t2 = tensor_ops.empty((1024, 1024), "float32")  # reused from the cache
    assert tensor_ops.memory_stats("cpu")["cache_hits"] > after["cache_hits"]
    del t2
    tensor_ops.empty_cache()
    assert tensor_ops.memory_stats("cpu")["reserved_bytes.all.current"] <= before["reserved_bytes.all.current"]


def test_memory_fraction_oom_then_recovers():
    total = tensor_ops.memory_stats("cpu")["device_total_bytes"]
    tensor_ops.set_memory_fraction(0.001, "cpu")
    want = int(total * 0.002) // 4
    before = tensor_ops.memory_stats("cpu")["num_ooms"]
    with pytest.raises(tensor_ops.OutOfMemoryError) as e:
        tensor_ops.empty((want,), "float32")
    msg = str(e.value)
    for word in ["tried to allocate", "free", "total", "reserved", "allocated", "limit", "empty_cache",
                 "set_memory_fraction"]:
        assert word in msg, msg
    assert tensor_ops.memory_stats("cpu")["num_ooms"] == before + 1
    small = tensor_ops.empty((1000,), "float32")  # the next normal allocation works
    assert small.shape == (1000,)
    with pytest.raises(ValueError, match="fraction"):
        tensor_ops.set_memory_fraction(0.0)
    with pytest.raises(ValueError, match="fraction"):
        tensor_ops.set_memory_fraction(1.5)


def test_oom_protection_safety_margin():
    free = tensor_ops.memory_stats("cpu")["device_free_bytes"]
    with pytest.raises(tensor_ops.OutOfMemoryError, match="safety margin"):
        tensor_ops.allocate_with_oom_protection((free // 4,), "float32", safety_margin=1.5)
    with pytest.raises(tensor_ops.OutOfMemoryError):
        tensor_ops.allocate_with_oom_protection((1 << 45,), "float32")
    t = tensor_ops.allocate_with_oom_protection((256, 256), "float16", safety_margin=1.2)
    assert t.shape == (256, 256) and t.dtype == "float16"
    with pytest.raises(ValueError, match="safety_margin"):
        tensor_ops.allocate_with_oom_protection((4,), "float32", safety_margin=0.5)


def test_injected_failure_retries_then_raises():
    tensor_ops.empty_cache()
    tensor_ops._C._inject_alloc_failures(0, 1 << 22, "cpu")  # upstream fails above 4 MiB
    before = tensor_ops.memory_stats("cpu")
    with pytest.raises(tensor_ops.OutOfMemoryError, match="after freeing the cache"):
        tensor_ops.empty((2 << 20,), "float32")  # 8 MiB
    after = tensor_ops.memory_stats("cpu")
    assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert tensor_ops.empty((1 << 10,), "float32").shape == (1024,)


def test_shape_overflow_is_clear():
    with pytest.raises(ValueError, match="overflow"):
        tensor_ops.empty((1 << 40, 1 << 40), "float32")


def test_large_outputs_come_from_the_pool(rng):
    """Outputs of POOL_OUTPUT_BYTES and more are pool blocks viewed by the
    caller's kind of array (no page faults on a fresh mmap per call); they
    go back to the pool when the array dies, and smaller ones stay np.empty."""
    from tensor_ops._arrays import POOL_OUTPUT_BYTES

    rows = POOL_OUTPUT_BYTES // (4 * 256)
    x = rng.standard_normal((rows, 256), dtype=np.float32)
    w = rng.standard_normal(256, dtype=np.float32)
    gc.collect()  # earlier tests' garbage must not be freed halfway through
    tensor_ops.empty_cache()
    before = tensor_ops.memory_stats()["allocated_bytes.all.current"]
    for y, ref in ((tensor_ops.silu(x), x / (1 + np.exp(-x.astype(np.float64)))),
                   (tensor_ops.rms_norm(x, w), None), (tensor_ops.softmax(x), None)):
        assert type(y) is np.ndarray and y.dtype == np.float32 and y.shape == x.shape and y.flags.writeable
        assert tensor_ops.memory_stats()["allocated_bytes.all.current"] >= before + x.nbytes
        if ref is not None:
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
        y[0, 0] = 7.0  # the caller owns it
        del y
    assert tensor_ops.memory_stats()["allocated_bytes.all.current"] == before
    assert tensor_ops.memory_stats()["cached_bytes"] >= x.nbytes
    small = tensor_ops.silu(x[:8])
    assert type(small) is np.ndarray and small.base is None  # np.empty, not a pool view
    tensor_ops.empty_cache()


def test_large_torch_outputs_come_from_the_pool(rng):
    torch = pytest.importorskip("torch")
    from tensor_ops._arrays import POOL_OUTPUT_BYTES

    x = torch.from_numpy(rng.standard_normal((POOL_OUTPUT_BYTES // (2 * 512), 512), dtype=np.float32)).bfloat16()
    gc.collect()
    before = tensor_ops.memory_stats()["allocated_bytes.all.current"]
    y = tensor_ops.silu(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == x.shape
    assert tensor_ops.memory_stats()["allocated_bytes.all.current"] >= before + x.numel() * 2
    torch.testing.assert_close(y, torch.nn.functional.silu(x.float()).bfloat16(), rtol=2 ** -7, atol=1e-3)
    del y
    assert tensor_ops.memory_stats()["allocated_bytes.all.current"] == before
    tensor_ops.empty_cache()


def test_an_op_that_runs_out_of_memory_counts_once(rng):
    """A torch call on OpenCL whose staging copy is refused under a cap
    raises OutOfMemoryError once: the torch layer's direct lane caught it and
    the public op ran the call again (num_ooms went up by 2 per failed call)."""
    torch = pytest.importorskip("torch")
    import tensor_ops.torch as tt

    if not any(b.name == "opencl" and b.usable for b in tensor_ops.backends()):
        pytest.skip("opencl is not usable here")
    dev = "opencl:0"
    x = torch.from_numpy(rng.standard_normal((33, 77), dtype=np.float32))
    w = torch.ones(77)
    with tensor_ops.use("opencl"):
        tt.silu(x)  # warm: the kernels built
    total = tensor_ops.memory_stats(dev)["device_total_bytes"]
    tensor_ops.empty_cache(dev)
    tensor_ops.set_memory_fraction(4096 / total, dev)
    try:
        for call in (lambda: tt.rms_norm(x, w, 1e-6), lambda: torch.ops.tensor_ops.rms_norm(x, w, 1e-6),
                     lambda: tt.silu(x), lambda: tensor_ops.silu(x), lambda: tt.RMSNorm(77)(x)):
            before = tensor_ops.memory_stats(dev)["num_ooms"]
            with pytest.raises(tensor_ops.OutOfMemoryError), tensor_ops.use("opencl"):
                call()
            assert tensor_ops.memory_stats(dev)["num_ooms"] == before + 1
    finally:
        tensor_ops.set_memory_fraction(1.0, dev)
    with tensor_ops.use("opencl"):
        assert torch.allclose(tt.silu(x), torch.nn.functional.silu(x), atol=1e-6)
