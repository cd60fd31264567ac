"""Kernel-only speed of tensor_ops against numpy, torch eager and torch.compile,
as a fraction of this machine's memory bandwidth measured in the same run.

    python bench/bench_ops.py [--shapes RxC ...] [--dtypes DTYPE ...]
                              [--ops OP ...] [--reps N] [--quick]

Default: rms_norm, add_rms_norm, layer_norm, silu, gelu (erf and tanh), swiglu
and softmax at 4096x4096 and 16384x8192 (DRAM-bound) and 32x4096
(cache-resident), float32 and bfloat16, median of 20 round-robin runs. Each
shape+dtype is one section: a STREAM triad measured just before it, then a
markdown table printed and written into bench/RESULTS.md, JSON
bench/out/ops_<dtype>_<R>x<C>.json and a bar chart
bench/out/roofline_<dtype>_<R>x<C>.png.

Implementations write into output buffers allocated once and shared by all
of them (a peer without an out= form allocates, and says so): a fresh output
of tens of MiB per call costs more in page faults than the kernel itself. The
"plain" rows time the allocating call to show that cost.
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
import shutil
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

import tensor_ops
from tensor_ops import _C

from results_md import machine, write_section

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

try:
    from scipy.special import erf as scipy_erf
except ImportError:
    scipy_erf = None

BENCH = pathlib.Path(__file__).resolve().parent
EPS, LN_EPS = 1e-6, 1e-5
SHAPES = ((4096, 4096), (16384, 8192), (32, 4096))
DTYPES = ("float32", "bfloat16")
QUICK_SHAPE, QUICK_REPS = (256, 1024), 5
TRIAD_ELEMENTS = 1 << 25  # 128 MiB of float32 per array, 4x the 32 MiB L3
# numpy's single-threaded multi-pass formulas and the plain (allocating) calls
# take seconds per call past this size; they are skipped there to bound the run.
SLOW_MAX_ELEMENTS = 1 << 24
PLAIN_OPS = ("rms_norm", "silu", "add_rms_norm", "softmax")
FUSED_OPS = ("rms_norm", "add_rms_norm", "swiglu", "softmax")
GOAL_PCT_TRIAD, GOAL_VS_COMPILE, GOAL_VS_EAGER = 90.0, 1.0, 2.0
SAMPLE_S = 2e-3  # fast calls are looped so that one sample lasts about this long
# Idle time before each sample (--gap-ms). torch's OpenMP (libgomp) workers
# spin for a few ms after every torch call; on 2 cores that takes a core from
# whatever runs next (measured here: tensor_ops rms_norm 4096x4096 6.4 ms right
# after a torch call, 5.1 ms after a 10 ms pause). A gap lets every sample
# start on an idle machine; --gap-ms 0 times back to back.
GAP_MS = 20.0
TRIAD = "triad"  # the round-robin's extra implementation
CHECK_ELEMENTS = 1 << 21  # rows sampled for the correctness check of big outputs
IMPLS = ("tensor_ops", "tensor_ops plain", "numpy", "torch eager", "torch eager plain", "torch.compile")
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 4e-2}  # rtol = atol


@dataclasses.dataclass
class Impl:
    run: Optional[Callable[[], object]] = None  # one timed call, returns its output(s)
    note: str = ""
    skipped: str = ""
    max_abs_err: float = math.nan


@dataclasses.dataclass
class Op:
    name: str
    args: str  # the op's arguments in order: x, r (a second full-size input), w, b (rows of weights)
    outputs: int  # full-size outputs
    ours: Callable  # (*args, *outs): kernel only, into preallocated outputs
    ours_note: str
    plain: Callable  # (*args) -> output(s): the public call, allocating
    numpy: Optional[Callable]  # (*args, *outs), float32; None with numpy_skip saying why
    numpy_skip: str
    torch_plain: Callable  # (*args) -> output(s): eager, the reference, and what torch.compile compiles
    torch_out: Optional[Callable]  # (*args, *outs); None where eager has no out= form
    eager_note: str

    @property
    def arrays(self) -> int:
        """Full-size arrays the op reads or writes once each."""
        return sum(a in "xr" for a in self.args) + self.outputs


def as_tuple(v) -> tuple:
    return v if isinstance(v, tuple) else (v,)


def summarize(samples: List[float]) -> Dict[str, float]:
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return {"median_s": statistics.median(samples), "p25_s": q1, "p75_s": q3,
            "min_s": min(samples), "max_s": max(samples)}


def make_triad(threads: int):
    """STREAM triad a = b + s*c: (the call, its description). Bytes count the
    3 arrays as STREAM does (the write-allocate read of a is not counted)."""
    n, s = TRIAD_ELEMENTS, 3.0
    if torch is not None:
        a, b, c = torch.empty(n), torch.full((n,), 1.0), torch.full((n,), 2.0)

        def triad():
            torch.add(b, c, alpha=s, out=a)

        meta = {"impl": f"torch.add(out=), {threads} threads", "arrays": 3, "note": ""}
    else:
        a, b, c = np.empty(n, np.float32), np.full(n, 1.0, np.float32), np.full(n, 2.0, np.float32)

        def triad():  # numpy has no fused triad: two passes move 5 arrays
            np.multiply(c, s, out=a)
            np.add(a, b, out=a)

        meta = {"impl": "numpy, 1 thread", "arrays": 5,
                "note": "torch missing: numpy triad is single-threaded and understates a multi-threaded kernel's limit"}
    triad()
    return triad, {**meta, "elements": n, "bytes": meta["arrays"] * n * 4}


def triad_stats(meta: dict, samples: List[float]) -> Dict[str, object]:
    stats = summarize(samples)
    nbytes = meta["bytes"]
    return {**meta, "samples_s": samples, **stats, "gbps": nbytes / stats["median_s"] / 1e9,
            "gbps_p25_p75": [nbytes / stats["p75_s"] / 1e9, nbytes / stats["p25_s"] / 1e9]}


def numpy_rms_norm(x, w, out):
    np.divide(x, np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS), out=out)
    out *= w
    return out


def numpy_add_rms_norm(x, r, w, out, res_out):
    np.add(x, r, out=res_out)
    numpy_rms_norm(res_out, w, out)
    return out, res_out


def numpy_layer_norm(x, w, b, out):
    d = x - x.mean(-1, keepdims=True)
    np.divide(d, np.sqrt(np.mean(d * d, -1, keepdims=True) + LN_EPS), out=out)
    out *= w
    out += b
    return out


def numpy_silu(x, out):
    np.divide(x, 1 + np.exp(-x), out=out)
    return out


def numpy_gelu_erf(x, out):
    t = scipy_erf(x * (1 / math.sqrt(2)))
    t += 1
    np.multiply(x, t, out=out)
    out *= 0.5
    return out


def numpy_gelu_tanh(x, out):
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


def numpy_swiglu(g, u, out):
    numpy_silu(g, out)
    out *= u
    return out


def numpy_softmax(x, out):
    np.subtract(x, x.max(-1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(-1, keepdims=True)
    return out


def ours_add_rms_norm(x, r, w, out, res_out):
    """tensor_ops.add_rms_norm has no out=: this is the core call it makes,
    into preallocated outputs."""
    _C.add_rms_norm(x, r, w, out, res_out, EPS)


def ours_softmax(x, out):
    """tensor_ops.softmax has no out=: the core call it makes for dim=-1."""
    _C.softmax(x, out, 1.0, False, False)


def eager_add_rms_norm(x, r, w):
    h = x + r
    return F.rms_norm(h, h.shape[-1:], w, EPS), h


_ln_stats: Dict[Tuple, Tuple] = {}


def eager_layer_norm_out(x, w, b, out):
    """aten's layer_norm kernel into out; its mean/rstd outputs are kept per shape."""
    key = (x.shape[0], x.dtype)
    if key not in _ln_stats:
        _ln_stats[key] = (x.new_empty(x.shape[0], 1), x.new_empty(x.shape[0], 1))
    mean, rstd = _ln_stats[key]
    torch.ops.aten.native_layer_norm.out(x, x.shape[-1:], w, b, LN_EPS, out0=out, out1=mean, out2=rstd)


