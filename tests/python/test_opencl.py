"""The OpenCL plugin (opencl/) on whatever OpenCL device is here (PoCL's CPU
device in CI): every op staged from numpy and resident on "opencl:0" vs a
float64 reference, chains without round trips, the on-disk binary cache
(hits, corrupt entries rebuilt), build errors, and the no-driver path."""
import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensor_ops
from conftest import DTYPES, assert_close, ml_dtypes, np_dtype, ref_gelu, ref_rms_norm, ref_silu


def _status():
    for b in tensor_ops.backends():
        if b.name == "opencl":
            return b
    raise AssertionError("tensor_ops.backends() does not list opencl")


STATUS = _status()
if not STATUS.compiled:
    pytest.skip(f"opencl plugin not compiled: {STATUS.reason}", allow_module_level=True)

# The no-driver test needs only the plugin; everything else a usable device.
needs_device = pytest.mark.skipif(not STATUS.usable, reason=f"opencl is not usable here: {STATUS.reason}")

DEVICE = "opencl:0"
HIDDEN = [1, 7, 64, 4095, 4096, 8193]
OPS = {
    "rms_norm": (lambda x, w, out=None: tensor_ops.rms_norm(x, w, 1e-6, out=out), lambda x, w: ref_rms_norm(x, w, 1e-6)),
    "silu": (lambda x, w, out=None: tensor_ops.silu(x, out=out), lambda x, w: ref_silu(x)),
    "gelu": (lambda x, w, out=None: tensor_ops.gelu(x, out=out), lambda x, w: ref_gelu(x)),
    "gelu_tanh": (lambda x, w, out=None: tensor_ops.gelu(x, "tanh", out=out), lambda x, w: ref_gelu(x, "tanh")),
}


