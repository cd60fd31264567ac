"""Drop-in torch modules running on tensor_ops kernels. Each has the
parameters, names and constructor of the module it replaces, so it loads the
same state_dict (the norms and activations subclass torch's own modules and
override only forward)."""
from __future__ import annotations

import functools
import logging
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import tensor_ops as _to
from tensor_ops import ops as _ops
from tensor_ops import UnsupportedError

from . import functional as ops


def _flat_last(x: torch.Tensor, normalized_shape) -> torch.Tensor:
    """x with its normalized trailing dims folded into one (our norms reduce
    over the last dim)."""
    if len(normalized_shape) == 1:
        return x
    if tuple(x.shape[x.dim() - len(normalized_shape):]) != tuple(normalized_shape) or x.dim() < len(normalized_shape):
        # torch's words; the fold gave another layout's answer, or a reshape error
        raise ValueError(f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
                         f"[*, {', '.join(map(str, normalized_shape))}], but got input of size {list(x.shape)}")
    return x.reshape(*x.shape[: x.dim() - len(normalized_shape)], math.prod(normalized_shape))


def _affine(param: Optional[torch.Tensor], x: torch.Tensor, n: int, fill: float) -> torch.Tensor:
    """The norm's weight or bias flattened and in x's dtype (a constant when
    the module has none)."""
    if param is None:
        return x.new_full((n,), fill)
    return param.reshape(n).to(x.dtype)


# The dtypes our kernels take. The drop-in norms and activations hand any
# other input (a model cast to float64 after prepare_model) to torch's own
# forward, and log it once.
_KERNEL_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))
_torch_dtype_logged = set()


def _log_torch_dtype(cls: type, what: str, dtype: torch.dtype) -> None:
    if (cls, dtype) not in _torch_dtype_logged:
        _torch_dtype_logged.add((cls, dtype))
        logging.getLogger("tensor_ops").warning(
            "tensor_ops.torch.%s: %s input runs torch's %s (our kernels take float32, float16 and bfloat16)",
            cls.__name__, str(dtype).replace("torch.", ""), what)


def _outside_base(cls: type) -> type:
    """The first class in cls's MRO that is not ours: the torch (or
    transformers) module ours subclasses (HFRMSNorm -> RMSNorm -> nn.RMSNorm:
    nn.RMSNorm; the next class alone recursed through ours)."""
    return next(c for c in cls.__mro__ if not c.__module__.startswith("tensor_ops."))


