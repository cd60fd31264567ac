"""python -m tensor_ops: the main job.

Detects devices and backends, runs every op on every usable backend (or the
one --backend names), checks each against a numpy float64 reference, and
prints a speed table against numpy, torch eager and torch.compile (when
installed) with each implementation's share of the memory bandwidth (a
STREAM triad), all measured side by side in this run. --json writes every
number, --plot a bar chart of the bandwidth shares.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import tensor_ops
from tensor_ops._cli_progress import track

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

EPS_RMS, EPS_LN = 1e-6, 1e-5
TRIAD_ELEMENTS = 1 << 25  # 128 MiB of float32 per array: well past any L3
TRIAD_ELEMENTS_QUICK = 1 << 23


def _erf64(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _rms64(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS_RMS) * w


def _silu(x):
    return x / (1 + np.exp(-x))


@dataclasses.dataclass
class Op:
    """One op of the job: its inputs (x: [rows, cols]; u: a second array of
    x's shape; w: a [cols] weight), the full-size arrays it moves (for GB/s),
    a float64 reference of its first output, and each implementation (each
    call returns fresh outputs, as `y = op(x)` does)."""
    name: str
    inputs: str
    arrays: int
    reference: Callable
    ours: Callable
    numpy: Optional[Callable] = None
    torch: Optional[Callable] = None


def ops() -> List[Op]:
    def np_rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + np.float32(EPS_RMS)) * w

    def np_layer_norm(x, w):
        m = x.mean(-1, keepdims=True)
        return (x - m) / np.sqrt(x.var(-1, keepdims=True) + np.float32(EPS_LN)) * w

    def np_softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def np_gelu_tanh(x):
        c = np.float32(math.sqrt(2 / math.pi))
        return 0.5 * x * (1 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))

    def np_add_rms(x, u, w):
        r = x + u
        return np_rms(r, w), r

    def t_add_rms(x, u, w):
        r = x + u
        return F.rms_norm(r, (r.shape[-1],), w, EPS_RMS), r

    t = torch is not None
    return [
        Op("rms_norm", "xw", 2, _rms64, lambda x, w: tensor_ops.rms_norm(x, w, EPS_RMS), np_rms,
           (lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS_RMS)) if t else None),
        Op("silu", "x", 2, _silu, tensor_ops.silu, lambda x: x / (1 + np.exp(-x)), F.silu if t else None),
        Op("gelu", "x", 2, lambda x: 0.5 * x * (1 + _erf64(x / math.sqrt(2))), tensor_ops.gelu, None,
           F.gelu if t else None),
        Op("gelu_tanh", "x", 2,
           lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
           lambda x: tensor_ops.gelu(x, "tanh"), np_gelu_tanh,
           (lambda x: F.gelu(x, approximate="tanh")) if t else None),
        Op("layer_norm", "xw", 2,
           lambda x, w: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS_LN) * w,
           lambda x, w: tensor_ops.layer_norm(x, w, None, EPS_LN), np_layer_norm,
           (lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None, EPS_LN)) if t else None),
        Op("softmax", "x", 2, lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(
            x - x.max(-1, keepdims=True)).sum(-1, keepdims=True), tensor_ops.softmax, np_softmax,
           (lambda x: torch.softmax(x, -1)) if t else None),
        Op("swiglu", "xu", 3, lambda x, u: _silu(x) * u, tensor_ops.swiglu, lambda x, u: x / (1 + np.exp(-x)) * u,
           (lambda x, u: F.silu(x) * u) if t else None),
        Op("add_rms_norm", "xuw", 4, lambda x, u, w: _rms64(x + u, w), lambda x, u, w: tensor_ops.add_rms_norm(
            x, u, w, EPS_RMS), np_add_rms, t_add_rms if t else None),
    ]


def first(y):
    return y[0] if isinstance(y, tuple) else y


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def time_samples(fn: Callable[[], Any], reps: int) -> List[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def spread(samples: List[float]) -> Dict[str, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "p25_s": q[0], "p75_s": q[2]}


def make_triad(elements: int) -> Tuple[Callable[[], Any], Dict[str, Any]]:
    """STREAM triad a = b + s*c and the bytes it moves (3 arrays, as STREAM
    counts them; numpy has no fused triad: two passes move 5)."""
    if torch is not None:
        a, b, c = torch.empty(elements), torch.full((elements,), 1.0), torch.full((elements,), 2.0)
        return (lambda: torch.add(b, c, alpha=3.0, out=a)), {
            "impl": f"torch.add(out=), {torch.get_num_threads()} threads", "bytes": 3 * 4 * elements}
    a, b, c = (np.empty(elements, np.float32), np.full(elements, 1.0, np.float32),
               np.full(elements, 2.0, np.float32))

    def triad():
        np.multiply(c, 3.0, out=a)
        np.add(a, b, out=a)

    return triad, {"impl": "numpy (2 passes), 1 thread", "bytes": 5 * 4 * elements}


def print_table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tensor_ops", description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=None, metavar=("ROWS", "COLS"),
                   help="the ops' input shape (default 2048 4096; --quick: 64 1024)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per op (default 10; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="small shape, few repetitions, a smaller triad")
    p.add_argument("--backend", metavar="NAME", help="run only this backend (see the Backends table)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out of the speed table")
    p.add_argument("--json", metavar="FILE", help="write the checks, timings and triad as JSON")
    p.add_argument("--plot", metavar="FILE", help="plot each op's %% of the measured bandwidth (matplotlib)")
    p.add_argument("--cmake-dir", action="store_true",
                   help="print the folder of tensor_opsConfig.cmake (for -Dtensor_ops_DIR=...) and exit")
    p.add_argument("--include", action="store_true", help="print the C/C++ include folder and exit")
    args = p.parse_args(argv)
    # --quick sets what --shape / --reps leave unset (it overrode them silently)
    if args.shape is None:
        args.shape = [64, 1024] if args.quick else [2048, 4096]
    if args.reps is None:
        args.reps = 3 if args.quick else 10
    if min(args.shape) < 1:
        p.error(f"--shape needs two dimensions >= 1, got {args.shape[0]} {args.shape[1]}")
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and (path.endswith(os.sep) or os.path.isdir(path)):
            p.error(f"{flag} {path}: a file name is needed, not a folder")
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            p.error(f"{flag} {path}: the folder {folder} does not exist or is not writable")  # before the run
    return args


def select_backends(name: Optional[str]) -> List[str]:
    for _ in track(["loading plugins, listing devices"], "probing backends"):
        all_backends = tensor_ops.backends()
        tensor_ops.devices()
    if name is None:
        return [b.name for b in all_backends if b.usable]
    for b in all_backends:
        if b.name == name:
            if not b.usable:
                raise SystemExit(f"--backend {name}: not usable here: {b.reason}")
            return [name]
    raise SystemExit(f"--backend {name}: no such backend (have: {', '.join(b.name for b in all_backends)})")


def check(backends: List[str], table: List[Op], inputs64, inputs32, failed: List[bool]):
    rows, unsupported = [], set()
    torch_dtypes = [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)] if torch is not None else []
    for backend in backends:
        with tensor_ops.use(backend):
            # The first call on a backend builds its kernels (OpenCL programs,
            # the SYCL JIT): seconds, so it is a step of its own.
            for op in track(table, f"checking on {backend}", lambda o: o.name):
                args = [inputs32[c] for c in op.inputs]
                ref = op.reference(*[inputs64[c] for c in op.inputs])
                try:
                    got = first(op.ours(*args))
                except NotImplementedError:
                    unsupported.add((backend, op.name))
                    rows.append({"backend": backend, "op": op.name, "dtype": "-", "error": None,
                                 "ok": None, "note": "not implemented by this backend"})
                    continue
                err = rel_err(np.asarray(got, np.float64), ref)
                rows.append({"backend": backend, "op": op.name, "dtype": "float32", "error": err, "ok": err < 1e-5})
                for dt, tol in torch_dtypes:
                    targs = [torch.from_numpy(inputs32[c]).to(dt) for c in op.inputs]
                    tref = op.reference(*[a.double().numpy() for a in targs])
                    err = rel_err(first(op.ours(*targs)).double().numpy(), tref)
                    rows.append({"backend": backend, "op": op.name, "dtype": str(dt).split(".")[-1],
                                 "error": err, "ok": err < tol})
    failed[0] = any(r["ok"] is False for r in rows)
    return rows, unsupported


def implementations(backends, unsupported, table: List[Op], inputs32, use_compile: bool):
    """(op, label, backend, call) for every implementation timed; compile
    failures come back as notes."""
    impls, notes = [], []
    targs = {c: torch.from_numpy(a) for c, a in inputs32.items()} if torch is not None else {}
    for op in table:
        args = [inputs32[c] for c in op.inputs]
        for b in backends:
            if (b, op.name) not in unsupported:
                impls.append((op.name, f"tensor_ops[{b}]", b, lambda f=op.ours, a=args: f(*a)))
        if op.numpy is not None:
            impls.append((op.name, "numpy", None, lambda f=op.numpy, a=args: f(*a)))
        if op.torch is not None:
            ta = [targs[c] for c in op.inputs]
            impls.append((op.name, "torch eager", None, lambda f=op.torch, a=ta: f(*a)))
    if torch is not None and use_compile:
        compiled = [op for op in table if op.torch is not None]
        for op in track(compiled, "torch.compile", lambda o: o.name):
            ta = [targs[c] for c in op.inputs]
            torch._dynamo.reset()
            try:
                fn = torch.compile(op.torch, fullgraph=True, dynamic=False)
                fn(*ta)  # compiles: seconds
            except Exception as e:  # any compile failure: say so and go on without it
                notes.append(f"torch.compile {op.name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}")
                continue
            impls.append((op.name, "torch.compile", None, lambda f=fn, a=ta: f(*a)))
    order = {op.name: i for i, op in enumerate(table)}
    impls.sort(key=lambda i: order[i[0]])
    return impls, notes


def speed(backends, unsupported, table: List[Op], inputs32, args) -> Dict[str, Any]:
    impls, notes = implementations(backends, unsupported, table, inputs32, not args.no_compile)
    triad, triad_meta = make_triad(TRIAD_ELEMENTS_QUICK if args.quick else TRIAD_ELEMENTS)
    triad_samples: List[float] = []
    results = []
    arrays = {op.name: op.arrays for op in table}
    nbytes_x = inputs32["x"].nbytes
    # The triad interleaved with the ops: its bandwidth is the machine's at
    # the time the ops ran.
    for op_name, label, backend, call in track(impls, "timing", lambda i: f"{i[0]} / {i[1]}"):
        triad_samples += time_samples(triad, 1)
        if backend:
            with tensor_ops.use(backend):
                samples = time_samples(call, args.reps)
        else:
            samples = time_samples(call, args.reps)
        s = spread(samples)
        nbytes = arrays[op_name] * nbytes_x
        results.append({"op": op_name, "impl": label, "bytes": nbytes, **s, "gbps": nbytes / s["median_s"] / 1e9})
    triad_s = spread(triad_samples)
    triad_gbps = triad_meta["bytes"] / triad_s["median_s"] / 1e9
    for r in results:
        base = {x["impl"]: x["median_s"] for x in results if x["op"] == r["op"]}
        r["vs_torch_eager"] = base["torch eager"] / r["median_s"] if "torch eager" in base else None
        r["vs_torch_compile"] = base["torch.compile"] / r["median_s"] if "torch.compile" in base else None
        r["pct_triad"] = 100 * r["gbps"] / triad_gbps
    return {"results": results, "notes": notes,
            "triad": {**triad_meta, **triad_s, "gbps": triad_gbps, "samples": len(triad_samples)}}


def plot(path: str, sp: Dict[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sp["results"]
    op_names = list(dict.fromkeys(r["op"] for r in results))
    labels = list(dict.fromkeys(r["impl"] for r in results))
    height = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.45 * len(op_names) * max(len(labels), 2) / 2))
    for j, label in enumerate(labels):
        ys, xs = [], []
        for i, name in enumerate(op_names):
            for r in results:
                if r["op"] == name and r["impl"] == label:
                    ys.append(i + (j - (len(labels) - 1) / 2) * height)
                    xs.append(r["pct_triad"])
        ax.barh(ys, xs, height=height, label=label)
    ax.axvline(100, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(op_names)))
    ax.set_yticklabels(op_names)
    ax.invert_yaxis()
    ax.set_xlabel(f"% of the measured STREAM triad bandwidth ({sp['triad']['gbps']:.1f} GB/s, "
                  f"{sp['triad']['impl']})")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cmake_dir or args.include:
        if args.cmake_dir:
            print(tensor_ops.cmake_dir())
        if args.include:
            print(tensor_ops.get_include())
        return 0
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2

    backends = select_backends(args.backend)
    print("== Backends")
    print_table(["backend", "compiled", "usable", "priority", "reason"],
                [[b.name, b.compiled, b.usable, b.priority, b.reason or "-"] for b in tensor_ops.backends()])
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
    print(f"\nSelected backend: {selected}; running on: {', '.join(backends)}")

    rows, cols = args.shape
    rng = np.random.default_rng(0)
    inputs32 = {"x": rng.standard_normal((rows, cols)).astype(np.float32),
                "u": rng.standard_normal((rows, cols)).astype(np.float32),
                "w": rng.standard_normal(cols).astype(np.float32)}
    inputs64 = {k: v.astype(np.float64) for k, v in inputs32.items()}
    table = ops()

    print(f"\n== Correctness vs numpy float64 ({rows}x{cols}, float32, and float16 / bfloat16 via torch)")
    failed = [False]
    checks, unsupported = check(backends, table, inputs64, inputs32, failed)
    print_table(["backend", "op", "dtype", "max err / max|ref|", "check"],
                [[c["backend"], c["op"], c["dtype"], "-" if c["error"] is None else f"{c['error']:.2e}",
                  c.get("note") or ("ok" if c["ok"] else "FAIL")] for c in checks])

    load_before = os.getloadavg()
    sp = speed(backends, unsupported, table, inputs32, args)
    load_after = os.getloadavg()
    sp["load_average"] = {"before": load_before, "after": load_after}
    tr = sp["triad"]
    print(f"\n== Speed, {rows}x{cols} float32, median of {args.reps} (each call returns fresh outputs); "
          f"GB/s = arrays read + written / time; STREAM triad in this run: {tr['gbps']:.1f} GB/s ({tr['impl']}, "
          f"median of {tr['samples']}); an op whose arrays fit in cache can pass 100%; "
          f"vs torch eager / vs torch.compile = torch's time / this row's (> 1: this row is faster). "
          f"Load average (1 min) {load_before[0]:.1f} before the timings, {load_after[0]:.1f} after, on "
          f"{os.cpu_count()} CPUs: other work on the machine slows every row")
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}x"  # noqa: E731
    print_table(["op", "implementation", "ms", "p25-p75 ms", "GB/s", "% triad", "vs torch eager", "vs torch.compile"],
                [[r["op"], r["impl"], f"{r['median_s'] * 1e3:.3f}",
                  f"{r['p25_s'] * 1e3:.3f}-{r['p75_s'] * 1e3:.3f}", f"{r['gbps']:.1f}", f"{r['pct_triad']:.0f}%",
                  fmt(r["vs_torch_eager"]), fmt(r["vs_torch_compile"])] for r in sp["results"]])
    for note in sp["notes"]:
        print(f"note: {note}")
    if torch is None:
        print("note: torch is not installed: no torch eager / torch.compile columns")

    if args.json:
        report = {"shape": [rows, cols], "reps": args.reps, "backends_run": backends,
                  "backends": [b.to_dict() for b in tensor_ops.backends()],
                  "devices": [d.to_dict() for d in tensor_ops.devices()], "checks": checks, "speed": sp,
                  "torch": None if torch is None else torch.__version__, "tensor_ops": tensor_ops.__version__}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(args.plot, sp, f"tensor_ops: {rows}x{cols} float32, median of {args.reps}"
                            f"{' (in cache: can pass 100%)' if args.quick else ''}")
        print(f"wrote {args.plot}")
    if failed[0]:
        print("\nSome checks FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
