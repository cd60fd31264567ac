"""The ops the Python layer calls, in one table (as
cpp/include/tensor_ops/ops.def is for C++), and the one path every call
takes: `invoke`.

An entry names the binding, its array arguments in the binding's order and,
per output, the array argument it is shaped and typed like. The public
functions (tensor_ops.rms_norm, ops.py) check and convert their options,
then call invoke; none has a fast path of its own.

invoke takes one of two lanes:
- the fast lane, for the common call: no out=, every array of one plain
  kind and dtype (numpy float32/float16; or host torch tensors, torch.Tensor
  or nn.Parameter, read as their data: the op API records no autograd). Torch outputs are made by the
  binding (Note [outputs made in C++] in python/src/convert.cpp; one C call
  instead of a torch.empty_like per output), numpy outputs by np.empty.
- the general lane, for everything else: Arg conversion (DLPack producers,
  numpy bfloat16, mixed kinds or dtypes, lazy torch views, device data and
  its streams), outputs in the caller's framework, a contiguous
  retry for strided inputs, and the worded refusals.
A layout the core refuses on the fast lane (a strided or lazy view) sends
the call to the general lane, which copies what needs copying.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from . import _C
from ._arrays import (FAST_NP, POOL_OUTPUT_BYTES, TORCH_TYPES, Arg, _torch, bump_torch_version, call, empty_like,
                      fast_out, run)
from .errors import DTypeError, LayoutError, OutOfMemoryError, TensorOpsError, UnsupportedError


class OpEntry(NamedTuple):
    fn: Callable[..., Any]  # the _C binding: fn(*arrays, *outputs, *scalars, bf16=...)
    arrays: tuple[str, ...]  # array arguments in the binding's order (names for the messages)
    # per output: the array argument it is shaped and typed like, or LSE
    # (float32, the first argument's shape without its last dim)
    like: tuple[int, ...]
    optional: int = -1  # the array argument that may be None (layer_norm's bias), else -1
    index: int = -1  # the integer array argument (rope's positions): any dtype, else -1
    # the output's shape from the arrays and the extra arguments, when it is not its `like`
    # argument's (linear: x's with the last dim weight's rows, or columns); single-output ops only
    shape: Optional[Callable[[tuple, tuple], tuple]] = None


LSE = -1  # attention's log-sum-exp output


def _linear_shape(arrays: tuple, extra: tuple) -> tuple:
    """linear's output: x's shape with its last dim weight's rows, or its
    columns when extra holds weight_layout 1 ("kn": weight [K, N]) (shapes
    the core refuses give some shape; the core's error names the real ones)."""
    x, w = arrays[0].shape, arrays[1].shape
    return tuple(x[:-1]) + (w[1 if extra and extra[0] == 1 else 0] if len(w) == 2 else 0,) if len(x) else ()


TABLE: dict[str, OpEntry] = {
    "rms_norm": OpEntry(_C.rms_norm, ("x", "weight"), (0,)),
    "silu": OpEntry(_C.silu, ("x",), (0,)),
    "gelu": OpEntry(_C.gelu, ("x",), (0,)),
    "layer_norm": OpEntry(_C.layer_norm, ("x", "weight", "bias"), (0,), optional=2),
    "add_rms_norm": OpEntry(_C.add_rms_norm, ("x", "residual", "weight"), (0, 0)),
    "softmax": OpEntry(_C.softmax, ("x",), (0,)),
    "glu": OpEntry(_C.glu, ("gate", "up"), (0,)),
    "rms_norm_backward": OpEntry(_C.rms_norm_backward, ("dy", "x", "weight"), (1, 2)),
    "softmax_backward": OpEntry(_C.softmax_backward, ("dy", "y"), (1,)),
    "activation_backward": OpEntry(_C.activation_backward, ("dy", "x"), (1,)),
    "glu_backward": OpEntry(_C.glu_backward, ("dy", "gate", "up"), (1, 1)),
    "rope": OpEntry(_C.rope, ("x", "cos", "sin", "positions"), (0,), index=3),
    "attention": OpEntry(_C.attention, ("q", "k", "v"), (0, LSE)),
    "linear": OpEntry(_C.linear, ("x", "weight", "bias"), (0,), optional=2, shape=_linear_shape),
}

_NONES = {1: (None,), 2: (None, None), 3: (None, None, None)}
_ndarray = np.ndarray
_np_empty = np.empty


def _same_kind(e: OpEntry, arrays: tuple, kinds, dt) -> bool:
    """Every array argument of one of `kinds` and of dtype dt (the index
    argument any dtype; the optional one may be None)."""
    for i, a in enumerate(arrays):
        if type(a) not in kinds or (a.dtype != dt and i != e.index):
            if a is None and i == e.optional:
                continue
            return False
    return True


_NP_KIND = (_ndarray,)


def _fast(e: OpEntry, arrays: tuple, extra: tuple):
    """The fast lane: the outputs, or None when the call does not qualify
    (or the core refused a layout: the general lane copies)."""
    x = arrays[0]
    t = type(x)
    like = e.like
    if t is _ndarray:
        dt = x.dtype
        if dt not in FAST_NP:
            return None
        if len(arrays) > 1 and not _same_kind(e, arrays, _NP_KIND, dt):
            return None
        if e.shape is not None:
            return _into(e, arrays, (_np_empty(e.shape(arrays, extra), dt),), extra)
        if len(like) == 1:
            a = arrays[like[0]]
            return _into(e, arrays, (_np_empty(a.shape, dt) if a.nbytes < POOL_OUTPUT_BYTES else fast_out(a),), extra)
        return _into(e, arrays, tuple(_np_empty(x.shape[:-1], np.float32) if i == LSE
                                      else _np_empty(arrays[i].shape, dt) if arrays[i].nbytes < POOL_OUTPUT_BYTES
                                      else fast_out(arrays[i]) for i in like), extra)
    if t not in TORCH_TYPES:
        return None
    dt = x.dtype
    # A weight is usually an nn.Parameter: any plain torch type qualifies. A
    # tensor that requires grad is read as its data (the op API records no
    # autograd: tensor_ops.torch does), as the general lane's detach() would.
    if len(arrays) > 1 and not _same_kind(e, arrays, TORCH_TYPES, dt):
        return None
    try:
        made = e.fn(*arrays, *_NONES[len(like)], *extra)
        if made is not None:
            return made
    except LayoutError:
        pass  # a lazy view, a large output, device data: outputs from Python below, or the general lane
    except (UnsupportedError, DTypeError):
        return None  # the general lane words the refusal (shapes, dtypes, meta / fake tensors)
    if LSE in like or e.shape is not None:
        return None  # the general lane makes it
    outs = tuple(fast_out(arrays[i]) for i in like)
    return None if any(o is None for o in outs) else _into(e, arrays, outs, extra)


def _into(e: OpEntry, arrays: tuple, outs: tuple, extra: tuple):
    """e's binding writing into outs: the output(s), or None when the core
    refused a layout (the general lane copies)."""
    try:
        e.fn(*arrays, *outs, *extra)
    except LayoutError:
        return None
    return outs[0] if len(outs) == 1 else outs


def torch_call(name: str, arrays: tuple, extra: tuple):
    """The binding of TABLE[name] on host torch tensors, its outputs made in
    C++ (Note [outputs made in C++]): the torch layer's direct lane
    (functional._run), without the public op's option checks, which its
    caller has done. The output(s), or None for anything this does not
    take as it is (a strided or lazy layout, a large output, device data,
    mixed dtypes, an option the core refuses, the XLA shim selected): the
    caller then takes the public op, which copies, routes or words the error."""
    e = TABLE[name]
    try:
        return e.fn(*arrays, *_NONES[len(e.like)], *extra)
    except OutOfMemoryError:
        raise  # the public op would run it again (its outputs are torch's either way): counted twice
    except (TensorOpsError, TypeError):
        return None


def _fast_into(e: OpEntry, arrays: tuple, extra: tuple, out):
    """The fast lane with out= (Note [out= on the fast lane]): out, or None
    when the call does not qualify or the core refused (the general lane
    then copies, or words the refusal)."""
    x = arrays[0]
    t = type(x)
    if t is _ndarray:
        dt = x.dtype
        if (dt not in FAST_NP or type(out) is not _ndarray or out.dtype != dt or not out.flags.writeable
                or not _same_kind(e, arrays, _NP_KIND, dt)):
            return None
        return _into(e, arrays, (out,), extra)
    if t not in TORCH_TYPES or type(out) not in TORCH_TYPES:
        return None
    dt = x.dtype
    if (out.dtype != dt or out.requires_grad or not out.is_cpu or not _same_kind(e, arrays, TORCH_TYPES, dt)
            or out.is_inference() and not _torch().is_inference_mode_enabled()):  # the general lane refuses
        return None
    try:
        e.fn(*arrays, out, *extra)
    except (LayoutError, UnsupportedError, DTypeError):
        return None
    bump_torch_version(out)  # torch's version counter, as the general lane's bump_version
    return out


# Note [out= on the fast lane]
# out= took the general lane (Arg conversion, check_out, the stream logic):
# silu float32[1, 64] with out= cost 6.4 us from numpy and 9.4 us from torch,
# against 1.9 / 3.4 us without (Xeon, 1 thread; prepared models run their
# inference activations in place this way). A call whose inputs and out are
# all numpy arrays (float32 / float16) or host torch tensors of one dtype now
# calls the binding with out directly: the core checks out's shape and dtype
# and refuses a partial overlap with an input (Note [row-strided overlap]),
# and the torch reader refuses a lazy (negative / conjugate) view; any
# refusal, a read-only numpy out, an out that requires grad, an inference
# tensor outside inference mode and device tensors take the general lane, which copies what it can and words the rest.


def invoke(name: str, arrays: tuple, extra: tuple = (), out=None):
    """The op `name` of TABLE on arrays, with the scalars `extra` after the
    outputs (already checked by the caller). Returns the output, or the tuple
    of outputs; `out` (single-output ops) is written and returned."""
    e = TABLE[name]
    if out is None:
        y = _fast(e, arrays, extra)
        if y is not None:
            return y
    elif len(e.like) == 1:
        y = _fast_into(e, arrays, extra, out)
        if y is not None:
            return y
    args = [None if a is None and i == e.optional else Arg(a, e.arrays[i]) for i, a in enumerate(arrays)]
    if out is not None:
        return call(e.fn, args, out, *extra)
    if e.shape is not None:
        outs = [empty_like(args[0], e.shape(tuple(None if a is None else a.array for a in args), extra))]
    else:
        outs = [empty_like(args[0], tuple(args[0].array.shape)[:-1], "float32") if i == LSE else empty_like(args[i])
                for i in e.like]
    run(e.fn, args, outs, *extra)
    return outs[0] if len(outs) == 1 else tuple(outs)