def _torch_forward(module: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    base = _outside_base(type(module))
    _log_torch_dtype(type(module), base.__name__, x.dtype)
    return base.forward(module, x, *args, **kwargs)


def torch_for_other_dtypes(forward):
    """A forward of a subclass of a torch / transformers module, for the
    dtypes our kernels take; the class's own forward for others (a model cast
    to float64 after prepare_model), logged once per class and dtype."""
    @functools.wraps(forward)
    def wrapped(self, x, *args, **kwargs):
        if x.dtype in _KERNEL_DTYPES:
            return forward(self, x, *args, **kwargs)
        return _torch_forward(self, x, *args, **kwargs)

    return wrapped


# Note [scripted modules]: torch.jit.script of a prepared model compiles
# each module's forward; ours call Python (the op table, dtype sets, try
# blocks), which TorchScript cannot compile, so a model that scripted before
# prepare_model failed after it. Each forward is now a TorchScript branch
# computing what the torch module it replaces computes (torch's own ops: the
# scripted model runs and saves anywhere, without our kernels) and, in
# Python, the kernel forward (torch.jit.unused: not compiled).


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm on the fused tensor_ops kernel (fp32 accumulation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules]
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _KERNEL_DTYPES:
            return _torch_forward(self, x)
        w = self.weight
        eps = self.eps if self.eps is not None else _OPMATH_EPS  # torch's default for eps=None
        if w is not None and w.dtype == x.dtype and len(self.normalized_shape) == 1:
            return ops.rms_norm(x, w, eps)  # the common case: no reshape, no cast, no view
        n = math.prod(self.normalized_shape)
        y = ops.rms_norm(_flat_last(x, self.normalized_shape), _affine(w, x, n, 1.0), eps)
        return y.view(x.shape)


# nn.RMSNorm(eps=None): torch takes the epsilon of its compute type, float32
# for float16 / bfloat16 input (1.19e-7), not the input dtype's: bf16's
# 0.0078 put a prepared model 0.21-0.88 off at activations of 0.1-0.01.
_OPMATH_EPS = torch.finfo(torch.float32).eps


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' *RMSNorm forward on our kernel: weight * normed.to(x.dtype).
    A weight of another dtype than x (an fp32 weight on bf16 activations
    under autocast) gives the promoted dtype, as HF's: the normalised x in
    x's dtype, then times the weight."""
    if weight.dtype == x.dtype:
        return ops.rms_norm(x, weight, eps)
    return weight * ops.rms_norm(x, torch.ones(weight.shape, dtype=x.dtype, device=x.device), eps)


class HFRMSNorm(RMSNorm):
    """What prepare_model puts in place of transformers' *RMSNorm classes
    (LlamaRMSNorm, Qwen3RMSNorm...): RMSNorm, except for a weight of another
    dtype than the input (an fp32 weight on bf16 activations under autocast),
    where HF's forward, weight * normed.to(x.dtype), gives the promoted dtype
    (ours gave x's): the normalised x in x's dtype, then times the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules]: HF's forward
            eps = self.eps
            h = x.to(torch.float32)
            dims = [-1 - i for i in range(len(self.normalized_shape))]  # every normalized dim, as eager
            # eps None: float32's, as the eager forward (_OPMATH_EPS; 1e-6 put a script 0.74 off at x ~ 1e-3)
            # (the literal: TorchScript does not read a module-level float such as _OPMATH_EPS)
            h = h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + (1.1920928955078125e-07 if eps is None else eps))
            w = self.weight
            return h.to(x.dtype) if w is None else w * h.to(x.dtype)
        return self._hf_forward(x)

    @torch.jit.unused
    def _hf_forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is None or w.dtype == x.dtype or x.dtype not in _KERNEL_DTYPES or len(self.normalized_shape) != 1:
            return self._kernel_forward(x)
        return hf_rms_norm(x, w, self.eps if self.eps is not None else _OPMATH_EPS)


class LayerNorm(nn.LayerNorm):
    """torch.nn.LayerNorm on the fused tensor_ops kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules]
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _KERNEL_DTYPES:
            return _torch_forward(self, x)
        w, b = self.weight, self.bias
        if (w is not None and w.dtype == x.dtype and (b is None or b.dtype == x.dtype)
                and len(self.normalized_shape) == 1):
            return ops.layer_norm(x, w, b, self.eps)  # the common case: no reshape, no cast, no view
        n = math.prod(self.normalized_shape)
        bias = None if self.bias is None else _affine(self.bias, x, n, 0.0)
        y = ops.layer_norm(_flat_last(x, self.normalized_shape), _affine(self.weight, x, n, 1.0), bias, self.eps)
        return y.view(x.shape)


