"""Hugging Face transformers models on tensor_ops kernels, whole.

Two ways in, in the conventions HF users know (Liger-Kernel's are the anchor):
- a loaded model: prepare_model(model, "O1") (which calls prepare_hf_model
  here), or apply_tensor_ops_kernel_to_<family>(..., model=model);
- before loading: apply_tensor_ops_kernel_to_<family>(rope=..., rms_norm=...,
  swiglu=..., cross_entropy=..., fused_linear_cross_entropy=...) patches the
  family's modeling module, so every model built afterwards (from_config,
  from_pretrained) is built from our classes; AutoTensorOpsKernelForCausalLM
  .from_pretrained does that from the checkpoint's model_type.

What runs where:
- norms: HF's RMSNorm classes (Gemma's x / rms * (1 + weight) too) become
  subclasses of themselves whose forward is our rms_norm kernel (same object,
  same Parameter: optimizers, state_dict and isinstance checks keep working).
  Note [Gemma's offset]: the rms_norm kernel takes the offset (offset=1.0)
  and forms 1 + weight in float32 per element, as Gemma's own forward does
  (x.float() * rstd * (1.0 + weight.float()), then x's dtype): nothing is
  materialised per call, and a bf16 model no longer rounds 1 + weight to bf16
  first (which it did when the offset was added here). The weight is passed
  as it is when its dtype is x's (the usual case), else cast to x's dtype.
- gated MLPs (LlamaMLP-like; Phi3MLP's fused gate_up_proj) run act(gate) * up
  in one swiglu / geglu kernel; dense + activation pairs (GPT-NeoX, BERT,
  GPT-2's Conv1D) run as one Linear + activation epilogue (fused_linear) in
  their MLP's forward (Note [fused at the parent]);
  standalone activations run our silu / gelu (erf or tanh, as the module's own
  approximation: NewGELU / FastGELU / GELUTanh are the tanh form, GELUActivation
  the erf form).
- RoPE: on a loaded model, that model's attention modules call ours instead
  of the family's module-level apply_rotary_pos_emb (their class becomes a
  same-named subclass whose forward reads a copy of the module's globals,
  Note [RoPE per model]); every other model in the process keeps HF's. The
  class patch before loading replaces the module-level function itself,
  process-wide, as Liger does (until revert_tensor_ops_kernel). Partial
  rotary (GPT-NeoX, Phi-3) passes the tail dims through.
- attention: registered as "tensor_ops" in transformers' AttentionInterface
  (masks built by HF's own sdpa mask function), and the model's
  config._attn_implementation set to it, so KV caches, padding and sliding
  window masks and GQA are HF's as before. No mask: our flash attention
  kernel; a mask, dropout or a logit softcap (Gemma 2): scores by torch's
  matmul in float32, our softmax. What we cannot run (output_attentions,
  paged caches, T5 position bias, sinks, head_dim mismatch) goes per call to
  the family's own eager attention, counted in ATTENTION_FALLBACKS and logged
  once per reason. Half-precision calls with more than one query on a CPU
  whose torch has native half GEMMs go to HF's own SDPA (Note [native half
  attention]).
- loss: *ForCausalLM.forward wrapped: with labels, the loss through our
  cross_entropy (logits kept) or, with fused_linear_cross_entropy in training
  mode, through fused_linear_cross_entropy from the last hidden states, so
  the [tokens, vocab] logits and their gradient never exist (logits=None, as
  Liger)."""
from __future__ import annotations

import collections
import copyreg
import dataclasses
import functools
import importlib
import inspect
import logging
import re
import sys
import types
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised without transformers only
    raise ImportError("tensor_ops.torch.hf needs transformers: pip install 'tensor_ops[hf]' "
                      f"(or pip install transformers): {e}") from e

from tensor_ops import _C

from . import functional as ops
from . import modules, swap_check
from .flash_attention import _additive, scaled_dot_product_attention
from .fused_linear import hooked, linear_activation, plain_linear_layout, torch_activation_kind
from .linear_cross_entropy import fused_linear_cross_entropy as _flce

_log = logging.getLogger("tensor_ops")
_selected_backend = _C.selected_backend  # the backend host tensors run on now

ATTENTION = "tensor_ops"
# reason -> calls that went to the family's eager attention instead of ours.
ATTENTION_FALLBACKS: collections.Counter = collections.Counter()
_logged_reasons: set = set()

# ---------------------------------------------------------------- activations

# HF activation classes (transformers.activations) by name -> our activation.
HF_ACTIVATIONS = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
                  "PytorchGELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh", "SiLUActivation": "silu"}


def activation_kind(act: Optional[nn.Module]) -> Optional[str]:
    """'silu', 'gelu' (erf) or 'gelu_tanh' for an activation module we have a
    kernel for, else None."""
    if act is None:
        return None
    if getattr(act, "_tensor_ops_act", None):
        return act._tensor_ops_act
    kind = torch_activation_kind(act)
    if kind is not None:
        return kind
    # The class whose function is named must also be the one whose forward runs: a subclass with a
    # forward of its own computes something else.
    forward = type(act).forward
    for cls in type(act).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ in HF_ACTIVATIONS:
            return HF_ACTIVATIONS[cls.__name__] if forward is cls.forward else None
    return None


def _act(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return ops.silu(x)
    return ops.gelu(x, "tanh" if kind == "gelu_tanh" else "none")


def _glu(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return ops.swiglu(gate, up)
    return ops.geglu(gate, up, "tanh" if kind == "gelu_tanh" else "none")


# ------------------------------------------------------- subclasses of HF's own

@modules.torch_for_other_dtypes
def _activation_forward(self, x):
    return _act(x, self._tensor_ops_act)


@modules.torch_for_other_dtypes
def _rms_norm_forward(self, x):
    return modules.hf_rms_norm(x, self.weight, self.variance_epsilon)


@modules.torch_for_other_dtypes
def _offset_rms_norm_forward(self, x):
    # Note [Gemma's offset]: the kernel forms 1 + weight in float32, as Gemma's own forward.
    return ops.rms_norm(x, self.weight.to(x.dtype), self.eps, 1.0)


@modules.torch_for_other_dtypes
def _eps_rms_norm_forward(self, x):
    # Gemma 3n / Gemma 4's RMSNorm: Gemma's eps attribute and fp32 arithmetic, weight without the offset.
    return ops.rms_norm(x, self.weight.to(x.dtype), self.eps)


def _gated_mlp(m, x, kind: str):
    return m.down_proj(_glu(m.gate_proj(x), m.up_proj(x), kind))


@modules.torch_for_other_dtypes
def _gated_mlp_forward(self, x):
    return _gated_mlp(self, x, self._tensor_ops_act)


def _gate_up_mlp(m, x, kind: str):
    gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
    return m.down_proj(_glu(gate, up, kind))


@modules.torch_for_other_dtypes
def _gate_up_mlp_forward(self, x):
    return _gate_up_mlp(self, x, self._tensor_ops_act)


# What the plain forms' forwards read (Note [checked swaps]): HF's LlamaMLP and Phi3MLP.
_GATED_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})
_GATE_UP_NAMES = frozenset({"gate_up_proj", "chunk", "activation_fn", "down_proj"})


_SUBCLASSES: Dict[tuple, type] = {}


def _subclass(cls: type, forward: Callable, what: str) -> type:
    """TensorOps<cls> deriving from cls, with our forward (cached: one class per (cls, forward))."""
    key = (cls, forward)
    sub = _SUBCLASSES.get(key)
    if sub is None:
        sub = type(f"TensorOps{cls.__name__}", (cls,),
                   {"forward": forward, "__module__": __name__, "_tensor_ops_kind": what,
                    "__reduce_ex__": _subclass_reduce_ex, "__doc__": f"{cls.__name__} on tensor_ops kernels ({what})."})
        _SUBCLASSES[key] = sub
    return sub


def _subclass_instance(cls: type, forward: Callable, what: str, *args):
    """An instance of _subclass(cls, forward, what), made as pickle makes one (state set after)."""
    register_attention()  # a prepared model's config names our attention (registered on import too)
    sub = _subclass(cls, forward, what)
    return sub.__new__(sub, *args)


def _subclass_reduce_ex(self, protocol):
    # A _subclass class is made at run time and cannot be found by name: pickled as the class it
    # derives from and our forward (a function of this module), made again on load (torch.save of
    # a prepared model; copy.deepcopy goes this way too).
    rv = object.__reduce_ex__(self, protocol)
    sub = type(self)
    base = sub.__bases__[0]
    if (isinstance(rv, tuple) and rv[0] is copyreg.__newobj__ and rv[1][0] is sub
            and _SUBCLASSES.get((base, sub.forward)) is sub):
        return (_subclass_instance, (base, sub.forward, sub._tensor_ops_kind, *rv[1][1:]), *rv[2:])
    return rv


