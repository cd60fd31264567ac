"""Every tensor_ops op as a torch custom op, torch.ops.tensor_ops.<name>: the
real kernel, a fake kernel (shapes and dtypes only) so torch.compile traces
through without a graph break, and autograd through our backward kernels.

Note [two ways in]: a torch custom op's call costs several us of dispatch
(silu [1, 64], torch 2.13, 1 thread, Xeon: ~4 us with nothing to
differentiate, Note [the autograd key's direct lane]; ~14 us recording a
gradient), more than our small kernels take. So
each differentiable op is also an autograd.Function built from the same
kernel, setup_context and backward; tensor_ops.torch.functional calls that
Function for plain tensors in eager mode (about the cost of a torch eager op)
and the custom op whenever torch.compile traces. A backward takes its
kernels from `k`: the custom ops (TRACED) under the custom op's autograd, so
compiled backward graphs record them; the plain functions (DIRECT) under
the Function.

Note [contiguous inputs]: the kernels take dense row-major data; a strided
input would be copied by the op layer anyway, so each op calls .contiguous()
(a no-op for dense tensors) rather than going through the op layer's
refuse-and-retry path (softmax along an inner dim still takes it: the op
layer moves that dim last, then copies). Gradients arriving from autograd are
often strided (expanded by sum(), transposed by a matmul): backward ops do
the same.

Note [fake layouts]: each fake kernel returns what the real one returns,
strides included: new_empty is row-major, as the op layer's outputs are
(softmax along an inner dim too: Note [softmax along an inner dim]); the
activations keep a dense input's layout (Note [elementwise layouts]).
"""
import functools
import inspect
import math
import types
from typing import List, Optional, Tuple

import torch
from torch._C import _functions as _autograd_functions

import tensor_ops as _to
from tensor_ops._arrays import note_torch
from tensor_ops._optable import torch_call
from tensor_ops._xla_torch import _causal_keep
from tensor_ops.errors import ArgumentTypeError

note_torch()  # torch tensors take the routing's fast lane (torch may be imported after tensor_ops)

Tensor = torch.Tensor

OPS = {}  # name -> the torch custom op
FUNCTIONS = {}  # name -> the autograd.Function of a differentiable op
FUNCTIONS_FUNC = {}  # name -> the same with setup_context, for torch.func transforms
TRACED = types.SimpleNamespace()  # the custom ops, by name
DIRECT = types.SimpleNamespace()  # the kernels as plain functions, by name
# the FUNCTIONS_FUNC, by name: what a backward calls under torch.func, so an
# outer level records it (Note [backward ops refuse to be differentiated])
FUNC = types.SimpleNamespace()


def _softmax_options(x, dim, scale, causal, log=False):
    return (scale, 1 if causal else 0, log) if dim == -1 and type(scale) is float and type(causal) is bool else None


_CAUSAL_MODES = {"bottom_right": 1, "top_left": 2}


def _attention_options(q, k, v, causal, scale, causal_alignment):
    if type(causal) is not bool or causal_alignment not in _CAUSAL_MODES or q.dim() != 4 or q.shape[3] < 1:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])  # the public op's default, to the bit
    elif type(scale) is not float:
        return None
    return (_CAUSAL_MODES[causal_alignment] if causal else 0, scale)


# Note [direct lane]
# A functional call with nothing to differentiate (tensor_ops.torch.functional),
# the forward of its autograd.Function when there is, and the registered
# op's kernel (torch.ops.tensor_ops.<op>, what compiled graphs run) run the
# op table's binding
# (tensor_ops._optable.torch_call) with its outputs made in C++: no public
# op, no routing wrapper, no contiguous() per argument. Here is how each op's
# arguments become the table's: the op table entry, how many leading
# arguments are its arrays, and the table's extra scalars from the op's
# arguments (None: the options pass as they are; a function of all the
# arguments, returning None for options the public op must check or
# convert). What the binding does not take as it is (a strided view, a large
# output, mixed dtypes, a bad option, the XLA shim selected; device tensors
# are not tried: the binding makes host outputs only) goes the way it
# went before: the plain kernel (DIRECT), through the public op. Measured per
# call, fp32, 1 thread (Xeon, best of 7 x 20000): silu [1, 4096] 5.2 -> 3.6
# us (the public op 3.4, the binding alone 3.0, F.silu 2.3-2.8); layer_norm
# [1, 64] 3.5 us (F.layer_norm 2.3); decode attention [1, 8, 1, 64] over 300
# keys 30.4 -> 27.0 us (SDPA 29.2), over 1 key 10.3 -> 6.8 us (SDPA 5.6);
# with a gradient recorded, [1, 4096]: layer_norm 12.2 -> 10.5 us, rms_norm
# 11.9 -> 10.2. torch.ops' calls take the lane at the Autograd key (Note
# [the autograd key's direct lane]).
LOWERED = {
    "rms_norm": ("rms_norm", 2, None),
    "layer_norm": ("layer_norm", 3, None),
    "add_rms_norm": ("add_rms_norm", 3, None),
    "silu": ("silu", 1, None),
    "gelu": ("gelu", 1, None),
    "swiglu": ("glu", 2, lambda gate, up: ("silu", "none")),
    "geglu": ("glu", 2, lambda gate, up, approximate: ("gelu", approximate)),
    "softmax": ("softmax", 1, _softmax_options),
    "log_softmax": ("softmax", 1, lambda x, dim, scale, causal: _softmax_options(x, dim, scale, causal, True)),
    "attention": ("attention", 3, _attention_options),
}


