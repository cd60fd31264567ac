"""Real transformers models end to end: the original against the same model
after prepare_model(model, "O1"), interleaved in one process.

    python bench/bench_hf.py [--families llama gpt2 ...] [--hidden 512]
        [--layers 2] [--vocab 1000] [--batch 4] [--seq 256] [--prompt 256]
        [--new-tokens 128] [--reps 10] [--threads 1 2]
        [--dtypes float32 bfloat16] [--json bench/out/hf.json] [--smoke]

Per family, thread count and dtype: forward (no grad), a training step
(forward + backward + torch's default AdamW step) and greedy generate
(batch 1, --new-tokens after a --prompt-token prompt, KV cache) in tokens/s;
median of --reps after one warm-up, the two models alternating call by call
so that drift in the machine's load hits both alike. Peak RSS of one
training step of each model, measured in a forked child (its peak over its
RSS at the start). --smoke: a tiny size and 2 reps, to check the script
runs (the numbers mean nothing). Prints a markdown table; --json writes
every number.
"""
from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import pathlib
import resource
import statistics
import time

import torch

import tensor_ops.torch as tt

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


def train_step_fn(model, x):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()
        opt.step()

    return step


def _peak_child(model, x, queue):
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open("/proc/self/statm") as f:
        start = int(f.read().split()[1]) * resource.getpagesize() // 1024
    train_step_fn(model, x)()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put((max(peak, base) - start) * 1024)


def peak_rss_bytes(model, x) -> int:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(model, x, queue))
    p.start()
    out = queue.get(timeout=600)
    p.join()
    return out


def bench_family(family, args, dtype, threads):
    torch.set_num_threads(threads)
    original = build(family, args, dtype)
    prepared, result = tt.prepare_model(copy.deepcopy(original), "O1", backend="cpu")
    models = {"original": original, "prepared": prepared}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=g)
    row = {"family": family, "dtype": str(dtype).replace("torch.", ""), "threads": threads,
           "warnings": result.warnings}
    for m in models.values():
        m.eval()
    with torch.no_grad():
        fwd = interleaved({k: (lambda m=m: m(x)) for k, m in models.items()}, args.reps)
        gen_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=0)
        gen = interleaved({k: (lambda m=m: m.generate(prompt, **gen_kw)) for k, m in models.items()},
                          max(args.reps // 2, 2))
    for m in models.values():
        m.train()
    steps = {k: train_step_fn(m, x) for k, m in models.items()}
    train = interleaved(steps, args.reps)
    rss = {k: peak_rss_bytes(m, x) for k, m in models.items()}
    for k in models:
        row[k] = {"forward_s": fwd[k], "train_step_s": train[k], "decode_tokens_per_s": args.new_tokens / gen[k],
                  "train_peak_rss_bytes": rss[k]}
    row["speedup"] = {"forward": fwd["original"] / fwd["prepared"], "train_step": train["original"] / train["prepared"],
                      "decode": gen["original"] / gen["prepared"]}
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
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
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.batch, args.seq = 64, 1, 128, 1, 16
        args.prompt, args.new_tokens, args.reps = 8, 4, 2
    rows = []
    print("| family | dtype | threads | forward x | train step x | decode x | decode tok/s (orig / ours) "
          "| train peak RSS MiB (orig / ours) |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for threads in args.threads:
            for family in args.families:
                r = bench_family(family, args, getattr(torch, dtype), threads)
                rows.append(r)
                o, p, s = r["original"], r["prepared"], r["speedup"]
                print(f"| {family} | {dtype} | {threads} | {s['forward']:.2f} | {s['train_step']:.2f} "
                      f"| {s['decode']:.2f} | {o['decode_tokens_per_s']:.1f} / {p['decode_tokens_per_s']:.1f} "
                      f"| {o['train_peak_rss_bytes'] / 2**20:.0f} / {p['train_peak_rss_bytes'] / 2**20:.0f} |",
                      flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