def _is_ours(m: nn.Module) -> bool:
    return type(m).__module__.startswith("tensor_ops.")


def _swap_class(m: nn.Module, forward: Callable, what: str, counts, **attrs) -> None:
    old = type(m).__name__
    m.__class__ = _subclass(type(m), forward, what)
    for k, v in attrs.items():
        setattr(m, k, v)
    counts[f"{old} -> {type(m).__name__} ({what})"] += 1


# ----------------------------------------------------------------- recognisers

def _hf_class(m: nn.Module) -> bool:
    return type(m).__module__.startswith("transformers.")


def _swap_norm(m: nn.Module, path: str, warnings: List[str], counts) -> bool:
    if _is_ours(m):
        return getattr(m, "_tensor_ops_kind", "").startswith("rms_norm")
    name = type(m).__name__
    if not (_hf_class(m) and name.endswith("RMSNorm")):
        return False
    w = getattr(m, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        warnings.append(f"{path} ({name}) looks like an RMSNorm but was left as is: no 1-d weight Parameter")
        return True
    # The forms we have, by the eps attribute the class keeps; each checked against the module's own
    # forward (Note [checked swaps]): Gemma's 1 + weight, Gemma 3n / 4's plain weight under that name.
    if isinstance(getattr(m, "variance_epsilon", None), float):
        forms = ((_rms_norm_forward, "rms_norm kernel"),)
    elif isinstance(getattr(m, "eps", None), float):
        forms = ((_offset_rms_norm_forward, "rms_norm kernel, weight offset 1"), (_eps_rms_norm_forward, "rms_norm kernel"))
    else:
        forms = ()
    why = "no float variance_epsilon or eps"
    for forward, what in forms:
        why = swap_check.same_output(m, forward, w.shape[0])
        if why is None:
            _swap_class(m, forward, what, counts)
            return True
    warnings.append(f"{path} ({name}) looks like an RMSNorm but was left as is: {why}")
    return True


def _swap_gated_mlp(m: nn.Module, path: str, warnings: List[str], counts) -> bool:
    if _is_ours(m):
        return "GLU" in getattr(m, "_tensor_ops_kind", "")
    children = dict(m.named_children())
    name = type(m).__name__
    if "gate_up_proj" in children and "down_proj" in children:  # Phi-3
        kind = activation_kind(children.get("activation_fn"))
        gu, d = children["gate_up_proj"], children["down_proj"]
        why = None
        if set(children) != {"gate_up_proj", "down_proj", "activation_fn"}:
            why = f"children {sorted(children)} are not gate_up_proj, down_proj, activation_fn"
        elif type(gu) is not nn.Linear or type(d) is not nn.Linear or gu.out_features != 2 * d.in_features:
            why = "gate_up_proj / down_proj are not nn.Linear of out_features 2 * intermediate"
        elif kind is None:
            why = f"activation_fn {type(children['activation_fn']).__name__} has no tensor_ops kernel"
        elif not _hf_class(m):
            why = "not a transformers class (its forward is unknown)"
        else:  # Note [checked swaps]
            why = swap_check.names_mismatch(m, _GATE_UP_NAMES) or swap_check.same_output(
                m, lambda mod, x: _gate_up_mlp(mod, x, kind), d.out_features)
        if why:  # its children are still visited: its activation module, called by its own forward, is ours
            warnings.append(f"{path} ({name}) looks like a fused gate/up MLP but was left as is: {why}")
            return False
        _swap_class(m, _gate_up_mlp_forward, f"gate_up_proj + {kind} GLU kernel", counts, _tensor_ops_act=kind)
        _swap_activation(children["activation_fn"], collections.Counter())  # unused by our forward: consistent
        return True
    if {"gate_proj", "up_proj", "down_proj"} <= set(children) and _hf_class(m):
        kind = activation_kind(children.get("act_fn"))
        why = None
        if set(children) != _GATED_NAMES or kind is None or not all(
                type(children[c]) is nn.Linear for c in ("gate_proj", "up_proj", "down_proj")):
            why = f"children {sorted(children)}, act_fn {type(children.get('act_fn')).__name__} (kernel: {kind})"
        else:  # Note [checked swaps]
            why = swap_check.names_mismatch(m, _GATED_NAMES) or swap_check.same_output(
                m, lambda mod, x: _gated_mlp(mod, x, kind), children["down_proj"].out_features)
        if why:  # its children are still visited: its act_fn, called by its own forward, is ours
            warnings.append(f"{path} ({name}) looks like a gated MLP but was left as is: {why}")
            return False
        _swap_class(m, _gated_mlp_forward, f"{kind} GLU kernel", counts, _tensor_ops_act=kind)
        _swap_activation(children["act_fn"], collections.Counter())  # unused by our forward: consistent
        return True
    return False


# HF modules whose forward is linear -> act -> the rest, in order: (linear
# slot, activation slot, the slots after it).
LINEAR_ACTIVATION_PAIRS = {
    "GPTNeoXMLP": ("dense_h_to_4h", "act", ("dense_4h_to_h",)),
    "BertIntermediate": ("dense", "intermediate_act_fn", ()),
    "BertPredictionHeadTransform": ("dense", "transform_act_fn", ("LayerNorm",)),
    "GPT2MLP": ("c_fc", "act", ("c_proj", "dropout")),
}


# Note [fused at the parent]: a Linear + activation pair is fused in its
# parent's forward, which runs linear_activation on the linear's weight only
# while the linear is a plain Linear / Conv1D (ours or torch's /
# transformers') and the activation still the one prepared, neither with
# hooks; otherwise it calls the two modules as HF's forward does. The
# linear used to become the fused module itself, its activation slot
# nn.Identity: a PEFT LoRA adapter wrapping it then added its update after
# the GELU (gelu(xW + b) + BAx for gelu(xW + b + BAx)): a GPT-2 LoRA run's
# losses drifted from step 1 (4.817 for 4.846) and an adapter trained on the
# plain model gave logits 0.63 off on a prepared one, silently.
def _linear_act_rest(self, x: torch.Tensor, slots) -> torch.Tensor:
    lin, act = getattr(self, slots[0]), getattr(self, slots[1])
    layout = plain_linear_layout(lin)
    if (layout is not None and (getattr(act, "_tensor_ops_act", None) or activation_kind(act)) == self._tensor_ops_act
            and not hooked(lin) and not hooked(act)):
        h = linear_activation(x, lin.weight if layout == "nk" else lin.weight.t(), lin.bias, self._tensor_ops_act)
    else:
        h = act(lin(x))
    for name in slots[2]:
        h = getattr(self, name)(h)
    return h


def _pair_forward(self, hidden_states):
    return _linear_act_rest(self, hidden_states, LINEAR_ACTIVATION_PAIRS[self._tensor_ops_pair])


def _fuse_pair(m: nn.Module, path: str, warnings: List[str], counts) -> bool:
    name = type(m).__name__
    if _is_ours(m):
        return getattr(m, "_tensor_ops_pair", None) is not None
    slots = LINEAR_ACTIVATION_PAIRS.get(name)
    if slots is None or not _hf_class(m):
        return False
    lin, act = getattr(m, slots[0], None), getattr(m, slots[1], None)
    kind = activation_kind(act)
    layout = None if lin is None else plain_linear_layout(lin)
    why = None
    if kind is None:
        why = f"activation {type(act).__name__} has no tensor_ops kernel"
    elif layout is None:
        why = f"{slots[0]} ({type(lin).__name__}) is not nn.Linear or Conv1D"
    else:  # Note [checked swaps]
        why = swap_check.names_mismatch(m, frozenset((slots[0], slots[1]) + slots[2]))
        if why is None:
            was = [(x, x.training) for x in m.modules()]
            m.eval()  # GPT-2's dropout: the check compares the arithmetic
            try:
                width = lin.in_features if layout == "nk" else lin.weight.shape[0]
                why = swap_check.same_output(m, lambda mod, x: _linear_act_direct(mod, x, slots, kind), width)
            finally:
                for x, t in was:
                    x.training = t
    if why:
        warnings.append(f"{path} ({name}): {slots[0]} + {slots[1]} left unfused: {why}")
        return True
    _swap_class(m, _pair_forward, f"{slots[0]} + {kind} epilogue", counts, _tensor_ops_act=kind,
                _tensor_ops_pair=name)
    return True


def _linear_act_direct(m, x, slots, kind):
    """What _pair_forward computes on the fused path (the check's side)."""
    lin = getattr(m, slots[0])
    w = lin.weight if plain_linear_layout(lin) == "nk" else lin.weight.t()
    h = linear_activation(x, w, lin.bias, kind)
    for name in slots[2]:
        h = getattr(m, name)(h)
    return h


def _swap_activation(m: nn.Module, counts) -> bool:
    if _is_ours(m):
        return False
    kind = activation_kind(m)
    if kind is None:
        return False
    _swap_class(m, _activation_forward, f"{kind} kernel", counts, _tensor_ops_act=kind)
    return True


def swap_hf_modules(model: nn.Module, warnings: List[str], counts, *, rms_norm: bool = True, swiglu: bool = True,
                    activations: bool = True, fuse_linear: bool = True) -> None:
    """Our subclasses for HF's norms, gated MLPs, Linear + activation pairs
    and activations, at any depth, in place."""
    def visit(m: nn.Module, path: str) -> None:
        if rms_norm and _swap_norm(m, path, warnings, counts):
            return
        if swiglu and _swap_gated_mlp(m, path, warnings, counts):
            return
        if fuse_linear and _fuse_pair(m, path, warnings, counts):
            pass  # its other children (c_proj, ...) are visited below
        elif activations and _swap_activation(m, counts):
            return
        for name, child in m.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")


# ------------------------------------------------------------------ attention

def _eager_mask(mask: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                causal: bool) -> Optional[torch.Tensor]:
    """The mask HF's sdpa mask function made for our attention (bool, True
    attends; or None where causal alone is enough) as a model's eager
    attention takes it: additive in query's dtype (0 or the dtype's min, as
    HF's eager masks), the causal part made explicit (top-left, as
    attention_forward: query i sees keys j <= i)."""
    if mask is None:
        if not causal:
            return None
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril(0)[None, None]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    return mask


def _fallback(reason: str, module, query, key, value, attention_mask, is_causal: Optional[bool] = None, **kwargs):
    """The call on the model's own eager attention (what it runs without us),
    with the mask converted to eager's form (_eager_mask); HF's
    sdpa_attention_forward, which takes the mask as it is, for a model that
    has no eager function."""
    ATTENTION_FALLBACKS[reason] += 1
    # A model that ran SDPA before ours falls back to SDPA where SDPA can take
    # the call (not for probabilities, position bias, sinks or a paged cache):
    # eager's answer differs on rows with no key to attend (Note [eager's
    # empty rows]: V's mean where SDPA's is 0), and the model was SDPA's.
    sdpa = getattr(module, _ORIGINAL_ATTENTION, None) == "sdpa" and not (
        _attentions_requested(kwargs) or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
        or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None)
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        _log.warning("tensor_ops attention: %s: this call (and any like it) runs %s's %s attention",
                     reason, type(module).__name__, "SDPA" if sdpa else "eager")
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None or sdpa:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = _eager_mask(attention_mask, query, key, bool(query.shape[2] > 1 and causal))
    out, weights = eager(module, query, key, value, mask, **kwargs)
    if (getattr(module, _ORIGINAL_ATTENTION, None) == "sdpa" and isinstance(attention_mask, torch.Tensor)
            and attention_mask.dtype == torch.bool and out.dim() == 4 and out.shape[1] == query.shape[2]):
        # A model that ran SDPA asking for the probabilities: eager's rows with no key to attend
        # are V's mean, SDPA's (and ours) 0 (Note [eager's empty rows]): a left-padded batch's
        # loss moved with output_attentions=True. Those rows zeroed, probabilities too.
        seen = attention_mask.any(-1)  # [batch, 1 | heads, Lq]
        out = torch.where(seen.transpose(1, 2)[..., None], out, out.new_zeros(()))
        if isinstance(weights, torch.Tensor):
            weights = torch.where(seen[..., None], weights, weights.new_zeros(()))
    return out, weights


try:  # transformers' output capture: what a forward with output_attentions=True collects
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # pragma: no cover - other transformers versions: the kwarg alone
    _OUTPUT_COLLECTOR = None


def _attentions_requested(kwargs) -> bool:
    """Whether the caller wants this call's attention probabilities: the
    output_attentions kwarg (Llama passes it down), or transformers' output
    capture collecting "attentions" (GPT-2 does not pass it: its eager
    attention's probabilities were returned, ours are not, so a prepared
    eager GPT-2 returned no attentions)."""
    if kwargs.get("output_attentions"):
        return True
    if _OUTPUT_COLLECTOR is None or torch.compiler.is_compiling():
        return False
    try:
        collected = _OUTPUT_COLLECTOR.get()
    except LookupError:
        return False
    return isinstance(collected, dict) and "attentions" in collected


def _unsupported(query, key, value, dropout, kwargs) -> Optional[str]:
    if query.dtype not in modules._KERNEL_DTYPES:
        return f"{str(query.dtype)[len('torch.'):]} attention (our kernels take float32, float16 and bfloat16)"
    if _attentions_requested(kwargs):
        return "output_attentions=True needs the attention probabilities"
    if kwargs.get("cache") is not None:
        return "paged attention cache"
    if kwargs.get("position_bias") is not None:
        return "position_bias (T5-style) is not supported"
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return "attention sinks are not supported"
    if query.dim() != 4 or key.shape[-1] != value.shape[-1] or query.shape[-1] != key.shape[-1]:
        return f"q/k/v head dims {query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]} differ"
    if query.shape[1] % key.shape[1]:
        return f"kv heads ({key.shape[1]}) do not divide q heads ({query.shape[1]})"
    return None


def _softcapped_attention(q, k, v, mask, dropout, causal, scale, softcap, eager_rows=False):
    """Gemma 2's attention: softcap * tanh(scale q k^T / softcap) + mask, our softmax, @ v; with
    eager_rows the mask adds the dtype's minimum, as eager's does (Note [eager's empty rows])."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + (_eager_mask(mask, q, k, False).to(acc) if eager_rows else _additive(mask, acc))
    if causal:
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(0)
        scores = scores.masked_fill(~keep, float("-inf"))
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    probs = ops.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if dropout:
        probs = F.dropout(probs, dropout, True)
    return torch.matmul(probs, v.to(acc)).to(q.dtype)


# Note [native half attention]: on a CPU where torch's bf16 (or fp16) GEMMs
# run natively (AMX, AVX512-BF16: modules.half_gemm_in_fp32 is False), torch's
# SDPA computes prefill attention with them, and our kernel, which widens
# half inputs to fp32 FMAs, was 0.20-0.65x of it forward (bf16, Xeon with AMX,
# 1 thread: [1, 32/8, 1024, 128] causal 77 vs 24 ms). So there a half call
# with more than one query runs HF's own sdpa_attention_forward (what the
# original model runs: the same numbers); one-query decode stays on our
# kernel (1.6x SDPA there, split along the cache). The exception is the amx
# CPU level (Notes [AMX attention] and [AMX attention backward],
# attention_flash.h): its bf16 forward and backward run on AMX tiles, at
# 1 and 2 threads 1.06-1.45x SDPA forward and 1.46-3.21x forward+backward
# (bench/RESULTS.md, attention), so there a
# bf16 prefill with no mask or dropout runs ours (masked calls still run
# SDPA). The policy is the half GEMMs' (TENSOR_OPS_HALF_GEMM=fp32 keeps our
# kernel throughout); prepare_model says so.
SDPA_HALF_CALLS = collections.Counter()  # dtype name -> calls routed to torch's SDPA


def amx_half_attention(dtype: torch.dtype) -> bool:
    """Whether our CPU attention (forward and backward) runs this dtype on
    AMX tiles (the amx ISA level, bfloat16)."""
    return dtype == torch.bfloat16 and modules._cpu_isa() == "amx"


def native_half_attention(dtype: torch.dtype, plain: bool = False) -> bool:
    """Whether a half-precision prefill attention of this dtype on the CPU
    runs torch's SDPA (Note [native half attention]); plain: the call has no
    mask and no dropout."""
    if dtype not in modules._HALF or modules.half_gemm_in_fp32(dtype):
        return False
    return not (plain and amx_half_attention(dtype))


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, softcap: Optional[float] = None, **kwargs):
    """transformers' attention interface (sdpa_attention_forward's contract):
    query [batch, heads, Lq, d], key / value [batch, kv_heads, Lk, d], the
    mask from HF's sdpa mask function (bool, True attends, or None when
    causal alone is enough); returns ([batch, Lq, heads, d], None)."""
    reason = _unsupported(query, key, value, dropout, kwargs)
    if reason is not None:
        return _fallback(reason, module, query, key, value, attention_mask, is_causal, dropout=dropout,
                         scaling=scaling, softcap=softcap, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    plain = attention_mask is None and not dropout
    if (q_len > 1 and softcap is None and query.is_cpu and native_half_attention(query.dtype, plain)
            # host tensors run on OpenCL / SYCL stay there, not on this CPU's SDPA (traced: no
            # registry call in the graph, which dynamo could not trace: the CPU's route)
            and (torch.compiler.is_compiling() or _selected_backend() == "cpu")):
        SDPA_HALF_CALLS[str(query.dtype)[len("torch."):]] += 1
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    eager_rows = (attention_mask is not None and attention_mask.dtype == torch.bool
                  and getattr(module, _EAGER_ROWS, False))
    if (eager_rows and softcap is None and torch.is_grad_enabled()
            and (query.requires_grad or key.requires_grad or value.requires_grad)
            and (torch.compiler.is_compiling() or not bool(attention_mask.any(-1).all()))):
        return _fallback("a query row with no key to attend (left padding) in a model loaded with eager attention, "
                         "while recording gradients (eager's gradients there, Note [eager's empty rows])",
                         module, query, key, value, attention_mask, is_causal, dropout=dropout, scaling=scaling,
                         softcap=softcap, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:  # as sdpa_attention_forward: an empty static cache's prefill
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if softcap is not None:
        out = _softcapped_attention(query, key, value, attention_mask, dropout, causal, scale, softcap, eager_rows)
    elif attention_mask is None and not dropout:
        out = ops.attention(query, key, value, causal, scale, causal_alignment="top_left")
    else:
        out = scaled_dot_product_attention(query, key, value, attention_mask, dropout, causal, scale,
                                           training=True, causal_alignment="top_left")
    if eager_rows and softcap is None:
        out = _eager_empty_rows(out, value, attention_mask)
    return out.transpose(1, 2).contiguous(), None


# Note [eager's empty rows]: a query row whose keys are all masked (a left pad's position, where the
# causal and padding masks meet) is 0 in our attention, as in SDPA; a model's eager attention adds the
# dtype's minimum to every score of that row, which absorbs the scores, so its softmax is uniform and
# the row is the mean of V. Such a row reaches the loss (the last pad predicts the first real token):
# a left-padded Gemma 2 training batch lost 2.7e-3 against HF and its gradients 0.13 relative. So a
# model that ran eager attention before prepare_model keeps eager's answers there (its attention
# modules carry _EAGER_ROWS, set by _set_attention): the row is V's mean; softcapped attention, which
# builds the scores anyway, adds eager's minimum; and a call that records gradients with such a row
# runs the model's eager attention, since eager's gradient reaches q and k through those absorbed
# scores (uniform softmax, nonzero Jacobian), which no kernel that skips them can give.
_EAGER_ROWS = "_tensor_ops_eager_empty_rows"
_ORIGINAL_ATTENTION = "_tensor_ops_original_attention"


def _eager_empty_rows(out: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """out [batch, heads, Lq, d] with each row that the bool mask [batch, 1 | heads, Lq, Lk] leaves
    no key replaced by the mean of its kv head's values (no data-dependent branch: compiles whole)."""
    mean = value.mean(-2, keepdim=True).to(out.dtype)
    if out.shape[1] != mean.shape[1]:
        mean = mean.repeat_interleave(out.shape[1] // mean.shape[1], 1)
    return torch.where(mask.any(-1, keepdim=True), out, mean)


def register_attention() -> str:
    """Registers "tensor_ops" in transformers' AttentionInterface (and HF's
    sdpa mask function for it); idempotent. Returns the name."""
    if AttentionInterface._global_mapping.get(ATTENTION) is not attention_forward:
        AttentionInterface.register(ATTENTION, attention_forward)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


# A prepared model's config names "tensor_ops" as its attention: registered
# on import, so a model torch.load-ed (or pickled into a spawned worker) in a
# fresh process runs (unpickling it imports this module: _subclass_instance).
register_attention()


def _mark_empty_rows(model: nn.Module, old: str) -> List[nn.Module]:
    """Note [eager's empty rows]: the model's attention modules keep eager's
    rows when `old` (what the model ran before ours) is "eager"; a model
    already on ours (prepared twice) keeps what it had. Returns the modules."""
    attention_modules = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")]
    for m in attention_modules:
        if old != ATTENTION or not hasattr(m, _EAGER_ROWS):
            setattr(m, _EAGER_ROWS, old == "eager")
            setattr(m, _ORIGINAL_ATTENTION, old)  # what _fallback runs where ours cannot
    return attention_modules


def _set_attention(model: nn.Module, warnings: List[str], counts) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return
    register_attention()
    old = config._attn_implementation
    try:
        model.set_attn_implementation(ATTENTION)
    except Exception as e:  # noqa: BLE001 - reported, the model keeps its attention
        warnings.append(f"attention left as {old!r}: set_attn_implementation({ATTENTION!r}) failed: "
                        f"{type(e).__name__}: {e}")
        return
    if config._attn_implementation != ATTENTION:
        warnings.append(f"attention left as {config._attn_implementation!r}: {type(model).__name__} does not "
                        f"dispatch through transformers' AttentionInterface")
        return
    attention_modules = _mark_empty_rows(model, old)
    counts[f"attention {old} -> {ATTENTION} (AttentionInterface) in {len(attention_modules)} attention modules"] += 1
    natives = sorted({str(t.dtype)[len("torch."):] for t in model.parameters()
                      if t.is_cpu and native_half_attention(t.dtype)})
    if natives:
        amx = " / ".join(d for d in natives if amx_half_attention(getattr(torch, d)))
        counts[f"{' / '.join(natives)} attention with more than one query on torch's SDPA: this CPU's native "
               f"{' / '.join(natives)} GEMMs beat our fp32-accumulating kernel there; one-query decode on ours"
               + (f"; {amx} prefill without mask or dropout on ours (AMX tiles)" if amx else "")
               + " (TENSOR_OPS_HALF_GEMM=fp32 keeps ours throughout; host tensors run on OpenCL / SYCL keep "
               "ours there)"] += 1
    if getattr(config, "attn_logit_softcapping", None) is not None:
        counts["attention logit softcapping on the score-matrix path (torch matmul + our softmax)"] += 1


# ----------------------------------------------------------------------- RoPE

def _rope_tables(cos: torch.Tensor, sin: torch.Tensor):
    """HF's cos / sin [batch, seq, rotary_dim] as our kernel's [rows, rotary_dim / 2] tables and the
    [batch, seq] positions that pick each batch's rows; once per call, for q and k alike. The positions
    are given even for batch 1 (decode): the op then takes the op table's fast lane instead of making
    them itself."""
    b, s, rd = cos.shape
    half = rd // 2
    c, sn = cos[..., :half].reshape(b * s, half), sin[..., :half].reshape(b * s, half)
    return c, sn, torch.arange(b * s, device=cos.device).view(b, s)


def _rope_one(x: torch.Tensor, c: torch.Tensor, sn: torch.Tensor, positions) -> torch.Tensor:
    # x [batch, heads, seq, d] is HF's transposed view of the projection's [batch, seq, heads, d]: our
    # kernel's layout, so the transpose back is free.
    return ops.rope(x.transpose(1, 2), c, sn, positions).transpose(1, 2)


def _rope_function(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        ok = (len(args) <= 1 and set(kwargs) <= {"unsqueeze_dim"} and unsqueeze_dim == 1 and q.dim() == 4
              and q.dtype in modules._KERNEL_DTYPES
              and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape and cos.shape[-1] % 2 == 0
              and cos.shape[-1] <= min(q.shape[-1], k.shape[-1]) and cos.shape[1] == q.shape[2] == k.shape[2]
              and cos.shape[0] in (1, q.shape[0]) and q.shape[0] == k.shape[0])
        if not ok:
            return original(q, k, cos, sin, *args, **kwargs)
        tables = _rope_tables(cos, sin)
        return _rope_one(q, *tables), _rope_one(k, *tables)

    apply_rotary_pos_emb._tensor_ops_original = original
    return apply_rotary_pos_emb


_ROPE_CHECKED: Dict[Callable, Optional[str]] = {}  # HF's apply_rotary_pos_emb -> _rope_mismatch's answer


def _rope_mismatch(original: Callable) -> Optional[str]:
    """None when our RoPE computes what a modeling module's own
    apply_rotary_pos_emb computes, else why not (Note [checked swaps]):
    called as Llama's, (q, k, cos, sin) with q / k [batch, heads, seq, d]
    and cos / sin [batch, seq, rotary_dim] holding the same half twice, on
    the whole head and on part of it. Families with another layout
    (Cohere, GLM, Helium: interleaved pairs) or signature (GPT-J, CodeGen,
    Gemma 4) give wrong answers or raise under ours: their RoPE stays HF's."""
    if original in _ROPE_CHECKED:
        return _ROPE_CHECKED[original]
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    why = None
    for rd in (16, 8):  # whole head, then partial (a form that raises on it is never called so)
        f = torch.randn(2, 5, rd // 2, generator=g) * 3
        cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
        try:
            want = original(q, k, cos, sin)
        except Exception as e:  # noqa: BLE001 - another signature
            if rd == 16:
                why = f"its {_ROPE}(q, k, cos, sin) raised {type(e).__name__}: {e}"
            break
        with torch.no_grad():
            got = _rope_function(original)(q, k, cos, sin)
        if not (isinstance(want, tuple) and len(want) == 2 and all(
                torch.is_tensor(w) and w.shape == o.shape and torch.allclose(w, o, rtol=1e-5, atol=1e-5)
                for w, o in zip(want, got))):
            why = f"its {_ROPE} computes another rotation than Llama's (rotary dim {rd} of head dim 16)"
            break
    _ROPE_CHECKED[original] = why
    return why


def patch_rope(modeling: types.ModuleType) -> bool:
    """Replaces modeling.apply_rotary_pos_emb by ours PROCESS-WIDE: every
    model of that family in this process, prepared or not, runs our RoPE
    until unpatch_rope(modeling). Only the Liger-style class patch before
    loading (apply_tensor_ops_kernel without model=) does this, as Liger
    does; prepare_model scopes RoPE to the model's own modules (scope_rope).
    False when the module has none, or one whose layout or signature is
    not ours (_rope_mismatch). Idempotent."""
    fn = getattr(modeling, _ROPE, None)
    if fn is None or _rope_mismatch(getattr(fn, "_tensor_ops_original", fn)) is not None:
        return False
    if not hasattr(fn, "_tensor_ops_original"):
        setattr(modeling, _ROPE, _rope_function(fn))
    return True


def unpatch_rope(modeling: types.ModuleType) -> None:
    """Undoes patch_rope(modeling): HF's own apply_rotary_pos_emb back."""
    fn = getattr(modeling, _ROPE, None)
    if fn is not None and hasattr(fn, "_tensor_ops_original"):
        setattr(modeling, _ROPE, fn._tensor_ops_original)


# Note [RoPE per model]: HF's attention forwards call apply_rotary_pos_emb as a global of their
# modeling module, looked up at call time. To give one model our RoPE without touching the module
# (which every other model of the family shares), each module of the model whose class reaches that
# global gets a subclass of its class (same name, qualname and module: isinstance, class-name based
# device maps and _no_split_modules keep working) whose methods are HF's own code objects rebuilt on a
# copy of the modeling module's globals where apply_rotary_pos_emb is ours ("the scope"). Module-level
# functions that reach it (directly or through another such function) are rebuilt on the scope too.
# The scope is a snapshot taken the first time a model of that module is prepared: rebinding a
# module-level name afterwards does not reach prepared models. It has no __name__, on purpose:
# for an inlined function's globals, dynamo (get_globals_source_and_value) builds its guard sources
# on sys.modules[__name__] when __name__ is set, that is on HF's module, whose apply_rotary_pos_emb
# is not the one traced; without __name__ its sources are this dict itself. (The functions keep
# their own __module__.)

_ROPE = "apply_rotary_pos_emb"
_ROPE_SCOPES: Dict[int, tuple] = {}  # id(modeling globals; alive in sys.modules) -> (scope, names reaching RoPE)
_ROPE_CLASSES: Dict[type, Optional[type]] = {}  # class -> its subclass with RoPE scoped, None when it has no RoPE


def _rebuilt(fn: types.FunctionType, scope: dict) -> types.FunctionType:
    """fn's code, defaults and closure on the globals scope (its name, module, qualname, doc and attributes kept)."""
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__module__, new.__qualname__, new.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    if getattr(fn, "__annotate__", None) is not None:  # Python 3.14: lazy, kept so (may need TYPE_CHECKING names)
        new.__annotate__ = fn.__annotate__
    else:
        new.__annotations__ = dict(fn.__annotations__)
    new._tensor_ops_rope_from = fn
    return new


def _rope_scope(module_globals: dict) -> tuple:
    """(scope, names), cached per module: the scope of Note [RoPE per model]
    for a modeling module's globals, and the names in it that reach
    apply_rotary_pos_emb."""
    cached = _ROPE_SCOPES.get(id(module_globals))
    if cached is not None:
        return cached
    names = {_ROPE}
    funcs = {n: f for n, f in module_globals.items()
             if isinstance(f, types.FunctionType) and f.__globals__ is module_globals and n != _ROPE}
    grew = True
    while grew:  # helpers that call helpers that call apply_rotary_pos_emb
        grew = False
        for n, f in funcs.items():
            if n not in names and swap_check.code_names(f.__code__) & names:
                names.add(n)
                grew = True
    scope = {k: v for k, v in module_globals.items() if k != "__name__"}
    original = module_globals[_ROPE]
    scope[_ROPE] = _rope_function(getattr(original, "_tensor_ops_original", original))
    for n in names - {_ROPE}:
        scope[n] = _rebuilt(funcs[n], scope)
    _ROPE_SCOPES[id(module_globals)] = (scope, frozenset(names))
    return _ROPE_SCOPES[id(module_globals)]


def _rope_methods(cls: type) -> Dict[str, Any]:
    """{name: HF's function} for the methods cls resolves to a transformers
    class's function (through its MRO, up to nn.Module) whose code reaches a
    module-level apply_rotary_pos_emb; empty when none does (a method that a
    class of another package overrides is that package's: left alone). A
    method wrapped by a decorator (functools.wraps) raises ValueError: its
    inner code cannot be rebuilt without the decorator."""
    found: Dict[str, Any] = {}
    seen: set = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for name, attr in vars(klass).items():
            if name in seen or name.startswith("__"):
                continue
            seen.add(name)
            fn = attr.__func__ if isinstance(attr, staticmethod) else attr
            if not klass.__module__.startswith("transformers.") or not isinstance(fn, types.FunctionType):
                continue
            inner = inspect.unwrap(fn)
            if not isinstance(inner, types.FunctionType) or _ROPE not in inner.__globals__:
                continue
            if _rope_scope(inner.__globals__)[1] & swap_check.code_names(inner.__code__):
                original = inner.__globals__[_ROPE]
                why = _rope_mismatch(getattr(original, "_tensor_ops_original", original))
                if why is not None:
                    raise ValueError(f"{inner.__globals__.get('__name__', klass.__module__)}: {why}")
                if inner is not fn:
                    raise ValueError(f"{klass.__name__}.{name} is wrapped by a decorator ({fn.__module__}."
                                     f"{fn.__qualname__}), so its {_ROPE} cannot be rebound without losing "
                                     f"the decorator")
                found[name] = attr
    return found


def _rope_instance(cls: type, *args):
    """Unpickling a module of _rope_class(cls): an instance of cls whose class is then the subclass again."""
    obj = cls.__new__(cls, *args)
    obj.__class__ = _rope_class(cls)
    return obj


def _rope_reduce_ex(self, protocol):
    # The subclass shares HF's class name, so pickle would find HF's class by name and refuse ("not the
    # same object"): pickled as HF's class, made ours again on load. copy.deepcopy goes this way too.
    rv = object.__reduce_ex__(self, protocol)
    cls = type(self)
    if (isinstance(rv, tuple) and rv[0] is copyreg.__newobj__ and rv[1][0] is cls
            and _ROPE_CLASSES.get(cls._tensor_ops_rope_from) is cls):
        return (_rope_instance, (cls._tensor_ops_rope_from, *rv[1][1:]), *rv[2:])
    return rv


def _rope_class(cls: type) -> Optional[type]:
    """cls's subclass with RoPE scoped (cached per class), or None when no
    method of cls reaches apply_rotary_pos_emb; ValueError as _rope_methods."""
    if cls in _ROPE_CLASSES:
        return _ROPE_CLASSES[cls]
    sub = None
    methods = _rope_methods(cls)
    if methods:
        body = {}
        for name, attr in methods.items():
            if isinstance(attr, staticmethod):
                body[name] = staticmethod(_rebuilt(attr.__func__, _rope_scope(attr.__func__.__globals__)[0]))
            else:
                body[name] = _rebuilt(attr, _rope_scope(attr.__globals__)[0])
        body.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__,
                    _tensor_ops_rope_from=cls, __reduce_ex__=_rope_reduce_ex)
        sub = type(cls.__name__, (cls,), body)
    _ROPE_CLASSES[cls] = sub
    return sub


def scope_rope(model: nn.Module, warnings: List[str], counts) -> None:
    """Our RoPE for this model's modules only (Note [RoPE per model]): every
    other model in the process, of the same family or not, keeps HF's."""
    reached: set = set()  # modules of the classes (and their bases) whose RoPE was dealt with
    warned: set = set()
    for path, m in model.named_modules():
        cls = type(m)
        try:
            sub = cls if getattr(cls, "_tensor_ops_rope_from", None) is not None else _rope_class(cls)
        except ValueError as e:
            if cls not in warned:  # once per class, not per layer
                warned.add(cls)
                warnings.append(f"{path or 'the model'} ({cls.__name__}) and any other {cls.__name__}: RoPE left "
                                f"as HF's: {e}")
            reached.update(c.__module__ for c in cls.__mro__)
            continue
        if sub is not None:  # sub is cls: scoped by an earlier prepare
            m.__class__ = sub
            reached.update(c.__module__ for c in cls.__mro__)
            counts[f"RoPE: {cls.__name__} -> tensor_ops rope (this model only)"] += 1
    for modeling in _modeling_modules(model):
        if getattr(modeling, _ROPE, None) is not None and modeling.__name__ not in reached:
            warnings.append(f"RoPE left as HF's: {modeling.__name__}.{_ROPE} is not called from any transformers "
                            f"method of this model's modules (a class overriding HF's forward, or reached some "
                            f"other way)")


def _modeling_modules(model: nn.Module) -> List[types.ModuleType]:
    names = sorted({type(m).__module__ for m in model.modules()} | {
        c.__module__ for m in model.modules() for c in type(m).__mro__})
    return [sys.modules[n] for n in names if n.startswith("transformers.models.") and n in sys.modules]


# ----------------------------------------------------------------------- loss

_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def _shift(labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor], ignore_index: int):
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.contiguous()


def _reduce(loss_fn, num_items_in_batch):
    if num_items_in_batch is None:
        return loss_fn("mean")
    n = num_items_in_batch.to(torch.float32) if torch.is_tensor(num_items_in_batch) else float(num_items_in_batch)
    return loss_fn("sum") / n


# Note [checked losses]
# Our loss replaces what a *ForCausalLM forward computes from its labels, so
# it may only stand in for the plain form: `loss = self.loss_function(logits,
# labels, vocab_size, **kwargs)` with transformers' ForCausalLMLoss (shift by
# one, cross-entropy, ignore_index, num_items_in_batch). Read from the
# forward's names (as Note [checked swaps] does for modules):
# - it must call self.loss_function, and that must be ForCausalLMLoss (Bart,
#   XLNet and other LM heads compute an unshifted loss of their own: ours
#   shifted it, 16x off in gradients);
# - names that scale or cap the logits before the loss (softcapping,
#   logits_scaling, logit_scale, ...) keep our loss on the returned logits
#   but turn the fused linear cross-entropy off (it computes head(hidden));
# - MoE classes that add `self.router_aux_loss_coef * aux_loss` get that term
#   added to ours (it was dropped: load balancing silently off);
# - any other name (z-loss, codebooks, another output) keeps HF's loss, said
#   in the warnings.
_LOSS_PLAIN = frozenset({
    "CausalLMOutputWithPast", "CausalLMOutputWithCrossAttentions", "MoeCausalLMOutputWithPast", "attentions",
    "config", "hidden_states", "last_hidden_state", "lm_head", "loss_function", "model", "past_key_values",
    "slice_logits_to_keep", "vocab_size", "router_logits", "cross_attentions", "return_dict", "use_return_dict",
    "logger", "warning", "warning_once", "device", "to"})
_LOSS_LOGIT_TRANSFORMS = frozenset({"final_logit_softcapping", "tanh", "torch", "float", "dtype", "logits_scaling",
                                    "logit_scale", "lm_head_multiplier", "logit_softcap", "output_logit_soft_cap",
                                    "soft_cap"})
_LOSS_MOE_AUX = frozenset({"load_balancing_loss_func", "num_experts", "num_experts_per_tok", "output_router_logits",
                           "router_aux_loss_coef"})


class _LossForm(NamedTuple):
    why: Optional[str]  # None: our loss may stand in for the class's
    fused: bool  # logits = head(hidden): the fused linear cross-entropy computes the same loss
    aux: bool  # the loss adds self.router_aux_loss_coef * aux_loss


_LOSS_FORMS: Dict[type, _LossForm] = {}


def _loss_form(model: nn.Module) -> _LossForm:
    """How type(model)'s forward computes its loss (Note [checked losses]):
    the forward's names read once per class, the loss function (which a
    model's loss_type or a set loss_function may change) once per model (at
    prepare time: HF's loss_function property logs, which a compiled forward
    must not call)."""
    form = model.__dict__.get("_tensor_ops_loss_form")
    if form is None:
        form = model.__dict__["_tensor_ops_loss_form"] = _loss_form_of(model)
    return form


def _loss_form_of(model: nn.Module) -> _LossForm:
    cls = type(model)
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # pragma: no cover - a transformers without it
        LOSS_MAPPING, ForCausalLMLoss = {}, None
    # PreTrainedModel.loss_function without its log line (a compiled forward may get here): the
    # function set on the model, else LOSS_MAPPING's for its loss_type, ForCausalLM's by default.
    loss_function = model.__dict__.get("_loss_function")
    if loss_function is None:
        loss_function = LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM", ForCausalLMLoss)
    if ForCausalLMLoss is None or loss_function is not ForCausalLMLoss:
        return _LossForm(f"{cls.__name__} computes its loss with {loss_function!r}, not transformers' "
                         f"ForCausalLMLoss", False, False)
    form = _LOSS_FORMS.get(cls)
    if form is not None:
        return form
    names = swap_check.forward_names(cls)
    base = {getattr(model, "base_model_prefix", "")}
    if names is None:
        form = _LossForm(f"{cls.__name__}.forward is not Python code we can read", False, False)
    elif "loss_function" not in names:
        form = _LossForm(f"{cls.__name__} computes its loss itself, not with transformers' ForCausalLMLoss", False,
                         False)
    else:
        extra = sorted(n for n in names - _LOSS_PLAIN - _LOSS_LOGIT_TRANSFORMS - _LOSS_MOE_AUX - base
                       if not n.endswith(("Output", "OutputWithPast")))
        aux = "router_aux_loss_coef" in names
        if extra or (not aux and names & _LOSS_MOE_AUX):
            form = _LossForm(f"{cls.__name__}.forward also uses {', '.join(extra or sorted(names & _LOSS_MOE_AUX))}"
                             f" (not the plain causal-LM loss)", False, False)
        else:
            form = _LossForm(None, not names & _LOSS_LOGIT_TRANSFORMS, aux)
    _LOSS_FORMS[cls] = form
    return form


def _causal_lm_forward(original: Callable) -> Callable:
    """original (a *ForCausalLM.forward) with the loss on our kernels, by
    self._tensor_ops_loss: "cross_entropy" (logits as before, our loss) or
    "fused_linear_cross_entropy" (in training mode, no logits)."""
    names = [n for n, p in inspect.signature(original).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]

    @functools.wraps(original)
    def forward(self, *args, labels=None, **kwargs):
        mode = getattr(self, "_tensor_ops_loss", None)
        if args and len(args) <= len(names):  # positional inputs (input_ids first) by name
            kwargs.update(zip(names, args))
            args = ()
            labels = kwargs.pop("labels", labels)
        shift_labels = kwargs.get("shift_labels")
        form = _loss_form(self)
        head = self.get_output_embeddings()
        weight = getattr(head, "weight", None)
        # as HF: no labels, no loss; HF's own loss form; a model cast to a dtype our kernels lack
        # (float64 after prepare_model): HF's loss in torch's arithmetic, as the prepared modules do
        if (mode is None or labels is None or form.why
                or isinstance(weight, torch.Tensor) and weight.dtype not in modules._KERNEL_DTYPES):
            return original(self, *args, labels=labels, **kwargs)
        # return_dict=False: HF's tuple, the loss first; the model's own output is asked
        # for as a ModelOutput so the loss can be set on it.
        as_tuple = kwargs.pop("return_dict", None) is False
        ignore_index = kwargs.get("ignore_index", -100)
        num_items = kwargs.get("num_items_in_batch")
        targets = _shift(labels, shift_labels, ignore_index)
        fused = (mode == "fused_linear_cross_entropy" and self.training and not args and form.fused
                 and getattr(self.config, "final_logit_softcapping", None) is None
                 and isinstance(head, nn.Linear) and not kwargs.get("logits_to_keep"))
        if not fused:
            out = original(self, *args, labels=None, return_dict=True,
                           **{k: v for k, v in kwargs.items() if k not in ("shift_labels",)})
            logits = out.logits
            vocab = logits.shape[-1]

            def loss_fn(reduction):
                return ops.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1).to(logits.device),
                                         ignore_index, reduction)

            loss = _reduce(loss_fn, num_items)
            if form.aux and getattr(out, "aux_loss", None) is not None:  # Note [checked losses]
                loss = loss + self.router_aux_loss_coef * out.aux_loss.to(loss.device)
            # a new output rather than out.loss = ...: ModelOutput left "loss" (None) out of its keys
            out = type(out)(**{**out, "loss": loss})
            return out.to_tuple() if as_tuple else out
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        base_kwargs = {k: v for k, v in kwargs.items() if k not in _LOSS_KWARGS + ("logits_to_keep",)}
        router = False
        if form.aux:  # the base model's router logits, for the aux loss (Note [checked losses])
            router = kwargs.get("output_router_logits")
            router = self.config.output_router_logits if router is None else router
            base_kwargs["output_router_logits"] = router
        outputs = getattr(self, self.base_model_prefix)(return_dict=True, **base_kwargs)
        hidden = outputs[0]

        def loss_fn(reduction):
            return _flce(hidden, head.weight, targets.to(hidden.device), head.bias, ignore_index, reduction)

        loss = _reduce(loss_fn, num_items)
        cache = dict(past_key_values=getattr(outputs, "past_key_values", None),
                     hidden_states=getattr(outputs, "hidden_states", None),
                     attentions=getattr(outputs, "attentions", None))
        if form.aux:
            aux_loss = None
            if router:
                balance = inspect.unwrap(original).__globals__["load_balancing_loss_func"]
                aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                   kwargs.get("attention_mask"))
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            out = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=None, **cache,
                                            router_logits=getattr(outputs, "router_logits", None))
        else:
            out = CausalLMOutputWithPast(loss=loss, logits=None, **cache)
        if as_tuple:  # HF's positions: the logits slot kept, None (as Liger's), so the cache keeps its index
            return tuple(getattr(out, f.name) for f in dataclasses.fields(out)
                         if f.name == "logits" or getattr(out, f.name) is not None)
        return out

    forward._tensor_ops_original = original
    return forward