class SiLU(nn.SiLU):
    """torch.nn.SiLU on our kernel. inplace=True writes x and returns it, as
    torch's: through our kernel when there is nothing to differentiate,
    torch's own in-place op when x records a gradient (our backward saves x,
    which the write would overwrite)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules]
            return F.silu(x, inplace=self.inplace)
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _KERNEL_DTYPES:
            return _torch_forward(self, x)
        if not self.inplace:
            return ops.silu(x)
        if (torch.is_grad_enabled() and x.requires_grad) or not x.is_cpu or _is_compiling():
            return F.silu(x, inplace=True)
        return x.copy_(ops.silu(x))


class GELU(nn.GELU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules]
            return F.gelu(x, approximate=self.approximate)
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu(x, self.approximate) if x.dtype in _KERNEL_DTYPES else _torch_forward(self, x)


# Calls of Linear with at most this many rows of input (x.numel() / in_features)
# run our linear kernel: decode's batch x new tokens. More rows are a GEMM,
# torch's (oneDNN / its BLAS) is the faster one there.
LINEAR_MAX_ROWS = 16
# ... except for a 16-bit dtype whose GEMMs torch runs natively (the CPU has
# the instructions: half_gemm_in_fp32 is False). Measured on a Xeon with
# AVX512-BF16 and AMX, [4096, 4096] bf16 weight, one thread, our time over
# oneDNN's: 1 row 0.62x, 4 rows 0.86x, 5 rows 1.6x, 8 rows 2.3x, 16 rows 4.1x
# (our kernel widens each weight element once per group of four rows).
LINEAR_MAX_ROWS_NATIVE_HALF = 4
_LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state  # torch.jit.trace under way: not None
_is_grad_enabled = torch.is_grad_enabled
_is_autocast_enabled = torch.is_autocast_enabled
_fwad = torch.autograd.forward_ad  # ._current_level: the dual level, -1 outside one
_functorch_stack = torch._C._functorch.peek_interpreter_stack
_cpu_threads = _to._C.cpu_num_threads
_cpu_isa = _to._C.cpu_active_isa


def fp32_kn_ours() -> bool:
    """Whether a few-row fp32 product with a [K, N] weight runs our kernel:
    on two or more threads of the AVX2 kernels only (see linear_rows)."""
    return _cpu_threads() >= 2 and _cpu_isa() == "avx2"


def linear_max_rows(dtype: torch.dtype) -> int:
    """The most rows of input a Linear call may have to run our kernel
    (LINEAR_MAX_ROWS, or LINEAR_MAX_ROWS_NATIVE_HALF for a 16-bit dtype
    torch multiplies natively on this CPU: half_gemm_in_fp32's policy)."""
    if dtype in _HALF and not half_gemm_in_fp32(dtype):
        return LINEAR_MAX_ROWS_NATIVE_HALF
    return LINEAR_MAX_ROWS


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                weight_layout: str = "nk") -> Optional[torch.Tensor]:
    """x @ weight.T + bias (weight [N, K]; weight_layout "kn": x @ weight +
    bias, weight [K, N]) on tensor_ops' linear kernel when the call is a
    few-row product it is made for: plain CPU tensors of one float dtype, at
    most linear_max_rows(dtype) rows, nothing to differentiate, no autocast, not
    traced, a backend with the kernel; None otherwise (run torch's).
    torch's CPU F.linear reads a [N, K] weight for one row at a fraction of
    the bandwidth its GEMMs reach (~15 GB/s fp32, ~5-10 GB/s bf16 here)."""
    if _is_compiling() or _tracing_state():
        return None  # traced (torch.compile, torch.jit.trace): torch's op, which the tracer knows
    k = weight.shape[0 if weight_layout == "kn" else -1]
    if (type(x) is not torch.Tensor or not x.is_cpu or x.dtype not in _LINEAR_DTYPES or weight.dtype != x.dtype
            or not weight.is_cpu or k == 0 or x.numel() > linear_max_rows(x.dtype) * k
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_cpu))):
        return None
    if _is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    if _is_autocast_enabled("cpu"):
        return None  # F.linear casts under autocast; we would not
    if _fwad._current_level >= 0:
        return None  # tangents (Note [forward-mode AD]): F.linear carries them
    if weight_layout == "kn" and x.dtype == torch.float32 and not fp32_kn_ours():
        # Measured (one row, GPT-2's [768, 3072] / [3072, 768] / [768, 2304]):
        # on one thread torch's addmm takes 0.65-0.92x our kernel's time for
        # an fp32 [K, N] weight; on two, our AVX2 kernel is 1.27-1.44x faster
        # (AMD EPYC), and in bf16 8-21x (bench/RESULTS.md, "Our linear kernel
        # in decode"). On an AVX-512 Xeon, two threads, torch's (MKL) addmm
        # took 0.55-0.85x our kernel's time ([512, 2048] and [2048, 512]):
        # fp32 [K, N] stays on torch's there too.
        return None
    try:
        # The op itself, not the routing wrapper (~0.9 us more per call): the checks above are what it routes on.
        return _ops.linear(x, weight, bias) if weight_layout == "nk" else _ops.linear(x, weight, bias, weight_layout="kn")
    except UnsupportedError:
        return None  # the active backend has no linear kernel (the XLA shim selected: torch's GEMM)
    except RuntimeError:
        if torch._C._functorch.peek_interpreter_stack() is None:
            raise
        return None  # torch.func's wrapped tensors (Note [torch.func] in functional.py): torch's F.linear


