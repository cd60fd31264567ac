"""Real transformers models end to end: the original against the same model
after prepare_model(model, "O1"), interleaved in one process.

    python bench/bench_hf.py [--families llama gpt2 ...] [--hidden 512]
        [--layers 2] [--vocab 1000] [--batch 4] [--seq 256] [--prompt 256]
        [--new-tokens 128] [--reps 10] [--threads 1 2]
        [--dtypes float32 bfloat16] [--bf16-reps N] [--no-bf16-train]
        [--json bench/out/hf.json] [--smoke | --quick] [--profile]

Per family, thread count and dtype: forward (no grad), a training step
(forward + backward + optimizer step: torch's default AdamW for the
original; for the prepared model the optimizer optimize_for_training hands
back for that AdamW) and greedy generate (batch 1, --new-tokens after a
--prompt-token prompt, KV cache) in tokens/s; median of --reps after one
warm-up, the two models alternating call by call so that drift in the
machine's load hits both alike. Peak RSS of one training step of each model,
measured in a fresh interpreter (this script again, spawned, with a time
limit) that rebuilds the model from the config and seed: its peak RSS during
the step over its RSS before it. Threads: torch's and tensor_ops' CPU kernel
threads alike. --smoke: a tiny size and 2 reps, to check the script runs
(the numbers mean nothing; peak RSS for the first row only). --quick:
llama and gpt2 at the issue's size, float32 as above, bfloat16 forward and
decode only at 3 reps: on a CPU without bf16 instructions (AVX2 only)
torch's bf16 GEMMs are emulated and one bf16 training step of llama here
takes ~25 s, so ten of them per model do not fit in minutes. Prints a
markdown table (medians in ms or tokens/s, original / prepared, speedup,
seconds the row took); --json writes every number.

--profile (llama unless --families is given; --threads / --dtypes as above):
torch.profiler over the forward, forward + backward, and the training step
of each model, self CPU time per op per call, split into GEMMs (aten::mm,
addmm, bmm, matmul, linear, with whatever runs inside them: addmm's copy
of the bias into its output) and everything else, with the top non-GEMM ops
of each model and the ratio non-GEMM(prepared) / non-GEMM(original) (issue
24 asks for <= 0.5). Our kernels are no torch ops, so while profiling each
is wrapped in a record_function named tensor_ops::<op>; "(python)" is the
time inside the step that no recorded op accounts for (Python in HF's and
our modules, the interpreter, the profiler's own cost).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import torch

import tensor_ops
import tensor_ops.torch as tt
from tensor_ops import _C
from tensor_ops.torch import custom_ops

try:
    import transformers
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"bench_hf.py needs transformers: pip install transformers ({e})")

transformers.logging.set_verbosity_error()

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "gpt_neox", "gpt2"]


def make_config(family: str, hidden: int, layers: int, vocab: int, positions: int):
    heads = max(hidden // 64, 2)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4 // 1, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=positions)
    kv = dict(num_key_value_heads=max(heads // 2, 1))
    C = transformers
    return {
        "llama": lambda: C.LlamaConfig(**common, **kv),
        "qwen2": lambda: C.Qwen2Config(**common, **kv),
        "qwen3": lambda: C.Qwen3Config(**common, **kv),
        "mistral": lambda: C.MistralConfig(**common, **kv, sliding_window=None),
        "gemma": lambda: C.GemmaConfig(**common, **kv, head_dim=hidden // heads),
        "gemma2": lambda: C.Gemma2Config(**common, **kv, head_dim=hidden // heads),
        "phi3": lambda: C.Phi3Config(**common, **kv, pad_token_id=0),
        "gpt_neox": lambda: C.GPTNeoXConfig(**common, hidden_dropout=0.0, attention_dropout=0.0),
        "gpt2": lambda: C.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                     n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    }[family]()


def build(family, args, dtype):
    torch.manual_seed(0)
    cfg = make_config(family, args.hidden, args.layers, args.vocab, max(args.seq, args.prompt + args.new_tokens) + 8)
    impl = "eager" if family == "gemma2" else "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(fns: dict, reps: int) -> dict:
    for fn in fns.values():  # warm-up
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def train_step_fn(model, x, optimizer=None):
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()
        opt.step()

    return step


CPU = None  # the CPU Backend, made on first use


def prepared_train_step_fn(model, x):
    """The prepared model's step: optimize_for_training(model, AdamW) (model
    already prepared: that part changes nothing), its optimizer."""
    global CPU
    CPU = CPU or tt.BackendFactory.create("cpu")
    model, opt, _ = CPU.optimize_for_training(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return train_step_fn(model, x, opt)


def make_train_step(which, model, x):
    return (prepared_train_step_fn if which == "prepared" else train_step_fn)(model, x)


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    _C.cpu_set_num_threads(threads)


def _current_rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rss_child(spec: dict) -> None:
    """In the spawned interpreter: one training step of the model spec names,
    rebuilt from its config and seed; prints the step's peak RSS growth."""
    args = argparse.Namespace(**spec["args"])
    set_threads(spec["threads"])
    model = build(spec["family"], args, getattr(torch, spec["dtype"]))
    if spec["which"] == "prepared":
        model, _ = tt.prepare_model(model, "O1", backend="cpu")
    model.train()
    x = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    step = make_train_step(spec["which"], model, x)
    try:  # Linux: "5" resets the peak (VmHWM) to the current RSS, so the build's own peak does not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    start = _current_rss_kib()
    step()
    print(json.dumps({"peak_bytes": max(_peak_rss_kib() - start, 0) * 1024}))


