"""The CUDA and HIP plugins (one source, cuda/): honest status and error
paths on a machine without a GPU, conformance vs float64 where one is usable.

Without a driver the plugins still load (CUDA links its runtime statically;
HIP needs libamdhip64 to load at all), so their tables are called here
directly through ctypes to exercise the error paths a GPU machine rarely
takes."""
import ctypes
import re

import numpy as np
import pytest

import tensor_ops
from conftest import DTYPES, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu, torch

GPU_BACKENDS = ["cuda", "hip"]
PRIORITY = {"cuda": 100, "hip": 90}
TO_OK, TO_ERR_INVALID_ARGUMENT, TO_ERR_BACKEND_UNAVAILABLE, TO_ERR_DEVICE = 0, 1, 3, 5
OP_IDS = {"rms_norm": 0, "silu": 1, "gelu": 2}


def status(name):
    for b in tensor_ops.backends():
        if b.name == name:
            return b
    raise AssertionError(f"tensor_ops.backends() does not list {name}")


@pytest.fixture(params=GPU_BACKENDS)
def compiled(request):
    """A GPU backend whose plugin was compiled into this package."""
    b = status(request.param)
    if not b.compiled:
        pytest.skip(f"{b.name} plugin not compiled: {b.reason}")
    return b


@pytest.fixture
def unusable(compiled):
    if compiled.usable:
        pytest.skip(f"{compiled.name} is usable here; the no-driver paths cannot be taken")
    return compiled


@pytest.fixture
def usable(compiled):
    if not compiled.usable:
        pytest.skip(f"{compiled.name} is not usable here: {compiled.reason}")
    return compiled


def test_listed_once_with_library_and_reason(compiled):
    assert [b.name for b in tensor_ops.backends()].count(compiled.name) == 1
    assert compiled.library.endswith(f"libtensor_ops_{compiled.name}.so")
    if compiled.usable:
        assert compiled.reason == "" and compiled.priority == PRIORITY[compiled.name]
        return
    assert re.search(r"driver|runtime", compiled.reason, re.I), compiled.reason
    if "failed to load" not in compiled.reason:  # loaded: the probe names its call and code
        assert re.search(rf"{compiled.name}GetDeviceCount returned \d+ \({compiled.name}Error\w+\)",
                         compiled.reason), compiled.reason


def test_selecting_unusable_backend_raises_with_reason(unusable):
    with pytest.raises(RuntimeError, match=re.escape(unusable.reason)):
        tensor_ops.set_backend(unusable.name)
    with pytest.raises(tensor_ops.BackendUnavailableError, match=re.escape(unusable.reason)):
        with tensor_ops.use(unusable.name):
            pass
    assert tensor_ops.get_backend() == "cpu"
    assert not [d for d in tensor_ops.devices() if d.backend == unusable.name]


def test_cpu_ops_still_work(unusable, rng):
    x = (rng.standard_normal((3, 37)) * 3).astype(np.float32)
    w = rng.standard_normal(37).astype(np.float32)
    assert_close(tensor_ops.rms_norm(x, w), ref_rms_norm(x, w), "float32", "rms_norm")
    assert_close(tensor_ops.silu(x), ref_silu(x), "float32", "silu")
    assert_close(tensor_ops.gelu(x, "tanh"), ref_gelu(x, "tanh"), "float32", "gelu")


# --- the plugin table, called directly (mirrors cpp/include/tensor_ops/plugin.h) ---

class _View(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64), ("dtype", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * 8), ("strides", ctypes.c_int64 * 8),
                ("device_id", ctypes.c_int32)]


class _OpCall(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int32), ("n_inputs", ctypes.c_int32), ("n_outputs", ctypes.c_int32),
                ("inputs", _View * 8), ("outputs", _View * 8), ("scalars", ctypes.c_double * 4),
                ("ints", ctypes.c_int64 * 4), ("stream", ctypes.c_void_p)]


class _DeviceInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 256), ("vendor", ctypes.c_char * 128),
                ("driver_version", ctypes.c_char * 128), ("compute_capability", ctypes.c_char * 64),
                ("device_type", ctypes.c_int32), ("total_memory_bytes", ctypes.c_uint64),
                ("is_available", ctypes.c_int32), ("properties", ctypes.c_char * 2048)]


_F = ctypes.CFUNCTYPE


