"""The seed guides' API beyond the core: named tensor pools, the error
names, HardwareDetector / backend_info, TensorOpsConfig, unknown backend
names, FlashAttention with masks, fused Linear + activation."""
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensor_ops
from tensor_ops import config as cfg_mod
from tensor_ops import pools

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import tensor_ops.torch as tt  # noqa: E402


def _usable(name):
    return any(b.name == name and b.usable for b in tensor_ops.backends())


needs_opencl = pytest.mark.skipif(not _usable("opencl"), reason="OpenCL is not usable here")


@pytest.fixture
def pool_id(request):
    name = f"test-{request.node.name}"
    yield name
    pools.clear_pool(name)


# ---- named tensor pools ---------------------------------------------------------------------------


def test_pool_reuse_is_visible_in_stats(pool_id):
    a = tensor_ops.allocate_tensor((64, 128), "float32", pool_id=pool_id)
    ptr = a.data_ptr
    tensor_ops.return_to_pool(a, pool_id)
    before = tensor_ops.memory_stats()["allocation.all.allocated"]
    b = tensor_ops.allocate_tensor((64, 128), "float32", pool_id=pool_id)
    assert b.data_ptr == ptr
    assert tensor_ops.memory_stats()["allocation.all.allocated"] == before  # the device pool was not asked
    s = tensor_ops.pool_stats(pool_id)
    assert (s["hits"], s["misses"], s["returns"], s["outstanding"]) == (1, 1, 1, 1)
    c = tensor_ops.allocate_tensor((64, 128), "float16", pool_id=pool_id)  # another dtype: a new tensor
    assert c.data_ptr != ptr and tensor_ops.pool_stats(pool_id)["misses"] == 2
    stats = tensor_ops.get_memory_stats()
    assert stats["pools"][pool_id]["hits"] == 1
    assert stats["allocated_gb"] == stats["allocated_bytes.all.current"] / 2 ** 30
    assert stats["reserved_gb"] == stats["reserved_bytes.all.current"] / 2 ** 30
    assert stats["allocated_gb"] >= 64 * 128 * 6 / 2 ** 30


def test_pool_is_bounded_by_count_and_bytes(pool_id):
    tensor_ops.set_pool_limits(pool_id, max_cached_tensors=2)
    ts = [tensor_ops.allocate_tensor((256, 256), "float32", pool_id=pool_id) for _ in range(5)]
    base = tensor_ops.memory_stats()["allocated_bytes.all.current"]
    for t in ts:
        tensor_ops.return_to_pool(t, pool_id)
    del ts, t
    s = tensor_ops.pool_stats(pool_id)
    assert (s["cached_tensors"], s["evictions"], s["cached_bytes"]) == (2, 3, 2 * 256 * 256 * 4)
    # the 3 evicted tensors went back to the device pool
    assert tensor_ops.memory_stats()["allocated_bytes.all.current"] <= base - 3 * 256 * 256 * 4
    tensor_ops.set_pool_limits(pool_id, max_cached_bytes=256 * 256 * 4 + 1, max_cached_tensors=100)
    assert tensor_ops.pool_stats(pool_id)["cached_tensors"] == 1
    big = tensor_ops.allocate_tensor((1024, 1024), "float32", pool_id=pool_id)  # larger than the whole bound
    tensor_ops.return_to_pool(big, pool_id)
    s = tensor_ops.pool_stats(pool_id)
    assert s["cached_bytes"] <= s["max_cached_bytes"] and s["cached_tensors"] == 1


def test_pool_does_not_leak(pool_id):
    gc.collect()
    base = tensor_ops.memory_stats()["allocated_bytes.all.current"]
    kept = [tensor_ops.allocate_tensor((512, 512), "float32", pool_id=pool_id) for _ in range(3)]
    tensor_ops.return_to_pool(kept.pop(), pool_id)
    del kept  # two given out and dropped without return_to_pool
    gc.collect()
    s = tensor_ops.pool_stats(pool_id)
    assert s["outstanding"] == 0 and s["cached_tensors"] == 1
    assert tensor_ops.memory_stats()["allocated_bytes.all.current"] == base + 512 * 512 * 4
    tensor_ops.clear_pool(pool_id)
    assert tensor_ops.memory_stats()["allocated_bytes.all.current"] == base
    assert tensor_ops.pool_stats(pool_id)["cached_tensors"] == 0


