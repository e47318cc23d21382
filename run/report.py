"""
What a run reports each step: the metrics record (one JSON object per step, OUT/metrics.jsonl), the
one printed step line, the completions it shows, and the health checks that stop a run going
nowhere.

The step line, field by field (STEP_LINE below; `python train.py --help` prints it too):

    step 12/800 | reward 0.412 ± 0.21 | loss -0.0012 | ent 1.935 | clip 0.000 | |dlogp| 1.8e-07
    | len 4.0 | 51234 tok/s | roll 0.02s lp 0.00s train 0.04s | max RSS 0.37 GB | eval 0.650 (20%
    correct, pass@4 45%)

Completions shown: every evaluation prints the first --show_samples held-out prompts (the same ones
each time, so a reader sees them change) with the (first) completion, the reference and the reward,
and OUT/samples.jsonl gets every completion (step, prompt, completion, reference, reward, stopped,
correct; and sample, its index among the prompt's k, when --eval_samples k > 1); --show_rollouts N
prints N of the step's sampled completions after each step line.

Health: a run stops in one line (after a checkpoint) when for N steps in a row no update was finite
(--max_bad_steps), no reward was scored (--max_unscored_steps), or every group's rewards were all
equal (--max_flat_steps): then every advantage is 0 and nothing can learn, which is what an
all-or-nothing reward does to a model that never earns it. A step whose every sample is fully
correct, or earns the run's top reward, counts as learned, not stuck; the message says whether
every sample earned one reward or each prompt's samples one of their own.

Leaves out: wandb and other loggers (metrics.jsonl is the record; run/plot.py draws it).
Tested by tests/test_train.py.
"""

import math
import resource
from dataclasses import dataclass

import torch

from tasks import short

STEP_LINE = """\
step line: reward mean ± std over the step's samples | loss (about 0 when mu = 1: the ratio is 1,
the gradient is not) | kl to the reference (beta > 0) | ent: mean entropy of the sampled tokens,
nats | clip: share of tokens whose ratio was clipped | |dlogp|: mean |sampler logp - trainer logp|
before the update (~1e-7 in float32: the engine's health check) | len: mean completion tokens, the
stop token included (a tool's answers too) | calls: tool turns answered per row (a task with a
tool; errors: the model's mistakes told: a ToolError, a malformed or unknown function call) |
tok/s: the rollout's new tokens per second | roll, lp, train: seconds in the rollout, the old and
reference logprobs (mu > 1, beta > 0), training; compile: of those, the seconds torch.compile took
(a step that compiled) | max RSS (CPU) or max allocated (GPU) | eval: mean held-out greedy reward
(share fully correct; with --eval_samples k > 1, of all k per prompt, and pass@k: the share of
prompts with one of its k fully correct), every --eval_every steps"""

# -----------------------------------------------------------------------------
# The step's record and line


def memory_figures(device: torch.device, mem) -> dict[str, float]:
    """On a GPU, the max of max_memory_allocated over all phases (mem: memory.PhaseManager); on a
    CPU, the process's max RSS (what the OS holds for it, not the memory table's tagged tensors).
    In GB, each named for what it measures."""
    if device.type == "cuda":
        peak = max(mem.peak_bytes(), torch.cuda.max_memory_allocated(device))
        return dict(max_allocated_gb=peak / 1e9)
    return dict(max_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)  # KiB