# Note [half GEMMs in fp32]
# torch's CPU GEMM runs bfloat16 / float16 natively fast only where the CPU
# has the instructions for it (AVX512-BF16 or AMX for bf16; AMX-FP16 for
# fp16). Elsewhere (this AVX2 machine, any CPU before Cooper Lake) it takes a
# slow path: [1024, 512] @ [512, 1536] bf16 143 ms at 2 threads against 22 ms
# for the same product widened to fp32 (conversion included), forward +
# backward 2.7 s against 68 ms (bench/RESULTS.md, "Half-precision GEMMs").
# There the prepared Linear / Conv1D / Linear + activation compute their
# GEMMs on fp32 copies of the operands and round the result to the storage
# dtype once: fp32 accumulation, as torch's own half GEMMs accumulate, so
# the results agree to the storage precision (summation order aside).
# TENSOR_OPS_HALF_GEMM=native keeps torch's half GEMMs; =fp32 widens on any CPU.
_HALF = (torch.bfloat16, torch.float16)
_HALF_POLICY: dict = {}
_WIDEN_CHUNK_BYTES = 16 << 20  # fp32 weight copies above this are made a slice of output columns at a time


def half_gemm_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the prepared modules widen this dtype's CPU GEMMs to fp32
    (Note [half GEMMs in fp32]): decided once per dtype from the CPU's
    instructions as torch reports them, or TENSOR_OPS_HALF_GEMM."""
    r = _HALF_POLICY.get(dtype)
    if r is None:
        mode = os.environ.get("TENSOR_OPS_HALF_GEMM", "auto").strip().lower()
        if mode not in ("auto", "fp32", "native"):
            raise ValueError(f"TENSOR_OPS_HALF_GEMM must be auto, fp32 or native, got {mode!r}")
        if dtype not in _HALF or mode == "native":
            r = False
        elif mode == "fp32":
            r = True
        else:
            cpu = torch.cpu
            probes = (("_is_avx512_bf16_supported", "_is_amx_tile_supported") if dtype == torch.bfloat16
                      else ("_is_amx_fp16_supported",))
            r = not any(getattr(cpu, name, lambda: False)() for name in probes)
        _HALF_POLICY[dtype] = r
    return r


def widens(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a GEMM of these tensors (None skipped: an absent bias) takes
    the fp32 route (Note [half GEMMs in fp32]): all of the first one's half
    dtype, all on the CPU, and the policy widens that dtype."""
    dt = tensors[0].dtype
    return (dt in _HALF and all(t is None or (t.dtype == dt and t.is_cpu) for t in tensors)
            and half_gemm_in_fp32(dt))


