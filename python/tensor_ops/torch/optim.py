"""The fastest correct optimizer for a training step: torch's fused Adam /
AdamW kernel in place of a default one (on CPU torch's fused AdamW step was
5.2x the default's speed for 110M parameters, issue 24), same param groups,
hyperparameters and state. Used by Backend.optimize_for_training and the
seed-guide compat backends."""
from __future__ import annotations

from typing import Tuple

import torch

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def fuse_optimizer(optimizer: torch.optim.Optimizer) -> Tuple[torch.optim.Optimizer, str]:
    """(optimizer, what was done): torch's fused kernel for a plain Adam /
    AdamW whose parameters are all floating-point on CPU or CUDA, else the
    optimizer as given with the reason."""
    kind = type(optimizer)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind not in _FUSABLE:
        return optimizer, f"optimizer kept as given: {name} has no fused torch kernel (only Adam and AdamW)"
    groups = optimizer.param_groups
    why = None
    if any(g.get("fused") for g in groups):
        why = "it is already fused"
    elif any(g.get("foreach") or g.get("differentiable") or g.get("capturable") for g in groups):
        why = "foreach, differentiable or capturable was asked for"
    else:
        params = [p for g in groups for p in g["params"]]
        bad = [p for p in params if p.device.type not in ("cpu", "cuda") or not p.is_floating_point()]
        if bad:
            why = f"a parameter is {bad[0].dtype} on {bad[0].device} (fused needs floating point on CPU or CUDA)"
    if why:
        return optimizer, f"optimizer kept as given ({name}): {why}"
    # The same object, switched to the fused kernel in place (what
    # Adam(..., fused=True) sets up: the groups' flags, the defaults, AMP's
    # flag, the state reloaded as the fused kernel keeps it: step counts as
    # float32 tensors on each parameter's device). Its param_groups list and
    # dicts are put back after the reload, so an LR scheduler, a GradScaler or
    # code holding a group keeps driving the optimizer that steps (a new
    # optimizer left a StepLR changing the old one's lr: 1e-6 set, 1e-2 used).
    groups = optimizer.param_groups
    state = optimizer.state_dict()
    for g in state["param_groups"]:
        g["fused"], g["foreach"] = True, None
    optimizer.defaults.update(fused=True, foreach=None)
    optimizer._step_supports_amp_scaling = True
    optimizer.load_state_dict(state)
    for old, new in zip(groups, optimizer.param_groups):
        old.update({k: v for k, v in new.items() if k != "params"})
    optimizer.param_groups = groups
    return optimizer, (f"optimizer: {name} switched in place to fused=True, torch's fused kernel, with the same "
                       f"{len(groups)} param group(s), hyperparameters and state (the same object: schedulers "
                       f"attached to it keep working)")
