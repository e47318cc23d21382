"""
GRPO training, end to end: `python train.py` on a CPU, `torchrun --nproc_per_node=N train.py` on GPUs.

One step, as data (DESIGN.md): draw B prompts from the task and tokenize them (left-truncated to
max_prompt_len) -> wake the rollout phase and sample G completions per prompt, prefilling each prompt
once (rollout.py) -> score them with the task's reward functions -> group advantages (grpo.py) -> old
logprobs when mu > 1, reference logprobs when beta > 0 -> mu optimizer steps, each over the whole
generation batch in micro-batches of whole groups (shared-prompt forward, chunked logprobs, GRPO loss)
-> one printed line and a metrics.jsonl record; a checkpoint every save_every steps and at the end.

Parallelism: world = tp x dp. The tp ranks of a dp group hold one sharded model (tp.py) and see the same
prompts and tokens; each dp group takes its own slice of the prompts and gradients are summed over dp.
Loss normalisers are counted over the whole generation batch on all ranks, so the update does not
depend on how the batch is split.

Leaves out: pipeline parallelism, multi-node launch details, evaluation sets, chat templates, wandb.
Shapes: Bp prompts, G samples per prompt, N = Bp*G completions, Tr completion length.
Run `python train.py --help` for every option. Tested by tests/test_train.py.
"""

import contextlib
import copy
import dataclasses
import importlib
import inspect
import json
import math
import os
import random
import resource
import signal
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

import grpo
import memory
import rollout
import tp
import checkpoint
from model import Llama, ModelConfig, build_char_tokenizer, load_tokenizer

# -----------------------------------------------------------------------------
# Config and command line


@dataclass
class TrainConfig:
    # model
    model: str = ""                  # Hugging Face checkpoint directory; "" = a fresh tiny Llama built for the task
    dim: int = 64                    # fresh model: width
    layers: int = 2                  # fresh model: transformer blocks
    heads: int = 4                   # fresh model: attention heads
    kv_heads: int = 2                # fresh model: key/value heads (GQA)
    dtype: str = "float32"           # trainer weights: float32 or bfloat16
    sampler_dtype: str = ""          # sampler weights; "" = same tensors as the trainer (no copy)
    # task
    task: str = "tasks:reverse"      # package.module:attr, a Task or a function (task_data) -> Task
    task_data: str = ""              # passed to a task factory, e.g. a JSONL file for tasks:jsonl_math
    # rollout
    prompts_per_step: int = 16       # Bp prompts per generation batch (over all dp ranks)
    num_samples: int = 16            # G completions per prompt
    max_prompt_len: int = 256        # longer prompts are truncated on the left (counted in the log)
    max_new_tokens: int = 0          # 0 = the task's own budget (or 256)
    temperature: float = 1.0         # sampling temperature, also applied to the trainer's logprobs
    top_k: int = 0                   # 0 = off
    top_p: float = 1.0               # 1 = off
    # GRPO
    loss_type: str = "dapo"          # dapo | grpo | dr_grpo
    scale: str = "group"             # advantage scaling: group | batch | none
    eps_low: float = 0.2             # clip ratio below at 1 - eps_low
    eps_high: float = 0.28           # clip ratio above at 1 + eps_high (clip-higher)
    beta: float = 0.0                # KL weight to the initial model (k3); 0 = no reference model
    mu: int = 1                      # optimizer steps per generation batch
    micro_batch_groups: int = 16     # whole groups per forward/backward
    chunk_size: int = 1024           # completion tokens per logprob chunk
    # optimisation
    steps: int = 800                 # generation batches to train on
    lr: float = 1e-3                 # peak learning rate (tiny fresh model; ~1e-6 for a real checkpoint)
    min_lr_ratio: float = 0.1        # cosine decay floor, as a fraction of lr
    warmup_steps: int = 10           # linear warmup, in optimizer steps
    weight_decay: float = 0.0        # AdamW weight decay
    grad_clip: float = 1.0           # global gradient-norm clip; 0 = off
    max_bad_steps: int = 5           # stop (with a checkpoint) after this many non-finite losses in a row
    # parallelism and memory
    tp: int = 1                      # tensor-parallel size; world size = tp * dp
    sequence_parallel: bool = False  # tp.py's sequence parallelism in the training forward
    phases: bool = True              # memory.py sleep/wake of KV cache, grads, optimizer state between phases
    activation_checkpoint: bool = False  # recompute each block in backward (memory.py)
    activation_offload: bool = False # saved activations to (pinned) host memory in the training forward
    threads: int = 1                 # CPU threads per process (1 suits tiny models, shared machines); 0 = torch's
    # output
    out: str = "runs/default"        # metrics.jsonl and checkpoints go here
    save_every: int = 100            # checkpoint every N steps (and at the end); 0 = only at the end
    resume: str = ""                 # a checkpoint directory to continue from exactly ("latest" = out/latest)
    seed: int = 0                    # model init, prompts and sampling are functions of (seed, step)


