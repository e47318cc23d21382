"""Where the engine stands on one CUDA GPU, in one call: every figure the GPU path is judged by,
each part in its own process group under its own time limit, one table and one JSON.

    python tests/gpu_check.py --out $OUT --commit HASH    # one CUDA GPU, 8 minutes at most
    python tests/gpu_check.py --out $OUT --parts train,compile   # some parts, in this order
    python tests/gpu_check.py --dry_run --out DIR         # every part on the CPU, tiny shapes

Parts, in the order of their value (their seconds in LIMITS):
- decode: the bf16 rollout at Qwen2.5-0.5B's shape, 16 prompts x 8 samples, 256 new tokens
  (tests/bench_limits.py's rollout part): decode tokens/s captured alone (a figure even when the
  compile outruns the part), then compiled and captured (the default on a GPU for this shape), the
  share of the copy-bandwidth floor (the bytes a step must read over the copy rate measured in the
  same process), beside transformers' generate with its dynamic cache and with its static cache
  compiled (its best); at P = 64, then P = 512.
- kernels: the kernels one replay of the decode step's graph launches a layer, eager and compiled
  (tests/bench_rollout.py: a 2-block model's total less a 1-block model's).
- train: one GRPO forward + backward at the same shape, fp32 master under bf16 autocast, the blocks
  compiled (bench_limits' train part): MFU of the packed, padded and repeated-prompt forwards at
  uniform lengths (64 + 256) against the bf16 matmul rate measured in the same process and
  against the card's dense bf16 peak (CARD_PEAKS), and packed against padded at a mean of 1/3 of
  those lengths, as a multiple of their token share.
- compile: the first step's compile seconds with an empty compile cache, then with the cache the
  first left, each in a fresh process (tests/bench_compiling.py).
- default: `python train.py`, the default run, timed whole.
- profile (only when named in --parts): torch.profiler over a compiled + captured rollout and a
  packed training step at uniform lengths and at a mean of 1/3: the top kernels and the share of
  the wall clock the GPU was busy (the rest: launch gaps), for the goals the figures miss.
- tests: what only a GPU can test (CUDA_TESTS: the tests/test_*_cuda.py files, then
  tests/test_train.py, whose runs go to the GPU when there is one), each test under
  tests/deadline.py's --deadline, failures by name even from a run that was cut; then the failed
  ones again, alone. Beside them, `train.py --dtype bfloat16` on seeds 0-4 to step 800 (their
  held-out accuracy is the figure, not their time; a seed cut by the limit says how far it got).
A part past its limit keeps the figures it had reported, says so ("timeout"), and the rest still
run. Each part runs in a process group of its own, ended whole when the part ends (the pytest
workers, the compile part's measuring processes, what tests started), and the next part starts
only when none of its processes is left, nor any process the check started on the GPU.
--dry_run runs each part on the CPU at tiny shapes through every route a CPU can (the decode step
and the draw compiled by inductor, the compiled blocks, the kernel counts; CUDA hidden from every
child; tests/test_gpu_check.py runs it), so the script works the first time a GPU is lent.
OUT/gpu_check.json holds every figure, rewritten after each part; OUT/<part>.log each part's
output; the table at the end has the headline figures.
"""

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]

# Seconds per part on a GPU: 470 in all (the failed tests' rerun inside the tests' 140), inside
# one 9-minute call with the machine's start. An H200 ran 0.5B-shaped train steps in 70 s with a
# warm-up each; the default run takes ~0.04 s a step eagerly, and the five seeds side by side with
# the tests ~0.25 s (they share 16 cores).
LIMITS = dict(decode=110, kernels=60, train=55, compile=65, default=40, tests=140, alone=25,
              profile=90)
DRY_LIMITS = dict(decode=240, kernels=240, train=180, compile=240, default=120, tests=300,
                  alone=60, profile=240)  # a 2-core CPU beside other tests: generous