def peak_rss_bytes(family, args, dtype, threads, which):
    """The training step's peak RSS growth, in a fresh interpreter (no fork of
    this one: its torch / OpenMP threads make a forked child hang); None when
    the child fails or runs past --rss-timeout."""
    spec = {"family": family, "dtype": str(dtype).replace("torch.", ""), "threads": threads, "which": which,
            "args": {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "batch", "seq", "prompt",
                                                   "new_tokens")}}
    env = dict(os.environ, TENSOR_OPS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=args.rss_timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"# peak RSS of {family} {which}: timed out after {args.rss_timeout} s", file=sys.stderr)
        return None
    if done.returncode != 0:
        print(f"# peak RSS of {family} {which} failed: {done.stderr.strip()[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]


def build_pair(family, args, dtype):
    original = build(family, args, dtype)
    prepared, result = tt.prepare_model(copy.deepcopy(original), "O1", backend="cpu")
    return {"original": original, "prepared": prepared}, result


def paired(models: dict, make) -> dict:
    """{which: make(which, model)}. (Each model runs its own RoPE by itself:
    prepare_model's RoPE is the prepared model's only, so the original runs
    HF's without any help.)"""
    return {k: make(k, m) for k, m in models.items()}


def bench_family(family, args, dtype, threads, reps: int, train: bool, rss: bool):
    """One row: forward, decode and (when train) the training step, reps
    each; the peak RSS children when rss."""
    start = time.perf_counter()
    set_threads(threads)
    models, result = build_pair(family, args, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=g)
    row = {"family": family, "dtype": str(dtype).replace("torch.", ""), "threads": threads, "reps": reps,
           "warnings": result.warnings}
    for m in models.values():
        m.eval()
    with torch.no_grad():
        fwd = interleaved(paired(models, lambda k, m: lambda: m(x)), reps)
        gen_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=0)
        gen = interleaved(paired(models, lambda k, m: lambda: m.generate(prompt, **gen_kw)), reps)
    step = dict.fromkeys(models)
    if train:
        for m in models.values():
            m.train()
        step = interleaved(paired(models, lambda k, m: make_train_step(k, m, x)), reps)
    peak = {k: peak_rss_bytes(family, args, dtype, threads, k) if rss and train else None for k in models}
    for k in models:
        row[k] = {"forward_s": fwd[k], "train_step_s": step[k], "decode_tokens_per_s": args.new_tokens / gen[k],
                  "train_peak_rss_bytes": peak[k]}
    row["speedup"] = {"forward": fwd["original"] / fwd["prepared"],
                      "train_step": step["original"] / step["prepared"] if train else None,
                      "decode": gen["original"] / gen["prepared"]}
    row["elapsed_s"] = time.perf_counter() - start
    return row


