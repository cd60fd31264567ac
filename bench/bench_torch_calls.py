"""Calls from torch, per op and entry point, against torch's own equivalent;
and a decode step (batch 1, one token) built from them (issue 21).

    python bench/bench_torch_calls.py [--threads 1,2] [--repeat R] [--quick]

Entry points, each on torch tensors with no gradient recorded (inference):
  tensor_ops fn      tensor_ops.<op>(torch tensors)
  functional         tensor_ops.torch.functional.<op> (what the modules and
                     prepare_model call)
  torch.ops          torch.ops.tensor_ops.<op> (the dispatcher: what a
                     compiled graph calls)
  module             the drop-in module (RMSNorm, LayerNorm, SiLU, GELU)
against torch's equivalent: F.<op> (swiglu: F.silu(g) * u; add_rms_norm: x + r
then F.rms_norm) and its nn module. Shapes 1x64, 1x4096 and 32x4096 (float32;
32x4096 also bfloat16). Implementations of one op and shape alternate
round-robin in one process; each sample times N calls (timeit, garbage
collector off); medians. Threads: torch.set_num_threads(t) and tensor_ops'
pool both at t, one run per thread count (a subprocess each).

Decode step: rms_norm -> qkv GEMM -> rope -> attention over a 2048-token KV
cache (GQA) -> o GEMM -> add_rms_norm -> SwiGLU MLP, twice on our side: with
the same torch GEMMs as torch's step (only the non-GEMM ops differ), and with
the GEMMs (one row: matrix-vector products) on our linear kernel as well, as
a model prepared by prepare_model runs them (tensor_ops.torch.Linear).

Writes bench/out/torch_calls.json and the "torch_calls" section of
bench/RESULTS.md (not with --quick).
"""
from __future__ import annotations

import argparse
import functools
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import timeit
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import tensor_ops
from tensor_ops import _C
from tensor_ops.torch import functional as TF
from tensor_ops.torch import modules as TM

from results_md import machine, write_section

BENCH = pathlib.Path(__file__).resolve().parent
SHAPES = ((1, 64), (1, 4096), (32, 4096))
ENTRIES = ("tensor_ops fn", "functional", "torch.ops", "module")


