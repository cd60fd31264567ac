"""prepare_model: a torch model onto a backend and its fused kernels, by
optimization level, reporting everything it changed; validate_model: the
prepared model against the original on each backend."""
from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

import tensor_ops
from tensor_ops import BackendUnavailableError

from . import modules, swap_check
from .factory import Backend, BackendFactory, BackendType


class OptimizationLevel(enum.IntEnum):
    """O0: device placement only. O1: + fused modules for norms, activations
    and gated MLPs. O2: + torch.compile. O3: + reduced precision (bfloat16
    where the device has it, else float16)."""

    O0 = 0
    O1 = 1
    O2 = 2
    O3 = 3
    NONE = 0
    CONSERVATIVE = 1
    BALANCED = 2
    AGGRESSIVE = 3

    @classmethod
    def from_string(cls, value: Union[str, int, "OptimizationLevel"]) -> "OptimizationLevel":
        """"O2", "o2", "2", "balanced" (any case), 2 or a member."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
            return cls(value)
        if isinstance(value, str):
            key = value.strip().upper()
            if key.isdigit():
                key = "O" + key
            if key in cls.__members__:
                return cls.__members__[key]
        names = ", ".join(f"{m.name} ({n.lower()})" for n, m in cls.__members__.items() if n != m.name)
        raise ValueError(f"unknown optimization level {value!r}; valid: {names}, or 0-3")

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass
class OptimizationResult:
    success: bool
    level: OptimizationLevel
    optimizations_applied: List[str]
    warnings: List[str]
    metrics: Dict[str, Any]

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["level"] = self.level.name
        return d


# HF's RMSNorm classes that compute weight * x / rms(x) (Gemma's 1 + weight does not).
HF_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"}
# Activation modules by class name (HF's transformers.activations included).
_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu", "GELUTanh": "gelu_tanh",
                "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _activation_of(act: nn.Module) -> Optional[str]:
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if isinstance(act, nn.SiLU):
        return "silu"
    return _ACTIVATIONS.get(type(act).__name__)


def _gated_mlp(m: nn.Module, warnings: List[str], path: str) -> Optional[nn.Module]:
    """A SwiGLU over m's own Linear modules when m is an HF-style gated MLP."""
    children = dict(m.named_children())
    if (not {"gate_proj", "up_proj", "down_proj"} <= set(children) or isinstance(m, modules.SwiGLU)
            or getattr(type(m), "_tensor_ops_kind", None) is not None):  # already ours (a class patch: hf.py)
        return None
    why = None
    g, u, d = children["gate_proj"], children["up_proj"], children["down_proj"]
    act = _activation_of(children["act_fn"]) if "act_fn" in children else None
    if set(children) != _MLP_CHILDREN:
        why = f"children {sorted(children)} are not exactly {sorted(_MLP_CHILDREN)}"
    elif not all(type(x) is nn.Linear for x in (g, u, d)):
        why = "gate/up/down are not all nn.Linear"
    elif not (g.in_features == u.in_features == d.out_features and g.out_features == u.out_features == d.in_features):
        why = "the Linear shapes do not chain"
    elif act is None:
        why = f"act_fn {type(children['act_fn']).__name__} is not SiLU or GELU"
    else:  # Note [checked swaps] (swap_check.py)
        why = swap_check.state_left_behind(m, children["act_fn"]) or swap_check.names_mismatch(
            m, frozenset(_MLP_CHILDREN))
    why = why or swap_check.same_output(
        m, lambda mod, x: modules.SwiGLU.from_linears(mod.gate_proj, mod.up_proj, mod.down_proj, act)(x), g.in_features)
    if why:
        warnings.append(f"{path or 'the model'} ({type(m).__name__}) looks like a gated MLP but was left as is: {why}")
        return None
    return modules.SwiGLU.from_linears(g, u, d, act)


_LEFT_AS_IS = " looks like a gated MLP but was left as is: "


def _withdraw_mlp_warnings(model: nn.Module, warnings: List[str]) -> None:
    """The generic gated-MLP check (_swiglu_of) runs before hf.py's, which
    knows more activations (FastGELU: a gelu_tanh GLU): its "left as is"
    warning is withdrawn for a module hf.py then swapped, and a module both
    checks refused keeps one warning (the first)."""
    mods = dict(model.named_modules())
    seen, kept = set(), []
    for w in warnings:
        if _LEFT_AS_IS in w:
            path = w.split(" (", 1)[0]
            m = mods.get(path if path != "the model" else "")
            if path in seen or (m is not None and getattr(type(m), "_tensor_ops_kind", None) is not None):
                continue
            seen.add(path)
        kept.append(w)
    warnings[:] = kept