def make(rng, shape, dtype, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def device_props(device_id=0):
    for d in tensor_ops.devices():
        if d.backend == "opencl" and d.device_id == device_id:
            return d.properties
    raise AssertionError("devices() lists no opencl device")


def run_py(code, *args, **env):
    e = {k: v for k, v in os.environ.items() if k != "TENSOR_OPS_BACKEND"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=e, timeout=600)


# --- status and devices ---

@needs_device
def test_listed_usable_with_priority():
    assert [b.name for b in tensor_ops.backends()].count("opencl") == 1
    assert STATUS.library.endswith("libtensor_ops_opencl.so") and STATUS.reason == ""
    gpu = any(d.device_type == "gpu" for d in tensor_ops.devices() if d.backend == "opencl")
    # Above the CPU backend (50) only with a GPU; PoCL runs only when asked.
    assert STATUS.priority == (70 if gpu else 40)
    if not gpu:
        assert run_py("import tensor_ops; print(tensor_ops.get_backend())").stdout.split()[-1] == "cpu"


@needs_device
def test_devices_report_the_opencl_facts():
    ds = [d for d in tensor_ops.devices() if d.backend == "opencl"]
    assert ds and [d.device_id for d in ds] == list(range(len(ds)))
    rank = {"gpu": 0, "accelerator": 1, "cpu": 2, "other": 3}
    assert [rank[d.device_type] for d in ds] == sorted(rank[d.device_type] for d in ds), "best device first"
    for d in ds:
        assert d.device_name and d.vendor and d.driver_version and d.is_available
        assert d.total_memory_bytes > 0 and d.compute_capability.startswith("OpenCL C ")
        p = d.properties
        for key in ["platform", "platform_version", "opencl_c_version", "device_type", "compute_units",
                    "max_work_group_size", "max_alloc_bytes", "local_mem_bytes", "fp16", "fp64", "bf16",
                    "fp16_storage", "binary_cache_dir", "binary_cache_hits", "binary_cache_misses",
                    "binary_cache_rejected", "host_to_device_copies", "device_to_host_copies"]:
            assert key in p, f"{d.device_name}: no {key} in {p}"
        assert p["device_type"] == d.device_type.upper()
        assert int(p["compute_units"]) >= 1 and int(p["max_work_group_size"]) >= 1
        assert p["fp16"] in ("0", "1") and p["fp64"] in ("0", "1") and p["fp16_storage"] == "1"
        assert p["opencl_c_version"] == d.compute_capability
    pocl = [d for d in ds if "Portable Computing Language" in d.properties["platform"]]
    if pocl:  # CI: PoCL's CPU device, OpenCL C 1.2 without cl_khr_fp16
        assert pocl[0].device_type == "cpu" and pocl[0].properties["fp16"] == "0"


@needs_device
def test_mem_info_counts_what_the_plugin_holds():
    before = tensor_ops.memory_stats(DEVICE)
    total = before["device_total_bytes"]
    assert total == [d for d in tensor_ops.devices() if d.backend == "opencl"][0].total_memory_bytes
    t = tensor_ops.zeros((1 << 20,), "float32", device=DEVICE)  # 4 MiB, filled by clEnqueueFillBuffer
    after = tensor_ops.memory_stats(DEVICE)
    assert after["device_free_bytes"] <= total - (4 << 20)
    assert (t.numpy() == 0).all()


@needs_device
def test_allocation_past_the_device_limit_is_out_of_memory():
    p = device_props()
    max_alloc, total = int(p["max_alloc_bytes"]), tensor_ops.memory_stats(DEVICE)["device_total_bytes"]
    n = max_alloc + (1 << 20)
    if n * 1.25 > total:
        pytest.skip("the device allows one buffer of nearly all its memory: the core's free check fires first")
    with pytest.raises(tensor_ops.OutOfMemoryError, match="CL_DEVICE_MAX_MEM_ALLOC_SIZE"):
        tensor_ops.empty((n // 4,), "float32", device=DEVICE)


# --- conformance vs float64 ---

@needs_device
@pytest.mark.parametrize("resident", [False, True], ids=["staged", "resident"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_conformance(op, dtype, hidden, resident, rng):
    x = make(rng, (3, hidden), dtype)
    w = make(rng, (hidden,), dtype, 1.0)
    run, ref = OPS[op]
    if resident:
        xt, wt = tensor_ops.from_numpy(x, device=DEVICE), tensor_ops.from_numpy(w, device=DEVICE)
        yt = run(xt, wt)
        assert isinstance(yt, tensor_ops.Tensor) and yt.device == DEVICE and yt.dtype == dtype
        y = yt.numpy()
    else:
        with tensor_ops.use("opencl"):
            y = run(x, w)
        assert isinstance(y, np.ndarray)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref(x, w), dtype, f"opencl {'resident' if resident else 'staged'} {op} {dtype} {x.shape}")


@needs_device
@pytest.mark.parametrize("shape", [(4096,), (2, 3, 7), (2, 1, 3, 64), (5, 1, 4095)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_ranks(op, dtype, shape, rng):
    x = make(rng, shape, dtype)
    w = make(rng, shape[-1:], dtype, 1.0)
    run, ref = OPS[op]
    with tensor_ops.use("opencl"):
        y = run(x, w)
    assert_close(y, ref(x, w), dtype, f"staged {op} {dtype} {shape}")
    yt = run(tensor_ops.from_numpy(x, device=DEVICE), tensor_ops.from_numpy(w, device=DEVICE))
    assert yt.shape == shape
    assert_close(yt.numpy(), ref(x, w), dtype, f"resident {op} {dtype} {shape}")


@needs_device
@pytest.mark.parametrize("op", ["silu", "gelu", "gelu_tanh"])
def test_special_values(op):
    x = np.array([0.0, -0.0, np.nan, 1e-30, -1e-30, 20.0, -20.0, 1e4, -1e4, 100.0, -100.0], np.float32)
    with tensor_ops.use("opencl"):
        y = OPS[op][0](x, None)
    ref = OPS[op][1](x, None)
    assert np.isnan(y[2])
    fin = np.isfinite(ref)
    np.testing.assert_allclose(y[fin].astype(np.float64), ref[fin], rtol=1e-5, atol=1e-30)


@needs_device
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_stores_round_to_nearest_even_and_keep_nan(dtype, op, rng):
    # The same fp32 math on the same (exact) inputs: the 16-bit result must
    # be the fp32 result rounded to nearest even, NaN kept NaN.
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0 if dtype == "float16" else 3e38]
    x = np.concatenate([special, rng.standard_normal(4090) * 4]).astype(np.float32).astype(np_dtype(dtype))
    x = x.reshape(2, 2048)
    w = make(rng, (2048,), dtype, 1.0)
    run = OPS[op][0]
    with tensor_ops.use("opencl"):
        y = run(x, w)
        y32 = run(x.astype(np.float32), w.astype(np.float32))
    want = y32.astype(np_dtype(dtype))
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(y.astype(np.float32)) == nan).all()
    np.testing.assert_array_equal(y.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@needs_device
def test_rms_norm_rows_isolated_and_eps(rng):
    x = make(rng, (3, 64), "float32")
    x[1, 5] = np.nan
    with tensor_ops.use("opencl"):
        y = tensor_ops.rms_norm(x, np.ones(64, np.float32))
        z = tensor_ops.rms_norm(np.zeros((2, 8), np.float32), np.ones(8, np.float32))
        big = tensor_ops.rms_norm(x[[0, 2]], np.ones(64, np.float32), eps=1e30)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
    assert (z == 0).all()
    assert_close(big, ref_rms_norm(x[[0, 2]], np.ones(64, np.float32), 1e30), "float32", "huge eps")


@needs_device
def test_many_rows_and_a_row_slice(rng):
    x = make(rng, (20000, 8), "float32")
    w = make(rng, (8,), "float32", 1.0)
    with tensor_ops.use("opencl"):
        assert_close(tensor_ops.rms_norm(x, w), ref_rms_norm(x, w), "float32", "20000 rows")
        # A strided view of the input: the Python layer copies it contiguous for staging.
        wide = make(rng, (5, 1000 + 8), "float32")
        assert_close(tensor_ops.silu(wide[:, :1000]), ref_silu(wide[:, :1000]), "float32", "row slice")


@needs_device
def test_row_strided_out(rng):
    """out= a row-strided view (every other row): written through a
    contiguous buffer (staging needs whole tensors; it raised a LayoutError
    naming neither out nor the strides), the rows between left as they were."""
    x = make(rng, (5, 33), "float32")
    w = make(rng, (33,), "float32", 1.0)
    buf = np.full((10, 33), 7.0, np.float32)
    with tensor_ops.use("opencl"):
        assert tensor_ops.rms_norm(x, w, out=buf[::2]) is not None
    assert_close(buf[::2], ref_rms_norm(x, w, 1e-6), "float32", "strided out")
    assert (buf[1::2] == 7.0).all()


@needs_device
@pytest.mark.parametrize("group", [2, 64, 256])
def test_rms_norm_work_group_reduction(group, tmp_path):
    """The reduction over several work-items per row (what a GPU runs; a
    CPU device defaults to one item per row), in place too."""
    r = run_py("""
        import sys, numpy as np, tensor_ops
        rng = np.random.default_rng(3)
        out = {}
        for cols in (1, 7, 64, 4095, 8193):
            for dt in ("float32", "float16"):
                x = (rng.standard_normal((3, cols)) * 3).astype(dt)
                w = rng.standard_normal(cols).astype(dt)
                xt = tensor_ops.from_numpy(x, device="opencl:0")
                tensor_ops.rms_norm(xt, tensor_ops.from_numpy(w, device="opencl:0"), out=xt)
                out[f"{dt}_{cols}_x"], out[f"{dt}_{cols}_w"], out[f"{dt}_{cols}_y"] = x, w, xt.numpy()
        np.savez(sys.argv[1], **out)
    """, str(tmp_path / "out.npz"), TENSOR_OPS_OPENCL_RMS_NORM_GROUP=str(group))
    assert r.returncode == 0, r.stderr
    data = np.load(tmp_path / "out.npz")
    for cols in (1, 7, 64, 4095, 8193):
        for dt in ("float32", "float16"):
            x, w, y = (data[f"{dt}_{cols}_{k}"] for k in "xwy")
            assert_close(y, ref_rms_norm(x, w), dt, f"group {group} {dt} cols {cols} in place")


# --- resident tensors: chains, in place, out= ---

@needs_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_on_device_without_round_trips(dtype, rng):
    x = make(rng, (6, 4095), dtype)
    w = make(rng, (4095,), dtype, 1.0)
    xt, wt = tensor_ops.from_numpy(x, device=DEVICE), tensor_ops.from_numpy(w, device=DEVICE)
    before = device_props()
    y = tensor_ops.rms_norm(xt, wt)
    s = tensor_ops.silu(y)
    g = tensor_ops.gelu(s, "tanh")
    e = tensor_ops.empty(g.shape, dtype, device=DEVICE)
    out = tensor_ops.gelu(g, out=e)
    after = device_props()
    assert out is e and all(t.device == DEVICE for t in (y, s, g, e))
    for key in ("host_to_device_copies", "device_to_host_copies"):
        assert after[key] == before[key], f"{key}: the chain copied between host and device"
    # Each stage against the reference of what the stage before produced.
    y_h, s_h, g_h, e_h = y.numpy(), s.numpy(), g.numpy(), e.numpy()
    assert_close(y_h, ref_rms_norm(x, w), dtype, "rms_norm")
    assert_close(s_h, ref_silu(y_h), dtype, "silu")
    assert_close(g_h, ref_gelu(s_h, "tanh"), dtype, "gelu tanh")
    assert_close(e_h, ref_gelu(g_h), dtype, "gelu")
    assert int(device_props()["device_to_host_copies"]) == int(after["device_to_host_copies"]) + 4


@needs_device
@pytest.mark.parametrize("op", list(OPS))
def test_in_place_on_device(op, rng):
    x = make(rng, (4, 4096), "float32")
    w = make(rng, (4096,), "float32", 1.0)
    run, ref = OPS[op]
    xt, wt = tensor_ops.from_numpy(x, device=DEVICE), tensor_ops.from_numpy(w, device=DEVICE)
    assert run(xt, wt, out=xt) is xt
    assert_close(xt.numpy(), ref(x, w), "float32", f"{op} in place")


@needs_device
def test_copies_round_trip_bit_exact_and_zeros(rng):
    for dtype in DTYPES:
        x = make(rng, (3, 33), dtype)
        t = tensor_ops.from_numpy(x, device=DEVICE)
        assert t.to(DEVICE).device == DEVICE
        back = t.to("cpu")
        assert back.device == "cpu"
        bits = np.uint32 if dtype == "float32" else np.uint16
        np.testing.assert_array_equal(back.numpy().view(bits), x.view(bits))
        np.testing.assert_array_equal(t.numpy().view(bits), x.view(bits))
        z = tensor_ops.zeros((5, 7), dtype, device=DEVICE)
        assert (z.numpy().astype(np.float32) == 0).all()


# --- errors ---

@needs_device
def test_mixing_device_tensor_and_host_array_is_a_clear_error(rng):
    x = make(rng, (2, 16), "float32")
    xt = tensor_ops.from_numpy(x, device=DEVICE)
    with pytest.raises(ValueError, match=r"rms_norm: weight is on cpu but x is on opencl:0"):
        tensor_ops.rms_norm(xt, np.ones(16, np.float32))
    with pytest.raises(ValueError, match=r"silu: out is on cpu but x is on opencl:0"):
        tensor_ops.silu(xt, out=np.empty((2, 16), np.float32))
    with pytest.raises(ValueError, match=r"gelu: out is on opencl:0 but x is on cpu"):
        tensor_ops.gelu(x, out=tensor_ops.empty((2, 16), device=DEVICE))
    with pytest.raises(TypeError, match="dtype"):
        tensor_ops.rms_norm(xt, tensor_ops.from_numpy(np.ones(16, np.float16), device=DEVICE))
    with pytest.raises(ValueError, match="does not exist"):
        tensor_ops.from_numpy(x, device="opencl:99")


@needs_device
def test_build_error_carries_the_compiler_log(tmp_path):
    # "-DT=1" turns the storage typedef into a syntax error.
    r = run_py("""
        import numpy as np, tensor_ops
        try:
            with tensor_ops.use("opencl"):
                tensor_ops.silu(np.ones(8, np.float32))
        except tensor_ops.DeviceError as e:
            print("ERROR:", e)
    """, TENSOR_OPS_CACHE_DIR=str(tmp_path), TENSOR_OPS_OPENCL_BUILD_OPTIONS="-DT=1")
    msg = r.stdout.partition("ERROR: ")[2]
    assert msg, r.stdout + r.stderr
    assert "building the OpenCL kernels for float32" in msg
    assert re.search(r"clBuildProgram returned -11 CL_BUILD_PROGRAM_FAILURE \(options \"-DTO_DTYPE_F32 -DT=1\"\)", msg)
    assert "build log:" in msg and "dtype.cl:" in msg, msg  # the log names the .cl file and line


# --- the binary cache ---

CACHE_RUN = """
    import json, sys, numpy as np, tensor_ops
    dtypes = sys.argv[1:]
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 300)) * 3).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    out = {}
    for dt in dtypes:
        if dt == "bfloat16":
            import ml_dtypes
            cast = ml_dtypes.bfloat16
        else:
            cast = np.dtype(dt)
        with tensor_ops.use("opencl"):
            y = tensor_ops.rms_norm(x.astype(cast), w.astype(cast))
            g = tensor_ops.gelu(x.astype(cast))
        out[dt] = [y.astype(np.float32).tolist(), g.astype(np.float32).tolist()]
    p = [d for d in tensor_ops.devices() if d.backend == "opencl"][0].properties
    print(json.dumps({"results": out, "props": p}))
"""


def _cache_run(tmp_path, dtypes):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CACHE_RUN), *dtypes], capture_output=True, text=True,
                       timeout=600, env={**{k: v for k, v in os.environ.items() if k != "TENSOR_OPS_BACKEND"},
                                         "TENSOR_OPS_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout.strip().splitlines()[-1])
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 300)) * 3).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    for dt in dtypes:
        xd, wd = x.astype(np_dtype(dt)), w.astype(np_dtype(dt))
        y, g = (np.array(v, np.float32) for v in data["results"][dt])
        assert_close(y, ref_rms_norm(xd, wd), dt, f"rms_norm {dt} after the cache")
        assert_close(g, ref_gelu(xd), dt, f"gelu {dt} after the cache")
    p = data["props"]
    return {k: int(p[f"binary_cache_{k}"]) for k in ("hits", "misses", "rejected")}, p


def _entry(path):
    """(key, binary) of a cache entry (layout: opencl/binary_cache.cpp)."""
    data = path.read_bytes()
    assert data[:8] == b"TOCLBIN1"
    (key_size,) = struct.unpack_from("<Q", data, 8)
    key = data[16:16 + key_size]
    size, _ = struct.unpack_from("<QQ", data, 16 + key_size)
    return key, data[32 + key_size:32 + key_size + size]


def _fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@needs_device
def test_binary_cache_hits_and_rebuilds_corrupt_entries(tmp_path):
    dtypes = ["float32", "float16"] + (["bfloat16"] if ml_dtypes is not None else [])
    n = len(dtypes)
    stats, props = _cache_run(tmp_path, dtypes)
    assert stats == {"hits": 0, "misses": n, "rejected": 0}, props
    cache = tmp_path / "opencl"
    assert props["binary_cache_dir"] == str(cache) and "binary_cache_problem" not in props
    files = sorted(cache.glob("*.bin"))
    assert len(files) == n and not list(cache.glob("*.tmp*"))
    assert (cache.stat().st_mode & 0o777) == 0o700 and (tmp_path.stat().st_mode & 0o077) == 0
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in files)
    keys = [_entry(f)[0].decode() for f in files]
    assert all(re.search(r"^device=.+$", k, re.M) and "driver_version=" in k and "source_sha256=" in k for k in keys)
    assert sorted(re.search(r"options=(\S+)", k).group(1) for k in keys) == sorted(
        {"float32": "-DTO_DTYPE_F32", "float16": "-DTO_DTYPE_F16", "bfloat16": "-DTO_DTYPE_BF16"}[d] for d in dtypes)

    stats, _ = _cache_run(tmp_path, dtypes)
    assert stats == {"hits": n, "misses": 0, "rejected": 0}

    # Truncated; one bit flipped in the binary; a binary the driver refuses
    # under a valid header (its size and hash match).
    truncated, flipped = files[0], files[1]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0x10
    flipped.write_bytes(bytes(data))
    corrupt = 2
    if n > 2:
        key, binary = _entry(files[2])
        garbage = bytes(range(256)) * 4
        files[2].write_bytes(b"TOCLBIN1" + struct.pack("<Q", len(key)) + key +
                             struct.pack("<QQ", len(garbage), _fnv1a64(garbage)) + garbage)
        corrupt = 3
    stats, _ = _cache_run(tmp_path, dtypes)
    assert stats == {"hits": n - corrupt, "misses": corrupt, "rejected": corrupt}

    # Rebuilt entries were written back whole.
    stats, _ = _cache_run(tmp_path, dtypes)
    assert stats == {"hits": n, "misses": 0, "rejected": 0}