def _loss_mode(cross_entropy: bool, fused_linear_cross_entropy: bool) -> Optional[str]:
    if fused_linear_cross_entropy:
        return "fused_linear_cross_entropy"
    return "cross_entropy" if cross_entropy else None


def _patch_loss(model: nn.Module, mode: Optional[str], warnings: List[str], counts) -> None:
    if mode is None or not type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        return
    if not hasattr(type(model).forward, "_tensor_ops_original") and not hasattr(
            getattr(model.forward, "__func__", None), "_tensor_ops_original"):
        model.forward = types.MethodType(_causal_lm_forward(type(model).forward), model)
    model._tensor_ops_loss = mode
    form = _loss_form(model)  # Note [checked losses]
    if form.why:
        warnings.append(f"causal-LM loss left as HF's: {form.why}")
        return
    counts[f"causal-LM loss -> {mode}{' + router aux loss' if form.aux else ''}"] += 1
    if mode == "fused_linear_cross_entropy" and getattr(model.config, "final_logit_softcapping", None) is not None:
        warnings.append("fused linear cross-entropy off for this model: final_logit_softcapping is set; "
                        "the loss runs our cross_entropy on the (softcapped) logits")
    elif mode == "fused_linear_cross_entropy" and not form.fused:
        warnings.append(f"fused linear cross-entropy off for this model: {type(model).__name__}.forward scales or "
                        f"caps the logits before its loss; the loss runs our cross_entropy on its logits")