# Note [registration]: the ops are defined with torch.library.Library
# define/impl (schema inferred from the type hints, the kernel registered for
# CompositeExplicitAutograd: every device), not the torch.library.custom_op
# decorator, whose Python wrapper costs several us more per call (measured in
# bench/bench_latency.py; issue 21). Fake kernels go through
# torch.library.register_fake, autograd through torch's own autograd kernel
# (what register_autograd registers, behind the direct lane: Note [the
# autograd key's direct lane]), so torch.compile and autograd see the same op.
_LIB = torch.library.Library("tensor_ops", "DEF")


def direct_lane(lowered, args):
    """The direct lane (Note [direct lane]) of the op LOWERED maps to
    `lowered`, on its arguments `args` (every one given, args[0] a plain
    tensor): the output(s), or None for a call the lane does not take."""
    if not args[0].is_cpu:
        return None
    entry, n, options = lowered
    extra = args[n:] if options is None else options(*args)
    return None if extra is None else torch_call(entry, args[:n], extra)


def _defaults(impl):
    """impl's parameter defaults, in order (inspect's empty marker for a
    parameter without one)."""
    return tuple(p.default for p in inspect.signature(impl).parameters.values())


def _filled(args, defaults):
    """The dispatcher's arguments with the defaults it dropped put back (it
    leaves out trailing arguments equal to their defaults: rms_norm(x, w,
    1e-6, 0.0) arrives as (x, w)); None when one without a default is missing."""
    n = len(args)
    if n == len(defaults):
        return args
    rest = defaults[n:]
    return None if inspect.Parameter.empty in rest else args + rest


def _direct_first(impl, lowered):
    """The registered kernel of an op: its direct lane for plain tensors,
    impl for the rest (and for what the lane hands back)."""
    if lowered is None:
        return impl
    defaults = _defaults(impl)

    def kernel(*args, **kwargs):
        if not kwargs and type(args[0]) is Tensor:
            full = _filled(args, defaults)
            y = None if full is None else direct_lane(lowered, full)
            if y is not None:
                return y
        return impl(*args, **kwargs)

    return functools.wraps(impl)(kernel)


# Note [the autograd key's direct lane]
# A call of torch.ops.tensor_ops.<op> passes the Autograd dispatch key first
# (unless inference_mode is on), even when nothing needs a gradient. The
# kernel torch.library.register_autograd puts there is Python: it redispatches
# below autograd, which enters Python again for our kernel. The two hops cost
# ~3.6 us per call (silu [1, 64], 1 thread: 7.2 us through torch.ops, 3.6 us
# under inference_mode). So the Autograd kernel is torch's own
# (make_autograd_impl, what register_autograd registers) behind the direct
# lane: a call that records no gradient, with plain tensors and no
# TorchDispatchMode active, runs the op table's binding there; anything else
# (a gradient to record, FakeTensors while compiling, a mode, what the lane
# refuses) takes torch's kernel unchanged. A torch without that helper gets
# register_autograd as before.
try:
    from torch._library.autograd import Info as _AutogradInfo
    from torch._library.autograd import make_autograd_impl as _make_autograd_impl
except ImportError:  # pragma: no cover - another torch: register_autograd
    _AutogradInfo = _make_autograd_impl = None

_grad_enabled = torch._C.is_grad_enabled
_fwad = torch.autograd.forward_ad
_any_requires_grad = torch._C._any_requires_grad
_dispatch_modes = torch._C._len_torch_dispatch_stack
TORCH_AUTOGRAD = {}  # name -> torch's autograd kernel of the op (what the direct lane hands on)


def _autograd_kernel(name, lowered, defaults):
    """The Autograd-key kernel of op `name`: the direct lane first (Note
    [the autograd key's direct lane]), torch's autograd kernel for the rest."""

    def kernel(keyset, *args, **kwargs):
        if _fwad._current_level >= 0:  # Note [forward-mode AD]
            from . import forward_ad

            full = _filled(args, defaults)
            if not kwargs and full is not None and forward_ad.has_tangent(full):
                return forward_ad.reference(name, full)
        if (lowered is not None and not kwargs and type(args[0]) is Tensor
                and not (_grad_enabled() and _any_requires_grad(*args)) and not _dispatch_modes()):
            full = _filled(args, defaults)
            y = None if full is None else direct_lane(lowered, full)
            if y is not None:
                return y
        return TORCH_AUTOGRAD[name](keyset, *args, **kwargs)

    return kernel


# Note [first-order gradients]: the backward kernels record no autograd of
# their own, so a second derivative through them (create_graph=True:
# gradient penalties, Hessian-vector products) would silently miss their
# terms (torch's fallback for ops without autograd only warns). first_order
# makes the gradients a backward returns under create_graph raise when they
# are differentiated, as torch's once_differentiable does, but also when
# only the saved inputs require grad: once_differentiable looks at the
# incoming gradients alone, and a gradient penalty's incoming gradient is
# the constant 1 of sum(), so a prepared Linear -> GELU's penalty gradient
# came out 40.2 where torch's is 60.8, silently. Not inside torch.func's
# transforms: their grad always runs with create_graph and refuses the
# marking, so a grad of grad (hessian) through our kernels goes unchecked there.
_functorch_stack = torch._C._functorch.peek_interpreter_stack
_SECOND_ORDER = (b"tensor_ops: a second derivative through this op's backward kernel (create_graph=True) is not "
                 b"computed; run this part of the model on torch's own op")