PARTS = ("decode", "kernels", "train", "compile", "default", "tests")
MORE_PARTS = ("profile",)  # asked for by name (--parts): the profiles of the goals missed
SHAPE = "Qwen2.5-0.5B"
CUDA_TESTS = sorted(f"tests/{f}" for f in os.listdir(TESTS) if f.endswith("_cuda.py")) + [
    "tests/test_train.py"]
SEED_STEPS = 800
# Dense bf16 matmul peaks (TFLOP/s, no sparsity) of the cards' datasheets, by a part of the name
# torch.cuda.get_device_name gives: the MFU the rest of the field quotes.
CARD_PEAKS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200": 989, "A100": 312,
              "L40S": 362, "A10G": 70}


def card_peak(card: str) -> float | None:
    return next((peak for name, peak in CARD_PEAKS.items() if name in card), None)

# -----------------------------------------------------------------------------
# Parts run in a child process: each yields its figures so far (printed as a JSON line each time,
# so a part cut by its limit still reports what it measured)


def cpu_kernel_route() -> None:
    """On the CPU, CUDA's bf16 kernel route with SDPA's fused CPU kernel in its place (as
    tests/test_graphs.py runs it): the decode step takes the route that compiles."""
    import decode
    decode.kernel_for = lambda device, dtype, head_dim: decode.cpu_flash


def part_decode(dry: bool):
    import bench_limits
    if dry:
        bench_limits.BP, bench_limits.G, bench_limits.NEW = 2, 2, 8
        cpu_kernel_route()
    device = "cpu" if dry else "cuda"
    lim = bench_limits.limits()
    out = dict(copy_gb_s=lim["copy"])
    # The captured step first (no compile: a figure even if the compile outruns the part), then
    # compiled and captured (the default on a GPU for this shape), then transformers' generate,
    # whose compiled static cache comes last (its compile is the longest).
    routes = ("engine, graphs", "engine, compiled + graphs")
    for P in (8,) if dry else (64, 512):
        bench_limits.P = P
        for route in routes:
            for row in bench_limits.rollout_part("tiny" if dry else SHAPE, lim, device, (route,),
                                                 transformers=()):
                out[f"P{P} {route}"] = {k: v for k, v in row.items()
                                        if k not in ("shape", "P", "route")}
            yield out
        if P == 64 or dry:  # transformers at P = 64: the goal's comparison
            caches = ("dynamic",) if dry else ("dynamic", "static")
            hf = {row["cache"]: row["seconds"] for row in bench_limits.rollout_part(
                "tiny" if dry else SHAPE, lim, device, (), transformers=caches)}
            for cache, seconds in hf.items():
                out[f"P{P} transformers {cache}"] = dict(seconds=seconds)
                for route in routes:
                    row = out[f"P{P} {route}"]
                    row[f"over_generate_{cache}"] = seconds / row["seconds"]
                    row["over_generate"] = min(hf.values()) / row["seconds"]
                yield out


def part_kernels(dry: bool):
    import torch
    from bench_rollout import kernels_per_layer
    out = {}
    device = torch.device("cpu" if dry else "cuda")
    for route in ("bf16 kernel", "bf16 kernel, compiled"):
        per_layer, rest, layer = kernels_per_layer(route, device, "" if dry else SHAPE)
        out[route] = dict(per_layer=per_layer, rest=rest, by_kind=dict(layer.most_common(8)))
        yield out


