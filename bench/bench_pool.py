"""Builds and runs the C++ pool benchmark (bench_pool.cpp: one allocate +
deallocate pair from the caching pool vs malloc/free, 256 B to 64 MiB), prints
its table and writes the "Memory pool" section of bench/RESULTS.md.

    python bench/bench_pool.py [--build-dir DIR] [--no-results]

The same by hand:

    cmake -S . -B build/bench_pool -DTENSOR_OPS_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release \\
          -DTENSOR_OPS_CUDA=OFF -DTENSOR_OPS_HIP=OFF
    cmake --build build/bench_pool --target bench_pool -j 2
    build/bench_pool/bench/bench_pool bench/out/pool.json
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys

from results_md import machine, write_section

BENCH = pathlib.Path(__file__).resolve().parent
ROOT = BENCH.parent
# The pool needs only the core: accelerator plugins off keeps the configure short.
CONFIGURE = ["-DTENSOR_OPS_BUILD_BENCH=ON", "-DCMAKE_BUILD_TYPE=Release", "-DTENSOR_OPS_BUILD_PYTHON=OFF",
             "-DTENSOR_OPS_CUDA=OFF", "-DTENSOR_OPS_HIP=OFF", "-DTENSOR_OPS_SYCL=OFF", "-DTENSOR_OPS_OPENCL=OFF"]


def run(cmd: list) -> str:
    print("+ " + " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed with exit code {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", type=pathlib.Path, default=ROOT / "build" / "bench_pool")
    p.add_argument("--no-results", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = p.parse_args(argv)
    if shutil.which("cmake") is None:
        p.error("the C++ pool benchmark is built with cmake, which is not on PATH (pip install cmake)")
    run(["cmake", "-S", ROOT, "-B", args.build_dir, *CONFIGURE])
    run(["cmake", "--build", args.build_dir, "--target", "bench_pool", "-j", "2"])
    (BENCH / "out").mkdir(exist_ok=True)
    json_path = BENCH / "out" / "pool.json"
    mach = machine()
    table = run([args.build_dir / "bench" / "bench_pool", json_path]).strip()
    md = (f"## Memory pool\n\n{mach} · `python bench/bench_pool.py` (C++ `bench/bench_pool.cpp`, Release)\n\n"
          "Median ns of one allocate + deallocate pair with the block in the pool's cache (the steady state of "
          "a training or inference loop), 41 samples of 200–2000 pairs; malloc/free for comparison "
          "(speedup = malloc / pool).\n\n" + table + "\n")
    print("\n" + md + f"\nJSON: {json_path}")
    if not args.no_results:
        print(f"Section written to {write_section('pool', '3 pool', md)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
