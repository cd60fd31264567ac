"""Kernel-only speed of tensor_ops against numpy, torch eager and torch.compile,
as a fraction of this machine's memory bandwidth measured in the same run.

    python bench/bench_ops.py [--shape R C] [--dtype float32|float16|bfloat16]
                              [--reps N] [--quick]

Prints a markdown table and writes bench/out/ops_<dtype>_<R>x<C>.json.
Every implementation writes into an output buffer allocated once (where the
peer has no out= form it says so): a fresh output of tens of MiB per call
costs more in page faults than the kernel itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np

import tensor_ops

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

try:
    from scipy.special import erf as scipy_erf
except ImportError:
    scipy_erf = None

EPS = 1e-6
TRIAD_ELEMENTS = 1 << 25  # 128 MiB of float32 per array, 4x the 32 MiB L3
IMPLS = ("tensor_ops", "numpy", "torch eager", "torch.compile")
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 4e-2}  # rtol = atol


@dataclasses.dataclass
class Impl:
    run: Optional[Callable[[], object]] = None  # one timed call, returns its output
    note: str = ""
    skipped: str = ""
    max_abs_err: float = math.nan


@dataclasses.dataclass
class Op:
    name: str
    ours: Callable  # (x, w, out)
    numpy: Optional[Callable]  # (x, w, out), or None with numpy_skip saying why
    numpy_skip: str
    torch_plain: Callable  # (x, w) -> new tensor
    torch_out: Optional[Callable]  # (x, w, out), None where torch has no out= overload


def summarize(samples: List[float]) -> Dict[str, float]:
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return {"median_s": statistics.median(samples), "p25_s": q1, "p75_s": q3,
            "min_s": min(samples), "max_s": max(samples)}


def measure_triad(threads: int, reps: int) -> Dict[str, object]:
    """STREAM triad a = b + s*c. Bytes count the 3 arrays as STREAM does (the
    write-allocate read of a is not counted)."""
    n, s = TRIAD_ELEMENTS, 3.0
    if torch is not None:
        a, b, c = torch.empty(n), torch.full((n,), 1.0), torch.full((n,), 2.0)

        def triad():
            torch.add(b, c, alpha=s, out=a)

        impl, arrays = f"torch.add(out=), {threads} threads", 3
        note = ""
    else:
        a, b, c = np.empty(n, np.float32), np.full(n, 1.0, np.float32), np.full(n, 2.0, np.float32)

        def triad():  # numpy has no fused triad: two passes move 5 arrays
            np.multiply(c, s, out=a)
            np.add(a, b, out=a)

        impl, arrays = "numpy, 1 thread", 5
        note = "torch missing: numpy triad is single-threaded and understates a multi-threaded kernel's limit"
    triad()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        triad()
        samples.append(time.perf_counter() - t0)
    nbytes = arrays * n * 4
    stats = summarize(samples)
    return {"impl": impl, "note": note, "elements": n, "bytes": nbytes, "samples_s": samples, **stats,
            "gbps": nbytes / stats["median_s"] / 1e9,
            "gbps_min": nbytes / stats["max_s"] / 1e9, "gbps_max": nbytes / stats["min_s"] / 1e9}


def numpy_rms_norm(x, w, out):
    np.divide(x, np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS), out=out)
    out *= w
    return out


def numpy_silu(x, w, out):
    np.divide(x, 1 + np.exp(-x), out=out)
    return out


def numpy_gelu_erf(x, w, out):
    t = scipy_erf(x * (1 / math.sqrt(2)))
    t += 1
    np.multiply(x, t, out=out)
    out *= 0.5
    return out


def numpy_gelu_tanh(x, w, out):
    t = x * x
    t *= 0.044715
    t += 1
    t *= x
    t *= math.sqrt(2 / math.pi)
    np.tanh(t, out=t)
    t += 1
    np.multiply(x, t, out=out)
    out *= 0.5
    return out


def make_ops() -> List[Op]:
    def gelu_op(approximate, numpy_fn, numpy_skip=""):
        return Op(
            name=f"gelu {approximate}",
            ours=lambda x, w, out: tensor_ops.gelu(x, approximate, out=out),
            numpy=numpy_fn, numpy_skip=numpy_skip,
            torch_plain=lambda x, w: F.gelu(x, approximate=approximate),
            torch_out=lambda x, w, out: torch.ops.aten.gelu.out(x, approximate=approximate, out=out),
        )

    return [
        Op("rms_norm", lambda x, w, out: tensor_ops.rms_norm(x, w, EPS, out=out), numpy_rms_norm, "",
           lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS), None),
        Op("silu", lambda x, w, out: tensor_ops.silu(x, out=out), numpy_silu, "",
           lambda x, w: F.silu(x), lambda x, w, out: torch.ops.aten.silu.out(x, out=out)),
        gelu_op("none", numpy_gelu_erf if scipy_erf else None, "" if scipy_erf else "scipy not installed (erf)"),
        gelu_op("tanh", numpy_gelu_tanh),
    ]


def as_numpy(y) -> np.ndarray:
    if torch is not None and isinstance(y, torch.Tensor):
        return y.float().numpy()
    return np.asarray(y, dtype=np.float32)


def check(op: Op, impl: str, got, want, dtype: str) -> float:
    """Max abs error against the reference; exits loudly past the tolerance."""
    got, want = as_numpy(got), as_numpy(want)
    tol = TOLERANCE[dtype]
    err = np.abs(got - want)
    bad = ~(err <= tol + tol * np.abs(want))  # NaN counts as bad
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise SystemExit(
            f"\n*** WRONG RESULT: {impl} {op.name} {dtype}{list(got.shape)}: {int(bad.sum())} elements "
            f"outside rtol=atol={tol}; first at {tuple(int(j) for j in i)}: got {got[i]!r}, "
            f"reference {want[i]!r}; max abs error {float(np.nanmax(err))!r} ***\n"
            "Not timing a wrong kernel.")
    return float(err.max())


def reference(op: Op, x_np, w_np, x_t, w_t):
    """torch eager's answer; without torch, the numpy formula in float64."""
    if torch is not None:
        return op.torch_plain(x_t, w_t)
    if op.numpy is None:
        raise SystemExit(f"no reference for {op.name}: install torch or scipy")
    out = np.empty(x_np.shape, np.float64)
    op.numpy(x_np.astype(np.float64), w_np.astype(np.float64), out)
    return out