@needs_device
def test_binary_cache_refuses_a_directory_others_can_write(tmp_path):
    (tmp_path / "opencl").mkdir(mode=0o700)
    os.chmod(tmp_path / "opencl", 0o777)
    stats, props = _cache_run(tmp_path, ["float32"])
    assert stats == {"hits": 0, "misses": 1, "rejected": 0}
    assert "not trusted" in props.get("binary_cache_problem", ""), props
    assert not list((tmp_path / "opencl").iterdir())


# --- no OpenCL driver ---

def test_no_icd_reports_unusable_with_reason_and_cpu_still_runs(tmp_path):
    empty = tmp_path / "vendors"
    empty.mkdir()
    r = run_py("""
        import json, numpy as np, tensor_ops
        b = [b for b in tensor_ops.backends() if b.name == "opencl"][0]
        x = np.linspace(-4, 4, 64, dtype=np.float32)
        y = tensor_ops.silu(x)
        try:
            with tensor_ops.use("opencl"):
                pass
            err = ""
        except tensor_ops.BackendUnavailableError as e:
            err = str(e)
        print(json.dumps({"status": b.to_dict(), "backend": tensor_ops.get_backend(), "err": err,
                          "devices": [d.backend for d in tensor_ops.devices()],
                          "max_err": float(np.abs(y - x / (1 + np.exp(-x))).max())}))
    """, OCL_ICD_VENDORS=str(empty))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    s = out["status"]
    assert s["compiled"] and not s["usable"] and s["library"].endswith("libtensor_ops_opencl.so")
    assert s["reason"].startswith(
        "no OpenCL platforms found (clGetPlatformIDs returned -1001 CL_PLATFORM_NOT_FOUND_KHR)"), s["reason"]
    assert s["reason"] in out["err"]
    assert out["backend"] == "cpu" and "opencl" not in out["devices"] and out["max_err"] < 1e-5