def test_pool_torch_dtype_gives_torch_tensors(pool_id):
    t = tensor_ops.allocate_tensor((8, 16), dtype=torch.float16, pool_id=pool_id)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float16 and t.shape == (8, 16)
    t.fill_(3.0)
    ptr = t.data_ptr()
    tensor_ops.return_to_pool(t, pool_id)
    u = tensor_ops.allocate_tensor((8, 16), dtype=torch.float16, pool_id=pool_id)
    assert u.data_ptr() == ptr and tensor_ops.pool_stats(pool_id)["hits"] == 1


def test_pool_refuses_foreign_and_double_returns(pool_id):
    t = tensor_ops.allocate_tensor((4,), "float32", pool_id=pool_id)
    with pytest.raises(tensor_ops.MemoryAllocationError, match="came from pool"):
        tensor_ops.return_to_pool(t, pool_id + "-other")
    tensor_ops.return_to_pool(t, pool_id)
    with pytest.raises(tensor_ops.MemoryAllocationError, match="already returned"):
        tensor_ops.return_to_pool(t, pool_id)
    with pytest.raises(tensor_ops.MemoryAllocationError):
        tensor_ops.return_to_pool(torch.zeros(4), pool_id)
    with pytest.raises(tensor_ops.InvalidArgumentError):
        tensor_ops.allocate_tensor((4,), pool_id="")


def test_clear_all_pools(pool_id):
    for name in (pool_id, pool_id + "-b"):
        tensor_ops.return_to_pool(tensor_ops.allocate_tensor((16,), pool_id=name), name)
    tensor_ops.clear_pool()
    assert tensor_ops.pool_stats(pool_id)["cached_tensors"] == tensor_ops.pool_stats(pool_id + "-b")["cached_tensors"] == 0


# ---- errors --------------------------------------------------------------------------------------


