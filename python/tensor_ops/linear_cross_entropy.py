"""Fused linear cross-entropy: cross_entropy(hidden @ weight.T + bias, target)
and its gradients without the [N, V] logits (Liger-Kernel's algorithm).

Note [chunked linear cross-entropy]: the rows of hidden are taken a chunk at a
time; each chunk's logits go into one [chunk, V] buffer reused by every chunk,
our cross_entropy_with_grad writes their gradient in the same pass, and the
three GEMMs that follow (grad_hidden = dlogits @ W, grad_weight += dlogits.T @
hidden, grad_bias += the column sums) consume it before the next chunk. So the
peak holds the inputs, the gradients (which any training step holds) and one
[chunk, V] block (the gradient overwrites the logits). The chunks' gradients
are those of the summed loss; the mean's 1 / n_valid (valid rows of the whole
batch, not of a chunk) and a backward's grad_output scale the finished
gradients once at the end, a pass over [N, H] and [V, H] against the GEMMs' 6
N H V flops. Gradients of fp16 / bf16 inputs accumulate over chunks in fp32
(grad_weight sums N / chunk rounded GEMM outputs otherwise), through buffers
fw.accumulator makes once per call ([ACC_ROWS, chunk] and [chunk, H]), so the
loop makes no per-chunk temporary the size of the logits (numpy's own matmul
on ml_dtypes bfloat16 still casts through float32 buffers). This module runs
numpy input on numpy's BLAS; tensor_ops.torch.fused_linear_cross_entropy runs
the same loop on torch's GEMMs.
"""
from __future__ import annotations

import math
import types

import numpy as np

from . import _C, _checks
from .errors import DTypeError, InvalidArgumentError, UnsupportedError
from .ops import _ce_options, cross_entropy, cross_entropy_with_grad

REDUCTIONS = ("mean", "sum", "none")
# Rows of grad_weight per accumulation step (fw.accumulator): its buffers stay [ACC_ROWS, H] or [ACC_ROWS, chunk].
ACC_ROWS = 1024


def default_chunk_size(n: int, hidden: int, vocab: int) -> int:
    """Liger's choice, next_pow2(ceil(N / ceil(V / H))): the [chunk, V] logits
    buffer is then about the size of hidden [N, H] (between half and twice it),
    so the fused peak stays O((N + V) H), the size of the tensors a training
    step holds anyway. At least 32 rows (when V / H is large) so the GEMMs keep
    an M dimension the BLAS micro-kernels block well; never more than N."""
    rows = math.ceil(max(n, 1) / math.ceil(vocab / max(hidden, 1)))
    return max(1, min(max(n, 1), max(32, 1 << (rows - 1).bit_length())))


