"""Does the default recipe learn? `python train.py` over tasks x seeds, a table and a picture each.

Each run is a fresh `python train.py --task tasks:<task> --seed <s> --out <out>/<task>/seed<s>` (plus
--flags) with one thread, `--jobs` at a time (2 on a 2-core machine). A run whose directory already
holds a finished run with the same command line is reused, not repeated (--force repeats it). Then
one row per task x seed:

    first / last   mean reward of the first and the last 10% of steps, and last / first
    entropy        mean entropy of the last 10% of steps (sampled tokens, nats)
    zero_std       share of groups with all-equal rewards (no gradient) in the last 10% of steps,
                   where the records have it
    eval / correct the last held-out evaluation (greedy): mean reward, share fully correct
    to_0.9         first step where the mean reward over the last 10 steps reaches 0.9
    ent<0.5 @      first step where the mean entropy over the last 10 steps is below 0.5 nats
                   (the policy is nearly deterministic), and the mean reward over those steps:
                   what the run had learned when it stopped exploring
    wall_s         seconds of the whole process (setup, evaluations and checkpoint included)
    target         the bar: reverse reaches 0.9 in under 600 s; any other task ends at
                   >= 0.5 and >= 2x its start (last >= max(0.5, 2 * first))

and <out>/<task>.svg with the task's seeds (run/plot.py). Tables are Markdown, to paste as they are.

Variants side by side: each `--variant NAME="FLAGS"` runs every task x seed again with FLAGS added
(in <out>/NAME/...), and one more table compares them per task: last 10% reward per seed and its
mean, to_0.9 per seed, zero_std, extra rollouts per step (dynamic sampling), wall clock. E.g. the
GRPO family against the default:

    python tests/bench_learning.py --tasks reverse,sort,increment --seeds 0,1,2 \
        --variant default= --variant gspo="--importance_sampling_level sequence --loss_type grpo" \
        --variant cispo="--loss_type cispo --eps_high 5" --variant dynamic="--dynamic_sampling 4"

Where the stop goes (--probe): one run in this process, and every 10 steps, on 64 fixed prompts of
the task with their right answers teacher-forced, the model's mean P(stop) right after the answer,
its mean P(stop) inside the answer (after each shorter right prefix), and its mean P(the right next
token) inside the answer: whether the model tells the answer's end from its middle.

Run: python tests/bench_learning.py --tasks reverse,double,sort,count,increment,add --seeds 0,1,2
     [--flags "--lr 5e-4"] [--steps N] [--jobs 2] [--out runs/learning/NAME] [--force] [--report]
     [--variant NAME="FLAGS" ...]
     python tests/bench_learning.py --supervised 1000   (can the fresh model hold each task at all?)
     python tests/bench_learning.py --probe stars [--flags "--entropy_coef 0"] [--steps 300]
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from run import plot  # noqa: E402

# -----------------------------------------------------------------------------
# Running


def task_spec(name: str) -> str:
    return name if ":" in name else f"tasks:{name}"


def command(task: str, seed: int, out: str, flags: list[str]) -> list[str]:
    return ["--task", task_spec(task), "--seed", str(seed), "--out", out, "--overwrite", "true",
            "--save_every", "0", "--threads", "1", *flags]


def finished(out: str, argv: list[str]) -> bool:
    """The directory holds a run of this same command line that ran to its end."""
    try:
        with open(os.path.join(out, "run.json")) as f:
            info = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return info.get("argv") == argv and info.get("returncode") == 0


def run_one(task: str, seed: int, out: str, flags: list[str], force: bool) -> str:
    """One training process; its wall clock and command line go to out/run.json."""
    argv = command(task, seed, out, flags)
    if finished(out, argv) and not force:
        return f"{out}: reused"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    t0 = time.perf_counter()
    with open(out + ".log", "w") as log:  # beside the run: train.py owns the directory
        done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], cwd=ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    os.makedirs(out, exist_ok=True)  # a run that failed at its first step wrote nothing
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(dict(argv=argv, wall_s=wall, returncode=done.returncode), f)
    return f"{out}: exit {done.returncode} in {wall:.0f} s"

# -----------------------------------------------------------------------------
# Summaries


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def first_step(records: list[dict], key: str, reached) -> int | None:
    """The first step where the mean of key over the last 10 records satisfies reached."""
    values = [(r["step"], r.get(key)) for r in records]
    for i in range(10, len(values) + 1):
        window = [v for _, v in values[i - 10:i] if v is not None]
        if window and reached(sum(window) / len(window)):
            return values[i - 1][0]
    return None


def summary(out: str, task: str) -> dict:
    """The table's numbers for one run directory (None where a run has no such record)."""
    records = plot.read_metrics(out)
    tenth = max(1, len(records) // 10)
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    first = mean([r["reward"] for r in records[:tenth] if r.get("reward") is not None])
    last = mean([r["reward"] for r in records[-tenth:] if r.get("reward") is not None])
    evals = [r for r in records if r.get("eval_reward") is not None]
    to_target = first_step(records, "reward", lambda m: m >= 0.9)
    frozen = first_step(records, "entropy", lambda m: m < 0.5)
    frozen_reward = None
    if frozen is not None:
        window = [r for r in records if frozen - 10 < r["step"] <= frozen]
        frozen_reward = mean([r["reward"] for r in window if r.get("reward") is not None])
    with open(os.path.join(out, "run.json")) as f:
        wall = json.load(f)["wall_s"]
    row = dict(first=first, last=last, ratio=last / first if first and last is not None else None,
               entropy=mean([r["entropy"] for r in records[-tenth:] if r.get("entropy") is not None]),
               zero_std=mean([r["zero_std"] for r in records[-tenth:]
                              if r.get("zero_std") is not None]),
               eval=evals[-1]["eval_reward"] if evals else None,
               correct=evals[-1].get("eval_correct") if evals else None,
               to_target=to_target, frozen=frozen, frozen_reward=frozen_reward, wall=wall,
               steps=len(records),
               extra=mean([r["extra_rollouts"] for r in records if "extra_rollouts" in r]))
    if task == "reverse":
        row["target"] = to_target is not None and wall < 600
    else:
        row["target"] = last is not None and first is not None and last >= max(0.5, 2 * first)
    return row


def cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[tuple[str, int, dict]]) -> None:
    print("| task | seed | first | last | last/first | entropy | zero_std | eval | correct | "
          "to_0.9 | ent<0.5 @ | reward then | wall_s | target |")
    print("|" + "---|" * 14)
    for task, seed, r in rows:
        print(f"| {task} | {seed} | {cell(r['first'], '.3f')} | {cell(r['last'], '.3f')} | "
              f"{cell(r['ratio'], '.2f')} | {cell(r['entropy'], '.3f')} | "
              f"{cell(r['zero_std'], '.2f')} | {cell(r['eval'], '.3f')} | "
              f"{cell(r['correct'], '.2f')} | {cell(r['to_target'], 'd')} | "
              f"{cell(r['frozen'], 'd')} | {cell(r['frozen_reward'], '.3f')} | "
              f"{r['wall']:.0f} | {'yes' if r['target'] else 'no'} |")
    by_task: dict[str, list[dict]] = {}
    for task, _, r in rows:
        by_task.setdefault(task, []).append(r)
    print()
    for task, runs in by_task.items():
        passed = sum(r["target"] for r in runs)
        print(f"{task}: target met on {passed}/{len(runs)} seeds; last 10% mean reward "
              f"{cell(mean([r['last'] for r in runs if r['last'] is not None]), '.3f')}")