def make_ops() -> List[Op]:
    t = tensor_ops

    def gelu(approximate, numpy_fn, numpy_skip=""):
        return Op("gelu" if approximate == "none" else f"gelu_{approximate}", "x", 1,
                  lambda x, y: t.gelu(x, approximate, out=y), "out=", lambda x: t.gelu(x, approximate),
                  numpy_fn, numpy_skip,
                  lambda x: F.gelu(x, approximate=approximate),
                  lambda x, y: torch.ops.aten.gelu.out(x, approximate=approximate, out=y), "aten .out")

    return [
        Op("rms_norm", "xw", 1, lambda x, w, y: t.rms_norm(x, w, EPS, out=y), "out=",
           lambda x, w: t.rms_norm(x, w, EPS), numpy_rms_norm, "",
           lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS), None, "F.rms_norm: no out=, allocates"),
        Op("add_rms_norm", "xrw", 2, ours_add_rms_norm, "no public out=: core call into preallocated outputs",
           lambda x, r, w: t.add_rms_norm(x, r, w, EPS), numpy_add_rms_norm, "",
           eager_add_rms_norm, None, "x + r, then F.rms_norm: two ops, allocating"),
        Op("layer_norm", "xwb", 1, lambda x, w, b, y: t.layer_norm(x, w, b, LN_EPS, out=y), "out=",
           lambda x, w, b: t.layer_norm(x, w, b, LN_EPS), numpy_layer_norm, "",
           lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, LN_EPS), eager_layer_norm_out,
           "aten native_layer_norm.out"),
        Op("silu", "x", 1, lambda x, y: t.silu(x, out=y), "out=", t.silu, numpy_silu, "",
           F.silu if torch else None, lambda x, y: torch.ops.aten.silu.out(x, out=y), "aten .out"),
        gelu("none", numpy_gelu_erf if scipy_erf else None, "" if scipy_erf else "scipy not installed (erf)"),
        gelu("tanh", numpy_gelu_tanh),
        Op("swiglu", "xr", 1, lambda g, u, y: t.swiglu(g, u, out=y), "out=", t.swiglu, numpy_swiglu, "",
           lambda g, u: F.silu(g) * u, lambda g, u, y: torch.mul(F.silu(g), u, out=y),
           "F.silu(g) allocates, then mul(out=): two passes"),
        Op("softmax", "x", 1, ours_softmax, "no public out=: core call into a preallocated output",
           lambda x: t.softmax(x, -1), numpy_softmax, "",
           lambda x: torch.softmax(x, -1), lambda x, y: torch.softmax(x, -1, out=y), "torch.softmax(out=)"),
    ]