def _outer_differentiating_levels() -> int:
    """How many torch.func levels that differentiate (grad / vjp / jacrev,
    jvp / jacfwd) are active around a backward, besides the one running it:
    torch.func.grad runs the backward inside its own level (innermost on the
    stack: [Grad] for grad, [Vmap, Grad] for vmap of grad), vjp / jacrev after
    leaving it ([Vmap] for jacrev). More than that is a level that will
    differentiate the backward's result ([Grad, Grad] for grad of grad,
    [Grad, Vmap] for jacrev of jacrev)."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    kinds = [i.key() for i in retrieve_all_functorch_interpreters()]
    differentiating = (TransformType.Grad, TransformType.Jvp)
    n = sum(k in differentiating for k in kinds)
    return n - 1 if kinds and kinds[-1] in differentiating else n


def first_order(backward):
    """backward run without recording autograd; under create_graph, its
    gradients raise when differentiated if any incoming gradient or saved
    input requires grad (Note [first-order gradients])."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.compiler.is_compiling():
            # Traced by dynamo (an autograd.Function inside a compiled region: the Linear +
            # activation epilogue): the functorch checks below cannot be traced, and a compiled
            # graph takes no second derivative of it anyway.
            with torch.no_grad():
                return backward(ctx, *grads)
        if _functorch_stack() is not None:
            # torch.func's grad always differentiates with create_graph, and its tensors cannot be
            # marked (requires_grad_ is refused inside a transform). A backward run inside an
            # outer differentiating level (grad of grad, jacrev of jacrev: a Hessian, a gradient
            # penalty) is being differentiated again: refused here (it gave zeros, silently).
            if _outer_differentiating_levels() >= 1:
                raise RuntimeError(_SECOND_ORDER.decode() + " (torch.func: a grad of a grad)")
            # Recorded, not under no_grad (which would hide it from every level): a vjp's
            # backward runs at an outer grad's level, which the stack does not tell from a
            # plain grad; the backward ops' refusal (Note [backward ops refuse to be
            # differentiated]) raises if that level differentiates them.
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        saved = getattr(ctx, "saved_tensors", ())
        anchors = [t for t in (*grads, *saved) if isinstance(t, Tensor) and t.requires_grad]
        if not anchors:
            return outputs
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        err = _autograd_functions.DelayedError(_SECOND_ORDER, len(outputs))
        # The marked gradients hang off every anchor through an exact 0 (an
        # empty slice's sum): autograd.grad(..., inputs=params) prunes what
        # does not reach its inputs, so a mark on a fresh leaf never fired
        # there and the second-order terms were silently left out.
        link = sum(a.unsqueeze(0)[:0].sum() for a in anchors)  # views: no copy of a strided anchor
        marked = err(*[None if o is None else o.detach() + link.to(o.dtype) for o in outputs])
        marked = marked if isinstance(marked, tuple) else (marked,)
        return marked[0] if single else marked

    return wrapper


def _register_autograd(name, impl, op, backward, setup_context):
    """What torch.library.register_autograd registers, behind the Autograd
    kernel's checks (Note [the autograd key's direct lane], Note
    [forward-mode AD])."""
    if _make_autograd_impl is None:
        torch.library.register_autograd(f"tensor_ops::{name}", backward, setup_context=setup_context, lib=_LIB)
        return
    TORCH_AUTOGRAD[name] = _make_autograd_impl(op, _AutogradInfo(backward, setup_context))
    _LIB.impl(name, _autograd_kernel(name, LOWERED.get(name), _defaults(impl)), "Autograd", with_keyset=True)


# Note [inference tensors saved for backward]
# An input made under torch.inference_mode (a frozen backbone's features)
# cannot be saved for backward; an op whose gradient is wanted for another
# input (a trainable RMSNorm head's weight) saved it and raised "Inference
# tensors cannot be saved for backward", where torch's composite RMSNorm
# saves what it computed and trains. setup_context saves a copy of such an
# input instead (a plain tensor, made outside inference mode); every other
# call pays one is_inference() per tensor input.
_is_inference = Tensor.is_inference


def _inference_safe(setup_context):
    def setup(ctx, inputs, output):
        for a in inputs:
            if isinstance(a, Tensor) and _is_inference(a):
                inputs = tuple(b.clone() if isinstance(b, Tensor) and _is_inference(b) else b for b in inputs)
                break
        setup_context(ctx, inputs, output)

    return setup


def _register(impl, fake, setup_context=None, backward=None):
    """torch.ops.tensor_ops.<impl name> with its fake kernel and, given a
    backward, its autograd and the matching autograd.Function."""
    name = impl.__name__
    if setup_context is not None:
        setup_context = _inference_safe(setup_context)  # Note [inference tensors saved for backward]
    qualname = f"tensor_ops::{name}"
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=()))
    lowered = LOWERED.get(name)
    kernel = _direct_first(impl, lowered)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=_LIB)
    op = getattr(torch.ops.tensor_ops, name).default
    OPS[name] = op
    setattr(TRACED, name, op)
    setattr(DIRECT, name, impl)
    if backward is None:
        _register_refusal(name, impl, kernel, op)
        return
    traced_backward = first_order(functools.partial(backward, k=TRACED))  # Note [first-order gradients]
    _register_autograd(name, impl, op, traced_backward, setup_context)

    def forward(ctx, *args):  # ctx-style: ~9 us cheaper per call than a separate setup_context
        output = kernel(*args)
        setup_context(ctx, args, output)
        return output

    direct_backward = staticmethod(first_order(functools.partial(backward, k=DIRECT)))
    FUNCTIONS[name] = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": direct_backward})
    # The same Function with a separate setup_context, which torch.func's
    # transforms (grad, jacrev, vjp) require: functional takes it only
    # while one is active (Note [torch.func]).
    # It runs the custom ops, forward and backward, which functorch
    # unwraps or batches (the plain kernels cannot read its wrappers), so
    # torch can make its vmap rule (vmap of grad: per-sample gradients).
    FUNCTIONS_FUNC[name] = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(functools.partial(_call, op)), "generate_vmap_rule": True,
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(first_order(functools.partial(backward, k=FUNC)))})
    setattr(FUNC, name, FUNCTIONS_FUNC[name].apply)