def test_error_hierarchy_and_seed_names():
    assert issubclass(tensor_ops.OutOfMemoryError, tensor_ops.MemoryAllocationError)
    assert issubclass(tensor_ops.MemoryAllocationError, tensor_ops.TensorOpsError)
    assert tensor_ops.KernelLaunchError is tensor_ops.DeviceError
    assert tensor_ops.CUDANotAvailableError is tensor_ops.BackendUnavailableError
    total = tensor_ops.memory_stats()["device_total_bytes"]
    with pytest.raises(tensor_ops.MemoryAllocationError, match="out of memory"):  # a real OOM from the core
        tensor_ops.allocate_with_oom_protection((total // 2,), "float32")
    with pytest.raises(tensor_ops.CUDANotAvailableError):
        with tensor_ops.use("cuda" if not _usable("cuda") else "hip"):
            pass


# ---- hardware detection --------------------------------------------------------------------------


def test_detector_follows_the_registry(monkeypatch):
    det = tensor_ops.HardwareDetector()
    profile = det.detect()
    with tensor_ops.use("auto"):
        assert profile.backend == det.get_optimal_backend() == tensor_ops.get_backend()
    assert profile.device_count == sum(d.backend == profile.backend for d in tensor_ops.devices())
    assert profile.total_memory_gb > 0 and profile.device_name
    assert profile.to_dict()["hardware_type"] == str(profile.hardware_type)
    if _usable("opencl"):  # the registry's own override moves the detector too
        monkeypatch.delenv("TENSOR_OPS_BACKEND", raising=False)
        monkeypatch.setenv("TENSOR_OPS_PRIORITY", "opencl,cpu")
        assert det.detect().backend == profile.backend  # cached until force_redetect
        p = det.detect(force_redetect=True)
        assert p.backend == "opencl" == det.get_optimal_backend() == det.get_optimal_backend(p)
        first = next(d for d in tensor_ops.devices() if d.backend == "opencl")
        assert p.device_name == first.device_name and p.capabilities["platform"] == first.properties["platform"]
        assert p.hardware_type == (tensor_ops.HardwareType.CPU if first.device_type == "cpu"
                                   else p.hardware_type)
    monkeypatch.setenv("TENSOR_OPS_BACKEND", "cpu")
    monkeypatch.delenv("TENSOR_OPS_PRIORITY", raising=False)
    p = det.detect(force_redetect=True)
    assert (p.backend, p.hardware_type) == ("cpu", tensor_ops.HardwareType.CPU)
    assert p.capabilities["simd_level"] == tensor_ops._C.cpu_active_isa()


def test_cpu_info_reports_live_state():
    info = tensor_ops.backend_info("cpu")
    dev = next(d for d in tensor_ops.devices() if d.backend == "cpu")
    assert info["has_avx2"] == (dev.properties["has_avx2"] == "1")
    assert info["has_avx512"] == (dev.properties["has_avx512"] == "1")
    assert info["has_fma"] == (dev.properties["has_fma"] == "1")
    assert info["simd_level"] in info["supported_isas"] and "rms_norm" in info["ops"]
    try:
        tensor_ops._C.cpu_set_isa("baseline")
        assert tensor_ops.backend_info("cpu")["simd_level"] == "baseline"
        with tensor_ops.use("cpu"):
            assert tensor_ops.get_backend_info()["simd_level"] == "baseline"
    finally:
        tensor_ops._C.cpu_set_isa("auto")
    assert tt.BackendFactory.create("cpu").info()["threads"] == tensor_ops._C.cpu_num_threads()


@needs_opencl
def test_opencl_info_has_device_fields():
    info = tensor_ops.backend_info("opencl")
    assert info["available"] and info["device_count"] >= 1
    assert info["device_name"] and "platform" in info["properties"] and info["total_memory_gb"] > 0


# ---- unknown backend names -----------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda: tensor_ops.set_backend("cdua"),
    lambda: tensor_ops.use("cdua").__enter__(),
    lambda: tensor_ops.backend_info("cdua"),
    lambda: tensor_ops.TensorOpsConfig(backend="cdua").validate(),
    lambda: tt.BackendFactory.create("cdua"),
])
def test_unknown_backend_names_are_rejected_with_the_valid_ones(call):
    with pytest.raises(ValueError, match="cdua") as e:
        call()
    assert "cpu" in str(e.value) and "opencl" in str(e.value)
    assert tensor_ops.get_backend() == "cpu"  # nothing fell back silently


# ---- configuration -------------------------------------------------------------------------------


@pytest.fixture
def restore():
    threads = tensor_ops._C.cpu_num_threads()
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    limits = (pools.POOL_MAX_CACHED_BYTES, pools.POOL_MAX_CACHED_TENSORS)
    yield
    tensor_ops._C.cpu_set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = flags
    pools.POOL_MAX_CACHED_BYTES, pools.POOL_MAX_CACHED_TENSORS = limits
    tensor_ops.set_backend(None)
    cfg_mod._applied = None
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_default_matmul_precision", None)


def _tasks():
    return len(os.listdir("/proc/self/task"))


def test_cpu_threads_resize_the_pool(restore):
    tensor_ops.TensorOpsConfig(cpu=cfg_mod.CPUConfig(threads=1)).apply()
    one = _tasks()
    assert tensor_ops._C.cpu_num_threads() == 1 == tensor_ops.backend_info("cpu")["threads"]
    tensor_ops.TensorOpsConfig(cpu=cfg_mod.CPUConfig(threads=4)).apply()
    assert _tasks() == one + 3  # three worker threads started
    x = np.random.default_rng(0).standard_normal((257, 1031)).astype(np.float32)
    np.testing.assert_allclose(tensor_ops.silu(x), x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)
    dev = next(d for d in tensor_ops.devices() if d.backend == "cpu")
    assert dev.properties["threads"] == "4"


