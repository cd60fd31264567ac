"""Masked and causal attention against torch's SDPA (issue 17, items 3 and 4):
fully masked rows (bool masks, finfo.min additive masks, HF left padding
with causal=True) forward and backward; is_causal with Lq != Lk top-left as
torch's, bottom-right through causal_alignment, on every backend; the
masked path's fp16 / bf16 error within torch's own."""
import math

import numpy as np
import pytest

import tensor_ops as to
from conftest import assert_close, torch
from test_ops_llm import grad_close, make, ref_attention

pytestmark = pytest.mark.skipif(torch is None, reason="compares with torch's scaled_dot_product_attention")

if torch is not None:
    import torch.nn.functional as F
    from tensor_ops.torch import FlashAttention, scaled_dot_product_attention as sdpa

def leaves(rng, shape_q, shape_kv):
    """float32 q, k, v that need gradients, seeded from rng."""
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    return [torch.randn(s, generator=gen).requires_grad_() for s in (shape_q, shape_kv, shape_kv)]


def run(fn, q, k, v, do, **kw):
    """fn's output and the gradients of sum(out * do), on fresh leaves."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    (out * do).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def check_like_torch(got, want, what, rtol=1e-5, atol=1e-5):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{what}: {name} has non-finite values"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {name}: {m}")


def padding_mask(B, Lq, Lk, kind, dtype):
    """Rows 1 and Lq - 1 of batch 0 see no key (but for kind "partial"); the
    rest see a random half or more."""
    keep = torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(3)) < 0.6
    keep[..., 0] = True
    if kind != "partial":
        keep[0, :, 1] = False
        keep[0, :, Lq - 1] = False
    if kind in ("bool", "partial"):
        return keep
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def explicit(q, k, v, attn_mask):
    """softmax(q k^T / sqrt(D) + mask) v by torch's softmax: its backward is
    the exact gradient of the forward."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + attn_mask
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("kind", ["bool", "finfo_min"])
def test_fully_masked_rows_match_sdpa(kind, rng):
    B, H, Lq, Lk, D = 2, 3, 6, 9, 16
    q, k, v = leaves(rng, (B, H, Lq, D), (B, H, Lk, D))
    mask = padding_mask(B, Lq, Lk, kind, torch.float32)
    # The loss reads every row but the fully masked ones (rows 1 and Lq - 1 of batch 0), as a training loss would.
    do = torch.randn(B, H, Lq, D)
    do[0, :, [1, Lq - 1]] = 0
    want = run(F.scaled_dot_product_attention, q, k, v, do, attn_mask=mask)
    got = run(sdpa, q, k, v, do, attn_mask=mask)
    check_like_torch(got, want, kind)
    if kind == "bool":  # SDPA's zero rows, and no gradient through them
        assert (got[0][0, :, 1] == 0).all()
        do = torch.randn(B, H, Lq, D)
        check_like_torch(run(sdpa, q, k, v, do, attn_mask=mask),
                         run(F.scaled_dot_product_attention, q, k, v, do, attn_mask=mask), "bool, every row")
        return
    # finfo.min is a finite score: the row averages v, as SDPA's.
    torch.testing.assert_close(got[0][0, :, 1], v.detach()[0].mean(-2), rtol=1e-5, atol=1e-6)
    # Read those rows too and the gradients are the exact ones of that forward.
    # (torch's differ there: its backward recomputes p = exp(s - lse) with lse =
    # finfo.min + log(Lk) rounded back to finfo.min, so p = 1, not 1 / Lk.)
    do = torch.randn(B, H, Lq, D)
    ref = run(explicit, q.double(), k.double(), v.double(), do.double(), attn_mask=mask.double())
    check_like_torch(run(sdpa, q, k, v, do, attn_mask=mask), [r.float() for r in ref], "finfo.min, every row")


def test_fully_masked_rows_with_dropout_keep_gradients_finite(rng):
    q, k, v = leaves(rng, (1, 2, 5, 8), (1, 2, 5, 8))
    mask = padding_mask(1, 5, 5, "bool", torch.float32)
    out = sdpa(q, k, v, attn_mask=mask, dropout_p=0.3)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (out.detach()[0, :, 1] == 0).all()