def _call(op, *args):
    return op(*args)


# Note [backward ops refuse to be differentiated]
# The backward ops (rms_norm_backward, ...) have no derivative of their own.
# Registered without autograd, torch let their outputs through with no
# grad_fn when an input required grad (its fallback only warns), and
# torch.func recorded nothing for them: a grad of a vjp (a Hessian-vector
# product through our backward kernels) came out as zeros, silently. Each
# now has an autograd whose backward raises (torch's once_differentiable
# does the same): called where a gradient is recorded, its outputs require
# grad and differentiating them raises; the forward runs as before.
#
# torch.compile traces a joint forward + backward graph, whose backward runs
# for every output that requires grad whether the loss used it or not (its
# incoming gradient then 0): there the refusal is an op,
# second_order_refused, which returns zeros for zero incoming gradients (the
# chain rule's exact contribution) and raises at run time otherwise.
def _refusal_message(name):
    return (f"tensor_ops: {name}'s output was differentiated, but {name} has no derivative of its own "
            f"(a second derivative through this op's backward kernel, with create_graph=True or torch.func, "
            f"is not computed either); run this part of the model on torch's own ops")


def _refuse(name):
    def backward(ctx, *grads):
        given = [g for g in grads if g is not None]
        if torch.compiler.is_compiling() or any(_is_fake(g) for g in given):
            return tuple(None if meta is None else
                         torch.ops.tensor_ops.second_order_refused(given, meta[0], meta[1], name)
                         for meta in ctx.tensor_inputs)
        if _functorch_stack() is not None:  # torch.func (a vmap cannot look at the values)
            raise RuntimeError(_refusal_message(name))
        # Eager as compiled: exactly zero incoming gradients contribute zeros (0 * d.sum() in a loss).
        return tuple(None if meta is None else second_order_refused(given, meta[0], meta[1], name)
                     for meta in ctx.tensor_inputs)
    return backward


def _is_fake(t):
    return isinstance(t, Tensor) and type(t) is not Tensor and "Fake" in type(t).__name__


def _input_metas(ctx, inputs, output):
    ctx.tensor_inputs = [(t.shape, t.dtype) if isinstance(t, Tensor) else None for t in inputs]


def second_order_refused(grads: List[Tensor], shape: List[int], dtype: torch.dtype, op: str) -> Tensor:
    """The gradient of a backward op's input in a compiled graph: zeros
    when every incoming gradient is 0, else the refusal (Note [backward
    ops refuse to be differentiated])."""
    if any(bool(g.any()) for g in grads):
        raise RuntimeError(_refusal_message(op))
    return torch.zeros(shape, dtype=dtype, device=grads[0].device if grads else None)


_LIB.define("second_order_refused(Tensor[] grads, SymInt[] shape, ScalarType dtype, str op) -> Tensor")
_LIB.impl("second_order_refused", second_order_refused, "CompositeExplicitAutograd")
torch.library.register_fake(
    "tensor_ops::second_order_refused",
    lambda grads, shape, dtype, op: torch.empty(shape, dtype=dtype, device=grads[0].device if grads else None),
    lib=_LIB)


def _register_refusal(name, impl, kernel, op):
    refuse = _refuse(name)
    _register_autograd(name, impl, op, refuse, _input_metas)

    def forward(ctx, *args):
        _input_metas(ctx, args, None)
        return kernel(*args)

    FUNCTIONS[name] = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(refuse)})
    FUNCTIONS_FUNC[name] = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(functools.partial(_call, op)), "generate_vmap_rule": True,
        "setup_context": staticmethod(_input_metas), "backward": staticmethod(refuse)})
    setattr(FUNC, name, FUNCTIONS_FUNC[name].apply)


def _c(t):
    if t is None:
        return None
    if not isinstance(t, Tensor):  # F.layer_norm's order (normalized_shape second) gave AttributeError
        raise ArgumentTypeError(f"expected a torch.Tensor, got {type(t).__name__} {t!r:.60}; tensor_ops.torch's ops "
                                f"take tensors where torch.nn.functional may take shapes (layer_norm(x, weight, "
                                f"bias, eps), rms_norm(x, weight, eps))")
    return t.contiguous()


def _like(x):
    return x.new_empty(x.shape)


# Note [elementwise layouts]: torch's activations keep a dense input's
# layout (channels_last conv activations, a transposed matrix); ours copied
# such input to row-major and returned row-major, so a prepared conv net lost
# channels_last after its first GELU. A dense input in another order of its
# dims is now run as the contiguous permutation it is, and the output
# permuted back: x's strides, no copy. The fake kernels give the same.
def _dense_order(x):
    """The order of x's dims, outermost first, that makes it contiguous, when x
    is a dense layout other than row-major; None otherwise."""
    if x.is_contiguous() or x.dim() < 2:
        return None
    order = sorted(range(x.dim()), key=lambda i: (-x.stride(i), -x.shape[i]))
    return order if x.permute(order).is_contiguous() else None


