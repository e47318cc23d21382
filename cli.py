"""
The command line of train.py: flags from the config dataclasses, --help, the checks a run's
configs need before anything is built, and the one-line step summary.

Every knob has one home, the dataclass of the file that uses it (train.py's SECTIONS: TrainConfig,
rollout.RolloutConfig, grpo.GRPOConfig, memory.MemoryConfig, tp.ParallelConfig). `--field value`
(or `--field=value`) is routed to the section that declares `field`, converted to the field's type;
`--help` prints every field with its default and the end-of-line comment of its declaration (the
config's source is its documentation). This file is given the sections; it imports no engine file.

Leaves out: short flags, config files, environment variables.
Tested by tests/test_train.py.
"""

import dataclasses
import inspect
import math
import os
import resource
import sys

import torch

# -----------------------------------------------------------------------------
# Flags and help


def field_owners(sections: dict[str, type]) -> dict[str, str]:
    """field name -> its section; a name declared in two sections would be ambiguous on the CLI."""
    owners: dict[str, str] = {}
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            if f.name in owners:
                raise TypeError(f"--{f.name} is declared by {owners[f.name]} and {section}")
            owners[f.name] = section
    return owners


def field_help(cls: type) -> dict[str, str]:
    """The end-of-line comment of each field: the config's source is its documentation."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        name, _, rest = line.strip().partition(":")
        if "#" in rest and name.isidentifier():
            out[name] = rest.split("#", 1)[1].strip()
    return out


def print_help(sections: dict[str, type]) -> None:
    lines = ["usage: [torchrun ...] train.py [--field value ...] [--plan]",
             "  --plan: print each rank's memory per phase for these flags (config.json only, no "
             "weight read), then exit"]
    for section, cls in sections.items():
        file = os.path.basename(inspect.getsourcefile(cls))  # train.py, not __main__, as a script
        lines.append(f"\n{section} ({file} {cls.__name__}):")
        comments = field_help(cls)
        for f in dataclasses.fields(cls):
            kind = type(f.default).__name__
            default = repr(f.default)
            lines.append(f"  --{f.name:<22} {kind:<6} {default:<16} {comments.get(f.name, '')}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `--help | head` closed the pipe: that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def parse_value(name: str, value: str, kind: type):
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--{name} expects true or false, got {value!r}")
        return value.lower() in ("true", "1")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"--{name} expects {kind.__name__}, got {value!r}") from None


def parse_args(argv: list[str], sections: dict[str, type]) -> dict[str, object]:
    """`--field value` or `--field=value` -> {field: value}, converted to the field's type."""
    owners = field_owners(sections)
    kinds = {f.name: type(f.default) for cls in sections.values()
             for f in dataclasses.fields(cls)}
    values = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; options look like --field value "
                             "(see --help)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"--{name} needs a value")
            i += 1
            value = argv[i]
        i += 1
        if name not in owners:
            raise ValueError(f"unknown option --{name} (see --help for the list)")
        values[name] = parse_value(name, value, kinds[name])
    return values


def build_configs(values: dict[str, object], sections: dict[str, type]) -> dict[str, object]:
    """{section: its dataclass} from flat {field: value}; each dataclass validates its own fields."""
    owners = field_owners(sections)
    by_section: dict[str, dict] = {section: {} for section in sections}
    for name, value in values.items():
        by_section[owners[name]][name] = value
    return {s: cls(**by_section[s]) for s, cls in sections.items()}