def test_no_icd_loader_reports_unusable_with_reason_and_cpu_still_runs(tmp_path):
    # The plugin opens the ICD loader at run time: without one (here a path
    # that does not exist) it is compiled but unusable, and says why.
    missing = tmp_path / "libOpenCL.so.1"
    r = run_py("""
        import json, numpy as np, tensor_ops
        b = [b for b in tensor_ops.backends() if b.name == "opencl"][0]
        x = np.linspace(-4, 4, 64, dtype=np.float32)
        print(json.dumps({"status": b.to_dict(), "backend": tensor_ops.get_backend(),
                          "max_err": float(np.abs(tensor_ops.silu(x) - x / (1 + np.exp(-x))).max())}))
    """, TENSOR_OPS_OPENCL_LIBRARY=str(missing))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    s = out["status"]
    assert s["compiled"] and not s["usable"], s
    assert s["reason"].startswith(f"no OpenCL ICD loader ({missing}: "), s["reason"]
    assert out["backend"] == "cpu" and out["max_err"] < 1e-5


def test_plugin_links_no_opencl_library():
    # Built without OpenCL headers or libOpenCL: the loader is dlopen'ed.
    r = subprocess.run(["readelf", "-d", STATUS.library], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"readelf unavailable: {r.stderr}")
    assert "libOpenCL" not in r.stdout, r.stdout

