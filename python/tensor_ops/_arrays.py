"""Arrays in, the caller's kind of array out.

numpy arrays, torch tensors (any device) and any other DLPack producer reach
the core zero-copy. Outputs are allocated with the caller's framework, so a
torch tensor in gives a torch tensor out and numpy gives numpy.
"""
from __future__ import annotations

import sys

import numpy as np

from . import _C
from .errors import DTypeError, InvalidArgumentError, LayoutError

_BF16_NAME = "bfloat16"


def is_bf16(dt) -> bool:
    """ml_dtypes' bfloat16 (a 'V'-kind numpy dtype). dtype.name is computed
    in Python by numpy (~1-3 us a read), so it stays off the per-call path."""
    return dt.kind == "V" and dt.type.__name__ == _BF16_NAME


def _torch():
    return sys.modules.get("torch")


def is_torch(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


class Arg:
    """One array argument as the core sees it."""

    __slots__ = ("kind", "array", "bf16_view", "original")

    def __init__(self, value, name: str):
        self.original = value
        if isinstance(value, np.ndarray):
            self.kind = "numpy"
            if is_bf16(value.dtype):  # ml_dtypes.bfloat16: pass the bits
                self.array, self.bf16_view = value.view(np.uint16), True
            else:
                self.array, self.bf16_view = value, False
        elif isinstance(value, _C.Tensor):
            self.kind = "tensor_ops"
            self.array, self.bf16_view = value, False
        elif is_torch(value):
            self.kind = "torch"
            self.array = value.detach() if value.requires_grad else value
            self.bf16_view = False
        elif hasattr(value, "__dlpack__"):
            self.kind = "dlpack"
            self.array, self.bf16_view = value, False
        else:
            raise TypeError(
                f"{name} must be an array (numpy.ndarray, torch.Tensor or a DLPack producer), "
                f"got {type(value).__name__}"
            )

    def contiguous(self):
        if self.kind == "tensor_ops":
            return  # always contiguous
        if self.kind == "torch":
            self.array = self.array.contiguous()
        elif self.kind == "numpy":
            self.array = np.ascontiguousarray(self.array)
        else:
            self.kind = "numpy"
            self.array = np.ascontiguousarray(np.from_dlpack(self.array))


def empty_like(arg: Arg, shape=None, dtype: str | None = None):
    """A contiguous output in arg's framework and on arg's device: arg's shape
    and dtype unless given (dtype as a name: "float32", "int64", ...)."""
    a = arg.original if arg.kind == "numpy" else arg.array
    if arg.kind == "dlpack":
        a = np.from_dlpack(a)
    shape = tuple(a.shape) if shape is None else tuple(shape)
    if arg.kind == "tensor_ops":
        return _C.empty(list(shape), dtype or a.dtype, a.device)
    if arg.kind == "torch":
        t = _torch()
        if dtype is None and shape == tuple(a.shape):  # ~1.2 us against ~1.8 us for t.empty(...)
            return t.empty_like(a, memory_format=t.contiguous_format)
        return t.empty(shape, dtype=getattr(t, dtype) if dtype else a.dtype, device=a.device)
    return np.empty(shape, dtype=np.dtype(dtype) if dtype else a.dtype)


def native(value):
    """The array the core reads for an output or extra argument (numpy
    bfloat16 as its uint16 bits)."""
    if isinstance(value, np.ndarray) and is_bf16(value.dtype):
        return value.view(np.uint16)
    return value


def run(fn, args: list[Arg], outs: list, *extra):
    """fn(*inputs, *outputs, *extra, bf16=...) with a contiguous retry for
    strided inputs; outputs must be writable."""
    bf16 = any(a.bf16_view for a in args if a is not None) or any(
        isinstance(o, np.ndarray) and is_bf16(o.dtype) for o in outs if o is not None
    )
    for o in outs:
        if isinstance(o, np.ndarray) and not o.flags.writeable:
            raise InvalidArgumentError(f"output is a read-only numpy array (shape {o.shape}, dtype {o.dtype})")
    outs_n = [native(o) for o in outs]
    try:
        fn(*[a.array if a is not None else None for a in args], *outs_n, *extra, bf16=bf16)
    except LayoutError:
        for a in args:
            if a is not None:
                a.contiguous()
        fn(*[a.array if a is not None else None for a in args], *outs_n, *extra, bf16=bf16)


def call(fn, args: list[Arg], out, *extra):
    """Runs fn(*arrays, out_array, *extra), copying strided inputs the core
    cannot take as they are (a correct answer beats a refusal)."""
    bf16 = any(a.bf16_view for a in args)
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise InvalidArgumentError(f"out is a read-only numpy array (shape {out.shape}, dtype {out.dtype})")
    out_arr = out.view(np.uint16) if isinstance(out, np.ndarray) and is_bf16(out.dtype) else out
    if bf16 and not (isinstance(out_arr, np.ndarray) and out_arr.dtype == np.uint16):
        raise DTypeError("a numpy bfloat16 input needs a numpy bfloat16 out")
    if not bf16 and isinstance(out_arr, np.ndarray) and out_arr is not out:
        raise DTypeError("out is bfloat16 but the inputs are not")
    try:
        fn(*[a.array for a in args], out_arr, *extra, bf16=bf16)
    except LayoutError:
        for a in args:
            a.contiguous()
        fn(*[a.array for a in args], out_arr, *extra, bf16=bf16)
    return out