def build_impls(op: Op, x_np, x_t, w_np, w_t, dtype: str, use_compile: bool, compile_skip: str):
    """The four implementations bound to their inputs and output buffers,
    each run and checked once against the reference."""
    ours_x, ours_w = (x_np, w_np) if x_np is not None else (x_t, w_t)
    ours_out = np.empty_like(ours_x) if isinstance(ours_x, np.ndarray) else torch.empty_like(ours_x)
    impls = {"tensor_ops": Impl(lambda: op.ours(ours_x, ours_w, ours_out),
                                note=f"{type(ours_x).__module__} input, out=")}

    if x_np is None:
        impls["numpy"] = Impl(skipped=f"numpy has no {dtype}")
    elif op.numpy is None:
        impls["numpy"] = Impl(skipped=op.numpy_skip)
    else:
        np_out = np.empty_like(x_np)
        impls["numpy"] = Impl(lambda: op.numpy(x_np, w_np, np_out), note="1 thread, out= on last step")

    if torch is None:
        impls["torch eager"] = impls["torch.compile"] = Impl(skipped="torch not installed")
    else:
        if op.torch_out is not None:
            eager_out = torch.empty_like(x_t)
            impls["torch eager"] = Impl(lambda: op.torch_out(x_t, w_t, eager_out), note="aten .out")
        else:
            impls["torch eager"] = Impl(lambda: op.torch_plain(x_t, w_t), note="no out= overload: allocates per call")
        impls["torch.compile"] = compiled_impl(op, x_t, w_t) if use_compile else Impl(skipped=compile_skip)

    want = reference(op, x_np, w_np, x_t, w_t)
    for name, impl in impls.items():
        if impl.run is not None:
            impl.max_abs_err = check(op, name, impl.run(), want, dtype)
    return impls


def compiled_impl(op: Op, x_t, w_t) -> Impl:
    """torch.compile of the eager op writing into a preallocated output;
    inductor fuses the copy_ into its kernel (one pass, as eager's .out)."""
    def into(x, w, out):
        out.copy_(op.torch_plain(x, w))

    out = torch.empty_like(x_t)
    try:
        fn = torch.compile(into, fullgraph=True, dynamic=False)
        fn(x_t, w_t, out)  # compiles
    except Exception as e:  # any compile failure: report and go on without it
        msg = (str(e).strip().splitlines() or [""])[0][:120]
        return Impl(skipped=f"compile failed: {type(e).__name__}: {msg}")

    def run():
        fn(x_t, w_t, out)
        return out

    return Impl(run, note="copy_ into out, fused")


def time_round_robin(impls: Dict[str, Impl], reps: int) -> Dict[str, List[float]]:
    """Each rep runs every implementation once, starting at a rotating one,
    so drifting noise on a shared machine lands on all of them alike."""
    names = [n for n, i in impls.items() if i.run is not None]
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for n in names:  # warm-up past the correctness call
        impls[n].run()
    gc.disable()
    try:
        for r in range(reps):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                run = impls[n].run
                t0 = time.perf_counter()
                run()
                samples[n].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return samples


