"""The OpenCL backend (PoCL's CPU device in CI) against tensor_ops' own CPU
backend on the same data.

    python bench/bench_opencl.py [--shapes 4096x4096 256x1024] [--dtype float32] [--reps 20]

Per op and shape, timed round-robin (each repetition starts at a rotating
implementation):
  cpu              numpy in, preallocated numpy out=, with use("cpu")
  opencl resident  tensor_ops.Tensor on opencl:0 in, preallocated Tensor out=;
                   kernels are asynchronous, so a sample ends with a 4-byte
                   read on the same in-order queue (it waits for them)
  opencl staged    numpy in, numpy out=, with use("opencl"): the core copies
                   the inputs to the device, runs the kernel, copies back
Calls under 2 ms are looped and divided, so a sample is the time of one
call. GB/s counts x read + y written (the weight row is not counted), from
the median; p25-p75 is the spread. Every implementation's output is checked
against float64 before timing. Prints a markdown table; writes
bench/out/opencl_<dtype>_<R>x<C>.json.

    python bench/bench_opencl.py --llm [--dtype float32] [--reps 10]

The LLM op set instead: each op on opencl:0-resident tensors (synchronised
by reading a small output back) against the CPU backend on the same numpy
data in the same run, round-robin; the OpenCL result is checked against the
CPU backend's before timing. Writes bench/out/opencl_llm_<dtype>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np

import tensor_ops

EPS = 1e-6
IMPLS = ("cpu", "opencl resident", "opencl staged")
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}  # rtol = atol, vs float64
LOOP_BELOW_S = 2e-3


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def reference(op: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x, w = x.astype(np.float64), w.astype(np.float64)
    if op == "rms_norm":
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w
    if op == "silu":
        return x / (1 + np.exp(-x))
    if op == "gelu tanh":
        u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
        return x / (1 + np.exp(-2 * u))
    return 0.5 * x * np.vectorize(math.erfc, otypes=[np.float64])(-x / math.sqrt(2))


def call(op: str) -> Callable:
    t = tensor_ops
    return {
        "rms_norm": lambda x, w, y: t.rms_norm(x, w, EPS, out=y),
        "silu": lambda x, w, y: t.silu(x, out=y),
        "gelu erf": lambda x, w, y: t.gelu(x, "none", out=y),
        "gelu tanh": lambda x, w, y: t.gelu(x, "tanh", out=y),
    }[op]


def summarize(samples: List[float]) -> Dict[str, float]:
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return {"median_s": statistics.median(samples), "p25_s": q1, "p75_s": q3, "min_s": min(samples),
            "max_s": max(samples)}


def bench_shape(rows: int, cols: int, dtype: str, reps: int, seed: int) -> Dict[str, object]:
    rng = np.random.default_rng(seed)
    dt = np_dtype(dtype)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32).astype(dt)
    w = rng.standard_normal(cols).astype(np.float32).astype(dt)
    dev = "opencl:0"
    xt, wt = tensor_ops.from_numpy(x, device=dev), tensor_ops.from_numpy(w, device=dev)
    yt = tensor_ops.empty((rows, cols), dtype, device=dev)
    probe = tensor_ops.zeros((1,), "float32", device=dev)
    y_cpu, y_staged = np.empty_like(x), np.empty_like(x)
    check_rows = np.unique(np.linspace(0, rows - 1, min(rows, 64)).astype(np.int64))
    nbytes = 2 * x.nbytes

    results = {}
    for op in ("rms_norm", "silu", "gelu erf", "gelu tanh"):
        f = call(op)

        def cpu():
            with tensor_ops.use("cpu"):
                f(x, w, y_cpu)

        def resident():
            f(xt, wt, yt)

        def staged():
            with tensor_ops.use("opencl"):
                f(x, w, y_staged)

        runs = {"cpu": (cpu, lambda: None), "opencl resident": (resident, probe.numpy),
                "opencl staged": (staged, lambda: None)}
        want = reference(op, x[check_rows], w)
        errors = {}
        for name, (run, sync) in runs.items():
            run()
            sync()
            got = {"cpu": y_cpu, "opencl staged": y_staged}.get(name)
            got = (yt.numpy() if got is None else got)[check_rows].astype(np.float64)
            err = np.abs(got - want)
            tol = TOLERANCE[dtype]
            if not (err <= tol + tol * np.abs(want)).all():
                raise SystemExit(f"*** WRONG RESULT: {name} {op} {dtype} {rows}x{cols}: max abs error "
                                 f"{float(np.nanmax(err))!r}; not timing a wrong kernel ***")
            errors[name] = float(err.max())
        # Calls per sample: enough that one sample lasts about LOOP_BELOW_S.
        loops = {}
        for name, (run, sync) in runs.items():
            t0 = time.perf_counter()
            run()
            sync()
            loops[name] = max(1, math.ceil(LOOP_BELOW_S / max(time.perf_counter() - t0, 1e-7)))
        samples: Dict[str, List[float]] = {n: [] for n in runs}
        order = list(runs)
        for r in range(reps):
            for name in order[r % len(order):] + order[:r % len(order)]:
                run, sync = runs[name]
                t0 = time.perf_counter()
                for _ in range(loops[name]):
                    run()
                sync()
                samples[name].append((time.perf_counter() - t0) / loops[name])
        results[op] = {}
        for name in runs:
            s = summarize(samples[name])
            results[op][name] = {**s, "samples_s": samples[name], "calls_per_sample": loops[name],
                                 "gbps": nbytes / s["median_s"] / 1e9, "max_abs_err": errors[name]}
    return {"rows": rows, "cols": cols, "dtype": dtype, "bytes": nbytes, "ops": results}


def table(section: Dict[str, object]) -> str:
    lines = [f"### {section['dtype']} {section['rows']}x{section['cols']} "
             f"({section['bytes'] / 2 ** 20:.0f} MiB moved per call)", "",
             "| op | implementation | median ms | p25-p75 ms | GB/s | vs cpu |", "|---|---|---|---|---|---|"]
    for op, impls in section["ops"].items():
        base = impls["cpu"]["median_s"]
        for name in IMPLS:
            r = impls[name]
            lines.append(f"| {op} | {name} | {r['median_s'] * 1e3:.3f} | {r['p25_s'] * 1e3:.3f}-{r['p75_s'] * 1e3:.3f}"
                         f" | {r['gbps']:.2f} | {base / r['median_s']:.2f}x |")
    return "\n".join(lines)


def llm_cases(dtype: str, seed: int):
    """(name, cpu thunk, opencl thunk returning something to read back)."""
    t = tensor_ops
    rng = np.random.default_rng(seed)
    dt = np_dtype(dtype)
    mk = lambda *shape: (rng.standard_normal(shape)).astype(np.float32).astype(dt)  # noqa: E731
    dev = lambda a: t.from_numpy(np.ascontiguousarray(a), device="opencl:0")  # noqa: E731
    R, C = 2048, 4096
    x, r, dy, w = mk(R, C), mk(R, C), mk(R, C), mk(C)
    xt, rt, dyt, wt = dev(x), dev(r), dev(dy), dev(w)
    B, S, H, D = 4, 512, 16, 128
    x4 = mk(B, S, H, D)
    ang = np.arange(S)[:, None] * (1e-4 ** (np.arange(D // 2) / (D // 2)))[None, :]
    cos, sin = np.cos(ang).astype(dt), np.sin(ang).astype(dt)
    pos = np.tile(np.arange(S), (B, 1))
    x4t, cost, sint, post = dev(x4), dev(cos), dev(sin), dev(pos)
    q, k, v = mk(1, 16, 1024, 64), mk(1, 4, 1024, 64), mk(1, 4, 1024, 64)
    qt, kt, vt = dev(q), dev(k), dev(v)
    with t.use("cpu"):
        o, lse = t.attention(q, k, v, True, return_lse=True)
    ot, lset = dev(o), dev(lse)
    N, V = 512, 32000
    logits, tgt = mk(N, V), rng.integers(0, V, N)
    lgt, tgtt = dev(logits), dev(tgt)
    return [
        ("layer_norm 2048x4096", lambda: t.layer_norm(x, w), lambda: t.layer_norm(xt, wt)),
        ("add_rms_norm 2048x4096", lambda: t.add_rms_norm(x, r, w)[0], lambda: t.add_rms_norm(xt, rt, wt)[0]),
        ("softmax causal 2048x4096", lambda: t.softmax(x, causal=True), lambda: t.softmax(xt, causal=True)),
        ("swiglu 2048x4096", lambda: t.swiglu(x, r), lambda: t.swiglu(xt, rt)),
        ("rope 4x512x16x128", lambda: t.rope(x4, cos, sin, pos), lambda: t.rope(x4t, cost, sint, post)),
        ("attention causal gqa 16/4x1024x64", lambda: t.attention(q, k, v, True),
         lambda: t.attention(qt, kt, vt, True)),
        ("cross_entropy+grad 512x32000", lambda: t.cross_entropy_with_grad(logits, tgt, reduction="none")[1],
         lambda: t.cross_entropy_with_grad(lgt, tgtt, reduction="none")[1]),
        ("layer_norm_backward 2048x4096", lambda: t.layer_norm_backward(dy, x, w)[1],
         lambda: t.layer_norm_backward(dyt, xt, wt)[1]),
        ("softmax_backward 2048x4096", lambda: t.softmax_backward(dy, x), lambda: t.softmax_backward(dyt, xt)),
        ("swiglu_backward 2048x4096", lambda: t.swiglu_backward(dy, x, r)[0],
         lambda: t.swiglu_backward(dyt, xt, rt)[0]),
        ("attention_backward causal gqa 16/4x1024x64", lambda: t.attention_backward(q, q, k, v, o, lse, True)[0],
         lambda: t.attention_backward(qt, qt, kt, vt, ot, lset, True)[0]),
    ]


def bench_llm(dtype: str, reps: int, seed: int) -> Dict[str, object]:
    probe = tensor_ops.zeros((1,), "float32", device="opencl:0")
    results = {}
    for name, cpu_f, cl_f in llm_cases(dtype, seed):
        def cpu():
            with tensor_ops.use("cpu"):
                return cpu_f()

        def opencl():
            cl_f()
            probe.numpy()  # the in-order queue: waits for the kernels

        want = np.asarray(cpu()).astype(np.float64)
        got = cl_f().numpy().astype(np.float64)
        fin = np.isfinite(want)
        tol = TOLERANCE[dtype] * 4
        scale = max(1.0, float(np.abs(want[fin]).max(initial=0.0)))
        if not ((np.isfinite(got) == fin).all() and (np.abs(got[fin] - want[fin]) <= tol * scale).all()):
            raise SystemExit(f"*** WRONG RESULT: opencl {name} {dtype} differs from the cpu backend ***")
        samples: Dict[str, List[float]] = {"cpu": [], "opencl resident": []}
        runs = {"cpu": cpu, "opencl resident": opencl}
        for f in runs.values():
            f()
        order = list(runs)
        for rep in range(reps):
            for impl in order[rep % 2:] + order[:rep % 2]:
                t0 = time.perf_counter()
                runs[impl]()
                samples[impl].append(time.perf_counter() - t0)
        results[name] = {impl: {**summarize(v), "samples_s": v} for impl, v in samples.items()}
    return {"dtype": dtype, "ops": results}


def llm_table(section: Dict[str, object]) -> str:
    lines = [f"### LLM ops, {section['dtype']}", "", "| op | cpu median ms | opencl resident median ms "
             "(p25-p75) | opencl vs cpu |", "|---|---|---|---|"]
    for op, r in section["ops"].items():
        c, o = r["cpu"], r["opencl resident"]
        lines.append(f"| {op} | {c['median_s'] * 1e3:.2f} | {o['median_s'] * 1e3:.2f} "
                     f"({o['p25_s'] * 1e3:.2f}-{o['p75_s'] * 1e3:.2f}) | {c['median_s'] / o['median_s']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "256x1024"], help="RxC ...")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20, help="samples per implementation (at least 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llm", action="store_true", help="time the LLM op set instead of the --shapes sweep")
    args = ap.parse_args(argv)
    for shape in args.shapes:
        dims = shape.lower().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            ap.error(f"--shapes takes ROWSxCOLS (e.g. 256x1024), got {shape!r}")
    if args.reps < (4 if args.llm else 10):
        ap.error("--reps must be at least 10 (4 with --llm)")
    status = {b.name: b for b in tensor_ops.backends()}["opencl"]
    if not status.usable:
        raise SystemExit(f"opencl is not usable here: {status.reason}")
    device = [d for d in tensor_ops.devices() if d.backend == "opencl"][0]
    cpu = [d for d in tensor_ops.devices() if d.backend == "cpu"][0]
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "load_average": os.getloadavg(), "python": sys.version.split()[0],
            "opencl_device": device.to_dict(), "cpu_device": cpu.to_dict(),
            "cpu_threads": tensor_ops.get_backend_info().get("cpu", {}).get("num_threads")}
    print(f"opencl:0 = {device.device_name} ({device.properties.get('platform')}, {device.driver_version}); "
          f"cpu = {cpu.device_name}, {meta['cpu_threads']} threads; load average {meta['load_average'][0]:.2f}\n")
    out_dir = pathlib.Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    if args.llm:
        section = bench_llm(args.dtype, args.reps, args.seed)
        section["meta"] = meta
        print(llm_table(section) + "\n")
        path = out_dir / f"opencl_llm_{args.dtype}.json"
        path.write_text(json.dumps(section, indent=1))
        print(f"wrote {path}\n")
        return
    for shape in args.shapes:
        rows, cols = (int(v) for v in shape.lower().split("x"))
        section = bench_shape(rows, cols, args.dtype, args.reps, args.seed)
        section["meta"] = meta
        print(table(section) + "\n")
        path = out_dir / f"opencl_{args.dtype}_{rows}x{cols}.json"
        path.write_text(json.dumps(section, indent=1))
        print(f"wrote {path}\n")


if __name__ == "__main__":
    main()
