"""python -m tensor_ops (the main job, __main__.py): progress on stderr,
--json with every check and timing, --plot, --backend, and a speed table
where every op has torch eager and torch.compile peers and a share of the
STREAM triad measured in the same run."""
import json
import subprocess
import sys

import pytest

import tensor_ops

try:
    import torch
except ImportError:
    torch = None

OPS = ["rms_norm", "silu", "gelu", "gelu_tanh", "layer_norm", "softmax", "swiglu", "add_rms_norm"]


def run_main(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "tensor_ops", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_quick_json_plot_backend(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    args = ["--quick", "--no-compile", "--backend", "cpu", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(png)]
    except ImportError:
        png = None
    r = run_main(*args)
    assert r.returncode == 0, r.stderr
    # Progress, as plain lines when stderr is not a terminal.
    assert "[checking on cpu 1/8] rms_norm" in r.stderr and "[timing] done in" in r.stderr, r.stderr
    report = json.loads(out.read_text())
    assert report["backends_run"] == ["cpu"] and report["shape"] == [64, 1024]
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    sp = report["speed"]
    assert sp["triad"]["gbps"] > 0 and sp["triad"]["samples"] >= len(sp["results"]) // 2
    impls = {(r["op"], r["impl"]) for r in sp["results"]}
    for op in OPS:
        assert (op, "tensor_ops[cpu]") in impls, op
        if torch is not None:
            assert (op, "torch eager") in impls, op
    for row in sp["results"]:
        assert row["pct_triad"] > 0 and row["median_s"] > 0
        if torch is not None:
            assert row["vs_torch_eager"] is not None, row  # no "-" (swiglu, add_rms_norm included)
    assert " - " not in r.stdout.split("== Speed")[1].replace("p25-p75", "")
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_speed_table_has_torch_compile_for_every_op(tmp_path):
    out = tmp_path / "out.json"
    r = run_main("--quick", "--backend", "cpu", "--json", str(out))
    assert r.returncode == 0, r.stderr
    sp = json.loads(out.read_text())["speed"]
    compiled = {r["op"] for r in sp["results"] if r["impl"] == "torch.compile"}
    assert compiled | {n.split()[1].rstrip(":") for n in sp["notes"]} >= set(OPS), sp["notes"]
    for row in sp["results"]:
        if row["op"] in compiled:
            assert row["vs_torch_compile"] is not None, row
    assert "vs torch.compile" in r.stdout and "% triad" in r.stdout


def test_backend_that_is_not_there_is_a_clear_error():
    r = run_main("--backend", "nosuch")
    assert r.returncode != 0 and "--backend nosuch: no such backend (have: cpu" in r.stderr, r.stderr


def test_flags_are_checked_before_the_run():
    """Bad numbers and an output path that cannot be written are usage
    errors before anything runs (numpy tracebacks, an IndexError, or a
    FileNotFoundError after the whole run); --quick fills in only what
    --shape / --reps leave unset (it overrode them)."""
    from tensor_ops.__main__ import parse_args

    for args, words in ((["--shape", "0", "0"], "--shape needs two dimensions >= 1"),
                        (["--shape", "-1", "5"], "--shape needs two dimensions >= 1"),
                        (["--reps", "0"], "--reps must be >= 1"),
                        (["--json", "/nonexistent/dir/x.json"], "does not exist or is not writable"),
                        (["--json", "/tmp/"], "a file name is needed")):
        r = run_main(*args, "--backend", "cpu", "--no-compile", timeout=120)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-500:])
    a = parse_args(["--quick", "--shape", "8", "8"])
    assert (a.shape, a.reps) == ([8, 8], 3)
    a = parse_args(["--quick", "--reps", "50"])
    assert (a.shape, a.reps) == ([64, 1024], 50)
    a = parse_args([])
    assert (a.shape, a.reps) == ([2048, 4096], 10)


def test_cmake_dir_and_include():
    r = run_main("--cmake-dir", "--include")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [tensor_ops.cmake_dir(), tensor_ops.get_include()]