def _hf_rms_norm(m: nn.Module, warnings: List[str], path: str) -> Optional[nn.Module]:
    """An RMSNorm holding m's weight when m is one of HF's RMSNorm classes."""
    if type(m).__name__ not in HF_RMS_NORMS:
        return None
    w, eps = getattr(m, "weight", None), getattr(m, "variance_epsilon", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or not isinstance(eps, float):
        warnings.append(f"{path or 'the model'} ({type(m).__name__}) was left as is: no 1-d weight Parameter "
                        f"and float variance_epsilon")
        return None
    norm = modules.HFRMSNorm(w.shape[0], eps=eps, device="meta")
    norm.weight = w
    why = swap_check.same_output(m, lambda mod, x: modules.hf_rms_norm(x, mod.weight, eps), w.shape[0])  # Note [checked swaps]
    if why:
        warnings.append(f"{path or 'the model'} ({type(m).__name__}) was left as is: {why}")
        return None
    return norm


_CLASS_SWAPS = {nn.RMSNorm: modules.RMSNorm, nn.LayerNorm: modules.LayerNorm, nn.SiLU: modules.SiLU,
                nn.GELU: modules.GELU}


# The per-module state a replacement takes over from the module it replaces:
# hooks registered before prepare_model keep firing (they were dropped), and
# the train / eval mode is the model's (a new module is in training mode).
def _carry_over(old: nn.Module, new: nn.Module) -> None:
    new.train(old.training)
    for name in swap_check.CALL_HOOKS:
        hooks = getattr(old, name, None)
        if hooks:
            getattr(new, name).update(hooks)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


# What _swap_modules may swap, by kind (the per-kernel switches of
# hf.apply_tensor_ops_kernel): torch's classes by kind, and the kinds of the
# recognisers that build new modules.
_CLASS_KINDS = {nn.RMSNorm: "rms_norm", nn.LayerNorm: "layer_norm", nn.SiLU: "activations", nn.GELU: "activations"}
SWAP_KINDS = frozenset({"rms_norm", "layer_norm", "activations", "swiglu"})


def _swap_modules(m: nn.Module, path: str, warnings: List[str], counts: collections.Counter,
                  kinds: frozenset = SWAP_KINDS) -> nn.Module:
    """m with, in place, torch's norms and activations swapped for ours (a
    class swap: same object, same Parameters) and gated MLPs / HF RMSNorms
    replaced by new modules holding the same Parameters, at any depth (m
    itself included); only the kinds in `kinds` (SWAP_KINDS). Counts
    "Old -> tensor_ops.torch.New"."""
    old = type(m).__name__
    new = _CLASS_SWAPS.get(type(m))
    if new is not None and _CLASS_KINDS[type(m)] in kinds:
        m.__class__ = new
        counts[f"{old} -> tensor_ops.torch.{new.__name__}"] += 1
        return m
    replacement = ("swiglu" in kinds and _gated_mlp(m, warnings, path)) or (
        "rms_norm" in kinds and _hf_rms_norm(m, warnings, path)) or None
    if replacement is not None:
        _carry_over(m, replacement)
        counts[f"{old} -> tensor_ops.torch.{type(replacement).__name__}"] += 1
        return replacement
    for name, child in list(m.named_children()):
        swapped = _swap_modules(child, f"{path}.{name}" if path else name, warnings, counts, kinds)
        if swapped is not child:
            setattr(m, name, swapped)
    return m


def _swap_linears(model: nn.Module, counts: collections.Counter) -> None:
    """Every nn.Linear and transformers Conv1D (exactly: subclasses have
    forwards of their own, as the Conv1D + activation epilogue hf.py makes)
    at any depth becomes tensor_ops.torch.Linear / Conv1D, in place (a class
    swap): its few-row calls (decode) run our linear kernel. Last, after the
    swaps that look for nn.Linear / Conv1D children (gated MLPs, Linear +
    activation pairs)."""
    # Conv1D is transformers': looked up only where transformers is imported (a model holding one imported it).
    hf_conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = modules.Linear
            counts["Linear -> tensor_ops.torch.Linear"] += 1
        elif hf_conv1d is not None and type(m) is hf_conv1d:
            m.__class__ = modules.conv1d_class()
            counts["Conv1D -> tensor_ops.torch.Conv1D"] += 1


def _linears_swapped(counts: collections.Counter) -> bool:
    """Whether O1 swapped Linear / Conv1D modules (or made Linear + activation epilogues)."""
    return any("Linear" in k or "Conv1D" in k for k in counts)


def _is_transformers_model(model: nn.Module) -> bool:
    """Whether model holds transformers modules (transformers is then imported already)."""
    return "transformers" in sys.modules and any(
        type(m).__module__.startswith("transformers.") for m in model.modules())


def _reduced_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16  # CPU (fp32 math on bf16 storage in our kernels), XPU, XLA


def _cast_inputs_hook(dtype: torch.dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module, args, kwargs):
        return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)

    return hook


