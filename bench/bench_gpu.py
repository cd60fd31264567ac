"""Every tensor_ops op on a CUDA (or ROCm) GPU at DRAM-sized shapes, against
torch eager, torch.compile and, where installed, Liger-Kernel, as a fraction
of the device-to-device copy bandwidth measured in the same run.

    python bench/bench_gpu.py                    # every op, bfloat16 and float32, ~5 min on an H100
    python bench/bench_gpu.py --ops rms_norm softmax --dtypes bfloat16 --reps 50
    python bench/bench_gpu.py --no-compile       # skip torch.compile (faster)

Needs torch with CUDA (or ROCm) and tensor_ops built with its CUDA (HIP)
plugin; exits with a message (status 2) where no GPU is present. Times are
CUDA-event medians over --reps calls after warm-up; every implementation's
result is checked against torch eager in float32 first (a wrong kernel stops
the run). Bytes are what the op must move at least (inputs read once,
outputs written once, weights and tables not counted); "% copy" divides that
rate by the rate of `dst.copy_(src)` on 1 GiB, measured at the start of the
run. Attention is compute-bound: its row also gives TFLOP/s.

--smoke-cpu runs the same code on the CPU backend with tiny shapes and
wall-clock timing: a check that the script works, not a benchmark.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None

import tensor_ops

try:  # optional peer
    import liger_kernel.ops as liger_ops  # noqa: F401
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    HAVE_LIGER = True
except Exception:  # not installed, or an API that moved
    HAVE_LIGER = False


class Op:
    def __init__(self, name, make, ours, eager, nbytes, liger=None, flops=None, tol=None):
        self.name, self.make, self.ours, self.eager, self.nbytes = name, make, ours, eager, nbytes
        self.liger, self.flops, self.tol = liger, flops, tol


def rms_ref(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rms_bwd_ref(dy, x, w, eps=1e-6):
    xf, g = x.float(), dy.float() * w.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xh = xf * rstd
    dx = rstd * (g - xh * (g * xh).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy.float() * xh).sum(0).to(w.dtype)


def ln_bwd_ref(dy, x, w, eps=1e-5):
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    xh, g = (xf - mean) * rstd, dy.float() * w.float()
    dx = rstd * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy.float() * xh).sum(0).to(w.dtype), dy.float().sum(0).to(w.dtype)


def silu_bwd_ref(dy, x):
    s = torch.sigmoid(x.float())
    return (dy.float() * s * (1 + x.float() * (1 - s))).to(x.dtype)


def swiglu_bwd_ref(dy, g, u):
    gf, s = g.float(), torch.sigmoid(g.float())
    return ((dy.float() * u.float() * s * (1 + gf * (1 - s))).to(g.dtype), (dy.float() * gf * s).to(u.dtype))


def softmax_bwd_ref(dy, y):
    yf = y.float()
    return (yf * (dy.float() - (dy.float() * yf).sum(-1, keepdim=True))).to(y.dtype)


def rope_ref(x, cos, sin, pos):
    # x [B, S, H, D], tables [P, D/2], GPT-NeoX halves
    c, s = cos[pos][:, :, None, :].float(), sin[pos][:, :, None, :].float()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def make_ops(R: int, C: int, att: tuple, rope_dims: tuple, ce: tuple) -> List[Op]:
    def rows(n, dt, dev):
        return [torch.randn(R, C, device=dev, dtype=dt) for _ in range(n)]

    def wvec(dt, dev):
        return torch.rand(C, device=dev, dtype=dt) + 0.5

    def rope_args(dt, dev):
        B, S, H, D = rope_dims
        ang = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * torch.rand(D // 2, device=dev)
        pos = torch.arange(S, device=dev).expand(B, S).contiguous()
        return (torch.randn(B, S, H, D, device=dev, dtype=dt), ang.cos().to(dt), ang.sin().to(dt), pos)

    def att_args(dt, dev):
        B, H, L, D = att
        return tuple(torch.randn(B, H, L, D, device=dev, dtype=dt) for _ in range(3))

    def att_bwd_args(dt, dev):
        q, k, v = att_args(dt, dev)
        out, lse = tensor_ops.attention(q, k, v, causal=True, return_lse=True)
        return (torch.randn_like(q), q, k, v, out, lse)

    def ce_args(dt, dev):
        N, V = ce
        return (torch.randn(N, V, device=dev, dtype=dt), torch.randint(0, V, (N,), device=dev))

    B, H, L, D = att
    att_flops = 4 * B * H * L * L * D / 2  # causal: half the score matrix
    el = lambda t: t.numel() * t.element_size()  # noqa: E731
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    ops = [
        Op("rms_norm", lambda dt, dev: (*rows(1, dt, dev), wvec(dt, dev)), lambda x, w: tensor_ops.rms_norm(x, w),
           lambda x, w: F.rms_norm(x, (C,), w, 1e-6), lambda a: 2 * el(a[0]),
           liger=lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)),
        Op("rms_norm_backward", lambda dt, dev: (*rows(2, dt, dev), wvec(dt, dev)),
           lambda dy, x, w: tensor_ops.rms_norm_backward(dy, x, w), rms_bwd_ref, lambda a: 3 * el(a[0])),
        Op("layer_norm", lambda dt, dev: (*rows(1, dt, dev), wvec(dt, dev), wvec(dt, dev)),
           lambda x, w, b: tensor_ops.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5),
           lambda a: 2 * el(a[0]), liger=lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)),
        Op("layer_norm_backward", lambda dt, dev: (*rows(2, dt, dev), wvec(dt, dev)),
           lambda dy, x, w: tensor_ops.layer_norm_backward(dy, x, w), ln_bwd_ref, lambda a: 3 * el(a[0])),
        Op("add_rms_norm", lambda dt, dev: (*rows(2, dt, dev), wvec(dt, dev)),
           lambda x, r, w: tensor_ops.add_rms_norm(x, r, w), lambda x, r, w: (rms_ref(x + r, w), x + r),
           lambda a: 4 * el(a[0])),
        Op("silu", lambda dt, dev: tuple(rows(1, dt, dev)), tensor_ops.silu, F.silu, lambda a: 2 * el(a[0])),
        Op("gelu", lambda dt, dev: tuple(rows(1, dt, dev)), tensor_ops.gelu, F.gelu, lambda a: 2 * el(a[0])),
        Op("activation_backward", lambda dt, dev: tuple(rows(2, dt, dev)), tensor_ops.silu_backward, silu_bwd_ref,
           lambda a: 3 * el(a[0])),
        Op("glu", lambda dt, dev: tuple(rows(2, dt, dev)), tensor_ops.swiglu, lambda g, u: F.silu(g) * u,
           lambda a: 3 * el(a[0]), liger=lambda g, u: LigerSiLUMulFunction.apply(g, u)),
        Op("glu_backward", lambda dt, dev: tuple(rows(3, dt, dev)), tensor_ops.swiglu_backward, swiglu_bwd_ref,
           lambda a: 5 * el(a[0])),
        Op("softmax", lambda dt, dev: tuple(rows(1, dt, dev)), tensor_ops.softmax,
           lambda x: torch.softmax(x, -1), lambda a: 2 * el(a[0])),
        Op("softmax_backward", lambda dt, dev: (rows(1, dt, dev)[0], torch.softmax(rows(1, dt, dev)[0], -1)),
           tensor_ops.softmax_backward, softmax_bwd_ref, lambda a: 3 * el(a[0])),
        Op("rope", rope_args, lambda x, c, s, p: tensor_ops.rope(x, c, s, p), rope_ref, lambda a: 2 * el(a[0]),
           liger=None),
        Op("attention", att_args, lambda q, k, v: tensor_ops.attention(q, k, v, causal=True), sdpa,
           lambda a: 4 * el(a[0]), flops=att_flops, tol=3e-2),
        Op("attention_backward", att_bwd_args,
           lambda do, q, k, v, o, lse: tensor_ops.attention_backward(do, q, k, v, o, lse, causal=True), None,
           lambda a: 8 * el(a[1]), flops=2.5 * att_flops),
        Op("cross_entropy", ce_args, lambda x, t: tensor_ops.cross_entropy(x, t),
           lambda x, t: F.cross_entropy(x.float(), t), lambda a: el(a[0]),
           liger=lambda x, t: LigerCrossEntropyFunction.apply(x, t)[0]),
    ]
    return ops


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def timer(dev: str, reps: int) -> Callable[[Callable[[], object]], List[float]]:
    def run(fn):
        for _ in range(3):
            fn()
        samples = []
        for _ in range(reps):
            if dev == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                samples.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
        return samples
    return run


def copy_bandwidth(dev: str, time_fn, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / statistics.median(time_fn(lambda: dst.copy_(src)))


def check(name: str, impl: str, got, want, tol: float) -> None:
    got, want = first(got).float(), first(want).float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    if not math.isfinite(err) or err > tol:
        sys.exit(f"bench_gpu: {name}: {impl} differs from torch eager: max error {err:.3g} of max |ref| (> {tol})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="*", help="ops of ops.def to run (default all)")
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--json", default="bench/out/gpu.json")
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch is None:
        print("bench_gpu: needs torch (pip install torch with CUDA or ROCm)", file=sys.stderr)
        return 2
    if args.smoke_cpu:
        dev, R, C = "cpu", 64, 256
        att, rope_dims, ce = (1, 2, 64, 32), (1, 16, 2, 32), (64, 1000)
        args.reps, args.no_compile = 2, True
    else:
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA (or ROCm) device: torch.cuda.is_available() is False. This benchmark "
                  "needs a GPU; tests/gpu_emulation checks the kernels' results without one.", file=sys.stderr)
            return 2
        gpu = {b.name: b for b in tensor_ops.backends()}
        if not any(gpu.get(n) is not None and gpu[n].usable for n in ("cuda", "hip")):
            reasons = "; ".join(f"{n}: {gpu[n].reason}" for n in ("cuda", "hip") if n in gpu)
            print(f"bench_gpu: torch sees a GPU but tensor_ops has no usable cuda / hip backend ({reasons})",
                  file=sys.stderr)
            return 2
        dev, R, C = "cuda", args.rows, args.cols
        att, rope_dims, ce = (4, 32, 4096, 128), (8, 4096, 32, 128), (8192, 128256)
    time_fn = timer(dev, args.reps)
    bw = copy_bandwidth(dev, time_fn, (1 << 30) if dev == "cuda" else (1 << 24))
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke run)"
    print(f"device: {name}; device-to-device copy: {bw / 1e9:.0f} GB/s; liger-kernel: "
          f"{'yes' if HAVE_LIGER else 'not installed'}")
    report: Dict[str, object] = {"device": name, "copy_bytes_per_s": bw, "results": []}
    for dtype_name in args.dtypes:
        dt = getattr(torch, dtype_name)
        tol = 2e-2 if dt != torch.float32 else 1e-3
        print(f"\n{dtype_name}, rows {R} x {C} (row ops)\n{'op':<22}{'impl':<10}{'ms':>10}{'GB/s':>10}"
              f"{'% copy':>9}{'TFLOP/s':>9}")
        for op in make_ops(R, C, att, rope_dims, ce):
            if args.ops and op.name not in args.ops:
                continue
            a = op.make(dt, dev)
            impls: Dict[str, Optional[Callable]] = {"tensor_ops": lambda: op.ours(*a)}
            if op.eager is not None:
                impls["eager"] = lambda: op.eager(*a)
                if not args.no_compile:
                    impls["compile"] = (lambda f: (lambda: f(*a)))(torch.compile(op.eager, dynamic=False))
            if op.liger is not None and HAVE_LIGER and dev == "cuda":
                impls["liger"] = lambda: op.liger(*a)
            want = impls["eager"]() if "eager" in impls else None
            for impl, fn in list(impls.items()):
                try:
                    got = fn()
                except Exception as e:  # a peer that does not take these inputs
                    if impl == "tensor_ops":
                        raise
                    print(f"{op.name:<22}{impl:<10} skipped: {type(e).__name__}: {e}")
                    del impls[impl]
                    continue
                if want is not None and impl != "eager":
                    check(op.name, impl, got, want, op.tol or tol)
            for impl, fn in impls.items():
                med = statistics.median(time_fn(fn))
                rate = op.nbytes(a) / med
                tf = f"{op.flops / med / 1e12:9.1f}" if op.flops else f"{'':9}"
                print(f"{op.name:<22}{impl:<10}{med * 1e3:10.3f}{rate / 1e9:10.0f}{100 * rate / bw:8.0f}%{tf}")
                report["results"].append({"op": op.name, "dtype": dtype_name, "impl": impl, "seconds": med,
                                          "bytes": op.nbytes(a), "pct_copy": 100 * rate / bw})
            del a
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
