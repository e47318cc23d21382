"""tests/gpu_check.py's dry run: every part runs on the CPU at tiny shapes and lands in the JSON
and the table, so the script works the first time a GPU is lent; and its parsing of a cut pytest
run names the failures."""

import json
import os
import subprocess
import sys

import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_dry_run_runs_every_part_and_writes_one_json_and_one_table(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "tests/gpu_check.py", "--dry_run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    parts = report["parts"]
    assert list(parts) == ["suite", "seeds", "decode", "train", "compile", "default"]
    for name in ("suite", "decode", "train", "compile", "default"):
        assert parts[name]["status"] == "ok", (name, parts[name])
    assert parts["suite"]["passed"] > 0 and parts["suite"]["failed"] == []
    assert [run["step"] for run in parts["seeds"]["runs"].values()] == [2] * 5
    assert parts["decode"]["P8"]["decode_tokens_s"] > 0 < parts["decode"]["P8"]["floor_share"]
    assert parts["train"]["uniform packed"]["mfu"] > 0
    assert parts["compile"]["cold"]["compile_s"] > 0 and parts["default"]["step"] == 3
    table = done.stdout[done.stdout.index("| figure | value | goal |"):]
    assert "| decode P8: tokens/s" in table and "| first step's compile (s), cold / warm" in table


def test_the_suite_part_names_the_failures_of_a_run_cut_short():
    """pytest -v lines, with and without xdist, and the -rfE summary; a test that passed before
    failing in teardown counts as failed; nothing after the cut is invented."""
    log = "\n".join([
        "[gw0] [ 10%] PASSED tests/test_a.py::test_one ",
        "[gw1] [ 20%] FAILED tests/test_a.py::test_two[0.7-30] ",
        "tests/test_b.py::test_three PASSED                  [ 30%]",
        "tests/test_b.py::test_four SKIPPED (needs a CUDA GPU) [ 40%]",
        "tests/test_b.py::test_five PASSED                   [ 50%]",
        "tests/test_b.py::test_five ERROR                    [ 50%]",
        "FAILED tests/test_a.py::test_two[0.7-30] - AssertionError: Tensor-likes are not close!",
    ])
    got = gpu_check.suite_figures(log)
    assert got == dict(passed=2, skipped=1, failed=["tests/test_a.py::test_two[0.7-30]",
                                                     "tests/test_b.py::test_five"])
