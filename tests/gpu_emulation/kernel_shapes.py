#!/usr/bin/env python3
"""Kernel paths of cuda/ that the conformance files' small shapes do not
reach, on the emulated backends, against the CPU backend (and two runs for
the same bits):
- the norms' forward, softmax / log_softmax / their backward / cross-entropy (with gradient,
  in place, ignored rows, label smoothing): rows held in registers (up to
  kRowChunks chunks per thread) at and just past that limit, where they
  stream twice; rows that do not start on a 16-byte boundary (odd widths:
  a scalar head and tail around 16-byte chunks, the weight read in chunks
  on the rows where it meets the row's boundary and one element at a time
  on the others), down to 1 and 7 columns; short rows, several to a block;
- the norms on device views whose rows, output, weight and bias all start
  one element past a 16-byte boundary;
- activations and gated units on strided rows (gate / up as the halves of
  a fused projection), 16-byte aligned or not;
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

import device_views
from against_cpu import against_cpu

# fp32 chunks are 4 elements, fp16 / bf16 8; a block has at most 1024
# threads and keeps kRowChunks<T> chunks each (4 fp32, 2 16-bit): 16384
# columns are the last held in registers, in every dtype.
# Odd widths (vocab 50257, hidden 4095 / 4097, 1, 7): row r starts r * cols
# elements in, at a different offset from a 16-byte boundary row by row.
ODD_SHAPES = [(2, 50257), (3, 4095), (3, 4097), (2, 1), (5, 7)]
# Short rows, several a block (up to 32 chunks: a group of 8 to 32 threads
# each): rows that leave the last block's groups partly empty; 512 fp32
# columns (128 chunks) keep a block per row.
SMALL_SHAPES = [(37, 128), (50, 64), (33, 20), (19, 256), (70, 33), (3, 512)]
ROW_SHAPES = {"float32": [(3, 16384), (2, 16388), (4, 1000)] + ODD_SHAPES + SMALL_SHAPES,
              "bfloat16": [(3, 16384), (2, 16392), (2, 8193)] + ODD_SHAPES + SMALL_SHAPES,
              "float16": [(2, 16384), (2, 16392)] + ODD_SHAPES + SMALL_SHAPES}
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
        w, b = rand(cols), rand(cols)
        out += [
            # Outputs O(|w|): the row sums' order differs from the CPU's, an absolute floor of 0.1 RTOL.
            (f"rms_norm {tag}", lambda x=x, w=w: to.rms_norm(x, w), 0.1),
            (f"layer_norm {tag}", lambda x=x, w=w, b=b: to.layer_norm(x, w, b), 0.1),
            (f"add_rms_norm {tag}", lambda x=x, dy=dy, w=w: to.add_rms_norm(x, dy, w), 0.1),
            # Softmax keeps exp(v - m) of each thread's max m and scales it (Note [One exp per element]): one
            # rounding more than the CPU's exp(v - max) / sum, which can move an fp16 output below fp16's normal
            # range (6.1e-5, a row of 16384) by one step of 2^-24 = 6e-8: a floor of 2e-5 RTOL (8e-8 in fp16).
            (f"softmax {tag}", lambda x=x: to.softmax(x, scale=0.7), 2e-5),
            (f"log_softmax causal {tag}", lambda x=x: to.log_softmax(x, causal=True), 0.0),
            (f"softmax_backward {tag}", lambda dy=dy, y=y: to.softmax_backward(dy, y), 1e-3),
            (f"log_softmax_backward {tag}", lambda dy=dy, x=x: to.log_softmax_backward(dy, to.log_softmax(x)), 1e-3),
            # Label smoothing subtracts eps / C from p: a gradient near 0 keeps the rounding of p (1 ulp of
            # 1e-3 at C = 64 is 1e-10), an absolute floor of 1e-5 RTOL.
            (f"cross_entropy {tag}", lambda x=x, t=t: to.cross_entropy_with_grad(x, t, reduction="none",
                                                                                 label_smoothing=0.1), 1e-5),
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


def strided(backend, dtype, rng, problems):
    """Activations and gated units on the halves of a fused [7, 2H] projection
    resident on the device (strided DLPack views), output into half of a
    [7, 2H] buffer: the rows kernels, 16-byte aligned (H = 512; and H = 36 in
    fp32) or not (lo = 1: one element in; H = 36 in 16-bit). Returns calls made."""
    dt, calls = dtype_of(dtype), 0
    dev = f"{backend}:0"
    for H in (512, 36):
        fused = (rng.standard_normal((7, 2 * H))).astype(np.float32).astype(dt)
        base = to.from_numpy(fused, device=dev)
        for lo in (0, 1):
            n = H - lo
            gate, up = fused[:, lo:H], fused[:, H:2 * H - lo]
            gv, uv = device_views.halves(base, 7, H, dtype, lo)
            dy = (rng.standard_normal((7, n))).astype(np.float32).astype(dt)
            for name, fn, ref_fn in (
                    ("silu", lambda o: to.silu(gv, out=o), lambda: to.silu(gate)),
                    ("swiglu", lambda o: to.swiglu(gv, uv, out=o), lambda: to.swiglu(gate, up)),
                    ("geglu", lambda o: to.geglu(gv, uv, "tanh", out=o), lambda: to.geglu(gate, up, "tanh"))):
                obuf = to.from_numpy(np.zeros((7, 2 * H), dt), device=dev)
                fn(device_views.DeviceView(obuf, lo, (7, n), (2 * H, 1), dtype))
                with to.use("cpu"):
                    ref = ref_fn()
                got = np.asarray(obuf.numpy())
                ok, err = close(got[:, lo:H], ref, dtype, 1e-3)
                calls += 1
                if not ok or np.any(got[:, :lo] != 0) or np.any(got[:, H:] != 0):
                    problems.append(f"{backend} {name} {dtype} strided halves H={H} lo={lo}: max error {err:.3g} "
                                    f"(or a write outside the view)")
            got = to.swiglu_backward(to.from_numpy(dy, device=dev), gv, uv)
            with to.use("cpu"):
                ref = to.swiglu_backward(dy, gate, up)
            calls += 1
            for i, (g, r) in enumerate(zip(got, ref)):
                ok, err = close(np.asarray(g.numpy()), r, dtype, 1e-3)
                if not ok:
                    problems.append(f"{backend} swiglu_backward {dtype} strided halves H={H} lo={lo} output {i}: "
                                    f"max error {err:.3g}")
    return calls


def offset_rows(backend, dtype, rng, problems):
    """The norms on device views whose every row starts one element past a
    16-byte boundary (x, out, weight and bias alike, [5, 1000] in [5, 1024]
    buffers): the head of V - 1 single elements with the weight read in
    16-byte chunks after it, which contiguous odd widths never reach (their
    weight is aligned, so it meets the row's boundary only on rows with no
    head). Returns calls made."""
    dt, dev, lo, n, width = dtype_of(dtype), f"{backend}:0", 1, 1000, 1024
    x = rng.standard_normal((5, width)).astype(np.float32).astype(dt)
    wb = rng.standard_normal((2, width)).astype(np.float32).astype(dt)
    xd, wd = to.from_numpy(x, device=dev), to.from_numpy(wb, device=dev)
    xv = device_views.DeviceView(xd, lo, (5, n), (width, 1), dtype)
    wv, bv = (device_views.DeviceView(wd, k * width + lo, (n,), (1,), dtype) for k in (0, 1))
    xs, ws, bs = x[:, lo:lo + n], wb[0, lo:lo + n], wb[1, lo:lo + n]
    calls = 0
    for name, fn, ref_fn in (
            ("rms_norm", lambda o: to.rms_norm(xv, wv, out=o), lambda: to.rms_norm(xs, ws)),
            ("layer_norm", lambda o: to.layer_norm(xv, wv, bv, out=o), lambda: to.layer_norm(xs, ws, bs))):
        obuf = to.from_numpy(np.zeros((5, width), dt), device=dev)
        fn(device_views.DeviceView(obuf, lo, (5, n), (width, 1), dtype))
        with to.use("cpu"):
            ref = ref_fn()
        got = np.asarray(obuf.numpy())
        ok, err = close(got[:, lo:lo + n], ref, dtype, 0.1)
        calls += 1
        if not ok or np.any(got[:, :lo] != 0) or np.any(got[:, lo + n:] != 0):
            problems.append(f"{backend} {name} {dtype} rows one element off a 16-byte boundary: max error {err:.3g} "
                            f"(or a write outside the view)")
    return calls


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
            runs += strided(backend, dtype, np.random.default_rng(3), problems)
            runs += offset_rows(backend, dtype, np.random.default_rng(4), problems)
            for name, fn, scale in cases(np.random.default_rng(2), dtype):
                against_cpu(backend, name, fn, lambda g, r, dtype=dtype, scale=scale: close(g, r, dtype, scale),
                            problems)
                runs += 1
    print(f"kernel_shapes: {runs} calls checked against the CPU backend")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(f"kernel_shapes: {len(problems)} problem(s)")


if __name__ == "__main__":
    main()
