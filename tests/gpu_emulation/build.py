#!/usr/bin/env python3
"""Builds the emulated CUDA (warp 32) or HIP (wave 64) plugin from the real
cuda/ sources with the host g++ (see README.md).

cuda/backend.cpp compiles as it is (copied beside the rewritten files). The
kernel files cuda/*.cu and cuda/common.cuh are copied into the build
directory with three mechanical rewrites (the sources in cuda/ are never
touched; #line keeps diagnostics and ASan reports pointing at cuda/):
  kernel<<<grid, block, smem, stream>>>(args)
      -> ::emu::launcher("kernel", grid, block, smem, stream)(
             [](auto... emu_a) { kernel(emu_a...); }, args)
  extern __shared__ T name[];  ->  T* name = ::emu::dynamic_shared<T>();
  __shared__ T name[N];  ->  __shared__ T name[N]; EMU_SHARED_OBJECT(name)
      (registers the object, refilled with 0xff bytes for every block)
With --traffic (AddressSanitizer off) the kernel files are compiled with
GCC's kernel-address instrumentation made into calls, which the emulator
defines to count the bytes each launch loads from and stores to device
allocations (TENSOR_OPS_EMU_TRAFFIC=path: one line per launch; traffic.py).
The kernels include include/cuda_runtime.h (or, for HIP, hip/vendor.h
includes include/hip/hip_runtime.h): the emulated device and runtime.
"""
import argparse
import concurrent.futures
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
KERNELS = ["norm.cu", "activation.cu", "softmax.cu", "rope.cu", "attention.cu"]


def rewrite_launches(text, where):
    out, pos, count = [], 0, 0
    while True:
        i = text.find("<<<", pos)
        if i < 0:
            break
        # The callee: an identifier with optional template arguments, right before <<<.
        j = i
        while j > 0 and text[j - 1].isspace():
            j -= 1
        if text[j - 1] == ">":
            depth = 0
            while True:
                j -= 1
                if text[j] == ">":
                    depth += 1
                elif text[j] == "<":
                    depth -= 1
                    if depth == 0:
                        break
        while j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_:"):
            j -= 1
        callee = text[j:i].strip()
        k = text.find(">>>", i)
        if not callee or k < 0:
            sys.exit(f"build.py: cannot parse the launch at {where} offset {i}")
        config = text[i + 3:k]
        name = " ".join(callee.split())
        m = re.compile(r"\s*\(\s*(\)?)").match(text, k + 3)
        if not m:
            sys.exit(f"build.py: no argument list after the launch at {where} offset {i}")
        out.append(text[pos:j])
        out.append(f'::emu::launcher("{name}", {config})([](auto... emu_a) {{ {callee}(emu_a...); }}'
                   + (")" if m.group(1) else ", "))
        pos = m.end()
        count += 1
    out.append(text[pos:])
    return "".join(out), count


STATIC_SHARED = re.compile(r"(?<!extern )__shared__\s+([\w:]+)\s+(\w+)((?:\s*\[[^\]]*\])*)\s*;")
EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")


def rewrite(src, dst):
    with open(src) as f:
        text = f.read()
    text, launches = rewrite_launches(text, src)
    text, shared = EXTERN_SHARED.subn(r"\1* \2 = ::emu::dynamic_shared<\1>();", text)
    text, static = STATIC_SHARED.subn(r"__shared__ \1 \2\3; EMU_SHARED_OBJECT(\2)", text)
    if "<<<" in text or re.search(r"extern\s+__shared__", text):
        sys.exit(f"build.py: {src}: a launch or extern __shared__ was left unrewritten")
    body = f'#line 1 "{src}"\n' + text
    if not os.path.exists(dst) or open(dst).read() != body:
        with open(dst, "w") as f:
            f.write(body)
    return launches, shared + static