def sampled_rows(rows: int, cols: int) -> np.ndarray:
    """Rows spread over the whole array (every thread's share), at most
    CHECK_ELEMENTS elements in all."""
    n = max(1, min(rows, CHECK_ELEMENTS // cols))
    return np.unique(np.linspace(0, rows - 1, n).astype(np.int64))


def as_numpy(y, rows: np.ndarray) -> np.ndarray:
    if torch is not None and isinstance(y, torch.Tensor):
        return y[torch.from_numpy(rows)].float().numpy()
    return np.asarray(y[rows], dtype=np.float64)


def check(op: Op, impl: str, got, want, dtype: str) -> float:
    """Max abs error against the reference over sampled rows; exits loudly
    past the tolerance."""
    tol, worst = TOLERANCE[dtype], 0.0
    for k, (g, w) in enumerate(zip(as_tuple(got), as_tuple(want))):
        shape = list(w.shape)
        rows = sampled_rows(*shape)
        g, w = as_numpy(g, rows), as_numpy(w, rows)
        err = np.abs(g - w)
        bad = ~(err <= tol + tol * np.abs(w))  # NaN counts as bad
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), bad.shape)
            where = (int(rows[i[0]]), int(i[1]))
            raise SystemExit(
                f"\n*** WRONG RESULT: {impl} {op.name} {dtype}{shape} output {k}: "
                f"{int(bad.sum())} of {bad.size} sampled elements outside rtol=atol={tol}; first at {where}: "
                f"got {g[i]!r}, reference {w[i]!r}; max abs error {float(np.nanmax(err))!r} ***\n"
                "Not timing a wrong kernel.")
        worst = max(worst, float(err.max()))
    return worst