# ------------------------------------------------------------ what is left

# A norm class by name: ends in one of these, or holds one followed by a
# variant tag (NemotronLayerNorm1P, *RMSNormGated).
_NORM_NAME = re.compile(r"(RMSNorm|LayerNorm|GroupNorm)(\d+[A-Za-z]?|Gated)?$")


def _leftovers(model: nn.Module, warnings: List[str]) -> None:
    """Names every HF / torch norm, activation, MLP left on torch."""
    seen = set(w.split(" ", 1)[0] for w in warnings)
    handled_mlps = set(LINEAR_ACTIVATION_PAIRS)
    for path, m in model.named_modules():
        if _is_ours(m) or path in seen:
            continue
        name, where = type(m).__name__, path or "the model"
        if _NORM_NAME.search(name):
            warnings.append(f"{where} ({name}) is a norm left on torch: no tensor_ops replacement for this class")
        elif type(m).__module__ in ("transformers.activations", "torch.nn.modules.activation") and not isinstance(
                m, (nn.Softmax, nn.MultiheadAttention)):
            warnings.append(f"{where} ({name}) is an activation left on torch: no tensor_ops kernel for it")
        elif name.endswith("MLP") and name not in handled_mlps and _hf_class(m):
            warnings.append(f"{where} ({name}) is an MLP left on torch: its structure is not one we recognise")