class _Table(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("name", ctypes.c_char_p),
        ("flags", ctypes.c_uint32),
        ("init", _F(ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)),
        ("priority", _F(ctypes.c_int32)),
        ("device_count", _F(ctypes.c_int32)),
        ("device_info", _F(ctypes.c_int, ctypes.c_int32, ctypes.POINTER(_DeviceInfo))),
        ("mem_info", _F(ctypes.c_int, ctypes.c_int32, ctypes.POINTER(ctypes.c_uint64),
                        ctypes.POINTER(ctypes.c_uint64))),
        ("allocate", _F(ctypes.c_int, ctypes.c_int32, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))),
        ("deallocate", _F(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t)),
        ("copy", _F(ctypes.c_int, ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                    ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int32)),
        ("memset", _F(ctypes.c_int, ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32,
                      ctypes.c_size_t)),
        ("synchronize", _F(ctypes.c_int, ctypes.c_int32)),
        ("last_error", _F(ctypes.c_char_p)),
        ("kernels", ctypes.c_void_p * 64),
    ]


@pytest.fixture
def table(unusable):
    if "failed to load" in unusable.reason:
        pytest.skip(f"{unusable.name} plugin does not load here: {unusable.reason}")
    lib = ctypes.CDLL(unusable.library)  # the handle the core already holds
    entry = lib.tensor_ops_backend_v1
    entry.restype = ctypes.POINTER(_Table)
    t = entry().contents
    assert t.abi_version == 1, "plugin.h changed: update _Table in this test"
    return t


def test_table_reports_the_probe(table, unusable):
    assert table.name.decode() == unusable.name and table.flags == 0
    assert table.priority() == PRIORITY[unusable.name]
    assert table.device_count() == 0
    reason = ctypes.create_string_buffer(512)
    assert table.init(reason, len(reason)) == TO_ERR_BACKEND_UNAVAILABLE
    assert reason.value.decode() == unusable.reason
    for op, i in OP_IDS.items():
        assert table.kernels[i], f"{unusable.name} has no {op} kernel"


def test_table_error_paths_without_a_device(table, unusable):
    api = unusable.name  # the calls are named as the runtime that ran them
    err = lambda: table.last_error().decode()  # noqa: E731
    ptr = ctypes.c_void_p(1)
    assert table.allocate(0, 0, ctypes.byref(ptr)) == TO_OK and not ptr.value  # nothing to allocate
    assert table.allocate(0, 1024, ctypes.byref(ptr)) == TO_ERR_DEVICE
    assert re.search(rf"^{api}\w+\(.*\) returned \d+ \({api}Error\w+: .+\) at cuda/\w+\.(cuh|cpp):\d+$", err()), err()
    host = ctypes.create_string_buffer(16)
    assert table.copy(0, host, 0, host, 0, 16, 7) == TO_ERR_INVALID_ARGUMENT
    assert "copy kind 7" in err()
    assert table.copy(0, host, 0, host, 0, 16, 0) == TO_ERR_DEVICE
    assert table.memset(0, host, 0, 0, 16) == TO_ERR_DEVICE
    assert table.synchronize(0) == TO_ERR_DEVICE
    free_b, total_b = ctypes.c_uint64(), ctypes.c_uint64()
    assert table.mem_info(0, ctypes.byref(free_b), ctypes.byref(total_b)) == TO_ERR_DEVICE
    info = _DeviceInfo()
    assert table.device_info(0, ctypes.byref(info)) == TO_ERR_DEVICE
    assert err().startswith(f"{api}GetDeviceProperties("), err()
    table.deallocate(0, None, 0)  # a no-op, never a crash
    call = _OpCall(op=OP_IDS["silu"], n_inputs=1, n_outputs=1)
    for v in (call.inputs[0], call.outputs[0]):
        v.data, v.dtype, v.ndim = 4096, 0, 2
        v.shape[:2], v.strides[:2] = [1, 4], [4, 1]
    kernel = _F(ctypes.c_int, ctypes.POINTER(_OpCall))(table.kernels[OP_IDS["silu"]])
    assert kernel(ctypes.byref(call)) == TO_ERR_DEVICE
    assert re.search(rf"{api}\w+\(.*\) returned \d+", err()), err()


# --- with a usable device: conformance on torch device tensors vs float64 ---

def _torch_device_for(name):
    """torch's device tensors for this backend: CUDA builds for cuda, ROCm
    builds (which also say "cuda") for hip."""
    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs torch with a usable GPU")
    built_for = "hip" if getattr(torch.version, "hip", None) else "cuda"
    if built_for != name:
        pytest.skip(f"this torch drives {built_for} devices, not {name}")
    return torch.device("cuda", 0)


OPS = {
    "rms_norm": (lambda x, w, out: tensor_ops.rms_norm(x, w, 1e-6, out=out), lambda x, w: ref_rms_norm(x, w, 1e-6)),
    "silu": (lambda x, w, out: tensor_ops.silu(x, out=out), lambda x, w: ref_silu(x)),
    "gelu": (lambda x, w, out: tensor_ops.gelu(x, out=out), lambda x, w: ref_gelu(x)),
    "gelu_tanh": (lambda x, w, out: tensor_ops.gelu(x, "tanh", out=out), lambda x, w: ref_gelu(x, "tanh")),
}

