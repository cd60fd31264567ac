"""tensor_ops.compat beyond what the seed guides' blocks show (test_seed_guides):
the loud paths (hardware that is not here, the TPU without torch_xla), the
fused optimizer's equivalence, the detector's cache, the memory manager on
the CPU, FlashAttention3's (output, weights), airllm's facts."""
import subprocess
import sys

import numpy as np
import pytest

import tensor_ops

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from tensor_ops.compat import airllm  # noqa: E402
from tensor_ops.compat import kernel_pytorch as kp  # noqa: E402
from tensor_ops.compat import torchbridge as tb  # noqa: E402


def _usable(name):
    return any(b.name == name and b.usable for b in tensor_ops.backends())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def test_nothing_in_tensor_ops_imports_compat():
    code = "import sys, tensor_ops, tensor_ops.torch; print(any(m.startswith('tensor_ops.compat') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_airllm_does_not_import_torch():
    code = "import sys; from tensor_ops.compat import airllm; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.skipif(_usable("cuda"), reason="CUDA is usable here")
@pytest.mark.parametrize("make", [lambda: kp.NVIDIABackend(), lambda: kp.BackendFactory.create("nvidia"),
                                  lambda: tb.BackendFactory.create("cuda")])
def test_missing_hardware_is_loud_not_a_cpu_fallback(make):
    backend = make()
    assert backend.is_available is False and backend.device_count == 0
    assert "nvidia" not in kp.list_available_backends() and kp.BackendFactory.is_available("nvidia") is False
    for call in (lambda: backend.device, lambda: backend.prepare_model(_model()), backend.get_memory_stats,
                 lambda: backend.to_device(torch.ones(2)), backend.get_device_info, backend.empty_cache):
        with pytest.raises(tensor_ops.BackendUnavailableError, match="not available here: .*CUDA|cuda"):
            call()
    with pytest.raises(kp.CUDANotAvailableError):
        kp.NVIDIAMemoryManager()


def test_unknown_backend_names_raise_listing_the_valid_ones():
    for create in (kp.BackendFactory.create, tb.BackendFactory.create, kp.get_backend):
        with pytest.raises(ValueError, match="unknown backend 'tpuu'; valid names: .*cpu"):
            create("tpuu")


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_tpu_without_torch_xla_names_torch_xla():
    assert "tpu" not in kp.list_available_backends() and "xla" not in tensor_ops.torch.list_available_backends()
    info = kp.BackendFactory.get_all_backend_info()["tpu"]
    assert info["available"] is False and "torch_xla" in info["reason"]
    backend = kp.TPUBackend()
    for call in (lambda: backend.prepare_model(_model()), lambda: backend.to_device(torch.ones(2)),
                 backend.get_memory_stats, backend.empty_cache):
        with pytest.raises(tensor_ops.BackendUnavailableError, match="torch_xla") as e:
            call()
        assert "unknown backend" not in str(e.value)
    if _usable("xla"):  # our own Backend object on the jax shim, made directly
        ours = tensor_ops.torch.Backend("xla")
        for call in (ours.get_memory_stats, ours.empty_cache, lambda: ours.to_device(torch.ones(2))):
            with pytest.raises(tensor_ops.BackendUnavailableError, match="torch_xla"):
                call()