# ------------------------------------------------------------- entry points

def prepare_hf_model(model: nn.Module, warnings: List[str], counts: collections.Counter, *, rope: bool = True,
                     rms_norm: bool = True, swiglu: bool = True, activations: bool = True,
                     fuse_linear: bool = True, attention: bool = True, cross_entropy: bool = True,
                     fused_linear_cross_entropy: bool = False) -> nn.Module:
    """Everything above on a loaded model, in place; what changed goes into
    counts ("what -> what": n), what did not into warnings."""
    swap_hf_modules(model, warnings, counts, rms_norm=rms_norm, swiglu=swiglu, activations=activations,
                    fuse_linear=fuse_linear)
    if rope:
        scope_rope(model, warnings, counts)
    if attention:
        _set_attention(model, warnings, counts)
    _patch_loss(model, _loss_mode(cross_entropy, fused_linear_cross_entropy), warnings, counts)
    _leftovers(model, warnings)
    return model


def _post_init_class(cls: type, fix: Callable) -> type:
    """A subclass of cls whose __init__ runs cls's then fix(self) (fix
    class-swaps self or its children)."""
    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        fix(self)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "_tensor_ops_patched_from": cls})


def _patch_class(modeling, name: str, fix: Callable) -> bool:
    cls = getattr(modeling, name, None)
    if cls is None or getattr(cls, "_tensor_ops_patched_from", None) is not None:
        return cls is not None
    setattr(modeling, name, _post_init_class(cls, fix))
    return True


