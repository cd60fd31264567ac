#!/usr/bin/env python3
"""Checks one conformance run on the emulated backends (.ci/gpu_emulation):
no test skipped or failed on any emulated backend, and every op of ops.def
run there in every float dtype, forward and backward (the plugins' op log,
TENSOR_OPS_EMU_OPLOG). Prints the counts per backend."""
import argparse
import collections
import os
import re
import sys
import xml.etree.ElementTree as ET

DTYPES = ["float32", "float16", "bfloat16"]
# Ops of ops.def the GPU plugins do not implement (they refuse them by name:
# Unsupported), so no run of them is expected: op -> why.
NOT_ON_GPU = {"linear": "a CPU decode kernel (cpp/cpu/linear_rows.h); GPU frameworks have their own GEMV"}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--junit", required=True)
    ap.add_argument("--oplog", required=True)
    ap.add_argument("--ops-def", required=True)
    ap.add_argument("--backends", default="cuda,hip")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    backends = a.backends.split(",")
    ops = re.findall(r"^TENSOR_OPS_OP\((\w+),", open(a.ops_def).read(), re.M)
    for op, why in NOT_ON_GPU.items():
        print(f"gpu_emulation {a.label}: {op} not expected on {a.backends} (not implemented there: {why})")
    ops = [op for op in ops if op not in NOT_ON_GPU]

    counts = {b: collections.Counter() for b in backends}
    problems = []
    for case in ET.parse(a.junit).getroot().iter("testcase"):
        name = case.get("name", "")
        params = name[name.find("[") + 1:-1].split("-") if "[" in name else []
        hit = [b for b in backends if b in params]
        if not hit:
            problems.append(f"{case.get('classname')}::{name} ran on no emulated backend")
            continue
        c = counts[hit[0]]
        c["run"] += 1
        if case.find("skipped") is not None:
            c["skipped"] += 1
            problems.append(f"skipped on {hit[0]}: {case.get('classname')}::{name}: "
                            f"{case.find('skipped').get('message', '')}")
        elif case.find("failure") is not None or case.find("error") is not None:
            c["failed"] += 1
            problems.append(f"failed on {hit[0]}: {case.get('classname')}::{name}")
        else:
            c["passed"] += 1

    ran = collections.defaultdict(set)
    log = open(a.oplog).read().splitlines() if os.path.exists(a.oplog) else []
    for line in log:
        parts = line.split()
        if len(parts) == 3:
            ran[parts[0]].add((parts[1], parts[2]))
    for b in backends:
        unexpected = sorted({op for op, _ in ran[b] if op in NOT_ON_GPU})
        if unexpected:
            problems.append(f"{b}: ran {', '.join(unexpected)}: remove from NOT_ON_GPU, test it there")
        missing = [f"{op}/{dt}" for op in ops for dt in DTYPES if (op, dt) not in ran[b]]
        if missing:
            problems.append(f"{b}: never ran {', '.join(missing)}")
        c = counts[b]
        print(f"gpu_emulation {a.label}: {b}: {c['run']} tests, {c['passed']} passed, {c['failed']} failed, "
              f"{c['skipped']} skipped; {len(ops) * len(DTYPES) - len(missing)} of {len(ops) * len(DTYPES)} "
              f"op x dtype pairs ran ({len(ops)} ops of ops.def x {len(DTYPES)} dtypes)")
        if c["run"] == 0:
            problems.append(f"{b}: no test ran")
    if problems:
        print("\n".join(problems[:50]), file=sys.stderr)
        sys.exit(f"gpu_emulation {a.label}: {len(problems)} problem(s)")


if __name__ == "__main__":
    main()
