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

import math

import tensor_ops
from conftest import DTYPES, assert_close, np_dtype, ref_gelu, ref_rms_norm, ref_silu, to64, torch
from test_ops_llm import (grad_close, ref_attention, ref_cross_entropy, ref_layer_norm, ref_rope, ref_softmax,
                          rope_tables)

GPU_BACKENDS = ["cuda", "hip"]
PRIORITY = {"cuda": 100, "hip": 90}
TO_OK, TO_ERR_INVALID_ARGUMENT, TO_ERR_BACKEND_UNAVAILABLE, TO_ERR_DEVICE = 0, 1, 3, 5
# ops.def: every op has a kernel in the GPU plugins.
OP_IDS = {"rms_norm": 0, "silu": 1, "gelu": 2, "layer_norm": 3, "rms_norm_backward": 4, "layer_norm_backward": 5,
          "add_rms_norm": 6, "softmax": 7, "softmax_backward": 8, "activation_backward": 9, "glu": 10,
          "glu_backward": 11, "rope": 12, "attention": 13, "attention_backward": 14, "cross_entropy": 15}


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
                ("ints", ctypes.c_int64 * 8), ("stream", ctypes.c_void_p)]


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
        # ABI 2
        ("stream_wait", _F(ctypes.c_int, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)),
    ]


def test_mirrors_match_plugin_h():
    """The ctypes structures above against the C declarations: the field
    names in order and the array sizes (a missed field shifts every one after)."""
    import os

    header = os.path.join(os.path.dirname(__file__), "..", "..", "cpp", "include", "tensor_ops", "plugin.h")
    if not os.path.exists(header):
        pytest.skip("needs the source tree's plugin.h")
    text = open(header).read()
    consts = {k: int(v) for k, v in re.findall(r"#define TENSOR_OPS_(MAX_\w+) (\d+)", text)}
    sizes = {"TENSOR_OPS_" + k: v for k, v in consts.items()}

    def fields(struct):
        body = re.search(r"typedef struct %s \{(.*?)\n\} %s;" % (struct, struct), text, re.S).group(1)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        out = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            m = re.search(r"\(\*(\w+)\)", decl) or re.search(r"(\w+)(?:\[(\w+)\])?$", decl)
            n = m.group(2) if m.lastindex and m.lastindex >= 2 else None
            out.append((m.group(1), (sizes[n] if n in sizes else int(n)) if n else None))
        return out

    def mirror(cls):
        return [(name, getattr(ty, "_length_", None)) for name, ty in cls._fields_]

    assert mirror(_View) == fields("to_tensor")
    assert mirror(_OpCall) == fields("to_op_call")
    assert mirror(_DeviceInfo) == fields("to_device_info")
    assert mirror(_Table) == fields("to_backend_v1")
    assert re.search(r"#define TENSOR_OPS_PLUGIN_ABI_VERSION 2u", text), "plugin.h changed: update _Table"


@pytest.fixture
def table(unusable):
    if "failed to load" in unusable.reason:
        pytest.skip(f"{unusable.name} plugin does not load here: {unusable.reason}")
    lib = ctypes.CDLL(unusable.library)  # the handle the core already holds
    entry = lib.tensor_ops_backend_v1
    entry.restype = ctypes.POINTER(_Table)
    t = entry().contents
    assert t.abi_version == 2, "plugin.h changed: update _Table in this test"
    return t


def test_table_reports_the_probe(table, unusable):
    # device pointers, not handles (TO_BACKEND_HANDLE_MEMORY 1); the cross-entropy options read (TO_BACKEND_CE_OPTIONS 4),
    # rms_norm's weight offset too (TO_BACKEND_NORM_OFFSET 8)
    assert table.name.decode() == unusable.name and table.flags == 4 | 8
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
    call.stream = 0x1000  # a caller's stream: the device check fails first, nothing is launched on it
    assert kernel(ctypes.byref(call)) == TO_ERR_DEVICE
    assert table.stream_wait, "the GPU plugins order DLPack exports with stream_wait"
    assert table.stream_wait(0, None, None) == TO_ERR_DEVICE
    assert re.search(rf"^{api}(GetDevice|SetDevice|EventCreateWithFlags)\(.*\) returned \d+ \({api}Error\w+: .+\)",
                     err()), err()


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


