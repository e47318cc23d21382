"""
GRPO training, end to end: `python train.py` on a CPU, `torchrun --nproc_per_node=N train.py` on
GPUs.

setup() builds everything once: process groups, the task, tokenizer and model (plus a sampler copy
in another dtype and a frozen reference when asked), the optimizer and the memory phases. step() is
one GRPO step, docs/design.md's data flow in numbered pieces:

    1. draw the step's prompts (a function of seed and step: a resumed run draws the same ones)
    2. rollout phase: sync the sampler's weights from the trainer, sample G completions per prompt
    3. decode the completions and score them with the task's reward functions
    4. group advantages over every dp rank's rewards; --dynamic_sampling repeats 1-4 (DAPO)
    5. old logprobs (mu > 1, or a sampler in another dtype) and reference logprobs (beta > 0)
    6. train phase: mu optimizer steps over the generation batch, micro-batch by micro-batch
    7. the step's metrics, token-weighted over ranks and aggregated over the mu iterations

train() runs the steps: one printed line and a metrics.jsonl record each, checkpoints (and the
curves so far as metrics.svg, plot.py), and clean stops (Ctrl-C or SIGTERM: finish the step,
checkpoint, exit 0; a fault: one line and a checkpoint).

Parallelism: world = tp x dp. The tp ranks of a dp group hold one sharded model (tp.py) and see the
same prompts and tokens; each dp group takes its own slice of the prompts; gradients are summed over
dp. Loss normalisers count the whole generation batch on all ranks, so the update does not depend
on how the batch is split.

Each knob lives in the dataclass of the file that uses it (TrainConfig here, RolloutConfig,
GRPOConfig, MemoryConfig); `--field value` is routed to its owner. `python train.py --help` lists
them all. Leaves out: pipeline parallelism, multi-node launch details, chat templates (see
--prompt_template), wandb.
Shapes: Bp prompts, G samples per prompt, N = Bp*G completions, Tr completion length.
Tested by tests/test_train.py.
"""

import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

import checkpoint
import cli
import grpo
import memory
import plan
import plot
import rollout
import tp
from hf import (build_char_tokenizer, load_config, load_generation_config, load_model,
                load_tokenizer, stop_token_ids)
from model import Llama, ModelConfig
import tasks
from tasks import Task

# -----------------------------------------------------------------------------
# Config and command line


@dataclass
class TrainConfig:
    # model
    model: str = ""                  # Hugging Face checkpoint directory; "" = a fresh tiny Llama
    dim: int = 64                    # fresh model: width
    layers: int = 2                  # fresh model: transformer blocks
    heads: int = 4                   # fresh model: attention heads
    kv_heads: int = 2                # fresh model: key/value heads (GQA)
    dtype: str = "float32"           # trainer weights: float32 or bfloat16
    sampler_dtype: str = ""          # sampler weights; "" = the trainer's own tensors (no copy)
    # task
    task: str = "tasks:reverse"      # package.module:attr, a Task or a function (task_data) -> Task
    task_data: str = ""              # passed to a task factory, e.g. tasks:jsonl_math's JSONL file
    prompt_template: str = ""        # text around "{prompt}", e.g. a chat turn; "" = the prompt
    prompts_per_step: int = 16       # Bp prompts per generation batch (over all dp ranks)
    max_prompt_len: int = 256        # longer prompts are truncated on the left (counted in the log)
    # optimisation
    steps: int = 800                 # generation batches to train on
    lr: float = 5e-4                 # peak learning rate (tiny fresh model; ~1e-6 for a real one)
    min_lr_ratio: float = 0.1        # cosine decay floor, as a fraction of lr
    warmup_steps: int = 10           # linear warmup, in optimizer steps
    weight_decay: float = 0.0        # AdamW weight decay
    grad_clip: float = 1.0           # global gradient-norm clip; 0 = off
    max_bad_steps: int = 5           # stop after this many steps in a row with no finite update
    max_unscored_steps: int = 5      # stop after this many steps in a row with no reward scored
    # evaluation
    eval_every: int = 50             # greedy completions of held-out prompts every N steps; 0 = off
    eval_prompts: int = 64           # held-out prompts (own RNG stream; training never draws them)
    # memory and threads
    phases: bool = True              # memory.py sleep/wake between phases; false = all resident
    threads: int = 1                 # CPU threads per process (1 suits tiny models); 0 = torch's
    # output
    out: str = "runs/default"        # metrics.jsonl and checkpoints go here
    overwrite: bool = False          # start over in an --out that already holds a run
    save_every: int = 100            # checkpoint every N steps and at the end; 0 = only at the end
    resume: str = ""                 # a checkpoint directory to continue exactly ("latest" = out's)
    seed: int = 0                    # init, prompts and sampling are functions of (seed, step)


