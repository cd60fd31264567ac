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

import copy
import inspect
from typing import Callable, FrozenSet, Optional

import torch
from torch import nn


def code_names(code) -> set:
    """The global / attribute names code and the functions nested in it read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if inspect.iscode(c):
            names |= code_names(c)
    return names


def forward_names(cls: type) -> Optional[FrozenSet[str]]:
    """The global and attribute names cls's forward (its own code, through
    decorators) reads, with those of functions nested in it; None when the
    forward is no plain Python function."""
    fn = getattr(cls, "forward", None)
    fn = inspect.unwrap(fn) if fn is not None else None
    code = getattr(fn, "__code__", None)
    return None if code is None else frozenset(code_names(code))


def names_mismatch(m: nn.Module, allowed: FrozenSet[str]) -> Optional[str]:
    """None when type(m).forward reads only names in allowed, else why."""
    names = forward_names(type(m))
    if names is None:
        return f"{type(m).__name__}.forward is not Python code we can read"
    extra = sorted(names - allowed)
    if extra:
        return f"its forward also uses {', '.join(extra)} (not the plain form {', '.join(sorted(allowed))})"
    return None


_STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")
# A module's hook dicts that run when it is called (prepare._carry_over moves them to a replacement).
CALL_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def state_left_behind(m: nn.Module, *dropped: nn.Module) -> Optional[str]:
    """Why replacing m by a new module over its Linear children would lose
    something (None when nothing): parameters or buffers of m's own (an
    expert bias, a token counter: gone from the state_dict), state_dict /
    load hooks on m, or hooks on a child the replacement does not call
    (`dropped`: the act_fn whose function the kernel computes)."""
    own = [n for n, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]
    if own:
        return f"it holds parameters / buffers of its own ({', '.join(own)}) that the replacement would not keep"
    hooks = [h for h in _STATE_HOOKS if getattr(m, h, None)]
    if hooks:
        return f"it has state_dict / load hooks ({', '.join(hooks)}) that the replacement would not keep"
    for d in dropped:
        if any(getattr(d, h, None) for h in CALL_HOOKS) or "forward" in d.__dict__:
            return f"its {type(d).__name__} has hooks, and the replacement computes it without calling it"
    return None


class _Quiet:
    """The module tree in eval mode with its call hooks set aside, for the
    check's own call (it ran the model's hooks on the random input, and in
    train mode a spectral_norm parametrization stepped its power iteration:
    the refused model came out 0.19 off). Restored on exit."""

    def __init__(self, m: nn.Module):
        self.m = m

    def __enter__(self):
        self.saved = [(mod, mod.training, {h: getattr(mod, h) for h in CALL_HOOKS if getattr(mod, h, None)})
                      for mod in self.m.modules()]
        for mod, _, hooks in self.saved:
            mod.training = False
            for h, d in hooks.items():
                setattr(mod, h, type(d)())
        return self.m

    def __exit__(self, *exc):
        for mod, training, hooks in self.saved:
            mod.training = training
            for h, d in hooks.items():
                setattr(mod, h, d)
        return False


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def _data_twin(m: nn.Module) -> nn.Module:
    """A CPU copy of a module built on the meta device (no data), its
    parameters random (seeded) and its buffers zero: what the check runs
    when m has nothing to run on."""
    twin = copy.deepcopy(m).to_empty(device="cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in twin.parameters():
            t.copy_(torch.randn(t.shape, generator=g) * 0.5 + (1.0 if t.dim() == 1 else 0.0))
        for t in twin.buffers():
            t.zero_()
    return twin


def same_output(m: nn.Module, ours: Callable[[nn.Module, torch.Tensor], torch.Tensor], width: int) -> Optional[str]:
    """None when ours(m, x) matches the module's own type(m).forward(m, x)
    on a random x [2, 3, width] in the dtype and on the device of m's first
    parameter (float32 on the CPU without one), else why. A module on the
    meta device is checked as a CPU twin with random parameters."""
    # A device context (transformers' from_pretrained builds under torch.device("meta")) would put
    # the check's own tensors there: the check makes them on the CPU.
    with torch.device("cpu"), torch.no_grad():
        p = next(m.parameters(), None)
        if p is not None and p.is_meta:
            m = _data_twin(m)
            p = next(m.parameters())
        dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(2, 3, width, generator=g) * 2.0).to(device=p.device if p is not None else "cpu", dtype=dtype)
        with _Quiet(m):
            try:
                want = type(m).forward(m, x)
            except Exception as e:  # noqa: BLE001 - a forward that cannot take a plain [.., width] input
                return f"its forward on a [2, 3, {width}] input raised {type(e).__name__}: {e}"
            got = ours(m, x)
    if not torch.is_tensor(want) or want.shape != got.shape:
        return (f"its forward returns {type(want).__name__} {tuple(getattr(want, 'shape', ()))}, "
                f"ours {tuple(got.shape)}")
    want, got = want.float(), got.float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= _tolerance(dtype):
        return f"its forward and ours differ by {err:.2g} relative on a random input"
    return None
