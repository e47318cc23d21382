"""run/checkpoint.py's rules for the output directory and for resuming: one run per --out (the lock),
flags a checkpoint fixes, nothing written on a refused start."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

from run import checkpoint
import train
from test_train import FAST, ROOT, records, run


def start(out: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *FAST, "--out", out, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_runs_started_at_once_into_one_out_one_is_refused_naming_the_holder(tmp_path):
    """Regression: both ran, metrics.jsonl interleaved, checkpoints overwrote each other."""
    out = str(tmp_path / "run")
    procs = [start(out, "--steps", "10000", "--eval_every", "0") for _ in range(2)]
    try:
        deadline = time.time() + 120
        while time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        _, err = loser.communicate()
        metrics = os.path.join(out, "metrics.jsonl")
        while time.time() < deadline and not (os.path.exists(metrics) and os.path.getsize(metrics)):
            time.sleep(0.2)
        winner.send_signal(2)  # Ctrl-C: the winner checkpoints and exits 0
        winner.communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()  # this test's own processes, if they are still there
    assert loser.returncode == 2 and winner.returncode == 0, err
    assert err.strip() == err.strip().splitlines()[0]  # one line
    assert f"--out {out} is in use by the run of pid {winner.pid} on {socket.gethostname()}" in err
    assert not os.path.exists(os.path.join(out, ".lock"))  # released on exit
    assert [r["step"] for r in records(out)] == list(range(1, len(records(out)) + 1))


def test_a_lock_caught_between_its_creation_and_its_line_names_its_holder(tmp_path):
    """Regression: a run starting at the same instant made the lock (O_EXCL) but had not yet
    written its line, and the refusal named "pid 0 on an unknown host"."""
    out = tmp_path / "run"
    out.mkdir()
    lock = out / ".lock"
    lock.write_text("")  # made, not yet written
    writer = threading.Timer(0.2, lock.write_text, [f"{os.getpid()} {socket.gethostname()}\n"])
    writer.start()
    try:
        checkpoint._take_lock(str(out))
        raise AssertionError("the lock was taken from a live run")
    except ValueError as e:
        assert f"in use by the run of pid {os.getpid()} on {socket.gethostname()}" in str(e)
    finally:
        writer.join()


def test_a_crashed_runs_lock_is_taken_over_a_live_ones_refuses(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs: the lock of a run that crashed (kill -9)
    (out / ".lock").write_text(f"{gone.pid} {socket.gethostname()}\n")
    code, _ = run(tmp_path, "--steps", "1")
    assert code == 0 and not (out / ".lock").exists() and len(records(out)) == 1
    (out / ".lock").write_text(f"{os.getpid()} {socket.gethostname()}\n")  # alive: this test
    code, _ = run(tmp_path, "--steps", "2", "--resume", "latest")
    err = capsys.readouterr().err
    assert code == 2 and f"is in use by the run of pid {os.getpid()}" in err
    assert (out / ".lock").read_text().split()[0] == str(os.getpid())  # not another's to drop


def test_a_read_only_out_is_refused_before_the_first_step(tmp_path, capsys, monkeypatch):
    """Regression: found when the first metrics record was written, after the first step."""
    steps = []
    monkeypatch.setattr(train, "step", lambda *a: steps.append(a))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    out = str(ro)
    if os.access(out, os.W_OK):  # root ignores the mode: a pseudo-filesystem no one writes to
        out = "/proc/self"
    assert train.main(FAST + ["--out", out, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write there" in err and len(err.strip().splitlines()) == 1
    assert steps == []


def test_resume_refuses_what_the_checkpoint_fixes_and_prints_what_changes(tmp_path, capsys):
    """Regression: --dim 128 on resume trained width 32 and recorded 128; a refused --task
    rewrote the checkpoint's trainer_state.json, so a plain --resume latest failed after it."""
    code, out = run(tmp_path, "--steps", "1")
    state = os.path.join(out, "step-000001", "trainer_state.json")
    before = open(state).read()
    capsys.readouterr()
    for flag, value, saved in (("dim", "128", "32"), ("task", "tasks:double", "'tasks:reverse'"),
                               ("num_samples", "8", "4")):
        code, _ = run(tmp_path, "--resume", "latest", "--steps", "2", f"--{flag}", value)
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--{flag} {value!r}: the checkpoint being resumed fixes it to {saved}" in err \
            or f"--{flag} {value}: the checkpoint being resumed fixes it to {saved}" in err, err
    code, _ = run(tmp_path, "--resume", "latest", "--steps", "2", "--lr", "1e-4")
    assert code == 0 and "with: steps 2, was 1; lr 0.0001, was 0.001" in capsys.readouterr().out
    assert open(state).read() == before



def test_a_checkpoint_written_before_a_flag_was_renamed_resumes_with_its_value(tmp_path):
    """Regression: a checkpoint's field saved under its former name (--tools, now --use_tools)
    was dropped on resume, the default taken in silence: a run trained without its tool resumed
    with it."""
    code, out = run(tmp_path, "--task", "tasks:lookup", "--steps", "1", "--use_tools", "false",
                    "--eval_every", "0")
    state = os.path.join(out, "step-000001", "trainer_state.json")
    with open(state) as f:
        saved = json.load(f)
    saved["config"]["tools"]["tools"] = saved["config"]["tools"].pop("use_tools")  # as then
    with open(state, "w") as f:
        json.dump(saved, f)
    code, _ = run(tmp_path, "--resume", "latest", "--steps", "2")
    assert code == 0 and "tool_calls" not in records(out)[-1]  # still without the tool

def test_a_resume_that_fails_at_its_first_step_never_rewrites_the_checkpoint(tmp_path, capsys):
    """Regression: the fault's checkpoint rewrote step-000001 with the failing run's flags."""
    code, out = run(tmp_path, "--steps", "1")
    state = os.path.join(out, "step-000001", "trainer_state.json")
    before = open(state).read()
    capsys.readouterr()
    code, _ = run(tmp_path, "--resume", "latest", "--steps", "3", "--max_new_tokens", "1022")
    err = capsys.readouterr().err
    assert code == 2 and "max_position_embeddings" in err
    assert open(state).read() == before and json.loads(before)["step"] == 1
    assert len(records(out)) == 1
