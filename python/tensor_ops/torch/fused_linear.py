"""Linear + activation (the seeds' FusedLinearGELU / FusedLinearSiLU and
prepare_model_with_custom_kernels).

The GEMM is torch's (addmm: MKL / oneDNN on the CPU, cuBLAS / hipBLAS on
GPUs, with the bias folded into the GEMM), or for a few rows with nothing to
differentiate (decode) our linear kernel (modules.linear_rows); the activation is our kernel run
in place on the GEMM's output, so there is no second output tensor and no
extra pass through torch's dispatcher. Without autograd (inference, or
torch.no_grad) that is the whole forward. With autograd the pre-activation
must survive for the backward, so the activation writes a new tensor; the
backward is our activation_backward kernel (torch's for erf GELU, which is
faster for now) then torch's matmuls."""
from __future__ import annotations

import collections
import logging
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

import tensor_ops as _to

from . import functional as ops
from .custom_ops import first_order
from .modules import GELU as _ModulesGELU
from .modules import Linear as _ModulesLinear
from .modules import SiLU as _ModulesSiLU
from .modules import _KERNEL_DTYPES, _log_torch_dtype, _widened_gemm, half_mm, linear_max_rows, linear_rows, widens

_log = logging.getLogger("tensor_ops")
_tracing_state = torch._C._get_tracing_state  # torch.jit.trace under way: not None


def _gemm(x2: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    # Traced, linear_rows takes nothing: no row-count test there (it put a guard on the sequence
    # length into compiled and exported graphs: torch.export with a dynamic length from 2 refused;
    # torch.jit.trace warned of a size read as a Python bool).
    if not torch.compiler.is_compiling() and _tracing_state() is None and x2.shape[0] <= linear_max_rows(x2.dtype):
        # A few rows (decode): our linear kernel where it applies (linear_rows:
        # no gradient to record, plain CPU tensors), on the weight as stored:
        # a Conv1D's [in, out] weight arrives as its transposed view.
        kn = not weight.is_contiguous() and weight.t().is_contiguous()
        y = linear_rows(x2, weight.t() if kn else weight, bias, "kn" if kn else "nk")
        if y is not None:
            return y
    if widens(x2, weight, bias):
        return _widened_gemm(x2, weight, bias, False, x2.dtype)  # Note [half GEMMs in fp32]
    return torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())


_fwad = torch.autograd.forward_ad  # ._current_level: the dual level, -1 outside one
_functorch_stack = torch._C._functorch.peek_interpreter_stack


def _activate_(h: torch.Tensor, act: str) -> torch.Tensor:
    """act(h) written over h."""
    if act == "silu":
        return _to.silu(h, out=h)
    return _to.gelu(h, "tanh" if act == "gelu_tanh" else "none", out=h)


