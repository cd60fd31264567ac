"""Routing of tensor_ops' top-level ops: to the XLA shim (tensor_ops.xla):
XLA arrays always; host arrays (numpy, CPU torch) when the shim is selected:
by a use() scope, else set_backend(), else TENSOR_OPS_BACKEND (the core's
selection, which knows the shim's names). Results come back as the caller's
kind of array. And to tensor_ops.torch.functional for a call autograd would
record, or on torch.func's tensors (Note [ops that autograd would record])."""
from __future__ import annotations

import functools
import inspect
import sys

import numpy as np

from ._arrays import FORWARD_AD, TORCH_TYPES, note_torch
from ._xla_kernels import _jax
from . import _C
from .errors import DTypeError, ExternalBackendSelected, InvalidArgumentError, UnsupportedError
from .xla import NAMES, OPS, is_xla_array


def is_name(name) -> bool:
    return isinstance(name, str) and name in NAMES


# The selection (use / set_backend / TENSOR_OPS_BACKEND) lives in the core,
# which knows the shim's names (backends.py registers them): an op on host
# arrays raises ExternalBackendSelected there while the shim is selected.
host_selected = _C.external_selected


_PLAIN = {np.ndarray, float, int, bool, str, type(None)}  # never XLA arrays: skipped at no cost


def _is_host(a) -> bool:
    if type(a) is np.ndarray or a is None or isinstance(a, (bool, int, float, str, np.generic)):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor) and a.is_cpu


def _host_to_jax(a, table: bool = False, index: str = ""):
    """numpy / CPU torch -> jax, with the native dtype rules (rope's cos/sin
    tables may be any float: the op casts them to x's dtype; index arrays must
    be int32 / int64)."""
    jnp = _jax().numpy
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        t = a.detach()
        a = t.view(torch.int16).numpy().view(jnp.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    if not isinstance(a, np.ndarray):
        return a
    if index and a.dtype not in (np.int32, np.int64):
        raise DTypeError(f"{index} must be int32 or int64, got {a.dtype} (shape {a.shape})")
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
_INDEX = {"rope": (3, "positions"), "rope_backward": (3, "positions"), "cross_entropy": (1, "target"),
          "cross_entropy_with_grad": (1, "target")}


def _call(shim, args, kwargs, host: bool):
    out = kwargs.pop("out", None)
    if not host:
        if out is not None:
            raise InvalidArgumentError("out= does not apply to XLA arrays (they are immutable): use the result")
        return shim(*args, **kwargs)
    like = next((a for a in args if not isinstance(a, (bool, int, float, str, np.generic)) and a is not None), None)
    # inplace=True on a host buffer (numpy / CPU torch while the shim is
    # selected): the shim's arrays are immutable, the caller's are not, so
    # the gradient is computed out of place and written back into logits.
    inplace = shim.__name__ == "cross_entropy_with_grad" and kwargs.get("inplace", False) is not False
    if inplace:
        kwargs = {**kwargs, "inplace": False}
    tables = _TABLES.get(shim.__name__, ())
    index = _INDEX.get(shim.__name__, ())

    def conv(key, a):
        return _host_to_jax(a, key in tables, index[1] if key in index and a is not None else "")

    result = _to_host(shim(*[conv(i, a) for i, a in enumerate(args)], **{k: conv(k, v) for k, v in kwargs.items()}),
                      like)
    if inplace:
        logits = args[0] if args else kwargs["logits"]
        if isinstance(logits, np.ndarray):
            if not logits.flags.writeable:
                raise InvalidArgumentError("cross_entropy_with_grad: inplace=True needs writable logits (the numpy "
                                           "array is read-only)")
            np.copyto(logits, result[1])
        else:
            logits.copy_(result[1])
        return result[0], logits
    if out is None:
        return result
    if isinstance(out, np.ndarray):
        np.copyto(out, result)
    else:
        out.copy_(result)
    return out


# Note [ops that autograd would record]
# The op API records no autograd: tensor_ops.torch does. A torch tensor that
# requires grad, passed while grad mode is on (a training step calling
# tensor_ops.rms_norm(h, self.weight)), used to be read as its data: the
# result had no grad_fn, so the weight got no gradient and, behind a
# residual add, the loss still backpropagated: training went on without the
# op's gradient, silently. Such a call now runs tensor_ops.torch.functional's
# op of the same name (the same kernels, with autograd; for a backward op,
# a result that refuses to be differentiated, as torch's once_differentiable
# does); under torch.no_grad, or with nothing that requires grad, nothing
# changes. out= records nothing, so it is refused there, as torch refuses it.
ROUTED = tuple(OPS)


def _grad_on() -> bool:
    """torch's grad mode (asked only about a tensor that requires grad: torch is imported)."""
    return sys.modules["torch"].is_grad_enabled()


def _records_autograd(values) -> bool:
    """Would torch's autograd record this call: a tensor that requires grad
    with grad mode on, or a tangent (Note [forward-mode AD])?"""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if torch.autograd.forward_ad._current_level >= 0:
        from .torch.forward_ad import has_tangent

        # traced (torch.compile): fake tensors show no tangent; the functional op decides at run time
        if torch.compiler.is_compiling() or has_tangent(values):
            return True
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in values)