def _tensors(model: nn.Module) -> List[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


_HF_ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def prepare_model(model: nn.Module, level: Union[str, int, OptimizationLevel] = OptimizationLevel.O1, *,
                  backend: Union[str, BackendType, Backend, None] = None,
                  compile_options: Optional[Dict[str, Any]] = None,
                  example_inputs: Optional[Sequence[Any]] = None) -> Tuple[nn.Module, OptimizationResult]:
    """Prepares `model` in place and returns (model, OptimizationResult); the
    returned model is a new object only where `model` itself is replaced (an
    HF-style MLP or RMSNorm given alone).

    O0 moves it to the backend's torch device (default: the best backend);
    O1 also swaps nn.RMSNorm / LayerNorm / SiLU / GELU for tensor_ops.torch's
    modules and HF-style gated MLPs (gate_proj, up_proj, down_proj, act_fn)
    and HF RMSNorms for SwiGLU / RMSNorm holding the same Parameters (the
    state_dict keys do not change), and on the CPU backend nn.Linear and
    transformers' Conv1D (GPT-2) for tensor_ops.torch.Linear / Conv1D
    (few-row calls, decode, on our linear kernel);
    on a transformers model, O1 also runs
    tensor_ops.torch.hf.prepare_hf_model (Gemma norms, fused gate/up MLPs,
    Linear + activation epilogues, activations, RoPE, attention through
    transformers' AttentionInterface, the causal-LM loss on our
    cross_entropy) and names in warnings what it leaves on torch; O2 also compiles it (Module.compile with
    compile_options); O3 also stores it in reduced precision and casts
    floating inputs on entry. With example_inputs, the prepared model runs once
    (which also compiles it); if that fails, the compile is undone and the
    result says success=False."""
    start = time.perf_counter()
    level = OptimizationLevel.from_string(level)
    if not isinstance(backend, Backend):
        backend = BackendFactory.create(BackendType.AUTO if backend is None else backend)
    backend._check_host_device()
    applied: List[str] = []
    warnings: List[str] = []
    metrics: Dict[str, Any] = {"backend": backend.name, "device": str(backend.device)}

    tensors = _tensors(model)
    if any(t.is_meta for t in tensors):
        # Built on the meta device (init_empty_weights-style): no data to move; the caller materialises it
        # (to_empty, load_state_dict(assign=True)), the swaps below keep the same Parameters.
        warnings.append(f"the model has tensors on the meta device (no data yet): left there, not moved to "
                        f"{backend.device}; materialise it (model.to_empty(device=...), "
                        f"load_state_dict(..., assign=True)) before running it")
    else:
        moved = sum(t.device != backend.device for t in tensors)
        backend.to_device(model)
        applied.append(f"device placement: {backend.device} (backend {backend.name}), "
                       f"moved {moved} of {len(tensors)} parameter/buffer tensors")
    active = tensor_ops.get_backend()
    if backend.device.type == "cpu" and backend.name != active:
        warnings.append(f"{backend.name} takes host tensors, and host tensors run on the active backend ({active}): "
                        f"call the model inside `with backend:` or after tensor_ops.set_backend({backend.name!r})")

    counts: collections.Counter = collections.Counter()
    # Our kernels take float32, float16 and bfloat16: a model holding other floating
    # parameters (float64) keeps torch's modules, and says so (it raised at its first call).
    odd = sorted({str(t.dtype).replace("torch.", "") for t in tensors
                  if t.is_floating_point() and t.dtype not in modules._KERNEL_DTYPES})
    if odd and level >= OptimizationLevel.O1:
        warnings.append(f"O1: the model has {'/'.join(odd)} parameters or buffers; tensor_ops kernels take "
                        f"float32, float16 and bfloat16, so no module was swapped (cast the model first)")
    elif level >= OptimizationLevel.O1:
        model = _swap_modules(model, "", warnings, counts)
        if _is_transformers_model(model):
            from . import hf  # imported only when transformers already is

            hf.prepare_hf_model(model, warnings, counts)
            _withdraw_mlp_warnings(model, warnings)
        if backend.name == "cpu":  # the only backend with a linear kernel
            _swap_linears(model, counts)
        applied += [f"{swap} x{n}" for swap, n in sorted(counts.items())]
        if not counts:
            warnings.append("O1: no module tensor_ops replaces was found")
        encoders = sum(isinstance(m, nn.TransformerEncoderLayer) for m in model.modules())
        if encoders and counts:
            warnings.append(f"{encoders} nn.TransformerEncoderLayer: in eval mode without gradients torch runs "
                            f"them on its fused fast path (torch._transformer_encoder_layer_fwd), which reads the "
                            f"norms' weights and uses its own kernels, not the swapped modules; training and calls "
                            f"the fast path does not take run ours")
    if level >= OptimizationLevel.O3:
        dtype = _reduced_dtype(backend.device)
        n = sum(t.is_floating_point() for t in _tensors(model))
        # Real floating tensors only: Module.to(dtype) also casts complex ones to the real dtype, which
        # dropped the imaginary part of a complex RoPE table (torchtitan's freqs_cis: output 0.73 off).
        # model.to itself still runs (transformers' refusals for quantized models live there); the
        # complex tensors are put back after it.
        complex_slots = [(m, slot, name, t if slot == "_buffers" else t.data) for m in model.modules()
                         for slot in ("_parameters", "_buffers") for name, t in getattr(m, slot).items()
                         if t is not None and t.is_complex()]
        kept = len(complex_slots)
        # transformers' rotary embeddings compute cos / sin from inv_freq in fp32 (.float(), autocast
        # off), and from_pretrained(dtype=bfloat16) leaves it fp32: rounded to bf16 by model.to, cos at
        # position 4000 was 0.69 off (HF's own bf16: 0.002). Kept as they are, as from_pretrained keeps them.
        rotary = [(m, name, t) for m in model.modules() if type(m).__module__.startswith("transformers.")
                  for name, t in m._buffers.items() if name in _HF_ROTARY_BUFFERS and t is not None
                  and t.dtype == torch.float32]
        model.to(dtype)
        for m, slot, name, original in complex_slots:
            if slot == "_buffers":
                m._buffers[name] = original
            else:
                m._parameters[name].data = original
        for m, name, original in rotary:
            m._buffers[name] = original
        model.register_forward_pre_hook(_cast_inputs_hook(dtype), with_kwargs=True)
        applied.append(f"reduced precision: {n} floating parameter/buffer tensors in {dtype}, "
                       f"floating inputs cast on entry (a forward pre-hook taking kwargs, which torch.jit.script "
                       f"cannot compile: to script, prepare at O1 after model.to({dtype}))"
                       + (f"; {kept} complex tensors kept as they were"
                                                           if kept else "")
                       + (f"; {len(rotary)} rotary inv_freq buffers kept in float32, as from_pretrained "
                          f"keeps them" if rotary else ""))
        if (backend.name == "cpu" and backend.get_device_info().properties.get("has_avx512_bf16") == "0"
                and not (_linears_swapped(counts) and modules.half_gemm_in_fp32(dtype))):
            warnings.append("O3 on a CPU without bf16 instructions (has_avx512_bf16=0): torch's bf16 matmuls "
                            "are emulated here and can run many times slower than float32")
    if level >= OptimizationLevel.O1 and backend.device.type == "cpu" and _linears_swapped(counts):
        # Note [half GEMMs in fp32] (modules.py): said where the model holds such a dtype.
        halves = sorted({str(t.dtype)[len("torch."):] for t in _tensors(model)
                         if t.dtype in modules._HALF and modules.half_gemm_in_fp32(t.dtype)})
        if halves:
            applied.append(f"{' / '.join(halves)} GEMMs of the Linear / Conv1D modules computed in float32 and "
                           f"rounded once: this CPU has no native {' / '.join(halves)} GEMM "
                           f"(TENSOR_OPS_HALF_GEMM=native keeps torch's)")
    if level >= OptimizationLevel.O2:
        options = dict(compile_options or {})
        model.compile(**options)
        applied.append(f"torch.compile ({', '.join(f'{k}={v}' for k, v in options.items()) or 'default options'})")

    success = True
    if example_inputs is not None:
        warm = time.perf_counter()
        try:
            with torch.set_grad_enabled(model.training and torch.is_grad_enabled()):
                model(*example_inputs)
            metrics["warmup_s"] = time.perf_counter() - warm
        except Exception as e:  # reported, not raised: the model stays usable
            success = False
            warnings.append(f"the prepared model failed on example_inputs: {type(e).__name__}: {e}")
            if level >= OptimizationLevel.O2:
                model._compiled_call_impl = None  # what Module.compile set: back to eager
                warnings.append("torch.compile undone")

    params = list(model.parameters())
    first = params[0] if params else None
    metrics.update({
        "parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "dtype": str(first.dtype) if first is not None else None,
        "modules_replaced": sum(counts.values()),
        "replacements": dict(counts),
        "time_s": time.perf_counter() - start,
    })
    # The generic and the HF recognisers can both refuse one module with the same words: said once.
    return model, OptimizationResult(success, level, applied, list(dict.fromkeys(warnings)), metrics)


@dataclasses.dataclass
class ValidationResult:
    passed: int
    total: int
    results: Dict[str, Dict[str, Any]]  # per backend: passed, max_abs_error, max_rel_error, tolerance, error

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# Largest error relative to the reference's largest magnitude, by output dtype.
VALIDATION_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float64: 1e-6}


