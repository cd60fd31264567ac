"""Forward-mode AD (Note [forward-mode AD]): the op set in torch's own ops,
for a call whose inputs carry tangents."""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad
import torch.nn.functional as F

from .. import _xla_torch as _ref
from ..errors import UnsupportedError
from ..ops import causal_mode

# Note [forward-mode AD]
# Our kernels read a tensor's data: a dual tensor's tangent (torch.autograd.
# forward_ad) was dropped without a word (the result had none: a jvp of
# tensor_ops.silu came out None, read as zero), and torch.func.jvp raised
# "Cannot access data pointer". The backward kernels give vector-Jacobian
# products, not the Jacobian-vector products forward mode needs, so a call
# with a tangent runs the op as torch ops (the XLA shim's torch formulas,
# _xla_torch: fp32 math for fp16 / bf16, rounded once), whose forward AD
# torch has: the same function, correct tangents, torch's speed. The check
# on the common path is one module attribute (the dual level, -1 outside
# forward_ad.dual_level()) and, under torch.func, the transform stack. The
# backward ops have no derivative of their own (Note [backward ops refuse
# to be differentiated]): a tangent there raises.


_REFERENCE = {
    "rms_norm": lambda x, w, eps, offset: _ref.rms_norm(x, w, eps, offset),
    "layer_norm": lambda x, w, b, eps: _ref.layer_norm(x, w, b, eps),
    "add_rms_norm": lambda x, r, w, eps: _ref.add_rms_norm(x, r, w, eps),
    "silu": _ref.silu,
    "gelu": lambda x, approximate: _ref.gelu(x, approximate),
    "swiglu": lambda g, u: _ref.glu(g, u, "silu"),
    "geglu": lambda g, u, approximate: _ref.glu(g, u, "gelu" if approximate == "none" else "gelu_tanh"),
    "softmax": lambda x, dim, scale, causal: _ref.softmax(x, dim, scale, 1 if causal else 0, False),
    "log_softmax": lambda x, dim, scale, causal: _ref.softmax(x, dim, scale, 1 if causal else 0, True),
    "rope": lambda x, cos, sin, positions, interleaved: _ref.rope(x, cos, sin, positions, interleaved, False),
    "attention": lambda q, k, v, causal, scale, alignment: _ref.attention(q, k, v, causal_mode(causal, alignment),
                                                                          scale),
    "cross_entropy": lambda z, t, ignore_index, reduction, ls, zl, softcap: _ref.cross_entropy(
        z, t, ignore_index, reduction, ls, zl, softcap or 0.0),
    "linear": lambda x, w, b, layout: F.linear(x, w if layout == "nk" else w.t(), b),
}


def has_tangent(args) -> bool:
    """Inside a dual level: does an argument carry a tangent?"""
    return any(isinstance(a, torch.Tensor) and _fwad.unpack_dual(a).tangent is not None for a in args)


def jvp_transform() -> bool:
    """Is torch.func.jvp (or jacfwd, hessian) among the active transforms?"""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def reference(name: str, args):
    """The op `name` on args (every argument given) in torch's ops."""
    fn = _REFERENCE.get(name)
    if fn is None:
        raise UnsupportedError(
            f"tensor_ops.{name}: forward-mode AD (torch.func.jvp / jacfwd, forward_ad dual tensors) is not "
            f"supported through this op"
            + (": it is a backward op, which has no derivative of its own" if name.endswith("_backward") else
               " (its gradient output is a backward kernel's)"))
    return fn(*args)