# --- the LLM op set on opencl:0 (the conformance suites test_ops_llm.py run
# it staged from numpy; here: resident tensors, in place, the work-group
# paths a GPU takes, data-dependent errors, 16-bit edges) ---

def dev(a):
    return tensor_ops.from_numpy(np.ascontiguousarray(a), device=DEVICE)


def host(t):
    return t.numpy() if isinstance(t, tensor_ops.Tensor) else np.asarray(t)


def _llm_results(rng, dtype):
    """Every LLM op once on small odd shapes, inputs and results as a dict
    of numpy arrays (run on whatever backend is selected)."""
    x, r, dy = make(rng, (5, 37), dtype), make(rng, (5, 37), dtype), make(rng, (5, 37), dtype, 1.0)
    w, b = make(rng, (37,), dtype, 1.0), make(rng, (37,), dtype, 1.0)
    q, k, v = make(rng, (2, 4, 9, 16), dtype, 1.0), make(rng, (2, 2, 11, 16), dtype, 1.0), make(rng, (2, 2, 11, 16), dtype, 1.0)
    do = make(rng, (2, 4, 9, 16), dtype, 1.0)
    logits, tgt = make(rng, (6, 300), dtype), rng.integers(0, 300, 6)
    tgt[1] = -100
    out = dict(x=x, r=r, dy=dy, w=w, b=b)
    out["layer_norm"] = tensor_ops.layer_norm(x, w, b)
    out["add_rms_norm"], out["residual"] = tensor_ops.add_rms_norm(x, r, w)
    out["rms_dx"], out["rms_dw"] = tensor_ops.rms_norm_backward(dy, x, w)
    out["ln_dx"], out["ln_dw"], out["ln_db"] = tensor_ops.layer_norm_backward(dy, x, w)
    out["softmax"] = tensor_ops.softmax(x, scale=0.5, causal=True)
    out["log_softmax"] = tensor_ops.log_softmax(x, causal=True)
    out["softmax_bwd"] = tensor_ops.softmax_backward(dy, out["softmax"])
    out["log_softmax_bwd"] = tensor_ops.log_softmax_backward(dy, out["log_softmax"])
    for causal in (False, True):
        o, lse = tensor_ops.attention(q, k, v, causal, return_lse=True)
        out[f"attn{causal}"], out[f"lse{causal}"] = o, lse
        out[f"dq{causal}"], out[f"dk{causal}"], out[f"dv{causal}"] = tensor_ops.attention_backward(do, q, k, v, o, lse, causal)
    out["ce_loss"], out["ce_grad"] = tensor_ops.cross_entropy_with_grad(logits, tgt, reduction="none")
    return out


