"""
The command line of train.py: flags from the config dataclasses, --help, and the checks a run's
configs need before anything is built (the step line is run/report.py's).

Every knob has one home, the dataclass of the file that uses it (train.py's SECTIONS: TrainConfig,
rollout.RolloutConfig, grpo.GRPOConfig, memory.MemoryConfig, tp.ParallelConfig). `--field value`
(or `--field=value`) is routed to the section that declares `field`, converted to the field's type;
`--help` prints every field with its default and the end-of-line comment of its declaration (the
config's source is its documentation). This file is given the sections; it imports no engine file.

A flag it does not know gets the nearest one it does, and TRL's GRPOConfig names (TRL_NAMES) get
this engine's: `--learning_rate` is `--lr` here; so do this engine's former names (OLD_NAMES). A
boolean flag takes its value, but for TRL's switches (SWITCHES: `--use_peft` alone is true).

Leaves out: short flags, config files, environment variables.
Tested by tests/test_train.py.
"""

import dataclasses
import difflib
import inspect
import os
import sys


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


def print_help(sections: dict[str, type], epilogue: str = "") -> None:
    """Every field of every section with its default and comment, then the epilogue (the step
    line's legend)."""
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
    if epilogue:
        lines.append("\n" + epilogue)
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `--help | head` closed the pipe: that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# TRL's GRPOConfig names a user may bring along: this engine's flag for each, and what differs.
TRL_NAMES = {
    "learning_rate": "--lr",
    "num_generations": "--num_samples",
    "max_completion_length": "--max_new_tokens",
    "max_prompt_length": "--max_prompt_len",
    "per_device_train_batch_size": "--prompts_per_step (prompts per step, each sampled "
                                   "--num_samples times; TRL counts completions per device)",
    "num_iterations": "--mu",
    "epsilon": "--eps_low",
    "epsilon_high": "--eps_high",
    "max_steps": "--steps",
    "output_dir": "--out",
    "gradient_checkpointing": "--activation_checkpoint",
    "bf16": "--dtype bfloat16",
    "model_name_or_path": "--model",
    "max_tool_calling_iterations": "--max_turns",
}
# TRL's boolean flags its users pass alone (`--use_peft`): true when no value follows. Every other
# boolean takes its value.
SWITCHES = ("use_peft", "use_rslora")
# This engine's former flag names: the one each became.
OLD_NAMES = {
    "packed_linears": "--prepacked_linears",  # "packed" is the training forward's row of tokens
    "tools": "--use_tools",  # a bool named like a task's function tools
    "check_every": "--sync_every",  # "check" is input validation; the decode loop's is a host sync
}


def renamed_fields() -> dict[str, str]:
    """{former field name: its name now}: a checkpoint written before a rename resumes with it."""
    return {old: new.removeprefix("--") for old, new in OLD_NAMES.items()}


def unknown_option(name: str, owners: dict[str, str]) -> str:
    """The line for a flag no section declares: TRL's name for it, its new name, or the nearest
    spelling."""
    if name in TRL_NAMES:
        return f"unknown option --{name} (TRL's name): did you mean {TRL_NAMES[name]}?"
    if name in OLD_NAMES:
        return f"unknown option --{name} (renamed): did you mean {OLD_NAMES[name]}?"
    close = difflib.get_close_matches(name, list(owners), n=1, cutoff=0.6)
    hint = f"did you mean --{close[0]}? " if close else ""
    return f"unknown option --{name}; {hint}(--help lists every option)"


