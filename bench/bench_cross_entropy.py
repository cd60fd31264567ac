"""Cross-entropy on the CPU: tensor_ops against torch's F.cross_entropy (eager
and torch.compile), forward alone and forward + backward, with GB/s against
a STREAM triad measured in the same run.

    python bench/bench_cross_entropy.py [--shapes NxC ...] [--dtypes D ...]
                                        [--threads T ...] [--reps R] [--gap-ms MS] [--quick]

Default: [1024, 32000] and [4096, 32000], float32 and bfloat16, 1 and 2
threads (torch.set_num_threads and tensor_ops' CPU threads alike), median of
R round-robin samples (bench_ops' time_round_robin: each sample after an idle
gap, starting at a rotating implementation; the triad is one more
implementation in the round-robin). Every implementation is a plain call on
torch tensors (outputs allocated per call, as a training step does):

- forward: tensor_ops.cross_entropy; F.cross_entropy; torch.compile of it.
- forward + backward: tensor_ops.cross_entropy_with_grad (the gradient
  written in the forward pass; `inplace`: into the logits' own buffer);
  tensor_ops.torch.cross_entropy(...).backward() (the autograd drop-in);
  F.cross_entropy(...).backward(); torch.compile of that.

GB/s counts the logits read once (forward) plus the gradient written once
(forward + backward). Writes bench/out/cross_entropy.json and, without
--quick, the "cross_entropy" section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

import tensor_ops
import tensor_ops.torch as tt
from tensor_ops import _C

from bench_ops import GAP_MS, TRIAD, Impl, make_triad, summarize, time_round_robin, triad_stats
from results_md import machine, write_section

BENCH = pathlib.Path(__file__).resolve().parent
SHAPES = ((1024, 32000), (4096, 32000))
DTYPES = ("float32", "bfloat16")
THREADS = (1, 2)
GOAL_PCT_TRIAD, GOAL_VS_EAGER = 90.0, 3.0


def inputs(n, c, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, c, generator=g) * 2).to(getattr(torch, dtype))
    t = torch.randint(0, c, (n,), generator=g)
    t[::17] = -100
    return x, t


def impls_forward(x, t):
    compiled = torch.compile(lambda a, b: F.cross_entropy(a, b))
    return {
        "tensor_ops": Impl(run=lambda: tensor_ops.cross_entropy(x, t)),
        "torch eager": Impl(run=lambda: F.cross_entropy(x, t)),
        "torch.compile": Impl(run=lambda: compiled(x, t)),
    }


def impls_backward(x, t):
    xg = x.clone().requires_grad_()
    buf = x.clone()

    def eager():
        xg.grad = None
        F.cross_entropy(xg, t).backward()
        return xg.grad

    compiled_loss = torch.compile(lambda a, b: F.cross_entropy(a, b))

    def compiled():
        xg.grad = None
        compiled_loss(xg, t).backward()
        return xg.grad

    def dropin():
        xg.grad = None
        tt.cross_entropy(xg, t).backward()
        return xg.grad

    def inplace():  # the buffer holds gradients after the first call: same work, other values
        return tensor_ops.cross_entropy_with_grad(buf, t, inplace=True)[1]

    return {
        "tensor_ops": Impl(run=lambda: tensor_ops.cross_entropy_with_grad(x, t)[1]),
        "tensor_ops inplace": Impl(run=inplace),
        "tensor_ops.torch autograd": Impl(run=dropin),
        "torch eager": Impl(run=eager),
        "torch.compile": Impl(run=compiled),
    }


def check(x, t):
    """Ours against float64 torch autograd, forward and gradient (max abs error)."""
    ref = x.double().requires_grad_()
    loss = F.cross_entropy(ref, t)
    loss.backward()
    got, dl = tensor_ops.cross_entropy_with_grad(x, t)
    buf = x.clone()
    tensor_ops.cross_entropy_with_grad(buf, t, inplace=True)
    return {"loss_err": abs(float(got) - float(loss.detach())),
            "grad_err": float((dl.double() - ref.grad).abs().max()),
            "inplace_grad_err": float((buf.double() - ref.grad).abs().max())}


def run_case(n, c, dtype, threads, mode, args, triad_run, triad_meta):
    x, t = inputs(n, c, dtype)
    impls = impls_forward(x, t) if mode == "forward" else impls_backward(x, t)
    impls[TRIAD] = Impl(run=triad_run)
    samples, _ = time_round_robin(impls, args.reps, args.gap_ms / 1e3)
    triad = triad_stats(triad_meta, samples.pop(TRIAD))
    item = x.element_size()
    nbytes = n * c * item * (1 if mode == "forward" else 2)
    eager = summarize(samples["torch eager"])["median_s"]
    rows = {}
    for name, s in samples.items():
        st = summarize(s)
        gbps = nbytes / st["median_s"] / 1e9
        rows[name] = {**st, "samples_s": s, "gbps": gbps, "pct_triad": 100 * gbps / triad["gbps"],
                      "vs_eager": eager / st["median_s"]}
    return {"shape": [n, c], "dtype": dtype, "threads": threads, "mode": mode, "bytes": nbytes,
            "triad_gbps": triad["gbps"], "impls": rows}


def table(results):
    lines = ["| shape | dtype | threads | mode | impl | median ms (p25-p75) | GB/s | % triad | vs eager |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, v in r["impls"].items():
            lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['threads']} | {r['mode']} | {name} | "
                         f"{1e3 * v['median_s']:.1f} ({1e3 * v['p25_s']:.1f}-{1e3 * v['p75_s']:.1f}) | "
                         f"{v['gbps']:.1f} | {v['pct_triad']:.0f}% | {v['vs_eager']:.2f}x |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=[f"{n}x{c}" for n, c in SHAPES])
    p.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    p.add_argument("--threads", nargs="*", type=int, default=list(THREADS))
    p.add_argument("--modes", nargs="*", default=["forward", "forward+backward"], choices=["forward", "forward+backward"])
    p.add_argument("--reps", type=int, default=None, help="samples per implementation (default 7; --quick: 3)")
    p.add_argument("--gap-ms", type=float, default=GAP_MS)
    p.add_argument("--quick", action="store_true", help="256x32000, float32, 3 reps; RESULTS.md untouched")
    explicit = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
    args = p.parse_args()
    if args.quick:  # what --shapes / --dtypes / --reps leave unset (they were overridden silently)
        args.shapes = args.shapes if "--shapes" in explicit else ["256x32000"]
        args.dtypes = args.dtypes if "--dtypes" in explicit else ["float32"]
    args.reps = (3 if args.quick else 7) if args.reps is None else args.reps
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    mach = machine()
    results, checks = [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)  # before torch.compile: inductor bakes the count into its kernels
        _C.cpu_set_num_threads(threads)
        torch._dynamo.reset()
        triad_run, triad_meta = make_triad(threads)
        for shape in args.shapes:
            n, c = (int(v) for v in shape.split("x"))
            for dtype in args.dtypes:
                if threads == args.threads[0]:
                    checks[f"{shape} {dtype}"] = check(*inputs(n, c, dtype))
                for mode in args.modes:
                    r = run_case(n, c, dtype, threads, mode, args, triad_run, triad_meta)
                    results.append(r)
                    print(table([r]).split("\n", 2)[-1], flush=True)
    md = (f"## cross_entropy vs F.cross_entropy (eager, torch.compile)\n\n{mach}\n\n"
          f"`python bench/bench_cross_entropy.py {' '.join(sys.argv[1:])}`; plain calls on torch tensors, "
          f"median of {args.reps} round-robin samples ({args.gap_ms:g} ms idle gap), triad in the same round-robin. "
          f"Goals (issue 16): forward >= {GOAL_PCT_TRIAD:.0f}% of triad at 4096x32000 float32, "
          f"forward+backward >= {GOAL_VS_EAGER:.0f}x torch eager.\n\n{table(results)}\n\n"
          f"Max abs error vs float64 torch autograd: "
          + "; ".join(f"{k}: loss {v['loss_err']:.2g}, grad {v['grad_err']:.2g}, in place {v['inplace_grad_err']:.2g}"
                      for k, v in checks.items()) + "\n")
    print("\n" + md)
    out = BENCH / "out"
    out.mkdir(exist_ok=True)
    (out / "cross_entropy.json").write_text(json.dumps({"machine": mach, "results": results, "checks": checks},
                                                      indent=1))
    if not args.quick:
        write_section("cross_entropy", "1 ops cross_entropy", md)


if __name__ == "__main__":
    main()