def part_train(dry: bool):
    import bench_limits
    if dry:  # the tests' tiny model on the CPU, a small batch
        bench_limits.BP, bench_limits.G, bench_limits.P, bench_limits.NEW = 4, 2, 8, 16
    rows = bench_limits.train_part("tiny" if dry else SHAPE, bench_limits.limits(),
                                   device="cpu" if dry else "cuda", compile=True,
                                   repeats=1 if dry else 3)
    out = {f"{r['lengths']} {r['forward']}": dict(s=r["seconds"], mfu=r["mfu"],
                                                  tflops=r["tflops"],
                                                  timed_compile_s=r["timed_compile_s"])
           for r in rows}
    for r in rows:
        if r["forward"] == "packed":
            out[f"{r['lengths']} packed/padded"] = r["over_padded"]
            out[f"{r['lengths']} token share"] = r["valid_share"]
            out[f"{r['lengths']} packed/padded over share"] = r["over_padded"] / r["valid_share"]
    out.update(route=rows[0]["route"], peak_gb=rows[0]["peak_gb"] and max(  # None on the CPU
        r["peak_gb"] for r in rows))
    yield out


def part_compile(dry: bool):
    import bench_compiling
    if dry:  # inductor on the CPU, the tiny model
        yield from bench_compiling.cold_then_warm("tiny", 2, 2, 8, 8, rounds=1)
    else:
        yield from bench_compiling.cold_then_warm(SHAPE, 16, 8, 64, 256, rounds=2)


def part_profile(dry: bool):
    """Where the time of the goals' measurements goes: top kernels and launch gaps
    (bench_limits.profile_part), for the goals the figures miss."""
    import bench_limits
    if dry:
        bench_limits.BP, bench_limits.G, bench_limits.P, bench_limits.NEW = 2, 2, 8, 8
        cpu_kernel_route()
    yield bench_limits.profile_part("tiny" if dry else SHAPE, "cpu" if dry else "cuda")


CHILD_PARTS = dict(decode=part_decode, kernels=part_kernels, train=part_train,
                   compile=part_compile, profile=part_profile)

# -----------------------------------------------------------------------------
# Parts run as whole commands: the tests, train.py's runs


def train_py(args: list[str], out: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), "--out", out, *args]


def records(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def seed_figures(out: str, steps: int, status: str) -> dict:
    """A seed's run: how far it got, its last held-out evaluation, and whether it learned (its
    evaluation at the last step >= 0.9); a run that was cut says so and is not judged."""
    recs = records(out)
    evals = [r for r in recs if r.get("eval_correct") is not None]
    last = evals[-1] if evals else {}
    step = recs[-1]["step"] if recs else 0
    finished = step == steps and last.get("step") == steps
    verdict = ("learned" if last["eval_correct"] >= 0.9 else "not learned") if finished else (
        f"cut at step {step}" if status == "timeout" else f"stopped at step {step} ({status})")
    return dict(status=status, step=step, eval_correct=last.get("eval_correct"),
                eval_step=last.get("step"), verdict=verdict)


def tests_command(dry: bool, tests: list[str] | None = None) -> list[str]:
    """CUDA_TESTS (dry: one small file), or `tests` by id, one at a time."""
    cmd = [sys.executable, "-m", "pytest", "-p", "deadline", "--deadline", "90", "-rfE", "-v",
           "-p", "no:cacheprovider"]
    if tests:
        return cmd + tests
    try:
        import xdist  # noqa: F401 (pytest-xdist: -n)
        cmd += ["-n", "2" if dry else "6"]  # the seeds run beside them
    except ImportError:
        pass
    return cmd + (["tests/test_plot.py"] if dry else CUDA_TESTS)


def tests_figures(log: str) -> dict:
    """Counts and failing test ids from pytest's -v lines, which are there even when the run was
    cut: `[gw0] [ 1%] PASSED tests/x.py::test_y` (xdist), `tests/x.py::test_y PASSED`, and the
    -rfE summary's `FAILED tests/x.py::test_y - message`."""
    status: dict[str, str] = {}
    for line in log.splitlines():
        words = line.split()
        ids = [w for w in words if "::" in w]
        kind = next((w for w in words if w in ("PASSED", "FAILED", "ERROR", "SKIPPED")), None)
        if ids and kind and status.get(ids[0]) not in ("FAILED", "ERROR"):
            status[ids[0]] = kind
    failed = sorted(t for t, kind in status.items() if kind in ("FAILED", "ERROR"))
    return dict(passed=sum(kind == "PASSED" for kind in status.values()), failed=failed,
                skipped=sum(kind == "SKIPPED" for kind in status.values()))

# -----------------------------------------------------------------------------
# Processes: each part a process group, ended whole; nothing of it left on the GPU after it


def child_env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}


