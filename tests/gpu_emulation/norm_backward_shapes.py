#!/usr/bin/env python3
"""The norm backward's kernel variants on the emulated backends, against the
CPU backend: the conformance files use rows of at most a few hundred
columns, which take only the one-chunk-per-thread variant (K = 1) of
norm_backward_kernel in cuda/norm.cu. These shapes take K = 2, K = 4, the
wide fallback (norm_backward_wide_kernel), the scalar path (V = 1) and more
rows than the grid's kBackwardBlocks (a block over several rows); the rms
backward with and without its weight offset.
Also checks that two runs give the same bits (the sums' order is fixed).

    python3 tests/gpu_emulation/norm_backward_shapes.py [--backends cuda,hip]
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

from against_cpu import against_cpu

# (rows, cols): fp32 chunks are 4 elements, fp16 / bf16 8; a block has at
# most 512 threads (kBackwardThreads), so chunks > 512 need K = 2, > 1024
# K = 4, > 2048 the wide kernel; cols not a whole number of chunks take V = 1.
SHAPES = [(3, 8192), (2, 16384), (5, 40000), (300, 64), (140, 1000), (2, 3001), (1, 4097)]
RTOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def dtype_of(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def close(got, ref, dtype):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    tol = RTOL[dtype] * (1.0 + np.abs(ref)) * (1.0 + 1e-3 * np.sqrt(ref.shape[0] if ref.ndim else 1))
    return bool(np.all(np.abs(got - ref) <= tol)), float(np.max(np.abs(got - ref)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cuda,hip")
    a = ap.parse_args()
    usable = {b.name for b in to.backends() if b.usable}
    rng = np.random.default_rng(1)
    problems, runs = [], 0
    for backend in a.backends.split(","):
        if backend not in usable:
            problems.append(f"{backend}: not usable")
            continue
        for dtype in ("float32", "bfloat16", "float16"):
            dt = dtype_of(dtype)
            for rows, cols in SHAPES:
                x = rng.standard_normal((rows, cols)).astype(np.float32).astype(dt)
                dy = rng.standard_normal((rows, cols)).astype(np.float32).astype(dt)
                w = rng.standard_normal(cols).astype(np.float32).astype(dt)
                for name, fn in (("rms_norm_backward", to.rms_norm_backward),
                                 ("rms_norm_backward offset 1",
                                  lambda dy, x, w: to.rms_norm_backward(dy, x, w, offset=1.0)),
                                 ("layer_norm_backward", to.layer_norm_backward)):
                    against_cpu(backend, f"{name} {dtype} [{rows}, {cols}]",
                                lambda fn=fn, dy=dy, x=x, w=w: fn(dy, x, w),
                                lambda g, r, dtype=dtype: close(g, r, dtype), problems)
                    runs += 1
    print(f"norm_backward_shapes: {runs} calls checked against the CPU backend")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(f"norm_backward_shapes: {len(problems)} problem(s)")


if __name__ == "__main__":
    main()