# --- the LLM op set on torch device tensors vs float64 (and torch autograd) ---

def _dev_tensor(rng, shape, dtype, dev, scale=1.0):
    v = (rng.standard_normal(shape) * scale).astype(np.float32)
    return torch.from_numpy(v).to(getattr(torch, dtype)).to(dev)


def _rows(rng, rows, cols, dtype, dev, layout, scale=1.0):
    """[rows, cols] device tensors: contiguous, rows strided by cols + 8
    ("row_slice", the scalar path) or one element past a 16-byte boundary
    ("offset")."""
    if layout == "row_slice":
        return _dev_tensor(rng, (rows, cols + 8), dtype, dev, scale)[:, :cols]
    if layout == "offset":
        return _dev_tensor(rng, (rows * cols + 1,), dtype, dev, scale)[1:].view(rows, cols)
    return _dev_tensor(rng, (rows, cols), dtype, dev, scale)


def _assert_close_inf(got, ref, dtype, what, factor=None):
    """assert_close (grad_close with a factor) where ref may hold -inf
    (masked log_softmax, lse): those places must be -inf exactly."""
    g = to64(got)
    inf = np.isneginf(ref)
    assert (np.isneginf(g) == inf).all(), f"{what}: -inf at {np.argwhere(np.isneginf(g) != inf)[:5].tolist()}"
    g, ref = np.where(inf, 0.0, g), np.where(inf, 0.0, ref)
    if factor is None:
        assert_close(g, ref, dtype, what)
    else:
        grad_close(g, torch.from_numpy(ref), dtype, what, factor)


ROW_SHAPES = [(1, 1), (3, 7), (4, 64), (6, 4099), (2, 8192), (2, 8193), (70000, 8)]
ROW_LAYOUTS = ["contiguous", "row_slice", "offset"]