@needs_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_llm_ops_match_the_cpu_backend(dtype):
    """The same inputs through both backends: results within the dtype's
    tolerance of the CPU backend's (both fp32 math)."""
    with tensor_ops.use("opencl"):
        got = _llm_results(np.random.default_rng(5), dtype)
    with tensor_ops.use("cpu"):
        want = _llm_results(np.random.default_rng(5), dtype)
    for key, ref in want.items():
        ref64 = np.asarray(ref).astype(np.float64)
        g = np.asarray(got[key]).astype(np.float64)
        fin = np.isfinite(ref64)
        assert (np.isfinite(g) == fin).all() and (g[~fin] == ref64[~fin]).all(), key
        f = 8 if key.startswith(("d", "rms_d", "ln_d", "ce_grad", "softmax_bwd", "log_softmax_bwd")) else 2
        tol = {"float32": 1e-5, "float16": 2 ** -10, "bfloat16": 2 ** -7}[dtype] * f
        scale = float(np.max(np.abs(ref64[fin]), initial=1.0))
        np.testing.assert_allclose(g[fin], ref64[fin], rtol=tol, atol=tol * scale, err_msg=f"{key} {dtype}")


@needs_device
@pytest.mark.parametrize("groups", [(2, 1), (64, 4), (256, 64)], ids=lambda g: f"row{g[0]}-attn{g[1]}")
def test_llm_work_group_paths(groups, tmp_path):
    """The row-wise kernels with several work-items per row (a GPU's
    reduction; CPU devices run 1) and attention with other key-block sizes,
    against the defaults."""
    code = """
        import sys, numpy as np, tensor_ops
        sys.path.insert(0, sys.argv[2])
        from test_opencl import _llm_results
        with tensor_ops.use("opencl"):
            res = _llm_results(np.random.default_rng(11), "float32")
        np.savez(sys.argv[1], **{k: np.asarray(v) for k, v in res.items()})
    """
    here = os.path.dirname(os.path.abspath(__file__))
    r = run_py(code, str(tmp_path / "a.npz"), here, TENSOR_OPS_OPENCL_RMS_NORM_GROUP=str(groups[0]),
               TENSOR_OPS_OPENCL_ATTENTION_GROUP=str(groups[1]), TENSOR_OPS_CACHE_DIR=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    with tensor_ops.use("cpu"):
        want = _llm_results(np.random.default_rng(11), "float32")
    got = np.load(tmp_path / "a.npz")
    for key, ref in want.items():
        ref = np.asarray(ref).astype(np.float64)
        fin = np.isfinite(ref)
        assert (np.isfinite(got[key]) == fin).all(), key
        scale = float(np.max(np.abs(ref[fin]), initial=1.0))
        np.testing.assert_allclose(got[key][fin], ref[fin], rtol=1e-4, atol=1e-5 * scale, err_msg=f"{key} {groups}")


@needs_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_llm_chain_resident_without_round_trips(dtype, rng):
    """A transformer block's ops chained on opencl:0: no host copies until
    the results are read."""
    B, S, H, D = 2, 5, 4, 16
    hid = H * D
    x, res = make(rng, (B * S, hid), dtype, 1.0), make(rng, (B * S, hid), dtype, 1.0)
    w = make(rng, (hid,), dtype, 1.0)
    cos, sin = (a.astype(np_dtype(dtype)) for a in (np.cos(np.arange(S)[:, None] * 0.1 * np.arange(1, D // 2 + 1)),
                                                    np.sin(np.arange(S)[:, None] * 0.1 * np.arange(1, D // 2 + 1))))
    pos = np.tile(np.arange(S), (B, 1)).astype(np.int32)
    up = make(rng, (B * S, hid), dtype, 1.0)
    q4 = make(rng, (B, S, H, D), dtype, 1.0)
    xt, rt, wt, ct, st, pt, ut, qt = map(dev, (x, res, w, cos, sin, pos, up, q4))
    before = device_props()
    h, r2 = tensor_ops.add_rms_norm(xt, rt, wt)
    qk = tensor_ops.rope(qt, ct, st, pt)
    qk = tensor_ops.rope_backward(qk, ct, st, pt)  # back to q4, up to rounding
    assert False not in [isinstance(t, tensor_ops.Tensor) and t.device == DEVICE for t in (h, r2, qk)]
    a = tensor_ops.swiglu(h, ut)
    ln = tensor_ops.layer_norm(a, wt)
    sm = tensor_ops.log_softmax(ln)
    after = device_props()
    for key in ("host_to_device_copies", "device_to_host_copies"):
        assert after[key] == before[key], f"{key}: the chain copied between host and device"
    s = (x.astype(np.float64) + res.astype(np.float64)).astype(np.float32).astype(np_dtype(dtype))
    assert_close(host(r2), s.astype(np.float64), dtype, "residual")
    h_h = host(h)
    assert_close(h_h, ref_rms_norm(s, w), dtype, "add_rms_norm")
    a_h = host(a)
    assert_close(a_h, ref_silu(h_h) * up.astype(np.float64), dtype, "swiglu")
    with tensor_ops.use("cpu"):
        assert_close(host(ln), tensor_ops.layer_norm(a_h, w).astype(np.float64), dtype, "layer_norm")
        assert_close(host(sm), tensor_ops.log_softmax(host(ln)).astype(np.float64), dtype, "log_softmax")
        rot = tensor_ops.rope(q4, cos, sin, pos)
        assert_close(host(qk), tensor_ops.rope_backward(rot, cos, sin, pos).astype(np.float64), dtype, "rope")


@needs_device
def test_llm_in_place_on_device(rng):
    x, w, b, u = make(rng, (4, 333), "float32"), make(rng, (333,), "float32", 1.0), make(rng, (333,), "float32"), \
        make(rng, (4, 333), "float32")
    xt = dev(x)
    assert tensor_ops.layer_norm(xt, dev(w), dev(b), out=xt) is xt
    with tensor_ops.use("cpu"):
        ref = tensor_ops.layer_norm(x, w, b)
    assert_close(xt.numpy(), ref.astype(np.float64), "float32", "layer_norm in place")
    gt, ut = dev(x), dev(u)
    assert tensor_ops.swiglu(gt, ut, out=gt) is gt
    assert_close(gt.numpy(), ref_silu(x) * u.astype(np.float64), "float32", "swiglu out=gate")
    gt = dev(x)
    assert tensor_ops.geglu(gt, ut, out=ut) is ut
    assert_close(ut.numpy(), ref_gelu(x) * u.astype(np.float64), "float32", "geglu out=up")


@needs_device
def test_bad_indices_on_device_are_invalid_argument_and_the_device_stays_usable():
    x = dev(np.ones((1, 2, 1, 4), np.float32))
    cos, sin = np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32)
    for dt in (np.int32, np.int64):
        with pytest.raises(ValueError, match=r"position is outside the cos/sin tables \[0, 3\)"):
            tensor_ops.rope(x, dev(cos), dev(sin), dev(np.array([[0, 3]], dt)))
        with pytest.raises(ValueError, match=r"position is outside"):
            tensor_ops.rope(x, dev(cos), dev(sin), dev(np.array([[-1, 0]], dt)))
        logits = dev(np.zeros((3, 5), np.float32))
        with pytest.raises(ValueError, match=r"target is outside \[0, 5\) and is not the ignore_index -100"):
            tensor_ops.cross_entropy_with_grad(logits, dev(np.array([0, 5, 1], dt)))
        with pytest.raises(ValueError, match=r"target is outside"):
            tensor_ops.cross_entropy(logits, dev(np.array([-2, 0, 1], dt)))
    # The flag is cleared for the next call: good indices pass.
    y = tensor_ops.rope(x, dev(cos), dev(sin), dev(np.array([[0, 2]], np.int64)))
    np.testing.assert_array_equal(y.numpy(), np.ones((1, 2, 1, 4), np.float32))
    loss, g = tensor_ops.cross_entropy_with_grad(dev(np.zeros((3, 5), np.float32)), dev(np.array([0, -100, 4])),
                                                 reduction="none")
    np.testing.assert_allclose(loss.numpy(), [np.log(5), 0, np.log(5)], rtol=1e-6)
    np.testing.assert_allclose(g.numpy()[1], 0)


@needs_device
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_llm_half_edges(dtype):
    big = 60000.0 if dtype == "float16" else 3e38
    with tensor_ops.use("opencl"):
        # Large logits: fp32 math, no overflow of exp or the sum.
        x = np.array([[big, big, -big, 0.0]], np.float32).astype(np_dtype(dtype))
        y = tensor_ops.softmax(x).astype(np.float32)
        np.testing.assert_allclose(y, [[0.5, 0.5, 0, 0]])
        ly = tensor_ops.log_softmax(x).astype(np.float32)
        assert ly[0, 0] == ly[0, 1] and abs(ly[0, 0] + np.log(2)) < 1e-2 and ly[0, 2] < -1e4
        loss, _ = tensor_ops.cross_entropy_with_grad(x, np.array([0]), reduction="none")
        assert abs(float(loss[0]) - np.log(2)) < 1e-6
        # A constant row: variance 0, layer_norm gives the bias.
        c = np.full((2, 9), 7.0, np.float32).astype(np_dtype(dtype))
        w, b = np.ones(9, np_dtype(dtype)), np.arange(9, dtype=np.float32).astype(np_dtype(dtype))
        np.testing.assert_array_equal(tensor_ops.layer_norm(c, w, b).astype(np.float32), np.tile(b.astype(np.float32), (2, 1)))
        # NaN stays in its row.
        n = np.ones((2, 8), np.float32)
        n[0, 3] = np.nan
        s = tensor_ops.softmax(n.astype(np_dtype(dtype))).astype(np.float32)
        assert np.isnan(s[0]).all() and np.allclose(s[1], 1 / 8)


@needs_device
def test_norm_backward_dweight_is_deterministic_across_row_blocks(rng):
    """1000 rows: dweight / dbias summed over several row blocks, in a fixed
    order: bit-identical on every run, and right."""
    x, dy, w = make(rng, (1000, 65), "float32"), make(rng, (1000, 65), "float32"), make(rng, (65,), "float32", 1.0)
    with tensor_ops.use("opencl"):
        runs = [tensor_ops.layer_norm_backward(dy, x, w) for _ in range(3)]
        rms = tensor_ops.rms_norm_backward(dy, x, w)
    for r in runs[1:]:
        for a, b in zip(r, runs[0]):
            np.testing.assert_array_equal(a, b)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    xh = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    assert_close(runs[0][1], (dy64 * xh).sum(0), "float32", "dweight")
    assert_close(runs[0][2], dy64.sum(0), "float32", "dbias")
    xr = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    assert_close(rms[1], (dy64 * xr).sum(0), "float32", "rms dweight")
    with tensor_ops.use("opencl"):
        e = tensor_ops.rms_norm_backward(np.zeros((0, 5), np.float32), np.zeros((0, 5), np.float32),
                                         np.ones(5, np.float32))
    np.testing.assert_array_equal(e[1], 0)


@needs_device
def test_attention_edges_on_device(rng):
    # Causal with more queries than keys: the first rows see nothing (out 0, lse -inf).
    q, k, v = make(rng, (1, 2, 6, 8), "float32", 1.0), make(rng, (1, 1, 3, 8), "float32", 1.0), \
        make(rng, (1, 1, 3, 8), "float32", 1.0)
    o, lse = tensor_ops.attention(dev(q), dev(k), dev(v), causal=True, return_lse=True)
    o, lse = o.numpy(), lse.numpy()
    assert (o[:, :, :3] == 0).all() and (lse[:, :, :3] == -np.inf).all() and np.isfinite(lse[:, :, 3:]).all()
    dq, dk, dv = tensor_ops.attention_backward(*(dev(a) for a in (np.ones_like(q), q, k, v, o, lse)), causal=True)
    assert (dq.numpy()[:, :, :3] == 0).all() and np.isfinite(dk.numpy()).all() and np.isfinite(dv.numpy()).all()
    # head_dim 1 and a long key sequence (several key blocks).
    with tensor_ops.use("cpu"):
        q1, k1, v1 = make(rng, (1, 1, 3, 1), "float32"), make(rng, (1, 1, 300, 1), "float32"), make(rng, (1, 1, 300, 1), "float32")
        want = tensor_ops.attention(q1, k1, v1)
    with tensor_ops.use("opencl"):
        got = tensor_ops.attention(q1, k1, v1)
    assert_close(got, want.astype(np.float64), "float32", "head_dim 1")


def _opencl_device_ids():
    if not STATUS.usable:
        return []
    return [d.device_id for d in tensor_ops.devices() if d.backend == "opencl"]


@needs_device
@pytest.mark.parametrize("device_id", _opencl_device_ids())
def test_llm_ops_resident_on_every_device(device_id, rng):
    """Each OpenCL device (with PoCL's and Intel's ICDs both installed,
    opencl:1 is Intel's CPU runtime) runs the LLM ops on its own tensors."""
    where = f"opencl:{device_id}"
    on = lambda a: tensor_ops.from_numpy(np.ascontiguousarray(a), device=where)  # noqa: E731
    x, r, w = make(rng, (3, 100), "float32"), make(rng, (3, 100), "float32"), make(rng, (100,), "float32", 1.0)
    q, k, v = (make(rng, s, "float32", 1.0) for s in [(1, 4, 7, 32), (1, 2, 9, 32), (1, 2, 9, 32)])
    logits, tgt = make(rng, (4, 50), "float32"), np.array([1, -100, 49, 0])
    cos, sin = np.cos(np.arange(12)[:, None] * np.ones(8)), np.sin(np.arange(12)[:, None] * np.ones(8))
    x4 = make(rng, (2, 3, 2, 16), "float32")
    pos = np.array([[0, 5, 11], [3, 2, 1]], np.int32)
    got, want = {}, {}
    for res, f in ((got, on), (want, lambda a: a)):
        ctx = tensor_ops.use("cpu") if res is want else tensor_ops.use("opencl")
        with ctx:
            res["ln"] = tensor_ops.layer_norm(f(x), f(w))
            res["arn"] = tensor_ops.add_rms_norm(f(x), f(r), f(w))[0]
            res["sm"] = tensor_ops.softmax(f(x), causal=True)
            res["glu"] = tensor_ops.geglu(f(x), f(r), "tanh")
            res["rope"] = tensor_ops.rope(f(x4), f(cos.astype(np.float32)), f(sin.astype(np.float32)), f(pos), True)
            o, lse = tensor_ops.attention(f(q), f(k), f(v), True, return_lse=True)
            res["attn"], res["lse"] = o, lse
            res["dq"], res["dk"], res["dv"] = tensor_ops.attention_backward(f(q), f(q), f(k), f(v), o, lse, True)
            res["ce"] = tensor_ops.cross_entropy_with_grad(f(logits), f(tgt), reduction="none")[1]
    for key in want:
        assert isinstance(got[key], tensor_ops.Tensor) and got[key].device == where, key
        ref = np.asarray(want[key]).astype(np.float64)
        fin = np.isfinite(ref)
        g = got[key].numpy().astype(np.float64)
        assert (np.isfinite(g) == fin).all(), key
        np.testing.assert_allclose(g[fin], ref[fin], rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(ref[fin]).max())),
                                   err_msg=f"{key} on {where}")
