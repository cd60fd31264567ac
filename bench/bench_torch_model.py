"""Training-step time of the Llama-style test model (tests/python/
test_torch_integration.py: nn.RMSNorm, q/k/v/o Linear + SDPA, HF-style MLP)
unprepared vs prepared at O1, eager and under torch.compile, on the CPU.

    python bench/bench_torch_model.py [--reps N] [--batch B --seq S]   # defaults: the test's model
                                      [--hidden E --layers L --ffn F --vocab V]
                                      [--dtype float32|bfloat16] [--no-compile]

One step = zero_grad + forward + F.cross_entropy + backward (no optimizer
update, the same for every variant). Variants run round-robin after warm-up
(which includes the compiles); prints a markdown table (median, p25-p75,
min-max, speedup of each prepared variant over its unprepared peer) and writes
bench/out/torch_model_<dtype>_<config>.json. The prepared model must give the
unprepared model's logits (within the dtype's tolerance) before anything is
timed. On a shared 2-core machine run with OMP_NUM_THREADS=1
TENSOR_OPS_NUM_THREADS=1, or OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads
spin after each parallel region and starve tensor_ops' pool (and vice versa),
giving outliers of hundreds of ms to both sides.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import tensor_ops
import tensor_ops.torch as tt

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_torch_integration import tiny_llama  # noqa: E402  (the model the acceptance tests use)

TOLERANCE = {"float32": 1e-4, "bfloat16": 4e-2}


def summarize(samples: List[float]) -> Dict[str, float]:
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return {"median_s": statistics.median(samples), "p25_s": q1, "p75_s": q3, "min_s": min(samples),
            "max_s": max(samples)}


def make_step(model, ids, target) -> Callable[[], float]:
    def step():
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        loss.backward()
        return loss.item()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    # defaults: the acceptance test's model and batch
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=160)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    ap.add_argument("--no-compile", action="store_true", help="eager variants only")
    args = ap.parse_args()
    if args.reps < 10:
        ap.error("--reps must be at least 10 (medians of fewer are noise here)")

    dtype = getattr(torch, args.dtype)
    config = dict(batch=args.batch, seq=args.seq, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                  ffn=args.ffn, layers=args.layers, vocab=args.vocab)
    model = tiny_llama(vocab=args.vocab, E=args.hidden, H=args.heads, Hkv=args.kv_heads, FF=args.ffn,
                       layers=args.layers, max_pos=args.seq).to(dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    target = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    prepared, result = tt.prepare_model(copy.deepcopy(model), "O1")
    with torch.no_grad():
        ref, got = model(ids).double(), prepared(ids).double()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if not err <= TOLERANCE[args.dtype]:
        sys.exit(f"O1 logits differ from the unprepared model's: max rel err {err:.3g}")

    models = {"torch eager": model, "O1 eager": prepared}
    if not args.no_compile:
        models["torch.compile"] = copy.deepcopy(model)
        models["torch.compile"].compile()
        models["O1 + torch.compile"] = copy.deepcopy(prepared)
        models["O1 + torch.compile"].compile(fullgraph=True)
    steps = {name: make_step(m, ids, target) for name, m in models.items()}
    losses, compile_s = {}, {}
    for name, step in steps.items():
        start = time.perf_counter()
        losses[name] = step()
        compile_s[name] = time.perf_counter() - start
        for _ in range(args.warmup - 1):
            step()
    samples: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(args.reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)

    stats = {name: summarize(s) for name, s in samples.items()}
    peer = {"O1 eager": "torch eager", "O1 + torch.compile": "torch.compile"}
    cfg = " ".join(f"{k}={v}" for k, v in config.items())
    print(f"\nforward+backward step, {args.dtype}, {cfg}; {torch.get_num_threads()} torch threads (OMP_NUM_THREADS), "
          f"tensor_ops {tensor_ops.get_backend()} ({tensor_ops._C.cpu_active_isa()}, {tensor_ops._C.cpu_num_threads()} "
          f"threads: TENSOR_OPS_NUM_THREADS); medians of {args.reps}\n")
    print("| variant | median ms | p25-p75 ms | min-max ms | first step s | speedup vs peer |")
    print("|---|---|---|---|---|---|")
    for name, s in stats.items():
        speedup = f"{stats[peer[name]]['median_s'] / s['median_s']:.2f}x vs {peer[name]}" if name in peer else ""
        print(f"| {name} | {s['median_s'] * 1e3:.2f} | {s['p25_s'] * 1e3:.2f}-{s['p75_s'] * 1e3:.2f} | "
              f"{s['min_s'] * 1e3:.2f}-{s['max_s'] * 1e3:.2f} | {compile_s[name]:.2f} | {speedup} |")
    print(f"\nO1 swaps: {', '.join(result.optimizations_applied[1:])}; O1 logits max rel err {err:.2e}")

    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"torch_model_{args.dtype}_{'_'.join(f'{k}{v}' for k, v in config.items())}.json"
    path.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.machine(),
        "processor": platform.processor(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "tensor_ops_threads": tensor_ops._C.cpu_num_threads(),
        "dtype": args.dtype, "config": config, "reps": args.reps, "o1_logits_max_rel_err": err,
        "prepare": result.to_dict(), "first_step_s": compile_s, "first_loss": losses,
        "summary": stats, "samples_s": samples,
    }, indent=1))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