_FUNCTIONAL: dict = {}  # name -> (functional op, its parameter names, the native op's defaults)


def _functional(name: str, native):
    entry = _FUNCTIONAL.get(name)
    if entry is None:
        import importlib

        fn = getattr(importlib.import_module("tensor_ops.torch.functional"), name)
        params = frozenset(inspect.signature(fn).parameters)
        defaults = {k: p.default for k, p in inspect.signature(native).parameters.items() if k not in params}
        entry = _FUNCTIONAL[name] = (fn, params, defaults)
    return entry


def _is_default(value, default) -> bool:
    if value is None or value is default:
        return True
    plain = (bool, int, float, str)
    return type(value) in plain and type(default) in plain and value == default


def _as_torch(a):
    """A numpy array among torch arguments, as a torch tensor sharing its
    memory (what the autograd path takes); anything else as it is."""
    if type(a) is not np.ndarray or a.ndim == 0:  # a 0-d array is a scalar option (scale=np.array(0.5))
        return a
    torch = sys.modules["torch"]
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _differentiable(name: str, native, args, kwargs):
    """The op `name` through tensor_ops.torch.functional (Note [ops that
    autograd would record])."""
    fn, params, extra = _functional(name, native)
    # layer_norm_backward(bias=False): the same gradients, dbias left out.
    drop_dbias = name == "layer_norm_backward" and kwargs.get("bias", True) is False
    for key in extra:
        value = kwargs.get(key)
        if key == "bias" and drop_dbias or _is_default(value, extra[key]):
            continue
        if key == "inplace":  # the op's own refusal names the logits that require grad
            return native(*args, **kwargs)
        grads = [f"{type(a).__name__}{list(a.shape)} {a.dtype}" for a in args + tuple(kwargs.values())
                 if getattr(a, "requires_grad", False)]
        if not grads:  # a tangent (Note [forward-mode AD]), as torch refuses out= there
            raise InvalidArgumentError(
                f"{name}: {key}= records no forward-mode AD, but an argument carries a tangent "
                f"(torch.autograd.forward_ad / torch.func.jvp); call it without {key}= (the result carries it)")
        shown = f"{type(value).__name__}{list(value.shape)}" if hasattr(value, "shape") else repr(value)
        raise InvalidArgumentError(
            f"{name}: {key}={shown} records no autograd, but an argument requires grad ({', '.join(grads)}) "
            f"with grad mode on; call it under torch.no_grad() (or on .detach()ed tensors) if no gradient is "
            + ("wanted, or without out= (the result records the gradient)" if key == "out" else
               f"wanted: tensor_ops.torch's {name} has no {key} option"))
    if extra and kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    if any(type(a) is np.ndarray for a in args) or any(type(v) is np.ndarray for v in kwargs.values()):
        args, kwargs = tuple(_as_torch(a) for a in args), {k: _as_torch(v) for k, v in kwargs.items()}
    result = fn(*args, **kwargs)
    return (result[0], result[1], None) if drop_dbias else result


