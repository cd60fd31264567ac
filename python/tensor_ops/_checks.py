"""Strict argument checks for the op API: a value of the wrong type is a
TypeError naming the argument and what it got, never silently converted
(float('2'), int(1.5), bool('False'))."""
from __future__ import annotations

import numbers
import operator
import sys

import numpy as np

from .errors import ArgumentTypeError, InvalidArgumentError


def _zero_d_real(value) -> bool:
    """A 0-d numpy or (concrete) jax array of a real dtype: np.array(0.5),
    jnp.float32(0.5). Not a torch tensor: float() would drop its gradient."""
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and (value.dtype.kind in "fiu" or value.dtype.name == "bfloat16")
    jax = sys.modules.get("jax")
    return (jax is not None and isinstance(value, jax.Array) and value.ndim == 0
            and (value.dtype.kind in "fiu" or value.dtype.name == "bfloat16") and not isinstance(value, jax.core.Tracer))


def real(name: str, value, *, nonneg: bool = False) -> float:
    """A finite real number (int, float, numpy scalar, a 0-d numpy / jax
    array of a real dtype; not bool or str)."""
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or _zero_d_real(value)):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not v - v == 0.0:  # not finite (inf - inf and NaN are NaN); math.isfinite breaks a compiled graph
        raise InvalidArgumentError(f"{name} must be finite, got {v}")
    if nonneg and v < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {v}")
    return v


def integer(name: str, value) -> int:
    """An integer (int, numpy integer, anything with __index__; not bool or float)."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def int64(name: str, value) -> int:
    """An integer the kernels take as int64 (ignore_index): out of range is a
    ValueError naming it, not the binding's signature dump."""
    v = integer(name, value)
    if not -2 ** 63 <= v < 2 ** 63:
        raise InvalidArgumentError(f"{name} must fit in int64, got {v}")
    return v


def flag(name: str, value) -> bool:
    """A bool (Python or numpy); 'False', 0.0 and None are refused, not read as truth values."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def choice(name: str, value, allowed: tuple) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be one of {', '.join(map(repr, allowed))}, "
                                f"got {type(value).__name__} {value!r}")
    if value not in allowed:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def shape(name: str, value) -> tuple:
    """A shape: an int or a sequence of non-negative integers."""
    if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (value,)
    try:
        dims = tuple(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be a sequence of integers, got {type(value).__name__} {value!r}") from None
    out = tuple(integer(f"{name}[{i}]", d) for i, d in enumerate(dims))
    for i, d in enumerate(out):
        if d < 0:
            raise InvalidArgumentError(f"{name}[{i}] must be >= 0, got {d} in shape {out}")
    return out
