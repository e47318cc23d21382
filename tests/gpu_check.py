"""Where the engine stands on one CUDA GPU: every figure the GPU path is judged by, in two calls of
the device machine, each inside a time budget, every figure written the moment it exists.

    python tests/gpu_check.py --call figures --out $OUT --commit HASH   # 1st call: 460 s at most
    python tests/gpu_check.py --call tests --out $OUT --add_to FILE     # 2nd: 290 s; FILE: the 1st's JSON
    python tests/gpu_check.py --parts train,compile --budget 200        # some parts, in this order
    python tests/gpu_check.py --dry_run --call all --out DIR            # every part on the CPU, tiny

The calls (CALLS) and their parts, in the order of their value, each with its limit (LIMITS):
- decode: the bf16 rollout at Qwen2.5-0.5B's shape, 16 prompts x 8 samples, 256 new tokens
  (tests/bench_limits.py's rollout_rows), a row as each is measured: at P = 64 the engine's step
  captured in CUDA graphs (no compile: a figure even when the compile outruns the part), then
  compiled and captured (the default on a GPU for this shape), each with its share of the
  copy-bandwidth floor (the bytes a step must read over the copy rate measured in the same
  process); then transformers' generate with its dynamic cache (the goal's x generate needs it);
  then the engine at P = 512.
- generate_static: transformers' generate with its static cache, which it compiles with CUDA graphs
  (its best), at P = 64: a part of its own, since that compile is the longest.
- kernels: the kernels one replay of the decode step's graph launches a layer, eager and compiled
  (tests/bench_rollout.py: a 2-block model's total less a 1-block model's).
- train: one GRPO forward + backward at the same shape, fp32 master under bf16 autocast, the blocks
  compiled (bench_limits.train_rows), a row at a time: packed and padded at uniform lengths (64 +
  256) and at a mean of 1/3 of them first, then the repeated prompt and micro-batches of 4 groups;
  MFU against the bf16 matmul rate measured in the same process and the card's dense bf16 peak
  (CARD_PEAKS).
- compile: the first step's compile seconds with an empty compile cache, then with the cache the
  first left, each one step in a fresh process (tests/bench_compiling.py, rounds 0).
- default: `python train.py`, the default run: its seconds, whole and a step.
- seeds: `train.py --dtype bfloat16` on seeds 0-4 to step 800, side by side with nothing else on
  the GPU; held-out accuracy is the figure. A seed cut by the limit is judged by its last
  evaluation if that came at step >= 300, and says how far it got.
- tests: what only a GPU can test (CUDA_TESTS: tests/test_*_cuda.py, then tests/test_train.py,
  whose runs go to the GPU), each test under tests/deadline.py's --deadline; then each failed one
  again, alone on the GPU: what failed, what passed alone, what the limit cut.
- profile (only when named in --parts): torch.profiler's top kernels and the share of the wall clock
  the GPU was busy (the rest: launch gaps) for a rollout and a packed step, for the goals missed.

The budget (--budget, the call's BUDGETS by default) is one deadline for the call: each part's limit
is clipped to what is left of it. Each part runs in a process group of its own (its children die
with the driver: PR_SET_PDEATHSIG), ended whole when its limit or the budget ends, or when the
driver gets SIGTERM; the next part starts when nothing of it is left on the GPU. OUT holds
gpu_check.json, rewritten at each new figure (a cut part keeps what it measured; a figure never
measured reads "missing (...)" in the table) and gpu_check.log, every part's output in one file;
runs and checkpoints go to a folder under /tmp. --dry_run runs each part on the CPU at tiny shapes
through every route a CPU can (the decode step and the draw compiled by inductor, the compiled
blocks, the kernel counts; CUDA hidden from every child), and builds, imports and collects what only
the GPU runs (gpu_branches), so a typo cannot waste the call: tests/test_gpu_check.py runs it.
"""

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]

# Two calls of under 600 s each, back to back on one GPU machine, 15 minutes in all with the
# machine's start (~60-120 s): the figures first, then the tests and the seeds.
CALLS = dict(figures=("decode", "generate_static", "kernels", "train", "compile", "default"),
             tests=("seeds", "tests"))