# model_type -> modeling module, its RMSNorm, gated MLP, Linear+activation modules, causal-LM class.
FAMILIES = {
    "llama": ("llama", "LlamaRMSNorm", "LlamaMLP", (), "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralRMSNorm", "MistralMLP", (), "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2RMSNorm", "Qwen2MLP", (), "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3RMSNorm", "Qwen3MLP", (), "Qwen3ForCausalLM"),
    "gemma": ("gemma", "GemmaRMSNorm", "GemmaMLP", (), "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2RMSNorm", "Gemma2MLP", (), "Gemma2ForCausalLM"),
    "phi3": ("phi3", "Phi3RMSNorm", "Phi3MLP", (), "Phi3ForCausalLM"),
    "gpt_neox": ("gpt_neox", None, None, ("GPTNeoXMLP",), "GPTNeoXForCausalLM"),
    "gpt2": ("gpt2", None, None, ("GPT2MLP",), "GPT2LMHeadModel"),
    "bert": ("bert", None, None, ("BertIntermediate", "BertPredictionHeadTransform"), None),
}

# Classes we patched, to undo: (module, name) -> original.
_PATCHED: Dict[tuple, Any] = {}


def _set_global(modeling, name: str, value) -> None:
    _PATCHED.setdefault((modeling, name), getattr(modeling, name))
    setattr(modeling, name, value)