def _elementwise(fn, x, *args):
    order = _dense_order(x)
    if order is None:
        return fn(_c(x), *args)
    return fn(x.permute(order), *args).permute([order.index(i) for i in range(x.dim())])


def _elementwise_like(x):
    order = _dense_order(x)
    if order is None:
        return _like(x)
    xp = x.permute(order)
    return xp.new_empty(xp.shape).permute([order.index(i) for i in range(x.dim())])


def _softmax_like(y, dim):
    return _like(y)  # row-major, as torch's softmax along any dim (Note [softmax along an inner dim])


def _loss_like(logits, reduction):
    shape = logits.shape[:1] if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32)


# ---- backward kernels (ops of their own, so compiled backward graphs call them)

def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float = 1e-6,
                      offset: float = 0.0) -> Tuple[Tensor, Tensor]:
    return _to.rms_norm_backward(_c(dy), _c(x), _c(weight), eps, offset=offset)


def layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias); dbias is computed whether or not there is a bias."""
    return _to.layer_norm_backward(_c(dy), _c(x), _c(weight), eps, bias=True)


def silu_backward(dy: Tensor, x: Tensor) -> Tensor:
    return _to.silu_backward(_c(dy), _c(x))


def gelu_backward(dy: Tensor, x: Tensor, approximate: str = "none") -> Tensor:
    return _to.gelu_backward(_c(dy), _c(x), approximate)


def swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    return _to.swiglu_backward(_c(dy), _c(gate), _c(up))


def geglu_backward(dy: Tensor, gate: Tensor, up: Tensor, approximate: str = "none") -> Tuple[Tensor, Tensor]:
    return _to.geglu_backward(_c(dy), _c(gate), _c(up), approximate)


def softmax_backward(dy: Tensor, y: Tensor, dim: int = -1, scale: float = 1.0) -> Tensor:
    return _row_major(_to.softmax_backward(_c(dy), _c(y), dim, scale))


def log_softmax_backward(dy: Tensor, y: Tensor, dim: int = -1, scale: float = 1.0) -> Tensor:
    return _row_major(_to.log_softmax_backward(_c(dy), _c(y), dim, scale))


def rope_backward(dy: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor] = None,
                  interleaved: bool = False) -> Tensor:
    return _to.rope_backward(_c(dy), _c(cos), _c(sin), _c(positions), interleaved)


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       causal: bool = False, scale: Optional[float] = None,
                       causal_alignment: str = "bottom_right") -> Tuple[Tensor, Tensor, Tensor]:
    return _to.attention_backward(_c(dout), _c(q), _c(k), _c(v), _c(out), _c(lse), causal, scale,
                                  causal_alignment=causal_alignment)


_register(rms_norm_backward, lambda dy, x, weight, eps=1e-6, offset=0.0: (_like(x), _like(weight)))
_register(layer_norm_backward, lambda dy, x, weight, eps=1e-5: (_like(x), _like(weight), _like(weight)))
_register(silu_backward, lambda dy, x: _like(x))
_register(gelu_backward, lambda dy, x, approximate="none": _like(x))
_register(swiglu_backward, lambda dy, gate, up: (_like(gate), _like(gate)))
_register(geglu_backward, lambda dy, gate, up, approximate="none": (_like(gate), _like(gate)))
_register(softmax_backward, lambda dy, y, dim=-1, scale=1.0: _softmax_like(y, dim))
_register(log_softmax_backward, lambda dy, y, dim=-1, scale=1.0: _softmax_like(y, dim))
_register(rope_backward, lambda dy, cos, sin, positions=None, interleaved=False: _like(dy))
_register(attention_backward,
          lambda dout, q, k, v, out, lse, causal=False, scale=None, causal_alignment="bottom_right":
          (_like(q), _like(k), _like(v)))


# ---- forward ops, each with its setup_context and backward

def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """x / sqrt(mean(x**2) + eps) * (offset + weight) (Gemma's 1 + w: offset 1.0)."""
    return _to.rms_norm(_c(x), _c(weight), eps, offset=offset)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_bwd(ctx, dy, k):
    # d(offset + w)/dw = 1: the kernel's dweight is the weight's gradient as it is.
    x, weight = ctx.saved_tensors
    dx, dw = k.rms_norm_backward(dy, x, weight, ctx.eps, ctx.offset)
    return dx, dw, None, None


_register(rms_norm, lambda x, weight, eps=1e-6, offset=0.0: _like(x), _rms_norm_setup, _rms_norm_bwd)


def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    return _to.layer_norm(_c(x), _c(weight), _c(bias), eps)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.has_bias = eps, bias is not None


def _layer_norm_bwd(ctx, dy, k):
    x, weight = ctx.saved_tensors
    dx, dw, db = k.layer_norm_backward(dy, x, weight, ctx.eps)
    return dx, dw, (db if ctx.has_bias else None), None


_register(layer_norm, lambda x, weight, bias=None, eps=1e-5: _like(x), _layer_norm_setup, _layer_norm_bwd)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """(rms_norm(x + residual, weight), x + residual) in one pass."""
    return _to.add_rms_norm(_c(x), _c(residual), _c(weight), eps)


def _add_rms_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[2])  # the sum the norm read, and the weight
    ctx.eps = inputs[3]


