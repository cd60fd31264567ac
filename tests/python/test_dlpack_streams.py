"""DLPack stream semantics (Note [DLPack streams] in _arrays.py), the parts a
machine without a GPU can check: the sentinel table, exports of host data,
the stream a consumer asks a CUDA / ROCm producer for (a fake producer that
records it), and the producer side's waits through the mock plugin of
tests/cpp (in a subprocess, so its backends stay out of this process)."""
import ctypes
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensor_ops
from tensor_ops import _C
from tensor_ops._arrays import consumer_stream, dlpack_stream
from tensor_ops.memory import use_stream

CUDA, CUDA_HOST, OPENCL, ROCM, ROCM_HOST, CUDA_MANAGED, ONEAPI, CPU = 2, 3, 4, 10, 11, 13, 14, 1


# --- the spec's table: __dlpack__(stream=...) -> the consumer's stream handle ---

@pytest.mark.parametrize("dl_type", [CUDA, CUDA_MANAGED])
def test_cuda_sentinels(dl_type):
    assert consumer_stream(dl_type, None) == 0  # legacy default stream
    assert consumer_stream(dl_type, 1) == 0  # legacy default stream, named
    assert consumer_stream(dl_type, 2) == 2  # cudaStreamPerThread, a valid handle
    assert consumer_stream(dl_type, -1) is None  # no synchronisation
    assert consumer_stream(dl_type, 0x7F00_1234) == 0x7F00_1234
    with pytest.raises(ValueError, match="stream=0 is ambiguous on CUDA"):
        consumer_stream(dl_type, 0)
    with pytest.raises(ValueError, match="not a CUDA stream"):
        consumer_stream(dl_type, -2)


def test_rocm_sentinels():
    assert consumer_stream(ROCM, None) == 0
    assert consumer_stream(ROCM, 0) == 0
    assert consumer_stream(ROCM, -1) is None
    assert consumer_stream(ROCM, 0x5000) == 0x5000
    for s in (1, 2):
        with pytest.raises(ValueError, match="CUDA sentinel; ROCm takes None or 0"):
            consumer_stream(ROCM, s)
    with pytest.raises(ValueError, match="not a ROCm stream"):
        consumer_stream(ROCM, -3)


@pytest.mark.parametrize("dl_type", [CPU, CUDA_HOST, ROCM_HOST, OPENCL, ONEAPI])
def test_streamless_devices_take_none_or_minus_one(dl_type):
    assert consumer_stream(dl_type, None) is None
    assert consumer_stream(dl_type, -1) is None
    for s in (0, 1, 2, 0x1234):
        with pytest.raises(ValueError, match=f"DLPack device type {dl_type}, which has no streams"):
            consumer_stream(dl_type, s)


@pytest.mark.parametrize("bad", ["1", 1.0, True, [1]])
def test_stream_must_be_an_int(bad):
    with pytest.raises(TypeError, match="stream must be an int or None"):
        consumer_stream(CUDA, bad)


def test_what_a_consumer_asks_for():
    assert dlpack_stream(CUDA, 0) == 1  # the default stream is 1 on CUDA ...
    assert dlpack_stream(ROCM, 0) == 0  # ... and 0 on ROCm
    assert dlpack_stream(CUDA, 0xABC0) == dlpack_stream(ROCM, 0xABC0) == 0xABC0


# --- exports of host data ---

def test_host_tensor_exports_with_none_or_minus_one():
    t = tensor_ops.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert t.__dlpack_device__() == (CPU, 0)
    for s in (None, -1):
        t.__dlpack__(stream=s)  # a capsule, no error
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize("stream", [0, 1, 2, 0x1234])
def test_host_tensor_rejects_a_stream(stream):
    t = tensor_ops.from_numpy(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="which has no streams; pass stream=None"):
        t.__dlpack__(stream=stream)
    with pytest.raises(TypeError):
        t.__dlpack__(stream="default")


# --- the consumer side: what we ask a CUDA / ROCm producer for ---

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor)))]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeDeviceArray:
    """A float32 array that says it lives on a CUDA / ROCm device and records
    the stream each __dlpack__ call asks for. Its capsule is honest (that
    device type), so the op fails after the import when no such backend is
    usable: what is checked is what was asked before."""

    def __init__(self, shape, dl_type=CUDA, device_id=0):
        self.host = np.zeros(shape, np.float32)
        self.shape, self.dtype = self.host.shape, self.host.dtype
        self.dl_type, self.device_id = dl_type, device_id
        self.requested = []
        self._keep = []

    def __dlpack_device__(self):
        return (self.dl_type, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.requested.append(stream)
        shape = (ctypes.c_int64 * self.host.ndim)(*self.host.shape)
        m = _DLManagedTensor()
        m.dl_tensor.data = self.host.ctypes.data
        m.dl_tensor.device = _DLDevice(self.dl_type, self.device_id)
        m.dl_tensor.ndim = self.host.ndim
        m.dl_tensor.dtype = _DLDataType(2, 32, 1)  # float32
        m.dl_tensor.shape = shape
        self._keep += [shape, m]  # no deleter: the test keeps them
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)


def _no_backend_for(dl_type):
    name = {CUDA: "cuda", ROCM: "hip"}[dl_type]
    if any(b.name == name and b.usable for b in tensor_ops.backends()):
        pytest.skip(f"{name} is usable here: the fake producer's host memory must not reach its kernels")
    return name


