#!/usr/bin/env python3
"""The CUDA attention kernels for float16 / bfloat16 run on tensor cores:
compiles cuda/attention.cu to PTX (nvcc -ptx, no GPU needed) for each
architecture given and checks that the forward, dq and dk/dv kernels for
both 16-bit types exist at every head-dim instantiation and that each one's
body contains mma.sync.aligned.m16n8k16 with the type's operands (a kernel
that fell back to the shuffle path would have none). Prints per kernel the
mma count and the PTX instruction count (issue-slot model for the note).

    python3 tests/gpu_ptx/check_attention_ptx.py [--arch 80 90] [--nvcc nvcc]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = ["attention_mma_kernel", "attention_dq_mma_kernel", "attention_dkdv_mma_kernel"]
TYPES = {"13__nv_bfloat16": "bf16", "6__half": "f16"}
DIMS = [16, 32, 64, 128]


def entries(ptx):
    """{mangled name: body} of every .entry in a PTX text."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\S+)\s*\(", ptx):
        start = ptx.index("{", m.end())
        depth, i = 0, start
        while True:
            if ptx[i] == "{":
                depth += 1
            elif ptx[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        out[m.group(1)] = ptx[start:i]
    return out


def instructions(body):
    return sum(1 for line in body.splitlines()
               if re.match(r"\s*(@!?%p\d+\s+)?[a-z][a-z0-9_.]*\s", line) and not line.strip().startswith("."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="+", default=["80", "90"])
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    a = ap.parse_args()
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.arch:
            ptx_path = os.path.join(tmp, f"attention_sm{arch}.ptx")
            subprocess.run([a.nvcc, "-std=c++17", f"-arch=sm_{arch}", "-ptx", "-I", os.path.join(REPO, "cpp", "include"),
                            os.path.join(REPO, "cuda", "attention.cu"), "-o", ptx_path], check=True)
            found = entries(open(ptx_path).read())
            print(f"sm_{arch}: {'kernel':<28}{'type':<6}{'D':>5}{'mma':>7}{'PTX instrs':>12}{'instrs/mma':>12}")
            for kernel in KERNELS:
                for mangled_type, ptx_type in TYPES.items():
                    for dim in DIMS:
                        # ...<kernel>I<type>Li<dim>EE...
                        names = [n for n in found if f"{len(kernel)}{kernel}I{mangled_type}Li{dim}E" in n]
                        if len(names) != 1:
                            problems.append(f"sm_{arch}: {kernel}<{ptx_type}, {dim}>: {len(names)} entries in the PTX")
                            continue
                        body = found[names[0]]
                        mma = len(re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ptx_type}\.{ptx_type}\.f32",
                                             body))
                        n = instructions(body)
                        print(f"sm_{arch}: {kernel:<28}{ptx_type:<6}{dim:>5}{mma:>7}{n:>12}{n / max(mma, 1):>12.1f}")
                        if mma == 0:
                            problems.append(f"sm_{arch}: {kernel}<{ptx_type}, {dim}> has no mma.sync m16n8k16")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print("check_attention_ptx: every 16-bit attention kernel uses mma.sync m16n8k16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
