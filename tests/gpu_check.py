"""Where the engine stands on one CUDA GPU, in one call: every figure the GPU path is judged by,
each part in its own process under its own time limit, one table and one JSON.

    python tests/gpu_check.py --out $OUT --commit HASH    # one CUDA GPU, at most 8 minutes
    python tests/gpu_check.py --dry_run --out DIR         # every part on the CPU, tiny shapes

Parts (their seconds in LIMITS; a part past its limit keeps the figures it had reported, and the
rest still run):
- suite: the whole test suite (pytest-xdist when installed), each test under tests/deadline.py's
  --deadline; failures by name, even from a run that was cut, and why (deadline.py says each as it
  happens); then the failed ones again, alone (the seeds run beside the suite: a test that reads
  the device's free memory sees theirs).
- seeds: `train.py --dtype bfloat16` on seeds 0-4 side by side to step 800, beside the suite (their
  held-out accuracy is the figure, not their time).
- decode: the bf16 rollout at Qwen2.5-0.5B's shape, 16 prompts x 8 samples, 256 new tokens, P = 64
  and 512 (tests/bench_limits.py's rollout part): decode tokens/s compiled and captured, and
  captured alone, the share of the copy-bandwidth floor (the bytes a step must read over the copy
  rate measured in the same process), transformers' generate beside them; then the kernels one
  replay of the step's graph launches a layer, compiled and not (tests/bench_rollout.py).
- train: one GRPO forward + backward at the same shape, fp32 master under bf16 autocast, the blocks
  compiled (bench_limits' train part): MFU of the packed, padded and repeated-prompt forwards at
  uniform lengths (64 + 256) against the bf16 matmul rate measured in the same process, and packed
  against padded at a mean of 1/3 of those lengths, as a multiple of their token share.
- compile: the first step's compile seconds with an empty compile cache, then with the cache the
  first left, each in a fresh process (tests/bench_compiling.py).
- default: `python train.py`, the default run, timed whole.
--dry_run runs each part on the CPU at tiny shapes (CUDA hidden from every child; tests/
test_gpu_check.py runs it), so the script works the first time a GPU is lent. OUT/gpu_check.json holds every figure, rewritten after
each part; OUT/<part>.log each part's output; the table at the end has the headline figures.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]

# Seconds per part on a GPU (the suite and the seeds side by side), 8 minutes in all: an H200 ran
# 439 tests in 190 s beside the seeds, 0.5B-shaped train steps in 70 s, the default run eagerly at
# ~0.04 s a step.
LIMITS = dict(suite=200, alone=40, seeds=200, decode=100, train=60, compile=60, default=40)
DRY_LIMITS = dict(suite=120, alone=60, seeds=120, decode=120, train=120, compile=180, default=120)
SHAPE = "Qwen2.5-0.5B"

# -----------------------------------------------------------------------------
# Parts run in a child process: each yields its figures so far (printed as a JSON line each time,
# so a part cut by its limit still reports what it measured)


def part_decode(dry: bool):
    import bench_limits
    from bench_rollout import kernels_per_layer
    import torch
    if dry:
        bench_limits.BP, bench_limits.G, bench_limits.NEW = 2, 2, 8
    device = "cpu" if dry else "cuda"
    lim = bench_limits.limits()
    out = dict(copy_gb_s=lim["copy"])
    # The captured step first (no compile: a figure even if the compile outruns the part), then
    # compiled and captured (the default on a GPU for this shape), then transformers' generate.
    routes = ("engine, graphs", "engine, compiled + graphs")
    for P in (8,) if dry else (64, 512):
        bench_limits.P = P
        for i, route in enumerate(routes):
            for row in bench_limits.rollout_part("tiny" if dry else SHAPE, lim, device, (route,),
                                                 transformers=i == len(routes) - 1):
                out[f"P{P} {row['route']}"] = {k: v for k, v in row.items()
                                               if k not in ("shape", "P", "route")}
            out[f"P{P}"] = out[f"P{P} {route}"]  # the last route measured: the default's
            yield out
    # Kernels a layer of one graph replay (on the CPU: launches of the eager step; compiling it
    # there costs minutes, it is tests/test_graphs.py's)
    for route in ("bf16 kernel",) if dry else ("bf16 kernel", "bf16 kernel, compiled"):
        per_layer, rest, _ = kernels_per_layer(route, torch.device(device), "" if dry else SHAPE)
        out[f"kernels {route}"] = dict(per_layer=per_layer, rest=rest)
        out["kernels_per_layer"] = per_layer
        yield out


def part_train(dry: bool):
    import bench_limits
    if dry:  # the tests' tiny model on the CPU, a small batch
        bench_limits.BP, bench_limits.G, bench_limits.P, bench_limits.NEW = 4, 2, 8, 16
    rows = bench_limits.train_part("tiny" if dry else SHAPE, bench_limits.limits(),
                                   device="cpu" if dry else "cuda", compile=not dry,
                                   repeats=1 if dry else 3)
    out = {f"{r['lengths']} {r['forward']}": dict(s=r["seconds"], mfu=r["mfu"]) for r in rows}
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
    if dry:  # aot_eager: the same processes and graphs, no code generated
        yield from bench_compiling.cold_then_warm("tiny", 2, 2, 8, 8, rounds=1,
                                                  backend="aot_eager")
    else:
        yield from bench_compiling.cold_then_warm(SHAPE, 16, 8, 64, 256, rounds=2)


PARTS = dict(decode=part_decode, train=part_train, compile=part_compile)

# -----------------------------------------------------------------------------
# Parts run as whole commands: the suite, train.py's runs


def train_py(args: list[str], out: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), "--out", out, *args]


def last_record(out: str) -> dict:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[-1] if lines else {}


def suite_command(dry: bool, tests: list[str] | None = None) -> list[str]:
    """The suite (dry: one small file), or `tests` by id, one at a time."""
    cmd = [sys.executable, "-m", "pytest", "-p", "deadline", "--deadline", "150", "-rfE", "-v",
           "-p", "no:cacheprovider"]
    if tests:
        return cmd + tests
    try:
        import xdist  # noqa: F401 (pytest-xdist: -n)
        cmd += ["-n", "2" if dry else "10"]
    except ImportError:
        pass
    return cmd + ([os.path.join(TESTS, "test_plot.py")] if dry else [TESTS])


def suite_figures(log: str) -> dict:
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


def seeds_commands(dry: bool, out: str) -> dict[int, list[str]]:
    steps = ["--steps", "2", "--eval_every", "2", "--save_every", "0"] if dry else []
    return {seed: train_py(["--dtype", "bfloat16", "--seed", str(seed), *steps],
                           os.path.join(out, f"seed{seed}")) for seed in range(5)}

# -----------------------------------------------------------------------------
# The driver


def run_command(cmd: list[str], limit: float, log: str) -> tuple[str, float]:
    """(status, seconds): ok, error N (the exit code) or timeout; the output goes to `log`."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS,
                                                        os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "timeout", time.perf_counter() - start
    return ("ok" if code == 0 else f"error {code}"), time.perf_counter() - start


