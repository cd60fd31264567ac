"""Checks that a module prepare_model replaces computes what our replacement
computes, before it is replaced (Note [checked swaps]).

Note [checked swaps]
Modules are recognised by their structure (children named gate_proj,
up_proj, down_proj, act_fn; a class named *RMSNorm with a weight), and
transformers has families whose modules have that structure and compute
something else: FalconH1MLP scales by multipliers, Gemma3nTextMLP sparsifies
its activations, DeepseekV4MLP clamps, Gemma4RMSNorm has no 1 + weight
offset where Gemma's has one. Swapped on structure alone they gave wrong
logits (up to 4.3 relative). So a swap is made only when
- the class's own forward reads no names but those of the plain form
  (`forward_names`: a clamp, a multiplier or a sparsity step adds names,
  and shows only on inputs large enough to reach it, which a random check
  input may not be), and
- on a random input the module's forward and ours agree (`same_output`:
  a role swap or an offset changes every output).
Otherwise the module stays as it is and result.warnings says why."""
from __future__ import annotations

import inspect
from typing import Callable, FrozenSet, Optional

import torch
from torch import nn


def forward_names(cls: type) -> Optional[FrozenSet[str]]:
    """The global and attribute names cls's forward (its own code, through
    decorators) reads, with those of functions nested in it; None when the
    forward is no plain Python function."""
    fn = getattr(cls, "forward", None)
    fn = inspect.unwrap(fn) if fn is not None else None
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if inspect.iscode(k))
    return frozenset(names)


def names_mismatch(m: nn.Module, allowed: FrozenSet[str]) -> Optional[str]:
    """None when type(m).forward reads only names in allowed, else why."""
    names = forward_names(type(m))
    if names is None:
        return f"{type(m).__name__}.forward is not Python code we can read"
    extra = sorted(names - allowed)
    if extra:
        return f"its forward also uses {', '.join(extra)} (not the plain form {', '.join(sorted(allowed))})"
    return None


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def same_output(m: nn.Module, ours: Callable[[torch.Tensor], torch.Tensor], width: int,
                reference: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Optional[str]:
    """None when ours(x) matches the module's own output (reference(x), by
    default type(m).forward(m, x)) on a random x [2, 3, width] in the
    dtype and on the device of m's first parameter, else why. Modules
    without data (the meta device) are not run: None."""
    p = next(m.parameters(), None)
    if p is None or p.device.type == "meta" or not p.is_floating_point():
        return None
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, width, generator=g) * 2.0).to(device=p.device, dtype=p.dtype)
    ref = reference or (lambda t: type(m).forward(m, t))
    with torch.no_grad():
        try:
            want = ref(x)
        except Exception as e:  # noqa: BLE001 - a forward that cannot take a plain [.., width] input
            return f"its forward on a [2, 3, {width}] input raised {type(e).__name__}: {e}"
        got = ours(x)
    if not torch.is_tensor(want) or want.shape != got.shape:
        return (f"its forward returns {type(want).__name__} {tuple(getattr(want, 'shape', ()))}, "
                f"ours {tuple(got.shape)}")
    want, got = want.float(), got.float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= _tolerance(p.dtype):
        return f"its forward and ours differ by {err:.2g} relative on a random input"
    return None
