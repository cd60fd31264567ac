"""One Llama-style block run with tensor_ops ops (matmuls in torch) against
the same block written with torch ops."""
import math

import numpy as np
import pytest

import tensor_ops as to
from conftest import torch

pytestmark = pytest.mark.skipif(torch is None, reason="torch not installed")


def rope_ref(x, cos, sin):  # NeoX layout, x [B, S, H, D]
    half = cos.shape[-1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def block(x, p, ops):
    B, S, E = x.shape
    H, Hkv, D = p["H"], p["Hkv"], E // p["H"]
    if ops == "torch":
        F = torch.nn.functional
        h = F.rms_norm(x, (E,), p["ln1"], 1e-6)
    else:
        h = to.rms_norm(x, p["ln1"], 1e-6)
    q = (h @ p["wq"]).view(B, S, H, D)
    k = (h @ p["wk"]).view(B, S, Hkv, D)
    v = (h @ p["wv"]).view(B, S, Hkv, D)
    cos, sin = p["cos"][:S], p["sin"][:S]
    if ops == "torch":
        q, k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
        g = H // Hkv
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1),
            is_causal=True)
        attn = a.transpose(1, 2).reshape(B, S, E) @ p["wo"]
        resid = x + attn
        h2 = torch.nn.functional.rms_norm(resid, (E,), p["ln2"], 1e-6)
        mlp = (torch.nn.functional.silu(h2 @ p["wg"]) * (h2 @ p["wu"])) @ p["wd"]
    else:
        q, k = to.rope(q, p["cos"], p["sin"]), to.rope(k, p["cos"], p["sin"])
        a = to.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        attn = a.transpose(1, 2).reshape(B, S, E) @ p["wo"]
        h2, resid = to.add_rms_norm(attn, x, p["ln2"], 1e-6)
        mlp = to.swiglu(h2 @ p["wg"], h2 @ p["wu"]) @ p["wd"]
    return resid + mlp


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_block_matches_torch(dtype):
    torch.manual_seed(0)
    B, S, E, H, Hkv, FF = 2, 12, 64, 4, 2, 160
    D = E // H
    dt = getattr(torch, dtype)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(64, dtype=torch.float64)[:, None] * inv[None, :]
    p = {"H": H, "Hkv": Hkv, "cos": ang.cos().to(dt), "sin": ang.sin().to(dt)}
    for name, shape in [("ln1", (E,)), ("ln2", (E,)), ("wq", (E, E)), ("wk", (E, Hkv * D)), ("wv", (E, Hkv * D)),
                        ("wo", (E, E)), ("wg", (E, FF)), ("wu", (E, FF)), ("wd", (FF, E))]:
        scale = 1.0 if name.startswith("ln") else 1 / math.sqrt(shape[0])
        p[name] = (torch.randn(shape) * scale + (1.0 if name.startswith("ln") else 0.0)).to(dt)
    x = torch.randn(B, S, E).to(dt)
    ours = block(x, p, "tensor_ops")
    ref = block(x, p, "torch")
    assert isinstance(ours, torch.Tensor) and ours.dtype == dt
    err = (ours.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
    assert err < (1e-5 if dtype == "float32" else 3e-2), err