def print_variants(rows: list[tuple[str, str, int, dict]], variants: list[str]) -> None:
    """One row per task x variant, side by side."""
    print("| task | variant | last 10% reward per seed | mean | to_0.9 per seed | zero_std | "
          "extra rollouts / step | wall_s (mean) |")
    print("|" + "---|" * 8)
    tasks = list(dict.fromkeys(task for task, *_ in rows))
    for task in tasks:
        for name in variants:
            runs = [r for t, v, _, r in rows if t == task and v == name]
            if not runs:
                continue
            lasts = [r["last"] for r in runs]
            print(f"| {task} | {name} | {' '.join(cell(x, '.3f') for x in lasts)} | "
                  f"{cell(mean([x for x in lasts if x is not None]), '.3f')} | "
                  f"{' '.join(cell(r['to_target'], 'd') for r in runs)} | "
                  f"{cell(mean([r['zero_std'] for r in runs if r['zero_std'] is not None]), '.2f')}"
                  f" | {cell(mean([r['extra'] for r in runs if r['extra'] is not None]), '.2f')} | "
                  f"{mean([r['wall'] for r in runs]):.0f} |")

# -----------------------------------------------------------------------------
# Capacity: can the default fresh model hold the task at all? (teacher forcing, no RL)


def supervised(name: str, steps: int, seed: int = 0) -> tuple[float, float]:
    """The default fresh model (run/models.py's build_model) trained by cross-entropy on prompt ->
    answer<eos>, batches of 64 new pairs, AdamW 1e-3; returns the share of 256 new prompts whose
    greedy completion is fully correct, and the seconds it took."""
    import random
    import torch
    import grpo
    import rollout
    import tasks
    import tp
    import train
    t0 = time.perf_counter()
    task = tasks.load_task(task_spec(name), "")
    cfg = train.TrainConfig(seed=seed)
    model, tokenizer = train.models.build_model(cfg, task, "", torch.device("cpu"),
                                                tp.make_groups(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    bos = model.config.bos_token_id
    eos = model.config.eos_token_id
    rng = random.Random(seed)

    def encode(text: str) -> list[int]:
        return tokenizer.encode_text(text, add_special_tokens=False)
    for _ in range(steps):
        pairs = [task.sample(rng) for _ in range(64)]
        prompts = [[bos] + encode(prompt) for prompt, _ in pairs]
        answers = [encode(answer) + [eos] for _, answer in pairs]
        ids, lens = grpo.pad_right([p + a for p, a in zip(prompts, answers)], torch.device("cpu"))
        logits = model.head(model.hidden(ids[:, :-1]))  # (B, T-1, V)
        position = torch.arange(ids.shape[1] - 1)
        starts = torch.tensor([len(p) - 1 for p in prompts])
        answer = (position >= starts[:, None]) & (position < lens[:, None] - 1)  # (B, T-1)
        loss = torch.nn.functional.cross_entropy(logits[answer], ids[:, 1:][answer])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    pairs = [task.sample(rng) for _ in range(256)]
    greedy = rollout.RolloutConfig(num_samples=1, temperature=0.0,
                                   max_new_tokens=task.max_new_tokens)
    with torch.no_grad():
        out = rollout.generate(model, [[bos] + encode(p) for p, _ in pairs], greedy,
                               stop_ids=(eos,))
    texts = [tokenizer.decode(t[:-1] if stopped else t, skip_special_tokens=False)
             for t, stopped in zip(out.completions(), out.stopped.tolist())]
    right = sum(bool(task.correct(t, r)) for t, (_, r) in zip(texts, pairs))
    return right / len(pairs), time.perf_counter() - t0

# -----------------------------------------------------------------------------
# Where the stop goes: P(stop) at the answer's end against inside it, as training runs


def stop_probabilities(run, examples: list[tuple]) -> dict[str, float]:
    """Mean P(stop | prompt + right answer), P(stop | prompt + a shorter right prefix) and
    P(right next token | prompt + right prefix) of the run's model over the examples."""
    import torch
    stop = run.model.config.eos_token_id
    sums = {"end": 0.0, "inside": 0.0, "right": 0.0}
    inside = 0
    with torch.no_grad():
        for prompt, reference in examples:
            ids, _ = run.tokenizer.encode_prompts([prompt], run.cfgs.prompt, 256)
            answer = run.tokenizer.encode_text(reference, add_special_tokens=False)
            logp = run.model(torch.tensor([ids[0] + answer]))[0].float().log_softmax(-1)
            at = len(ids[0]) - 1  # the state predicting the answer's first token
            sums["end"] += logp[at + len(answer), stop].exp().item()
            for t, token in enumerate(answer):
                sums["inside"] += logp[at + t, stop].exp().item()
                sums["right"] += logp[at + t, token].exp().item()
            inside += len(answer)
    return dict(p_stop_end=sums["end"] / len(examples), p_stop_inside=sums["inside"] / inside,
                p_right=sums["right"] / inside)


def probe(task: str, flags: list[str], every: int = 10) -> None:
    import train
    argv = ["--task", task_spec(task), "--out", os.path.join("runs", "probe", task),
            "--overwrite", "true", "--eval_every", "0", "--save_every", "0", *flags]
    run = train.setup(train.parse_args(argv))
    rng = __import__("random").Random(123)
    examples = [run.task.sample(rng) for _ in range(64)]
    print(f"{task} {' '.join(flags)}\n| step | reward | entropy | P(stop) after the answer | "
          "P(stop) inside it | P(right token) inside |\n|---|---|---|---|---|---|")
    for i in range(run.cfgs.train.steps):
        record, _ = train.step(run, i)
        if i % every == 0 or i + 1 == run.cfgs.train.steps:
            p = stop_probabilities(run, examples)
            print(f"| {i + 1} | {record['reward']:.3f} | {record['entropy']:.3f} | "
                  f"{p['p_stop_end']:.4f} | {p['p_stop_inside']:.4f} | {p['p_right']:.3f} |",
                  flush=True)
    train.checkpoint.release_out_dir()

# -----------------------------------------------------------------------------
# Main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="reverse,add,sort,count,increment")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--flags", default="", help="extra train.py options for every run")
    parser.add_argument("--steps", type=int, default=0, help="train.py --steps (0: its default)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--out", default="runs/learning/default")
    parser.add_argument("--force", action="store_true", help="repeat runs that already finished")
    parser.add_argument("--report", action="store_true", help="only tabulate what is there")
    parser.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                        help="run every task x seed with these extra flags too, side by side")
    parser.add_argument("--supervised", type=int, default=0, metavar="STEPS",
                        help="instead: the capacity check, STEPS of teacher forcing per task")
    parser.add_argument("--probe", default="", metavar="TASK",
                        help="instead: where the stop goes in one run of TASK (in this process)")
    args = parser.parse_args()
    if args.probe:
        os.chdir(ROOT)
        probe(args.probe, shlex.split(args.flags) + (["--steps", str(args.steps)]
                                                     if args.steps else []))
        return
    if args.supervised:
        print("| task | supervised steps | greedy fully correct | seconds |\n|---|---|---|---|")
        for task in args.tasks.split(","):
            correct, seconds = supervised(task, args.supervised)
            print(f"| {task} | {args.supervised} | {correct:.3f} | {seconds:.0f} |", flush=True)
        return
    names = [t for t in args.tasks.split(",") if t]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    flags = shlex.split(args.flags) + (["--steps", str(args.steps)] if args.steps else [])
    out = os.path.abspath(args.out)
    if args.variant:
        variants = dict(v.partition("=")[::2] for v in args.variant)  # NAME -> FLAGS
        # seed-major: a run cut short still has every task x variant for its first seeds
        jobs = [(task, name, seed, os.path.join(out, name, task.replace(":", "."), f"seed{seed}"))
                for seed in seeds for task in names for name in variants]
        if not args.report:
            with ThreadPoolExecutor(args.jobs) as pool:
                futures = [pool.submit(run_one, task, seed, d, flags + shlex.split(variants[name]),
                                       args.force) for task, name, seed, d in jobs]
                for f in futures:
                    print(f.result(), flush=True)
        print(f"\nflags: {args.flags or '(none)'}; out: {args.out}; variants: {variants}\n")
        print_variants([(task, name, seed, summary(d, task)) for task, name, seed, d in jobs
                        if os.path.exists(os.path.join(d, "run.json"))], list(variants))
        return
    jobs = [(task, seed, os.path.join(out, task.replace(":", "."), f"seed{seed}"))
            for task in names for seed in seeds]
    if not args.report:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_one, task, seed, d, flags, args.force)
                       for task, seed, d in jobs]
            for f in futures:
                print(f.result(), flush=True)
    print(f"\nflags: {args.flags or '(none)'}; out: {args.out}\n")
    rows = [(task, seed, summary(d, task)) for task, seed, d in jobs
            if os.path.exists(os.path.join(d, "run.json"))]
    print_table(rows)
    for task in names:
        dirs = [d for t, _, d in jobs if t == task and os.path.exists(os.path.join(d, "run.json"))]
        if dirs:
            picture = os.path.join(out, f"{task.replace(':', '.')}.svg")
            plot.write_svg(dirs, picture, title=f"{task} {args.flags}".strip())
            print(f"picture: {picture}")


if __name__ == "__main__":
    main()