def _add_rms_norm_bwd(ctx, dy, dsum, k):
    s, weight = ctx.saved_tensors
    ds, dw = k.rms_norm_backward(dy, s, weight, ctx.eps)
    if dsum is not None:
        ds = ds + dsum
    return ds, ds, dw, None


_register(add_rms_norm, lambda x, residual, weight, eps=1e-6: (_like(x), _like(x)), _add_rms_norm_setup,
          _add_rms_norm_bwd)


def silu(x: Tensor) -> Tensor:
    return _elementwise(_to.silu, x)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return _elementwise(_to.gelu, x, approximate)


def _activation_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1] if len(inputs) > 1 else None


def _silu_bwd(ctx, dy, k):
    return k.silu_backward(dy, ctx.saved_tensors[0])


def _gelu_bwd(ctx, dy, k):
    return k.gelu_backward(dy, ctx.saved_tensors[0], ctx.approximate), None


_register(silu, lambda x: _elementwise_like(x), _activation_setup, _silu_bwd)
_register(gelu, lambda x, approximate="none": _elementwise_like(x), _activation_setup, _gelu_bwd)


# Note [softmax along an inner dim]: the op layer moves dim last, runs the
# kernel and moves it back: a view whose strides are not row-major, where
# torch's softmax returns a row-major tensor, so code that views the result
# (softmax(x, 1).view(...)) raised. The torch ops return it row-major (one
# copy, for an inner dim only).
def _row_major(y):
    return y.contiguous()


def softmax(x: Tensor, dim: int = -1, scale: float = 1.0, causal: bool = False) -> Tensor:
    """softmax(scale * x) along dim; causal masks [..., i, j] for j > i + cols - rows."""
    return _row_major(_to.softmax(_c(x), dim, scale, causal))


def log_softmax(x: Tensor, dim: int = -1, scale: float = 1.0, causal: bool = False) -> Tensor:
    return _row_major(_to.log_softmax(_c(x), dim, scale, causal))


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.dim, ctx.scale = inputs[1], inputs[2]
    ctx.causal = len(inputs) > 3 and inputs[3]


def _softmax_bwd(ctx, dy, k):
    return k.softmax_backward(dy, ctx.saved_tensors[0], ctx.dim, ctx.scale), None, None, None


def _log_softmax_bwd(ctx, dy, k):
    y = ctx.saved_tensors[0]
    dx = k.log_softmax_backward(dy, y, ctx.dim, ctx.scale)
    if ctx.causal:
        # dy - e^y sum(dy) is dy where y is the mask's -inf: the masked columns get no gradient, as
        # torch's masked_fill(-inf) then log_softmax (softmax's backward is 0 there by itself).
        rows, cols = (y.shape[-2] if y.dim() > 1 else 1), y.shape[-1]
        masked = torch.ones(rows, cols, dtype=torch.bool, device=y.device).triu(cols - rows + 1)
        dx = torch.where(masked, torch.zeros((), dtype=dx.dtype, device=dx.device), dx)
    return dx, None, None, None


_register(softmax, lambda x, dim=-1, scale=1.0, causal=False: _softmax_like(x, dim), _softmax_setup, _softmax_bwd)
_register(log_softmax, lambda x, dim=-1, scale=1.0, causal=False: _softmax_like(x, dim), _softmax_setup,
          _log_softmax_bwd)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up in one pass."""
    return _to.swiglu(_c(gate), _c(up))


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """gelu(gate) * up in one pass."""
    return _to.geglu(_c(gate), _c(up), approximate)


def _glu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2] if len(inputs) > 2 else None


def _swiglu_bwd(ctx, dy, k):
    return k.swiglu_backward(dy, *ctx.saved_tensors)


def _geglu_bwd(ctx, dy, k):
    return (*k.geglu_backward(dy, *ctx.saved_tensors, ctx.approximate), None)


_register(swiglu, lambda gate, up: _like(gate), _glu_setup, _swiglu_bwd)
_register(geglu, lambda gate, up, approximate="none": _like(gate), _glu_setup, _geglu_bwd)


def rope(x: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor] = None,
         interleaved: bool = False) -> Tensor:
    """Rotary embedding of x [batch, seq, heads, head_dim] with cos/sin tables
    [max_position, rotary_dim / 2]. The tables get no gradient."""
    return _to.rope(_c(x), _c(cos), _c(sin), _c(positions), interleaved)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, positions, interleaved = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.interleaved = interleaved


def _rope_bwd(ctx, dy, k):
    cos, sin, positions = ctx.saved_tensors
    return k.rope_backward(dy, cos, sin, positions, ctx.interleaved), None, None, None, None


_register(rope, lambda x, cos, sin, positions=None, interleaved=False: _like(x), _rope_setup, _rope_bwd)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None,
              causal_alignment: str = "bottom_right") -> Tuple[Tensor, Tensor]:
    """(softmax(scale * q k^T) v, float32 log-sum-exp [batch, heads, seq]),
    layout [batch, heads, seq, head_dim], grouped-query k/v allowed;
    causal_alignment "bottom_right" or "top_left" (tensor_ops.attention's)."""
    return _to.attention(_c(q), _c(k), _c(v), causal, scale, return_lse=True, causal_alignment=causal_alignment)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, alignment = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.alignment = causal, scale, alignment
    ctx.mark_non_differentiable(lse)


def _attention_bwd(ctx, dout, dlse, k):
    q, k_, v, out, lse = ctx.saved_tensors
    return (*k.attention_backward(dout, q, k_, v, out, lse, ctx.causal, ctx.scale, ctx.alignment), None, None, None)


_register(attention,
          lambda q, k, v, causal=False, scale=None, causal_alignment="bottom_right":
          (_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)),
          _attention_setup, _attention_bwd)


