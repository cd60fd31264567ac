"""Tensor.__dlpack__ export of device tensors: a consumer that refuses the
device (torch and numpy refuse OpenCL) raises, and the process neither
crashes nor frees the capsule twice; capsules made and dropped unconsumed
give their memory back. Each consumer runs in its own process (a double
free would take the test runner down)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensor_ops


def _usable(name):
    for b in tensor_ops.backends():
        if b.name == name:
            return b.usable, b.reason
    return False, f"{name} is not listed"


OPENCL_USABLE, OPENCL_REASON = _usable("opencl")
needs_opencl = pytest.mark.skipif(not OPENCL_USABLE, reason=f"opencl is not usable here: {OPENCL_REASON}")


def _run(body):
    code = "import numpy as np, tensor_ops\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@needs_opencl
@pytest.mark.parametrize("consumer", ["torch", "numpy"])
def test_consumer_refusing_an_opencl_tensor_raises_without_crashing(consumer):
    if consumer == "torch":
        pytest.importorskip("torch")
    call = "torch.from_dlpack(t)" if consumer == "torch" else "np.from_dlpack(t)"
    p = _run(f"""
        import gc
        {'import torch' if consumer == 'torch' else ''}
        t = tensor_ops.from_numpy(np.arange(6, dtype=np.float32), device="opencl:0")
        for _ in range(3):
            try:
                {call}
            except Exception as e:
                print("raised", type(e).__name__)
            else:
                print("accepted")
            gc.collect()
        print(t.numpy().tolist())
    """)
    assert p.returncode == 0, f"exit code {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr[-2000:]}"
    assert p.stdout.count("raised") == 3, p.stdout
    assert "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in p.stdout


@needs_opencl
def test_capsule_deleter_after_a_failed_consumer_is_not_run_twice():
    # What torch does on its error path: call the deleter and leave the
    # capsule named "dltensor"; then the capsule dies.
    p = _run("""
        import ctypes, gc
        class DLManaged(ctypes.Structure):
            pass
        DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManaged))
        DLManaged._fields_ = [("dl_tensor", ctypes.c_byte * 48), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        base = tensor_ops.memory_stats("opencl:0")["allocated_bytes.all.current"]
        t = tensor_ops.from_numpy(np.ones(1024, dtype=np.float32), device="opencl:0")
        for _ in range(50):
            cap = t.__dlpack__()
            mt = ctypes.cast(get(cap, b"dltensor"), ctypes.POINTER(DLManaged))
            mt.contents.deleter(mt)
            del cap, mt
            gc.collect()
        del t
        gc.collect()
        print("allocated back to baseline", tensor_ops.memory_stats("opencl:0")["allocated_bytes.all.current"] == base)
    """)
    assert p.returncode == 0, f"exit code {p.returncode}\nstderr: {p.stderr[-2000:]}"
    assert "allocated back to baseline True" in p.stdout, p.stdout


@pytest.mark.parametrize("device", ["cpu", "opencl:0"])
def test_unconsumed_capsules_leak_nothing(device):
    if device != "cpu" and not OPENCL_USABLE:
        pytest.skip(f"opencl is not usable here: {OPENCL_REASON}")
    import gc

    gc.collect()
    base = tensor_ops.memory_stats(device)["allocated_bytes.all.current"]
    t = tensor_ops.from_numpy(np.ones(4096, dtype=np.float32), device=device)
    for _ in range(200):
        cap = t.__dlpack__()
        del cap
    del t
    gc.collect()
    assert tensor_ops.memory_stats(device)["allocated_bytes.all.current"] == base


def test_consumed_capsule_keeps_the_data_alive_until_the_consumer_is_done():
    torch = pytest.importorskip("torch")
    t = tensor_ops.from_numpy(np.arange(8, dtype=np.float32), device="cpu")
    x = torch.from_dlpack(t)
    del t
    assert x.tolist() == list(range(8))
    y = np.from_dlpack(tensor_ops.from_numpy(np.arange(3, dtype=np.float32), device="cpu"))
    assert y.tolist() == [0.0, 1.0, 2.0]


@needs_opencl
def test_opencl_tensor_names_its_dlpack_device():
    t = tensor_ops.from_numpy(np.ones(2, dtype=np.float32), device="opencl:0")
    assert t.__dlpack_device__() == (4, 0)  # kDLOpenCL


def test_numpy_asarray_of_a_tensor():
    """np.asarray(t) gives the data (it gave a 0-d object array holding the
    Tensor, silently): a view on the host, a copy with np.array or a dtype."""
    import numpy as np

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = tensor_ops.from_numpy(a)
    v = np.asarray(t)
    assert v.dtype == np.float32 and v.shape == (2, 3) and np.array_equal(v, a)
    assert np.shares_memory(v, t.numpy())
    c = np.array(t)
    c[0, 0] = 99
    assert t.numpy()[0, 0] == 0
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