BUDGETS = dict(figures=460, tests=290, all=750)
DEVICE_SECONDS, MACHINE_START = 900, 120  # the two calls and a start fit in 15 minutes
# Seconds per part on a GPU, from an H200's runs of this check (seconds used): decode 90, the
# static cache's compile and figure 35-45, kernels 23 with the compiled step refused (its compile
# comes on top), train 67, compile ~30 (cold 19, warm 9), default 0.051 s a step x 800 after its
# start, the seeds 89, the CUDA tests over 150 (cut) and the failed ones alone 33.
LIMITS = dict(decode=100, generate_static=60, kernels=60, train=80, compile=50, default=60,
              seeds=100, tests=170, profile=90)
ALONE = 40  # of the tests' limit, kept for the failed tests' reruns alone
WAIT = 8  # seconds at most a part's end waits for its processes to leave the GPU
DRY_LIMITS = dict(decode=240, generate_static=120, kernels=240, train=180, compile=240,
                  default=120, seeds=180, tests=300, profile=240)  # a loaded 2-core CPU
PARTS = CALLS["figures"] + CALLS["tests"]
MORE_PARTS = ("profile",)  # asked for by name (--parts): the profiles of the goals missed
SHAPE = "Qwen2.5-0.5B"
CUDA_TESTS = sorted(f"tests/{f}" for f in os.listdir(TESTS) if f.endswith("_cuda.py")) + [
    "tests/test_train.py"]
SEEDS, SEED_STEPS, SEED_JUDGED_FROM = 5, 800, 300
# Dense bf16 matmul peaks (TFLOP/s, no sparsity) of the cards' datasheets, by a part of the name
# torch.cuda.get_device_name gives, the longest name that matches (an "H200 NVL" is not an
# "H200"): the MFU the rest of the field quotes.
CARD_PEAKS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200 NVL": 835, "H200": 989,
              "A100": 312, "L40S": 362, "A10G": 70}


def card_peak(card: str) -> float | None:
    names = sorted((name for name in CARD_PEAKS if name in card), key=len, reverse=True)
    return CARD_PEAKS[names[0]] if names else None


def fits(call: str, limits: dict = LIMITS) -> float:
    """Seconds the call's parts may take at most, their waits included (<= BUDGETS[call])."""
    parts = PARTS if call == "all" else CALLS[call]
    return sum(limits[p] for p in parts) + WAIT * len(parts)

# -----------------------------------------------------------------------------
# Parts run in a child process: each yields its figures so far, printed as a JSON line each time


def cpu_kernel_route() -> None:
    """On the CPU, CUDA's bf16 kernel route with SDPA's fused CPU kernel in its place (as
    tests/test_graphs.py runs it): the decode step takes the route that compiles."""
    from engine import decode
    decode.kernel_for = lambda device, dtype, head_dim: decode.cpu_flash


def rollout_setup(dry: bool):
    import bench_limits
    if dry:
        bench_limits.BP, bench_limits.G, bench_limits.NEW = 2, 2, 8
        cpu_kernel_route()
    return bench_limits, ("tiny" if dry else SHAPE), ("cpu" if dry else "cuda")


def row_figures(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("shape", "P", "route", "cache")}


def part_decode(dry: bool):
    bench_limits, shape, device = rollout_setup(dry)
    lim = bench_limits.limits()
    out = dict(copy_gb_s=lim["copy"])
    yield out
    routes = ("engine, graphs", "engine, compiled + graphs")
    for P, caches in ((8, ("dynamic",)),) if dry else ((64, ("dynamic",)), (512, ())):
        bench_limits.P = P
        for row in bench_limits.rollout_rows(shape, lim, device, routes, transformers=caches):
            name = row["route"] if "cache" not in row else f"transformers {row['cache']}"
            out[f"P{P} {name}"] = row_figures(row)
            yield out