def _call(model, sample_input, device):
    moved = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, sample_input)
    if isinstance(moved, dict):
        return model(**moved)
    if isinstance(moved, (tuple, list)):
        return model(*moved)
    return model(moved)


def validate_model(model: nn.Module, sample_input, backends: Optional[Sequence[Union[str, BackendType]]] = None,
                   level: Union[str, int, OptimizationLevel] = OptimizationLevel.O1,
                   **prepare_options) -> ValidationResult:
    """Runs a prepared copy of `model` (eval mode, no grad) on each backend
    (default: every available one) and compares every output tensor with the
    unprepared copy on the same device. sample_input: a tensor, a tuple of
    positional inputs or a dict of keyword inputs. A backend that cannot run
    counts as failed, with its reason; `model` itself is not changed.
    prepare_options go to prepare_model (e.g. compile_options)."""
    names = BackendFactory.list_available_backends() if backends is None else list(backends)
    results: Dict[str, Dict[str, Any]] = {}
    for name in names:
        key = str(BackendType.from_string(name))  # unknown names raise ValueError here
        try:
            backend = BackendFactory.create(key)
        except BackendUnavailableError as e:
            results[key] = {"passed": False, "error": str(e)}
            continue
        try:
            with torch.no_grad():
                ref = _call(backend.to_device(copy.deepcopy(model)).eval(), sample_input, backend.device)
                prepared, _ = prepare_model(copy.deepcopy(model).eval(), level, backend=backend, **prepare_options)
                with backend:
                    got = _call(prepared, sample_input, backend.device)
        except Exception as e:
            results[key] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
            continue
        results[key] = _compare(pytree.tree_leaves(got), pytree.tree_leaves(ref))
    return ValidationResult(sum(r["passed"] for r in results.values()), len(results), results)


def _compare(got: List[Any], ref: List[Any]) -> Dict[str, Any]:
    if len(got) != len(ref):
        return {"passed": False, "error": f"outputs differ in structure: {len(got)} vs {len(ref)} leaves"}
    pairs = [(g, r) for g, r in zip(got, ref) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    if not pairs:
        return {"passed": False, "error": "the model returned no floating-point tensor to compare"}
    max_abs, max_rel, tol = 0.0, 0.0, 0.0
    for g, r in pairs:
        err = (g.double() - r.double()).abs().max().item() if r.numel() else 0.0
        scale = r.double().abs().max().item() if r.numel() else 0.0
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / max(scale, 1e-30))
        tol = max(tol, VALIDATION_TOLERANCE.get(g.dtype, 1e-4))
    return {"passed": max_rel <= tol, "max_abs_error": max_abs, "max_rel_error": max_rel, "tolerance": tol}
