"""Fused Linear + activation on the CPU: tensor_ops.torch.FusedLinearGELU /
FusedLinearSiLU against torch's nn.Linear then the activation (F.gelu /
F.silu), float32, forward under torch.no_grad (the inference path: torch's
addmm, then our activation in place on its output), and forward + backward
(the training path).

    python bench/bench_fused_linear.py [--reps R] [--quick] [--threads N]

Both sides use the same weights, inputs and thread count (torch's intra-op
threads = tensor_ops' CPU threads = N, default: the CPUs this process may
use). Implementations alternate round-robin over R repetitions; each sample
is the time of one call (short calls are looped and divided). The table gives
the median with p25-p75 and the speedup (torch median / ours); writes
bench/out/fused_linear.json and the "fused_linear" section of
bench/RESULTS.md (not with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

import tensor_ops
import tensor_ops.torch as tt
from results_md import machine, write_section

SHAPES = [(32, 1024, 4096), (512, 1024, 4096), (2048, 768, 3072)]  # (tokens, in_features, out_features)
ACTS = {"gelu": lambda h: F.gelu(h), "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "silu": F.silu}


def _module(act: str, n_in: int, n_out: int):
    if act == "silu":
        return tt.FusedLinearSiLU(n_in, n_out)
    return tt.FusedLinearGELU(n_in, n_out, approximate="tanh" if act == "gelu_tanh" else "none")


def _sample(fn, min_s: float = 0.02) -> float:
    """Seconds per call: looped until a sample takes min_s."""
    n, t = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - start
        if t >= min_s:
            return t / n
        n *= 2


def _stats(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median_ms": 1e3 * statistics.median(xs), "p25_ms": 1e3 * q[0], "p75_ms": 1e3 * q[2],
            "samples_ms": [1e3 * x for x in xs]}


def run(reps: int, shapes, acts, modes):
    rows = []
    for tokens, n_in, n_out in shapes:
        for act in acts:
            torch.manual_seed(0)
            fused = _module(act, n_in, n_out)
            ref_act = ACTS[act]
            for mode in modes:
                x = torch.randn(tokens, n_in, requires_grad=(mode == "fwd+bwd"))
                gy = torch.randn(tokens, n_out)

                def ours():
                    if mode == "fwd":
                        with torch.no_grad():
                            return fused(x)
                    fused(x).backward(gy)

                def theirs():
                    if mode == "fwd":
                        with torch.no_grad():
                            return ref_act(F.linear(x, fused.weight, fused.bias))
                    ref_act(F.linear(x, fused.weight, fused.bias)).backward(gy)

                with torch.no_grad():
                    err = (fused(x) - ref_act(F.linear(x, fused.weight, fused.bias))).abs().max().item()
                impls = {"tensor_ops fused": ours, "torch Linear then act": theirs}
                for fn in impls.values():
                    fn()  # warm-up
                samples = {k: [] for k in impls}
                names = list(impls)
                for r in range(reps):
                    for i in range(len(names)):
                        name = names[(r + i) % len(names)]
                        samples[name].append(_sample(impls[name]))
                ours_s, theirs_s = _stats(samples[names[0]]), _stats(samples[names[1]])
                rows.append({"shape": [tokens, n_in, n_out], "activation": act, "mode": mode,
                             "max_abs_error": err, "ours": ours_s, "torch": theirs_s,
                             "speedup": theirs_s["median_ms"] / ours_s["median_ms"]})
                print(f"{tokens}x{n_in}->{n_out} {act:9s} {mode:7s} ours {ours_s['median_ms']:8.3f} ms  "
                      f"torch {theirs_s['median_ms']:8.3f} ms  x{rows[-1]['speedup']:.2f}", flush=True)
    return rows


def markdown(rows, threads: int, reps: int) -> str:
    lines = [f"## Fused Linear + activation (CPU, float32): `bench_fused_linear.py`", "",
             f"{machine()} · {threads} threads (torch and tensor_ops) · {reps} round-robin reps · "
             f"torch {torch.__version__}", "",
             "ours: `FusedLinearGELU` / `FusedLinearSiLU` (torch's addmm, then our activation kernel in "
             "place under no_grad; with autograd, out of place, then our activation_backward (torch's gelu_backward for erf GELU)). torch: "
             "`F.linear` then `F.gelu` / `F.silu`. Median ms (p25-p75); speedup = torch / ours.", "",
             "| tokens x in -> out | activation | pass | tensor_ops fused ms | torch Linear then act ms | speedup |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        o, t = r["ours"], r["torch"]
        lines.append(f"| {r['shape'][0]} x {r['shape'][1]} -> {r['shape'][2]} | {r['activation']} | {r['mode']} | "
                     f"{o['median_ms']:.3f} ({o['p25_ms']:.3f}-{o['p75_ms']:.3f}) | "
                     f"{t['median_ms']:.3f} ({t['p25_ms']:.3f}-{t['p75_ms']:.3f}) | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--quick", action="store_true", help="one shape, 3 reps, forward only, no RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tensor_ops.TensorOpsConfig(backend="cpu", cpu=tensor_ops.config.CPUConfig(threads=args.threads)).apply()
    shapes, reps, modes = (SHAPES[:1], 3, ["fwd"]) if args.quick else (SHAPES, args.reps, ["fwd", "fwd+bwd"])
    rows = run(reps, shapes, list(ACTS), modes)
    md = markdown(rows, args.threads, reps)
    print(md)
    out = pathlib.Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "fused_linear.json").write_text(json.dumps({"threads": args.threads, "reps": reps, "rows": rows},
                                                      indent=1))
    if not args.quick:
        print(f"Section written to {write_section('fused_linear', '4 fused_linear', md)}")


if __name__ == "__main__":
    main()