@pytest.mark.parametrize("layout", ROW_LAYOUTS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_norms(usable, dtype, shape, layout, rng):
    dev = _torch_device_for(usable.name)
    rows, cols = shape
    x, r = _rows(rng, rows, cols, dtype, dev, layout, 3), _rows(rng, rows, cols, dtype, dev, layout)
    w, b = _dev_tensor(rng, (cols,), dtype, dev), _dev_tensor(rng, (cols,), dtype, dev)
    what = f"{usable.name} {dtype} {rows}x{cols} {layout}"
    assert_close(tensor_ops.layer_norm(x, w, b, 1e-5), ref_layer_norm(x, w, b, 1e-5), dtype, "layer_norm " + what)
    assert_close(tensor_ops.layer_norm(x, w, None, 1e-5), ref_layer_norm(x, w, None, 1e-5), dtype,
                 "layer_norm no bias " + what)
    y, res = tensor_ops.add_rms_norm(x, r, w, 1e-6)
    torch.cuda.synchronize()
    s = (x.float() + r.float()).to(x.dtype)  # the stored residual
    assert_close(res, to64(s), dtype, "add_rms_norm residual " + what)
    assert_close(y, ref_rms_norm(s, w, 1e-6), dtype, "add_rms_norm " + what)
    expect = ref_layer_norm(x, w, b, 1e-5)
    y = tensor_ops.layer_norm(x, w, b, 1e-5, out=x)  # in place
    torch.cuda.synchronize()
    assert y is x
    assert_close(y, expect, dtype, "layer_norm in place " + what)


@pytest.mark.parametrize("layout", ROW_LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (6, 4099), (2, 8192), (300, 33)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_norm_grads(usable, dtype, shape, layout, rng):
    dev = _torch_device_for(usable.name)
    F = torch.nn.functional
    rows, cols = shape
    x, dy = _rows(rng, rows, cols, dtype, dev, layout), _rows(rng, rows, cols, dtype, dev, layout)
    w, b = _dev_tensor(rng, (cols,), dtype, dev), _dev_tensor(rng, (cols,), dtype, dev)
    t64 = lambda a: torch.tensor(to64(a), requires_grad=True)  # noqa: E731
    tx, tw = t64(x), t64(w)
    F.rms_norm(tx, (cols,), tw, 1e-6).backward(torch.tensor(to64(dy)))
    dx, dw = tensor_ops.rms_norm_backward(dy, x, w, 1e-6)
    torch.cuda.synchronize()
    assert dx.device == dev and dw.device == dev
    grad_close(dx, tx.grad, dtype, "rms dx")
    grad_close(dw, tw.grad, dtype, "rms dw")
    # dweight is a fixed-order two-stage sum: the same bits every run
    assert torch.equal(dw, tensor_ops.rms_norm_backward(dy, x, w, 1e-6)[1])
    tx, tw, tb = t64(x), t64(w), t64(b)
    F.layer_norm(tx, (cols,), tw, tb, 1e-5).backward(torch.tensor(to64(dy)))
    dx, dw, db = tensor_ops.layer_norm_backward(dy, x, w, 1e-5)
    torch.cuda.synchronize()
    grad_close(dx, tx.grad, dtype, "ln dx")
    grad_close(dw, tw.grad, dtype, "ln dw")
    grad_close(db, tb.grad, dtype, "ln db")


def test_gpu_norm_grads_no_rows(usable):
    dev = _torch_device_for(usable.name)
    e, w = torch.ones((0, 19), device=dev), torch.ones(19, device=dev)
    dx, dw, db = tensor_ops.layer_norm_backward(e, e, w)
    torch.cuda.synchronize()
    assert dx.shape == (0, 19) and (dw == 0).all() and (db == 0).all()


SOFTMAX_SHAPES = [(3, 1), (2, 7), (4, 64), (2, 4095), (1, 8193), (2, 3, 5, 9), (4, 6, 64), (3, 5, 3), (70000, 8)]


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_softmax(usable, dtype, shape, rng):
    dev = _torch_device_for(usable.name)
    x = _dev_tensor(rng, shape, dtype, dev, 4)
    what = f"{usable.name} {dtype} {shape}"
    assert_close(tensor_ops.softmax(x, scale=0.5), ref_softmax(x, 0.5), dtype, "softmax " + what)
    assert_close(tensor_ops.log_softmax(x), ref_softmax(x, log=True), dtype, "log_softmax " + what)
    if len(shape) >= 2:  # (3, 5, 3): 5 queries, 3 keys: rows 0, 1 fully masked -> 0 / -inf
        assert_close(tensor_ops.softmax(x, causal=True), ref_softmax(x, causal=True), dtype, "causal " + what)
        ref = ref_softmax(x, 0.7, causal=True, log=True)  # NaN on rows that see nothing: -inf there
        _assert_close_inf(tensor_ops.log_softmax(x, scale=0.7, causal=True), np.where(np.isnan(ref), -np.inf, ref),
                          dtype, "causal log " + what)
        strided = x[..., : shape[-1] - 1] if shape[-1] > 1 else x
        assert_close(tensor_ops.softmax(strided), ref_softmax(strided), dtype, "row_slice " + what)
    dy = _dev_tensor(rng, shape, dtype, dev)
    for log in (False, True):
        y = tensor_ops.log_softmax(x, scale=0.7) if log else tensor_ops.softmax(x, scale=0.7)
        bwd = tensor_ops.log_softmax_backward if log else tensor_ops.softmax_backward
        dx = bwd(dy, y, scale=0.7)
        torch.cuda.synchronize()
        # The op's definition on the stored y, in float64 ...
        y64, g64 = to64(y), to64(dy)
        if log:
            ref = g64 - np.exp(y64) * g64.sum(-1, keepdims=True)
        else:
            ref = y64 * (g64 - (g64 * y64).sum(-1, keepdims=True))
        grad_close(dx, torch.from_numpy(0.7 * ref), dtype, f"softmax backward log={log} " + what)
        if dtype == "float32":  # ... and torch autograd from x (16-bit y rounding moves the result off that)
            tx = torch.tensor(to64(x), requires_grad=True)
            (torch.log_softmax(0.7 * tx, -1) if log else torch.softmax(0.7 * tx, -1)).backward(torch.tensor(g64))
            grad_close(dx, tx.grad, dtype, f"softmax backward vs autograd log={log} " + what)


@pytest.mark.parametrize("layout", ROW_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_gated_and_activation_grads(usable, dtype, layout, rng):
    dev = _torch_device_for(usable.name)
    F = torch.nn.functional
    for rows, cols in [(1, 1), (3, 7), (5, 77), (4, 4099)]:
        g, u, dy = (_rows(rng, rows, cols, dtype, dev, layout, 3) for _ in range(3))
        what = f"{usable.name} {dtype} {rows}x{cols} {layout}"
        assert_close(tensor_ops.swiglu(g, u), ref_silu(g) * to64(u), dtype, "swiglu " + what)
        assert_close(tensor_ops.geglu(g, u), ref_gelu(g) * to64(u), dtype, "geglu " + what)
        assert_close(tensor_ops.geglu(g, u, "tanh"), ref_gelu(g, "tanh") * to64(u), dtype, "geglu tanh " + what)
        for name, f, ours in [
            ("silu", F.silu, lambda: tensor_ops.silu_backward(dy, g)),
            ("gelu", F.gelu, lambda: tensor_ops.gelu_backward(dy, g)),
            ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"), lambda: tensor_ops.gelu_backward(dy, g, "tanh")),
        ]:
            tx = torch.tensor(to64(g), requires_grad=True)
            f(tx).backward(torch.tensor(to64(dy)))
            grad_close(ours(), tx.grad, dtype, name + " backward " + what)
        for name, f, ours in [
            ("swiglu", F.silu, lambda: tensor_ops.swiglu_backward(dy, g, u)),
            ("geglu", F.gelu, lambda: tensor_ops.geglu_backward(dy, g, u)),
            ("geglu_tanh", lambda t: F.gelu(t, approximate="tanh"),
             lambda: tensor_ops.geglu_backward(dy, g, u, "tanh")),
        ]:
            tg, tu = torch.tensor(to64(g), requires_grad=True), torch.tensor(to64(u), requires_grad=True)
            (f(tg) * tu).backward(torch.tensor(to64(dy)))
            dg, du = ours()
            torch.cuda.synchronize()
            grad_close(dg, tg.grad, dtype, name + " dgate " + what)
            grad_close(du, tu.grad, dtype, name + " dup " + what)
    expect = ref_silu(g) * to64(u)
    out = tensor_ops.swiglu(g, u, out=g)  # in place
    torch.cuda.synchronize()
    assert out is g
    assert_close(out, expect, dtype, "swiglu in place")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(2, 5, 3, 8, 8), (1, 7, 2, 64, 32), (3, 1, 1, 6, 2), (1, 3, 5, 130, 128)])
def test_gpu_rope(usable, dims, interleaved, dtype, rng):
    dev = _torch_device_for(usable.name)
    B, S, H, D, R = dims
    x = _dev_tensor(rng, (B, S, H, D), dtype, dev)
    cos, sin = rope_tables(S + 5, R, dtype)
    tcos, tsin = (torch.from_numpy(to64(t).astype(np.float32)).to(x.dtype).to(dev) for t in (cos, sin))
    pos = rng.integers(0, S + 5, size=(B, S)).astype(np.int64)
    what = f"{usable.name} {dtype} {dims} interleaved={interleaved}"
    for p in (torch.from_numpy(pos).to(dev), torch.from_numpy(pos.astype(np.int32)).to(dev)):
        assert_close(tensor_ops.rope(x, tcos, tsin, p, interleaved), ref_rope(x, cos, sin, pos, interleaved),
                     dtype, f"rope {p.dtype} " + what)
    assert_close(tensor_ops.rope_backward(x, tcos, tsin, torch.from_numpy(pos).to(dev), interleaved),
                 ref_rope(x, cos, sin, pos, interleaved, inverse=True), dtype, "rope inverse " + what)
    default = ref_rope(x, cos, sin, np.arange(S)[None, :], interleaved)
    assert_close(tensor_ops.rope(x, tcos, tsin, interleaved=interleaved), default, dtype, "rope default " + what)
    bad = torch.from_numpy(pos).to(dev)
    bad[0, -1] = S + 5
    with pytest.raises(ValueError, match=re.escape(f"a position is outside the cos/sin tables [0, {S + 5})")):
        tensor_ops.rope(x, tcos, tsin, bad, interleaved)


def _ref_lse(q, k, causal, scale):
    q, k = to64(q), to64(k)
    g = q.shape[1] // k.shape[1]
    s = q @ np.swapaxes(np.repeat(k, g, 1), -1, -2) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.arange(lk)[None, :] > np.arange(lq)[:, None] + lk - lq, -np.inf, s)
    m = np.max(s, -1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (m + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1, keepdims=True)))[..., 0]