def step_record(step: int, rewards: torch.Tensor, counts: dict, iterations: list[dict],
                times: dict, zero_std: float, **extra) -> dict:
    """The step as one JSON-able dict (null for what did not happen): rewards (every rank's,
    every round's), counts summed over ranks, each iteration's metrics (already over ranks)
    aggregated over the mu iterations: min of *_min, max of *_max, mean of the rest."""
    scored = rewards[~rewards.isnan()]
    updated = [it for it in iterations if it["updated"]]
    record = dict(step=step + 1, reward=scored.mean().item() if len(scored) else None,
                  reward_std=scored.std().item() if len(scored) > 1 else None,
                  missing_rewards=len(rewards) - len(scored),
                  truncated_prompts=int(counts["truncated"]),
                  completion_len=counts["lengths"] / len(rewards),
                  tokens_per_s=counts["new_tokens"] / max(times["rollout"], 1e-9),
                  kept_groups=int(counts["kept_groups"]), zero_std=zero_std,
                  extra_rollouts=counts["extra_rollouts"], updates=len(updated),  # with a gradient
                  skipped_updates=sum(not it["finite"] for it in iterations))
    record["zero_grad"] = len(iterations) - len(updated) - record["skipped_updates"]
    metrics = ["loss", "clip_low", "clip_high", "ratio_mean", "kl", "entropy"]
    metrics += [k for k in (iterations[0] if iterations else {})
                if k not in (*metrics, "grad_norm", "updated", "finite")]
    for key in metrics:  # over the mu iterations
        values = [it[key] for it in iterations if key in it]
        pick = min if key.endswith("_min") else max if key.endswith("_max") else None
        record[key] = (pick(values) if pick else sum(values) / len(values)) if values else None
    norms = [it["grad_norm"] for it in updated]
    # sampler_logp_diff before any update of this step: the sampler's logprobs up to numerics
    record.update({f"t_{k}": v for k, v in times.items()}, **extra,
                  sampler_logp_diff=iterations[0].get("sampler_logp_diff") if iterations else None,
                  grad_norm=sum(norms) / len(norms) if norms else None)
    return record


def jsonable(record: dict) -> dict:
    """NaN and inf are not JSON (strict readers refuse a bare NaN): they become null."""
    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return {k: clean(v) for k, v in record.items()}


def plural(count: int, noun: str, nouns: str = "") -> str:
    """'1 prompt', '2 prompts' (nouns: an irregular plural)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def faults(record: dict) -> list[str]:
    """The step line's closing parts: what went wrong or was left out this step."""
    parts = []
    if record["reward"] is None:
        parts.append(f"NO REWARD SCORED: all {record['missing_rewards']} missing, no update")
    elif record["missing_rewards"]:
        parts.append(f"{plural(record['missing_rewards'], 'reward')} missing")
    if record["truncated_prompts"]:
        parts.append(f"{plural(record['truncated_prompts'], 'prompt')} truncated")
    if record["skipped_updates"]:
        parts.append(f"{plural(record['skipped_updates'], 'update')} skipped (non-finite loss or "
                     "grads)")
    if record.get("zero_grad"):
        parts.append(f"{plural(record['zero_grad'], 'update')} with a zero gradient (every "
                     "advantage 0: AdamW's momentum only)")
    return parts


def step_line(record: dict, steps: int, beta: float) -> str:
    """One printed line per step from its metrics.jsonl record (STEP_LINE says each field)."""
    record = jsonable(record)

    def num(key: str, fmt: str) -> str:
        return "-" if record[key] is None else format(record[key], fmt)
    parts = [f"step {record['step']}/{steps}",
             f"reward {num('reward', '.3f')} ± {num('reward_std', '.2f')}",
             f"loss {num('loss', '+.4f')}"]
    if beta > 0:
        parts.append(f"kl {num('kl', '.4f')}")
    clip = None
    if record["clip_low"] is not None:
        clip = record["clip_low"] + record["clip_high"]
    parts += [f"ent {num('entropy', '.3f')}", f"clip {'-' if clip is None else f'{clip:.3f}'}",
              f"|dlogp| {num('sampler_logp_diff', '.1e')}",
              f"len {record['completion_len']:.1f}"]
    if "tool_calls" in record:  # a task with a tool: calls per row (errors: the model's bad calls)
        errors = f" ({record['tool_errors']} errors)" if record["tool_errors"] else ""
        parts.append(f"calls {record['tool_calls']:.2f}{errors}")
    compiled = f" compile {record['t_compile']:.1f}s" if record.get("t_compile") else ""
    parts += [f"{record['tokens_per_s']:.0f} tok/s",
              f"roll {record['t_rollout']:.2f}s lp {record['t_logprobs']:.2f}s "
              f"train {record['t_train']:.2f}s{compiled}"]
    if "max_rss_gb" in record:  # the process's, not the memory table's tagged tensors
        parts.append(f"max RSS {record['max_rss_gb']:.2f} GB")
    else:
        parts.append(f"max allocated {record['max_allocated_gb']:.2f} GB")
    if record.get("eval_reward") is not None:
        right, passed = record["eval_correct"], record.get("eval_pass_at_k")
        k = f"pass@{record['eval_samples']} {passed:.0%}" if passed is not None else ""
        parts.append(f"eval {record['eval_reward']:.3f}" + (
            f" ({right:.0%} correct{', ' + k if k else ''})" if right is not None else ""))
    return " | ".join(parts + faults(record))