# Note [the log-sum-exp's gradient]
# attention's lse output records no gradient of its own (the kernels' backward
# takes dout only; a model's attention never reads it). A caller who asks for
# it (functional.attention(..., return_lse=True)) may use it: merging partial
# attentions over key blocks (ring / flash-decoding style), a z-loss. Its term
# was silently dropped from their gradients. So such a call's lse goes through
# LseGrad: the same values forward, and backward dlse's gradients in torch's
# ops, d lse_i = sum_j P_ij d s_ij with s = scale q k^T: dq = scale (dlse P) k,
# dk = scale (dlse P)^T q, summed over each kv head's query heads. P is
# recomputed from q, k and lse (O(Lq Lk) memory per head: only when lse's
# gradient is asked for; a None / unused lse costs nothing).
class LseGrad(torch.autograd.Function):
    @staticmethod
    def forward(lse, q, k, mode, scale):
        return lse.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        lse, q, k, mode, scale = inputs
        ctx.save_for_backward(lse, q, k)
        ctx.mode, ctx.scale = mode, scale
        ctx.set_materialize_grads(False)

    generate_vmap_rule = True

    @staticmethod
    def backward(ctx, dlse):  # torch's ops: differentiable again (create_graph) as they are
        if dlse is None:
            return None, None, None, None, None
        lse, q, k = ctx.saved_tensors
        g = q.shape[1] // k.shape[1]
        qf, kf = q.float(), k.float().repeat_interleave(g, 1)
        s = torch.matmul(qf, kf.transpose(-1, -2)) * ctx.scale
        if ctx.mode:
            s = s.masked_fill(~_causal_keep(s.shape[-2], s.shape[-1], s.device, ctx.mode), float("-inf"))
        # P as the softmax of s itself (not exp(s - lse): the saved lse is a constant to autograd, and a
        # second derivative through this backward dropped its dependence on q and k); a row with no key
        # (lse -inf) has P 0
        seen = torch.isfinite(lse)[..., None]
        p = torch.where(seen, torch.softmax(torch.where(seen, s, 0.0), -1), 0.0)
        w = p * dlse.float()[..., None]
        dq = torch.matmul(w, kf) * ctx.scale
        dk = torch.matmul(w.transpose(-1, -2), qf) * ctx.scale
        dk = dk.view(k.shape[0], k.shape[1], g, *dk.shape[2:]).sum(2)
        return None, dq.to(q.dtype), dk.to(k.dtype), None, None


def lse_with_gradient(lse, q, k, causal, scale, causal_alignment):
    """lse as LseGrad gives it (Note [the log-sum-exp's gradient])."""
    mode = _CAUSAL_MODES[causal_alignment] if causal else 0
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    return LseGrad.apply(lse, q, k, mode, float(scale))


# Note [ignored rows at an infinite loss scale]
# torch's cross-entropy backward leaves an ignored row's gradient at exactly
# 0 whatever the incoming gradient; ours scales the forward's gradient (0 on
# those rows) by it, and 0 * inf is NaN. An infinite incoming gradient is
# real: HF divides the summed loss by num_items_in_batch, 0 for a batch (or a
# gradient-accumulation window) with every label ignored, where HF's loss is
# NaN but its gradients are 0; ours were NaN, and one AdamW step wrote NaN
# into every parameter. So where the scale is not finite, exact zeros stay 0
# (a gradient entry is exactly 0 only on ignored rows, or where torch's is
# NaN or 0 too). Eager calls look at the scale first (on a device, one sync):
# a finite one scales as before, in place where the gradient is private.
def loss_scaled(grad, g, private: bool = False):
    """grad * g (g a scalar or broadcastable tensor of grad's dtype), zeros
    kept 0 where g is not finite (Note [ignored rows at an infinite loss
    scale]); private: grad is this backward's own, scaled in place."""
    if type(g) is float:
        if math.isfinite(g):
            return grad.mul_(g) if private else grad * g
        return torch.where(grad != 0, grad * g, 0.0)
    # Traced, the select is fused into the product by the compiler; eager, only an infinite scale takes it
    # (a private [V, H] weight gradient of the fused loss is scaled in place: no second copy).
    if (type(g) is torch.Tensor and not torch.compiler.is_compiling() and not _dispatch_modes()
            and _functorch_stack() is None and bool(torch.isfinite(g).all())):  # vmap: no bool()
        return grad.mul_(g) if private else grad * g
    return torch.where(grad != 0, grad * g, 0.0)


def _scaled(dlogits, dloss, reduction, private):
    """The forward's dlogits times the incoming gradient of the loss. Eager
    (a plain tensor, not traced) on the CPU, a reduced loss's gradient of exactly 1 (a
    plain loss.backward()) hands dlogits back as it is, and a private dlogits
    (made by this backward, seen by no caller) is scaled in place: either
    way no second [N, C] buffer and no extra pass over it."""
    if (type(dloss) is torch.Tensor and reduction != "none" and dloss.device.type == "cpu" and dloss.numel() == 1
            and not torch.compiler.is_compiling() and _functorch_stack() is None):  # vmap: no float()
        g = float(dloss)
        if g == 1.0:
            return dlogits
        return loss_scaled(dlogits, g, private)
    g = dloss.to(dlogits.dtype)
    return loss_scaled(dlogits, g[:, None] if reduction == "none" else g)


