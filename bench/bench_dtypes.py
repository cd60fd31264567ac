"""float32 against bfloat16 against float16: every memory-bound op and
backward of the CPU backend, per dtype, in the same run (issue 22).

    python bench/bench_dtypes.py                       # ~15 min on 2 quiet cores
    python bench/bench_dtypes.py --shapes 4096x4096 --ops rms_norm silu --reps 10
    python bench/bench_dtypes.py --quick               # smoke run, RESULTS.md left alone

For each shape and op, the op in float32, bfloat16 and float16 and a STREAM
triad are timed round-robin (bench_ops.time_round_robin: rotating start,
loops of ~2 ms, an idle gap before each sample), so the three dtypes and the
triad share the machine's noise; the median is reported. Kernel only: torch
tensors, outputs allocated once, the core call (`tensor_ops._C`) that the
public function makes. Per op and dtype: ms, ns per element, GB/s (the
full-size arrays the op reads and writes, each once) and % of the triad;
per op: bf16/fp32 and bf16/fp16 time, and issue 22's goals (bf16 <= 0.6x
fp32 and <= 1.15x fp16; >= 90% of triad where fp32 reaches it). Writes the
markdown section `dtypes` into bench/RESULTS.md (also printed, and kept in
bench/out/dtypes.md) and the samples to bench/out/dtypes.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np
import torch

import tensor_ops
from tensor_ops import _C

from bench_ops import GAP_MS, Impl, make_triad, parse_shape, summarize, time_round_robin, triad_stats
from results_md import machine, write_section

BENCH = pathlib.Path(__file__).resolve().parent
SHAPES = ((4096, 4096), (16384, 8192))
DTYPES = ("float32", "bfloat16", "float16")
QUICK_SHAPE, QUICK_REPS = (256, 1024), 5
EPS = 1e-6
HEAD_DIM = 128  # rope views [rows, cols] as [1, rows, cols / 128, 128]
GOAL_VS_FP32, GOAL_VS_FP16, GOAL_PCT_TRIAD = 0.6, 1.15, 90.0
POOL = 5  # full-size arrays per dtype: inputs in slots 0-2, outputs in 3-4


@dataclasses.dataclass
class Op:
    name: str
    arrays: int  # full-size arrays read or written once each
    call: Callable  # call(pool, small) -> None, pool: full-size tensors, small: row-sized ones


def _rope(inverse: bool):
    def call(p, s):
        _C.rope(p["x4"], s["cos"], s["sin"], s["pos"], p["y4"], False, inverse)
    return call


OPS = (
    Op("rms_norm", 2, lambda p, s: _C.rms_norm(p[0], s["w"], p[3], EPS)),
    Op("layer_norm", 2, lambda p, s: _C.layer_norm(p[0], s["w"], s["b"], p[3], EPS)),
    Op("add_rms_norm", 4, lambda p, s: _C.add_rms_norm(p[0], p[1], s["w"], p[3], p[4], EPS)),
    Op("silu", 2, lambda p, s: _C.silu(p[0], p[3])),
    Op("gelu", 2, lambda p, s: _C.gelu(p[0], p[3], "none")),
    Op("swiglu", 3, lambda p, s: _C.glu(p[0], p[1], p[3], "silu", "none")),
    Op("softmax", 2, lambda p, s: _C.softmax(p[0], p[3], 1.0, 0, False)),
    Op("rope", 2, _rope(False)),
    Op("rms_norm_backward", 3, lambda p, s: _C.rms_norm_backward(p[0], p[1], s["w"], p[3], s["dw"], EPS)),
    Op("layer_norm_backward", 3,
       lambda p, s: _C.layer_norm_backward(p[0], p[1], s["w"], p[3], s["dw"], s["db"], EPS)),
    Op("softmax_backward", 3, lambda p, s: _C.softmax_backward(p[0], p[1], p[3], 1.0, False)),
    Op("silu_backward", 3, lambda p, s: _C.activation_backward(p[0], p[1], p[3], "silu", "none")),
    Op("gelu_backward", 3, lambda p, s: _C.activation_backward(p[0], p[1], p[3], "gelu", "none")),
    Op("swiglu_backward", 5, lambda p, s: _C.glu_backward(p[0], p[1], p[2], p[3], p[4], "silu", "none")),
    Op("rope_backward", 2, _rope(True)),
)


def make_arrays(rows: int, cols: int, dtype: str, base: List[torch.Tensor]) -> tuple:
    """POOL full-size tensors of dtype (inputs from base: softmax_backward's y
    and the others' inputs alike, random normal) and the row-sized ones."""
    t = getattr(torch, dtype)
    # copy=True: float32's .to() would hand back base itself, numpy's memory
    # (page + 16 bytes) against torch's outputs (page + 64): a store stream
    # 48 bytes ahead of its load stream modulo 4096, where the CPU takes a
    # load for one that may alias the store just issued (4K aliasing) and
    # serialises the loop (silu 2.4x slower). All arrays torch's, as in a model.
    pool: Dict[object, torch.Tensor] = {i: base[i % len(base)].to(t, copy=True) for i in range(3)}
    pool.update({i: torch.empty(rows, cols, dtype=t) for i in (3, 4)})
    for i in (3, 4):
        pool[i].fill_(0)  # pre-faulted
    heads = cols // HEAD_DIM
    pool["x4"] = pool[0].view(1, rows, heads, HEAD_DIM)
    pool["y4"] = pool[3].view(1, rows, heads, HEAD_DIM)
    g = torch.Generator().manual_seed(2)
    ang = torch.rand(rows, HEAD_DIM // 2, generator=g) * 6.283
    small = {"w": (torch.rand(cols, generator=g) + 0.5).to(t), "b": (torch.randn(cols, generator=g) * 0.1).to(t),
             "dw": torch.empty(cols, dtype=t), "db": torch.empty(cols, dtype=t),
             "cos": ang.cos().to(t), "sin": ang.sin().to(t), "pos": torch.arange(rows, dtype=torch.int64)[None, :]}
    return pool, small


def ratio_cell(value: float, goal: float) -> str:
    return f"{value:.2f} {'✓' if value <= goal else '✗'}"


def run_shape(rows: int, cols: int, ops: List[Op], args, threads: int) -> dict:
    rng = np.random.default_rng(0)
    base = [torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32)) for _ in range(3)]
    arrays = {dt: make_arrays(rows, cols, dt, base) for dt in DTYPES}
    del base
    gc.collect()
    triad_run, triad_meta = make_triad(threads)
    n = rows * cols
    out = {"rows": rows, "cols": cols, "ops": {}}
    for op in ops:
        impls = {dt: Impl(run=lambda dt=dt: op.call(*arrays[dt])) for dt in DTYPES}
        impls["triad"] = Impl(run=triad_run)
        for dt in DTYPES:  # once outside the timing (first-touch, errors)
            impls[dt].run()
        samples, _ = time_round_robin(impls, args.reps, args.gap_ms / 1e3)
        tri = triad_stats(triad_meta, samples["triad"])
        entry = {"triad_gbps": tri["gbps"], "dtypes": {}}
        for dt in DTYPES:
            st = summarize(samples[dt])
            nbytes = op.arrays * n * torch.empty(0, dtype=getattr(torch, dt)).element_size()
            gbps = nbytes / st["median_s"] / 1e9
            entry["dtypes"][dt] = {**st, "samples_s": samples[dt], "ns_per_element": st["median_s"] / n * 1e9,
                                   "gbps": gbps, "pct_triad": 100 * gbps / tri["gbps"]}
        d = entry["dtypes"]
        entry["bf16_vs_fp32"] = d["bfloat16"]["median_s"] / d["float32"]["median_s"]
        entry["bf16_vs_fp16"] = d["bfloat16"]["median_s"] / d["float16"]["median_s"]
        out["ops"][op.name] = entry
        print(f"  {rows}x{cols} {op.name:20s} " + "  ".join(
            f"{dt} {d[dt]['median_s'] * 1e3:7.2f} ms" for dt in DTYPES) +
            f"  bf16/fp32 {entry['bf16_vs_fp32']:.2f}  bf16/fp16 {entry['bf16_vs_fp16']:.2f}", flush=True)
    del arrays
    gc.collect()
    return out