def start(cmd: list[str], log: str) -> subprocess.Popen:
    """cmd in a process group of its own (start_new_session): everything it starts is in it."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env(), start_new_session=True)


def finish(proc: subprocess.Popen, deadline: float) -> str:
    """Wait for proc until `deadline` (time.perf_counter()); then end its whole process group,
    whatever is left of it. ok, error N (its exit code) or timeout."""
    try:
        code = proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
        status = "ok" if code == 0 else f"error {code}"
    except subprocess.TimeoutExpired:
        status = "timeout"
    end_group(proc.pid)
    proc.wait()
    return status


def end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    reap()
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group exists (as another user)
        return True


def adopt_orphans() -> None:
    """Become the subreaper of what the parts start (Linux): a killed part's orphans are then
    this process's children, reaped here (reap), not zombies that keep their group alive."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def gpu_pids() -> set[int]:
    """The processes nvidia-smi sees on the GPU (none where there is no nvidia-smi)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(w) for w in done.stdout.split() if w.isdigit()}


def wait_clear(groups: list[int], before: set[int], seconds: float = 20.0) -> list[str]:
    """Wait until none of `groups` has a process and the GPU holds no process that was not there
    before the check (`before`); what is still there after `seconds`, named ([] when clear)."""
    deadline = time.perf_counter() + seconds
    while True:
        alive = [g for g in groups if group_alive(g)]
        on_gpu = gpu_pids() - before
        if not alive and not on_gpu:
            return []
        if time.perf_counter() > deadline:
            return [f"process group {g}" for g in alive] + [f"GPU process {p}" for p in on_gpu]
        for g in alive:
            end_group(g)
        time.sleep(0.5)


def last_json(log: str) -> dict:
    """The last figures a part's child printed (one JSON object a line)."""
    with open(log) as f:
        lines = [line for line in f if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}

# -----------------------------------------------------------------------------
# The driver