def field_help() -> dict[str, str]:
    """The end-of-line comment of each TrainConfig field: the config's source is its documentation."""
    out = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        name, _, rest = line.strip().partition(":")
        if "#" in rest and name.isidentifier():
            out[name] = rest.split("#", 1)[1].strip()
    return out


def parse_args(argv: list[str]) -> TrainConfig:
    """`--field value` or `--field=value` onto TrainConfig, converted to the field's type."""
    kinds = {f.name: type(f.default) for f in dataclasses.fields(TrainConfig)}
    if "-h" in argv or "--help" in argv:
        print("usage: [torchrun ...] train.py [--field value ...]\n")
        for f in dataclasses.fields(TrainConfig):
            print(f"  --{f.name:<22} {kinds[f.name].__name__:<6} {f.default!r:<16} {field_help().get(f.name, '')}")
        raise SystemExit(0)
    values, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; options look like --field value (see --help)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"--{name} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        if name not in kinds:
            raise ValueError(f"unknown option --{name} (see --help for the list)")
        kind = kinds[name]
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--{name} expects true or false, got {value!r}")
            values[name] = value.lower() in ("true", "1")
            continue
        try:
            values[name] = kind(value)
        except ValueError:
            raise ValueError(f"--{name} expects {kind.__name__}, got {value!r}") from None
    return TrainConfig(**values)


def check_config(cfg: TrainConfig) -> None:
    positive = ("prompts_per_step", "num_samples", "max_prompt_len", "mu", "micro_batch_groups", "steps", "tp")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("lr", "weight_decay", "grad_clip", "max_new_tokens", "save_every", "warmup_steps"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    dtypes = ("float32", "bfloat16", "float16")
    for name, allowed in (("dtype", dtypes), ("sampler_dtype", ("", *dtypes))):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name} must be one of {allowed}, got {getattr(cfg, name)!r}")


def load_task(spec: str, data: str):
    module_name, _, attr = spec.partition(":")
    try:
        task = getattr(importlib.import_module(module_name), attr or "task")
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--task {spec}: cannot load it ({e}); expected package.module:attr") from None
    return task if hasattr(task, "rewards") else task(data)

# -----------------------------------------------------------------------------
# Model, tokenizer, optimizer


def build_model(cfg: TrainConfig, task, source: str, device: torch.device, groups: tp.ParallelGroups):
    """From a HF directory (--model, or a checkpoint being resumed), or fresh: a char tokenizer for the
    task's alphabet and a tiny Llama initialised from the seed (the same on every rank)."""
    dtype = getattr(torch, cfg.dtype)
    if source:
        if groups.tp_size > 1:
            model = tp.load_sharded(source, groups, device, dtype)  # each rank reads only its slice
        else:
            model = Llama.from_pretrained(source, device=device, dtype=dtype)
        return model, load_tokenizer(source)
    if not task.alphabet:
        raise ValueError(f"task {task.name} has no alphabet for a fresh tokenizer: pass --model DIR")
    tokenizer = build_char_tokenizer(task.alphabet)
    mcfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=cfg.dim, intermediate_size=cfg.dim * 11 // 4,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       max_position_embeddings=1024, bos_token_id=tokenizer.token_to_id("<bos>"),
                       eos_token_id=tokenizer.token_to_id("<eos>"))
    model = Llama(mcfg).init_weights(cfg.seed).to(device=device, dtype=dtype)  # same init on every rank
    if groups.tp_size > 1:
        tp.shard_model(model, groups)
    return model, tokenizer


