"""FlashAttention (the seed's FlashAttention3 module name) and
scaled_dot_product_attention on our attention kernels, masks honoured.

Two paths. No mask and no dropout: our flash attention op (online softmax,
the score matrix never materialised). A mask (bool, True = attend, as in
torch's SDPA; or additive floats) or dropout in training: scores = scale *
q k^T by torch's matmul in float32 (fp16 / bf16 inputs too: unscaled half
scores lose digits), plus the mask and the causal mask, then our softmax op,
dropout, then @ v by torch's matmul: the score matrix is materialised,
[batch, heads, Lq, Lk]. Both paths are differentiable (our backward kernels +
torch's matmul backward).

Note [fully masked rows]: as torch's SDPA (2.13, every backend on CPU), a
query row whose every score is -inf (bool masks, the causal mask) gives a
zero output and zero gradients, never NaN; an additive mask of finfo.min is
a finite score, so such a row averages v as in SDPA (float32 scores: for a
float16 mask, -65504 + scores still orders the keys, as SDPA's)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as ops
from .modules import _KERNEL_DTYPES
from ..ops import causal_mode


def _keep_or_additive(mask: torch.Tensor) -> torch.Tensor:
    """A floating key-padding mask as an additive one: HF's keep mask as
    floats (0s and 1s with at least one 1: 0 -> -inf) or, for any other
    values (0 / -inf, 0 / -1e9), the mask as it is. Decided in tensor ops,
    no Python branch on the data: a bool() of it broke torch.compile's
    fullgraph and cost a sync per call."""
    ones = mask == 1
    keep = ((mask == 0) | ones).all() & ones.any()
    return torch.where(keep, torch.zeros_like(mask).masked_fill(~ones, float("-inf")), mask)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def scaled_dot_product_attention(q, k, v, attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
                                 training: bool = True, causal_alignment: str = "top_left") -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention's contract on
    [batch, heads, seq, head_dim] (kv heads may divide q heads): attn_mask
    bool (True attends) or additive, broadcastable to [batch, heads, Lq, Lk];
    is_causal top-left aligned as SDPA's (query i sees keys j <= i);
    causal_alignment="bottom_right" aligns it to the last key instead (j <= i
    + Lk - Lq: a query with no key gives zeros). is_causal may be combined
    with attn_mask (both apply). dropout_p applied when `training`. A row
    that attends to nothing gives zeros and zero gradients (see Note [fully
    masked rows]). enable_gqa is accepted as SDPA's (grouped-query k / v are
    taken whatever its value). An integer attn_mask is refused, as torch
    refuses it."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if q.dim() == k.dim() == v.dim() == 3:  # [batch, seq, head_dim], as SDPA takes it: one head
        mask = attn_mask[:, None] if attn_mask is not None and attn_mask.dim() == 3 else attn_mask
        return scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], mask, dropout_p, is_causal, scale,
                                            training=training, causal_alignment=causal_alignment)[:, 0]
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(f"scaled_dot_product_attention takes q, k, v as [batch, heads, seq, head_dim] (or [batch, "
                         f"seq, head_dim]), got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    mode = causal_mode(is_causal, causal_alignment)
    dropout = dropout_p if training else 0.0
    if attn_mask is not None and attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        # torch refuses it too; added to the scores, 0 / 1 integers masked nothing
        raise TypeError(f"attn_mask must be bool (True attends) or floating (added to the scores), got "
                        f"{attn_mask.dtype} {list(attn_mask.shape)}")
    kernel = q.dtype in _KERNEL_DTYPES
    if attn_mask is None and dropout == 0.0 and kernel and v.shape[-1] == q.shape[-1]:
        return ops.attention(q, k, v, is_causal, scale, causal_alignment=causal_alignment)
    # The composite: a mask, dropout, v's head dim other than q's (the kernel takes one; torch takes
    # both), float64 (torch's softmax: our kernels take 32 / 16-bit floats)
    s = (1.0 / math.sqrt(q.shape[-1])) if scale is None else float(scale)
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        if hq % hkv:
            raise ValueError(f"kv heads ({hkv}) must divide q heads ({hq})")
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * s
    if attn_mask is not None:
        scores = scores + _additive(attn_mask, acc)
    if mode:
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(0 if mode == 2 else lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    scores = scores.masked_fill(empty, 0.0)  # finite rows: a finite softmax and backward; zeroed below
    probs = (ops.softmax(scores, -1) if kernel else torch.softmax(scores, -1)).masked_fill(empty, 0.0)
    if dropout:
        probs = F.dropout(probs, dropout, True)
    return torch.matmul(probs, v.to(acc)).to(q.dtype)


class FlashAttention(nn.Module):
    """Multi-head self- (or cross-) attention: q/k/v projections, our
    attention, an output projection. forward(x, attention_mask=None,
    key_value=None) with x [batch, seq, embed_dim]. attention_mask: [batch,
    Lk] (a key-padding mask, HF style: 1 / True = attend, also as 0. / 1.
    floats; a floating one with other values is additive), or bool / additive
    broadcastable to [batch, heads, Lq, Lk]. dropout on the attention
    probabilities in training mode only; causal_alignment "bottom_right"
    (the default: query i sees keys j <= i + Lk - Lq) or "top_left"
    (SDPA's), the same when Lq == Lk (self-attention). Padding rows that
    attend to nothing give zeros and zero gradients."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, causal: bool = False,
                 bias: bool = True, device=None, dtype=None, causal_alignment: str = "bottom_right"):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        causal_mode(causal, causal_alignment)  # validates the alignment
        self.dropout, self.causal, self.causal_alignment = float(dropout), bool(causal), causal_alignment
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
            # HF's 1 / 0 keep mask, also as floats (0. / 1.: added to the scores, padded keys were
            # attended); a floating mask with other values (0 / -inf) is additive
            if mask.dtype != torch.bool:
                mask = _keep_or_additive(mask) if mask.is_floating_point() else mask != 0
        out = scaled_dot_product_attention(q, k, v, mask, self.dropout, self.causal, training=self.training,
                                           causal_alignment=self.causal_alignment)
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim))

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, causal={self.causal}"


FlashAttention3 = FlashAttention
