"""Small-call latency: one 1x64 float32 call through the Python API, tensor_ops
(numpy and torch inputs) against numpy, torch eager and torch.compile.

    python bench/bench_latency.py [--number N] [--repeat R] [--no-compile] [--quick]

Every implementation makes the plain call a user makes (outputs allocated per
call). Each sample times N calls with timeit (garbage collector off) and
divides; implementations alternate round-robin over R samples; the table
gives the median and the minimum per call. Goal: tensor_ops <= 2 us. Prints a
markdown table, writes bench/out/latency.json and the "latency" section of
bench/RESULTS.md (not with --quick).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import timeit
from typing import Callable, Dict, List

import numpy as np

import tensor_ops

from bench_ops import BENCH, TOLERANCE, Op, as_tuple, make_ops, summarize
from results_md import machine, write_section

try:
    import torch
except ImportError:
    torch = None

SHAPE = (1, 64)
OPS = ("rms_norm", "silu", "softmax", "swiglu", "add_rms_norm")
IMPLS = ("tensor_ops (numpy in)", "tensor_ops (torch in)", "numpy", "torch eager", "torch.compile")
GOAL_US = 2.0


def bind(op: Op, np_args: tuple, t_args: tuple, use_compile: bool) -> Dict[str, object]:
    """name -> zero-argument call, or a string saying why it is skipped."""
    def numpy_call():
        return op.numpy(*np_args, *[np.empty(SHAPE, np.float32) for _ in range(op.outputs)])

    calls: Dict[str, object] = {
        "tensor_ops (numpy in)": lambda: op.plain(*np_args),
        "numpy": numpy_call,
    }
    if torch is None:
        for name in IMPLS:
            calls.setdefault(name, "torch not installed")
        return calls
    calls["tensor_ops (torch in)"] = lambda: op.plain(*t_args)
    calls["torch eager"] = lambda: op.torch_plain(*t_args)
    if not use_compile:
        calls["torch.compile"] = "skipped (--no-compile or --quick)"
        return calls
    try:
        fn = torch.compile(op.torch_plain, fullgraph=True, dynamic=False)
        fn(*t_args)  # compiles
        calls["torch.compile"] = lambda: fn(*t_args)
    except Exception as e:  # any compile failure: report and go on without it
        calls["torch.compile"] = f"compile failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"
    return calls


def check(op: Op, calls: Dict[str, object]) -> None:
    """Every implementation agrees with torch eager (or numpy without torch)."""
    ref_name = "torch eager" if callable(calls.get("torch eager")) else "numpy"
    want = [np.asarray(v, dtype=np.float64) for v in as_tuple(calls[ref_name]())]
    for name, call in calls.items():
        if not callable(call):
            continue
        got = [np.asarray(v.detach() if torch is not None and isinstance(v, torch.Tensor) else v, dtype=np.float64)
               for v in as_tuple(call())]
        for g, w in zip(got, want):
            if not np.allclose(g, w, rtol=TOLERANCE["float32"], atol=TOLERANCE["float32"]):
                raise SystemExit(f"*** WRONG RESULT: {name} {op.name} 1x64: max abs error "
                                 f"{float(np.abs(g - w).max())!r} against {ref_name} ***")


def time_round_robin(calls: Dict[str, Callable], number: int, repeat: int) -> Dict[str, List[float]]:
    names = list(calls)
    timers = {n: timeit.Timer(calls[n]) for n in names}
    for n in names:
        timers[n].timeit(number)  # warm-up
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(repeat):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(timers[n].timeit(number) / number)
    return samples


def markdown(report: dict) -> str:
    lines = [
        "## Small-call latency: float32[1, 64]", "",
        f"{report['machine']} · tensor_ops and torch on {report['threads']} threads · "
        f"{report['repeat']} samples of {report['number']} calls, round-robin · `{report['command']}`", "",
        "Plain calls (outputs allocated per call), per call in µs. Goal: tensor_ops ≤ "
        f"{GOAL_US:g} µs (median). torch.compile pays its guard checks and wrapper on every call.", "",
        "| op | impl | median µs | p25–p75 µs | min µs | vs tensor_ops (numpy in) | goal ≤2 µs |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for op, impls in report["ops"].items():
        base = impls["tensor_ops (numpy in)"].get("median_s")
        for name, r in impls.items():
            if "skipped" in r:
                lines.append(f"| {op} | {name} | — | — | — | — | skipped: {r['skipped']} |")
                continue
            goal = ""
            if name.startswith("tensor_ops"):
                goal = ("yes" if r["median_s"] * 1e6 <= GOAL_US else "**no**") + f" ({r['median_s'] * 1e6:.2f} µs)"
            lines.append(f"| {op} | {name} | {r['median_s'] * 1e6:.2f} | {r['p25_s'] * 1e6:.2f}–{r['p75_s'] * 1e6:.2f} "
                         f"| {r['min_s'] * 1e6:.2f} | {r['median_s'] / base:.2f}x | {goal} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, help="calls per sample (default 2000, 200 with --quick)")
    p.add_argument("--repeat", type=int, help="samples per implementation (default 25, 5 with --quick)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (saves its compile time)")
    p.add_argument("--quick", action="store_true", help="smoke run: few calls, no torch.compile, RESULTS.md left alone")
    args = p.parse_args(argv)
    args.number = (200 if args.quick else 2000) if args.number is None else args.number  # 0 is refused below
    args.repeat = (5 if args.quick else 25) if args.repeat is None else args.repeat
    if args.number < 1 or args.repeat < 4:
        p.error(f"--number must be >= 1 and --repeat >= 4, got {args.number}, {args.repeat}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = tensor_ops.get_backend_info()["cpu"]["num_threads"]
    if torch is not None:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    base = {"x": rng.standard_normal(SHAPE, dtype=np.float32), "r": rng.standard_normal(SHAPE, dtype=np.float32),
            "w": (rng.random(SHAPE[1], dtype=np.float32) + 0.5).astype(np.float32)}
    t_base = {k: torch.from_numpy(v.copy()) for k, v in base.items()} if torch is not None else {}
    mach = machine()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": mach, "threads": threads, "shape": list(SHAPE), "number": args.number,
              "repeat": args.repeat,
              "command": " ".join(["python bench/bench_latency.py", *(sys.argv[1:] if argv is None else argv)]),
              "versions": {"tensor_ops": tensor_ops.__version__, "numpy": np.__version__,
                           "torch": torch.__version__ if torch else None},
              "ops": {}}
    for op in (o for o in make_ops() if o.name in OPS):
        print(f"  {op.name} ...", file=sys.stderr, flush=True)
        np_args = tuple(base[a] for a in op.args)
        t_args = tuple(t_base[a] for a in op.args) if torch is not None else ()
        calls = bind(op, np_args, t_args, use_compile=not (args.quick or args.no_compile))
        check(op, calls)
        samples = time_round_robin({n: c for n, c in calls.items() if callable(c)}, args.number, args.repeat)
        report["ops"][op.name] = {n: ({**summarize(samples[n]), "samples_s": samples[n]} if callable(calls[n])
                                      else {"skipped": calls[n]}) for n in IMPLS}
    out = BENCH / "out"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "latency.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    print("\n" + md + f"\nJSON: {path}")
    if args.quick:
        print("(--quick: bench/RESULTS.md left alone)")
    else:
        print(f"Section written to {write_section('latency', '2 latency', md)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