def part_generate_static(dry: bool):
    bench_limits, shape, device = rollout_setup(dry)
    bench_limits.P = 8 if dry else 64
    for row in bench_limits.rollout_rows(shape, dict(copy=float("nan")), device, (),
                                         transformers=("static",)):
        yield {f"P{bench_limits.P} transformers static": row_figures(row)}


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
    out = {}
    for r in bench_limits.train_rows("tiny" if dry else SHAPE, bench_limits.limits(),
                                     device="cpu" if dry else "cuda", compile=True,
                                     repeats=1 if dry else 3):
        out[f"{r['lengths']} {r['forward']}"] = dict(
            s=r["seconds"], mfu=r["mfu"], tflops=r["tflops"], micro_batches=r["micro_batches"],
            timed_compile_s=r["timed_compile_s"])
        out[f"{r['lengths']} token share"] = r["valid_share"]
        if r["forward"] == "packed":
            out[f"{r['lengths']} packed/padded"] = r["over_padded"]
            out[f"{r['lengths']} packed/padded over share"] = r["over_padded"] / r["valid_share"]
        out["route"] = r["route"]
        if r["peak_gb"] is not None:  # None on the CPU
            out["peak_gb"] = max(out.get("peak_gb", 0), r["peak_gb"])
        yield out
    # Then LoRA beside full fine-tuning: one whole step (forward, backward, AdamW) each, bf16 on
    # the GPU (full: fp32 master under autocast; LoRA: the base frozen in bf16, fp32 adapters).
    import bench_lora
    import torch
    cfg = bench_limits.tiny_model().config if dry else bench_limits.SHAPES[SHAPE]
    build = None if dry else lambda c: bench_limits.build(SHAPE, torch.float32, "cuda")
    for r in bench_lora.train_rows(cfg, "float32" if dry else "bfloat16", "cpu" if dry else "cuda",
                                   rounds=1 if dry else 3, batch=2 if dry else 8,
                                   length=16 if dry else 512, build=build):
        out[f"step {r['variant']}"] = dict(s=r["seconds"], peak_gb=r["peak_mb"] / 1024,
                                          resident_gb=r["resident_mb"] / 1024,
                                          trainable_m=r["trainable_m"])
        yield out


def part_compile(dry: bool):
    import bench_compiling
    if dry:  # inductor on the CPU, the tiny model
        yield from bench_compiling.cold_then_warm("tiny", 2, 2, 8, 8, rounds=0)
    else:
        yield from bench_compiling.cold_then_warm(SHAPE, 16, 8, 64, 256, rounds=0)


def part_profile(dry: bool):
    """Where the time of the goals' measurements goes: top kernels and launch gaps
    (bench_limits.profile_part), for the goals the figures miss."""
    import bench_limits
    if dry:
        bench_limits.BP, bench_limits.G, bench_limits.P, bench_limits.NEW = 2, 2, 8, 8
        cpu_kernel_route()
    yield bench_limits.profile_part("tiny" if dry else SHAPE, "cpu" if dry else "cuda")


CHILD_PARTS = dict(decode=part_decode, generate_static=part_generate_static, kernels=part_kernels,
                   train=part_train, compile=part_compile, profile=part_profile)

# -----------------------------------------------------------------------------
# Parts run as whole commands (train.py's runs, pytest), their figures read from what they write


def train_py(args: list[str], out: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), "--out", out, *args]


def seed_args(seed: int, dry: bool) -> list[str]:
    steps = 2 if dry else SEED_STEPS
    return ["--dtype", "bfloat16", "--seed", str(seed), "--steps", str(steps), "--save_every",
            "0"] + (["--eval_every", "2"] if dry else [])


def default_args(dry: bool) -> list[str]:
    return ["--steps", "3", "--eval_every", "0", "--save_every", "0"] if dry else []


