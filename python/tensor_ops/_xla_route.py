"""Routing of tensor_ops' top-level ops to the XLA shim (tensor_ops.xla):
XLA arrays always; host arrays (numpy, CPU torch) when the shim is selected:
by a use() scope, else set_backend(), else TENSOR_OPS_BACKEND (the core's
order). Results come back as the caller's kind of array."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Iterator, Optional

import numpy as np

from ._xla_kernels import _jax
from .errors import DTypeError, InvalidArgumentError
from .xla import NAMES, OPS, is_xla_array


class _Scopes(threading.local):
    def __init__(self):
        self.stack = []  # per thread: True shim, False native, None "auto"


_scopes = _Scopes()
_selected: Optional[bool] = None  # set_backend: True shim, False native, None unset
# The process environment as os.environ keeps it (bytes keys on POSIX): a
# lookup per op call costs ~0.1 us there against ~0.8 us through os.environ.
_env = getattr(os.environ, "_data", None)
_ENV_KEY = b"TENSOR_OPS_BACKEND"
_ENV_NAMES = tuple(n.encode() for n in NAMES)


def is_name(name) -> bool:
    return isinstance(name, str) and name in NAMES


def set_selected(name: Optional[str]) -> None:
    """Mirror of set_backend(name) (the core keeps the native choice)."""
    global _selected
    _selected = None if name in (None, "auto") else is_name(name)


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Mirror of use(name): innermost wins; "auto" falls back to the env."""
    stack = _scopes.stack
    stack.append(None if name == "auto" else is_name(name))
    try:
        yield
    finally:
        stack.pop()


def host_selected() -> bool:
    stack = _scopes.stack
    if stack:
        if stack[-1] is not None:
            return stack[-1]
    elif _selected is not None:
        return _selected
    if type(_env) is dict:
        return _env.get(_ENV_KEY) in _ENV_NAMES
    return os.environ.get("TENSOR_OPS_BACKEND") in NAMES


_PLAIN = {np.ndarray, float, int, bool, str, type(None)}  # never XLA arrays: skipped at no cost


def _is_host(a) -> bool:
    if type(a) is np.ndarray or a is None or isinstance(a, (bool, int, float, str, np.generic)):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor) and a.device.type == "cpu"


def _host_to_jax(a, table: bool = False):
    """numpy / CPU torch -> jax, with the native dtype rules (rope's cos/sin
    tables may be any float: the op casts them to x's dtype)."""
    jnp = _jax().numpy
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        t = a.detach()
        a = t.view(torch.int16).numpy().view(jnp.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    if not isinstance(a, np.ndarray):
        return a
    if table and a.dtype == np.float64:
        a = a.astype(np.float32)
    if a.dtype.kind == "f" and a.dtype not in (np.float16, np.float32):
        raise DTypeError(f"array has dtype {a.dtype}; tensor_ops ops take float32, float16 or bfloat16")
    if a.dtype == np.int64 and not _jax().config.jax_enable_x64 and a.size:
        if a.min() < -2 ** 31 or a.max() >= 2 ** 31:
            raise InvalidArgumentError("int64 index values beyond int32 need jax_enable_x64")
    return jnp.asarray(a)


def _to_host(r, like):
    """A shim result back to like's kind (numpy or CPU torch), writable."""
    if r is None:
        return None
    if isinstance(r, tuple):
        return tuple(_to_host(e, like) for e in r)
    arr = np.array(r)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        if arr.dtype.name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    return arr[()] if arr.ndim == 0 else arr


_TABLES = {"rope": (1, 2, "cos", "sin"), "rope_backward": (1, 2, "cos", "sin")}


def _call(shim, args, kwargs, host: bool):
    out = kwargs.pop("out", None)
    if not host:
        if out is not None:
            raise InvalidArgumentError("out= does not apply to XLA arrays (they are immutable): use the result")
        return shim(*args, **kwargs)
    like = next((a for a in args if not isinstance(a, (bool, int, float, str, np.generic)) and a is not None), None)
    tables = _TABLES.get(shim.__name__, ())
    result = _to_host(shim(*[_host_to_jax(a, i in tables) for i, a in enumerate(args)],
                           **{k: _host_to_jax(v, k in tables) for k, v in kwargs.items()}), like)
    if out is None:
        return result
    if isinstance(out, np.ndarray):
        np.copyto(out, result)
    else:
        out.copy_(result)
    return out


def routed(name: str, native):
    """native op -> the same op, sent to the shim for XLA arrays and, when
    the shim is selected, for host arrays; anything else runs natively."""
    shim = OPS[name]

    @functools.wraps(native)
    def op(*args, **kwargs):
        for a in (args + tuple(kwargs.values()) if kwargs else args):
            if type(a) not in _PLAIN and is_xla_array(a):
                return _call(shim, args, kwargs, host=False)
        if host_selected() and all(_is_host(a) for a in args) and all(_is_host(a) for a in kwargs.values()):
            return _call(shim, args, kwargs, host=True)
        return native(*args, **kwargs)

    return op
