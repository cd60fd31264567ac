"""The op set as functions on torch tensors, differentiable and traceable by
torch.compile: the custom ops themselves, plus attention and cross_entropy
with the Python-level options of tensor_ops' own functions."""
from __future__ import annotations

from typing import Optional

import torch

from . import custom_ops
from .custom_ops import (  # noqa: F401  (re-exported as they are)
    add_rms_norm, attention_backward, cross_entropy_with_grad, geglu, geglu_backward, gelu, gelu_backward,
    layer_norm, layer_norm_backward, log_softmax, log_softmax_backward, rms_norm, rms_norm_backward, rope,
    rope_backward, silu, silu_backward, softmax, softmax_backward, swiglu, swiglu_backward,
)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: Optional[float] = None, *, return_lse: bool = False):
    """softmax(scale * q k^T) v on [batch, heads, seq, head_dim] (grouped-query
    k/v allowed); with return_lse also the float32 log-sum-exp [batch, heads,
    seq]."""
    out, lse = custom_ops.attention(q, k, v, causal, scale)
    return (out, lse) if return_lse else out


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """The float32 cross-entropy of logits [N, C] against class indices [N].
    When logits need a gradient, the forward pass also writes it (the fused
    kernel) and the backward only scales it."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return custom_ops.cross_entropy_with_grad(logits, target, ignore_index, reduction)[0]
    return custom_ops.cross_entropy(logits, target, ignore_index, reduction)
