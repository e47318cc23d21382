"""tests/gpu_check.py: its dry run takes every route a CPU can (the decode step and the draw compiled
by inductor, the compiled blocks, the kernel counts) and lands each part's figures, in sane ranges,
in the JSON and the table, so the script works the first time a GPU is lent; a part past its limit
leaves nothing running; a seed cut by the limit says how far it got; a cut pytest run still names
its failures."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import bench_limits
import gpu_check
from engine import compiling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_dry_run_runs_every_part_through_the_compiled_routes(tmp_path):
    out = tmp_path / "check"
    every = gpu_check.PARTS + gpu_check.MORE_PARTS
    done = subprocess.run([sys.executable, "tests/gpu_check.py", "--dry_run", "--out", str(out),
                           "--parts", ",".join(every)], cwd=ROOT, capture_output=True, text=True,
                          timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log"]  # runs went to /tmp
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert list(parts) == ["gpu_branches", *every]
    for name, part in parts.items():
        assert part["status"] == "ok" and "left_running" not in part, (name, part)
    branches = parts["gpu_branches"]  # what only the GPU runs: built, imported, collected
    assert branches["cuda_tests_collected"] > 0 and branches["shape_params"] > 4e8
    assert "--steps 800" in branches["seeds"] and "test_train.py" in branches["tests"]
    for route in ("engine, graphs", "engine, compiled + graphs"):
        row = parts["decode"][f"P8 {route}"]
        assert 0 < row["floor_share"] <= 1 and row["decode_tokens_s"] > 0, (route, row)
        assert row["timed_compiles"] == 0, row  # the timed rollout compiled nothing more
    if importlib.util.find_spec("transformers"):  # transformers' rows, each in its own part
        assert parts["decode"]["P8 transformers dynamic"]["seconds"] > 0
        assert parts["generate_static"]["P8 transformers static"]["seconds"] > 0
    eager, compiled = parts["kernels"]["bf16 kernel"], parts["kernels"]["bf16 kernel, compiled"]
    assert eager["per_layer"] > 0 and eager["rest"] >= 0, parts["kernels"]
    if not compiling.unsupported():  # below compiling.MIN_TORCH the compiled routes run eagerly
        assert parts["decode"]["P8 engine, compiled + graphs"]["compiles"] >= 1  # inductor ran
        assert 0 < compiled["per_layer"] < eager["per_layer"] and compiled["rest"] >= 0
    train = parts["train"]
    for lengths, forward in bench_limits.TRAIN_ROWS:
        row = train[f"{lengths} {forward}"]
        assert 0 < row["mfu"] <= 1 and row["timed_compile_s"] == 0, (lengths, forward, row)
        assert 0 < train[f"{lengths} token share"] <= 1
    assert 0 < parts["compile"]["warm"]["compile_s"] < parts["compile"]["cold"]["compile_s"]
    assert "compiled_step_s" not in parts["compile"]["cold"]  # one step a process, no more
    assert parts["default"]["step"] == 3 and parts["default"]["step_s"] > 0
    runs = parts["seeds"]["runs"].values()
    assert [r["step"] for r in runs] == [2] * 5 and all(r["eval_step"] == 2 for r in runs)
    assert {r["verdict"] for r in runs} <= {"learned", "not learned"}
    tests = parts["tests"]
    assert tests["passed"] > 0 and tests["failed"] == [] and tests["not_reached"] == 0
    for key in ("rollout", "train uniform", "train mean 1/3"):
        p = parts["profile"][key]
        assert 0 < p["busy_share"] <= 1 and p["kernels"] > 0 and p["top"], (key, p)
    table = done.stdout[done.stdout.index("| figure | value | goal |"):]
    for row in ("| decode P8, engine, compiled + graphs: tokens/s", "| decode: kernels a layer",
                "| first step's compile (s), cold / warm", "| bf16 default, seeds 0-4",
                "| default run: s whole"):
        assert row in table, table
    if importlib.util.find_spec("transformers"):  # without it, x generate has no figure
        assert "missing" not in table, table
    log = (out / "gpu_check.log").read_text()
    for name in every:  # one combined log: every part's own output in it
        assert f"===== {name}: {name}.log" in log or name == "seeds", name
    assert "===== seeds: seed4.log" in log


def test_each_call_fits_its_budget_and_the_calls_fit_fifteen_minutes():
    """The parts' limits plus the waits for the GPU to clear fit each call's default budget; each
    budget is under 600 s a command, and the two with a machine's start fit DEVICE_SECONDS (15
    minutes); every part is in one call."""
    for call, parts in gpu_check.CALLS.items():
        assert gpu_check.fits(call) <= gpu_check.BUDGETS[call] <= 600 - 30, call
    assert sum(gpu_check.BUDGETS[c] for c in gpu_check.CALLS) + gpu_check.MACHINE_START <= \
        gpu_check.DEVICE_SECONDS
    assert sorted(sum(gpu_check.CALLS.values(), ())) == sorted(gpu_check.PARTS)
    assert gpu_check.ALONE < gpu_check.LIMITS["tests"]


def test_a_part_cut_by_the_budget_keeps_its_figures_and_the_rest_say_why_not(tmp_path):
    """A budget that ends inside a part: the part's figures so far are in the JSON (written as
    they came), it reads "timeout", the parts after it "not run", and the table says "missing"
    with why for each figure it never measured. decode's dry run compiles the decode step (11 s
    of compile on an idle 2-core CPU): the 6 s left to it (14 less the 8 s wait) cannot hold it."""
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "tests/gpu_check.py", "--dry_run", "--out", str(out),
                           "--parts", "decode,default", "--budget", "14"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    decode = parts["decode"]
    assert decode["status"] == "timeout" and decode["limit_s"] <= 6, decode
    assert "P8 engine, compiled + graphs" not in decode, decode
    assert parts["default"]["status"].startswith("not run"), parts["default"]
    assert "missing (decode: timeout at" in done.stdout, done.stdout


def test_sigterm_ends_every_part_and_flushes_the_figures(tmp_path):
    """The command's limit (SIGTERM) inside a part: the part's process group is gone, the JSON
    holds the part as cut, the table is printed."""
    out = tmp_path / "check"
    proc = subprocess.Popen([sys.executable, "tests/gpu_check.py", "--dry_run", "--out", str(out),
                             "--parts", "seeds"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    path = out / "gpu_check.json"
    deadline = time.perf_counter() + 120
    while time.perf_counter() < deadline and not (
            path.exists() and "seeds" in json.loads(path.read_text())["parts"]):
        time.sleep(0.2)
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(p) == proc.pid]
    assert children, "the seeds' runs had not started"
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stdout
    seeds = json.loads(path.read_text())["parts"]["seeds"]
    assert seeds["status"].startswith(f"cut by signal {signal.SIGTERM}"), seeds
    assert "| bf16 default, seeds 0-4" in stdout
    time.sleep(0.5)
    assert not [c for c in children if os.path.exists(f"/proc/{c}") and
                open(f"/proc/{c}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


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
    assert gpu_check.watch([proc], time.perf_counter() + 0.5, dict, lambda figures: None) == \
        "timeout"
    assert gpu_check.wait_clear([proc.pid], set(), seconds=10) == []
    assert not os.path.exists(f"/proc/{grandchild}") or open(
        f"/proc/{grandchild}/stat").read().split()[2] == "Z"  # gone (or a zombie of init's)


def write_metrics(out, recs):
    os.makedirs(out)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def test_a_seed_cut_by_the_limit_is_judged_by_its_last_evaluation_from_step_300(tmp_path):
    """Evaluations come every 50 steps: a run cut at step 561 ends on a line without one. It is
    judged by its last evaluation (550 >= 300) and says it was cut; one cut before any
    evaluation at step >= 300 is not judged; a run that reached its last step is judged there."""
    cut = str(tmp_path / "cut")
    write_metrics(cut, [dict(step=550, eval_correct=0.97, **T), dict(step=561, **T)])
    assert gpu_check.seed_figures(cut, 800, "timeout") == dict(
        status="timeout", step=561, eval_correct=0.97, eval_step=550,
        verdict="learned (cut at step 561, judged at 550)")
    early = str(tmp_path / "early")
    write_metrics(early, [dict(step=250, eval_correct=0.97, **T), dict(step=280, **T)])
    assert gpu_check.seed_figures(early, 800, "timeout")["verdict"] == "cut at step 280"
    done = str(tmp_path / "done")
    write_metrics(done, [dict(step=750, eval_correct=0.5, **T), dict(step=800, eval_correct=0.95,
                                                                       **T)])
    assert gpu_check.seed_figures(done, 800, "ok")["verdict"] == "learned"
    low = str(tmp_path / "low")
    write_metrics(low, [dict(step=800, eval_correct=0.5, **T)])
    assert gpu_check.seed_figures(low, 800, "ok")["verdict"] == "not learned"
    crashed = str(tmp_path / "crashed")
    write_metrics(crashed, [dict(step=3, **T)])
    assert gpu_check.seed_figures(crashed, 800, "error 1")["verdict"] == \
        "stopped at step 3 (error 1)"


T = dict(t_rollout=0.02, t_logprobs=0.0, t_train=0.02)  # a record's seconds


def test_the_tests_part_names_the_failures_of_a_run_cut_short():
    """pytest -v lines, with and without xdist, and the -rfE summary; a test that passed before
    failing in teardown counts as failed; nothing after the cut is invented, and the tests
    collected but never reached are counted."""
    log = "\n".join([
        "6 workers [7 items]",
        "[gw0] [ 10%] PASSED tests/test_a.py::test_one ",
        "[gw1] [ 20%] FAILED tests/test_a.py::test_two[0.7-30] ",
        "tests/test_b.py::test_three PASSED                  [ 30%]",
        "tests/test_b.py::test_four SKIPPED (needs a CUDA GPU) [ 40%]",
        "tests/test_b.py::test_five PASSED                   [ 50%]",
        "tests/test_b.py::test_five ERROR                    [ 50%]",
        "FAILED tests/test_a.py::test_two[0.7-30] - AssertionError: Tensor-likes are not close!",
    ])
    got = gpu_check.tests_figures(log)
    assert got == dict(passed=2, passed_ids=["tests/test_a.py::test_one",
                                             "tests/test_b.py::test_three"],
                       skipped=1, not_reached=2,
                       failed=["tests/test_a.py::test_two[0.7-30]", "tests/test_b.py::test_five"])
    assert gpu_check.tests_figures("collected 3 items\n")["not_reached"] == 3
    assert gpu_check.tests_figures("collecting ... collected 1 item\n")["not_reached"] == 1


def test_the_card_peak_is_the_datasheets_dense_bf16_rate():
    assert gpu_check.card_peak("NVIDIA H100 80GB HBM3") == 989
    assert gpu_check.card_peak("NVIDIA H100 PCIe") == 756
    assert gpu_check.card_peak("NVIDIA H200") == 989
    assert gpu_check.card_peak("NVIDIA H200 NVL") == 835
    assert gpu_check.card_peak("Tesla T4") is None


def test_train_flops_count_the_completion_tokens_fed():
    """A row of n completion tokens feeds n - 1 (the last is only scored) and scores n: one
    prompt of 1 token and one row of 1 token is one token through the body and one scored."""
    model = bench_limits.tiny_model()
    c = model.config
    body = sum(p.numel() for n, p in model.named_parameters()
               if "layers." in n and n.endswith("proj.weight"))
    width = c.num_attention_heads * c.head_dim
    got = bench_limits.train_flops(model, [1], [1])
    assert got == 3 * (2 * body * 1 + 2 * c.vocab_size * c.hidden_size + 4 * width *
                       c.num_hidden_layers)