def newest(paths):
    return max(os.path.getmtime(p) for p in paths)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warp", type=int, choices=[32, 64], required=True,
                    help="32: the cuda plugin (CUDA names); 64: the hip plugin (hip/vendor.h, wave64)")
    ap.add_argument("--out", required=True, help="build directory; the plugin lands in it")
    ap.add_argument("--asan", action=argparse.BooleanOptionalAction, default=True,
                    help="AddressSanitizer: out-of-bounds global and shared memory accesses abort (default on)")
    ap.add_argument("--traffic", action="store_true",
                    help="count global-memory bytes per launch (needs --no-asan; see src/emu.cpp count_access)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    args = ap.parse_args()

    if args.traffic and args.asan:
        ap.error("--traffic needs --no-asan (both use GCC's address instrumentation)")
    hip = args.warp == 64
    name = "hip" if hip else "cuda"
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "src"), exist_ok=True)

    units = []  # (source, object, is_kernel_file)
    total_launches = 0
    for k in KERNELS:
        dst = os.path.join(out, "src", k + ".cpp")
        launches, _ = rewrite(os.path.join(REPO, "cuda", k), dst)
        total_launches += launches
        units.append((dst, os.path.join(out, k + ".o"), True))
    # common.cuh gets the __shared__ rewrite too; backend.cpp is copied as it
    # is, so that it includes that common.cuh like the kernel files do.
    rewrite(os.path.join(REPO, "cuda", "common.cuh"), os.path.join(out, "src", "common.cuh"))
    backend = os.path.join(out, "src", "backend.cpp")
    rewrite(os.path.join(REPO, "cuda", "backend.cpp"), backend)
    units.append((backend, os.path.join(out, "backend.o"), False))
    units.append((os.path.join(HERE, "src", "emu.cpp"), os.path.join(out, "emu.o"), False))
    units.append((os.path.join(HERE, "src", "loader.cpp"), os.path.join(out, "loader.o"), False))

    flags = ["-std=c++17", "-O1", "-g1", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off",
             "-Wall", "-Wextra", "-Wno-unknown-pragmas",
             "-I", os.path.join(HERE, "include"), "-I", os.path.join(REPO, "cuda"),
             "-I", os.path.join(REPO, "cpp", "include"),
             f"-DTENSOR_OPS_EMU_WARP={args.warp}",
             f'-DTENSOR_OPS_GPU_ARCHS="emulator, warp {args.warp}"',
             "-Dtensor_ops_backend_v1=tensor_ops_emu_inner_backend_v1"]
    if hip:
        flags += ["-DTENSOR_OPS_HIP", "-D__HIPCC__"]
    if args.asan:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    # The row kernels read their registers (RowRegs, cuda/common.cuh) in a
    # later pass than the one that set them, under the same conditions; g++
    # cannot follow that and warns (nvcc does not).
    kernel_flags = ["-Wno-maybe-uninitialized"] + (["-D__CUDACC__"] if not hip else [])
    if args.traffic:
        flags += ["-DTENSOR_OPS_EMU_TRAFFIC"]
        kernel_flags += ["-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
                         "--param", "asan-stack=0", "--param", "asan-globals=0"]

    deps = []
    for d in (os.path.join(HERE, "include"), os.path.join(REPO, "cuda"), os.path.join(REPO, "hip"),
              os.path.join(REPO, "cpp", "include", "tensor_ops")):
        for root, _, files in os.walk(d):
            deps += [os.path.join(root, f) for f in files]
    deps.append(__file__)
    dep_time = newest(deps)
    stamp = os.path.join(out, "flags.txt")
    flag_text = " ".join(flags + kernel_flags)
    if not os.path.exists(stamp) or open(stamp).read() != flag_text:
        with open(stamp, "w") as f:
            f.write(flag_text)

    def compile_unit(unit):
        src, obj, kernel_file = unit
        if os.path.exists(obj) and os.path.getmtime(obj) > max(dep_time, newest([src, stamp])):
            return None
        cmd = [args.cxx] + flags + (kernel_flags if kernel_file else []) + \
            ["-x", "c++", "-c", src, "-o", obj]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}"
        if r.stderr.strip():
            print(r.stderr, file=sys.stderr)
        return None

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        errors = [e for e in pool.map(compile_unit, units) if e]
    if errors:
        sys.exit("build.py: compile failed:\n" + "\n".join(errors))
    lib = os.path.join(out, f"libtensor_ops_{name}.so")
    cmd = [args.cxx, "-shared", "-o", lib] + [u[1] for u in units] + \
        (["-fsanitize=address"] if args.asan else []) + ["-Wl,--no-undefined", "-lpthread"]
    subprocess.run(cmd, check=True)
    print(f"build.py: {lib} ({total_launches} kernel launches rewritten, warp {args.warp}, "
          f"asan {'on' if args.asan else 'off'}{', traffic counted' if args.traffic else ''})")


if __name__ == "__main__":
    main()