def reference(op: Op, np_args, t_args):
    """torch eager's answer; without torch, the numpy formula in float64."""
    if torch is not None:
        return op.torch_plain(*t_args)
    if op.numpy is None:
        raise SystemExit(f"no reference for {op.name}: install torch or scipy")
    a64 = [a.astype(np.float64) for a in np_args]
    outs = tuple(np.empty(np_args[0].shape, np.float64) for _ in range(op.outputs))
    op.numpy(*a64, *outs)
    return outs if op.outputs > 1 else outs[0]


def into(fn: Callable, args: tuple, outs: tuple) -> Callable[[], tuple]:
    def run():
        fn(*args, *outs)
        return outs

    return run


def build_impls(op: Op, section: "Section") -> Dict[str, Impl]:
    """The implementations bound to their inputs and the shared output
    buffers, each run and checked once against the reference (before the
    next one overwrites the buffers)."""
    s = section
    t_args = tuple(s.torch_args[a] for a in op.args) if torch is not None else None
    np_args = tuple(s.numpy_args[a] for a in op.args) if s.numpy_args else None
    ours_args = np_args if s.ours_numpy else t_args
    shape = (s.rows, s.cols)
    if s.ours_numpy:
        np_outs = tuple(np.empty(shape, np_args[0].dtype) for _ in range(op.outputs))
        t_outs = tuple(torch.from_numpy(o) for o in np_outs) if torch is not None else None
    else:
        np_outs, t_outs = None, tuple(torch.empty(shape, dtype=t_args[0].dtype) for _ in range(op.outputs))
    ours_outs = np_outs if s.ours_numpy else t_outs
    big = s.rows * s.cols > SLOW_MAX_ELEMENTS
    too_slow = f"skipped above 2^{SLOW_MAX_ELEMENTS.bit_length() - 1} elements to bound the run time"

    impls = {"tensor_ops": Impl(into(op.ours, ours_args, ours_outs),
                                note=f"{'numpy' if s.ours_numpy else 'torch'} input, {op.ours_note}")}
    if op.name in PLAIN_OPS:
        impls["tensor_ops plain"] = (Impl(skipped=too_slow) if big else
                                     Impl(lambda: op.plain(*ours_args), note="public call, allocates its output"))
    if s.dtype != "float32":
        impls["numpy"] = Impl(skipped="numpy peer measured for float32 only")
    elif op.numpy is None:
        impls["numpy"] = Impl(skipped=op.numpy_skip)
    elif big:
        impls["numpy"] = Impl(skipped=f"{too_slow} (1 thread, several passes: seconds per call)")
    else:
        impls["numpy"] = Impl(into(op.numpy, np_args, np_outs), note="1 thread, out= where numpy has one")

    if torch is None:
        impls["torch eager"] = impls["torch.compile"] = Impl(skipped="torch not installed")
    else:
        if op.torch_out is not None:
            impls["torch eager"] = Impl(into(op.torch_out, t_args, t_outs), note=op.eager_note)
            if op.name in PLAIN_OPS:
                impls["torch eager plain"] = (Impl(skipped=too_slow) if big else
                                              Impl(lambda: op.torch_plain(*t_args), note="allocates its output"))
        else:
            impls["torch eager"] = Impl(lambda: op.torch_plain(*t_args), note=op.eager_note)
        impls["torch.compile"] = (compiled_impl(op, t_args, t_outs) if s.use_compile
                                  else Impl(skipped="skipped by --quick"))

    want = reference(op, np_args, t_args)
    for name, impl in impls.items():
        if impl.run is not None:
            impl.max_abs_err = check(op, name, impl.run(), want, s.dtype)
    return impls