def run_part(name: str, args, limits: dict) -> tuple[dict, list[int]]:
    """One part: its figures and the process groups it started."""
    started = time.perf_counter()
    deadline = started + limits[name]
    log = os.path.join(args.out, f"{name}.log")
    if name in CHILD_PARTS:
        proc = start([sys.executable, __file__, "--part", name] + ["--dry_run"] * args.dry_run,
                     log)
        status = finish(proc, deadline)
        return dict(status=status, seconds=time.perf_counter() - started,
                    **last_json(log)), [proc.pid]
    if name == "default":
        run_out = os.path.join(args.out, "default")
        steps = ["--steps", "3", "--eval_every", "0", "--save_every", "0"] if args.dry_run else []
        proc = start(train_py(steps, run_out), log)
        status = finish(proc, deadline)
        recs = records(run_out)
        return dict(status=status, seconds=time.perf_counter() - started,
                    step=recs[-1]["step"] if recs else 0,
                    eval_correct=next((r["eval_correct"] for r in reversed(recs)
                                       if r.get("eval_correct") is not None), None)), [proc.pid]
    # tests, the seeds beside them
    steps = 2 if args.dry_run else SEED_STEPS
    seed_args = ["--steps", str(steps), "--save_every", "0"] + (
        ["--eval_every", "2"] if args.dry_run else [])
    seeds = {seed: start(train_py(["--dtype", "bfloat16", "--seed", str(seed), *seed_args],
                                  os.path.join(args.out, "seeds", f"seed{seed}")),
                         os.path.join(args.out, f"seed{seed}.log")) for seed in range(5)}
    proc = start(tests_command(args.dry_run), log)
    # the failed tests again, alone, within the same limit (less the time kept for that)
    status = finish(proc, deadline - limits["alone"])
    with open(log) as f:
        figures = dict(status=status, **tests_figures(f.read()))
    groups = [proc.pid]
    if figures["failed"]:
        alone = start(tests_command(args.dry_run, figures["failed"]),
                      os.path.join(args.out, "alone.log"))
        finish(alone, deadline)
        groups.append(alone.pid)
        with open(os.path.join(args.out, "alone.log")) as f:
            figures["failed_alone"] = tests_figures(f.read())["failed"]
    runs = {}
    for seed, p in seeds.items():
        runs[seed] = seed_figures(os.path.join(args.out, "seeds", f"seed{seed}"), steps,
                                  finish(p, deadline))
        groups.append(p.pid)
    learned = sum(r["verdict"] == "learned" for r in runs.values())
    figures["seeds"] = dict(learned=learned, runs=runs)
    figures["seconds"] = time.perf_counter() - started
    return figures, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check"))
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the record")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--part", help=argparse.SUPPRESS)  # inside a part's child process
    args = parser.parse_args()
    if args.part:
        for figures in CHILD_PARTS[args.part](args.dry_run):
            print(json.dumps(figures), flush=True)
        return
    if args.dry_run:  # every child on the CPU, also on a GPU machine
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    wanted = args.parts.split(",")
    if set(wanted) - set(PARTS + MORE_PARTS):
        sys.exit(f"gpu_check: unknown parts {sorted(set(wanted) - set(PARTS + MORE_PARTS))}; the "
                 f"parts are {', '.join(PARTS + MORE_PARTS)}")
    import torch  # this process never touches CUDA: the GPU is the parts'
    card = "CPU" if args.dry_run else card_name()
    if not card:
        sys.exit("gpu_check: no CUDA GPU here (nvidia-smi lists none); --dry_run runs every part "
                 "on the CPU")
    os.makedirs(args.out, exist_ok=True)
    adopt_orphans()
    before = set() if args.dry_run else gpu_pids()
    limits = DRY_LIMITS if args.dry_run else LIMITS
    report = dict(commit=args.commit, torch=torch.__version__, dry_run=args.dry_run, card=card,
                  card_peak_tflops=card_peak(card), parts={})
    for name in wanted:
        figures, groups = run_part(name, args, limits)
        left = wait_clear(groups, before)
        if left:
            figures["left_running"] = left
        report["parts"][name] = figures
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"{name}: {json.dumps(figures)[:600]}", flush=True)
    print_table(report)


