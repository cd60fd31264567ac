"""python -m tensor_ops: the main job.

Detects devices and backends, runs every op on every usable backend, checks
each against a numpy float64 reference, and prints a speed table against
numpy and torch eager (when installed), measured side by side in this run.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

import tensor_ops

try:
    import torch
except ImportError:
    torch = None


def _erf64(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def references():
    return {
        "rms_norm": lambda x, w: (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)) * w,
        "silu": lambda x, w: x / (1 + np.exp(-x)),
        "gelu": lambda x, w: 0.5 * x * (1 + _erf64(x / math.sqrt(2))),
        "gelu_tanh": lambda x, w: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
        "layer_norm": lambda x, w: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w,
        "softmax": lambda x, w: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(
            -1, keepdims=True),
        "swiglu": lambda x, w: x / (1 + np.exp(-x)) * w,
        "add_rms_norm": lambda x, w: (2 * x / np.sqrt(np.mean(4 * x * x, -1, keepdims=True) + 1e-6)) * w,
    }


def ours():
    return {
        "rms_norm": lambda x, w, out: tensor_ops.rms_norm(x, w, 1e-6, out=out),
        "silu": lambda x, w, out: tensor_ops.silu(x, out=out),
        "gelu": lambda x, w, out: tensor_ops.gelu(x, out=out),
        "gelu_tanh": lambda x, w, out: tensor_ops.gelu(x, "tanh", out=out),
        "layer_norm": lambda x, w, out: tensor_ops.layer_norm(x, w, None, 1e-5, out=out),
        "softmax": lambda x, w, out: tensor_ops.softmax(x),
        "swiglu": lambda x, w, out: tensor_ops.swiglu(x, _broadcast(w, x), out=out),
        "add_rms_norm": lambda x, w, out: tensor_ops.add_rms_norm(x, x, w)[0],
    }


def _broadcast(w, x):
    """w repeated to x's shape (the 'up' input of swiglu in the check)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return w.expand_as(x).contiguous()
    return np.ascontiguousarray(np.broadcast_to(w, x.shape))


def numpy_impls():
    def rms(x, w, out):
        np.multiply(x / np.sqrt(np.mean(x * x, -1, keepdims=True) + np.float32(1e-6)), w, out=out)

    def silu(x, w, out):
        np.divide(x, 1 + np.exp(-x), out=out)

    def gelu_tanh(x, w, out):
        c = np.float32(math.sqrt(2 / math.pi))
        np.multiply(0.5 * x, 1 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)), out=out)

    def softmax(x, w, out):
        e = np.exp(x - x.max(-1, keepdims=True))
        np.divide(e, e.sum(-1, keepdims=True), out=out)

    return {"rms_norm": rms, "silu": silu, "gelu_tanh": gelu_tanh, "softmax": softmax}


def torch_impls():
    F = torch.nn.functional
    return {
        "rms_norm": lambda x, w, out: out.copy_(F.rms_norm(x, (x.shape[-1],), w, 1e-6)),
        "silu": lambda x, w, out: torch.ops.aten.silu.out(x, out=out),
        "gelu": lambda x, w, out: torch.ops.aten.gelu.out(x, out=out),
        "gelu_tanh": lambda x, w, out: torch.ops.aten.gelu.out(x, approximate="tanh", out=out),
        "layer_norm": lambda x, w, out: out.copy_(F.layer_norm(x, (x.shape[-1],), w, None, 1e-5)),
        "softmax": lambda x, w, out: torch.softmax(x, -1, out=out),
    }