def _pair(o, p, scale, fmt, speedup) -> str:
    if o is None:
        return "-"
    return f"{o * scale:{fmt}} / {p * scale:{fmt}} ({speedup:.2f}x)"


def print_row(r) -> None:
    o, p, s = r["original"], r["prepared"], r["speedup"]
    print(f"| {r['family']} | {r['dtype']} | {r['threads']} | {r['reps']} "
          f"| {_pair(o['forward_s'], p['forward_s'], 1e3, '.0f', s['forward'])} "
          f"| {_pair(o['train_step_s'], p['train_step_s'], 1e3, '.0f', s['train_step'])} "
          f"| {_pair(o['decode_tokens_per_s'], p['decode_tokens_per_s'], 1, '.1f', s['decode'])} "
          f"| {mib(o['train_peak_rss_bytes'])} / {mib(p['train_peak_rss_bytes'])} | {r['elapsed_s']:.0f} |", flush=True)


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
PYTHON = "(python)"
GEMM = "(GEMM)"


@contextlib.contextmanager
def labelled_kernels():
    """Each tensor_ops kernel the torch layer calls, wrapped in a
    record_function "tensor_ops::<op>" (the profiler sees no torch op there):
    the public ops, and the functional layer's direct lane (Note [direct
    lane]), labelled by the op table entry it runs."""
    names = [n for n in vars(custom_ops.DIRECT) if callable(getattr(tensor_ops, n, None))]
    saved = {n: getattr(tensor_ops, n) for n in names}
    direct = custom_ops.torch_call

    def label(name, fn):
        def call(*a, **kw):
            with torch.profiler.record_function(f"tensor_ops::{name}"):
                return fn(*a, **kw)
        return call

    def direct_labelled(entry, arrays, extra):
        with torch.profiler.record_function(f"tensor_ops::{entry}"):
            return direct(entry, arrays, extra)

    for n, fn in saved.items():
        setattr(tensor_ops, n, label(n, fn))
    custom_ops.torch_call = direct_labelled
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(tensor_ops, n, fn)
        custom_ops.torch_call = direct