# Cross-entropy's options after (logits, target): ignore_index, reduction,
# label_smoothing, z_loss, softcap (tensor_ops.cross_entropy's meanings).
_CE_NONES = (None,) * 6


def cross_entropy_with_grad(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                            label_smoothing: float = 0.0, z_loss: float = 0.0,
                            softcap: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """(float32 loss, dlogits): the gradient of the reduced loss, written in
    the forward pass while each row is in cache."""
    loss, dlogits = _to.cross_entropy_with_grad(_c(logits), _c(target), ignore_index, reduction,
                                                label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    return torch.as_tensor(loss), dlogits


def _ce_with_grad_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.reduction = inputs[3]
    ctx.mark_non_differentiable(output[1])


def _ce_with_grad_bwd(ctx, dloss, _, k):
    return _scaled(ctx.saved_tensors[0], dloss, ctx.reduction, private=False), *_CE_NONES


_register(cross_entropy_with_grad,
          lambda logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None:
          (_loss_like(logits, reduction), _like(logits)),
          _ce_with_grad_setup, _ce_with_grad_bwd)


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None) -> Tensor:
    """The float32 loss alone. tensor_ops.torch.cross_entropy calls
    cross_entropy_with_grad instead whenever logits need a gradient; called
    directly with grad, this op's backward runs the fused kernel again."""
    return torch.as_tensor(_to.cross_entropy(_c(logits), _c(target), ignore_index, reduction,
                                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap))


def _ce_setup(ctx, inputs, output):
    logits, target, *options = inputs
    ctx.save_for_backward(logits, target)
    ctx.options = options


def _ce_bwd(ctx, dloss, k):
    logits, target = ctx.saved_tensors
    _, dlogits = k.cross_entropy_with_grad(logits, target, *ctx.options)
    if k is FUNC:  # torch.func: dlogits is not differentiable; an outer level differentiating it raises
        dlogits = _NoDerivative.apply(dlogits, logits)
    return _scaled(dlogits, dloss, ctx.options[1], private=True), *_CE_NONES


class _NoDerivative(torch.autograd.Function):
    """value, recorded as depending on anchor: differentiating it raises
    (Note [backward ops refuse to be differentiated]): cross-entropy's
    dlogits under torch.func, where a grad of a vjp gave zeros."""
    generate_vmap_rule = True

    @staticmethod
    def forward(value, anchor):
        return value.clone()

    setup_context = staticmethod(_input_metas)
    backward = staticmethod(_refuse("cross_entropy's gradient"))


_register(cross_entropy,
          lambda logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None:
          _loss_like(logits, reduction),
          _ce_setup, _ce_bwd)


# Note [the gradient handed over]: the custom op cross_entropy_with_grad
# returns dlogits and saves it for the backward, so when autograd
# accumulates it into logits.grad it is still referenced, and AccumulateGrad
# copies it: a second [N, C] buffer and a pass over it ([4096, 32000] fp32,
# 2 threads, Xeon: the backward took 113 ms, 128k page faults, for the
# copy). In eager mode cross_entropy's Function runs the fused kernel
# instead, returns the loss alone and keeps dlogits as a plain attribute,
# which its backward lets go of: autograd gets the only reference, and
# logits.grad is the forward's buffer (backward 0.2 ms). A second backward
# through a retained graph finds it gone and computes it again from the
# saved inputs (references, no copy). Traced graphs use the custom op.
class _CrossEntropyFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, *options):
        loss, dlogits = cross_entropy_with_grad(logits, target, *options)
        ctx.save_for_backward(logits, target)
        ctx.options, ctx.dlogits = options, dlogits
        return loss

    @staticmethod
    @first_order  # Note [first-order gradients]
    def backward(ctx, dloss):
        dlogits, ctx.dlogits = ctx.dlogits, None
        again = dlogits is None
        if again:  # a retained graph's second backward
            logits, target = ctx.saved_tensors
            dlogits = cross_entropy_with_grad(logits, target, *ctx.options)[1]
        return _scaled(dlogits, dloss, ctx.options[1], private=again), *_CE_NONES


FUNCTIONS["cross_entropy"] = _CrossEntropyFused


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, weight_layout: str = "nk") -> Tensor:
    """x @ weight.T + bias (F.linear; weight [N, K]) or, weight_layout "kn",
    x @ weight + bias (weight [K, N], transformers' Conv1D) on our kernel:
    made for a few rows of x (decode), fp32 accumulation, the same bits on
    any thread count."""
    return _to.linear(_c(x), _c(weight), _c(bias), weight_layout=weight_layout)


def _linear_fake(x, weight, bias=None, weight_layout="nk"):
    return x.new_empty((*x.shape[:-1], weight.shape[1 if weight_layout == "kn" else 0]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, *layout = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.kn = bool(layout) and layout[0] == "kn"


def _linear_bwd(ctx, dy, k):
    # torch's GEMMs: the gradients are GEMMs over every row, not few-row products. dw in weight's
    # own layout ([N, K], or [K, N] for "kn").
    x, weight = ctx.saved_tensors
    n = weight.shape[1 if ctx.kn else 0]
    dy2 = dy.reshape(-1, n)
    x2 = x.reshape(-1, x.shape[-1])
    if ctx.kn:
        dx, dw = dy2 @ weight.t(), x2.t() @ dy2
    else:
        dx, dw = dy2 @ weight, dy2.t() @ x2
    return dx.view(x.shape), dw, (dy2.sum(0) if ctx.has_bias else None), None


_register(linear, _linear_fake, _linear_setup, _linear_bwd)