GPU_ATTN_SHAPES = [  # B, Hq, Hkv, Lq, Lk, D: GQA, Lq != Lk, Lq > Lk (fully masked causal rows), head dims to 256
    (1, 1, 1, 1, 1, 1),
    (2, 4, 2, 7, 9, 16),
    (1, 3, 3, 65, 65, 8),
    (1, 8, 1, 5, 130, 64),
    (2, 2, 2, 9, 4, 32),
    (1, 4, 2, 100, 300, 128),
    (1, 2, 1, 33, 70, 256),
    (2, 6, 3, 129, 129, 96),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_ATTN_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_gpu_attention(usable, shape, causal, dtype, rng):
    dev = _torch_device_for(usable.name)
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = (_dev_tensor(rng, (B, h, L, D), dtype, dev) for h, L in [(Hq, Lq), (Hkv, Lk), (Hkv, Lk)])
    what = f"{usable.name} {dtype} {shape} causal={causal}"
    out, lse = tensor_ops.attention(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert lse.dtype == torch.float32 and lse.device == dev and tuple(lse.shape) == (B, Hq, Lq)
    assert_close(out, np.nan_to_num(ref_attention(q, k, v, causal, 1 / math.sqrt(D))), dtype, "out " + what)
    _assert_close_inf(lse, _ref_lse(q, k, causal, 1 / math.sqrt(D)), "float32", "lse " + what, factor=4)
    assert_close(tensor_ops.attention(q, k, v, causal, scale=0.3),
                 np.nan_to_num(ref_attention(q, k, v, causal, 0.3)), dtype, "scale " + what)
    # gradients vs torch float64 autograd (the backward reads the stored out)
    do = _dev_tensor(rng, (B, Hq, Lq, D), dtype, dev)
    dq, dk, dv = tensor_ops.attention_backward(do, q, k, v, out, lse, causal=causal)
    torch.cuda.synchronize()
    tq, tk, tv = (torch.tensor(to64(t), requires_grad=True) for t in (q, k, v))
    g = Hq // Hkv
    s = tq @ tk.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))
    (p @ tv.repeat_interleave(g, 1)).backward(torch.tensor(to64(do)))
    f = 4 if dtype == "float32" else 12
    grad_close(dq, tq.grad, dtype, "dq " + what, f)
    grad_close(dk, tk.grad, dtype, "dk " + what, f)
    grad_close(dv, tv.grad, dtype, "dv " + what, f)