# Every knob has one home: the dataclass of the file that uses it. The CLI routes --name to it.
SECTIONS = {"train": TrainConfig, "rollout": rollout.RolloutConfig, "grpo": grpo.GRPOConfig,
            "memory": memory.MemoryConfig, "parallel": tp.ParallelConfig}


@dataclass
class Configs:
    train: TrainConfig
    rollout: rollout.RolloutConfig
    grpo: grpo.GRPOConfig
    memory: memory.MemoryConfig
    parallel: tp.ParallelConfig


def parse_args(argv: list[str]) -> dict[str, object]:
    """`--field value` for every field of every section: {field: value} (cli.py)."""
    return cli.parse_args(argv, SECTIONS)


def build_configs(values: dict[str, object]) -> Configs:
    return Configs(**cli.build_configs(values, SECTIONS))


# -----------------------------------------------------------------------------
# Setup: task, model, tokenizer, optimizer, memory phases


class StopTraining(Exception):
    """A run that cannot go on (a reward function failed, no finite update for too long): one
    clear line, after a checkpoint of the last good state."""


def build_model(cfg: TrainConfig, task: Task, source: str, device: torch.device,
                groups: tp.ParallelGroups) -> tuple[Llama, object]:
    """From a HF directory (--model, or a checkpoint being resumed), or fresh: a char tokenizer for
    the task's alphabet and a tiny Llama initialised from the seed (the same on every rank)."""
    dtype = getattr(torch, cfg.dtype)
    if source:
        if groups.tp_size > 1:
            model = tp.load_sharded(source, groups, device, dtype)  # each rank reads its slice
        else:
            model = load_model(source, device=device, dtype=dtype)
        return model, load_tokenizer(source)
    if not task.alphabet:
        raise ValueError(f"task {task.name} has no alphabet for a fresh tokenizer: pass --model "
                         "DIR")
    tokenizer = build_char_tokenizer(task.alphabet)
    mcfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=cfg.dim,
                       intermediate_size=cfg.dim * 11 // 4, num_hidden_layers=cfg.layers,
                       num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       max_position_embeddings=1024, bos_token_id=tokenizer.token_to_id("<bos>"),
                       eos_token_id=tokenizer.token_to_id("<eos>"))
    model = Llama(mcfg).init_weights(cfg.seed).to(device=device, dtype=dtype)  # same on every rank
    if groups.tp_size > 1:
        tp.shard_model(model, groups)
    return model, tokenizer