def check_options(ignore_index, reduction, chunk_size) -> tuple:
    """(ignore_index, reduction, chunk_size) type- and range-checked; chunk_size may be None."""
    ignore_index = _checks.int64("ignore_index", ignore_index)
    reduction = _checks.choice("reduction", reduction, REDUCTIONS)
    if chunk_size is not None and _checks.integer("chunk_size", chunk_size) < 1:
        raise InvalidArgumentError(f"fused_linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    return ignore_index, reduction, chunk_size


def check_ce_options(label_smoothing, z_loss, softcap) -> tuple:
    """(label_smoothing, z_loss, softcap) checked as cross_entropy checks them
    (before any chunk runs), as floats; softcap None for none."""
    label_smoothing, z_loss, cap = _ce_options(label_smoothing, z_loss, softcap)
    return label_smoothing, z_loss, (cap if cap else None)


def check_args(hidden, weight, target, bias, ignore_index, reduction, chunk_size) -> tuple:
    """check_options, chunk_size defaulted, and the arrays' shapes and dtypes
    checked against each other with errors naming them."""
    ignore_index, reduction, chunk_size = check_options(ignore_index, reduction, chunk_size)
    hs, ws, ts = tuple(hidden.shape), tuple(weight.shape), tuple(target.shape)
    if len(hs) != 2 or len(ws) != 2 or hs[1] != ws[1] or ts != hs[:1]:
        raise InvalidArgumentError(f"fused_linear_cross_entropy: expected hidden [N, H], weight [V, H], target [N]; "
                                   f"got hidden {list(hs)}, weight {list(ws)}, target {list(ts)}")
    if ws[0] < 1:
        raise InvalidArgumentError(f"fused_linear_cross_entropy: weight has no classes: shape {list(ws)}")
    if bias is not None and tuple(bias.shape) != ws[:1]:
        raise InvalidArgumentError(f"fused_linear_cross_entropy: bias must be [{ws[0]}], got {list(bias.shape)}")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise DTypeError(f"fused_linear_cross_entropy: hidden, weight and bias must share a dtype, got "
                         f"{hidden.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if chunk_size is None:
        chunk_size = default_chunk_size(hs[0], hs[1], ws[0])
    return ignore_index, reduction, int(chunk_size)


def chunked(fw, hidden, weight, target, bias, ignore_index: int, chunk_size: int, grads: bool,
            dloss_rows=None, **options):
    """The loop of Note [chunked linear cross-entropy] on framework fw (numpy
    or torch ops, see NUMPY): (float32 loss per row, grad_hidden, grad_weight,
    grad_bias) with the gradients those of sum(loss rows * dloss_rows) (of the
    plain sum without dloss_rows), grad_weight and grad_bias in the
    accumulation dtype; (losses, None, None, None) without grads. options go
    to cross_entropy_with_grad."""
    if _C.external_selected():  # the XLA shim has no fused linear cross-entropy: say so, as linear does
        raise UnsupportedError("fused_linear_cross_entropy is not implemented by the XLA shim, which is selected "
                               "for host arrays; run it with the cpu backend selected")
    n, h = hidden.shape
    v = weight.shape[0]
    acc = fw.acc_dtype(hidden.dtype)
    losses = fw.empty((n,), fw.float32, hidden)
    gh = gw = gb = None
    if grads:
        gh = fw.empty((n, h), hidden.dtype, hidden)
        gw = fw.zeros((v, h), acc, hidden)
        gb = None if bias is None else fw.zeros((v,), acc, hidden)
        add_grad_weight = fw.accumulator(gw, hidden.dtype, min(chunk_size, n))
    buf = fw.empty((min(chunk_size, n), v), hidden.dtype, hidden)
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        h_c, logits = hidden[s:e], buf[:e - s]
        fw.linear(h_c, weight, bias, logits)
        if not grads:
            losses[s:e] = cross_entropy(logits, target[s:e], ignore_index, "none", **options)
            continue
        # the gradient overwrites the chunk's logits (inplace): one [chunk, V] block on the peak, not two
        rows, dl = cross_entropy_with_grad(logits, target[s:e], ignore_index, "none", inplace=True, **options)
        losses[s:e] = rows
        if dloss_rows is not None:
            dl *= fw.cast(dloss_rows[s:e, None], dl.dtype)
        fw.mm(dl, weight, gh[s:e])
        add_grad_weight(dl.T, h_c)
        if gb is not None:
            gb += dl.sum(0, dtype=gb.dtype)
        del rows, dl  # before the next chunk allocates its own
    return losses, gh, gw, gb


def reduce(losses, target, ignore_index: int, reduction: str):
    """(the reduced float32 loss, the scale its gradients take over the sum's):
    mean divides by the valid rows of the whole batch (NaN when there are none,
    as torch)."""
    if reduction == "none":
        return losses, 1.0
    total = losses.sum()
    if reduction == "sum":
        return total, 1.0
    n_valid = int((target != ignore_index).sum())
    return (total / n_valid if n_valid else total * float("nan")), (1.0 / n_valid if n_valid else 0.0)


def _np_linear(h_c, weight, bias, out):
    np.matmul(h_c, weight.T, out=out)
    if bias is not None:
        out += bias


def _np_mm(a, b, out):
    np.matmul(a, b, out=out)


def _np_accumulator(acc, dtype, chunk: int, rows: int = ACC_ROWS):
    """add(a, b): acc [V, H] += a @ b for a [V, <= chunk] and b [<= chunk, H]
    (a chunk's dlogits.T and hidden rows), a block of acc's rows at a time
    through one product buffer made here, once (numpy's matmul has no
    accumulating form). Inputs narrower than acc (fp16 / bf16 into fp32) are
    converted into buffers made here too, a's a block at a time: no converted
    copy of a whole chunk's dlogits exists."""
    rows = min(rows, acc.shape[0])
    prod = np.empty((rows, acc.shape[1]), acc.dtype)
    convert = np.dtype(dtype) != acc.dtype
    a_acc = np.empty((rows, chunk), acc.dtype) if convert else None
    b_acc = np.empty((chunk, acc.shape[1]), acc.dtype) if convert else None

    def add(a, b):
        k = b.shape[0]
        if convert:
            b_acc[:k] = b
            b = b_acc[:k]
        for r in range(0, acc.shape[0], rows):
            m = min(rows, acc.shape[0] - r)
            blk = a[r:r + m]
            if convert:
                a_acc[:m, :k] = blk
                blk = a_acc[:m, :k]
            np.matmul(blk, b, out=prod[:m])
            acc[r:r + m] += prod[:m]
    return add


NUMPY = types.SimpleNamespace(
    float32=np.float32,
    acc_dtype=lambda dt: np.dtype(np.float32) if np.dtype(dt).itemsize < 4 else np.dtype(dt),
    cast=lambda x, dtype: x.astype(dtype, copy=False),
    empty=lambda shape, dtype, like: np.empty(shape, dtype),
    zeros=lambda shape, dtype, like: np.zeros(shape, dtype),
    linear=_np_linear, mm=_np_mm, accumulator=_np_accumulator,
)


def fused_linear_cross_entropy(hidden, weight, target, bias=None, ignore_index: int = -100, reduction: str = "mean",
                               chunk_size: int | None = None, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                               softcap: float | None = None):
    """cross_entropy(hidden @ weight.T + bias, target) on numpy arrays
    (hidden [N, H], weight [V, H], target [N], bias [V] or None) without the
    [N, V] logits: returns (loss, grad_hidden, grad_weight, grad_bias), the
    gradients of the reduced loss (of the sum for reduction="none", as
    cross_entropy_with_grad), grad_bias None without a bias. The loss is
    float32, the gradients in the inputs' dtype. chunk_size: rows per chunk
    (default: default_chunk_size). label_smoothing, z_loss and softcap as
    cross_entropy's. Torch tensors: tensor_ops.torch.fused_linear_cross_entropy
    (autograd)."""
    arrays = [hidden, weight, target] + ([] if bias is None else [bias])
    if not all(isinstance(a, np.ndarray) for a in arrays):
        raise DTypeError(f"fused_linear_cross_entropy takes numpy arrays (torch tensors: "
                         f"tensor_ops.torch.fused_linear_cross_entropy), got "
                         f"{', '.join(type(a).__name__ for a in arrays)}")
    ignore_index, reduction, chunk_size = check_args(hidden, weight, target, bias, ignore_index, reduction,
                                                     chunk_size)
    label_smoothing, z_loss, softcap = check_ce_options(label_smoothing, z_loss, softcap)
    hidden, weight = np.ascontiguousarray(hidden), np.ascontiguousarray(weight)
    losses, gh, gw, gb = chunked(NUMPY, hidden, weight, target, bias, ignore_index, chunk_size, True,
                                 label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    loss, scale = reduce(losses, target, ignore_index, reduction)
    if scale != 1.0:
        gh *= scale
        gw *= scale
        if gb is not None:
            gb *= scale
    return (loss, gh, gw.astype(weight.dtype, copy=False),
            None if gb is None else gb.astype(weight.dtype, copy=False))


__all__ = ["fused_linear_cross_entropy"]