def apply_tensor_ops_kernel(model_type: str, *, rope: bool = True, rms_norm: bool = True, swiglu: bool = True,
                            activations: bool = True, fuse_linear: bool = True, attention: bool = True,
                            cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
                            layer_norm: bool = True, model: Optional[nn.Module] = None) -> List[str]:
    """Liger's apply_liger_kernel_to_<model> for one transformers family.
    Without model: patches transformers.models.<family>'s classes (and its
    causal-LM forward) so models built afterwards run on our kernels; pass
    attn_implementation="tensor_ops" when loading (AutoTensorOpsKernelForCausalLM
    does), the name is registered here. With rope, that patch replaces the
    family's module-level apply_rotary_pos_emb PROCESS-WIDE, as Liger's does:
    every model of the family in this process, already built or not, runs
    our RoPE until revert_tensor_ops_kernel(model_type).
    With model (already loaded): the same on that model in place (attention
    set too), RoPE for that model's modules only (as prepare_model).
    Returns the warnings."""
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    mod, norm, mlp, pairs, causal_lm = FAMILIES[model_type]
    warnings: List[str] = []
    counts: collections.Counter = collections.Counter()
    if model is not None:
        from .prepare import _swap_modules  # torch's norms and activations -> ours, as the switches say
        kinds = {k for k, on in (("layer_norm", layer_norm), ("rms_norm", rms_norm), ("swiglu", swiglu),
                                 ("activations", activations)) if on}
        if kinds:
            _swap_modules(model, "", warnings, counts, frozenset(kinds))
        prepare_hf_model(model, warnings, counts, rope=rope, rms_norm=rms_norm, swiglu=swiglu,
                         activations=activations, fuse_linear=fuse_linear, attention=attention,
                         cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy)
        return warnings
    modeling = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
    register_attention()
    if rope:
        patch_rope(modeling)
    sink: collections.Counter = collections.Counter()
    if rms_norm and norm:
        _patch_class(modeling, norm, lambda m: _swap_norm(m, norm, warnings, sink))
    if swiglu and mlp:
        _patch_class(modeling, mlp, lambda m: _swap_gated_mlp(m, mlp, warnings, sink))
    if fuse_linear:
        for p in pairs:
            _patch_class(modeling, p, lambda m, p=p: _fuse_pair(m, p, warnings, sink))
    if layer_norm and getattr(modeling.nn, "LayerNorm", None) is nn.LayerNorm and not norm:
        # HF builds nn.LayerNorm through modeling's `nn`: give it a namespace whose LayerNorm is ours.
        _set_global(modeling, "nn", types.SimpleNamespace(**{**vars(nn), "LayerNorm": modules.LayerNorm}))
    mode = _loss_mode(cross_entropy, fused_linear_cross_entropy)
    if causal_lm and mode:
        cls = getattr(modeling, causal_lm)
        if not hasattr(cls.forward, "_tensor_ops_original"):
            cls.forward = _causal_lm_forward(cls.forward)
        cls._tensor_ops_loss = mode
    return warnings