def shape_markdown(r: dict) -> List[str]:
    lines = [f"#### {r['rows']}x{r['cols']}", "",
             "| op | dtype | ms (p25–p75) | ns/element | GB/s | % triad | bf16/fp32 (≤0.6) | bf16/fp16 (≤1.15) "
             "| ≥90% triad |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, e in r["ops"].items():
        fp32_at_triad = e["dtypes"]["float32"]["pct_triad"] >= GOAL_PCT_TRIAD
        for dt in DTYPES:
            d = e["dtypes"][dt]
            cells = ["", "", ""]
            if dt == "bfloat16":
                triad_goal = ("✓" if d["pct_triad"] >= GOAL_PCT_TRIAD else "✗") if fp32_at_triad else "n/a (fp32 below)"
                cells = [ratio_cell(e["bf16_vs_fp32"], GOAL_VS_FP32), ratio_cell(e["bf16_vs_fp16"], GOAL_VS_FP16),
                         triad_goal]
            lines.append(f"| {name if dt == DTYPES[0] else ''} | {dt} | {d['median_s'] * 1e3:.2f} "
                         f"({d['p25_s'] * 1e3:.2f}–{d['p75_s'] * 1e3:.2f}) | {d['ns_per_element']:.3f} | "
                         f"{d['gbps']:.1f} | {d['pct_triad']:.0f}% | " + " | ".join(cells) + " |")
    triads = [e["triad_gbps"] for e in r["ops"].values()]
    lines += ["", f"Triad in the same round-robins: median {statistics.median(triads):.1f} GB/s "
                  f"(per op {min(triads):.1f}–{max(triads):.1f})."]
    return lines


def section_markdown(report: dict) -> str:
    lines = ["### float32 / bfloat16 / float16 per op (`bench_dtypes.py`)", "",
             f"{report['machine']} · {report['threads']} threads · ISA {report['isa']} · "
             f"{report['reps']} round-robin reps · `{report['command']}`", "",
             "Kernel only (torch tensors, outputs allocated once, the core call). GB/s counts the full-size "
             "arrays read and written once each; % triad against the triad timed in the same round-robin. "
             "Goals (issue 22): bf16 ≤ 0.6× fp32 and ≤ 1.15× fp16; ≥ 90% of triad where fp32 reaches it.", ""]
    for r in report["shapes"]:
        lines += shape_markdown(r) + [""]
    return "\n".join(lines)


def parse_args(argv=None):
    names = [op.name for op in OPS]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=parse_shape, metavar="RxC", help="default 4096x4096 16384x8192")
    p.add_argument("--ops", nargs="+", choices=names, metavar="OP", help=f"default all: {', '.join(names)}")
    p.add_argument("--reps", type=int, help=f"round-robin repetitions (default 11, {QUICK_REPS} with --quick)")
    p.add_argument("--gap-ms", type=float, default=GAP_MS, help=f"idle ms before each sample (default {GAP_MS:g})")
    p.add_argument("--quick", action="store_true", help="smoke run: 256x1024, few reps, RESULTS.md left alone")
    args = p.parse_args(argv)
    args.shapes = args.shapes or ([QUICK_SHAPE] if args.quick else list(SHAPES))
    args.ops = args.ops or names
    args.reps = (QUICK_REPS if args.quick else 11) if args.reps is None else args.reps  # 0 is refused below
    if args.reps < 4:
        p.error(f"--reps must be >= 4 (quartiles), got {args.reps}")
    for rows, cols in args.shapes:
        if cols % HEAD_DIM:
            p.error(f"--shapes: columns must be a multiple of {HEAD_DIM} (rope's head_dim), got {rows}x{cols}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    info = tensor_ops.get_backend_info()
    if "cpu" not in info:
        raise SystemExit(f"this benchmark measures the cpu backend; tensor_ops selected {info['backend']!r} "
                         "(run with TENSOR_OPS_BACKEND=cpu)")
    threads = info["cpu"]["num_threads"]
    torch.set_num_threads(threads)
    ops = [op for op in OPS if op.name in args.ops]
    command = " ".join(["python bench/bench_dtypes.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "threads": threads, "isa": info["cpu"]["isa"], "reps": args.reps,
              "command": command, "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                               "tensor_ops": tensor_ops.__version__}, "shapes": []}
    started = time.perf_counter()
    for rows, cols in args.shapes:
        report["shapes"].append(run_shape(rows, cols, ops, args, threads))
    md = section_markdown(report)
    out_dir = BENCH / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "dtypes.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "dtypes.md").write_text(md + "\n")
    print("\n" + md)
    if args.quick:
        print("(--quick: bench/RESULTS.md left alone)")
    else:
        print(f"Section written to {write_section('dtypes', '1 ops dtypes', md)}")
    print(f"Total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