def self_times(fn, reps: int) -> dict:
    """Self CPU microseconds per call of fn, by op; everything inside a GEMM
    op (addmm's copy of the bias into its output too) under GEMM; the
    step's time no op accounts for under PYTHON."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            with torch.profiler.record_function(PYTHON):
                fn()
    out = collections.Counter()
    for e in prof.events():
        p = e
        while p is not None and p.name not in GEMM_OPS:
            p = p.cpu_parent
        out[GEMM if p is not None else e.name] += e.self_cpu_time_total / reps
    return out


def split(times: dict):
    return times.get(GEMM, 0.0), sum(t for k, t in times.items() if k != GEMM)


def profile_family(family, args, dtype, threads):
    set_threads(threads)
    models, _ = build_pair(family, args, dtype)
    x = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def forward(k, m):
        def run():
            with torch.no_grad():
                m(x)
        return run

    phases = {"forward (no grad)": paired(models, forward),
              "forward + backward": paired(models, lambda k, m: lambda: m(x, labels=x).loss.backward()),
              "training step (+ AdamW; prepared: optimize_for_training's)":
                  paired(models, lambda k, m: make_train_step(k, m, x))}
    rows = []
    with labelled_kernels():
        for phase, fns in phases.items():
            for m in models.values():
                m.train(not phase.startswith("forward ("))
            times = {k: collections.Counter() for k in fns}
            for _ in range(2):  # the models alternate, twice, so that drift hits both alike
                for k, fn in fns.items():
                    times[k].update(self_times(fn, args.profile_reps))
            times = {k: {op: t / 2 for op, t in v.items()} for k, v in times.items()}
            (go, no), (gp, np_) = split(times["original"]), split(times["prepared"])
            print(f"\n### {family} {str(dtype).replace('torch.', '')} {threads} thread(s): {phase}\n")
            print(f"per call, ms: GEMM original {go / 1e3:.1f}, prepared {gp / 1e3:.1f}; "
                  f"non-GEMM original {no / 1e3:.1f}, prepared {np_ / 1e3:.1f}; "
                  f"non-GEMM prepared / original = {np_ / no:.2f}; "
                  f"total prepared / original = {(gp + np_) / (go + no):.2f}\n")
            tops = {k: sorted(((t, op) for op, t in v.items() if op != GEMM), reverse=True)[:args.top]
                    for k, v in times.items()}
            print("| # | original: op | ms | % non-GEMM | prepared: op | ms | % non-GEMM |")
            print("|---|---|---|---|---|---|---|")
            for i in range(args.top):
                cells = []
                for k, total in (("original", no), ("prepared", np_)):
                    t, op = tops[k][i] if i < len(tops[k]) else (0.0, "")
                    cells += [op, f"{t / 1e3:.2f}", f"{100 * t / total:.0f}"]
                print(f"| {i + 1} | " + " | ".join(cells) + " |")
            rows.append({"family": family, "dtype": str(dtype).replace("torch.", ""), "threads": threads,
                         "phase": phase, "gemm_us": {"original": go, "prepared": gp},
                         "non_gemm_us": {"original": no, "prepared": np_}, "non_gemm_ratio": np_ / no,
                         "self_us": times})
    return rows


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=FAMILIES,
                    help="default: all (llama with --profile, llama and gpt2 with --quick)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 reps: checks the script, not the speed")
    ap.add_argument("--quick", action="store_true",
                    help="llama and gpt2; bfloat16 with --bf16-reps 3 and --no-bf16-train (see above)")
    ap.add_argument("--bf16-reps", type=int, help="reps for bfloat16 (default: --reps)")
    ap.add_argument("--no-bf16-train", dest="bf16_train", action="store_false",
                    help="bfloat16: forward and decode only (no training step, no peak RSS)")
    ap.add_argument("--profile", action="store_true", help="the profiler's GEMM / non-GEMM split (see above)")
    ap.add_argument("--profile-reps", type=int, default=3, help="profiled calls per model and phase, per round")
    ap.add_argument("--top", type=int, default=10, help="non-GEMM ops listed per model with --profile")
    ap.add_argument("--no-rss", dest="rss", action="store_false", help="skip the peak-RSS children")
    ap.add_argument("--rss-timeout", type=float, default=300.0, help="seconds allowed to each peak-RSS child")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(json.loads(args.rss_child))
        return
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.batch, args.seq = 64, 1, 128, 1, 16
        args.prompt, args.new_tokens, args.reps, args.profile_reps = 8, 4, 2, 1
    if args.quick:
        args.bf16_reps, args.bf16_train = args.bf16_reps or 3, False
    if args.families is None:
        args.families = ["llama"] if args.profile else ["llama", "gpt2"] if args.quick else FAMILIES
    if args.profile:
        rows = [r for dtype in args.dtypes for threads in args.threads for family in args.families
                for r in profile_family(family, args, getattr(torch, dtype), threads)]
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "profile": rows},
                                            indent=1))
        return
    rows = []
    print("| family | dtype | threads | reps | forward ms (orig / ours) | train step ms (orig / ours) "
          "| decode tok/s (orig / ours) | train peak RSS MiB (orig / ours) | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        bf16 = dtype == "bfloat16"
        for threads in args.threads:
            for family in args.families:
                r = bench_family(family, args, getattr(torch, dtype), threads,
                                 reps=(args.bf16_reps or args.reps) if bf16 else args.reps,
                                 train=args.bf16_train or not bf16, rss=args.rss and not (args.smoke and rows))
                rows.append(r)
                print_row(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
