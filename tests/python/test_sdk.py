"""The C/C++ SDK inside the installed package (tensor_ops._sdk): headers and
a relocatable CMake package, found through `python -m tensor_ops --cmake-dir`;
an outside project (tests/embed, in C and C++) builds and runs against the
pip-installed package, not the source tree."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tensor_ops

# Where pip installed the compiled files (beside _C).
PACKAGE = Path(tensor_ops._C.__file__).parent
EMBED = Path(__file__).resolve().parents[1] / "embed"

if not (PACKAGE / "libtensor_ops.so").is_file():
    # .ci/asan lays the package out by hand (sources + _C, the core in its build tree).
    pytest.skip(f"tensor_ops is not a pip install here (no libtensor_ops.so beside _C in {PACKAGE})",
                allow_module_level=True)


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "tensor_ops", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


def test_cli_prints_the_package_sdk_paths():
    assert cli("--cmake-dir") == [tensor_ops.cmake_dir()]
    assert cli("--include") == [tensor_ops.get_include()]
    cmake_dir, include = Path(tensor_ops.cmake_dir()), Path(tensor_ops.get_include())
    assert PACKAGE in cmake_dir.parents and PACKAGE in include.parents
    for f in ["tensor_opsConfig.cmake", "tensor_opsConfigVersion.cmake", "tensor_opsTargets.cmake"]:
        assert (cmake_dir / f).is_file(), f
    for f in ["tensor_ops.h", "ops.h", "ops.def", "tensor.h", "plugin.h", "errors.h"]:
        assert (include / "tensor_ops" / f).is_file(), f
    assert (PACKAGE / "libtensor_ops.so").is_file()


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_outside_project_builds_and_runs_against_the_installed_package(tmp_path):
    cmake_dir = cli("--cmake-dir")[0]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    env = {k: v for k, v in os.environ.items() if k not in ("TENSOR_OPS_PLUGIN_PATH", "CMAKE_PREFIX_PATH")}
    build = tmp_path / "build"
    for cmd in (["cmake", "-S", str(EMBED), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                 f"-Dtensor_ops_DIR={cmake_dir}", "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"],
                ["cmake", "--build", str(build)]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    found = re.search(r"^tensor_ops_DIR:\w+=(.*)$", (build / "CMakeCache.txt").read_text(), re.M)
    assert found and Path(found.group(1)) == Path(cmake_dir), found
    for app in ["embed_cpp", "embed_c"]:
        r = subprocess.run([str(build / app)], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, f"{app}\n{r.stdout}\n{r.stderr}"
        if app == "embed_cpp":
            # The core and the plugins load from the installed package.
            assert f"libtensor_ops.so loaded from {PACKAGE.resolve()}" in r.stdout, r.stdout