def median_time(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensor_ops", description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[2048, 4096], metavar=("ROWS", "COLS"))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small shape, few repetitions")
    p.add_argument("--cmake-dir", action="store_true",
                   help="print the folder of tensor_opsConfig.cmake (for -Dtensor_ops_DIR=...) and exit")
    p.add_argument("--include", action="store_true", help="print the C/C++ include folder and exit")
    args = p.parse_args(argv)
    if args.cmake_dir or args.include:
        if args.cmake_dir:
            print(tensor_ops.cmake_dir())
        if args.include:
            print(tensor_ops.get_include())
        return 0
    if args.quick:
        args.shape, args.reps = [64, 1024], 3

    print("== Backends")
    print_table(
        ["backend", "compiled", "usable", "priority", "reason"],
        [[b.name, b.compiled, b.usable, b.priority, b.reason or "-"] for b in tensor_ops.backends()],
    )
    print("\n== Devices")
    for d in tensor_ops.devices():
        props = ", ".join(f"{k}={v}" for k, v in d.properties.items())
        print(f"{d.backend}:{d.device_id}  {d.device_type}  {d.device_name}  "
              f"{d.total_memory_bytes / 2**30:.1f} GiB  [{props}]")
    try:
        selected = tensor_ops.get_backend()
    except (ValueError, RuntimeError) as e:
        print(f"\nbackend selection failed: {e}", file=sys.stderr)
        return 2
    print(f"\nSelected backend: {selected}")

    rows, cols = args.shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    refs = references()
    usable = [b.name for b in tensor_ops.backends() if b.usable]

    print(f"\n== Correctness vs numpy float64 ({rows}x{cols}, float32, and float16 / bfloat16 via torch)")
    check_rows, failed = [], False
    unsupported = set()  # (backend, op) pairs a backend does not implement
    for backend in usable:
        with tensor_ops.use(backend):
            for name, fn in ours().items():
                ref = refs[name](x64, w64)
                try:
                    got = fn(x, w, np.empty_like(x)).astype(np.float64)
                except NotImplementedError:
                    unsupported.add((backend, name))
                    check_rows.append([backend, name, "-", "-", "not implemented by this backend"])
                    continue
                err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
                ok = err < 1e-5
                failed |= not ok
                check_rows.append([backend, name, "float32", f"{err:.2e}", "ok" if ok else "FAIL"])
                if torch is not None:
                    for dt, tol in [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)]:
                        xt, wt = torch.from_numpy(x).to(dt), torch.from_numpy(w).to(dt)
                        ref_t = refs[name](xt.double().numpy(), wt.double().numpy())
                        got_t = fn(xt, wt, torch.empty_like(xt)).double().numpy()
                        err = float(np.max(np.abs(got_t - ref_t)) / max(np.max(np.abs(ref_t)), 1e-30))
                        ok = err < tol
                        failed |= not ok
                        check_rows.append([backend, name, str(dt).split(".")[-1], f"{err:.2e}",
                                           "ok" if ok else "FAIL"])
    print_table(["backend", "op", "dtype", "max err / max|ref|", "check"], check_rows)

    print(f"\n== Speed, {rows}x{cols} float32, median of {args.reps} (output preallocated), GB/s = (read x + write y) / time")
    nbytes = 2 * x.nbytes
    impls = {f"tensor_ops[{b}]": (b, ours()) for b in usable}
    impls["numpy"] = (None, numpy_impls())
    if torch is not None:
        impls["torch eager"] = (None, torch_impls())
    xt = torch.from_numpy(x) if torch is not None else None
    wt = torch.from_numpy(w) if torch is not None else None
    speed_rows = []
    for name in ours():
        base = None
        results = []
        for label, (backend, table) in impls.items():
            if name not in table:
                continue
            if backend and (backend, name) in unsupported:
                continue
            is_torch = label == "torch eager"
            xi, wi = (xt, wt) if is_torch else (x, w)
            out = torch.empty_like(xt) if is_torch else np.empty_like(x)
            fn = lambda: table[name](xi, wi, out)
            if backend:
                with tensor_ops.use(backend):
                    t = median_time(fn, args.reps)
            else:
                t = median_time(fn, args.reps)
            results.append((label, t))
            if label == "torch eager":
                base = t
        for label, t in results:
            ratio = f"{base / t:.2f}x" if base else "-"
            speed_rows.append([name, label, f"{t * 1e3:.3f}", f"{nbytes / t / 1e9:.1f}", ratio])
    print_table(["op", "implementation", "ms", "GB/s", "speed vs torch eager"], speed_rows)
    if failed:
        print("\nSome checks FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
