"""The XLA shim's torch_xla path: the forward op set in plain torch ops, run
on the device the tensors are on (an XLA device when called from xla.py),
fp16/bf16 computed in fp32 and rounded once. Gradients come from torch
autograd through these ops.

UNVERIFIED ON AN XLA DEVICE: torch_xla's newest release (2.9) does not load
beside torch 2.13 on the project's machines. The code is device-agnostic
torch, and its math is tested on CPU tensors (tests/python/test_xla.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _acc(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _act(xf, act: str):
    if act == "silu":
        return F.silu(xf)
    return F.gelu(xf, approximate="none" if act == "gelu" else "tanh")


def _rms(xf, wf, eps: float):
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * wf


def rms_norm(x, weight, eps: float, offset: float = -0.0):
    return _rms(_acc(x), _acc(weight) + offset, float(eps)).to(x.dtype)


def silu(x):
    return F.silu(_acc(x)).to(x.dtype)


def gelu(x, approximate: str):
    return F.gelu(_acc(x), approximate=approximate).to(x.dtype)


def glu(gate, up, act: str):
    return (_act(_acc(gate), act) * _acc(up)).to(gate.dtype)


def layer_norm(x, weight, bias, eps: float):
    b = None if bias is None else _acc(bias)
    return F.layer_norm(_acc(x), (x.shape[-1],), _acc(weight), b, float(eps)).to(x.dtype)


def add_rms_norm(x, residual, weight, eps: float):
    s = (_acc(x) + _acc(residual)).to(x.dtype)  # normalise the residual as stored
    return rms_norm(s, weight, eps), s


def _causal_keep(rows: int, cols: int, device, mode: int = 1):
    # Query i sees keys j <= i + (cols - rows) (mode 1, bottom-right aligned) or j <= i (2, top-left).
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril(0 if mode == 2 else cols - rows)


def softmax(x, dim: int, scale: float, causal: int, log: bool):
    v = _acc(x) * float(scale)
    keep = _causal_keep(x.shape[-2], x.shape[-1], x.device, causal) if causal else None
    if keep is not None:
        v = v.masked_fill(~keep, float("-inf"))
    # A fully masked row gives NaN in torch; the native ops give 0 (log: -inf).
    out = torch.log_softmax(v, dim) if log else torch.softmax(v, dim)
    if keep is not None:
        out = out.masked_fill(~keep, float("-inf") if log else 0.0)
    return out.to(x.dtype)


def rope(x, cos, sin, positions, interleaved: bool, inverse: bool):
    B, S, _, D = x.shape
    pos = torch.arange(S, device=x.device)[None, :] if positions is None else positions.long()
    if pos.dim() == 1:
        pos = pos[None, :]
    # Tables take x's dtype first, as the native op layer does.
    c = _acc(cos.to(x.dtype))[pos][:, :, None, :]
    s = _acc(sin.to(x.dtype))[pos][:, :, None, :]
    if inverse:
        s = -s
    half = c.shape[-1]
    xf = _acc(x)
    rest = xf[..., 2 * half:]
    if interleaved:
        a, b = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
        rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = xf[..., :half], xf[..., half:2 * half]
        rot = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([rot, rest], dim=-1).to(x.dtype)


def attention(q, k, v, causal: int, scale):
    """causal: 0 none, 1 bottom-right, 2 top-left."""
    # (out, float32 lse); grouped-query by repeating k/v over q heads.
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    g = q.shape[1] // k.shape[1]
    kf, vf = _acc(k).repeat_interleave(g, 1), _acc(v).repeat_interleave(g, 1)
    s = _acc(q) @ kf.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~_causal_keep(q.shape[2], k.shape[2], q.device, causal), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1))  # fully masked rows: 0, not NaN
    return (p @ vf).to(q.dtype), lse.float()


def cross_entropy(logits, target, ignore_index: int, reduction: str, label_smoothing=0.0, z_loss=0.0, softcap=0.0):
    z = _acc(logits)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    target = target.long()
    if not z_loss:
        return F.cross_entropy(z, target, ignore_index=int(ignore_index), reduction=reduction,
                               label_smoothing=label_smoothing).float()
    valid = target != int(ignore_index)
    rows = F.cross_entropy(z, target, ignore_index=int(ignore_index), reduction="none", label_smoothing=label_smoothing)
    rows = rows + z_loss * torch.logsumexp(z, -1) ** 2 * valid
    if reduction == "none":
        return rows.float()
    total = rows.sum()
    return (total if reduction == "sum" else total / valid.sum()).float()
