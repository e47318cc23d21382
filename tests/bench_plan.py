"""Where every byte of one GRPO step goes, phase by phase, next to the memory plan.

The configuration is tests/bench_trl.py's (a random Llama, dim 256, 4 layers, 8/4 heads, ffn 704,
vocab 16, tied; 16 prompts of exactly P tokens x G = 8 samples x C = 32 new tokens, no early stop,
1 thread), run through train.py's own setup() and step(); any other train.py flag may be given and
is passed on (e.g. --micro_batch_groups 16 --activation_checkpoint false --sampler_dtype bfloat16
--beta 0.04). Each configuration runs twice, each time in a fresh process, `--steps` steps:

- allocator bytes: torch.profiler's memory events (profile_memory=True; every CPU allocation and
  free through torch's allocator, in order) from just after the imports, so their running sum is
  every live tensor byte: the CPU analogue of torch.cuda.memory_allocated, and its maximum of
  max_memory_allocated.
- RSS: the process's resident set over the post-import baseline, the peak of each phase read from
  /proc/self/status's VmHWM and reset (/proc/self/clear_refs) at every phase boundary (Linux).

A phase is the innermost of these functions running: rollout (weight sync, prefill, decode,
sampling, the rest of generate), old and reference logprobs (grpo.batch_logprobs), train (forward:
grpo.accumulate; loss: grpo.grpo_loss; backward: Tensor.backward; optimizer: the rest of
train.train_phase, i.e. clipping and AdamW's step), PhaseManager's enter/exit, and other (rewards,
prompts). A function-call hook (sys.setprofile) marks the boundaries; in the profiled process each
phase is also a torch.profiler.record_function range.

Below the table: train.py --plan with the same flags, and its peak against the measured one.

Below the table: the bytes the completions' attention over the shared prompt saves for backward
as K/V copied per row and as masks (0 with attention.SharedPromptAttentionPadded; --repeated_prompt runs
its repeated-prompt twin instead, the baseline of that row).

Run: python tests/bench_plan.py [--P 64,512] [--steps 2] [--repeated_prompt] [--model DIR]
[train.py flags ...] (about a minute for P = 64 and three for P = 512 on the shared 2-core CPU).
--model DIR: a Hugging Face checkpoint instead of the random tiny one (bench_trl.link_checkpoint:
no early stop), e.g. SmolLM2-135M-Instruct with --prompts_per_step 4 (minutes per step there).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, ROOT)
sys.path.insert(0, TESTS)

# -----------------------------------------------------------------------------
# Phases: which function is running, told by a function-call hook


def phase_of(run) -> dict:
    """code object -> function(frame, parent label) -> the label of the phase it starts."""
    import grpo
    import memory
    import rollout
    from engine import sampling
    import torch
    import train

    def fixed(label: str):
        return lambda frame, parent: label

    def logprobs(frame, parent):
        return "ref logprobs" if frame.f_locals.get("model") is run.reference else "old logprobs"
    table = {
        train.step: fixed("other"),
        memory.PhaseManager.enter: fixed("phase switch"),
        memory.PhaseManager.exit: fixed("phase switch"),
        rollout.sync_weights: fixed("rollout: weight sync"),
        rollout.generate: fixed("rollout: other"),
        rollout._prefill: fixed("rollout: prefill"),
        rollout._decode: fixed("rollout: decode"),
        sampling.draw: fixed("rollout: sampling"),
        grpo.batch_logprobs: logprobs,
        train.train_phase: fixed("train: optimizer"),
        grpo.accumulate: fixed("train: forward"),
        grpo.grpo_loss: fixed("train: loss"),
        torch.Tensor.backward: fixed("train: backward"),
    }
    return {getattr(f, "__wrapped__", f).__code__: label for f, label in table.items()}


class PhaseTracer:
    """sys.setprofile hook: a stack of the watched functions running; `changed(old, new)` is called
    whenever the innermost one changes."""

    def __init__(self, watch: dict, changed):
        self.watch = watch
        self.changed = changed
        self.stack: list[tuple[object, str]] = []  # (frame, label)

    @property
    def label(self) -> str:
        return self.stack[-1][1] if self.stack else "other"

    def hook(self, frame, event, arg):
        if event == "call":
            labeller = self.watch.get(frame.f_code)
            if labeller is not None:
                old = self.label
                self.stack.append((frame, labeller(frame, old)))
                self.changed(old, self.label)
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            old = self.label
            self.stack.pop()
            self.changed(old, self.label)

    def __enter__(self):
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

# -----------------------------------------------------------------------------
# The two measurements (child processes)


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class RSSPeaks:
    """Peak RSS of each phase: VmHWM read and reset at every boundary."""

    def __init__(self):
        self.peaks: dict[str, int] = {}
        self.step = 0

    def _reset(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)

    def changed(self, old: str, new: str):
        key = f"{self.step}|{old}"
        self.peaks[key] = max(self.peaks.get(key, 0), rss_kib("VmHWM"))
        self._reset()


class AllocRanges:
    """One torch.profiler.record_function range per phase segment."""

    def __init__(self):
        from torch.profiler import record_function
        self.record_function = record_function
        self.current = None
        self.step = 0

    def changed(self, old: str, new: str):
        if self.current is not None:
            self.current.__exit__(None, None, None)
        self.current = self.record_function(f"phase|{self.step}|{new}")
        self.current.__enter__()


def alloc_peaks(trace_file: str) -> tuple[dict[str, int], dict[str, int], int]:
    """From a chrome trace: the max running sum of allocator bytes within each phase range
    ("step|label"), the sum at each range's first start, and the overall max."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"].split("|", 1)[1])
                    for e in events if str(e.get("name", "")).startswith("phase|"))
    memory = sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]")
    peaks: dict[str, int] = {}
    starts: dict[str, int] = {}
    running = 0
    overall = 0
    i = 0
    label = "0|setup"
    for ts, nbytes in memory:
        while i < len(ranges) and ranges[i][0] <= ts:
            label = ranges[i][2]
            starts.setdefault(label, running)
            peaks[label] = max(peaks.get(label, 0), running)
            i += 1
        running += nbytes
        overall = max(overall, running)
        peaks[label] = max(peaks.get(label, 0), running)
    return peaks, starts, overall