def parse_value(name: str, value: str, kind: type):
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--{name} expects true or false, got {value!r} (a boolean flag "
                             f"takes its value: --{name} true)")
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
        if name not in owners:
            raise ValueError(unknown_option(name, owners))
        if not eq:
            last = i + 1 >= len(argv)
            if name in SWITCHES and (last or argv[i + 1].startswith("--")):
                values[name] = True  # TRL's switch, alone
                i += 1
                continue
            if kinds[name] is bool and (last or argv[i + 1].startswith("--")):
                # `--overwrite` alone, as a switch: say what it takes
                raise ValueError(f"--{name} takes a value: --{name} true or --{name} false")
            if last:
                raise ValueError(f"--{name} needs a value")
            i += 1
            value = argv[i]
        i += 1
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
                "max_unscored_steps", "eval_prompts", "eval_samples", "dim", "layers", "heads",
                "kv_heads")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("lr", "weight_decay", "grad_clip", "save_every", "warmup_steps", "eval_every",
                 "threads", "eval_top_k"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    if not 0 <= cfg.eval_temperature < float("inf"):  # NaN too
        raise ValueError(f"--eval_temperature must be a finite number >= 0 (0 = greedy), got "
                         f"{cfg.eval_temperature}")
    if not 0 < cfg.eval_top_p <= 1:
        raise ValueError(f"--eval_top_p must be in (0, 1] (1 = off), got {cfg.eval_top_p}")
    if cfg.eval_samples > 1 and cfg.eval_temperature == 0:
        raise ValueError(f"--eval_samples {cfg.eval_samples} at --eval_temperature 0 (greedy) "
                         "would be copies of one completion; sample them, e.g. Qwen3's thinking "
                         "mode: --eval_temperature 0.6 --eval_top_p 0.95 --eval_top_k 20")
    if cfg.dtype == "float16":
        raise ValueError("--dtype float16 is not supported: without loss scaling its gradients "
                         "underflow and its weights overflow to NaN; use --dtype bfloat16 (fp32 "
                         "master weights) or float32")
    if not cfg.out:
        raise ValueError("--out is empty: name the directory for metrics and checkpoints")
    if cfg.eval_data and not cfg.eval_every:
        raise ValueError(f"--eval_data {cfg.eval_data} is read by the evaluation, which "
                         "--eval_every 0 turns off; drop one of them")
    if not cfg.model:  # a fresh model's shape (a checkpoint's is checked by engine/hf.py)
        if cfg.heads % cfg.kv_heads:
            raise ValueError(f"--heads {cfg.heads} must be a multiple of --kv_heads "
                             f"{cfg.kv_heads} (each key/value head serves a group of heads)")
        if cfg.dim % (2 * cfg.heads):
            raise ValueError(f"--dim {cfg.dim} must be a multiple of 2 x --heads {cfg.heads} "
                             "(an even head width for rotary embeddings)")
    if cfg.cpu_bf16 not in ("auto", "true"):
        raise ValueError(f"--cpu_bf16 must be auto (bf16 kernels on a CPU with AVX512_BF16 or "
                         f"AMX, else float32 matmuls) or true, got {cfg.cpu_bf16!r}")
    if cfg.compile_blocks not in ("auto", "true", "false"):
        raise ValueError(f"--compile_blocks must be auto (on CUDA only), true or false, got "
                         f"{cfg.compile_blocks!r}")
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


PRETRAINED_LR = 1e-6  # TRL's default: the fresh model's 1e-3 wrecks a pretrained one in a few steps
# A fresh model's entropy bonus (verl's entropy_coeff): a model that starts from random weights
# would sharpen every position its partial credit does not yet teach (where its answer stops, first
# of all) before it is learned; docs/measurements.md, the stop set. A pretrained model keeps TRL's 0.
FRESH_ENTROPY_COEF = 0.2


def recipe_defaults(cfgs, explicit: set[str]) -> str:
    """The defaults that depend on the model (not on a resume, which keeps its own): a fresh one's
    entropy bonus; --model without --lr, TRL's learning rate. Returns the line that says what a
    --model run changed ("" when nothing)."""
    cfg = cfgs.train
    if cfg.resume:
        return ""
    if not cfg.model:
        if "entropy_coef" not in explicit:
            cfgs.grpo = dataclasses.replace(cfgs.grpo, entropy_coef=FRESH_ENTROPY_COEF)
        return ""
    if "lr" in explicit:
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


def check_eval_samples(eval_samples: int, local_prompts: int, num_samples: int) -> None:
    """The evaluation's k completions of a prompt share the rollout's KV cache (sized for a dp
    rank's prompts x --num_samples rows): one prompt's k must fit in it."""
    if eval_samples > local_prompts * num_samples:
        raise ValueError(f"--eval_samples {eval_samples} exceeds the rollout's rows a rank "
                         f"({local_prompts} prompts x --num_samples {num_samples}); lower it or "
                         "raise --prompts_per_step")


def check_dp(prompts_per_step: int, dp_size: int) -> None:
    """The generation batch splits evenly over the data-parallel ranks (dp = world / tp)."""
    if prompts_per_step % dp_size:
        raise ValueError(f"--prompts_per_step {prompts_per_step} must be divisible by "
                         f"dp = world / tp = {dp_size}")