def test_settings_are_checked_by_type_not_converted(restore, pool_id):
    """A setting of the wrong type is a TypeError naming it (threads=2.5 ran
    2 threads, True 1; set_pool_limits(p, 1.7) set 1 byte;
    set_memory_fraction("0.5") was taken), and nothing is applied."""
    before = tensor_ops._C.cpu_num_threads()
    for section, value in (("cpu", {"threads": 2.5}), ("cpu", {"threads": True}), ("opencl", {"device": 1.0}),
                           ("cuda", {"allow_tf32": 1}), ("memory", {"pool_max_cached_mb": 0.5})):
        with pytest.raises(TypeError, match=f"{section}.{next(iter(value))} must be"):
            tensor_ops.configure(**{section: value})
    assert tensor_ops._C.cpu_num_threads() == before
    with pytest.raises(TypeError, match="max_cached_bytes must be an integer"):
        tensor_ops.set_pool_limits(pool_id, 1.7)
    with pytest.raises(TypeError, match="max_cached_tensors must be an integer"):
        tensor_ops.set_pool_limits(pool_id, None, "3")
    with pytest.raises(TypeError, match="fraction must be a real number"):
        tensor_ops.set_memory_fraction("0.5")
    assert tensor_ops.configure(cpu={"threads": 2}).cpu.threads == 2


def test_torch_passthrough_flags(restore):
    lines = tensor_ops.TensorOpsConfig.for_development().apply()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cudnn.benchmark
    tensor_ops.TensorOpsConfig.for_training().apply()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.cudnn.benchmark
    assert any("allow_tf32" in line for line in lines)