def revert_tensor_ops_kernel(model_type: str) -> None:
    """Undoes apply_tensor_ops_kernel(model_type) (without model=): HF's
    classes, causal-LM forward and apply_rotary_pos_emb back for models built
    afterwards (and HF's RoPE for those built before, which read it at call
    time). Models given to prepare_model keep their own RoPE."""
    mod, norm, mlp, pairs, causal_lm = FAMILIES[model_type]
    modeling = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
    unpatch_rope(modeling)
    for name in filter(None, (norm, mlp, *pairs)):
        orig = getattr(getattr(modeling, name), "_tensor_ops_patched_from", None)
        if orig is not None:
            setattr(modeling, name, orig)
    for (m, name), orig in list(_PATCHED.items()):
        if m is modeling:
            setattr(m, name, orig)
            del _PATCHED[(m, name)]
    if causal_lm:
        cls = getattr(modeling, causal_lm)
        if hasattr(cls.forward, "_tensor_ops_original"):
            cls.forward = cls.forward._tensor_ops_original
        cls._tensor_ops_loss = None


def _family_function(model_type: str) -> Callable:
    def apply(rope: bool = True, rms_norm: bool = True, swiglu: bool = True, cross_entropy: bool = False,
              fused_linear_cross_entropy: bool = True, model: Optional[nn.Module] = None, **switches) -> List[str]:
        return apply_tensor_ops_kernel(model_type, rope=rope, rms_norm=rms_norm, swiglu=swiglu,
                                       cross_entropy=cross_entropy,
                                       fused_linear_cross_entropy=fused_linear_cross_entropy, model=model,
                                       **switches)

    apply.__name__ = apply.__qualname__ = f"apply_tensor_ops_kernel_to_{model_type}"
    apply.__doc__ = (f"apply_tensor_ops_kernel('{model_type}', ...): Liger's apply_liger_kernel_to_{model_type} "
                     f"switches (rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy; also "
                     f"activations, fuse_linear, attention, layer_norm), before loading or with model=.")
    return apply


apply_tensor_ops_kernel_to_llama = _family_function("llama")
apply_tensor_ops_kernel_to_mistral = _family_function("mistral")
apply_tensor_ops_kernel_to_qwen2 = _family_function("qwen2")
apply_tensor_ops_kernel_to_qwen3 = _family_function("qwen3")
apply_tensor_ops_kernel_to_gemma = _family_function("gemma")
apply_tensor_ops_kernel_to_gemma2 = _family_function("gemma2")
apply_tensor_ops_kernel_to_phi3 = _family_function("phi3")
apply_tensor_ops_kernel_to_gpt_neox = _family_function("gpt_neox")
apply_tensor_ops_kernel_to_gpt2 = _family_function("gpt2")
apply_tensor_ops_kernel_to_bert = _family_function("bert")


class AutoTensorOpsKernelForCausalLM:
    """AutoModelForCausalLM with the checkpoint's family patched first
    (Liger's AutoLigerKernelForCausalLM): from_pretrained(path, rope=...,
    rms_norm=..., fused_linear_cross_entropy=..., **from_pretrained_kwargs);
    attn_implementation defaults to "tensor_ops"."""

    _SWITCHES = ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "activations",
                 "fuse_linear", "attention", "layer_norm")

    @classmethod
    def _apply(cls, model_type: str, kwargs: dict) -> bool:
        """Patches the family; True when attention was set to ours by default
        (the caller did not name an attn_implementation)."""
        switches = {k: kwargs.pop(k) for k in cls._SWITCHES if k in kwargs}
        if model_type in FAMILIES:
            apply_tensor_ops_kernel(model_type, **switches)
            if switches.get("attention", True) and kwargs.get("attn_implementation") is None:
                kwargs["attn_implementation"] = ATTENTION
                return True
        else:
            _log.warning("AutoTensorOpsKernelForCausalLM: model_type %r has no tensor_ops patch; loading it as is",
                         model_type)
        return False

    @staticmethod
    def _loaded(model, ours_by_default: bool):
        """Note [eager's empty rows]: ours in place of what HF would have
        loaded: eager's rows where that is eager (Gemma 2's default)."""
        if ours_by_default and getattr(model.config, "_attn_implementation", None) == ATTENTION:
            try:
                default = model.get_correct_attn_implementation(None, True)
            except Exception:  # noqa: BLE001 - another transformers: SDPA's rows, as before
                default = "sdpa"
            _mark_empty_rows(model, default)
        return model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        config = transformers.AutoConfig.from_pretrained(pretrained_model_name_or_path,
                                                         trust_remote_code=kwargs.get("trust_remote_code", False))
        ours = cls._apply(config.model_type, kwargs)
        return cls._loaded(transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args,
                                                                             **kwargs), ours)

    @classmethod
    def from_config(cls, config, **kwargs):
        ours = cls._apply(config.model_type, kwargs)
        return cls._loaded(transformers.AutoModelForCausalLM.from_config(config, **kwargs), ours)


__all__ = [
    "ATTENTION", "ATTENTION_FALLBACKS", "AutoTensorOpsKernelForCausalLM", "FAMILIES", "apply_tensor_ops_kernel",
    "attention_forward", "prepare_hf_model", "register_attention", "revert_tensor_ops_kernel",
    *[f"apply_tensor_ops_kernel_to_{f}" for f in FAMILIES],
]
