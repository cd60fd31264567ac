"""FlashAttention (the seed's FlashAttention3 module name) and
scaled_dot_product_attention on our attention kernels, masks honoured.

Two paths. No mask and no dropout: our flash attention op (online softmax,
the score matrix never materialised, causal bottom-right aligned). A mask
(bool, True = attend, as in torch's SDPA; or additive floats) or dropout in
training: scores = scale * q k^T by torch's matmul, plus the mask, then our
softmax op (causal applied by the same kernel), dropout, then @ v by torch's
matmul: the score matrix is materialised, [batch, heads, Lq, Lk]. Both paths
are differentiable (our backward kernels + torch's matmul backward)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as ops


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def scaled_dot_product_attention(q, k, v, attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, *,
                                 training: bool = True) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention's contract on
    [batch, heads, seq, head_dim] (kv heads may divide q heads): attn_mask
    bool (True attends) or additive, broadcastable to [batch, heads, Lq, Lk];
    is_causal bottom-right aligned (SDPA's when Lq == Lk); dropout_p applied
    when `training`. A row that attends to nothing gives zeros, as SDPA's
    (its gradient is not defined)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    dropout = dropout_p if training else 0.0
    if attn_mask is None and dropout == 0.0:
        return ops.attention(q, k, v, is_causal, scale)
    s = (1.0 / math.sqrt(q.shape[-1])) if scale is None else float(scale)
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        if hq % hkv:
            raise ValueError(f"kv heads ({hkv}) must divide q heads ({hq})")
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.matmul(q, k.transpose(-1, -2))
    if attn_mask is not None:
        scores = scores + _additive(attn_mask, scores.dtype) * (1.0 / s)  # our softmax multiplies all by s
    probs = ops.softmax(scores, -1, s, is_causal)
    if attn_mask is not None:  # a row with every key masked is NaN here; SDPA gives zeros
        probs = probs.nan_to_num_(0.0) if not probs.requires_grad else probs.nan_to_num(0.0)
    if dropout:
        probs = F.dropout(probs, dropout, True)
    return torch.matmul(probs, v)


class FlashAttention(nn.Module):
    """Multi-head self- (or cross-) attention: q/k/v projections, our
    attention, an output projection. forward(x, attention_mask=None,
    key_value=None) with x [batch, seq, embed_dim]. attention_mask: [batch,
    Lk] (a key-padding mask, HF style: 1 / True = attend), or bool / additive
    broadcastable to [batch, heads, Lq, Lk]. dropout on the attention
    probabilities in training mode only; causal bottom-right aligned."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, causal: bool = False,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.causal = float(dropout), bool(causal)
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value: Optional[torch.Tensor] = None) -> torch.Tensor:
        kv = x if key_value is None else key_value
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(kv)), self._heads(self.v_proj(kv))
        mask = attention_mask
        if mask is not None and mask.dim() == 2:  # [batch, Lk] key padding
            if mask.shape != (x.shape[0], kv.shape[1]):
                raise ValueError(f"a 2-d attention_mask is [batch, key_len] = {(x.shape[0], kv.shape[1])}, "
                                 f"got {tuple(mask.shape)}")
            mask = mask[:, None, None, :]
            if mask.dtype != torch.bool and not mask.is_floating_point():
                mask = mask != 0
        out = scaled_dot_product_attention(q, k, v, mask, self.dropout, self.causal, training=self.training)
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim))

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, causal={self.causal}"


FlashAttention3 = FlashAttention
