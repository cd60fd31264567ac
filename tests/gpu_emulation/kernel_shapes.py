#!/usr/bin/env python3
"""Kernel paths of cuda/ that the conformance files' small shapes do not
reach, on the emulated backends, against the CPU backend (and two runs for
the same bits):
- softmax / log_softmax / their backward / cross-entropy (with gradient,
  in place, ignored rows, label smoothing): rows held in registers (up to
  kRowChunks chunks per thread) at and just past that limit, where they
  stream twice, and the scalar path (cols not a whole number of chunks);
- rope: a block per token over many heads, partial rotary, interleaved,
  positions per batch;
- attention forward and backward in float16 / bfloat16 on tensor cores:
  several 64-row query tiles and 64-key tiles, partial tiles, GQA, head dims
  that are padded (80) and the largest (128), both causal alignments.

    python3 tests/gpu_emulation/kernel_shapes.py [--backends cuda,hip]
(with the emulated plugins on TENSOR_OPS_PLUGIN_PATH, as .ci/gpu_emulation runs it)
"""
import argparse
import sys

import numpy as np

try:
    import ml_dtypes
except ImportError:  # bfloat16 numpy arrays need ml_dtypes
    ml_dtypes = None

import tensor_ops as to

# fp32 chunks are 4 elements, fp16 / bf16 8; a block has at most 1024
# threads and keeps 4 chunks each: 16384 fp32 / 32768 16-bit columns are the
# last held in registers.
ROW_SHAPES = {"float32": [(3, 16384), (2, 16388), (2, 4097), (4, 1000)],
              "bfloat16": [(3, 32768), (2, 32776), (2, 8193)],
              "float16": [(2, 32768), (2, 32776)]}
ATTN_SHAPES = [  # B, Hq, Hkv, Lq, Lk, D; causal alignments (None: not causal)
    ((1, 2, 1, 130, 140, 128), [None, "bottom_right"]),
    ((2, 2, 1, 70, 70, 80), ["top_left"]),
    ((1, 2, 2, 1, 300, 64), [None]),
    ((1, 3, 1, 200, 65, 32), ["bottom_right", "top_left"]),
]
RTOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def dtype_of(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def close(got, ref, dtype, scale=1.0):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are -inf (masked log_softmax, lse)
        err = np.abs(got - ref)
    ok = np.all((err <= RTOL[dtype] * (scale + np.abs(ref))) | (np.isinf(ref) & (got == ref)))
    return bool(ok), float(np.nanmax(np.where(np.isinf(ref), 0.0, err), initial=0.0))


def cases(rng, dtype):
    """(name, fn, scale) per call; fn() runs it on the current backend; scale: the error's absolute floor."""
    dt = dtype_of(dtype)

    def rand(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32).astype(dt)

    out = []
    for rows, cols in ROW_SHAPES[dtype]:
        x, dy = rand(rows, cols, s=3.0), rand(rows, cols)
        y = to.softmax(x)
        t = rng.integers(0, cols, rows).astype(np.int64)
        t[0] = -100
        tag = f"{dtype} [{rows}, {cols}]"
        out += [
            (f"softmax {tag}", lambda x=x: to.softmax(x, scale=0.7), 0.0),
            (f"log_softmax causal {tag}", lambda x=x: to.log_softmax(x, causal=True), 0.0),
            (f"softmax_backward {tag}", lambda dy=dy, y=y: to.softmax_backward(dy, y), 1e-3),
            (f"log_softmax_backward {tag}", lambda dy=dy, x=x: to.log_softmax_backward(dy, to.log_softmax(x)), 1e-3),
            (f"cross_entropy {tag}", lambda x=x, t=t: to.cross_entropy_with_grad(x, t, reduction="none",
                                                                                 label_smoothing=0.1), 1e-6),
            (f"cross_entropy in place {tag}", lambda x=x, t=t: to.cross_entropy_with_grad(x.copy(), t, inplace=True),
             1e-6),
        ]
    # rope: [B, S, H, D] with rotary dim 96 of 128 (dims past it pass through), positions per batch.
    B, S, H, D, R = 2, 5, 12, 128, 96
    xr = rand(B, S, H, D)
    ang = np.arange(16)[:, None] * (1e-1 * np.arange(R // 2))[None, :]
    cos, sin = np.cos(ang).astype(np.float32).astype(dt), np.sin(ang).astype(np.float32).astype(dt)
    pos = rng.integers(0, 16, (B, S)).astype(np.int64)
    for inter in (False, True):
        out.append((f"rope interleaved={inter} {dtype}",
                    lambda inter=inter: to.rope(xr, cos, sin, pos, interleaved=inter), 1e-3))
    if dtype != "float32":
        for (B, Hq, Hkv, Lq, Lk, D), alignments in ATTN_SHAPES:
            q, k, v, do = rand(B, Hq, Lq, D), rand(B, Hkv, Lk, D), rand(B, Hkv, Lk, D), rand(B, Hq, Lq, D)
            for causal, al in ((a is not None, a or "bottom_right") for a in alignments):
                def run(q=q, k=k, v=v, do=do, causal=causal, al=al):
                    o, lse = to.attention(q, k, v, causal, return_lse=True, causal_alignment=al)
                    return (o, lse) + tuple(to.attention_backward(do, q, k, v, o, lse, causal, causal_alignment=al))
                out.append((f"attention {dtype} {(B, Hq, Hkv, Lq, Lk, D)} causal={causal} {al}", run, 1.0))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cuda,hip")
    a = ap.parse_args()
    usable = {b.name for b in to.backends() if b.usable}
    problems, runs = [], 0
    for backend in a.backends.split(","):
        if backend not in usable:
            problems.append(f"{backend}: not usable")
            continue
        for dtype in ("float32", "bfloat16", "float16"):
            for name, fn, scale in cases(np.random.default_rng(2), dtype):
                with to.use("cpu"):
                    ref = fn()
                with to.use(backend):
                    got, again = fn(), fn()
                runs += 1
                ref, got, again = ((r,) if not isinstance(r, tuple) else r for r in (ref, got, again))
                for i, (g, r, g2) in enumerate(zip(got, ref, again)):
                    what = f"{backend} {name} output {i}"
                    ok, err = close(g, r, dtype, scale)
                    if not ok:
                        problems.append(f"{what}: max error {err:.3g}")
                    if np.asarray(g).tobytes() != np.asarray(g2).tobytes():
                        problems.append(f"{what}: two runs differ")
    print(f"kernel_shapes: {runs} calls checked against the CPU backend")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(f"kernel_shapes: {len(problems)} problem(s)")


if __name__ == "__main__":
    main()