def test_gpu_attention_head_dim_limit(usable):
    dev = _torch_device_for(usable.name)
    q = torch.ones((1, 1, 2, 4096), device=dev)
    with pytest.raises(NotImplementedError, match="head_dim 4096"):
        tensor_ops.attention(q, q, q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 7, 4095, 8193, 32000])
def test_gpu_cross_entropy(usable, C, dtype, rng):
    dev = _torch_device_for(usable.name)
    N = 6
    logits = _dev_tensor(rng, (N, C), dtype, dev, 3)
    target = rng.integers(0, C, size=N).astype(np.int64)
    target[2] = -100
    loss_rows, grad, n = ref_cross_entropy(logits, target)
    what = f"{usable.name} {dtype} C={C}"
    for tg in (torch.from_numpy(target).to(dev), torch.from_numpy(target.astype(np.int32)).to(dev)):
        rows, dl = tensor_ops.cross_entropy_with_grad(logits, tg, reduction="none")
        torch.cuda.synchronize()
        assert_close(rows, loss_rows, "float32", f"loss {tg.dtype} " + what)
        assert_close(dl, grad, dtype, f"dlogits {tg.dtype} " + what)
    mean = tensor_ops.cross_entropy(logits, torch.from_numpy(target).to(dev))
    assert abs(float(mean) - loss_rows.sum() / n) <= 1e-5 * abs(loss_rows.sum() / n) + 1e-6
    bad = torch.from_numpy(target).to(dev)
    bad[0] = C
    with pytest.raises(ValueError, match=re.escape(f"a target is outside [0, {C}) and is not the ignore_index -100")):
        tensor_ops.cross_entropy(logits, bad)


