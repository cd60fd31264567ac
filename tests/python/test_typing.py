"""The package is typed for its users: py.typed, the generated stubs of
tensor_ops._C, annotated op signatures. mypy --strict passes on a script
calling every public op (tests/typing/user_script.py) and flags each wrong
call in tests/typing/wrong_calls.py."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensor_ops

TYPING = Path(__file__).resolve().parents[1] / "typing"
PACKAGE = Path(tensor_ops.__file__).resolve().parent
COMPILED = Path(tensor_ops._C.__file__).parent  # where pip put _C and its stubs

pytest.importorskip("mypy", reason="mypy is not installed (pip install mypy)")


def mypy(script, tmp_path):
    # torch and jax are followed silently and only as far as tensor_ops uses
    # them: the scripts never touch them (and analysing torch takes minutes).
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n[mypy-torch.*,jax.*,jaxlib.*,torch_xla.*]\nfollow_imports = skip\n")
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", str(config),
                           "--cache-dir", str(tmp_path / "cache"), str(TYPING / script)],
                          capture_output=True, text=True, timeout=900)


def test_package_ships_type_information():
    assert (PACKAGE / "py.typed").is_file()
    if not (COMPILED / "libtensor_ops.so").is_file():
        pytest.skip(f"not a pip install (no libtensor_ops.so beside _C in {COMPILED}): no generated stubs")
    stub = (COMPILED / "_C.pyi").read_text()
    assert re.search(r"^def rms_norm\(", stub, re.M), stub[:2000]


def test_compiled_module_imports_alone(tmp_path):
    """nanobind's stubgen imports the freshly built _C as a top-level module,
    without the package. _C must not import tensor_ops while it initialises:
    that loaded whatever tensor_ops was installed, and an older installed _C
    then failed to link against the new core (the wheel build failed at its
    stub step), or with none installed the import failed."""
    if not (COMPILED / "libtensor_ops.so").is_file():
        pytest.skip(f"not a pip install (no libtensor_ops.so beside _C in {COMPILED})")
    import shutil
    so = Path(tensor_ops._C.__file__)
    shutil.copy(so, tmp_path / so.name)
    shutil.copy(COMPILED / "libtensor_ops.so", tmp_path / "libtensor_ops.so")
    # -S: no site-packages, so no installed tensor_ops to find.
    code = "import sys; sys.path.insert(0, sys.argv[1]); import _C; print(_C.cpu_num_threads() > 0)"
    r = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


def test_user_script_passes_mypy_strict_and_runs(tmp_path):
    r = mypy("user_script.py", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    run = subprocess.run([sys.executable, str(TYPING / "user_script.py")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr


def test_wrong_calls_are_flagged(tmp_path):
    r = mypy("wrong_calls.py", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = (TYPING / "wrong_calls.py").read_text().splitlines()
    expected = {i + 1 for i, line in enumerate(lines) if line.rstrip().endswith("# E") or "  # E:" in line}
    flagged = {int(m) for m in re.findall(r"wrong_calls\.py:(\d+): error", r.stdout)}
    assert flagged == expected, r.stdout