# (name, rows, cols, layout): aligned rows take the 16-byte path, odd sizes
# and offsets the scalar one (or single elements up to a 16-byte boundary),
# >65535 rows the grid-stride over rows; "edges" has fixed tail values.
CASES = [
    ("one", 1, 1, "contiguous"),
    ("tiny_offset", 1, 2, "offset_both"),
    ("odd", 3, 7, "contiguous"),
    ("aligned", 4, 4096, "contiguous"),
    ("odd_cols", 6, 4099, "contiguous"),
    ("wide", 2, 8193, "contiguous"),
    ("many_rows", 70000, 8, "contiguous"),
    ("row_slice", 5, 1000, "row_slice"),
    ("offset_both", 3, 1024, "offset_both"),
    ("offset_x", 3, 1024, "offset_x"),
    ("in_place", 4, 4096, "in_place"),
    ("edges", 2, 16, "edges"),
]
EDGES = [-100.0, -20.0, -9.0, -4.0, -1.0, -1e-3, -0.0, 0.0, 1e-3, 0.5, 1.0, 4.0, 9.0, 20.0, 30.0, 100.0]


def _make(rng, rows, cols, dtype, dev, layout):
    tdt = getattr(torch, dtype)

    def host(shape):
        v = rng.standard_normal(shape) * 3
        if rows * cols < 64:
            # A few elements set the tolerance's scale themselves: keep them
            # where fp16 results stay normal numbers (no subnormal rounding).
            v = np.clip(v, -4, 4)
        return torch.from_numpy(v.astype(np.float32))

    w = host((cols,)).to(tdt).to(dev)
    if layout == "edges":
        x = torch.tensor([EDGES, EDGES[::-1]], dtype=torch.float32).to(tdt).to(dev)
        return x, w, None
    if layout == "row_slice":  # rows strided by cols + 8
        x = host((rows, cols + 8)).to(tdt).to(dev)[:, :cols]
        return x, w, None
    if layout in ("offset_both", "offset_x"):  # one element past a 16-byte boundary
        x = host((rows * cols + 1,)).to(tdt).to(dev)[1:].view(rows, cols)
        out = None
        if layout == "offset_both":
            out = torch.empty(rows * cols + 1, dtype=tdt, device=dev)[1:].view(rows, cols)
        return x, w, out
    x = host((rows, cols)).to(tdt).to(dev)
    return x, w, x if layout == "in_place" else None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_torch_device_conformance(usable, op, dtype, case, rng):
    dev = _torch_device_for(usable.name)
    _, rows, cols, layout = case
    x, w, out = _make(rng, rows, cols, dtype, dev, layout)
    run, ref = OPS[op]
    expect = ref(x, w)  # before an in-place run overwrites x
    y = run(x, w, out)
    torch.cuda.synchronize()
    assert y.device == dev and y.dtype == x.dtype
    if out is not None:
        assert y is out
    assert_close(y, expect, dtype, f"{usable.name} {op} {dtype} {case[0]}")


def test_devices_and_staging(usable, rng):
    ds = [d for d in tensor_ops.devices() if d.backend == usable.name]
    assert ds and all(d.device_type == "gpu" and d.is_available and d.total_memory_bytes > 0 for d in ds)
    props = ds[0].properties
    assert {"bf16", "fp8", "l2_bytes", "warp_size", "runtime_version"} <= set(props)
    assert ("sm_count" if usable.name == "cuda" else "compute_units") in props
    if usable.name == "cuda":
        assert re.fullmatch(r"\d+\.\d+", ds[0].compute_capability)
    for dtype in DTYPES:  # host arrays staged through the device pool
        x = (rng.standard_normal((5, 300)) * 3).astype(np.float32).astype(np_dtype(dtype))
        w = rng.standard_normal(300).astype(np.float32).astype(np_dtype(dtype))
        with tensor_ops.use(usable.name):
            y = tensor_ops.rms_norm(x, w)
            z = tensor_ops.zeros((3, 5), dtype, device=usable.name)
            t = tensor_ops.silu(tensor_ops.from_numpy(x, device=usable.name))
        assert_close(y, ref_rms_norm(x, w), dtype, f"staged rms_norm {dtype}")
        assert (z.numpy().astype(np.float32) == 0).all()
        assert_close(t.numpy(), ref_silu(x), dtype, f"resident silu {dtype}")