def records(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().splitlines()
    recs = []
    for line in lines:
        try:
            recs.append(json.loads(line))
        except ValueError:  # the line being written as we read
            break
    return recs


def run_figures(out: str) -> dict:
    """A train.py run so far: its last step, its last held-out evaluation, and its seconds a step
    (rollout + logprobs + training, the mean over its steps)."""
    recs = records(out)
    evals = [r for r in recs if r.get("eval_correct") is not None]
    steps = [r["t_rollout"] + r["t_logprobs"] + r["t_train"] for r in recs]
    return dict(step=recs[-1]["step"] if recs else 0,
                eval_correct=evals[-1]["eval_correct"] if evals else None,
                eval_step=evals[-1]["step"] if evals else None,
                step_s=sum(steps) / len(steps) if steps else None)


def seed_figures(out: str, steps: int, status: str, judged_from: int = SEED_JUDGED_FROM) -> dict:
    """A seed's run: how far it got, its last held-out evaluation, and whether it learned (that
    evaluation >= 0.9), judged at the last step, or, for a run that was cut, at its last
    evaluation if that came at step >= judged_from."""
    got = run_figures(out)
    step, last = got["step"], got["eval_step"]
    finished = step == steps and last == steps
    if finished or (status == "timeout" and last is not None and last >= judged_from):
        verdict = "learned" if got["eval_correct"] >= 0.9 else "not learned"
        if not finished:
            verdict += f" (cut at step {step}, judged at {last})"
    else:
        verdict = f"cut at step {step}" if status == "timeout" else \
            f"stopped at step {step} ({status})"
    return dict(status=status, step=step, eval_correct=got["eval_correct"], eval_step=last,
                verdict=verdict)


def tests_command(dry: bool, tests: list[str] | None = None) -> list[str]:
    """CUDA_TESTS (dry: one small file), or `tests` by id, one at a time, nothing beside them."""
    cmd = [sys.executable, "-m", "pytest", "-p", "deadline", "--deadline", "90", "-rfE", "-v",
           "-p", "no:cacheprovider"]
    if tests:
        return cmd + tests
    try:
        import xdist  # noqa: F401 (pytest-xdist: -n)
        cmd += ["-n", "2" if dry else "6"]
    except ImportError:
        pass
    return cmd + (["tests/test_plot.py"] if dry else CUDA_TESTS)


def tests_figures(log: str) -> dict:
    """Counts and failing test ids from pytest's -v lines, which are there even when the run was
    cut: `[gw0] [ 1%] PASSED tests/x.py::test_y` (xdist), `tests/x.py::test_y PASSED`, and the
    -rfE summary's `FAILED tests/x.py::test_y - message`; the tests collected (`collected N items`,
    `collecting ... collected N items` under -v, or xdist's `N workers [M items]`), so that those a
    cut never reached are counted."""
    status: dict[str, str] = {}
    collected = None
    for line in log.splitlines():
        words = line.split()
        count = re.search(r"collected (\d+) items?\b|workers \[(\d+) items?\]", line)
        if count:
            collected = int(count.group(1) or count.group(2))
        ids = [w for w in words if "::" in w]
        kind = next((w for w in words if w in ("PASSED", "FAILED", "ERROR", "SKIPPED")), None)
        if ids and kind and status.get(ids[0]) not in ("FAILED", "ERROR"):
            status[ids[0]] = kind
    failed = sorted(t for t, kind in status.items() if kind in ("FAILED", "ERROR"))
    passed = sorted(t for t, kind in status.items() if kind == "PASSED")
    return dict(passed=len(passed), passed_ids=passed, failed=failed,
                skipped=sum(kind == "SKIPPED" for kind in status.values()),
                not_reached=None if collected is None else collected - len(status))

# -----------------------------------------------------------------------------
# Processes: each part a process group, ended whole; nothing of it left on the GPU after it

GROUPS: set[int] = set()  # the process groups running now (ended on SIGTERM)


def child_env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the driver dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start(cmd: list[str], log: str) -> subprocess.Popen:
    """cmd in a process group of its own (start_new_session): everything it starts is in it."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env(), start_new_session=True,
                                preexec_fn=die_with_parent)
    GROUPS.add(proc.pid)
    return proc


def watch(procs: list[subprocess.Popen], deadline: float, figures, publish) -> str:
    """Wait for procs until `deadline` (time.perf_counter()), calling publish(figures()) each time
    the figures change; then end each one's whole process group, whatever is left of it. ok,
    error N (the first non-zero exit code) or timeout."""
    last = None
    while True:
        done = all(p.poll() is not None for p in procs)
        now = figures()
        if now != last:
            publish(now)
            last = now
        if done or time.perf_counter() > deadline:
            break
        time.sleep(0.5)
    for p in procs:
        end_group(p.pid)
        p.wait()
    if not done:
        return "timeout"
    codes = [p.returncode for p in procs if p.returncode != 0]
    return f"error {codes[0]}" if codes else "ok"


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
        GROUPS.discard(pgid)
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


def end_everything() -> None:
    """End every part's group and every process left to this one (an orphan that left its group
    with setsid is reparented here: this process is the subreaper)."""
    for g in list(GROUPS):
        end_group(g)
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == me:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    reap()


def gpu_pids() -> set[int]:
    """The processes nvidia-smi sees on the GPU (none where there is no nvidia-smi)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(w) for w in done.stdout.split() if w.isdigit()}