class AttentionSaves:
    """Bytes the completions' prompt attention saves for backward, summed over the layers of a
    micro-batch (the largest micro-batch kept): keys and values longer than the row's own tokens
    (the prompt's K/V copied per row) and masks (bool or additive, one head wide). `repeated`
    runs the repeated-prompt twin (attention.shared_prompt_attention_repeated) in place of
    attention.SharedPromptAttentionPadded."""

    def __init__(self, repeated: bool):
        from engine import packing
        self.totals = {"prompt K/V per row": 0, "mask": 0}
        self.current = dict(self.totals)
        packing.CPU_FLASH = packing.CPU_FLASH and not repeated
        build = packing.padded_rows_attention

        def counted(*args, **kwargs):
            attend = build(*args, **kwargs)
            self.current = {k: 0 for k in self.totals}

            def hooked(q, k, v, pk, pv):
                import torch
                # detach: the saved tensor itself (an output saved by its own node) would make a
                # cycle that only the garbage collector frees
                with torch.autograd.graph.saved_tensors_hooks(
                        lambda t: self.count(t, q.shape) or t.detach(), lambda t: t):
                    return attend(q, k, v, pk, pv)
            return hooked
        packing.padded_rows_attention = counted

    def count(self, t, q_shape) -> None:
        N, _, T, _ = q_shape
        if t.dim() == 4 and t.shape[1] == 1:  # a mask or additive bias, broadcast over heads
            self.current["mask"] += t.numel() * t.element_size()
        elif t.dim() == 4 and t.shape[0] == N and t.shape[2] > T:  # (N, Hkv, P + T, D)
            self.current["prompt K/V per row"] += t.numel() * t.element_size()
        for k in self.totals:
            self.totals[k] = max(self.totals[k], self.current[k])