def routed(name: str, native):
    """native op -> the same op, sent to the shim for XLA arrays and, when
    the shim is selected, for host arrays; to tensor_ops.torch.functional
    when autograd would record it (Note [ops that autograd would record]);
    anything else runs natively. A numpy-only call costs one type check per
    array argument on top of the native op: the core reports a shim
    selection (ExternalBackendSelected)."""
    shim = OPS.get(name)
    plain = _PLAIN

    def general(args, kwargs):
        if not TORCH_TYPES:
            note_torch()
        values = args + tuple(kwargs.values()) if kwargs else args
        for a in values:
            if shim is not None and type(a) not in plain and is_xla_array(a):
                return _call(shim, args, kwargs, host=False)
        if _records_autograd(values):
            return _differentiable(name, native, args, kwargs)
        try:
            return native(*args, **kwargs)
        except ExternalBackendSelected:
            return selected(args, kwargs)

    def selected(args, kwargs):
        values = args + tuple(kwargs.values()) if kwargs else args
        if any(isinstance(a, _C.Tensor) for a in values):
            raise UnsupportedError(
                f"{name}: the XLA shim is selected, and it takes numpy arrays, torch tensors and XLA arrays, not "
                f"tensor_ops.Tensor ({', '.join(f'{a.dtype}{list(a.shape)} on {a.device}' for a in values if isinstance(a, _C.Tensor))}); "
                f"pass t.numpy(), or run the op outside the XLA selection")
        if not all(_is_host(a) for a in values):
            arrays = sorted({f"{type(a).__name__} on {getattr(a, 'device', 'host')}" for a in values
                             if type(a) not in _PLAIN})
            raise InvalidArgumentError(
                f"{name}: the XLA shim is selected for host arrays, but the arguments mix host arrays with "
                f"device tensors ({', '.join(arrays)}); move them to one place")
        return _call(shim, args, kwargs, host=True)

    def wrapped(args, kwargs):
        # torch.func's tensors (vmap with no gradient: they do not require grad) have no data the
        # core can read: a call that raised on them runs the functional op, which torch batches.
        torch = sys.modules.get("torch")
        if torch is None or torch._C._functorch.peek_interpreter_stack() is None:
            raise  # noqa: PLE0704 - the error being handled
        return _differentiable(name, native, args, kwargs)

    return _with_signature(native, general, selected, wrapped)


def _with_signature(native, general, selected, wrapped):
    """A wrapper with native's own signature (no *args / **kwargs packing on
    the hot path): numpy arrays go straight to native (the core raises
    ExternalBackendSelected when the shim is selected); any other array kind
    (torch / jax / XLA) goes through `general`. Arguments whose default is a
    plain number, bool or string are options, not arrays: not checked."""
    sig = inspect.signature(native)
    params, pos, kw, checks, torch_lane, defaults = [], [], [], [], [], {}
    star = False
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):  # not expected: keep the generic form
            return functools.wraps(native)(lambda *a, **k: general(a, k))
        text = p.name
        if p.default is not p.empty:
            defaults["d_" + p.name] = p.default
            text += "=d_" + p.name
        if p.kind is p.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            kw.append(p.name)
        else:
            pos.append(p.name)
        params.append(text)
        if p.default is p.empty or p.default is None:
            checks.append(f"type({p.name}) not in plain")
            torch_lane.append(f"(type({p.name}) in plain or (type({p.name}) in torch_types and not {p.name}.is_xla "
                              f"and not ({p.name}.requires_grad and grad_on())))")
    if torch_lane:  # a tangent takes the general path (Note [forward-mode AD])
        torch_lane.append("fwad[0]._current_level < 0")
    args = f"({', '.join(pos)}{',' if len(pos) == 1 else ''}), {{{', '.join(repr(n) + ': ' + n for n in kw)}}}"
    call = ", ".join(pos + [f"{n}={n}" for n in kw])
    factory = ", ".join(["native", "general", "selected", "wrapped", "plain", "torch_types", "ExternalBackendSelected",
                         "grad_on", "fwad"] +
                        list(defaults))
    src = (f"def _make({factory}):\n"
           f"  def op({', '.join(params)}):\n"
           f"    if ({' or '.join(checks) or 'False'}) and not ({' and '.join(torch_lane) or 'False'}):\n"
           f"      return general({args})\n"
           f"    try:\n"
           f"      return native({call})\n"
           f"    except ExternalBackendSelected:\n"
           f"      return selected({args})\n"
           f"    except RuntimeError:\n"
           f"      return wrapped({args})\n"
           f"  return op\n")
    scope = {}
    exec(compile(src, f"<tensor_ops routed {native.__name__}>", "exec"), {}, scope)  # noqa: S102
    # Host tensors of torch's plain types (not is_xla, not requiring grad)
    # go straight to the native op, without the general path's per-argument
    # XLA and autograd checks.
    op = scope["_make"](native, general, selected, wrapped, _PLAIN, TORCH_TYPES, ExternalBackendSelected, _grad_on,
                        FORWARD_AD,
                        **defaults)
    return functools.wraps(native)(op)