def test_guide_backend_returns_models_and_keeps_our_api():
    backend = kp.get_backend("cpu")
    model = _model()
    out = backend.prepare_model(model, "O1")
    assert out is model and backend.last_result.success and backend.last_result.model is model
    assert any("GELU" in a for a in backend.last_result.optimizations_applied)
    ours = tensor_ops.torch.BackendFactory.create("cpu").prepare_model(_model(), "O1")
    assert isinstance(ours, tuple) and len(ours) == 2  # our own API still returns (model, result)
    inf = backend.optimize_for_inference(out)
    assert inf is model and not model.training and not any(p.requires_grad for p in model.parameters())
    assert backend.optimize_for_training(model) is model and model.training


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_optimize_for_training_fuses_adam_with_the_same_state(kind):
    torch.manual_seed(1)
    ref_model = _model()
    model = _model()
    model.load_state_dict(ref_model.state_dict())
    groups = lambda m: [{"params": m[0].parameters(), "lr": 3e-2}, {"params": m[2].parameters()}]  # noqa: E731
    ref_opt = kind(groups(ref_model), lr=1e-2, weight_decay=0.05, amsgrad=True)
    opt = kind(groups(model), lr=1e-2, weight_decay=0.05, amsgrad=True)
    x = torch.randn(4, 8)
    for m, o in ((ref_model, ref_opt), (model, opt)):  # one step before: the state must carry over
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    backend = kp.get_backend("cpu")
    model, fused = backend.optimize_for_training(model, opt)
    assert type(fused) is kind and fused is opt and all(g["fused"] for g in fused.param_groups)
    assert [g["lr"] for g in fused.param_groups] == [3e-2, 1e-2] and fused.param_groups[0]["amsgrad"]
    assert "fused=True" in backend.last_result.optimizations_applied[-1]
    ref_model.train()
    for _ in range(3):
        for m, o in ((ref_model, ref_opt), (model, fused)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_optimize_for_training_keeps_other_optimizers():
    backend = kp.get_backend("cpu")
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert backend.optimize_for_training(model, sgd)[1] is sgd
    assert "SGD has no fused torch kernel" in backend.last_result.optimizations_applied[-1]
    foreach = torch.optim.Adam(model.parameters(), foreach=True)
    assert backend.optimize_for_training(model, foreach)[1] is foreach
    assert "foreach" in backend.last_result.optimizations_applied[-1]


def test_detector_caches_until_force_redetect():
    det = tensor_ops.HardwareDetector()
    first = det.detect()
    assert det.detect() is first and det.detect(force_redetect=True) is not first
    assert det.get_optimal_backend(first) == first.backend
    with pytest.raises(tensor_ops.InvalidArgumentError, match="HardwareProfile"):
        det.get_optimal_backend("cpu")
    assert kp.HardwareDetector().get_optimal_backend() in ("nvidia", "amd", "intel", "tpu", "opencl", "cpu")


def test_device_info_optional_fields_and_sizes():
    info = tensor_ops.DeviceInfo(backend="cpu", device_type="cpu", device_id=0, device_name="n",
                                 total_memory_bytes=3 << 20)
    assert (info.total_memory_mb, info.compute_capability, info.is_available) == (3.0, "", True)
    d = info.to_dict()
    assert d["total_memory_gb"] == 3 / 1024 and d["total_memory_mb"] == 3.0


def test_context_manager_empties_the_cache_on_exit():
    backend = kp.get_backend("cpu")
    before = tensor_ops.memory_stats("cpu:0")["reserved_bytes.all.current"]
    with backend as b:
        assert b is backend
        t = tensor_ops.empty((1 << 24,), "float32", "cpu:0")  # 64 MiB: a segment of its own
        del t
        cached = tensor_ops.memory_stats("cpu:0")["reserved_bytes.all.current"]
        assert cached >= before + (64 << 20)  # the pool keeps it until emptied
    assert tensor_ops.memory_stats("cpu:0")["reserved_bytes.all.current"] <= before


def test_memory_manager_on_the_cpu():
    mm = kp.MemoryManager("cpu:0")
    t = mm.allocate_with_oom_protection((4, 8), torch.float16, safety_margin=1.5)
    assert isinstance(t, torch.Tensor) and t.shape == (4, 8) and t.dtype == torch.float16
    a = mm.allocate_tensor((16, 16), torch.float32, pool_id="compat-test")
    ptr = a.data_ptr()
    mm.return_to_pool(a, "compat-test")
    assert mm.allocate_tensor((16, 16), torch.float32, pool_id="compat-test").data_ptr() == ptr
    mm.clear_pool("compat-test")
    stats = mm.get_memory_stats()
    assert {"allocated_gb", "reserved_gb"} <= set(stats)
    with pytest.raises(kp.OutOfMemoryError, match="tried to allocate .* device free") as e:
        mm.allocate_with_oom_protection((1 << 20, 1 << 20, 1 << 10), torch.float32)
    assert isinstance(e.value, kp.MemoryAllocationError) and isinstance(e.value, kp.NVIDIABackendError)


def test_flash_attention3_returns_output_and_weights():
    torch.manual_seed(0)
    attn = kp.FlashAttention3(embed_dim=32, num_heads=4, causal=True).eval()
    x = torch.randn(3, 6, 32)
    result = attn(x)
    assert isinstance(result, tuple) and len(result) == 2  # `output, weights = attn(x)` never unpacks the batch
    output, weights = result
    assert output.shape == (3, 6, 32) and weights is None
    output2, weights = attn(x, return_attention_weights=True)
    torch.testing.assert_close(output2, output, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 6))


def test_airllm_facts_come_from_the_cpu_backend():
    info = airllm.get_optimization_info()
    cpu = tensor_ops.backend_info("cpu")
    for key in ("has_avx2", "has_avx512", "has_fma"):
        assert info[key] == cpu[key]
    assert info["has_simd"] == (cpu["simd_level"] != "baseline") and info["has_openmp"] is False
    assert info["has_avx"] == (cpu["has_avx2"] or cpu["has_avx512"])
    b = airllm.get_backend_info()
    assert b["active_backend"] == airllm.get_backend() and b["active_backend"] in b["available_backends"]
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    np.testing.assert_allclose(airllm.cpp.silu(x), airllm.silu(x), rtol=1e-6)


@pytest.mark.skipif(_usable("cuda"), reason="CUDA is usable here")
def test_airllm_cuda_module_raises_where_cuda_is_not_usable():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(tensor_ops.BackendUnavailableError, match="cuda"):
        airllm.get_cuda_info()
    with pytest.raises(tensor_ops.BackendUnavailableError):
        airllm.cuda.rms_norm(x, np.ones(8, np.float32))


def test_configs_take_the_guides_fields_and_refuse_typos():
    config = kp.KernelPyTorchConfig()
    config.hardware.nvidia.fp8_enabled = True
    with pytest.raises(AttributeError, match="fp8_enabeld"):
        config.hardware.nvidia.fp8_enabeld = True
    with pytest.raises(AttributeError, match="enable_amx"):
        tb.IntelConfig().enable_amxx = True
    assert tb.TorchBridgeConfig.for_inference().optimization_level == kp.OptimizationLevel.O2