class _LinearActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, act):
        h = _gemm(x2, weight, bias)
        ctx.save_for_backward(x2, weight, h)
        ctx.act, ctx.has_bias = act, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return ops.silu(h) if act == "silu" else ops.gelu(h, "tanh" if act == "gelu_tanh" else "none")

    @staticmethod
    @first_order  # Note [first-order gradients] (custom_ops.py): our activation backward
    def backward(ctx, dy):
        x2, weight, h = ctx.saved_tensors
        dy = dy.contiguous()
        if ctx.act == "silu":
            dh = ops.silu_backward(dy, h)
        elif ctx.act == "gelu_tanh":
            dh = ops.gelu_backward(dy, h, "tanh")
        else:
            # Our erf GELU backward kernel measured ~8x slower than torch's on
            # float32[2048, 3072] (2 AVX2 threads, 2026-11): torch's, until it is not.
            dh = torch.ops.aten.gelu_backward(dy, h, approximate="none")
        # Under autocast the forward's GEMM ran in the autocast dtype (h, dh:
        # bf16) on fp32 x2 / weight: the backward GEMMs run in dh's dtype,
        # as autocast's addmm backward does, and each gradient comes back in
        # its input's dtype.
        w, x = weight.to(dh.dtype), x2.to(dh.dtype)
        dx = half_mm(dh, w).to(x2.dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            # In the weight's own layout: a Conv1D's [in, out] weight comes as a transposed view, and a
            # gradient in the other layout would be copied whole by autograd's accumulation into .grad.
            dw = (half_mm(x.t(), dh).t() if weight.t().is_contiguous() and not weight.is_contiguous()
                  else half_mm(dh.t(), x)).to(weight.dtype)
        db = dh.sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias=None, activation: str = "gelu") -> torch.Tensor:
    """activation(x @ weight.T + bias), activation "gelu", "gelu_tanh" or
    "silu", on any leading dims of x."""
    if activation not in ("gelu", "gelu_tanh", "silu"):
        raise ValueError(f"activation must be 'gelu', 'gelu_tanh' or 'silu', got {activation!r}")
    if x.dtype not in _KERNEL_DTYPES or x.dim() == 0 or x.shape[-1] == 0:
        # a model cast to float64 after prepare_model: torch's arithmetic; a 0-d x (torch's error) and
        # in_features 0 (the bias: reshape(-1, 0) raised) as torch's Linear + activation
        if x.dtype not in _KERNEL_DTYPES:
            _log_torch_dtype(FusedLinearGELU if activation != "silu" else FusedLinearSiLU, "F.linear + activation",
                             x.dtype)
        h = F.linear(x, weight, bias)
        return F.silu(h) if activation == "silu" else F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
    if _fwad._current_level >= 0 or not torch.compiler.is_compiling() and _functorch_stack() is not None:
        # torch.func's transforms (the ctx-style Function is refused there) and
        # tangents (Note [forward-mode AD]): torch's GEMM, the functional activation
        h = F.linear(x, weight, bias)
        return ops.silu(h) if activation == "silu" else ops.gelu(h, "tanh" if activation == "gelu_tanh" else "none")
    x2 = x.reshape(-1, x.shape[-1])
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if _tracing_state() is not None or not grad and (torch.compiler.is_compiling() or type(x) is not torch.Tensor):
        # Traced or a subclass: our GEMM route (16-bit widened where that is
        # the policy), then the functional custom op out of place.
        # torch.jit.trace records dispatcher ops only (_activate_'s write in
        # place is none), and its graph must not depend on the grad mode
        # (check_trace changes it), so it takes this with grad too.
        h = _gemm(x2, weight, bias)
        y = ops.silu(h) if activation == "silu" else ops.gelu(h, "tanh" if activation == "gelu_tanh" else "none")
    elif grad:
        y = _LinearActivation.apply(x2, weight, bias, activation)
    else:
        y = _activate_(_gemm(x2, weight, bias), activation)
    return y.view(*x.shape[:-1], weight.shape[0])


class FusedLinearGELU(nn.Linear):
    """nn.Linear followed by GELU (approximate "none" or "tanh"): the same
    parameters and state_dict as nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, approximate: str = "none",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules] (modules.py)
            return F.gelu(F.linear(x, self.weight, self.bias), approximate=self.approximate)
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_activation(x, self.weight, self.bias, "gelu_tanh" if self.approximate == "tanh" else "gelu")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, approximate={self.approximate!r}"


class FusedLinearSiLU(nn.Linear):
    """nn.Linear followed by SiLU, nn.Linear's parameters and state_dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules] (modules.py)
            return F.silu(F.linear(x, self.weight, self.bias))
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_activation(x, self.weight, self.bias, "silu")


def _pair_kind(lin: nn.Module, act: nn.Module):
    """The activation of a Linear -> activation pair we run as one epilogue
    ("gelu", "gelu_tanh", "silu"), or None: lin a plain Linear (torch's or
    ours), act nn.GELU / nn.SiLU (or ours), neither hooked."""
    if plain_linear_layout(lin) != "nk":
        return None
    kind = torch_activation_kind(act)
    return None if kind is None or hooked(lin) or hooked(act) else kind


def torch_activation_kind(act: nn.Module):
    """"gelu", "gelu_tanh" or "silu" for torch's nn.GELU / nn.SiLU (or ours),
    or a subclass keeping its forward; None for anything else: a subclass
    with a forward of its own (CLIP's QuickGELU(nn.GELU)) computes another
    function."""
    t = type(act)
    if isinstance(act, nn.GELU) and (t.forward is nn.GELU.forward or t is _ModulesGELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if isinstance(act, nn.SiLU) and (t.forward is nn.SiLU.forward or t is _ModulesSiLU):
        return "silu"
    return None


def plain_linear_layout(lin: nn.Module):
    """'nk' for a plain nn.Linear (or ours), 'kn' for a plain transformers
    Conv1D (or ours), None for anything else (a LoRA wrapper, a quantized
    linear): the linears a fused Linear + activation may read the weight of."""
    t = type(lin)
    if t is nn.Linear or t is _ModulesLinear:
        return "nk"
    if t.__name__ == "Conv1D" and (t.__module__.startswith("transformers.")
                                   or t.__module__ == _ModulesLinear.__module__):  # ours: modules.conv1d_class()
        return "kn"
    return None


def hooked(m: nn.Module) -> bool:
    """Whether calling m does more than its class's forward: torch's hooks,
    or a forward set on the instance (accelerate's offload hooks replace it
    to load the weights, which sit on the meta device until then)."""
    return "forward" in m.__dict__ or any(
        getattr(m, name, None) for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                            "_backward_pre_hooks", "_forward_hooks_with_kwargs")) or any(
        getattr(_torch_module, name, None) for name in _GLOBAL_HOOKS)  # torch.nn.modules.module.register_module_*