def card_name() -> str:
    """The first GPU's name as torch gives it, from nvidia-smi (this process makes no CUDA
    context: it would sit on the GPU beside the parts)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    names = done.stdout.strip().splitlines()
    return names[0].strip() if names else ""

# -----------------------------------------------------------------------------
# The table


def summary(report: dict) -> list[tuple[str, str, str]]:
    """The table's rows: (figure, value, goal), the figures the GPU path is judged by."""
    parts = report["parts"]

    def get(part: str, *keys, fmt: str = "{:.3g}") -> str:
        value = parts.get(part, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            return parts.get(part, {}).get("status", "not run")
        return fmt.format(value) if isinstance(value, (int, float)) else str(value)
    rows = []
    decode = parts.get("decode", {})
    for P in ("P64", "P512", "P8"):
        for route in ("engine, compiled + graphs", "engine, graphs"):
            key = f"{P} {route}"
            if key in decode:
                rows.append((f"decode {P}, {route}: tokens/s, of the copy floor, x generate "
                             "(best; dynamic, static + compile)",
                             f"{get('decode', key, 'decode_tokens_s', fmt='{:,.0f}')}, "
                             f"{get('decode', key, 'floor_share', fmt='{:.0%}')}, "
                             f"{get('decode', key, 'over_generate', fmt='{:.1f}x')} "
                             f"({get('decode', key, 'over_generate_dynamic', fmt='{:.1f}x')}, "
                             f"{get('decode', key, 'over_generate_static', fmt='{:.1f}x')})",
                             ">= 30%, >= 3x" if P == "P64" else ""))
    if "decode" in parts:
        rows.append(("decode part", f"{decode['status']} in {decode['seconds']:.0f} s", ""))
    if "kernels" in parts:
        rows.append(("decode: kernels a layer of the graphed step, eager / compiled",
                     f"{get('kernels', 'bf16 kernel', 'per_layer')} / "
                     f"{get('kernels', 'bf16 kernel, compiled', 'per_layer')}", "<= 12"))
    if "train" in parts:
        peak = report.get("card_peak_tflops")
        rows.append(("train MFU at uniform lengths (of the measured matmul rate): packed, "
                     "padded, repeated prompt",
                     ", ".join(get("train", f"uniform {f}", "mfu", fmt="{:.0%}")
                               for f in ("packed", "padded", "naive")), ">= 35%"))
        if peak:
            rows.append((f"train MFU, packed, of the card's dense bf16 peak ({peak} TFLOP/s)",
                         get("train", "uniform packed", "tflops", fmt="{:.0f} TFLOP/s") +
                         (f" = {parts['train']['uniform packed']['tflops'] / peak:.0%}"
                          if "uniform packed" in parts["train"] else ""), ""))
        rows.append(("train packed / padded, uniform lengths",
                     get("train", "uniform packed/padded"), "<= 1.0"))
        rows.append(("train packed / padded over the token share, mean 1/3 (micro-batches by "
                     "tokens; by 4 groups)",
                     f"{get('train', 'mean 1/3 packed/padded over share')}; "
                     f"{get('train', 'mean 1/3, 4 groups a micro-batch packed/padded over share')}",
                     "<= 1.2"))
    if "compile" in parts:
        rows.append(("first step's compile (s), cold / warm cache",
                     f"{get('compile', 'cold', 'compile_s', fmt='{:.1f}')} / "
                     f"{get('compile', 'warm', 'compile_s', fmt='{:.1f}')}", "<= 20 / <= 5"))
    if "default" in parts:
        rows.append(("default run (s)", f"{get('default', 'seconds', fmt='{:.0f}')} "
                     f"({parts['default']['status']}, step {parts['default']['step']})", "<= 30"))
    if "tests" in parts:
        t = parts["tests"]
        failed = t["failed"]
        rows.append(("CUDA tests", f"{t['passed']} passed, {len(failed)} failed ({t['status']})"
                     + (": " + ", ".join(failed) if failed else ""), "green"))
        if failed:
            rows.append(("CUDA tests: of those, failed again alone",
                         ", ".join(t.get("failed_alone", ["not run"])) or "none", "none"))
        runs = t["seeds"]["runs"].values()
        rows.append(("bf16 default, seeds 0-4: held-out correct",
                     f"{t['seeds']['learned']}/5 learned; " + "; ".join(
                         f"{r['verdict']}, eval {r['eval_correct']} at step {r['eval_step']}"
                         for r in runs), "5/5"))
    for name, part in parts.items():
        if part.get("left_running"):
            rows.append((f"{name}: still running after it ended", ", ".join(part["left_running"]),
                         "none"))
    return rows


def print_table(report: dict) -> None:
    print(f"\ngpu_check at {report['commit']} on {report['card']}, torch {report['torch']}"
          f"{' (dry run)' if report['dry_run'] else ''}; every figure in gpu_check.json")
    print("| figure | value | goal |\n|---|---|---|")
    for figure, value, goal in summary(report):
        print(f"| {figure} | {value} | {goal} |")


if __name__ == "__main__":
    main()