def wait_clear(groups: list[int], before: set[int], seconds: float = WAIT) -> list[str]:
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
        time.sleep(0.25)


def child_figures(log: str):
    """The last figures a part's child printed (one JSON object a line), read as it runs."""
    def read() -> dict:
        with open(log) as f:
            lines = [line for line in f if line.startswith("{") and line.endswith("}\n")]
        return json.loads(lines[-1]) if lines else {}
    return read

# -----------------------------------------------------------------------------
# The driver


class Check:
    """One call's report: gpu_check.json rewritten at each new figure, the combined log."""

    def __init__(self, args, card: str, torch_version: str):
        self.args, self.out = args, args.out
        self.work = tempfile.mkdtemp(prefix="gpu_check_")  # runs, checkpoints, per-part logs
        self.report = dict(commit=args.commit, torch=torch_version, dry_run=args.dry_run,
                           card=card, card_peak_tflops=card_peak(card), parts={})
        if args.add_to:  # the earlier call's figures: this call adds its parts to them
            with open(args.add_to) as f:
                earlier = json.load(f)
            self.report["parts"] = earlier["parts"]
            self.report["calls"] = earlier.get("calls", [])
        self.report.setdefault("calls", []).append(dict(call=args.call, commit=args.commit,
                                                        budget_s=args.budget))
        self.log = open(os.path.join(self.out, "gpu_check.log"), "a")

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def publish(self, name: str, figures: dict) -> None:
        self.report["parts"][name] = figures
        path = os.path.join(self.out, "gpu_check.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.report, f, indent=1)
        os.replace(path + ".tmp", path)  # whole or not at all, whenever the call is cut

    def keep_log(self, name: str, log: str) -> None:
        """A part's own log, appended to the combined one."""
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                self.log.write(f"\n===== {name}: {os.path.basename(log)}\n{f.read()}")
            self.log.flush()

    def run_part(self, name: str, limit: float) -> tuple[dict, list[int], list[str]]:
        """One part under `limit` seconds: its figures (published as they come), the process
        groups it started and its logs."""
        args, started = self.args, time.perf_counter()
        deadline = started + limit
        state = dict(status="running", limit_s=round(limit))

        def publish(figures: dict) -> None:
            self.publish(name, dict(state, seconds=time.perf_counter() - started, **figures))
        log = os.path.join(self.work, f"{name}.log")
        if name in CHILD_PARTS:
            proc = start([sys.executable, __file__, "--part", name] + ["--dry_run"] * args.dry_run,
                         log)
            state["status"] = watch([proc], deadline, child_figures(log), publish)
            publish(child_figures(log)())
            return self.report["parts"][name], [proc.pid], [log]
        if name == "default":
            run = os.path.join(self.work, "default")
            proc = start(train_py(default_args(args.dry_run), run), log)
            state["status"] = watch([proc], deadline, lambda: run_figures(run), publish)
            publish(run_figures(run))
            return self.report["parts"][name], [proc.pid], [log]
        if name == "seeds":
            steps = 2 if args.dry_run else SEED_STEPS
            judged = 2 if args.dry_run else SEED_JUDGED_FROM
            runs = {s: os.path.join(self.work, "seeds", f"seed{s}") for s in range(SEEDS)}
            logs = [os.path.join(self.work, f"seed{s}.log") for s in runs]
            procs = {s: start(train_py(seed_args(s, args.dry_run), runs[s]), logs[s])
                     for s in runs}

            def figures() -> dict:
                got = {s: seed_figures(runs[s], steps, "timeout" if procs[s].poll() is None else
                                       "ok" if procs[s].returncode == 0 else
                                       f"error {procs[s].returncode}", judged) for s in runs}
                return dict(learned=sum(r["verdict"].startswith("learned") for r in got.values()),
                            runs=got)
            state["status"] = watch(list(procs.values()), deadline, figures, publish)
            publish(figures())
            return self.report["parts"][name], [p.pid for p in procs.values()], logs
        # tests: the CUDA tests, then each that failed again, alone (ALONE kept for that)
        alone_log = os.path.join(self.work, "alone.log")
        proc = start(tests_command(args.dry_run), log)

        def read(path: str) -> dict:
            with open(path, errors="replace") as f:
                return tests_figures(f.read())
        state["status"] = watch([proc], deadline - min(ALONE, limit / 3), lambda: read(log),
                                publish)
        figures = read(log)
        groups = [proc.pid]
        if figures["failed"]:
            wait_clear(groups, self.before)  # nothing else on the GPU
            alone = start(tests_command(args.dry_run, figures["failed"]), alone_log)
            groups.append(alone.pid)

            def with_alone() -> dict:
                again = read(alone_log)
                return dict(figures, failed_alone=again["failed"],
                            passed_alone=again["passed_ids"],
                            cut_alone=sorted(set(figures["failed"]) - set(again["failed"]) -
                                             set(again["passed_ids"])))
            watch([alone], deadline, with_alone, publish)
            figures = with_alone()
        publish(figures)
        return self.report["parts"][name], groups, [log, alone_log]

    def run(self, wanted: list[str], budget: float) -> None:
        end = time.perf_counter() + budget
        limits = DRY_LIMITS if self.args.dry_run else LIMITS
        for name in wanted:
            left = end - time.perf_counter() - WAIT  # the part's end waits for the GPU to clear
            if left < 5:
                self.publish(name, dict(status=f"not run: the budget's {budget:.0f} s were spent"))
                self.say(f"{name}: not run (budget spent)")
                continue
            self.current = name
            figures, groups, logs = self.run_part(name, min(limits[name], left))
            still = wait_clear(groups, self.before)
            if still:
                figures["left_running"] = still
                self.publish(name, figures)
            for log in logs:
                self.keep_log(name, log)
            self.say(f"{name}: {figures['status']} in {figures.get('seconds', 0):.0f} s")
        self.current = None

    def interrupted(self, signum, frame) -> None:
        """SIGTERM (the command's limit) or SIGINT: end every part, keep what they measured."""
        end_everything()
        name = getattr(self, "current", None)
        if name:
            part = self.report["parts"].get(name, {})
            self.publish(name, dict(part, status=f"cut by signal {signum} at "
                                    f"{part.get('seconds', 0):.0f} s"))
            self.keep_log(name, os.path.join(self.work, f"{name}.log"))
        self.say(f"gpu_check: ended by signal {signum}; the figures so far are in "
                 f"{self.out}/gpu_check.json")
        print_table(self.report, self.say)
        os._exit(128 + signum)


def gpu_branches() -> dict:
    """What only a GPU runs, built and imported on the CPU (a dry run's check): each part's GPU
    command line and settings, the modules and names its GPU branches reach, the CUDA test
    files collected, the seeds' train.py options parsed, and the budgets' arithmetic."""
    import bench_compiling  # noqa: F401 (the compile part's child)
    import bench_limits
    import bench_rollout
    from engine import packing
    from run import plan
    import train
    import torch
    from model import Llama
    got = {name: " ".join([sys.executable, __file__, "--part", name]) for name in CHILD_PARTS}
    for seed in range(SEEDS):
        train.parse_args(seed_args(seed, dry=False))  # exits in one line if an option is unknown
    train.parse_args(default_args(dry=False))
    got["seeds"] = " ".join(train_py(seed_args(0, dry=False), "RUN"))
    got["tests"] = " ".join(tests_command(dry=False))
    with torch.device("meta"):  # the GPU's shape builds (no memory on the meta device)
        got["shape_params"] = sum(p.numel() for p in Llama(bench_limits.SHAPES[SHAPE]).parameters())
    assert "static" in bench_limits.HF_CACHES and callable(bench_rollout.kernels_per_layer)
    assert callable(packing.cuda_route) and plan.GPU_CHUNK_BYTES > 0
    assert all(os.path.exists(os.path.join(ROOT, f)) for f in CUDA_TESTS), CUDA_TESTS
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *CUDA_TESTS], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True)
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert done.returncode == 0 and collected, done.stdout[-2000:] + done.stderr[-2000:]
    got["cuda_tests_collected"] = len(collected)
    for call in CALLS:
        assert fits(call) <= BUDGETS[call], (call, fits(call), BUDGETS[call])
    got["fits"] = {call: fits(call) for call in CALLS}
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check"))
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the record")
    parser.add_argument("--call", default="figures", choices=list(BUDGETS),
                        help="which call's parts (CALLS; all: both)")
    parser.add_argument("--parts", default="", help="these parts, in this order (not the call's)")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds for the whole call (default: the call's BUDGETS)")
    parser.add_argument("--add_to", default="", help="an earlier call's gpu_check.json to add to")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # inside a part's child process
    args = parser.parse_args()
    if args.part:
        for figures in CHILD_PARTS[args.part](args.dry_run):
            print(json.dumps(figures), flush=True)
        # Every figure is out: end here. On an H200 the generate_static and compile parts' children
        # outlived their last figure by 30 s and more in the interpreter's exit (compile workers).
        sys.stderr.flush()
        os._exit(0)
    if args.dry_run:  # every child on the CPU, also on a GPU machine
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    wanted = args.parts.split(",") if args.parts else list(
        PARTS if args.call == "all" else CALLS[args.call])
    if set(wanted) - set(PARTS + MORE_PARTS):
        sys.exit(f"gpu_check: unknown parts {sorted(set(wanted) - set(PARTS + MORE_PARTS))}; the "
                 f"parts are {', '.join(PARTS + MORE_PARTS)}")
    args.budget = args.budget or BUDGETS[args.call] * (4 if args.dry_run else 1)
    import torch  # this process never touches CUDA: the GPU is the parts'
    card = "CPU" if args.dry_run else card_name()
    if not card:
        sys.exit("gpu_check: no CUDA GPU here (nvidia-smi lists none); --dry_run runs every part "
                 "on the CPU")
    os.makedirs(args.out, exist_ok=True)
    adopt_orphans()
    check = Check(args, card, torch.__version__)
    signal.signal(signal.SIGTERM, check.interrupted)
    signal.signal(signal.SIGINT, check.interrupted)
    check.before = set() if args.dry_run else gpu_pids()
    if args.dry_run:
        check.publish("gpu_branches", dict(status="ok", **gpu_branches()))
    check.run(wanted, args.budget)
    print_table(check.report, check.say)
    shutil.rmtree(check.work, ignore_errors=True)


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
    """The table's rows: (figure, value, goal), the figures the GPU path is judged by; a figure
    never measured reads "missing (...)" with why."""
    parts = report["parts"]

    def missing(part: str) -> str:
        p = parts.get(part)
        if p is None:
            return "missing (not run)"
        return f"missing ({part}: {p.get('status')} at {p.get('seconds', 0):.0f} s)"

    def value(part: str, *keys):
        v = parts.get(part, {})
        for key in keys:
            v = v.get(key) if isinstance(v, dict) else None
        return v

    def get(part: str, *keys, fmt: str = "{:.3g}") -> str:
        v = value(part, *keys)
        if v is None:
            return missing(part)
        return fmt.format(v) if isinstance(v, (int, float)) else str(v)

    def ratio(a, b, fmt="{:.1f}x") -> str:
        return fmt.format(a / b) if a is not None and b else "missing"
    rows = []
    for P in () if "decode" not in parts else ("P8",) if report["dry_run"] else ("P64", "P512"):
        dynamic = value("decode", f"{P} transformers dynamic", "seconds")
        static = value("generate_static", f"{P} transformers static", "seconds")
        best = min((s for s in (dynamic, static) if s is not None), default=None)
        for route in ("engine, compiled + graphs", "engine, graphs"):
            key = f"{P} {route}"
            seconds = value("decode", key, "seconds")
            rows.append((f"decode {P}, {route}: tokens/s, of the copy floor, x generate "
                         "(best; dynamic, static + compile)",
                         f"{get('decode', key, 'decode_tokens_s', fmt='{:,.0f}')}, "
                         f"{get('decode', key, 'floor_share', fmt='{:.0%}')}, "
                         f"{ratio(best, seconds)} ({ratio(dynamic, seconds)}, "
                         f"{ratio(static, seconds)})" if seconds else missing("decode"),
                         ">= 30%, >= 3x" if P == "P64" else ""))
    for name in ("decode", "generate_static"):
        if name in parts:
            rows.append((f"{name} part", f"{parts[name]['status']} in "
                         f"{parts[name].get('seconds', 0):.0f} s", ""))
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
        tflops = value("train", "uniform packed", "tflops")
        if peak:
            rows.append((f"train MFU, packed, of the card's dense bf16 peak ({peak} TFLOP/s)",
                         get("train", "uniform packed", "tflops", fmt="{:.0f} TFLOP/s") +
                         (f" = {tflops / peak:.0%}" if tflops else ""), ""))
        rows.append(("train packed / padded, uniform lengths",
                     get("train", "uniform packed/padded"), "<= 1.0"))
        rows.append(("train packed / padded over the token share, mean 1/3 (micro-batches by "
                     "tokens; by 4 groups)",
                     f"{get('train', 'mean 1/3 packed/padded over share')}; "
                     f"{get('train', 'mean 1/3, 4 groups a micro-batch packed/padded over share')}",
                     "<= 1.2"))
        full = value("train", "step full", "s")
        rows.append(("train step (AdamW included), LoRA all-linear / q,v against full "
                     "fine-tuning: s; resident GB, LoRA all-linear / full; step peak GB, the same",
                     f"{ratio(value('train', 'step lora all', 's'), full, '{:.2f}')} / "
                     f"{ratio(value('train', 'step lora q,v', 's'), full, '{:.2f}')}; " +
                     "; ".join(" / ".join(get("train", f"step {k}", key, fmt="{:.2f}")
                                          for k in ("lora all", "full"))
                               for key in ("resident_gb", "peak_gb")), ""))
    if "compile" in parts:
        rows.append(("first step's compile (s), cold / warm cache",
                     f"{get('compile', 'cold', 'compile_s', fmt='{:.1f}')} / "
                     f"{get('compile', 'warm', 'compile_s', fmt='{:.1f}')}", "<= 20 / <= 5"))
    if "default" in parts:
        d = parts["default"]
        rows.append(("default run: s whole (its status, last step), s a step",
                     f"{d.get('seconds', 0):.0f} ({d['status']}, step {d.get('step')}), "
                     f"{get('default', 'step_s', fmt='{:.3f}')}", "<= 30"))
    if "seeds" in parts:
        s = parts["seeds"]
        runs = (s.get("runs") or {}).values()
        rows.append(("bf16 default, seeds 0-4: held-out correct",
                     f"{s.get('learned', 0)}/{SEEDS} learned ({s['status']}); " + "; ".join(
                         f"{r['verdict']}, eval {r['eval_correct']} at step {r['eval_step']}"
                         for r in runs), "5/5"))
    if "tests" in parts:
        t = parts["tests"]
        failed = t.get("failed", [])
        rows.append(("CUDA tests", f"{t.get('passed', 0)} passed, {len(failed)} failed, "
                     f"{t.get('not_reached')} not reached ({t['status']})"
                     + (": " + ", ".join(failed) if failed else ""), "green"))
        if failed:
            rows.append(("CUDA tests: of those, alone: failed; passed; cut",
                         "; ".join(", ".join(t.get(k, [])) or "none" for k in
                                   ("failed_alone", "passed_alone", "cut_alone")), "none failed"))
    for name, part in parts.items():
        if part.get("left_running"):
            rows.append((f"{name}: still running after it ended", ", ".join(part["left_running"]),
                         "none"))
    return rows


def print_table(report: dict, say=print) -> None:
    say(f"\ngpu_check at {report['commit']} on {report['card']}, torch {report['torch']}"
        f"{' (dry run)' if report['dry_run'] else ''}; every figure in gpu_check.json")
    say("| figure | value | goal |\n|---|---|---|")
    for figure, value, goal in summary(report):
        say(f"| {figure} | {value} | {goal} |")


if __name__ == "__main__":
    main()