def compiled_impl(op: Op, t_args: tuple, t_outs: tuple) -> Impl:
    """torch.compile of the eager function writing into the preallocated
    outputs; inductor fuses the copy_ into its kernel."""
    n = len(t_args)

    def into_outs(*a):
        for o, v in zip(a[n:], as_tuple(op.torch_plain(*a[:n]))):
            o.copy_(v)

    # A fresh dynamo cache per op/shape/dtype: all of them share into_outs'
    # code object, and past 8 recompiles dynamo would silently run eager.
    torch._dynamo.reset()
    try:
        fn = torch.compile(into_outs, fullgraph=True, dynamic=False)
        fn(*t_args, *t_outs)  # compiles
    except Exception as e:  # any compile failure: report and go on without it
        msg = (str(e).strip().splitlines() or [""])[0][:120]
        return Impl(skipped=f"compile failed: {type(e).__name__}: {msg}")

    def run():
        fn(*t_args, *t_outs)
        return t_outs

    return Impl(run, note="copy_ into out" + ("s" if op.outputs > 1 else "") + ", fused")


def time_round_robin(impls: Dict[str, Impl], reps: int,
                     gap_s: float = GAP_MS / 1e3) -> Tuple[Dict[str, List[float]], Dict[str, int]]:
    """Each rep runs every implementation once, starting at a rotating one,
    so drifting noise on a shared machine lands on all of them alike. Calls
    shorter than SAMPLE_S are looped; a sample is the time per call. Each
    sample starts after gap_s of idle time (see GAP_MS)."""
    names = [n for n, i in impls.items() if i.run is not None]
    number = {}
    for n in names:  # warm-up past the correctness call, timed to size the loops
        t0 = time.perf_counter()
        impls[n].run()
        number[n] = max(1, min(10_000, round(SAMPLE_S / max(time.perf_counter() - t0, 1e-7))))
    samples: Dict[str, List[float]] = {n: [] for n in names}
    gc.disable()
    try:
        for r in range(reps):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                run, calls = impls[n].run, number[n]
                if gap_s:
                    time.sleep(gap_s)
                t0 = time.perf_counter()
                for _ in range(calls):
                    run()
                samples[n].append((time.perf_counter() - t0) / calls)
    finally:
        gc.enable()
    return samples, number


@dataclasses.dataclass
class Section:
    """One shape+dtype: its inputs and how the implementations take them."""
    rows: int
    cols: int
    dtype: str
    numpy_args: Optional[Dict[str, np.ndarray]]
    torch_args: Optional[Dict[str, object]]
    ours_numpy: bool  # tensor_ops takes the numpy arrays (else the torch tensors)
    use_compile: bool


def make_section(rows, cols, dtype, x32, r32, use_compile) -> Section:
    rng = np.random.default_rng(1)
    w32 = (rng.random(cols, dtype=np.float32) + 0.5).astype(np.float32)
    b32 = rng.standard_normal(cols, dtype=np.float32) * np.float32(0.1)
    base = {"x": x32, "r": r32, "w": w32, "b": b32}
    base = {k: v for k, v in base.items() if v is not None}
    torch_args = None
    if torch is not None:
        tdtype = getattr(torch, dtype)
        torch_args = {k: torch.from_numpy(v).to(tdtype) for k, v in base.items()}  # no copy for float32
    numpy_args = None
    if dtype != "bfloat16":
        numpy_args = ({k: v.numpy() for k, v in torch_args.items()} if torch_args  # the same memory
                      else {k: v.astype(dtype) for k, v in base.items()})
    return Section(rows, cols, dtype, numpy_args, torch_args, numpy_args is not None, use_compile)


