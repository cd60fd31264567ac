"""Attention on the CPU: tensor_ops' flash attention against torch's
scaled_dot_product_attention (eager, and torch.compile of it), forward and
forward + backward, prefill and decode shapes, causal and not, float32 and
bfloat16.

    python bench/bench_attention.py [--reps R] [--quick] [--threads 1,2] [--gap-ms G] [--only decode]

Both sides get the same tensors and the same thread count (torch's intra-op
threads = tensor_ops' CPU threads). Implementations alternate round-robin
within each case; each sample starts after an idle gap (torch's OpenMP
workers spin for a few ms after every call). The table gives medians, the
ratio torch / ours (> 1: we are faster), and our GFLOP/s as a % of the
machine's GEMM peak measured in the same run (torch.mm on float32
2048x2048, MKL / oneDNN: the best FMA throughput a library reaches here).
Causal shapes count the flops of the visible half. Writes
bench/out/attention.json and the "attention" section of bench/RESULTS.md
(not with --quick).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

import tensor_ops
import tensor_ops.torch as tt
from results_md import machine, write_section

OUT = pathlib.Path(__file__).resolve().parent / "out"

# (name, batch, q heads, kv heads, Lq, Lk, head_dim)
CASES = [
    ("prefill", 1, 32, 8, 1024, 1024, 128),
    ("prefill", 4, 8, 2, 256, 256, 64),
    ("decode", 1, 32, 8, 1, 4096, 128),
]


def flops(b, hq, lq, lk, d, causal, backward):
    visible = lq * lk - (lq * (lq - 1) / 2 if causal and lq == lk else 0)
    f = 4.0 * b * hq * visible * d  # two products of 2 flops per multiply-add
    return f * (3.5 if backward else 1.0)  # the backward: five products (FlashAttention-2's count) + the forward


def gemm_peak(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        torch.mm(a, b)
    best = min(_time(lambda: torch.mm(a, b)) for _ in range(5))
    return 2 * 2048 ** 3 / best / 1e9


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_impls(q, k, v, causal, backward):
    group = q.shape[1] // k.shape[1]
    # torch's SDPA aligns causal masks top-left; at Lq == Lk both alignments agree,
    # and decode (Lq = 1) runs unmasked on both sides (the whole cache is visible).
    is_causal = causal and q.shape[2] == k.shape[2]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=group > 1)

    def ours(q, k, v):
        return tt.attention(q, k, v, causal=is_causal)

    compiled = torch.compile(sdpa, dynamic=False)
    impls = {"tensor_ops": ours, "torch": sdpa, "torch.compile": compiled}
    if not backward:
        return {name: (lambda f=f: f(q, k, v)) for name, f in impls.items()}
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(q)

    def step(f):
        def run():
            for t in (qg, kg, vg):
                t.grad = None
            f(qg, kg, vg).backward(dout)
        return run
    return {name: step(f) for name, f in impls.items()}


def check(q, k, v, causal):
    is_causal = causal and q.shape[2] == k.shape[2]
    group = q.shape[1] // k.shape[1]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                         enable_gqa=group > 1)
    got = tt.attention(q, k, v, causal=is_causal).double()
    return float((got - ref).abs().max() / ref.abs().max())


def run_case(case, dtype, causal, backward, threads, reps, gap, peak):
    name, b, hq, hkv, lq, lk, d = case
    torch.manual_seed(0)
    q = torch.randn(b, hq, lq, d, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, dtype=dtype)
    impls = make_impls(q, k, v, causal, backward)
    for fn in impls.values():  # warm-up (and compile)
        fn()
        fn()
    samples = {n: [] for n in impls}
    for _ in range(reps):
        for n, fn in impls.items():
            time.sleep(gap)
            samples[n].append(_time(fn))
    med = {n: statistics.median(s) for n, s in samples.items()}
    f = flops(b, hq, lq, lk, d, causal and lq == lk, backward)
    return {
        "case": f"{name} [{b}, {hq}/{hkv}, {lq}x{lk}, {d}]", "dtype": str(dtype).replace("torch.", ""),
        "causal": causal, "pass": "fwd+bwd" if backward else "fwd", "threads": threads,
        "ms": {n: m * 1e3 for n, m in med.items()},
        "vs_torch": med["torch"] / med["tensor_ops"], "vs_compile": med["torch.compile"] / med["tensor_ops"],
        "gflops": f / med["tensor_ops"] / 1e9, "pct_peak": 100 * f / med["tensor_ops"] / 1e9 / peak,
        "max_rel_err_vs_fp64": check(q, k, v, causal) if not backward else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--gap-ms", type=float, default=20)
    ap.add_argument("--only", choices=["prefill", "decode"],
                    help="only these cases (printed; bench/RESULTS.md is not rewritten)")
    args = ap.parse_args()
    reps = 3 if args.quick else args.reps
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        tensor_ops._C.cpu_set_num_threads(threads)
        peak = gemm_peak(threads)
        print(f"threads {threads}: GEMM peak (torch.mm float32 2048^3) {peak:.1f} GFLOP/s")
        # --quick: the first case of each kind asked for (it kept CASES[:1], a prefill: --only decode ran nothing)
        cases = [next(c for c in CASES if c[0] == kind) for kind in ("prefill", "decode")] if args.quick else CASES
        for case in [c for c in cases if args.only in (None, c[0])]:
            for dtype in ([torch.float32] if args.quick else [torch.float32, torch.bfloat16]):
                for causal in ([True] if case[0] == "decode" else [True, False]):
                    for backward in ([False] if case[0] == "decode" else [False, True]):
                        r = run_case(case, dtype, causal, backward, threads, reps, args.gap_ms / 1e3, peak)
                        r["peak_gflops"] = peak
                        rows.append(r)
                        print(f"{r['case']:36s} {r['dtype']:8s} causal={int(causal)} {r['pass']:7s} t={threads} "
                              f"ours {r['ms']['tensor_ops']:8.2f} ms  torch {r['ms']['torch']:8.2f}  "
                              f"compile {r['ms']['torch.compile']:8.2f}  x{r['vs_torch']:.2f} "
                              f"(compile x{r['vs_compile']:.2f})  {r['gflops']:.1f} GFLOP/s = "
                              f"{r['pct_peak']:.0f}% of peak", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "attention.json").write_text(json.dumps(rows, indent=1))
    if args.quick or args.only:
        return
    lines = [f"Machine: {machine()}", "",
             "Ratios are torch's median / ours (> 1: tensor_ops faster), same tensors and thread count, "
             f"round-robin, {reps} samples after a {args.gap_ms:.0f} ms idle gap each. % of peak: our GFLOP/s "
             "against torch.mm float32 2048^3 in the same run.", "",
             "| case | dtype | causal | pass | threads | ours ms | vs torch SDPA | vs torch.compile | GFLOP/s | % of GEMM peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['dtype']} | {int(r['causal'])} | {r['pass']} | {r['threads']} | "
                     f"{r['ms']['tensor_ops']:.2f} | {r['vs_torch']:.2f}x | {r['vs_compile']:.2f}x | "
                     f"{r['gflops']:.1f} | {r['pct_peak']:.0f}% |")
    write_section("attention", "60", "\n".join(lines))


if __name__ == "__main__":
    main()