def ms(s: float) -> str:
    """Milliseconds to 3 significant figures, no exponent."""
    v = s * 1e3
    return f"{v:.{max(0, 2 - math.floor(math.log10(v)))}f}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs=2, type=int, metavar=("R", "C"), help="default 4096 4096 (256 1024 with --quick)")
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per implementation (default 20)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run in seconds: small cache-resident shape, short triad, no torch.compile")
    args = p.parse_args(argv)
    args.shape = tuple(args.shape or ((256, 1024) if args.quick else (4096, 4096)))
    if min(args.shape) < 1 or args.reps < 4:
        p.error(f"--shape must be positive and --reps >= 4, got shape {args.shape}, reps {args.reps}")
    if torch is None and args.dtype == "bfloat16":
        p.error("--dtype bfloat16 needs torch (numpy has no bfloat16)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    info = tensor_ops.get_backend_info()
    if "cpu" not in info:
        raise SystemExit(f"this benchmark measures the cpu backend; tensor_ops selected {info['backend']!r} "
                         "(run with TENSOR_OPS_BACKEND=cpu)")
    threads = info["cpu"]["num_threads"]
    if torch is not None:
        torch.set_num_threads(threads)  # before torch.compile: inductor bakes the count into its kernels
    rows, cols = args.shape
    itemsize = 2 if args.dtype in ("float16", "bfloat16") else 4
    op_bytes = 2 * rows * cols * itemsize  # read x + write y; the weight row is negligible

    triad = measure_triad(threads, 5 if args.quick else args.reps)

    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((rows, cols), dtype=np.float32)
    w32 = (rng.random(cols, dtype=np.float32) + 0.5).astype(np.float32)
    if torch is not None:
        tdtype = getattr(torch, args.dtype)
        x_t, w_t = torch.from_numpy(x32).to(tdtype), torch.from_numpy(w32).to(tdtype)
    else:
        x_t = w_t = None
    if args.dtype == "bfloat16":
        x_np = w_np = None  # numpy skipped; tensor_ops takes the torch tensors
    elif x_t is not None:
        x_np, w_np = x_t.numpy(), w_t.numpy()  # same memory as the torch inputs
    else:
        x_np, w_np = x32.astype(args.dtype), w32.astype(args.dtype)

    use_compile = torch is not None and not args.quick
    compile_skip = "skipped by --quick" if torch is not None else "torch not installed"
    results = {}
    for op in make_ops():
        impls = build_impls(op, x_np, x_t, w_np, w_t, args.dtype, use_compile, compile_skip)
        samples = time_round_robin(impls, args.reps)
        entry = {"bytes": op_bytes, "impls": {}}
        for name in IMPLS:
            impl = impls[name]
            if impl.run is None:
                entry["impls"][name] = {"skipped": impl.skipped}
                continue
            stats = summarize(samples[name])
            gbps = op_bytes / stats["median_s"] / 1e9
            entry["impls"][name] = {**stats, "gbps": gbps, "pct_triad": 100 * gbps / triad["gbps"],
                                    "max_abs_err": impl.max_abs_err, "note": impl.note,
                                    "samples_s": samples[name]}
        ours = entry["impls"]["tensor_ops"]["median_s"]
        entry["tensor_ops_speedup"] = {n: r["median_s"] / ours for n, r in entry["impls"].items()
                                       if "median_s" in r and n != "tensor_ops"}
        results[op.name] = entry

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": [rows, cols], "dtype": args.dtype, "reps": args.reps, "quick": args.quick,
        "threads": threads, "isa": info["cpu"]["isa"], "cpu": platform.processor() or platform.machine(),
        "versions": {"python": platform.python_version(), "tensor_ops": tensor_ops.__version__,
                     "numpy": np.__version__, "torch": torch.__version__ if torch else None,
                     "scipy": sys.modules["scipy"].__version__ if "scipy" in sys.modules else None},
        "bytes_per_op": op_bytes, "triad": triad, "ops": results,
    }
    out_dir = pathlib.Path(__file__).resolve().parent / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"ops_{args.dtype}_{rows}x{cols}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print_report(report, path)
    return 0


def print_report(report, path) -> None:
    t = report["triad"]
    rows, cols = report["shape"]
    mib = report["bytes_per_op"] / 2**20
    print(f"\n## tensor_ops vs peers: {report['dtype']}[{rows}, {cols}], {report['threads']} threads "
          f"({report['isa']}), median of {report['reps']}, round-robin\n")
    print(f"Triad bandwidth ({t['impl']}, 3 x {t['elements'] * 4 // 2**20} MiB): **{t['gbps']:.1f} GB/s** "
          f"median (range {t['gbps_min']:.1f}–{t['gbps_max']:.1f})" + (f" — {t['note']}" if t["note"] else ""))
    print(f"Bytes per op: read x + write y = {mib:.1f} MiB. Speedup = impl median / tensor_ops median "
          "(> 1: tensor_ops faster).\n")
    print("| op | impl | median ms | p25–p75 ms | min–max ms | GB/s | % triad | tensor_ops speedup | note |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for op, entry in report["ops"].items():
        for name, r in entry["impls"].items():
            if "skipped" in r:
                print(f"| {op} | {name} | — | — | — | — | — | — | skipped: {r['skipped']} |")
                continue
            speedup = entry["tensor_ops_speedup"].get(name)
            print(f"| {op} | {name} | {ms(r['median_s'])} | {ms(r['p25_s'])}–{ms(r['p75_s'])} "
                  f"| {ms(r['min_s'])}–{ms(r['max_s'])} | {r['gbps']:.1f} | {r['pct_triad']:.0f}% "
                  f"| {'—' if speedup is None else f'{speedup:.2f}x'} | {r['note']} |")
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    sys.exit(main())