def learning_rate(cfg: TrainConfig, opt_step: int, total: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if opt_step < cfg.warmup_steps:
        return cfg.lr * (opt_step + 1) / cfg.warmup_steps
    progress = min(1.0, (opt_step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

# -----------------------------------------------------------------------------
# One step's pieces


def draw_prompts(cfg: TrainConfig, task, tokenizer, bos: int | None, step: int) -> tuple[list, list[list[int]], int]:
    """The step's prompts are a function of (seed, step) alone, so a resumed run draws the same ones."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    examples = [task.sample(rng) for _ in range(cfg.prompts_per_step)]
    ids, truncated = [], 0
    for text, _ in examples:
        tokens = tokenizer.encode(text, add_special_tokens=False).ids
        if bos is not None and (not tokens or tokens[0] != bos):
            tokens = [bos] + tokens
        if len(tokens) > cfg.max_prompt_len:  # keep the end: the question sits at the end of the prompt
            tokens, truncated = tokens[-cfg.max_prompt_len:], truncated + 1
        ids.append(tokens)
    return examples, ids, truncated


class StopTraining(Exception):
    """A run that cannot go on (a reward function raised, losses stayed non-finite): one clear line."""


def score(task, completions: list[str], references: list[str]) -> tuple[torch.Tensor, int]:
    """Weighted reward per completion; None/NaN from any reward function -> NaN (left out of the stats)."""
    rewards, missing = [], 0
    for text, ref in zip(completions, references):
        total = 0.0
        for fn, weight in task.rewards:
            try:
                r = fn(text, ref)
            except Exception as e:  # a user's reward function: report it with the input that broke it
                raise StopTraining(f"task {task.name}: reward function {getattr(fn, '__name__', fn)} raised "
                                   f"{type(e).__name__}: {e} on completion {text!r} (reference {ref!r})") from None
            total += float("nan") if r is None else weight * float(r)
        missing += math.isnan(total)
        rewards.append(total)
    return torch.tensor(rewards), missing


def peak_memory(device: torch.device, mem: memory.PhaseManager) -> float:
    """GB: the peak of torch.cuda.max_memory_allocated over all phases on a GPU, the process's peak RSS
    on a CPU."""
    if device.type == "cuda":
        return max(mem.peak_bytes(), torch.cuda.max_memory_allocated(device)) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def all_reduce_sum(values: list[float], groups: tp.ParallelGroups, device) -> list[float]:
    if groups.dp_group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=groups.dp_group)  # DP: sum of per-rank counts over the dp ranks
    return t.tolist()

# -----------------------------------------------------------------------------
# The loop


def run(cfg: TrainConfig, explicit: set[str]) -> None:
    rank, world, device = tp.init_distributed()
    groups = tp.make_groups(cfg.tp)
    if cfg.resume:  # continue with the saved config; options given on this command line still win
        saved = checkpoint.saved_config(cfg.resume, cfg.out)
        cfg = dataclasses.replace(TrainConfig(**saved), **{k: getattr(cfg, k) for k in explicit})
    check_config(cfg)
    if device.type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.threads or max(1, torch.get_num_threads() // local))  # no oversubscription
    if cfg.prompts_per_step % groups.dp_size:
        raise ValueError(f"--prompts_per_step {cfg.prompts_per_step} must be divisible by "
                         f"dp = world / tp = {groups.dp_size}")
    task = load_task(cfg.task, cfg.task_data)
    resume_dir = checkpoint.resolve(cfg.resume, cfg.out) if cfg.resume else ""
    model, tokenizer = build_model(cfg, task, resume_dir or cfg.model, device, groups)
    mcfg = model.config
    stop_ids = tuple(mcfg.eos_token_id if isinstance(mcfg.eos_token_id, list) else
                     [mcfg.eos_token_id] if mcfg.eos_token_id is not None else [])
    max_new = cfg.max_new_tokens or task.max_new_tokens or 256
    G, local_prompts = cfg.num_samples, cfg.prompts_per_step // groups.dp_size
    lo = groups.dp_rank * local_prompts  # this dp rank's slice of the generation batch

    # The reference is the initial policy (built before any checkpoint is loaded); the sampler shares the
    # trainer's tensors unless it runs in another dtype, then memory.py syncs it before each rollout.
    reference = None
    if cfg.beta > 0:
        reference = build_model(cfg, task, cfg.model, device, groups)[0] if resume_dir else copy.deepcopy(model)
        reference.requires_grad_(False)
    sampler = model
    if cfg.sampler_dtype and cfg.sampler_dtype != cfg.dtype:
        sampler = copy.deepcopy(model).to(getattr(torch, cfg.sampler_dtype)).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    gcfg = grpo.GRPOConfig(num_samples=G, loss_type=cfg.loss_type, scale=cfg.scale, eps_low=cfg.eps_low,
                           eps_high=cfg.eps_high, beta=cfg.beta, temperature=cfg.temperature or 1.0,
                           chunk_size=cfg.chunk_size, micro_batch_groups=min(cfg.micro_batch_groups, local_prompts),
                           mu=cfg.mu, max_completion_len=max_new)
    start = checkpoint.load_checkpoint(resume_dir, optimizer, groups) if resume_dir else 0
    logprob_fn = partial(tp.vocab_parallel_logprobs, groups=groups) if groups.tp_size > 1 else None
    logits_fn = partial(tp.gather_vocab, groups=groups) if groups.tp_size > 1 else None
    dp_grads = tp.DataParallelGrads(model, groups)

    cache = rollout.KVCache.for_batch(mcfg, local_prompts, G, cfg.max_prompt_len, max_new,
                                      next(sampler.parameters()).dtype, device, tp_size=groups.tp_size)
    mem = memory.PhaseManager(device, memory.MemoryConfig(activation_checkpoint=cfg.activation_checkpoint,
                                                          activation_offload=cfg.activation_offload))
    mem.add_weights(model, sampler)
    mem.add_kv_cache(cache.buffer)
    mem.add_grads(model)
    mem.add_optimizer(optimizer)
    if reference is not None:
        mem.add_reference(reference)
    phase = mem.phase if cfg.phases else (lambda name: contextlib.nullcontext())

    os.makedirs(cfg.out, exist_ok=True)
    metrics_file = os.path.join(cfg.out, "metrics.jsonl")
    if rank == 0:  # drop records past the step we resume from: they are about to be recomputed
        kept = []
        if os.path.exists(metrics_file) and start > 0:
            with open(metrics_file) as f:
                kept = [line for line in f if json.loads(line)["step"] <= start]
        with open(metrics_file, "w") as f:
            f.writelines(kept)

    stop_requested = []
    def on_sigint(signum, frame):  # finish the step, checkpoint, exit; a second Ctrl-C interrupts at once
        stop_requested.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGINT, on_sigint)

    def save(step: int) -> str:
        return checkpoint.save_checkpoint(cfg.out, step, model, tokenizer, optimizer, dataclasses.asdict(cfg), groups)

    bad_in_a_row, opt_step, total_opt_steps = 0, start * cfg.mu, cfg.steps * cfg.mu
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        step_start = time.perf_counter()
        # 1. prompts (the same on every rank; each dp rank takes its slice)
        examples, prompt_ids, truncated = draw_prompts(cfg, task, tokenizer, mcfg.bos_token_id, step)
        prompts, references = prompt_ids[lo:lo + local_prompts], [ref for _, ref in examples[lo:lo + local_prompts]]
        # 2-4. rollout: weights awake (sampler synced), KV cache allocated; both released after
        with phase("rollout"):
            rcfg = rollout.RolloutConfig(num_samples=G, max_new_tokens=max_new, temperature=cfg.temperature,
                                         top_k=cfg.top_k, top_p=cfg.top_p,
                                         cuda_graphs=groups.tp_size == 1)  # no collectives in a graph
            out = rollout.generate(sampler, prompts, rcfg, stop_ids=stop_ids,
                                   seed=cfg.seed * 1_000_003 + step * 7919 + groups.dp_rank, cache=cache,
                                   logits_fn=logits_fn)
        completions = out.completions()
        t_rollout = time.perf_counter() - step_start
        # 5. rewards and advantages (over the whole generation batch: gather every dp rank's rewards)
        texts = [tokenizer.decode([t for t in c if t not in stop_ids]) for c in completions]
        try:
            rewards, missing = score(task, texts, [ref for ref in references for _ in range(G)])
        except StopTraining:
            save(step)  # nothing lost: the state after the last finished step
            raise
        rewards = rewards.to(device)
        if groups.dp_group is not None:
            parts = [torch.empty_like(rewards) for _ in range(groups.dp_size)]
            dist.all_gather(parts, rewards, group=groups.dp_group)  # DP: every rank's rewards, in dp-rank order
            all_rewards = torch.cat(parts)
        else:
            all_rewards = rewards
        advantages = grpo.group_advantages(all_rewards, G, scale=cfg.scale)
        rows = slice(lo * G, (lo + local_prompts) * G)
        batch = grpo.GRPOBatch(prompts, completions, advantages[rows])
        # 6. old logprobs (mu > 1, or a sampler in another dtype) and reference logprobs, without grad
        t0 = time.perf_counter()
        if cfg.mu > 1 or sampler is not model:
            batch.old_logp = grpo.batch_logprobs(model, prompts, completions, gcfg, logprob_fn=logprob_fn)
        if reference is not None:
            with phase("reference"):
                batch.ref_logp = grpo.batch_logprobs(reference, prompts, completions, gcfg, logprob_fn=logprob_fn)
        t_logprobs = time.perf_counter() - t0
        num_seqs, num_tokens = all_reduce_sum([len(completions), sum(map(len, completions))], groups, device)
        # 7. mu optimizer steps over the one generation batch
        t0 = time.perf_counter()
        skipped = 0
        with phase("train"):
            for _ in range(cfg.mu):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(cfg, opt_step, total_opt_steps)
                optimizer.zero_grad(set_to_none=True)
                sp = (tp.sequence_parallel(model, cfg.sequence_parallel) if groups.tp_size > 1
                      else contextlib.nullcontext())
                with sp, mem.activations(model):
                    m = grpo.accumulate(model, batch, gcfg, logprob_fn=logprob_fn, num_seqs=int(num_seqs),
                                        num_tokens=max(1, int(num_tokens)))
                dp_grads.all_reduce()
                (finite,) = all_reduce_sum([float(math.isfinite(m["loss"]))], groups, device)
                if finite < groups.dp_size:  # a NaN/inf loss anywhere: skip this update on every rank
                    skipped += 1
                    optimizer.zero_grad(set_to_none=True)
                    continue
                m["grad_norm"] = tp.clip_grad_norm(model, cfg.grad_clip or float("inf"), groups)
                optimizer.step()
                opt_step += 1
        if groups.tp_size > 1:  # SP's gather buffers (tp.MemoryBuffer) are not needed again until the next train phase
            model.tp_state.buffer.tensors.clear()
        bad_in_a_row = bad_in_a_row + 1 if skipped == cfg.mu else 0
        t_train = time.perf_counter() - t0
        # 8. log
        seconds = time.perf_counter() - step_start
        keys = ["loss", "kl", "entropy", "clip_low", "clip_high"]
        summed = all_reduce_sum([m.get(k, float("nan")) for k in keys], groups, device)
        record = dict(step=step + 1, reward=all_rewards.nanmean().item(),
                      reward_std=all_rewards[~all_rewards.isnan()].std().item() if all_rewards.numel() > 1 else 0.0,
                      **{k: v if k == "loss" else v / groups.dp_size for k, v in zip(keys, summed)},
                      grad_norm=m.get("grad_norm", float("nan")),
                      completion_len=sum(map(len, completions)) / len(completions),
                      tokens_per_s=out.stats["new_tokens"] * groups.dp_size / max(t_rollout, 1e-9),
                      t_rollout=t_rollout, t_logprobs=t_logprobs, t_train=t_train, t_step=seconds,
                      peak_gb=peak_memory(device, mem), lr=optimizer.param_groups[0]["lr"],
                      missing_rewards=missing, truncated_prompts=truncated, skipped_updates=skipped)
        if rank == 0:
            with open(metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(f"step {step + 1}/{cfg.steps} | reward {record['reward']:.3f} ± {record['reward_std']:.2f} | "
                      f"loss {record['loss']:+.4f} | " + (f"kl {record['kl']:.4f} | " if cfg.beta > 0 else "") +
                      f"ent {record['entropy']:.3f} | "
                      f"clip {record['clip_low'] + record['clip_high']:.3f} | len {record['completion_len']:.1f} | "
                      f"{record['tokens_per_s']:.0f} tok/s | roll {t_rollout:.2f}s lp {t_logprobs:.2f}s "
                      f"train {t_train:.2f}s | peak {record['peak_gb']:.2f} GB"
                      + (f" | {missing} rewards missing" if missing else "")
                      + (f" | {truncated} prompts truncated" if truncated else "")
                      + (f" | {skipped} updates skipped (non-finite loss)" if skipped else ""))
            if step == start and cfg.phases:
                bar.write(mem.report())
        last = step + 1 == cfg.steps
        stop = bool(all_reduce_sum([float(bool(stop_requested))], groups, device)[0])
        if bad_in_a_row >= cfg.max_bad_steps:
            path = save(step + 1)
            raise StopTraining(f"{bad_in_a_row} steps in a row had a non-finite loss; stopped, checkpoint at {path}")
        if last or stop or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            path = save(step + 1)
            if stop:
                if rank == 0:
                    bar.write(f"interrupted: checkpoint at {path}; continue with --resume {path}")
                break
    bar.close()


def main(argv: list[str]) -> int:
    previous_sigint = signal.getsignal(signal.SIGINT)
    try:
        cfg = parse_args(argv)
        explicit = {a[2:].partition("=")[0] for a in argv if a.startswith("--")}
        run(cfg, explicit)
    except (ValueError, FileNotFoundError, StopTraining) as e:  # bad input: one line; anything else keeps its trace
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGINT, previous_sigint)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