def l3_bytes() -> int:
    try:
        size = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}[size[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


def goals(op: str, entry: dict, dram_fp32: bool) -> Dict[str, dict]:
    """Issue 7's goals for tensor_ops' kernel row: >= 90% of triad at DRAM
    sizes in float32; fused ops >= 1.0x torch.compile and >= 2x torch eager."""
    ours, out = entry["impls"]["tensor_ops"], {}
    if dram_fp32:
        out["triad"] = {"goal": GOAL_PCT_TRIAD, "value": ours["pct_triad"], "met": ours["pct_triad"] >= GOAL_PCT_TRIAD}
    if op in FUSED_OPS:
        for key, peer, target in (("compile", "torch.compile", GOAL_VS_COMPILE), ("eager", "torch eager", GOAL_VS_EAGER)):
            s = entry["speedup"].get(peer)
            out[key] = {"goal": target, "value": s, "met": None if s is None else s >= target}
    return out


def goals_text(g: Dict[str, dict]) -> str:
    def yes(m):
        return "n/a" if m is None else ("yes" if m else "**no**")

    parts = []
    if "triad" in g:
        parts.append(f"≥{g['triad']['goal']:.0f}% triad: {yes(g['triad']['met'])} ({g['triad']['value']:.0f}%)")
    for key in ("compile", "eager"):
        if key in g:
            v = g[key]["value"]
            parts.append(f"≥{g[key]['goal']:.1f}x {key}: {yes(g[key]['met'])}" + ("" if v is None else f" ({v:.2f}x)"))
    return "; ".join(parts)


def run_section(ops: List[Op], s: Section, args, threads: int, l3: int) -> dict:
    t_start = time.perf_counter()
    itemsize = 2 if s.dtype in ("float16", "bfloat16") else 4
    array_bytes = s.rows * s.cols * itemsize
    dram = 2 * array_bytes > l3
    # At DRAM sizes the triad is one more implementation in every op's
    # round-robin, so each op's % of triad compares samples taken in the same
    # rounds (this shared machine's bandwidth drifts by 30% from minute to
    # minute). Cache-resident sections time it apart, before their ops: in
    # the rounds it would flush the others' data from the caches.
    triad_run, triad_meta = make_triad(threads)
    triad_samples: List[float] = []
    if not dram:
        triad_samples = time_round_robin({TRIAD: Impl(run=triad_run)}, args.reps, args.gap_ms / 1e3)[0][TRIAD]
    results = {}
    for op in ops:
        print(f"  [{s.dtype} {s.rows}x{s.cols}] {op.name} ...", file=sys.stderr, flush=True)
        op_bytes = op.arrays * array_bytes
        impls = build_impls(op, s)
        if dram:
            impls[TRIAD] = Impl(run=triad_run)
        samples, number = time_round_robin(impls, args.reps, args.gap_ms / 1e3)
        if dram:
            triad_samples += samples[TRIAD]
        op_triad = triad_stats(triad_meta, samples[TRIAD] if dram else triad_samples)
        entry = {"bytes": op_bytes, "arrays": op.arrays, "impls": {},
                 "triad_gbps": op_triad["gbps"], "triad_gbps_p25_p75": op_triad["gbps_p25_p75"]}
        for name in IMPLS:
            impl = impls.get(name)
            if impl is None:
                continue
            if impl.run is None:
                entry["impls"][name] = {"skipped": impl.skipped}
                continue
            stats = summarize(samples[name])
            gbps = op_bytes / stats["median_s"] / 1e9
            entry["impls"][name] = {**stats, "gbps": gbps, "pct_triad": 100 * gbps / op_triad["gbps"],
                                    "calls_per_sample": number[name], "max_abs_err": impl.max_abs_err,
                                    "note": impl.note, "samples_s": samples[name]}
        ours = entry["impls"]["tensor_ops"]["median_s"]
        entry["speedup"] = {n: r["median_s"] / ours for n, r in entry["impls"].items()
                            if "median_s" in r and n != "tensor_ops"}
        entry["goals"] = goals(op.name, entry, dram and s.dtype == "float32")
        results[op.name] = entry
        del impls
        gc.collect()
    return {"shape": [s.rows, s.cols], "dtype": s.dtype, "dram_bound": dram, "reps": args.reps, "gap_ms": args.gap_ms,
            "quick": args.quick, "triad": triad_stats(triad_meta, triad_samples), "ops": results,
            "seconds": time.perf_counter() - t_start}


def ms(s: float) -> str:
    """Milliseconds to 3 significant figures, no exponent."""
    v = s * 1e3
    return f"{v:.{max(0, 2 - math.floor(math.log10(v)))}f}"


def section_markdown(report: dict, plot_name: Optional[str]) -> str:
    t = report["triad"]
    rows, cols = report["shape"]
    kind = "DRAM-bound" if report["dram_bound"] else "cache-resident: % of the DRAM triad can pass 100%"
    lines = [
        f"## Ops: {report['dtype']}[{rows}, {cols}] ({kind})", "",
        f"{report['machine']} · tensor_ops and torch on {report['threads']} threads ({report['isa']}) · "
        f"median of {report['reps']} round-robin" + (" (**under 20: preliminary**)" if report["reps"] < 20 else "")
        + (f", {report['gap_ms']:g} ms idle before each sample" if report.get("gap_ms") else ", back to back")
        + f" · section took {report['seconds']:.0f} s · `{report['command']}`", "",
        (f"Triad ({t['impl']}, 3 x {t['elements'] * 4 // 2**20} MiB), timed as one more implementation in every "
         f"op's round-robin: **{t['gbps']:.1f} GB/s** over the section "
         f"(p25–p75 {t['gbps_p25_p75'][0]:.1f}–{t['gbps_p25_p75'][1]:.1f}); each op's % triad is against the "
         f"triad samples of its own rounds (shown on its tensor_ops row)" if report["dram_bound"] else
         f"Triad ({t['impl']}, 3 x {t['elements'] * 4 // 2**20} MiB), timed before the ops: **{t['gbps']:.1f} GB/s** "
         f"(p25–p75 {t['gbps_p25_p75'][0]:.1f}–{t['gbps_p25_p75'][1]:.1f})") + (f" — {t['note']}" if t["note"] else ""),
        "",
        "Bytes per call: x + y for the single-input ops; x + residual + y + new residual for add_rms_norm; "
        "gate + up + y for swiglu. Speedup = row median / tensor_ops median (> 1: tensor_ops faster). "
        "Goals (tensor_ops row): ≥90% of triad at DRAM sizes in float32; fused ops (rms_norm, add_rms_norm, "
        "swiglu, softmax) ≥1.0x torch.compile and ≥2x torch eager.", "",
        "| op | impl | median ms | p25–p75 ms | GB/s | % triad | tensor_ops speedup | goals | note |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for op, entry in report["ops"].items():
        for name, r in entry["impls"].items():
            if "skipped" in r:
                lines.append(f"| {op} | {name} | — | — | — | — | — | | skipped: {r['skipped']} |")
                continue
            speedup = entry["speedup"].get(name)
            g = goals_text(entry["goals"]) if name == "tensor_ops" else ""
            loops = f"; {r['calls_per_sample']} calls per sample" if r["calls_per_sample"] > 1 else ""
            if name == "tensor_ops" and report["dram_bound"]:
                loops += f"; triad in these rounds {entry['triad_gbps']:.1f} GB/s"
            lines.append(f"| {op} | {name} | {ms(r['median_s'])} | {ms(r['p25_s'])}–{ms(r['p75_s'])} "
                         f"| {r['gbps']:.1f} | {r['pct_triad']:.0f}% | {'—' if speedup is None else f'{speedup:.2f}x'} "
                         f"| {g} | {r['note']}{loops} |")
    if plot_name:
        lines += ["", f"![% of triad per op and implementation]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> bool:
    """Bar chart of % of triad per op and implementation."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): no plot", file=sys.stderr)
        return False
    ops = list(report["ops"])
    present = [n for n in IMPLS if any("pct_triad" in e["impls"].get(n, {}) for e in report["ops"].values())]
    width = 0.84 / len(present)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.25 * len(ops)), 4.6))
    for i, name in enumerate(present):
        vals = [report["ops"][op]["impls"].get(name, {}).get("pct_triad", math.nan) for op in ops]
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(ops))]
        ax.bar(xs, vals, width, label=name, color=f"C{IMPLS.index(name)}")
    ax.axhline(100, color="black", lw=0.8)
    ax.axhline(GOAL_PCT_TRIAD, color="gray", lw=0.8, ls="--", label=f"goal {GOAL_PCT_TRIAD:.0f}%")
    ax.set_xticks(range(len(ops)), ops)
    ax.set_ylabel("% of STREAM triad")
    rows, cols = report["shape"]
    ax.set_title(f"{report['dtype']}[{rows}, {cols}]: triad {report['triad']['gbps']:.1f} GB/s, "
                 f"{report['threads']} threads, median of {report['reps']} ({report['date'][:10]})", fontsize=10)
    top = max([v for e in report["ops"].values() for r in e["impls"].values() for v in [r.get("pct_triad", 0)]])
    ax.set_ylim(0, max(110.0, 1.08 * top))
    ax.legend(fontsize=8, ncol=len(present) + 1, loc="upper center", bbox_to_anchor=(0.5, -0.09), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def print_section(md: str, json_path: pathlib.Path) -> None:
    print("\n" + md + f"\nJSON: {json_path}\n", flush=True)


def parse_shape(text: str) -> Tuple[int, int]:
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be RxC, e.g. 4096x4096, got {text!r}")
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"shape must be positive, got {text!r}")
    return rows, cols


def parse_args(argv=None):
    names = [op.name for op in make_ops()]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=parse_shape, metavar="RxC",
                   help="default 4096x4096 16384x8192 32x4096 (256x1024 with --quick)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(TOLERANCE),
                   help="default float32 bfloat16 (float32 with --quick)")
    p.add_argument("--ops", nargs="+", choices=names, metavar="OP", help=f"default all: {', '.join(names)}")
    p.add_argument("--reps", type=int, help=f"timed repetitions per implementation (default 20, {QUICK_REPS} with --quick)")
    p.add_argument("--gap-ms", type=float, default=GAP_MS,
                   help=f"idle ms before each timed sample, so no implementation runs while the previous one's "
                        f"threads still spin (default {GAP_MS:g}; 0: back to back)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run in seconds: small shape, float32, few reps, no torch.compile, "
                        "RESULTS.md left alone")
    args = p.parse_args(argv)
    args.shapes = args.shapes or ([QUICK_SHAPE] if args.quick else list(SHAPES))
    args.dtypes = args.dtypes or (["float32"] if args.quick else list(DTYPES))
    args.ops = args.ops or names
    args.reps = (QUICK_REPS if args.quick else 20) if args.reps is None else args.reps  # 0 is refused below
    if args.reps < 4:
        p.error(f"--reps must be >= 4 (quartiles), got {args.reps}")
    if torch is None and set(args.dtypes) & {"bfloat16"}:
        p.error("--dtypes bfloat16 needs torch (numpy has no bfloat16)")
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
    ops = [op for op in make_ops() if op.name in args.ops]
    command = " ".join(["python bench/bench_ops.py", *(sys.argv[1:] if argv is None else argv)])
    out_dir = BENCH / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    l3, started = l3_bytes(), time.perf_counter()
    versions = {"python": platform.python_version(), "tensor_ops": tensor_ops.__version__,
                "tensor_ops_path": str(pathlib.Path(tensor_ops.__file__).parent),
                "numpy": np.__version__, "torch": torch.__version__ if torch else None,
                "scipy": sys.modules["scipy"].__version__ if "scipy" in sys.modules else None}
    rng = np.random.default_rng(0)
    for rows, cols in args.shapes:
        x32 = rng.standard_normal((rows, cols), dtype=np.float32)
        r32 = rng.standard_normal((rows, cols), dtype=np.float32) if any("r" in op.args for op in ops) else None
        for dtype in args.dtypes:
            s = make_section(rows, cols, dtype, x32, r32, use_compile=torch is not None and not args.quick)
            mach = machine()
            report = run_section(ops, s, args, threads, l3)
            report.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          machine=mach, threads=threads, isa=info["cpu"]["isa"], command=command,
                          cpu=platform.processor() or platform.machine(), versions=versions)
            del s
            gc.collect()
            stem = f"{dtype}_{rows}x{cols}"
            json_path = out_dir / f"ops_{stem}.json"
            json_path.write_text(json.dumps(report, indent=1) + "\n")
            png = out_dir / f"roofline_{stem}.png"
            plotted = plot(report, png)
            committed = plotted and not args.quick and dtype == "float32" and report["dram_bound"]
            if committed:
                shutil.copyfile(png, BENCH / png.name)
            md = section_markdown(report, png.name if committed else None)
            print_section(md, json_path)
            if args.quick:
                print("(--quick: bench/RESULTS.md left alone)")
            else:
                order = (f"1 ops {DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)} "
                         f"{SHAPES.index((rows, cols)) if (rows, cols) in SHAPES else len(SHAPES)} {rows:07d}x{cols:07d}")
                print(f"Section written to {write_section(f'ops {dtype} {rows}x{cols}', order, md)}")
        del x32, r32
        gc.collect()
    print(f"\nTotal {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