@pytest.mark.parametrize("kind", ["bool", "long"])
def test_flash_attention_left_padding_causal_matches_sdpa(kind):
    """A HF key-padding mask with left padding and causal=True: the padded
    query rows see no key; the loss skips them; gradients stay finite and
    equal to a torch SDPA model's."""
    torch.manual_seed(0)
    B, L, E, H = 3, 7, 32, 4
    model = FlashAttention(E, H, causal=True)
    x = torch.randn(B, L, E)
    pad = torch.ones(B, L, dtype=torch.long)
    pad[0, :3] = 0
    pad[1, :1] = 0
    mask = pad.bool() if kind == "bool" else pad  # HF's attention_mask: int64 0 / 1
    out = model(x, attention_mask=mask)
    loss = (out * pad[..., None]).pow(2).sum()
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(torch.isfinite(g).all() for g in got.values()), "NaN / inf gradients"

    model.zero_grad()
    heads = lambda t: t.view(B, L, H, E // H).transpose(1, 2)  # noqa: E731
    q, k, v = heads(model.q_proj(x)), heads(model.k_proj(x)), heads(model.v_proj(x))
    keep = pad.bool()[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    ref = model.out_proj(ref.transpose(1, 2).reshape(B, L, E))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (ref * pad[..., None]).pow(2).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def _err(got, ref):
    return (got.double() - ref).abs().max().item()


@pytest.mark.parametrize("kind", ["partial", "bool", "finfo_min"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_masked_half_precision_within_torch_error(dtype, kind, rng):
    """The masked path's error against float64, forward and backward, is
    within twice torch SDPA's own (unscaled half scores were 3-6x worse)."""
    dt = getattr(torch, dtype)
    B, H, Lq, Lk, D = 2, 4, 33, 47, 64
    q, k, v = (t.detach() * 2 for t in leaves(rng, (B, H, Lq, D), (B, H, Lk, D)))
    do = torch.randn(B, H, Lq, D)
    do[0, :, [1, Lq - 1]] = 0  # the fully masked rows: see test_fully_masked_rows_match_sdpa
    # The reference takes the very mask values the half-precision calls get
    # (float16's finfo.min -65504 still orders a fully masked row's keys).
    mask = padding_mask(B, Lq, Lk, kind, dt)
    ref = run(F.scaled_dot_product_attention, q.double(), k.double(), v.double(), do.double(),
              attn_mask=mask if mask.dtype == torch.bool else mask.double())
    args = (q.to(dt), k.to(dt), v.to(dt), do.to(dt))
    theirs = run(F.scaled_dot_product_attention, *args, attn_mask=mask)
    ours = run(sdpa, *args, attn_mask=mask)
    for name, o, t, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        assert torch.isfinite(o).all(), f"{name}: non-finite"
        e_ours, e_torch = _err(o, r), _err(t, r)
        assert e_ours <= 2 * e_torch + 1e-6, f"{name}: error {e_ours:.3g} vs torch's {e_torch:.3g}"


SHAPES = [(1, 2, 1, 3, 7, 8), (2, 2, 2, 7, 3, 16), (1, 4, 2, 5, 5, 8), (1, 1, 1, 9, 4, 4)]  # B, Hq, Hkv, Lq, Lk, D


@pytest.mark.parametrize("path", ["flash", "masked"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"Lq{s[3]}-Lk{s[4]}")
def test_is_causal_is_top_left_as_torch(shape, path, rng):
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = leaves(rng, (B, Hq, Lq, D), (B, Hkv, Lk, D))
    do = torch.randn(B, Hq, Lq, D)
    g = Hq // Hkv
    want = run(lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True), q, k, v, do)
    # The masked path: an all-True mask routes through the materialised scores.
    kw = {"attn_mask": torch.ones(Lq, Lk, dtype=torch.bool)} if path == "masked" else {}
    got = run(sdpa, q, k, v, do, is_causal=True, **kw)
    check_like_torch(got, want, f"{path} {shape}")


@pytest.mark.parametrize("path", ["flash", "masked"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"Lq{s[3]}-Lk{s[4]}")
def test_sdpa_bottom_right_option(shape, path, rng):
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = leaves(rng, (B, Hq, Lq, D), (B, Hkv, Lk, D))
    do = torch.randn(B, Hq, Lq, D)
    kw = {"attn_mask": torch.ones(Lq, Lk, dtype=torch.bool)} if path == "masked" else {}
    got = run(sdpa, q, k, v, do, is_causal=True, causal_alignment="bottom_right", **kw)

    def ref(q, k, v):
        s = q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no key: zeros
        return p @ v.repeat_interleave(Hq // Hkv, 1)

    want = run(ref, q.double(), k.double(), v.double(), do.double())
    check_like_torch(got, [w.float() for w in want], f"{path} {shape}")


def test_causal_alignment_is_checked():
    x = torch.ones(1, 1, 2, 4)
    with pytest.raises(ValueError, match="causal_alignment"):
        sdpa(x, x, x, is_causal=True, causal_alignment="left")
    with pytest.raises(ValueError, match="causal_alignment"):
        to.attention(x.numpy(), x.numpy(), x.numpy(), True, causal_alignment="top")


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("dims", [(2, 5), (7, 3), (4, 4), (1, 6), (6, 1)], ids=lambda d: f"Lq{d[0]}-Lk{d[1]}")
def test_attention_alignment_on_every_backend(dims, alignment, target, rng):
    """tensor_ops.attention and its backward with either alignment, on every
    target (CPU ISAs, OpenCL, the XLA shim): top-left as torch's SDPA,
    bottom-right against float64; rows that see no key are 0 with zero
    gradients."""
    target.require("attention", "attention_backward")
    Lq, Lk = dims
    B, Hq, Hkv, D = 2, 4, 2, 8
    q, k, v = make(rng, (B, Hq, Lq, D), "float32"), make(rng, (B, Hkv, Lk, D), "float32"), \
        make(rng, (B, Hkv, Lk, D), "float32")
    do = make(rng, (B, Hq, Lq, D), "float32")
    out, lse = to.attention(q, k, v, True, return_lse=True, causal_alignment=alignment)
    dq, dk, dv = to.attention_backward(do, q, k, v, out, lse, True, causal_alignment=alignment)
    tq, tk, tv = (torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    g = Hq // Hkv
    if alignment == "top_left":
        ref = F.scaled_dot_product_attention(tq, tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1),
                                             is_causal=True)
    else:
        s = tq @ tk.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq), float("-inf"))
        ref = torch.softmax(s, -1).nan_to_num(0.0) @ tv.repeat_interleave(g, 1)
    ref.backward(torch.tensor(np.asarray(do), dtype=torch.float64))
    assert_close(np.asarray(out), ref.detach().numpy(), "float32", f"out {alignment}")
    for name, got, t in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tv)):
        assert np.isfinite(np.asarray(got)).all(), name
        grad_close(np.asarray(got), t.grad, "float32", name)
    visible = np.arange(Lq) + (0 if alignment == "top_left" else Lk - Lq) >= 0
    assert (np.asarray(lse)[..., ~visible] == -np.inf).all() and (np.asarray(out)[..., ~visible, :] == 0).all()


@pytest.mark.parametrize("dims", [(2, 5), (7, 3)], ids=lambda d: f"Lq{d[0]}-Lk{d[1]}")
def test_softmax_causal_top_left_on_every_backend(dims, target, rng):
    target.require("softmax")
    Lq, Lk = dims
    x = make(rng, (3, Lq, Lk), "float32")
    got = to.softmax(x, causal=True, causal_alignment="top_left", scale=0.5)
    keep = np.tril(np.ones((Lq, Lk), bool))
    e = np.where(keep, np.exp(0.5 * x.astype(np.float64) - 0.5 * x.max()), 0.0)
    assert_close(np.asarray(got), e / e.sum(-1, keepdims=True), "float32", "softmax top-left")


@pytest.mark.parametrize("lq", [7, 6])
@pytest.mark.parametrize("mask_dims", [0, 2, 3])
def test_three_dim_inputs_as_sdpa(lq, mask_dims, rng):
    """[batch, seq, head_dim] q / k / v, as torch's SDPA takes them (one
    head): the unmasked call refused them, the masked one read seq as heads
    ("kv heads (7) must divide q heads (6)" for Lq != Lk)."""
    q, k, v = leaves(rng, (5, lq, 16), (5, 7, 16))
    mask = None if not mask_dims else torch.rand((5, lq, 7)[3 - mask_dims:], generator=torch.Generator().manual_seed(1)) > 0.3
    if mask is not None:
        mask[..., 0] = True
    do = torch.randn(5, lq, 16)
    want = run(F.scaled_dot_product_attention, q, k, v, do, attn_mask=mask)
    got = run(sdpa, q, k, v, do, attn_mask=mask)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert_close(g.detach().numpy(), w.detach().numpy(), "float32", "3-d sdpa")
    with pytest.raises(ValueError, match=r"got shapes \(2, 3, 4, 5, 6\)"):
        sdpa(torch.randn(2, 3, 4, 5, 6), k, v)


def test_sdpa_drop_in_takes_enable_gqa():
    """tt.scaled_dot_product_attention takes SDPA's enable_gqa= (code written
    for F.scaled_dot_product_attention passes it with grouped-query heads; it
    raised TypeError)."""
    import torch.nn.functional as F

    import tensor_ops.torch as tt

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(tt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), want,
                               rtol=1e-5, atol=1e-6)