_torch_module = torch.nn.modules.module
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


# Note [fused in the Sequential]: prepare_model_with_custom_kernels makes an
# nn.Sequential with Linear -> GELU / SiLU pairs a FusingSequential (a class
# swap: the same children, Parameters and state_dict), whose forward runs
# each pair as one Linear + activation epilogue while the Linear is plain
# and neither module has hooks, and the two modules otherwise. The Linear
# used to become FusedLinearGELU itself (the activation's slot nn.Identity):
# a LoRA adapter wrapping it afterwards added its update after the GELU, a
# hook added later saw GELU's output, and a Linear also called elsewhere got
# GELU there too. Here each call decides.
class FusingSequential(nn.Sequential):
    """nn.Sequential whose Linear -> GELU / SiLU pairs run as one Linear +
    activation epilogue (Note [fused in the Sequential])."""

    def forward(self, input):
        if torch.jit.is_scripting():  # Note [scripted modules] (modules.py)
            for module in self:
                input = module(input)
            return input
        return self._kernel_forward(input)

    @torch.jit.unused
    def _kernel_forward(self, x):
        mods = list(self._modules.values())
        i, n = 0, len(mods)
        while i < n:
            m = mods[i]
            kind = _pair_kind(m, mods[i + 1]) if i + 1 < n else None
            if kind is not None:
                x = linear_activation(x, m.weight, m.bias, kind)
                i += 2
            else:
                x = m(x)
                i += 1
        return x


def _fuse_sequentials(m: nn.Module, counts: collections.Counter, skipped: list, path: str = "") -> None:
    """Every plain nn.Sequential under m with a Linear -> GELU / SiLU pair
    becomes a FusingSequential, in place; a subclass of nn.Sequential with
    such pairs is named in `skipped` (its forward may not be the chain)."""
    for name, child in m.named_children():
        _fuse_sequentials(child, counts, skipped, f"{path}.{name}" if path else name)
    if not isinstance(m, nn.Sequential) or isinstance(m, FusingSequential):
        return
    mods = list(m._modules.values())
    pairs = [f"Linear + {type(b).__name__}" for a, b in zip(mods, mods[1:]) if _pair_kind(a, b)]
    if pairs and type(m) is not nn.Sequential:
        skipped.append(f"{path or type(m).__name__} ({type(m).__qualname__}, a subclass of nn.Sequential) has "
                       f"{', '.join(pairs)} but was not fused: its forward may not run its children as a chain")
        return
    if pairs:
        m.__class__ = FusingSequential
        for what in pairs:
            counts[f"{what} -> one epilogue (tensor_ops.torch.FusingSequential)"] += 1


def prepare_model_with_custom_kernels(model: nn.Module, level="O1", **prepare_options) -> Tuple[nn.Module, object]:
    """Makes every nn.Sequential with an nn.Linear directly followed by
    nn.GELU / nn.SiLU a FusingSequential, which runs each such pair as one
    Linear + activation epilogue (the same modules, Parameters and state_dict
    keys: Note [fused in the Sequential]), then prepare_model(model, level,
    ...) for the other swaps.
    Returns prepare_model's (model, OptimizationResult), the fusions listed
    first in optimizations_applied."""
    from .prepare import prepare_model

    counts: collections.Counter = collections.Counter()
    skipped: list = []
    _fuse_sequentials(model, counts, skipped)
    model, result = prepare_model(model, level, **prepare_options)
    fused = [f"{what} x{n}" for what, n in sorted(counts.items())]
    if fused:
        result.warnings = [w for w in result.warnings if not w.startswith("O1: no module")]
    result.warnings.extend(f"prepare_model_with_custom_kernels: {w}" for w in skipped)
    result.optimizations_applied[1:1] = fused  # after device placement
    result.metrics["linear_activation_fusions"] = sum(counts.values())
    _log.debug("prepare_model_with_custom_kernels: %s", fused or "no Linear + GELU/SiLU pair")
    return model, result


__all__ = ["FusedLinearGELU", "FusedLinearSiLU", "FusingSequential", "linear_activation",
           "prepare_model_with_custom_kernels"]
