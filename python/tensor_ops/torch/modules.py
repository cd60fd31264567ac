"""Drop-in torch modules running on tensor_ops kernels. Each has the
parameters, names and constructor of the module it replaces, so it loads the
same state_dict (the norms and activations subclass torch's own modules and
override only forward)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import functional as ops


def _flat_last(x: torch.Tensor, normalized_shape) -> torch.Tensor:
    """x with its normalized trailing dims folded into one (our norms reduce
    over the last dim)."""
    if len(normalized_shape) == 1:
        return x
    return x.reshape(*x.shape[: x.dim() - len(normalized_shape)], math.prod(normalized_shape))


def _affine(param: Optional[torch.Tensor], x: torch.Tensor, n: int, fill: float) -> torch.Tensor:
    """The norm's weight or bias flattened and in x's dtype (a constant when
    the module has none)."""
    if param is None:
        return x.new_full((n,), fill)
    return param.reshape(n).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm on the fused tensor_ops kernel (fp32 accumulation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if w is not None and w.dtype == x.dtype and len(self.normalized_shape) == 1:
            return ops.rms_norm(x, w, eps)  # the common case: no reshape, no cast, no view
        n = math.prod(self.normalized_shape)
        y = ops.rms_norm(_flat_last(x, self.normalized_shape), _affine(w, x, n, 1.0), eps)
        return y.view(x.shape)


class LayerNorm(nn.LayerNorm):
    """torch.nn.LayerNorm on the fused tensor_ops kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (w is not None and w.dtype == x.dtype and (b is None or b.dtype == x.dtype)
                and len(self.normalized_shape) == 1):
            return ops.layer_norm(x, w, b, self.eps)  # the common case: no reshape, no cast, no view
        n = math.prod(self.normalized_shape)
        bias = None if self.bias is None else _affine(self.bias, x, n, 0.0)
        y = ops.layer_norm(_flat_last(x, self.normalized_shape), _affine(self.weight, x, n, 1.0), bias, self.eps)
        return y.view(x.shape)


class SiLU(nn.SiLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu(x)


class GELU(nn.GELU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu(x, self.approximate)


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
        gate, up = self.gate_proj(x), self.up_proj(x)
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