def test_memory_fraction_limits_cuda_pools(restore):
    lines = tensor_ops.TensorOpsConfig(cuda=cfg_mod.CUDAConfig(memory_fraction=0.25)).apply()
    cuda = [d for d in tensor_ops.devices() if d.backend == "cuda"]
    if not cuda:
        assert "CUDA is not usable" in lines[0]
        pytest.skip("no CUDA device: the fraction had nothing to limit")
    s = tensor_ops.memory_stats("cuda:0")
    assert abs(s["limit_bytes"] - 0.25 * s["device_total_bytes"]) <= 1 << 20
    with pytest.raises(tensor_ops.OutOfMemoryError):
        tensor_ops.empty((int(0.3 * s["device_total_bytes"]) // 4,), "float32", "cuda:0")
    tensor_ops.set_memory_fraction(1.0, "cuda:0")


def test_memory_section_bounds_named_pools(restore, pool_id):
    tensor_ops.TensorOpsConfig(memory=cfg_mod.MemoryConfig(pool_max_cached_tensors=1)).apply()
    ts = [tensor_ops.allocate_tensor((8,), pool_id=pool_id) for _ in range(3)]
    for t in ts:
        tensor_ops.return_to_pool(t, pool_id)
    assert tensor_ops.pool_stats(pool_id)["cached_tensors"] == 1


def test_tpu_precision_reaches_the_xla_shim(restore):
    jax = pytest.importorskip("jax")
    from tensor_ops import _xla_kernels

    q = jax.numpy.ones((1, 1, 4, 8), jax.numpy.float32)

    def jaxpr():
        return str(jax.make_jaxpr(lambda a: _xla_kernels._attn(a, a, a, 1.0, False))(q))

    assert "Precision.HIGHEST" in jaxpr()  # the shim's default: full fp32 passes
    tensor_ops.TensorOpsConfig(tpu=cfg_mod.TPUConfig(precision="bfloat16")).apply()
    assert jax.config.jax_default_matmul_precision == "default"
    assert "Precision.HIGHEST" not in jaxpr() and "Precision.DEFAULT" in jaxpr()


@needs_opencl
def test_opencl_device_choice(restore):
    dev = next(d for d in tensor_ops.devices() if d.backend == "opencl")
    platform = dev.properties["platform"]
    c = tensor_ops.TensorOpsConfig(backend="opencl", opencl=cfg_mod.OpenCLConfig(platform=platform[:6].lower()))
    c.apply()
    assert tensor_ops.get_backend() == "opencl"
    assert tensor_ops.zeros((4,)).device == tensor_ops.allocate_tensor((4,), pool_id="oc").device == "opencl:0"
    tensor_ops.set_backend("cpu")
    assert tensor_ops.zeros((4,)).device == "cpu"  # the choice applies while opencl is active
    with pytest.raises(ValueError, match="no OpenCL device") as e:
        tensor_ops.TensorOpsConfig(opencl=cfg_mod.OpenCLConfig(platform="no such platform")).apply()
    assert platform in str(e.value)
    with pytest.raises(ValueError, match="no OpenCL device"):
        tensor_ops.TensorOpsConfig(opencl=cfg_mod.OpenCLConfig(device=99)).apply()
    pools.clear_pool("oc")


@needs_opencl
def test_opencl_cache_dir(tmp_path):
    code = textwrap.dedent(f"""
        import numpy as np, os, tensor_ops
        tensor_ops.TensorOpsConfig(opencl=tensor_ops.config.OpenCLConfig(cache_dir={str(tmp_path)!r})).apply()
        with tensor_ops.use("opencl"):
            tensor_ops.silu(np.ones(64, np.float32))
        print(sorted(os.listdir({str(tmp_path / "opencl")!r})))
        try:
            tensor_ops.TensorOpsConfig(opencl=tensor_ops.config.OpenCLConfig(cache_dir={str(tmp_path / "b")!r})).apply()
        except tensor_ops.TensorOpsError as e:
            print("refused:", e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TENSOR_OPS_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    files, refused = out.stdout.splitlines()[0], out.stdout.splitlines()[1]
    assert files != "[]"  # the program binary was cached where the config said
    assert refused.startswith("refused:") and "already uses" in refused


def test_precedence_file_env_overrides(tmp_path):
    path = tmp_path / "tensor_ops.toml"
    path.write_text('backend = "cpu"\n[cpu]\nthreads = 3\n[cuda]\nmemory_fraction = 0.5\nallow_tf32 = true\n'
                    '[tpu]\nprecision = "high"\n')
    env = {"TENSOR_OPS_CONFIG": str(path), "TENSOR_OPS_NUM_THREADS": "2", "TENSOR_OPS_CUDA_ALLOW_TF32": "0"}
    c = tensor_ops.TensorOpsConfig.load(environ=env, cuda={"memory_fraction": 0.7}, preset="development")
    assert c.backend == "cpu"  # file
    assert c.cpu.threads == 2  # env over file
    assert c.cuda.allow_tf32 is False  # env over file
    assert c.cuda.memory_fraction == 0.7  # explicit over file
    assert c.tpu.precision == "high"  # file over preset
    assert c.memory.pool_max_cached_tensors == 16 and c.cuda.cudnn_benchmark is False  # preset
    assert tensor_ops.TensorOpsConfig.load(environ={}) == tensor_ops.TensorOpsConfig()
    assert tensor_ops.TensorOpsConfig.load(path, environ={}).cpu.threads == 3


def test_presets_differ():
    t, i, d = (tensor_ops.TensorOpsConfig.for_training(), tensor_ops.TensorOpsConfig.for_inference(),
               tensor_ops.TensorOpsConfig.for_development())
    assert t.cuda.allow_tf32 and not d.cuda.allow_tf32 and t.tpu.precision != i.tpu.precision != d.tpu.precision
    assert d.cuda.memory_fraction < t.cuda.memory_fraction


@pytest.mark.parametrize("text, match", [
    ("[cuda]\nmemory_fractoin = 0.5\n", "unknown field cuda.memory_fractoin; valid: allow_tf32"),
    ("[gpu]\nx = 1\n", "unknown key 'gpu'"),
    ('backend = "tpu2"\n', "unknown backend 'tpu2'; valid backends: auto, cpu"),
    ("[cuda]\nmemory_fraction = 1.5\n", r"memory_fraction must be in \(0, 1\]"),
    ('[tpu]\nprecision = "fp8"\n', "tpu.precision 'fp8'"),
    ("[cpu]\nthreads = 0\n", "cpu.threads"),
])
def test_bad_config_files(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(tensor_ops.InvalidArgumentError, match=match):
        tensor_ops.TensorOpsConfig.from_file(path)


def test_bad_env_value():
    with pytest.raises(tensor_ops.InvalidArgumentError, match="TENSOR_OPS_CUDA_ALLOW_TF32"):
        tensor_ops.TensorOpsConfig.from_env(environ={"TENSOR_OPS_CUDA_ALLOW_TF32": "maybe"})


def test_configure_sets_backend(restore):
    c = tensor_ops.configure(backend="cpu")
    assert tensor_ops.get_config() is c and tensor_ops.get_backend() == "cpu"


def test_a_failed_apply_changes_nothing_it_set(restore):
    """apply() puts back the backend selection and the CPU thread count when
    a later field fails (an OpenCL device that does not exist): it left the
    backend switched and the pool resized, with get_config() unchanged."""
    if "opencl" not in {b.name for b in tensor_ops.backends() if b.usable}:
        pytest.skip("needs a usable OpenCL backend to select")
    threads = tensor_ops._C.cpu_num_threads()
    with pytest.raises(tensor_ops.InvalidArgumentError, match="OpenCL device 7"):
        tensor_ops.configure(backend="opencl", cpu={"threads": 1}, opencl={"device": 7})
    assert tensor_ops.get_backend() == "cpu" and tensor_ops._C.cpu_num_threads() == threads
    assert tensor_ops.get_config() is None


# ---- FlashAttention with masks -------------------------------------------------------------------


def _qkv(b=2, h=4, lq=9, lk=9, d=16, hkv=None, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hkv or h, lk, d, generator=g)
    v = torch.randn(b, hkv or h, lk, d, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _bool_mask(*shape, seed=1):
    m = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    m[..., 0] = True  # no fully masked row
    return m


@pytest.mark.parametrize("kind", ["bool", "additive", "key_padding", "bool_causal", "additive_gqa"])
def test_sdpa_masks_match_torch(kind):
    q, k, v = _qkv(hkv=2 if kind.endswith("gqa") else None)
    causal = kind.endswith("causal")
    mask = {"bool": _bool_mask(2, 4, 9, 9), "bool_causal": _bool_mask(9, 9),
            "key_padding": _bool_mask(2, 1, 1, 9),
            "additive": torch.randn(2, 1, 9, 9), "additive_gqa": torch.randn(9, 9)}[kind]
    kr, vr = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) if kind.endswith("gqa") else (k, v)
    ref_mask = mask & torch.ones(9, 9, dtype=torch.bool).tril() if causal else mask
    ref = F.scaled_dot_product_attention(q, kr, vr, attn_mask=ref_mask)
    got = tt.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    unmasked = tt.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert (got - unmasked).abs().max() > 0.1  # the mask changed the output


def test_sdpa_mask_gradients_match_torch():
    q, k, v = _qkv(grad=True)
    mask = _bool_mask(2, 1, 9, 9)
    gy = torch.randn(2, 4, 9, 16)
    got = torch.autograd.grad(tt.scaled_dot_product_attention(q, k, v, mask), (q, k, v), gy)
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), gy)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_fully_masked_row_is_zero():
    q, k, v = _qkv()
    mask = torch.ones(9, 9, dtype=torch.bool)
    mask[3] = False
    got = tt.scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(got[:, :, 3], torch.zeros_like(got[:, :, 3])) and torch.isfinite(got).all()


def _module_reference(m, x, mask):
    def heads(t):
        return t.view(x.shape[0], -1, m.num_heads, m.head_dim).transpose(1, 2)

    q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=m.causal and mask is None)
    return m.out_proj(o.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_module(causal):
    torch.manual_seed(0)
    m = tt.FlashAttention(64, 4, dropout=0.0, causal=causal).eval()
    assert tt.FlashAttention3 is tt.FlashAttention
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), _module_reference(m, x, None), rtol=1e-5, atol=1e-5)
        pad = torch.ones(2, 10, dtype=torch.long)
        pad[1, 6:] = 0  # HF-style attention_mask: the second sequence has 4 padding tokens
        want_mask = pad.bool()[:, None, None, :]
        if causal:
            want_mask = want_mask & torch.ones(10, 10, dtype=torch.bool).tril()
        got = m(x, attention_mask=pad)
        torch.testing.assert_close(got, _module_reference(m, x, want_mask), rtol=1e-5, atol=1e-5)
        assert (got[1] - m(x)[1]).abs().max() > 1e-3 and torch.allclose(got[0], m(x)[0], atol=1e-6)
    with pytest.raises(ValueError, match="key_len"):
        m(x, attention_mask=torch.ones(2, 7))


def test_flash_attention_dropout_only_in_training():
    torch.manual_seed(0)
    m = tt.FlashAttention(32, 2, dropout=0.5)
    x = torch.randn(1, 6, 32)
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(2)
    b = m(x)
    assert (a - b).abs().max() > 1e-3  # different dropout masks
    m.eval()
    torch.testing.assert_close(m(x), _module_reference(m, x, None), rtol=1e-5, atol=1e-5)
    a.sum().backward()
    assert m.q_proj.weight.grad is not None and torch.isfinite(m.q_proj.weight.grad).all()


# ---- fused Linear + activation -------------------------------------------------------------------


@pytest.mark.parametrize("name, ref", [
    ("gelu", lambda h: F.gelu(h)), ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")), ("silu", F.silu)])
def test_fused_linear_matches_torch(name, ref):
    torch.manual_seed(0)
    if name == "silu":
        m = tt.FusedLinearSiLU(48, 80)
    else:
        m = tt.FusedLinearGELU(48, 80, approximate="tanh" if name == "gelu_tanh" else "none")
    x = torch.randn(3, 7, 48, requires_grad=True)
    want = ref(F.linear(x, m.weight, m.bias))
    got = m(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(want)
    g = torch.autograd.grad(got, (x, m.weight, m.bias), gy)
    r = torch.autograd.grad(want, (x, m.weight, m.bias), gy)
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the in-place path
        torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    assert list(m.state_dict()) == ["weight", "bias"]


def test_fused_linear_no_bias_and_bad_activation():
    m = tt.FusedLinearSiLU(8, 4, bias=False)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(m(x), F.silu(x @ m.weight.t()))
    with pytest.raises(ValueError, match="activation"):
        tt.linear_activation(x, m.weight, None, "relu")


def test_prepare_model_with_custom_kernels():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(32, 32), torch.nn.SiLU(), torch.nn.Linear(32, 4),
                                torch.nn.LayerNorm(4))
    x = torch.randn(6, 16)
    with torch.no_grad():
        want = model(x)
    keys = list(model.state_dict())
    w0 = model[0].weight
    model, result = tt.prepare_model_with_custom_kernels(model, backend="cpu")
    # Note [fused in the Sequential]: the Sequential runs the pairs; its modules stay what they were
    # (prepare_model's few-row (decode) Linear, our activations)
    assert type(model) is tt.FusingSequential
    assert type(model[0]) is tt.Linear and type(model[1]) is tt.GELU and model[1].approximate == "tanh"
    assert type(model[4]) is tt.Linear and model[0].weight is w0 and list(model.state_dict()) == keys
    assert result.metrics["linear_activation_fusions"] == 2
    assert any("FusingSequential" in s for s in result.optimizations_applied)
    seen = []
    real = tt.fused_linear.linear_activation
    tt.fused_linear.linear_activation = lambda *a: seen.append(a[3]) or real(*a)
    try:
        with torch.no_grad():
            model(x)
    finally:
        tt.fused_linear.linear_activation = real
    assert seen == ["gelu_tanh", "silu"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