@pytest.mark.parametrize("dl_type, default", [(CUDA, 1), (ROCM, 0)])
def test_consumer_asks_for_the_default_stream(dl_type, default):
    name = _no_backend_for(dl_type)
    x, w, out = FakeDeviceArray((2, 8), dl_type), FakeDeviceArray((8,), dl_type), FakeDeviceArray((2, 8), dl_type)
    with pytest.raises(tensor_ops.TensorOpsError, match=name):
        tensor_ops.layer_norm(x, w, out=out)
    # Every device argument, inputs and the output, was asked for our stream.
    assert x.requested == w.requested == out.requested == [default]
    assert _C._current_stream(f"{name}:0") == 0


@pytest.mark.parametrize("dl_type", [CUDA, ROCM])
def test_consumer_asks_for_the_threads_stream(dl_type):
    name = _no_backend_for(dl_type)
    x, out = FakeDeviceArray((3, 4), dl_type, 1), FakeDeviceArray((3, 4), dl_type, 1)
    with use_stream(0xCAFE00, f"{name}:1"):
        assert _C._current_stream(f"{name}:1") == 0xCAFE00
        assert _C._current_stream(f"{name}:0") == 0  # streams are per device
        with pytest.raises(tensor_ops.TensorOpsError):
            tensor_ops.swiglu(x, x, out=out)
        assert _C._current_stream(f"{name}:1") == 0xCAFE00  # restored after the failed op
    assert _C._current_stream(f"{name}:1") == 0
    assert x.requested == [0xCAFE00, 0xCAFE00] and out.requested == [0xCAFE00]


def test_use_stream_checks_the_handle():
    with pytest.raises(TypeError, match="stream handle"):
        with use_stream(-1, "cuda:0"):
            pass
    with pytest.raises(TypeError, match="stream handle"):
        with use_stream(None, "cuda:0"):
            pass


def test_host_arrays_take_no_stream_path():
    """numpy and host tensor_ops.Tensor inputs run as before, whatever
    stream a device has set."""
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    with use_stream(0x1000, "cuda:0"):
        y = tensor_ops.silu(x)
    np.testing.assert_allclose(y, x / (1 + np.exp(-x)), rtol=1e-6)


# --- the producer side: our export makes the consumer's stream wait ---

def _mock_plugin_dir():
    d = os.path.join(_C.core_library_dir(), "tests", "cpp", "plugins")
    if not os.path.exists(os.path.join(d, "libtensor_ops_mock.so")):
        pytest.skip(f"the mock plugins of tests/cpp are not built in {d}")
    return d


_PRODUCER_SCRIPT = r"""
import ctypes, json, os, sys
from tensor_ops import _C, memory
plugins = sys.argv[1]
_C.load_plugins_from(plugins)
mock = ctypes.CDLL(os.path.join(plugins, "libtensor_ops_mock.so"))  # the copy the registry loaded
mock.tensor_ops_mock_waits.restype = ctypes.c_uint64
mock.tensor_ops_mock_waits.argtypes = [ctypes.POINTER(ctypes.c_void_p)] * 2

def waits():
    c, p = ctypes.c_void_p(), ctypes.c_void_p()
    n = mock.tensor_ops_mock_waits(ctypes.byref(c), ctypes.byref(p))
    return [n, c.value or 0, p.value or 0]

class FakeTensor:  # a Tensor as _tensor_dlpack sees it: CUDA to DLPack, "mock:0" to the core
    device = "mock:0"
    def __dlpack_device__(self):
        return (2, 0)

memory._export_dlpack = lambda self, **kw: "capsule"
out = {"has_streams": _C._has_streams("mock:0"), "v1_has_streams": _C._has_streams("mockv1:0")}
def export(stream):
    try:
        r = memory._tensor_dlpack(FakeTensor(), stream=stream)
    except Exception as e:
        r = type(e).__name__ + ": " + str(e)
    return [r] + waits()
for s in [None, 1, -1, 2, 0x5000, 0, 0xBAD]:
    out[str(s)] = export(s)
with memory.use_stream(0x7000, "mock:0"):
    out["ours None"] = export(None)
    out["ours same"] = export(0x7000)
print(json.dumps(out))
"""


def test_export_makes_the_consumer_stream_wait():
    plugins = _mock_plugin_dir()
    r = subprocess.run([sys.executable, "-c", _PRODUCER_SCRIPT, plugins], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["has_streams"] and not out["v1_has_streams"]
    # [result, waits so far, last consumer, last producer]; our stream is the default (0)
    assert out["None"] == ["capsule", 0, 0, 0]  # default on both sides: nothing to wait for
    assert out["1"] == ["capsule", 0, 0, 0]  # 1 is the legacy default stream: the same
    assert out["-1"] == ["capsule", 0, 0, 0]  # no synchronisation asked for
    assert out["2"] == ["capsule", 1, 2, 0]  # per-thread default stream waits for the legacy one
    assert out[str(0x5000)] == ["capsule", 2, 0x5000, 0]
    assert out["0"][0].startswith("InvalidArgumentError: __dlpack__: stream=0 is ambiguous") and out["0"][1] == 2
    assert out[str(0xBAD)][0].startswith("DeviceError:") and "invalid resource handle" in out[str(0xBAD)][0]
    assert out["ours None"] == ["capsule", 3, 0, 0x7000]  # the consumer's default waits for our stream
    assert out["ours same"] == ["capsule", 3, 0, 0x7000]  # same stream: no wait