def _widened_gemm(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kn: bool,
                  dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x2 [M, K] @ weight.T (weight [N, K]; kn: @ weight, weight [K, N]) +
    bias, in fp32, rounded once to dtype (or out's): [M, N], into out when
    given. A large weight (or with out, a quarter of out's columns) is
    widened a slice of output columns at a time: no fp32 copy of the whole
    weight, nor of the whole product when there is an out."""
    x32 = x2.float()
    n = weight.shape[1 if kn else 0]
    k = x2.shape[1]
    step = max(1, _WIDEN_CHUNK_BYTES // (4 * max(k, 1)))
    if out is not None:  # fp32 products of at most a quarter of out's columns: half of out's bytes when it is 16-bit
        step = min(step, max(1, -(-n // 4)))
    if n <= step:
        w32 = weight.float()
        w32 = w32 if kn else w32.t()
        y = torch.addmm(bias.float(), x32, w32) if bias is not None else x32.mm(w32)
        return y.to(dtype) if out is None else out.copy_(y)
    y = x2.new_empty((x2.shape[0], n), dtype=dtype) if out is None else out
    for c in range(0, n, step):
        e = min(n, c + step)
        w32 = (weight[:, c:e] if kn else weight[c:e].t()).float()
        part = torch.addmm(bias[c:e].float(), x32, w32) if bias is not None else x32.mm(w32)
        y[:, c:e].copy_(part)
    return y


def half_mm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b (2-D; into out when given), in fp32 and rounded once to the
    output's dtype where this CPU's half GEMM is slow (Note [half GEMMs in
    fp32]; a large b, or with out a quarter of the inner dim, is widened a
    slice at a time and summed in fp32: no fp32 copy of a whole operand);
    torch's mm otherwise."""
    if not widens(a, b):
        return a.mm(b) if out is None else torch.mm(a, b, out=out)
    k = b.shape[0]
    step = max(1, _WIDEN_CHUNK_BYTES // (4 * max(b.shape[1], 1)))
    if out is not None:  # fp32 copies of at most a quarter of a's columns: half of a's bytes
        step = min(step, max(1, -(-k // 4)))
    if k <= step:
        y = a.float().mm(b.float())
    else:
        y = a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.float32)
        for c in range(0, k, step):
            y.addmm_(a[:, c:c + step].float(), b[c:c + step].float())
    if out is None:
        return y.to(a.dtype)
    return out.copy_(y)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] (reshape(-1, 0) is ambiguous for an empty last dim)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class _WidenedLinear(torch.autograd.Function):
    """x @ weight.T + bias (kn: x @ weight + bias) through _widened_gemm,
    with a backward of fp32 GEMMs too; saves the half tensors, not fp32 copies."""

    @staticmethod
    def forward(ctx, x, weight, bias, kn):
        ctx.save_for_backward(x, weight)
        ctx.kn, ctx.has_bias = kn, bias is not None
        y = _widened_gemm(_rows(x), weight, bias, kn, x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        g = _rows(dy).float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w32 = weight.float()
            dx = (g.mm(w32.t()) if ctx.kn else g.mm(w32)).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            x32 = _rows(x).float()
            dw = (x32.t().mm(g) if ctx.kn else g.t().mm(x32)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0).to(dy.dtype)
        return dx, dw, db, None


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   weight_layout: str = "nk") -> Optional[torch.Tensor]:
    """x @ weight.T + bias (weight_layout "kn": x @ weight + bias) with its
    GEMMs in fp32 (Note [half GEMMs in fp32]) when that is the faster way on
    this CPU: bfloat16 / float16 CPU tensors, one dtype, no autocast; None
    otherwise (run torch's). Differentiable."""
    if not widens(x, weight, bias) or _is_autocast_enabled("cpu") or x.dim() == 0:
        return None
    if not _is_compiling() and (_fwad._current_level >= 0 or _functorch_stack() is not None):
        return None  # tangents, torch.func (Note [forward-mode AD]): _WidenedLinear has neither rule; torch's F.linear
    dt = x.dtype
    kn = weight_layout == "kn"
    if _is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _WidenedLinear.apply(x, weight, bias, kn)
    y = _widened_gemm(_rows(x), weight, bias, kn, dt)
    return y.view(*x.shape[:-1], y.shape[-1])


class Linear(nn.Linear):
    """torch.nn.Linear whose few-row calls (decode: at most linear_max_rows
    rows, no gradient; linear_rows) run tensor_ops' linear kernel, and whose
    bfloat16 / float16 GEMMs run in fp32 where torch's half GEMM is slow
    (Note [half GEMMs in fp32]); every other call torch's F.linear. The same
    parameters and state_dict; prepare_model swaps nn.Linear for it (a class
    swap, on the CPU backend)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules]
            return F.linear(x, self.weight, self.bias)
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_rows(x, self.weight, self.bias)
        if y is None:
            y = widened_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y


_CONV1D: Optional[type] = None


def conv1d_class() -> type:
    """tensor_ops.torch.Conv1D: a subclass of transformers' Conv1D (GPT-2's
    c_attn, c_proj, c_fc: weight [in, out], x @ weight + bias) whose few-row
    calls (decode: at most linear_max_rows rows, no gradient; linear_rows)
    run tensor_ops' linear kernel on the weight as stored (weight_layout
    "kn"), every other call Conv1D's own forward. The same parameters and
    state_dict; prepare_model swaps Conv1D for it (a class swap, on the CPU
    backend). Made on first use: transformers stays optional."""
    global _CONV1D
    if _CONV1D is None:
        try:
            from transformers.pytorch_utils import Conv1D as HFConv1D
        except ImportError as e:
            raise ImportError(f"tensor_ops.torch.Conv1D subclasses transformers' Conv1D: pip install transformers "
                              f"({e})") from e

        class Conv1D(HFConv1D):
            __doc__ = conv1d_class.__doc__

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if torch.jit.is_scripting():  # Note [scripted modules]: Conv1D's own
                    out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
                    return out.view(x.size()[:-1] + (self.nf,))
                return self._kernel_forward(x)

            @torch.jit.unused
            def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
                if x.dtype is torch.float32 and (_is_compiling() or not fp32_kn_ours()):
                    return super().forward(x)  # neither our kernel nor the fp32 route applies: no checks
                y = linear_rows(x, self.weight, self.bias, "kn")
                if y is None:
                    y = widened_linear(x, self.weight, self.bias, "kn")
                return super().forward(x) if y is None else y

        Conv1D.__module__, Conv1D.__qualname__ = __name__, "Conv1D"  # pickles as tensor_ops.torch.modules.Conv1D
        _CONV1D = Conv1D
    return _CONV1D


def __getattr__(name: str):
    if name == "Conv1D":  # made on first use (transformers imported then)
        return conv1d_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _glu_activation(name: str) -> str:
    if name not in ("silu", "gelu", "gelu_tanh"):
        raise ValueError(f"activation must be 'silu', 'gelu' or 'gelu_tanh', got {name!r}")
    return name


class SwiGLU(nn.Module):
    """The gated MLP of Llama / Mistral / Qwen (HF LlamaMLP's parameter names):
    down_proj(act(gate_proj(x)) * up_proj(x)) with act(gate) * up fused into
    one kernel. activation "silu" (SwiGLU) or "gelu" / "gelu_tanh" (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu",
                 device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = _glu_activation(activation)
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)

    @classmethod
    def from_linears(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                     activation: str = "silu") -> "SwiGLU":
        """A SwiGLU holding these Linear modules themselves (no copy: an
        optimizer built on the old parameters keeps working)."""
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.hidden_size, mlp.intermediate_size = gate_proj.in_features, gate_proj.out_features
        mlp.activation = _glu_activation(activation)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate_proj, up_proj, down_proj
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # Note [scripted modules]
            gate = self.gate_proj(x)
            act = F.silu(gate) if self.activation == "silu" else F.gelu(
                gate, approximate="tanh" if self.activation == "gelu_tanh" else "none")
            return self.down_proj(act * self.up_proj(x))
        return self._kernel_forward(x)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype not in _KERNEL_DTYPES:  # a model cast to float64 after prepare_model: torch's arithmetic
            _log_torch_dtype(type(self), "F.silu / F.gelu", gate.dtype)
            act = F.silu(gate) if self.activation == "silu" else F.gelu(
                gate, approximate="tanh" if self.activation == "gelu_tanh" else "none")
            return self.down_proj(act * up)
        if self.activation == "silu":
            h = ops.swiglu(gate, up)
        else:
            h = ops.geglu(gate, up, "tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class Attention(nn.Module):
    """The attention core softmax(scale * q k^T) v on [batch, heads, seq,
    head_dim], grouped-query k/v allowed (kv heads divide q heads), without
    materialising the score matrix. causal is bottom-right aligned (query i
    sees keys j <= i + Lk - Lq), which is SDPA's is_causal when Lq == Lk."""

    def __init__(self, causal: bool = False, scale: Optional[float] = None):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ops.attention(q, k, v, self.causal, self.scale)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}"