def worker(mode: str, values: dict, steps: int, out_file: str, repeated: bool) -> None:
    import torch
    import torch._dynamo  # noqa: F401  torch.optim's Optimizer() imports it (sympy, +68 MiB RSS)
    import train
    torch.set_num_threads(1)
    saves = AttentionSaves(repeated)
    baseline = rss_kib("VmRSS")
    result = dict(baseline_kib=baseline, baseline_file_kib=rss_kib("RssFile"))
    if mode == "alloc":
        from torch.profiler import ProfilerActivity, profile
        recorder = AllocRanges()
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
    else:
        recorder = RSSPeaks()
        recorder.changed("setup", "setup")  # resets VmHWM: the setup's peak is read next
    run = train.setup(values)
    if mode == "rss":
        recorder.changed("setup", "other")
    cpu_seconds = []
    with PhaseTracer(phase_of(run), recorder.changed):
        for i in range(steps):
            recorder.step = i + 1
            start = time.process_time()
            train.step(run, i)
            cpu_seconds.append(time.process_time() - start)
    result["cpu_seconds"] = cpu_seconds
    result["attention_saves"] = saves.totals
    result["tags"] = {p: dict(t) for p, t in run.mem.phase_bytes.items()}
    if mode == "alloc":
        if recorder.current is not None:
            recorder.current.__exit__(None, None, None)
        prof.__exit__(None, None, None)
        trace = out_file + ".trace.json"
        prof.export_chrome_trace(trace)
        peaks, starts, overall = alloc_peaks(trace)
        if not os.environ.get("BENCH_PLAN_KEEP_TRACE"):
            os.remove(trace)
        result.update(peaks=peaks, starts=starts, overall=overall)
    else:
        recorder.changed("end", "end")
        # NOTE: clear_refs resets ru_maxrss too: the run's peak is the largest phase peak.
        result.update(peaks=recorder.peaks, file_kib=rss_kib("RssFile"),
                      maxrss_kib=max(recorder.peaks.values()))
    with open(out_file, "w") as f:
        json.dump(result, f)

# -----------------------------------------------------------------------------
# The parent: one configuration, both measurements, the table


PHASES = ["other", "phase switch", "rollout: weight sync", "rollout: prefill",
          "rollout: decode", "rollout: sampling", "rollout: other", "old logprobs",
          "ref logprobs", "train: forward", "train: loss", "train: backward",
          "train: optimizer"]