def learning_rate(cfg: TrainConfig, opt_step: int, total: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if opt_step < cfg.warmup_steps:
        return cfg.lr * (opt_step + 1) / cfg.warmup_steps
    progress = min(1.0, (opt_step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


@dataclass
class Run:
    """Everything setup() builds once and step() uses."""
    cfgs: Configs
    explicit: set[str]               # options given on the command line (they beat a resume's)
    rank: int
    groups: tp.ParallelGroups
    device: torch.device
    task: Task
    tokenizer: object
    stop_ids: tuple[int, ...]        # config.json's and generation_config.json's eos ids
    generation_config: dict | None   # the source's, copied into every checkpoint
    model: Llama
    sampler: Llama                   # the trainer itself, or a copy in --sampler_dtype
    reference: Llama | None          # the initial policy, when beta > 0
    optimizer: torch.optim.Optimizer
    mem: memory.PhaseManager
    cache: rollout.KVCache
    start: int = 0                   # steps done before this process (a resumed run)
    opt_step: int = 0
    bad_in_a_row: int = 0            # steps whose every update was skipped (non-finite)
    unscored_in_a_row: int = 0       # steps with no reward scored at all
    held_out: dict[str, str] = field(default_factory=dict)  # the eval's prompt -> reference
    logits_fn: object = None         # TP: all-gather the vocab shards before sampling
    logprob_fn: object = None        # TP: vocab-parallel logprobs
    stop_signals: list = field(default_factory=list)

    @property
    def local_prompts(self) -> int:  # this dp rank's share of the generation batch
        return self.cfgs.train.prompts_per_step // self.groups.dp_size

    def phase(self, name: str):
        return self.mem.phase(name) if self.cfgs.train.phases else contextlib.nullcontext()


def resolve_configs(values: dict[str, object]) -> tuple[Configs, set[str]]:
    """The command line's configs, or a resumed run's saved ones with this command line's options
    on top."""
    explicit = set(values)
    resume = values.get("resume", "")
    if resume:
        out = values.get("out", TrainConfig.out)
        saved = checkpoint.saved_config(resume, out)
        owners = cli.field_owners(SECTIONS)
        flat = {name: value for section, fields in saved.items() for name, value in fields.items()
                if owners.get(name) == section}
        values = {**flat, **values}
    return build_configs(values), explicit


def memory_phases(device: torch.device | str, cfg: memory.MemoryConfig, model: Llama,
                  sampler: Llama, cache: rollout.KVCache, optimizer: torch.optim.Optimizer,
                  reference: Llama | None) -> memory.PhaseManager:
    """The one list of memory tags, for setup() and for --plan (on the meta device)."""
    mem = memory.PhaseManager(device, cfg)
    mem.add_weights(model, sampler)
    mem.add_kv_cache(cache.buffer)
    mem.add_grads(model)
    mem.add_optimizer(optimizer)
    if reference is not None:
        mem.add_reference(reference)
    if getattr(model, "tp_state", None) is not None:  # sequence parallelism's gathered activations
        mem.add_scratch(model.tp_state.buffer.tensors)
    return mem


def setup(values: dict[str, object]) -> Run:
    rank, world, device = tp.init_distributed()
    cfgs, explicit = resolve_configs(values)
    cfg = cfgs.train
    cli.check_config(cfgs)
    groups = tp.make_groups(cfgs.parallel.tp)
    if cfg.prompts_per_step % groups.dp_size:
        raise ValueError(f"--prompts_per_step {cfg.prompts_per_step} must be divisible by "
                         f"dp = world / tp = {groups.dp_size}")
    checkpoint.check_out_dir(cfg.out, cfg.resume, cfg.overwrite)
    if device.type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # no oversubscription
        torch.set_num_threads(cfg.threads or max(1, torch.get_num_threads() // local))
    task = tasks.load_task(cfg.task, cfg.task_data)
    resume_dir = checkpoint.resolve(cfg.resume, cfg.out) if cfg.resume else ""
    source = resume_dir or cfg.model
    model, tokenizer = build_model(cfg, task, source, device, groups)
    generation_config = load_generation_config(source) if source else None
    if cfgs.rollout.max_new_tokens == 0:  # the task's own budget
        budget = task.max_new_tokens or 256
        cfgs.rollout = dataclasses.replace(cfgs.rollout, max_new_tokens=budget)
    # The reference is the initial policy (built before any checkpoint is loaded).
    reference = None
    if cfgs.grpo.beta > 0:
        if resume_dir:
            reference = build_model(cfg, task, cfg.model, device, groups)[0]
        else:
            reference = copy.deepcopy(model)
        reference.requires_grad_(False)
    sampler = model
    if cfg.sampler_dtype and cfg.sampler_dtype != cfg.dtype:
        sampler = copy.deepcopy(model).to(getattr(torch, cfg.sampler_dtype)).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                  weight_decay=cfg.weight_decay)
    start = 0
    if resume_dir:
        start = checkpoint.load_checkpoint(resume_dir, optimizer, groups.tp_rank, groups.tp_size)
    local_prompts = cfg.prompts_per_step // groups.dp_size
    cache = rollout.KVCache.for_batch(model.config, local_prompts, cfgs.rollout.num_samples,
                                      cfg.max_prompt_len, cfgs.rollout.max_new_tokens,
                                      next(sampler.parameters()).dtype, device,
                                      tp_size=groups.tp_size)
    memory.checkpoint_blocks(model.model.layers, cfgs.memory.activation_checkpoint)
    mem = memory_phases(device, cfgs.memory, model, sampler, cache, optimizer, reference)
    stop_ids = stop_token_ids(model.config, generation_config)
    run = Run(cfgs, explicit, rank, groups, device, task, tokenizer, stop_ids, generation_config,
              model, sampler, reference, optimizer, mem, cache, start=start,
              opt_step=start * cfgs.grpo.mu)
    if cfg.eval_every:
        run.held_out = held_out_prompts(task, cfg)  # may be empty: then there is no evaluation
    if groups.tp_size > 1:
        run.logits_fn = partial(tp.gather_vocab, groups=groups)
        run.logprob_fn = partial(tp.vocab_parallel_logprobs, groups=groups)
    return run

# -----------------------------------------------------------------------------
# Prompts and rewards


def draw_prompts(run: Run, step: int, round: int = 0) -> tuple[list[list[int]], list[str], int]:
    """This rank's prompts (token ids) and references, and how many were truncated. The whole
    batch is a function of (seed, step, round) alone, so a resumed run draws the same one."""
    cfg = run.cfgs.train
    rng = random.Random(cfg.seed * 1_000_003 + step if not round else f"{cfg.seed}:{step}:{round}")
    examples = [draw_training_example(run, rng) for _ in range(cfg.prompts_per_step)]
    lo = run.groups.dp_rank * run.local_prompts
    examples = examples[lo:lo + run.local_prompts]
    ids, truncated = tokenize_prompts(run, [text for text, _ in examples])
    return ids, [ref for _, ref in examples], truncated


def draw_training_example(run: Run, rng: random.Random) -> tuple[str, str]:
    """A (prompt, reference) the evaluation does not hold out."""
    for _ in range(1000):
        example = run.task.sample(rng)
        if example[0] not in run.held_out:
            return example
    raise StopTraining(f"task {run.task.name}: 1000 draws in a row were held out for the "
                       f"evaluation; lower --eval_prompts (or --eval_every 0)")


def held_out_prompts(task: Task, cfg: TrainConfig) -> dict[str, str]:
    """The evaluation's distinct prompts and their references, from their own RNG stream. A task
    with fewer distinct prompts than --eval_prompts (the stream runs dry) holds out half of them,
    so that training keeps the other half."""
    rng = random.Random(f"eval:{cfg.seed}")
    examples: dict[str, str] = {}
    for _ in range(100 * cfg.eval_prompts):
        if len(examples) == cfg.eval_prompts:
            return examples
        prompt, reference = task.sample(rng)
        examples.setdefault(prompt, reference)
    return dict(list(examples.items())[:len(examples) // 2])


def tokenize_prompts(run: Run, texts: list[str]) -> tuple[list[list[int]], int]:
    """Token ids of each prompt (template applied, bos first), left-truncated to max_prompt_len;
    and how many were truncated."""
    cfg = run.cfgs.train
    bos = run.model.config.bos_token_id
    ids = []
    truncated = 0
    for text in texts:
        if cfg.prompt_template:
            text = cfg.prompt_template.replace("{prompt}", text)
        tokens = encode(run, text)
        if bos is not None and (not tokens or tokens[0] != bos):
            tokens = [bos] + tokens
        if len(tokens) > cfg.max_prompt_len:  # keep the end: the question sits at the end
            tokens = tokens[-cfg.max_prompt_len:]
            truncated += 1
        ids.append(tokens)
    return ids, truncated


def encode(run: Run, text: str) -> list[int]:
    try:
        return run.tokenizer.encode(text, add_special_tokens=False).ids
    except Exception:  # the tokenizers library raises plain Exceptions (e.g. no [UNK] token)
        unknown = [c for c in text if run.tokenizer.token_to_id(c) is None]
        what = f"the character {unknown[0]!r}" if unknown else "a character"
        raise StopTraining(f"task {run.task.name}: prompt {text!r} has {what} that the tokenizer "
                           f"cannot encode; a fresh model's vocabulary is the task's alphabet "
                           f"{run.task.alphabet!r}") from None


def completion_texts(run: Run, out: rollout.Rollout) -> list[str]:
    """What a reward function sees: every token the model wrote, special ones included (a <pad>
    inside an answer is the policy's doing), except the stop token that ended the row."""
    texts = []
    for tokens, stopped in zip(out.completions(), out.stopped.tolist()):
        texts.append(run.tokenizer.decode(tokens[:-1] if stopped else tokens,
                                          skip_special_tokens=False))
    return texts


# -----------------------------------------------------------------------------
# Reductions over the data-parallel ranks


def all_reduce_dp(values: list[float], run: Run, op=None) -> list[float]:
    if run.groups.dp_group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=run.device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=run.groups.dp_group)  # over dp ranks
    return t.tolist()


def gather_dp(t: torch.Tensor, run: Run) -> torch.Tensor:
    """Every dp rank's tensor, concatenated in dp-rank order (the same on every rank)."""
    if run.groups.dp_group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(run.groups.dp_size)]
    dist.all_gather(parts, t.contiguous(), group=run.groups.dp_group)  # DP: every rank's rows
    return torch.cat(parts)

# -----------------------------------------------------------------------------
# One step


def sample_round(run: Run, step: int, round: int) -> tuple[grpo.GRPOBatch, torch.Tensor, dict]:
    """Pieces 1-4 once (round > 0: dynamic sampling's other prompts): this rank's batch with its
    advantages, every rank's rewards (dp * N,) and the rollout's counts."""
    cfgs, G = run.cfgs, run.cfgs.rollout.num_samples
    t0 = time.perf_counter()
    # 1. The step's prompts.
    prompts, references, truncated = draw_prompts(run, step, round)
    try:
        rollout.check_prompts(prompts, run.stop_ids, cfgs.rollout.max_new_tokens, run.model.config)
    except ValueError as e:
        raise StopTraining(f"task {run.task.name}: {e} (lower --max_prompt_len or "
                           "--max_new_tokens)") from None
    # 2. Rollout: the sampler gets the trainer's weights, then samples G completions per prompt.
    with run.phase("rollout"):
        rollout.sync_weights(run.sampler, run.model)
        seed = cfgs.train.seed * 1_000_003 + step * 7919 + run.groups.dp_rank + (round << 40)
        out = rollout.generate(run.sampler, prompts, cfgs.rollout, stop_ids=run.stop_ids,
                               seed=seed, cache=run.cache, logits_fn=run.logits_fn)
    counts = dict(rollout=time.perf_counter() - t0, truncated=truncated,
                  lengths=float(out.mask.sum()), new_tokens=float(out.stats["new_tokens"]))
    # 3. Rewards: each reward function's score, summed as TRL sums them (None leaves one out).
    texts = completion_texts(run, out)
    per_function = tasks.score(run.task, texts, [ref for ref in references for _ in range(G)])
    weights = [weight for _, weight in run.task.rewards]
    rewards = grpo.combine_rewards(per_function, weights).to(run.device)  # (N,), NaN: missing
    all_rewards = gather_dp(rewards, run)  # (dp * N,)
    # 4. Group advantages over the whole generation batch; this rank keeps its rows.
    g = cfgs.grpo
    advantages = grpo.group_advantages(all_rewards, G, g.scale, g.std_eps, g.std_correction)
    rows = slice(run.groups.dp_rank * len(rewards), (run.groups.dp_rank + 1) * len(rewards))
    batch = grpo.GRPOBatch.from_rollout(prompts, out, cfgs.rollout.max_new_tokens, advantages[rows])
    return batch, all_rewards, counts


def step(run: Run, step: int) -> dict:
    """One GRPO step (the numbered pieces of the module docstring); returns its metrics record."""
    g, G = run.cfgs.grpo, run.cfgs.rollout.num_samples
    # 1-4. Prompts, rollout, rewards, advantages; with --dynamic_sampling N (DAPO) up to N more
    # rounds, until they hold prompts_per_step informative groups: only those are trained.
    rounds = [sample_round(run, step, 0)]
    while len(rounds) <= g.dynamic_sampling and run.cfgs.train.prompts_per_step > sum(
            int(grpo.informative_groups(rewards, G).sum()) for _, rewards, _ in rounds):
        rounds.append(sample_round(run, step, len(rounds)))
    batch, all_rewards = rounds[0][0], torch.cat([rewards for _, rewards, _ in rounds])
    if g.dynamic_sampling:  # from every rank's flags: the same choice on every rank
        batch = grpo.keep_informative([(b, grpo.informative_groups(r, G)) for b, r, _ in rounds],
                                      run.cfgs.train.prompts_per_step,
                                      run.groups.dp_rank * run.local_prompts)
    counts = {k: sum(c[k] for _, _, c in rounds) for k in rounds[0][2]}
    counts.update(extra_rollouts=len(rounds) - 1, kept_groups=batch.prompt_ids.shape[0])
    # 5. Old and reference logprobs, without grad.
    t0 = time.perf_counter()
    if g.mu > 1 or run.sampler is not run.model:
        batch.old_logp = grpo.batch_logprobs(run.model, batch, g, logprob_fn=run.logprob_fn)
    if run.reference is not None:
        with run.phase("reference"):
            batch.ref_logp = grpo.batch_logprobs(run.reference, batch, g,
                                                 logprob_fn=run.logprob_fn)
    times = {"rollout": counts.pop("rollout"), "logprobs": time.perf_counter() - t0}
    # 6. Train: mu optimizer steps over the generation batch (none when nothing was scored).
    t0 = time.perf_counter()
    scored = int((~all_rewards.isnan()).sum())
    iterations = train_phase(run, batch) if scored else []
    times["train"] = time.perf_counter() - t0
    # 7. Metrics.
    return step_record(run, step, all_rewards, counts, iterations, times)


def train_phase(run: Run, batch: grpo.GRPOBatch) -> list[dict]:
    """mu optimizer steps over the one generation batch; each iteration's metrics, summed over
    the dp ranks (token-weighted sums with their token count), and whether its update ran."""
    cfgs = run.cfgs
    counts = [batch.mask.shape[0], float(batch.loss_mask(cfgs.grpo).sum())]  # rows, loss tokens
    num_seqs, num_tokens = all_reduce_dp(counts, run)
    iterations = []
    with run.phase("train"):
        for _ in range(cfgs.grpo.mu):
            lr = learning_rate(cfgs.train, run.opt_step, cfgs.train.steps * cfgs.grpo.mu)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            run.optimizer.zero_grad(set_to_none=True)
            sp = contextlib.nullcontext()
            if run.groups.tp_size > 1:
                sp = tp.sequence_parallel(run.model, cfgs.parallel.sequence_parallel)
            with sp, run.mem.activations(run.model):
                m = grpo.accumulate(run.model, batch, cfgs.grpo, logprob_fn=run.logprob_fn,
                                    num_seqs=int(num_seqs), num_tokens=max(1, int(num_tokens)))
            tp.DataParallelGrads(run.model, run.groups).all_reduce()
            m["grad_norm"] = tp.clip_grad_norm(run.model, cfgs.train.grad_clip or math.inf,
                                               run.groups)
            # A non-finite loss or gradient anywhere: skip this update on every rank.
            finite = math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
            (all_finite,) = all_reduce_dp([float(finite)], run, dist.ReduceOp.MIN)
            m["updated"] = bool(all_finite)
            if m["updated"]:
                run.optimizer.step()
                run.opt_step += 1
            run.optimizer.zero_grad(set_to_none=True)
            iterations.append(reduce_iteration(run, m, m["tokens"]))
    return iterations


def reduce_iteration(run: Run, m: dict, tokens: float) -> dict:
    """One iteration's metrics over the dp ranks: the loss summed (each is normalised by global
    counts), the min of *_min and max of *_max, token-weighted means of the rest."""
    extremes = {k: -1 if k.endswith("_min") else 1 for k in sorted(m) if k[-4:] in ("_min", "_max")}
    keys = sorted(k for k in m if k not in ("loss", "tokens", "grad_norm", "updated", *extremes))
    sums = all_reduce_dp([m["loss"], tokens] + [m[k] * tokens for k in keys], run)
    peaks = all_reduce_dp([s * m[k] for k, s in extremes.items()], run, dist.ReduceOp.MAX)
    return dict(loss=sums[0], grad_norm=m["grad_norm"], updated=m["updated"],
                **{k: s / max(sums[1], 1.0) for k, s in zip(keys, sums[2:])},
                **{k: s * p for (k, s), p in zip(extremes.items(), peaks)})


def step_record(run: Run, step: int, rewards: torch.Tensor, counts: dict,
                iterations: list[dict], times: dict) -> dict:
    """The step as one JSON-able dict (null for what did not happen). rewards: every round's."""
    scored = rewards[~rewards.isnan()]
    keys = ("lengths", "new_tokens", "truncated", "kept_groups")
    lengths, tokens, truncated, kept = all_reduce_dp([counts[k] for k in keys], run)
    updated = [it for it in iterations if it["updated"]]
    record = dict(step=step + 1, reward=scored.mean().item() if len(scored) else None,
                  reward_std=scored.std().item() if len(scored) > 1 else None,
                  missing_rewards=len(rewards) - len(scored), truncated_prompts=int(truncated),
                  completion_len=lengths / len(rewards),
                  tokens_per_s=tokens / max(times["rollout"], 1e-9), kept_groups=int(kept),
                  zero_std=float((~grpo.informative_groups(
                      rewards, run.cfgs.rollout.num_samples)).double().mean()),
                  extra_rollouts=counts["extra_rollouts"], updates=len(updated),
                  skipped_updates=len(iterations) - len(updated))
    metrics = ["loss", "clip_low", "clip_high", "ratio_mean", "kl", "entropy"]
    metrics += [k for k in (iterations[0] if iterations else {})
                if k not in (*metrics, "grad_norm", "updated")]
    for key in metrics:  # over the mu iterations
        values = [it[key] for it in iterations if key in it]
        pick = min if key.endswith("_min") else max if key.endswith("_max") else None
        record[key] = (pick(values) if pick else sum(values) / len(values)) if values else None
    norms = [it["grad_norm"] for it in updated]
    # sampler_logp_diff before any update of this step: the sampler's logprobs up to numerics
    record.update({f"t_{k}": v for k, v in times.items()}, peak_gb=peak_memory(run),
                  sampler_logp_diff=iterations[0].get("sampler_logp_diff") if iterations else None,
                  grad_norm=sum(norms) / len(norms) if norms else None,
                  lr=run.optimizer.param_groups[0]["lr"])
    return record


def evaluate(run: Run) -> dict:
    """Greedy completions of the held-out prompts (each dp rank a share), scored by the task's own
    reward functions: the mean reward and, where the task defines one, the share fully correct."""
    t0 = time.perf_counter()
    items = list(run.held_out.items())[run.groups.dp_rank::run.groups.dp_size]
    greedy = dataclasses.replace(run.cfgs.rollout, num_samples=1, temperature=0.0)
    rewards = []
    correct = 0
    for first in range(0, len(items), run.local_prompts):  # batches the KV cache was sized for
        part = items[first:first + run.local_prompts]
        prompts, _ = tokenize_prompts(run, [prompt for prompt, _ in part])
        with run.phase("rollout"):
            rollout.sync_weights(run.sampler, run.model)
            out = rollout.generate(run.sampler, prompts, greedy, stop_ids=run.stop_ids,
                                   cache=run.cache, logits_fn=run.logits_fn)
        texts = completion_texts(run, out)
        references = [ref for _, ref in part]
        weights = [weight for _, weight in run.task.rewards]
        rewards.append(grpo.combine_rewards(tasks.score(run.task, texts, references), weights))
        if run.task.correct is not None:
            correct += sum(bool(run.task.correct(t, r)) for t, r in zip(texts, references))
    scores = torch.cat(rewards) if rewards else torch.zeros(0, dtype=torch.float64)
    scored = scores[~scores.isnan()]
    total, count, right, prompts = all_reduce_dp(
        [scored.sum().item(), len(scored), correct, len(items)], run)
    return dict(eval_reward=total / count if count else None,
                eval_correct=right / prompts if run.task.correct is not None else None,
                t_eval=time.perf_counter() - t0)


def peak_memory(run: Run) -> float:
    """GB: the peak of max_memory_allocated over all phases on a GPU, peak RSS on a CPU."""
    if run.device.type == "cuda":
        return max(run.mem.peak_bytes(), torch.cuda.max_memory_allocated(run.device)) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def print_plan(argv: list[str]) -> int:
    """--plan: each rank's bytes per tag and phase, the transients and the peak, from config.json
    (or the fresh model's flags) and the run's flags, on the meta device: no weight is read.
    WORLD_SIZE (as torchrun sets it) gives dp = world / tp."""
    cfgs = build_configs(parse_args([a for a in argv if a != "--plan"]))
    cli.check_config(cfgs)
    cfg = cfgs.train
    task = tasks.load_task(cfg.task, cfg.task_data)
    world = int(os.environ.get("WORLD_SIZE", 1))
    groups = tp.ParallelGroups(None, None, tp_size=cfgs.parallel.tp,
                               dp_size=max(1, world // cfgs.parallel.tp))
    dtype = getattr(torch, cfg.dtype)
    with torch.device("meta"):  # shapes only
        if cfg.model:
            model = tp.shard_model(Llama(load_config(cfg.model)).to(dtype), groups)
        else:
            model = build_model(cfg, task, "", torch.device("meta"), groups)[0]
    sampler = model
    if cfg.sampler_dtype and cfg.sampler_dtype != cfg.dtype:
        sampler = copy.deepcopy(model).to(getattr(torch, cfg.sampler_dtype))
    sampler_dtype = next(sampler.parameters()).dtype
    budget = cfgs.rollout.max_new_tokens or task.max_new_tokens or 256  # as setup()
    r = dataclasses.replace(cfgs.rollout, max_new_tokens=budget)
    Bp = cfg.prompts_per_step // groups.dp_size
    P = cfg.max_prompt_len  # the longest prompt
    cache = rollout.KVCache.for_batch(model.config, Bp, r.num_samples, P, r.max_new_tokens,
                                      sampler_dtype, "meta", tp_size=groups.tp_size)
    reference = None
    if cfgs.grpo.beta > 0:
        reference = copy.deepcopy(model).requires_grad_(False)
    mem = memory_phases("meta", cfgs.memory, model, sampler, cache,
                        torch.optim.AdamW(model.parameters()), reference)
    transients = plan.step_transients(
        model.config, Bp, P, r, cfgs.grpo, dtype, sampler_dtype,
        checkpoint=cfgs.memory.activation_checkpoint, tp_size=groups.tp_size,
        sequence_parallel=cfgs.parallel.sequence_parallel,
        old=cfgs.grpo.mu > 1 or sampler is not model)
    target = "cuda" if torch.cuda.is_available() else "cpu"
    title = (f"tp {groups.tp_size} x dp {groups.dp_size}; {Bp} prompts x {P} + "
             f"{r.max_new_tokens} tokens x G {r.num_samples}")
    plan.print_plan(mem, transients, target, cfg.phases, reference is not None, title)
    return 0

# -----------------------------------------------------------------------------
# The loop


def save(run: Run, step: int) -> str:
    """A checkpoint (collective: every rank calls it). A sharded model is gathered into the full
    tensors a one-process model has, so TP and TP=1 checkpoints hold the same tensors."""
    g = run.groups
    if g.tp_size > 1:
        tensors = tp.full_state_dict(run.model, g)  # collective over the tp ranks
    else:
        tensors = {name: p.detach() for name, p in run.model.named_parameters()}
    return checkpoint.save_checkpoint(run.cfgs.train.out, step, run.model.config, tensors,
                                      run.tokenizer, run.optimizer, dataclasses.asdict(run.cfgs),
                                      tp_rank=g.tp_rank, tp_size=g.tp_size, dp_rank=g.dp_rank,
                                      generation_config=run.generation_config)


def check_health(run: Run, record: dict) -> None:
    """Stop a run that is going nowhere, after a checkpoint of its last good state."""
    cfg = run.cfgs.train
    no_update = record["skipped_updates"] > 0 and record["updates"] == 0
    run.bad_in_a_row = run.bad_in_a_row + 1 if no_update else 0
    run.unscored_in_a_row = run.unscored_in_a_row + 1 if record["reward"] is None else 0
    if run.bad_in_a_row >= cfg.max_bad_steps:
        path = save(run, record["step"])
        raise StopTraining(f"{run.bad_in_a_row} steps in a row had no finite update (non-finite "
                           f"loss or gradients); stopped, last good state at {path}")
    if run.unscored_in_a_row >= cfg.max_unscored_steps:
        path = save(run, record["step"])
        raise StopTraining(f"{run.unscored_in_a_row} steps in a row had no reward scored (every "
                           f"reward function returned None); stopped, checkpoint at {path}")


def train(run: Run) -> None:
    cfg = run.cfgs.train
    metrics_file = ""
    if run.rank == 0:
        metrics_file = checkpoint.start_out_dir(cfg.out, cfg.resume, cfg.overwrite, run.start)
    bar = tqdm(range(run.start, cfg.steps), initial=run.start, total=cfg.steps,
               disable=run.rank != 0, dynamic_ncols=True)
    for i in bar:
        try:
            record = step(run, i)
            due = i == 0 or (i + 1) % max(cfg.eval_every, 1) == 0 or i + 1 == cfg.steps
            if run.held_out and due:
                record.update(evaluate(run))
        except (StopTraining, tasks.RewardError):
            save(run, i)  # nothing lost: the state after the last finished step
            raise
        if run.rank == 0:
            with open(metrics_file, "a") as f:
                f.write(json.dumps(cli.jsonable(record), allow_nan=False) + "\n")
            bar.write(cli.step_line(record, cfg.steps, run.cfgs.grpo.beta))
            if i == run.start and cfg.phases:
                bar.write(run.mem.report())
        check_health(run, record)
        # A signal seen by any rank stops every rank after this same step.
        (stop,) = all_reduce_dp([float(bool(run.stop_signals))], run, dist.ReduceOp.MAX)
        if run.groups.tp_group is not None:
            stop_t = torch.tensor([stop], device=run.device)
            dist.all_reduce(stop_t, op=dist.ReduceOp.MAX, group=run.groups.tp_group)  # over tp
            stop = stop_t.item()
        last = i + 1 == cfg.steps
        if last or stop or (cfg.save_every and (i + 1) % cfg.save_every == 0):
            path = save(run, i + 1)
            if run.rank == 0:  # the curves so far, next to metrics.jsonl
                plot.write_svg([cfg.out], os.path.join(cfg.out, "metrics.svg"), title=cfg.out)
            if stop:
                if run.rank == 0:
                    bar.write(f"interrupted: checkpoint at {path}; continue with --resume {path}")
                break
    bar.close()


def on_stop_signal(run: Run, signum: int, frame) -> None:
    """Ctrl-C (SIGINT) or preemption (SIGTERM from torchrun, Slurm, Kubernetes): finish the step,
    checkpoint, exit 0. A second Ctrl-C interrupts at once."""
    run.stop_signals.append(signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        cli.print_help(SECTIONS)
        return 0
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    finished = False  # every rank got through: the groups can meet at a last barrier
    try:
        if "--plan" in argv:
            return print_plan(argv)
        run = setup(parse_args(argv))
        for s in handlers:
            signal.signal(s, partial(on_stop_signal, run))
        train(run)
        finished = True
    except (ValueError, FileNotFoundError, StopTraining) as e:  # one line; else: a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if dist.is_initialized():
            tp.destroy_groups(barrier=finished)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
