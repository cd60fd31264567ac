"""Fused linear cross-entropy on the CPU, forward + backward, float32:
tensor_ops.torch.fused_linear_cross_entropy (and the numpy form) against
torch's F.linear then F.cross_entropy: peak memory and time.

    python bench/bench_linear_cross_entropy.py [--reps R] [--threads 1 2] [--shape N H V] [--quick] [--memory-only]

Every sample is a fresh subprocess running one implementation: it builds the
inputs (seeded, the same for all), runs a small warm-up step (library and
thread-pool start-up), frees it, resets the peak RSS (VmHWM, by writing 5 to
/proc/self/clear_refs), then times one forward + backward of the loss of
hidden [N, H], weight [V, H] (and the gradients of both), and reports the
peak RSS above the RSS just before the step: what the step itself allocates,
gradients included, inputs not. (tracemalloc does not see torch's
allocations.) Implementations alternate round-robin over R repetitions
per thread count (torch's intra-op threads = tensor_ops' CPU threads =
OpenBLAS's = T). The table gives medians with p25-p75; writes
bench/out/linear_cross_entropy.json and the "linear_cross_entropy" section
of bench/RESULTS.md (not with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

IMPLS = ["torch linear then F.cross_entropy", "tensor_ops fused (torch)", "tensor_ops fused (numpy)"]


def _status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(impl: str, n: int, h: int, v: int, threads: int) -> dict:
    """One sample, in this (fresh) process: seconds and peak RSS delta of one step."""
    import torch
    import torch.nn.functional as F

    import tensor_ops
    import tensor_ops.torch as tt

    torch.set_num_threads(threads)
    tensor_ops.TensorOpsConfig(backend="cpu", cpu=tensor_ops.config.CPUConfig(threads=threads)).apply()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h ** -0.5).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)

    def step(rows: int) -> float:
        if impl.endswith("(numpy)"):
            loss = tensor_ops.fused_linear_cross_entropy(hidden.detach()[:rows].numpy(), weight.detach().numpy(),
                                                         target[:rows].numpy())[0]
            return float(loss)
        if impl.startswith("torch"):
            loss = F.cross_entropy(F.linear(hidden[:rows], weight), target[:rows])
        else:
            loss = tt.fused_linear_cross_entropy(hidden[:rows], weight, target[:rows])
        loss.backward()
        hidden.grad = weight.grad = None  # each step allocates its own (they are measured)
        return loss.item()

    step(min(n, 64))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss = _status_kb("VmRSS")
    start = time.perf_counter()
    loss = step(n)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_delta_mb": (_status_kb("VmHWM") - rss) / 1024, "loss": loss}


def sample(impl: str, shape, threads: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               TENSOR_OPS_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--child", impl, *map(str, shape), str(threads)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{impl} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stats(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "samples": xs}


def run(reps: int, shape, thread_counts, impls):
    rows = []
    for threads in thread_counts:
        samples = {k: [] for k in impls}
        for r in range(reps):
            for i in range(len(impls)):
                impl = impls[(r + i) % len(impls)]
                samples[impl].append(sample(impl, shape, threads))
                s = samples[impl][-1]
                print(f"T={threads} rep {r} {impl:36s} {s['seconds']:7.2f} s  peak +{s['peak_delta_mb']:7.0f} MB  "
                      f"loss {s['loss']:.6f}", flush=True)
        base = samples[IMPLS[0]]  # torch's, wherever --impls puts it (main() requires it)
        for impl in impls:
            t = _stats([s["seconds"] for s in samples[impl]])
            m = _stats([s["peak_delta_mb"] for s in samples[impl]])
            rows.append({"threads": threads, "impl": impl, "seconds": t, "peak_delta_mb": m,
                         "loss": samples[impl][0]["loss"],
                         "speedup": statistics.median(s["seconds"] for s in base) / t["median"],
                         "memory_ratio": m["median"] / statistics.median(s["peak_delta_mb"] for s in base)})
    return rows


def markdown(rows, shape, reps: int, memory_only: bool = False) -> str:
    import torch
    from results_md import machine

    n, h, v = shape
    floor = (n + v) * h * 4 / 2 ** 20  # grad_hidden + grad_weight, float32, MiB as the peaks
    torch_peak = statistics.median(r["peak_delta_mb"]["median"] for r in rows if r["impl"] == IMPLS[0])
    lines = [f"## Fused linear cross-entropy (CPU, float32): `bench_linear_cross_entropy.py`", "",
             f"{machine()} · torch {torch.__version__} · {reps} round-robin reps, one fresh process per sample", "",
             f"Forward + backward of the mean cross-entropy of hidden [{n}, {h}] @ weight [{v}, {h}].T, gradients "
             f"of hidden and weight. Peak: VmHWM above the RSS before the step (reset through "
             f"/proc/self/clear_refs), gradients included, inputs not. Median (p25-p75); "
             f"{'memory' if memory_only else 'speedup and memory'} against torch's F.linear then F.cross_entropy in the same run (the issue's acceptance: "
             f"memory <= 25%, speed >= 1.0x). MB are MiB. The floor of any fused form is the gradients "
             f"themselves, grad_hidden + grad_weight: {floor:.0f} MB, {100 * floor / torch_peak:.0f}% of torch's "
             f"peak.", ""]
    if memory_only:
        lines += ["Memory only (--memory-only): the run shared a loaded machine, where a peak is still valid "
                  "but a time is not, so no time or speedup is claimed here.", "",
                  "| threads | implementation | peak MB | peak vs torch |", "|---|---|---|---|"]
    else:
        lines += ["| threads | implementation | step s | peak MB | speedup | peak vs torch |", "|---|---|---|---|---|---|"]
    for r in rows:
        t, m = r["seconds"], r["peak_delta_mb"]
        time = "" if memory_only else f" {t['median']:.2f} ({t['p25']:.2f}-{t['p75']:.2f}) |"
        speed = "" if memory_only else f" {r['speedup']:.2f}x |"
        lines.append(f"| {r['threads']} | {r['impl']} |{time} {m['median']:.0f} ({m['p25']:.0f}-{m['p75']:.0f}) |"
                     f"{speed} {100 * r['memory_ratio']:.0f}% |")
    return "\n".join(lines)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        impl, n, h, v, threads = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(child(impl, n, h, v, threads)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shape", type=int, nargs=3, default=[4096, 2048, 32000], metavar=("N", "H", "V"))
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    ap.add_argument("--quick", action="store_true", help="a small shape, 2 reps, no RESULTS.md")
    ap.add_argument("--memory-only", action="store_true",
                    help="RESULTS.md without times and speedups (a loaded machine: peaks hold, times do not)")
    args = ap.parse_args()
    if IMPLS[0] not in args.impls:  # every speedup and memory ratio is against it
        ap.error(f"--impls must include {IMPLS[0]!r}: the table compares every implementation with it")
    if args.reps < 1 or min(args.threads) < 1 or min(args.shape) < 1:
        ap.error("--reps, --threads and --shape take numbers >= 1")
    shape, reps = ([512, 256, 4000], 2) if args.quick else (args.shape, args.reps)
    rows = run(reps, shape, args.threads, args.impls)
    md = markdown(rows, shape, reps, args.memory_only)
    print(md)
    out = pathlib.Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "linear_cross_entropy.json").write_text(json.dumps({"shape": shape, "reps": reps, "rows": rows},
                                                              indent=1))
    if not args.quick:
        from results_md import write_section

        print(f"Section written to {write_section('linear_cross_entropy', '5 linear_cross_entropy', md)}")


if __name__ == "__main__":
    main()
