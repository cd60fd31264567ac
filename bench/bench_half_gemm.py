"""Half-precision GEMMs on the CPU: torch's own bfloat16 / float16 F.linear
against the prepared modules' fp32 route (tensor_ops.torch.modules.
widened_linear, Note [half GEMMs in fp32]) and against float32 F.linear on
the same values, forward and forward + backward, interleaved in one process
(round-robin, medians), at 1 and 2 threads.

    python bench/bench_half_gemm.py [--reps 5] [--threads 1 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from tensor_ops.torch import modules

SHAPES = [(1024, 512, 1536), (1024, 512, 2816), (1024, 1408, 512), (256, 2048, 2048)]  # M, K, N


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    args = ap.parse_args()
    if args.reps < 1 or min(args.threads) < 1:
        ap.error("--reps and --threads take numbers >= 1")
    os.environ["TENSOR_OPS_HALF_GEMM"] = "fp32"  # the route measured, whatever this CPU's policy says
    print(f"policy on this CPU (auto): bf16 widened={not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())}, "
          f"fp16 widened={not torch.cpu._is_amx_fp16_supported()}; load average {os.getloadavg()[0]:.1f}")
    print("| M, K, N | dtype | threads | pass | torch half ms | ours (fp32 route) ms | torch fp32 ms | torch half / ours |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m, k, n in SHAPES:
            for name in args.dtypes:
                dt = getattr(torch, name)
                g = torch.Generator().manual_seed(m + k + n)
                x = torch.randn(m, k, generator=g).to(dt)
                w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dt)
                b = torch.randn(n, generator=g).to(dt)
                x32, w32, b32 = x.float(), w.float(), b.float()
                dy = torch.randn(m, n, generator=g).to(dt)

                def fwd_bwd(f, xx, ww, bb, gy):
                    def run():
                        xr, wr, br = (t.detach().requires_grad_() for t in (xx, ww, bb))
                        f(xr, wr, br).backward(gy)
                    return run

                impls = {
                    "fwd": {"half": lambda: F.linear(x, w, b), "ours": lambda: modules.widened_linear(x, w, b),
                            "fp32": lambda: F.linear(x32, w32, b32)},
                    "fwd+bwd": {"half": fwd_bwd(F.linear, x, w, b, dy),
                                "ours": fwd_bwd(modules.widened_linear, x, w, b, dy),
                                "fp32": fwd_bwd(F.linear, x32, w32, b32, dy.float())},
                }
                for pas, fns in impls.items():
                    for fn in fns.values():
                        fn()  # warm-up
                    samples = {key: [] for key in fns}
                    for _ in range(args.reps):
                        for key, fn in fns.items():
                            samples[key].append(timed(fn))
                    med = {key: statistics.median(v) for key, v in samples.items()}
                    print(f"| {m}, {k}, {n} | {name} | {threads} | {pas} | {med['half']:.1f} | {med['ours']:.1f} | "
                          f"{med['fp32']:.1f} | {med['half'] / med['ours']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