def last_json(log: str) -> dict:
    """The last figures a part's child printed (one JSON object a line)."""
    with open(log) as f:
        lines = [line for line in f if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def suite_and_seeds(args, limits: dict, wanted: list[str], save) -> None:
    """The suite, with the five bf16 seeds running beside it."""
    started = time.perf_counter()
    seeds = seeds_commands(args.dry_run, os.path.join(args.out, "seeds")) if (
        "seeds" in wanted) else {}
    procs = {}
    for seed, cmd in seeds.items():
        with open(os.path.join(args.out, f"seed{seed}.log"), "w") as log:
            procs[seed] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if "suite" in wanted:
        log = os.path.join(args.out, "suite.log")
        status, seconds = run_command(suite_command(args.dry_run), limits["suite"], log)
        with open(log) as f:
            figures = dict(status=status, seconds=seconds, **suite_figures(f.read()))
        if figures["failed"]:  # again, one at a time
            alone = os.path.join(args.out, "alone.log")
            run_command(suite_command(args.dry_run, figures["failed"]), limits["alone"], alone)
            with open(alone) as f:
                figures["failed_alone"] = suite_figures(f.read())["failed"]
        save("suite", figures)
    finals = {}
    for seed, proc in procs.items():
        try:
            proc.wait(timeout=max(1.0, limits["seeds"] - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        record = last_record(os.path.join(args.out, "seeds", f"seed{seed}"))
        finals[seed] = dict(code=proc.returncode, step=record.get("step"),
                            eval_correct=record.get("eval_correct"))
    if procs:
        learned = sum((f["eval_correct"] or 0) >= 0.9 for f in finals.values())
        save("seeds", dict(seconds=time.perf_counter() - started, learned=learned, runs=finals))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check"))
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the record")
    parser.add_argument("--parts", default="suite,seeds,decode,train,compile,default")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # inside a part's child process
    args = parser.parse_args()
    if args.part:
        for figures in PARTS[args.part](args.dry_run):
            print(json.dumps(figures), flush=True)
        return
    if args.dry_run:  # every child on the CPU, also on a GPU machine
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU here; --dry_run runs every part on the CPU")
    os.makedirs(args.out, exist_ok=True)
    limits = DRY_LIMITS if args.dry_run else LIMITS
    wanted = args.parts.split(",")
    report = dict(commit=args.commit, torch=torch.__version__, dry_run=args.dry_run,
                  card=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
                  parts={})

    def save(name: str, figures: dict) -> None:
        report["parts"][name] = figures
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"{name}: {json.dumps(figures)[:400]}", flush=True)

    if "suite" in wanted or "seeds" in wanted:
        suite_and_seeds(args, limits, wanted, save)
    for name in PARTS:
        if name in wanted:
            log = os.path.join(args.out, f"{name}.log")
            cmd = [sys.executable, __file__, "--part", name] + ["--dry_run"] * args.dry_run
            status, seconds = run_command(cmd, limits[name], log)
            save(name, dict(status=status, seconds=seconds, **last_json(log)))
    if "default" in wanted:
        run_out = os.path.join(args.out, "default")
        steps = ["--steps", "3", "--eval_every", "0", "--save_every", "0"] if args.dry_run else []
        status, seconds = run_command(train_py(steps, run_out), limits["default"],
                                      os.path.join(args.out, "default.log"))
        record = last_record(run_out)
        save("default", dict(status=status, seconds=seconds, step=record.get("step"),
                             eval_correct=record.get("eval_correct")))
    print_table(report)

# -----------------------------------------------------------------------------
# The table


def summary(parts: dict) -> list[tuple[str, str, str]]:
    """The table's rows: (figure, value, goal), the figures the GPU path is judged by."""
    def get(part: str, *keys, fmt: str = "{:.3g}") -> str:
        value = parts.get(part, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            return parts.get(part, {}).get("status", "not run")
        return fmt.format(value) if isinstance(value, (int, float)) else str(value)
    rows = []
    if "suite" in parts:
        suite = parts["suite"]
        failed = suite["failed"]
        rows.append(("suite", f"{suite['passed']} passed, {len(failed)} failed ({suite['status']})"
                     + (": " + ", ".join(failed) if failed else ""), "green"))
        if failed:
            rows.append(("suite: of those, failed again alone",
                         ", ".join(suite.get("failed_alone", ["not run"])) or "none", "none"))
    if "seeds" in parts:
        finals = [r["eval_correct"] for r in parts["seeds"]["runs"].values()]
        rows.append(("bf16 default, seeds 0-4: held-out correct",
                     f"{parts['seeds']['learned']}/5 >= 0.9 {finals}", "5/5"))
    for P in ("P64", "P512", "P8"):
        if P in parts.get("decode", {}):
            rows.append((f"decode {P}: tokens/s, of the copy floor, x generate",
                         f"{get('decode', P, 'decode_tokens_s', fmt='{:,.0f}')}, "
                         f"{get('decode', P, 'floor_share', fmt='{:.0%}')}, "
                         f"{get('decode', P, 'over_generate', fmt='{:.1f}x')}",
                         ">= 30%, ~20x" if P == "P64" else ""))
    if "decode" in parts:
        rows.append(("decode: kernels a layer of the graphed step",
                     get("decode", "kernels_per_layer"), "<= 12"))
    if "train" in parts:
        rows.append(("train MFU at uniform lengths: packed, padded, repeated prompt",
                     ", ".join(get("train", f"uniform {f}", "mfu", fmt="{:.0%}")
                               for f in ("packed", "padded", "naive")), ">= 35%"))
        rows.append(("train packed / padded, uniform lengths",
                     get("train", "uniform packed/padded"), "<= 1.0"))
        rows.append(("train packed / padded over the token share, mean 1/3",
                     get("train", "mean 1/3 packed/padded over share"), "<= 1.2"))
    if "compile" in parts:
        rows.append(("first step's compile (s), cold / warm cache",
                     f"{get('compile', 'cold', 'compile_s', fmt='{:.1f}')} / "
                     f"{get('compile', 'warm', 'compile_s', fmt='{:.1f}')}", "<= 20 / <= 5"))
    if "default" in parts:
        rows.append(("default run (s)", f"{get('default', 'seconds', fmt='{:.0f}')} "
                     f"({parts['default']['status']})", "<= 30"))
    return rows


def print_table(report: dict) -> None:
    print(f"\ngpu_check at {report['commit']} on {report['card']}, torch {report['torch']}"
          f"{' (dry run)' if report['dry_run'] else ''}; every figure in gpu_check.json")
    print("| figure | value | goal |\n|---|---|---|")
    for figure, value, goal in summary(report["parts"]):
        print(f"| {figure} | {value} | {goal} |")


if __name__ == "__main__":
    main()