# --- streams: torch's current stream, DLPack export waits (Note [DLPack streams]) ---

def _late_on(stream, dev, value):
    """A tensor that holds `value` only once `stream` gets past a long sleep:
    a kernel on any other stream would read its zeros."""
    t = torch.zeros_like(value, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        t.copy_(value)
    return t


def test_gpu_ops_run_on_torchs_current_stream(usable, rng):
    dev = _torch_device_for(usable.name)
    side = torch.cuda.Stream(dev)
    x = _dev_tensor(rng, (64, 1000), "float32", dev, 3)
    w = _dev_tensor(rng, (1000,), "float32", dev)
    late = _late_on(side, dev, x)
    with torch.cuda.stream(side):
        y = tensor_ops.rms_norm(late, w)
        out = torch.empty_like(x)
        tensor_ops.silu(late, out=out)
    side.synchronize()
    assert_close(y, ref_rms_norm(x, w), "float32", "rms_norm on torch's side stream")
    assert_close(out, ref_silu(x), "float32", "silu out= on torch's side stream")


def test_gpu_export_makes_the_consumer_wait(usable, rng):
    dev = _torch_device_for(usable.name)
    x = (rng.standard_normal((256, 1024)) * 3).astype(np.float32)
    side = torch.cuda.Stream(dev)
    t = tensor_ops.from_numpy(x, device=usable.name)
    # Our kernel on side (behind a sleep), the consumer (torch) on its default stream.
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
    with tensor_ops.memory.use_stream(side.cuda_stream, f"{usable.name}:0"):
        y = tensor_ops.silu(t)
        got = torch.from_dlpack(y)  # asks with stream=1: its stream waits for side
    assert_close(got.clone(), ref_silu(x), "float32", "export to torch's default stream")
    torch.cuda.synchronize()
    bad = 1 if usable.name == "hip" else 0  # a sentinel the other runtime does not define
    with pytest.raises(ValueError, match=f"stream={bad}"):
        y.__dlpack__(stream=bad)
    y.__dlpack__(stream=-1)  # no synchronisation asked for: fine