# -----------------------------------------------------------------------------
# Completions shown


def sample_lines(rollouts: list[dict], samples: list[dict], evaluated: int) -> list[str]:
    """The step's sampled completions shown, then the evaluation's (of `evaluated` prompts)."""
    return ([sample_line(s, f"sampled {n + 1}") for n, s in enumerate(rollouts)]
            + [sample_line(s, f"eval {n + 1}/{evaluated}") for n, s in enumerate(samples)])


def sample_line(sample: dict, label: str) -> str:
    """One completion as the run shows it: prompt -> completion | reference | reward. A
    conversation shows its last message."""
    prompt = sample["prompt"]
    if not isinstance(prompt, str):
        prompt = prompt[-1]["content"]
    end = "" if sample["stopped"] else " (no stop: the budget ran out)"
    reward = "-" if sample["reward"] is None else f"{sample['reward']:.3f}"
    return (f"  {label}: {short(prompt, 50)} -> {short(sample['completion'], 80)}{end} | "
            f"reference {short(sample['reference'], 40)} | reward {reward}")

# -----------------------------------------------------------------------------
# Health: stop a run that is going nowhere


@dataclass
class Health:
    """Steps in a row that went nowhere, by kind; update() names the first limit reached."""
    max_bad_steps: int       # no finite update (a non-finite loss or gradient)
    max_unscored_steps: int  # no reward scored (every reward function returned None)
    max_flat_steps: int      # every group all-equal (advantage 0 everywhere); 0 = never stop
    bad: int = 0
    unscored: int = 0
    flat: int = 0
    best: float = -math.inf   # the highest mean reward of a step so far
    worst: float = math.inf   # the lowest

    def update(self, record: dict) -> str:
        """Counts this step's record; returns why the run must stop, or ""."""
        no_update = record["skipped_updates"] > 0 and record["updates"] == 0
        self.bad = self.bad + 1 if no_update else 0
        reward = record["reward"]
        self.unscored = self.unscored + 1 if reward is None else 0
        flat = record["zero_std"] == 1.0 and reward is not None
        # A task whose every sample is fully correct, or earns the run's top reward (one reward
        # for the whole batch, none higher on any step before, the run risen to it), is learned,
        # not stuck, whether its `correct` predicate says so or it has none.
        same = flat and not record.get("reward_std")
        top = same and reward >= self.best and reward > self.worst
        if flat and not top and record.get("correct") != 1.0:
            self.flat += 1
        else:
            self.flat = 0
        if reward is not None:
            self.best, self.worst = max(self.best, reward), min(self.worst, reward)
        if self.bad >= self.max_bad_steps:
            return f"{self.bad} steps in a row had no finite update (a non-finite loss or grad)"
        if self.unscored >= self.max_unscored_steps:
            return f"{self.unscored} steps in a row had no reward scored (all returned None)"
        if self.max_flat_steps and self.flat >= self.max_flat_steps:
            if same:  # one reward for every sample, below the run's best (or flat from the start)
                return (f"{self.flat} steps in a row gave every sample the same reward "
                        f"{reward:.3f} (the run's best step: {self.best:.3f}): every advantage is "
                        "0, so nothing learns. An all-or-nothing reward that no sample earns does "
                        "this; give partial credit (README, Tasks), or --max_flat_steps 0 to go on")
            return (f"{self.flat} steps in a row gave every sample of each prompt the same reward, "
                    f"prompts apart (mean {reward:.3f}): every advantage is 0, so nothing learns; "
                    "the policy writes one completion per prompt. Sample more widely "
                    "(--temperature, --entropy_coef), or --max_flat_steps 0 to go on")
        return ""