def check_config(cfgs) -> None:
    """What the dataclasses cannot know alone: the values a training run needs (cfgs: train.py's
    Configs)."""
    cfg = cfgs.train
    positive = ("prompts_per_step", "max_prompt_len", "steps", "max_bad_steps",
                "max_unscored_steps", "eval_prompts", "dim", "layers", "heads", "kv_heads")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("lr", "weight_decay", "grad_clip", "save_every", "warmup_steps", "eval_every",
                 "threads"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.dtype == "float16":
        raise ValueError("--dtype float16 is not supported: without loss scaling its gradients "
                         "underflow and its weights overflow to NaN; use --dtype bfloat16 (fp32 "
                         "master weights) or float32")
    if not cfg.out:
        raise ValueError("--out is empty: name the directory for metrics and checkpoints")
    if not cfg.model:  # a fresh model's shape (a checkpoint's is checked by hf.py)
        if cfg.heads % cfg.kv_heads:
            raise ValueError(f"--heads {cfg.heads} must be a multiple of --kv_heads "
                             f"{cfg.kv_heads} (each key/value head serves a group of heads)")
        if cfg.dim % (2 * cfg.heads):
            raise ValueError(f"--dim {cfg.dim} must be a multiple of 2 x --heads {cfg.heads} "
                             "(an even head width for rotary embeddings)")
    dtypes = ("float32", "bfloat16", "float16")
    for name, allowed in (("dtype", dtypes[:2]), ("sampler_dtype", ("", *dtypes))):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if not cfgs.memory.memory_budget >= 0:  # NaN too
        raise ValueError(f"--memory_budget must be >= 0 GB (0: off), got "
                         f"{cfgs.memory.memory_budget}")
    r = cfgs.rollout
    if r.num_samples < 2:
        raise ValueError(f"--num_samples {r.num_samples}: GRPO compares the samples of a prompt "
                         "with each other (one alone has advantage 0); use at least 2")
    if r.temperature == 0:
        raise ValueError("--temperature 0 (greedy) samples every completion of a group alike: "
                         "every advantage would be 0; GRPO needs a temperature > 0")
    if r.top_k or r.top_p < 1:
        raise ValueError("--top_k/--top_p truncate the sampling distribution, which the trainer's "
                         "logprobs do not (the GRPO ratio would not be 1 on-policy); leave them "
                         "off for training (they are for evaluation with rollout.generate)")


PRETRAINED_LR = 1e-6  # TRL's default: the fresh model's 5e-4 wrecks a pretrained one in a few steps


def pretrained_defaults(cfgs, explicit: set[str]) -> str:
    """--model without --lr (and not a resume, which keeps its own): TRL's learning rate. Returns
    the line that says so ("" when nothing changed)."""
    cfg = cfgs.train
    if not cfg.model or cfg.resume or "lr" in explicit:
        return ""
    cfgs.train = dataclasses.replace(cfg, lr=PRETRAINED_LR)
    return (f"lr {PRETRAINED_LR:g}: the default for a pretrained --model (TRL's; the fresh "
            f"model's {cfg.lr:g} would wreck it); pass --lr to choose")


def check_budget(max_new_tokens: int, context: int) -> None:
    """Before any weight or KV cache is allocated: a completion budget that leaves no room for a
    prompt in the model's context (max_position_embeddings) would fail at the first step."""
    if max_new_tokens >= context:
        raise ValueError(f"--max_new_tokens {max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {context} tokens (max_position_embeddings); lower it")

# -----------------------------------------------------------------------------
# The step line


def memory_figures(device: torch.device, mem) -> dict[str, float]:
    """On a GPU, the max of max_memory_allocated over all phases (mem: memory.PhaseManager); on a
    CPU, the process's max RSS (what the OS holds for it, not the memory table's tagged tensors).
    In GB, each named for what it measures."""
    if device.type == "cuda":
        peak = max(mem.peak_bytes(), torch.cuda.max_memory_allocated(device))
        return dict(max_allocated_gb=peak / 1e9)
    return dict(max_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)  # KiB


def check_dp(prompts_per_step: int, dp_size: int) -> None:
    """The generation batch splits evenly over the data-parallel ranks (dp = world / tp)."""
    if prompts_per_step % dp_size:
        raise ValueError(f"--prompts_per_step {prompts_per_step} must be divisible by "
                         f"dp = world / tp = {dp_size}")


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


def step_line(record: dict, steps: int, beta: float) -> str:
    """One printed line per step from its metrics.jsonl record."""
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
              f"len {record['completion_len']:.1f}", f"{record['tokens_per_s']:.0f} tok/s",
              f"roll {record['t_rollout']:.2f}s lp {record['t_logprobs']:.2f}s "
              f"train {record['t_train']:.2f}s"]
    if "max_rss_gb" in record:  # the process's, not the memory table's tagged tensors
        parts.append(f"max RSS {record['max_rss_gb']:.2f} GB")
    else:
        parts.append(f"max allocated {record['max_allocated_gb']:.2f} GB")
    if record.get("eval_reward") is not None:
        right = record["eval_correct"]
        parts.append(f"eval {record['eval_reward']:.3f}"
                     + (f" ({right:.0%} correct)" if right is not None else ""))
    if record["reward"] is None:
        parts.append(f"NO REWARD SCORED: all {record['missing_rewards']} missing, no update")
    elif record["missing_rewards"]:
        parts.append(f"{record['missing_rewards']} rewards missing")
    if record["truncated_prompts"]:
        parts.append(f"{record['truncated_prompts']} prompts truncated")
    if record["skipped_updates"]:
        parts.append(f"{record['skipped_updates']} updates skipped (non-finite loss or grads)")
    if record.get("zero_grad"):
        parts.append(f"{record['zero_grad']} steps with a zero gradient (every advantage 0: AdamW's momentum only)")
    return " | ".join(parts)
