"""tests/gpu_check.py: its dry run takes every route a CPU can (the decode step and the draw compiled
by inductor, the compiled blocks, the kernel counts) and lands each part's figures, in sane ranges,
in the JSON and the table, so the script works the first time a GPU is lent; a part past its limit
leaves nothing running; a seed cut by the limit says how far it got; a cut pytest run still names
its failures."""

import json
import os
import subprocess
import sys
import time

import gpu_check
import graphs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_dry_run_runs_every_part_through_the_compiled_routes(tmp_path):
    out = tmp_path / "check"
    every = gpu_check.PARTS + gpu_check.MORE_PARTS
    done = subprocess.run([sys.executable, "tests/gpu_check.py", "--dry_run", "--out", str(out),
                           "--parts", ",".join(every)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert list(parts) == list(every)
    for name, part in parts.items():
        assert part["status"] == "ok" and "left_running" not in part, (name, part)
    for route in ("engine, graphs", "engine, compiled + graphs"):
        row = parts["decode"][f"P8 {route}"]
        assert 0 < row["floor_share"] <= 1 and row["decode_tokens_s"] > 0, (route, row)
        assert row["timed_compiles"] == 0, row  # the timed rollout compiled nothing more
    eager, compiled = parts["kernels"]["bf16 kernel"], parts["kernels"]["bf16 kernel, compiled"]
    assert eager["per_layer"] > 0 and eager["rest"] >= 0, parts["kernels"]
    if not graphs.unsupported():  # below graphs.MIN_TORCH the compiled routes run eagerly
        assert parts["decode"]["P8 engine, compiled + graphs"]["compiles"] >= 1  # inductor ran
        assert 0 < compiled["per_layer"] < eager["per_layer"] and compiled["rest"] >= 0
    train = parts["train"]
    for lengths in ("uniform", "mean 1/3"):
        for forward in ("padded", "packed", "naive"):
            row = train[f"{lengths} {forward}"]
            assert 0 < row["mfu"] <= 1 and row["timed_compile_s"] == 0, (lengths, forward, row)
        assert 0 < train[f"{lengths} token share"] <= 1
    assert 0 < parts["compile"]["warm"]["compile_s"] < parts["compile"]["cold"]["compile_s"]
    assert parts["default"]["step"] == 3
    tests = parts["tests"]
    assert tests["passed"] > 0 and tests["failed"] == []
    runs = tests["seeds"]["runs"].values()
    assert [r["step"] for r in runs] == [2] * 5 and all(r["eval_step"] == 2 for r in runs)
    assert {r["verdict"] for r in runs} <= {"learned", "not learned"}
    for key in ("rollout", "train uniform", "train mean 1/3"):
        p = parts["profile"][key]
        assert 0 < p["busy_share"] <= 1 and p["kernels"] > 0 and p["top"], (key, p)
    table = done.stdout[done.stdout.index("| figure | value | goal |"):]
    for row in ("| decode P8, engine, compiled + graphs: tokens/s", "| decode: kernels a layer",
                "| first step's compile (s), cold / warm", "| bf16 default, seeds 0-4"):
        assert row in table, table


def test_a_part_past_its_limit_ends_with_everything_it_started(tmp_path):
    """A part's child that started a grandchild (as pytest starts its workers) and outran its
    limit: the whole process group is ended, the grandchild too."""
    gpu_check.adopt_orphans()
    pidfile = tmp_path / "grandchild"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(600)\n")
    proc = gpu_check.start([sys.executable, "-c", script], str(tmp_path / "log"))
    while not pidfile.exists() or not pidfile.read_text():
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    assert gpu_check.finish(proc, time.perf_counter() + 0.5) == "timeout"
    assert gpu_check.wait_clear([proc.pid], set(), seconds=10) == []
    assert not os.path.exists(f"/proc/{grandchild}") or open(
        f"/proc/{grandchild}/stat").read().split()[2] == "Z"  # gone (or a zombie of init's)


def write_metrics(out, recs):
    os.makedirs(out)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def test_a_seed_cut_by_the_limit_says_how_far_it_got_not_that_it_did_not_learn(tmp_path):
    """Evaluations come every 50 steps: a run cut at step 561 ends on a line without one. It is
    reported as cut, with its last evaluation; a run that reached its last step is judged by the
    evaluation there."""
    cut = str(tmp_path / "cut")
    write_metrics(cut, [dict(step=550, eval_correct=0.97), dict(step=561)])
    assert gpu_check.seed_figures(cut, 800, "timeout") == dict(
        status="timeout", step=561, eval_correct=0.97, eval_step=550, verdict="cut at step 561")
    done = str(tmp_path / "done")
    write_metrics(done, [dict(step=750, eval_correct=0.5), dict(step=800, eval_correct=0.95)])
    assert gpu_check.seed_figures(done, 800, "ok")["verdict"] == "learned"
    low = str(tmp_path / "low")
    write_metrics(low, [dict(step=800, eval_correct=0.5)])
    assert gpu_check.seed_figures(low, 800, "ok")["verdict"] == "not learned"
    crashed = str(tmp_path / "crashed")
    write_metrics(crashed, [dict(step=3)])
    assert gpu_check.seed_figures(crashed, 800, "error 1")["verdict"] == \
        "stopped at step 3 (error 1)"


def test_the_tests_part_names_the_failures_of_a_run_cut_short():
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
    got = gpu_check.tests_figures(log)
    assert got == dict(passed=2, skipped=1, failed=["tests/test_a.py::test_two[0.7-30]",
                                                     "tests/test_b.py::test_five"])


def test_the_card_peak_is_the_datasheets_dense_bf16_rate():
    assert gpu_check.card_peak("NVIDIA H100 80GB HBM3") == 989
    assert gpu_check.card_peak("NVIDIA H100 PCIe") == 756
    assert gpu_check.card_peak("NVIDIA H200") == 989
    assert gpu_check.card_peak("Tesla T4") is None