def run_worker(mode: str, train_args: list[str], steps: int, work: str, repeated: bool) -> dict:
    out_file = os.path.join(work, f"{mode}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(steps),
           "--result", out_file, *["--repeated_prompt"] * repeated, "--", *train_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(out_file) as f:
        return json.load(f)


def print_table(alloc: dict, rss: dict, steps: int) -> None:
    mb = 1e6
    print(f"{'phase':<22}" + "".join(f"{'step ' + str(s) + ' alloc/peak/RSS':>28}"
                                     for s in range(1, steps + 1)))
    for label in PHASES:
        cells = []
        for s in range(1, steps + 1):
            key = f"{s}|{label}"
            if key not in alloc["peaks"] and key not in rss["peaks"]:
                cells.append(f"{'-':>28}")
                continue
            start = alloc["starts"].get(key, 0) / mb
            peak = alloc["peaks"].get(key, 0) / mb
            r = (rss["peaks"].get(key, 0) - rss["baseline_kib"]) / 1024
            cells.append(f"{start:>10.1f}{peak:>9.1f}{r:>9.1f}")
        print(f"{label:<22}" + "".join(cells))
    setup_rss = (rss["peaks"].get("0|setup", 0) - rss["baseline_kib"]) / 1024
    print(f"setup: allocator peak {alloc['peaks'].get('0|setup', 0) / mb:.1f} MB, "
          f"RSS peak over baseline {setup_rss:.1f} MiB")
    print(f"overall: allocator peak {alloc['overall'] / mb:.1f} MB, peak RSS over baseline "
          f"{(rss['maxrss_kib'] - rss['baseline_kib']) / 1024:.1f} MiB "
          f"(baseline {rss['baseline_kib'] / 1024:.0f} MiB; of the excess, file-backed pages "
          f"(library code) {(rss['file_kib'] - rss['baseline_file_kib']) / 1024:.1f} MiB)")
    print(f"CPU seconds per step (RSS run, no profiler): "
          f"{' '.join(f'{t:.2f}' for t in rss['cpu_seconds'])}")
    print("saved for backward by the completions' prompt attention, one micro-batch, all layers: "
          + ", ".join(f"{k} {b / mb:.1f} MB" for k, b in alloc["attention_saves"].items()))
    print("tags resident (MB): " + "; ".join(
        f"{p}: " + ", ".join(f"{t} {b / mb:.1f}" for t, b in tags.items() if b)
        for p, tags in alloc["tags"].items()))


def print_plan(train_args: list[str], measured: int) -> None:
    """train.py --plan with the same flags, and its peak against the measured allocator peak."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *train_args, "--plan"],
                         check=True, env=env, cwd=ROOT, capture_output=True, text=True).stdout
    print(out, end="")
    rows = [line.split() for line in out.splitlines()[2:-1]]
    planned = max(float(row[-1].replace(",", "")) for row in rows) * 1e6
    print(f"plan vs measured allocator peak: {planned / 1e6:.1f} vs {measured / 1e6:.1f} MB "
          f"({100 * (planned - measured) / measured:+.1f}%)")


def main() -> None:
    own, train_args = split_args(sys.argv[1:])
    if own.worker:
        import train
        worker(own.worker, train.parse_args(train_args), own.steps, own.result,
               own.repeated_prompt)
        return
    import bench_trl
    work = tempfile.mkdtemp(prefix="bench_plan_")
    model_dir = os.path.join(work, "model")
    if own.model:
        bench_trl.link_checkpoint(own.model, model_dir)
    else:
        bench_trl.write_checkpoint(model_dir)
    for P in own.P:
        prompts = os.path.join(work, f"prompts_{P}.json")
        bench_trl.write_prompts(prompts, P)
        flags = dict(model=model_dir, task="bench_trl:bench_task", task_data=prompts,
                     prompts_per_step=bench_trl.PROMPTS, num_samples=bench_trl.G,
                     max_new_tokens=bench_trl.C, max_prompt_len=P, lr=bench_trl.LR, threads=1,
                     micro_batch_groups=1, activation_checkpoint="true", eval_every=0,
                     out=os.path.join(work, "out"), overwrite="true", save_every=0)
        args = [f"--{k}={v}" for k, v in flags.items()] + train_args
        print(f"\nP = {P}: {' '.join(train_args) or '(bench_trl defaults)'}", flush=True)
        alloc = run_worker("alloc", args, own.steps, work, own.repeated_prompt)
        rss = run_worker("rss", args, own.steps, work, own.repeated_prompt)
        print_table(alloc, rss, own.steps)
        print_plan(args, alloc["overall"])


def split_args(argv: list[str]):
    parser = argparse.ArgumentParser(add_help=True)
    parser.add_argument("--P", default="64,512")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model", default="", help="a Hugging Face checkpoint directory")
    parser.add_argument("--worker", choices=("alloc", "rss"))
    parser.add_argument("--result")
    parser.add_argument("--repeated_prompt", action="store_true",
                        help="train with the repeated-prompt twin (the baseline of the default)")
    own, rest = parser.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    own.P = [int(p) for p in own.P.split(",")]
    return own, rest


if __name__ == "__main__":
    main()