def op_calls(name: str, shape, dtype) -> Dict[str, Callable]:
    """impl name -> zero-argument call; 'torch' and 'torch module' are the references."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype)
    r = torch.randn(*shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    b = torch.randn(shape[-1], generator=g).to(dtype)
    n = shape[-1]
    calls: Dict[str, Callable] = {}
    if name == "rms_norm":
        ref_mod = torch.nn.RMSNorm(n, eps=1e-6, dtype=dtype)
        our_mod = TM.RMSNorm(n, eps=1e-6, dtype=dtype)
        for m in (ref_mod, our_mod):
            m.weight.requires_grad_(False).copy_(w)
        calls = {"torch": lambda: F.rms_norm(x, (n,), w, 1e-6), "torch module": lambda: ref_mod(x),
                 "tensor_ops fn": lambda: tensor_ops.rms_norm(x, w, 1e-6),
                 "functional": lambda: TF.rms_norm(x, w, 1e-6),
                 "torch.ops": lambda: torch.ops.tensor_ops.rms_norm(x, w, 1e-6), "module": lambda: our_mod(x)}
    elif name == "layer_norm":
        ref_mod = torch.nn.LayerNorm(n, dtype=dtype)
        our_mod = TM.LayerNorm(n, dtype=dtype)
        for m in (ref_mod, our_mod):
            m.weight.requires_grad_(False).copy_(w), m.bias.requires_grad_(False).copy_(b)
        calls = {"torch": lambda: F.layer_norm(x, (n,), w, b, 1e-5), "torch module": lambda: ref_mod(x),
                 "tensor_ops fn": lambda: tensor_ops.layer_norm(x, w, b, 1e-5),
                 "functional": lambda: TF.layer_norm(x, w, b, 1e-5),
                 "torch.ops": lambda: torch.ops.tensor_ops.layer_norm(x, w, b, 1e-5), "module": lambda: our_mod(x)}
    elif name == "add_rms_norm":
        calls = {"torch": lambda: F.rms_norm(x + r, (n,), w, 1e-6),
                 "tensor_ops fn": lambda: tensor_ops.add_rms_norm(x, r, w, 1e-6),
                 "functional": lambda: TF.add_rms_norm(x, r, w, 1e-6),
                 "torch.ops": lambda: torch.ops.tensor_ops.add_rms_norm(x, r, w, 1e-6)}
    elif name in ("silu", "gelu"):
        ref_mod = torch.nn.SiLU() if name == "silu" else torch.nn.GELU()
        our_mod = TM.SiLU() if name == "silu" else TM.GELU()
        calls = {"torch": lambda: getattr(F, name)(x), "torch module": lambda: ref_mod(x),
                 "tensor_ops fn": lambda: getattr(tensor_ops, name)(x),
                 "functional": lambda: getattr(TF, name)(x),
                 "torch.ops": lambda: getattr(torch.ops.tensor_ops, name)(x), "module": lambda: our_mod(x)}
    elif name == "softmax":
        calls = {"torch": lambda: torch.softmax(x, -1), "tensor_ops fn": lambda: tensor_ops.softmax(x),
                 "functional": lambda: TF.softmax(x), "torch.ops": lambda: torch.ops.tensor_ops.softmax(x)}
    elif name == "swiglu":
        calls = {"torch": lambda: F.silu(x) * r, "tensor_ops fn": lambda: tensor_ops.swiglu(x, r),
                 "functional": lambda: TF.swiglu(x, r), "torch.ops": lambda: torch.ops.tensor_ops.swiglu(x, r)}
    return calls


OPS = ("rms_norm", "layer_norm", "add_rms_norm", "silu", "gelu", "softmax", "swiglu")


def round_robin(calls: Dict[str, Callable], number: int, repeat: int) -> Dict[str, float]:
    names = list(calls)
    timers = {k: timeit.Timer(calls[k]) for k in names}
    for k in names:
        timers[k].timeit(max(1, number // 4))
    samples: Dict[str, List[float]] = {k: [] for k in names}
    for i in range(repeat):
        j = i % len(names)
        for k in names[j:] + names[:j]:
            samples[k].append(timers[k].timeit(number) / number)
    return {k: statistics.median(v) for k, v in samples.items()}


def number_for(call: Callable) -> int:
    t = timeit.Timer(call).timeit(20) / 20
    return max(20, min(3000, int(0.01 / max(t, 1e-7))))


# ---- decode step -------------------------------------------------------------

def decode_step(hidden: int, heads: int, kv_heads: int, inter: int, cache: int, dtype):
    """(torch step, tensor_ops step with torch's GEMMs, tensor_ops step with
    our linear kernel): one token through one transformer layer."""
    g = torch.Generator().manual_seed(1)
    d = hidden // heads

    def p(*s):
        return (torch.randn(*s, generator=g) * 0.05).to(dtype)

    w_in, w_post = (torch.rand(hidden, generator=g) + 0.5).to(dtype), (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    w_qkv, w_o = p((heads + 2 * kv_heads) * d, hidden), p(hidden, heads * d)
    w_gate, w_up, w_down = p(inter, hidden), p(inter, hidden), p(hidden, inter)
    kc, vc = p(1, kv_heads, cache, d), p(1, kv_heads, cache, d)
    x = p(1, 1, hidden)
    pos = torch.tensor([cache - 1])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(cache, dtype=torch.float32), inv)
    cos_t, sin_t = ang.cos(), ang.sin()  # [cache, d/2] tables (ours)
    cos_h = torch.cat([cos_t, cos_t], -1)[pos].to(dtype)  # HF style [1, d] at the position
    sin_h = torch.cat([sin_t, sin_t], -1)[pos].to(dtype)
    cos_o, sin_o = cos_t.to(dtype), sin_t.to(dtype)

    def rotate_half(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return torch.cat((-t2, t1), dim=-1)

    def torch_step():
        h = F.rms_norm(x, (hidden,), w_in, 1e-6)
        qkv = F.linear(h, w_qkv)
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
        q = q.view(1, 1, heads, d).transpose(1, 2)
        k = k.view(1, 1, kv_heads, d).transpose(1, 2)
        q = q * cos_h + rotate_half(q) * sin_h
        k = k * cos_h + rotate_half(k) * sin_h
        kk, vv = torch.cat([kc[:, :, 1:], k], 2), torch.cat([vc[:, :, 1:], v.view(1, 1, kv_heads, d).transpose(1, 2)], 2)
        a = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
        o = F.linear(a.transpose(1, 2).reshape(1, 1, heads * d), w_o)
        res = o + x
        h2 = F.rms_norm(res, (hidden,), w_post, 1e-6)
        m = F.linear(F.silu(F.linear(h2, w_gate)) * F.linear(h2, w_up), w_down)
        return m + res

    def ours_step(linear=F.linear):
        h = TF.rms_norm(x, w_in, 1e-6)
        qkv = linear(h, w_qkv)
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
        q = TF.rope(q.view(1, 1, heads, d), cos_o, sin_o, pos)
        k = TF.rope(k.view(1, 1, kv_heads, d), cos_o, sin_o, pos)
        kk = torch.cat([kc[:, :, 1:], k.transpose(1, 2)], 2)
        vv = torch.cat([vc[:, :, 1:], v.view(1, 1, kv_heads, d).transpose(1, 2)], 2)
        a = TF.attention(q.transpose(1, 2), kk, vv)
        o = linear(a.transpose(1, 2).reshape(1, 1, heads * d), w_o)
        h2, res = TF.add_rms_norm(o, x, w_post, 1e-6)
        m = linear(TF.swiglu(linear(h2, w_gate), linear(h2, w_up)), w_down)
        return m + res

    return torch_step, ours_step, functools.partial(ours_step, TF.linear)


DECODE_CONFIGS = (("hidden 512, 8/2 heads, MLP 1408, cache 2048", 512, 8, 2, 1408, 2048),
                  ("hidden 2048, 16/4 heads, MLP 5632, cache 2048", 2048, 16, 4, 5632, 2048))


def run_threads(threads: int, repeat: int, quick: bool) -> dict:
    torch.set_num_threads(threads)
    _C.cpu_set_num_threads(threads)
    out = {"threads": threads, "ops": {}, "decode": {}}
    with torch.inference_mode():
        for name in OPS:
            for shape in SHAPES:
                for dtype in ((torch.float32, torch.bfloat16) if shape == (32, 4096) else (torch.float32,)):
                    calls = op_calls(name, shape, dtype)
                    ref = calls["torch"]()
                    for k, c in calls.items():  # every entry agrees with torch
                        got = c()
                        got = got[0] if isinstance(got, tuple) else got
                        if not torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2):
                            raise SystemExit(f"*** WRONG RESULT: {k} {name} {shape} {dtype} ***")
                    number = number_for(calls["torch"])
                    med = round_robin(calls, number, repeat)
                    key = f"{name} {dtype_name(dtype)}[{shape[0]}, {shape[1]}]"
                    out["ops"][key] = {k: v for k, v in med.items()}
                    print(f"  {threads}T {key}: " + ", ".join(f"{k} {v * 1e6:.2f}" for k, v in med.items()),
                          file=sys.stderr, flush=True)
        for label, *cfg in DECODE_CONFIGS[: 1 if quick else 2]:
            for dtype in (torch.float32, torch.bfloat16):
                t_step, o_step, l_step = decode_step(*cfg, dtype)
                a = t_step()
                for b in (o_step(), l_step()):
                    err = float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-6))
                    if err > (1e-4 if dtype == torch.float32 else 5e-2):
                        raise SystemExit(f"*** WRONG RESULT: decode step {label} {dtype}: relative error {err:.2e} ***")
                number = number_for(t_step)
                med = round_robin({"torch": t_step, "tensor_ops": o_step, "tensor_ops linear": l_step}, number, repeat)
                out["decode"][f"{label} {dtype_name(dtype)}"] = med
                print(f"  {threads}T decode {label} {dtype}: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in med.items()),
                      file=sys.stderr, flush=True)
    return out


def dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def markdown(report: dict) -> str:
    lines = ["## Calls from torch: per op and entry point, and a decode step", "",
             f"{report['machine']} · {report['repeat']} round-robin samples per implementation, medians · "
             f"`{report['command']}`", "",
             "Per call in µs, torch tensors, inference (no gradient recorded). Ratio = torch's time / ours "
             "(> 1: tensor_ops faster); the module column compares with torch's nn module, the others with F.*.", ""]
    for run in report["runs"]:
        t = run["threads"]
        lines += [f"### {t} thread{'s' if t > 1 else ''}", "",
                  "| op | torch µs | tensor_ops fn | functional | torch.ops | torch module µs | module |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for key, med in run["ops"].items():
            ref = med["torch"]

            def cell(k, base=ref):
                return "—" if k not in med else f"{med[k] * 1e6:.2f} ({base / med[k]:.2f}x)"
            mod = med.get("torch module")
            lines.append(f"| {key} | {ref * 1e6:.2f} | {cell('tensor_ops fn')} | {cell('functional')} | "
                         f"{cell('torch.ops')} | {'—' if mod is None else f'{mod * 1e6:.2f}'} | "
                         f"{cell('module', mod) if mod else '—'} |")
        lines += ["", "| decode step (one layer) | torch µs | tensor_ops, torch's GEMMs µs | speedup | "
                  "tensor_ops, our linear µs | speedup |", "|---|---:|---:|---:|---:|---:|"]
        for key, med in run["decode"].items():
            lin = med.get("tensor_ops linear")
            lines.append(f"| {key} | {med['torch'] * 1e6:.1f} | {med['tensor_ops'] * 1e6:.1f} | "
                         f"{med['torch'] / med['tensor_ops']:.2f}x | "
                         + ("— | — |" if lin is None else f"{lin * 1e6:.1f} | {med['torch'] / lin:.2f}x |"))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="few samples, one decode config, RESULTS.md left alone")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    repeat = 5 if args.quick else args.repeat
    if args.child:
        print(json.dumps(run_threads(args.child, repeat, args.quick)))
        return 0
    runs = []
    for t in (int(s) for s in args.threads.split(",")):
        cmd = [sys.executable, __file__, "--child", str(t), "--repeat", str(repeat)] + (["--quick"] if args.quick else [])
        env = dict(os.environ, TENSOR_OPS_NUM_THREADS=str(t), OMP_NUM_THREADS=str(t))
        res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "repeat": repeat, "runs": runs,
              "command": " ".join(["python bench/bench_torch_calls.py", *(sys.argv[1:] if argv is None else argv)])}
    out = BENCH / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch_calls.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    print(md)
    if not args.quick:
        print(f"Section written to {write_section('torch_calls', '2 latency b', md)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
