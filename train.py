"""
GRPO training, end to end: `python train.py` on a CPU, `torchrun --nproc_per_node=N train.py` on
GPUs.

setup() builds everything once: process groups, the task, the policy's models (run/models.py: the
trainer and its tokenizer, a sampler copy in another dtype and a frozen reference when asked;
LoRA's adapters on a frozen base), the optimizer and the memory phases. step() is one GRPO step,
docs/design.md's data flow in numbered pieces:

    1. draw the step's prompts (a function of seed and step: a resumed run draws the same ones)
    2. rollout phase: sync the sampler's weights from the trainer, roll out G completions per prompt
       (with a task's tool, multi-turn episodes: tools/ answers, rollout.py continues the row)
    3. decode the completions and score them with the task's reward functions
    4. group advantages over every dp rank's rewards; --dynamic_sampling repeats 1-4 (DAPO)
    5. old logprobs (mu > 1; at mu = 1 they are the loss's logp.detach()), reference (beta > 0)
    6. train phase: mu optimizer steps over the generation batch, micro-batch by micro-batch
    7. the step's metrics, token-weighted over ranks and aggregated over the mu iterations

train() runs the steps: one printed line and a metrics.jsonl record each (run/report.py), the
evaluation's completions (samples.jsonl), checkpoints (and the curves so far as metrics.svg,
run/plot.py), and clean stops (Ctrl-C or SIGTERM: finish the step, checkpoint, exit 0; a fault or a
run going nowhere: one line and a checkpoint).

Parallelism: world = tp x dp. The tp ranks of a dp group hold one sharded model (tp.py) and see the
same prompts and tokens (the first calls the task's tool: tools/runtime.py); each dp group takes its
own slice of the prompts; gradients are summed over dp (tp.py gathers rewards and sums counts and
metrics). Loss normalisers count the whole generation batch on all ranks, so the update does not
depend on how the batch is split.

Each knob lives in the dataclass of the file that uses it; `--field value` is routed to its owner
(run/cli.py). --dtype bfloat16: fp32 master weights and AdamW state, bf16 autocast, a bf16 sampler
(engine/precision.py); on a CPU without native bf16, bf16's values multiplied in float32, said at start.
Leaves out: pipeline parallelism, multi-node launch details, wandb.
Shapes: Bp prompts, G rows per prompt (its group), R = Bp*G rows, Tc completion length.
Tested by tests/test_train.py.
"""

import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

import grpo
import lora
import memory
import rollout
import tasks
import tools
import tp
from engine import compiling, precision
from engine import tokenizer as tk
from engine.decode import KVCache
from engine.hf import load_config, load_generation_config, load_model, save_model, stop_token_ids
from model import Llama
from run import checkpoint, cli, models, plan, plot, report
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
    dtype: str = "float32"           # compute: float32, or bfloat16 (fp32 master weights, autocast)
    cpu_bf16: str = "auto"           # CPU bf16 kernels: auto (AVX512_BF16/AMX; else float32), true
    sampler_dtype: str = ""          # sampler weights; "" = --dtype (bf16: a copy of the master)
    compile_blocks: str = "auto"     # blocks' training forward compiled: auto (CUDA), true, false
    compile_cache: str = "runs/compile_cache"  # torch's compile caches, kept for the next run
    # task
    task: str = "tasks:reverse"      # package.module:attr, a Task or a function (task_data) -> Task
    task_data: str = ""              # passed to a task factory, e.g. tasks:jsonl_math's JSONL file
    eval_data: str = ""              # the eval's test split, task_data's format; "" = held out
    prompts_per_step: int = 16       # Bp prompts per generation batch (over all dp ranks)
    max_prompt_len: int = 256        # longer prompts are truncated on the left (counted in the log)
    # optimisation
    steps: int = 800                 # generation batches to train on
    lr: float = 1e-3                 # peak learning rate (fresh model; 1e-6 with --model)
    min_lr_ratio: float = 0.1        # cosine decay floor, as a fraction of lr
    warmup_steps: int = 10           # linear warmup, in optimizer steps
    weight_decay: float = 0.0        # AdamW weight decay
    grad_clip: float = 1.0           # global gradient-norm clip; 0 = off
    max_bad_steps: int = 5           # stop after this many steps in a row with no finite update
    max_unscored_steps: int = 5      # stop after this many steps in a row with no reward scored
    max_flat_steps: int = 50         # stop after N steps in a row of all-equal groups; 0 = off
    # evaluation
    eval_every: int = 50             # completions of held-out prompts every N steps; 0 = off
    eval_prompts: int = 64           # held-out prompts (own RNG stream; training never draws them)
    eval_temperature: float = 0.0    # 0 = greedy; a thinking model's (Qwen3: 0.6; greedy loops)
    eval_top_p: float = 1.0          # 1 = off (Qwen3 thinking: 0.95)
    eval_top_k: int = 0              # 0 = off (Qwen3 thinking: 20)
    eval_samples: int = 1            # k completions per held-out prompt: mean correct and pass@k
    show_samples: int = 3            # held-out completions printed per eval (samples.jsonl: all)
    show_rollouts: int = 0           # sampled completions printed after each step line
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
SECTIONS = {"train": TrainConfig, "prompt": tk.PromptConfig, "rollout": rollout.RolloutConfig,
            "tools": tools.ToolConfig, "grpo": grpo.GRPOConfig, "memory": memory.MemoryConfig,
            "parallel": tp.ParallelConfig, "lora": lora.LoRAConfig}


@dataclass
class Configs:
    train: TrainConfig
    prompt: tk.PromptConfig
    rollout: rollout.RolloutConfig
    tools: tools.ToolConfig
    grpo: grpo.GRPOConfig
    memory: memory.MemoryConfig
    parallel: tp.ParallelConfig
    lora: lora.LoRAConfig


def parse_args(argv: list[str]) -> dict[str, object]:
    """`--field value` for every field of every section: {field: value} (run/cli.py)."""
    return cli.parse_args(argv, SECTIONS)


def build_configs(values: dict[str, object]) -> Configs:
    return Configs(**cli.build_configs(values, SECTIONS))


# -----------------------------------------------------------------------------
# Setup: task, model, tokenizer, optimizer, memory phases


class StopTraining(Exception):
    """A run that cannot go on (a reward function failed, no finite update for too long): one
    clear line, after a checkpoint of the last good state."""


def together(run, fn, *args):
    """fn(*args), which may fail on one rank alone (a reward function, a prompt too long, logits
    that turned NaN in one rank's rollout): all stop here, at the same step. A lone rank that
    raised would leave the others in a collective."""
    error = None
    try:
        result = fn(*args)
    except (StopTraining, tasks.RewardError, tools.ToolFailure, rollout.NonFiniteLogits) as e:
        error = e
    if tp.any_rank(error is not None, run.device):
        if str(error or "") and run.rank != 0:  # rank 0 prints its own at exit; another's, here
            print(f"error: {error}", file=sys.stderr, flush=True)
        raise StopTraining(str(error or "") if run.rank == 0 else "")
    return result


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
    rank: int
    ranks: tp.ParallelGroups
    device: torch.device
    task: Task
    tokenizer: tk.PromptTokenizer
    stop_ids: tuple[int, ...]        # config.json's and generation_config.json's eos ids
    tools: tools.TaskTools | None    # the task's tools as this run calls them (tools/)
    generation_config: dict | None   # the source's, copied into every checkpoint
    model: Llama
    sampler: Llama                   # the trainer itself, or a copy in --sampler_dtype
    reference: Llama | None          # the initial policy, when beta > 0
    optimizer: torch.optim.Optimizer
    mem: memory.PhaseManager
    cache: KVCache
    start: int = 0                   # steps done before this process (a resumed run)
    opt_step: int = 0
    health: report.Health | None = None  # steps in a row that went nowhere
    eval: tasks.EvalSplit = field(default_factory=lambda: tasks.EvalSplit([]))  # the eval's prompts
    logits_fn: object = None         # TP: all-gather the vocab shards before sampling
    logprob_fn: object = None        # TP: vocab-parallel logprobs
    signals: checkpoint.StopSignals = field(default_factory=checkpoint.StopSignals)
    notes: list[str] = field(default_factory=list)  # lines printed at the first step

    @property
    def calls_tools(self) -> bool:  # a tool is called (--use_tools false: a call is text)
        return self.tools is not None and bool(self.tools.call_ids)

    @property
    def local_prompts(self) -> int:  # this dp rank's share of the generation batch
        return self.cfgs.train.prompts_per_step // self.ranks.dp_size

    def phase(self, name: str):
        return self.mem.phase(name) if self.cfgs.train.phases else contextlib.nullcontext()


def setup(values: dict[str, object]) -> Run:
    rank, world, device = tp.init_distributed()
    changes, explicit = [], set(values)  # a resumed run: the checkpoint's flags, these on top
    if values.get("resume"):
        owners = cli.field_owners(SECTIONS)
        values, changes = checkpoint.resume_values(values, owners, TrainConfig.out,
                                                   cli.renamed_fields())
    cfgs = build_configs(values)
    cli.check_config(cfgs)
    lora.check_flags(cfgs)
    notes = [cli.recipe_defaults(cfgs, explicit)]
    cfg = cfgs.train
    ranks = tp.make_groups(cfgs.parallel.tp)
    cli.check_dp(cfg.prompts_per_step, ranks.dp_size)
    cli.check_eval_samples(cfg.eval_samples, cfg.prompts_per_step // ranks.dp_size,
                           cfgs.rollout.num_samples)
    checkpoint.check_out_dir(cfg.out, cfg.resume, cfg.overwrite)
    checkpoint.lock_out_dir(cfg.out)  # one run per --out, before anything is written there
    if rank == 0 and changes:
        print(f"resuming {cfg.resume} with: {'; '.join(changes)}")
    if device.type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # no oversubscription
        torch.set_num_threads(cfg.threads or max(1, torch.get_num_threads() // local))
    task = tasks.load_task(cfg.task, cfg.task_data)
    resume_dir = checkpoint.resolve(cfg.resume, cfg.out) if cfg.resume else ""
    source = resume_dir or cfg.model
    if cfgs.lora.use_peft:  # a LoRA checkpoint holds the adapter: the base is --model's
        source = cfg.model
    budget = cfgs.rollout.max_new_tokens or task.max_new_tokens or 256  # 0: the task's own
    cfgs.rollout = dataclasses.replace(cfgs.rollout, max_new_tokens=budget)
    config = load_config(source) if source else None
    cli.check_budget(budget, config.max_position_embeddings if config else 1024)
    # bf16 without a CPU's bf16 kernels
    note = precision.cpu_precision(cfg, device, config, cfgs.lora.use_peft)
    if note and rank == 0:  # at once: a run's first step can take minutes on a CPU
        print(note, flush=True)
    # The trainer, the sampler and the reference (the initial policy: built before any checkpoint
    # is loaded), compiled and checkpointed as the flags say; LoRA's config as its adapters are.
    model, tokenizer, sampler, reference, cfgs.lora, built = models.build(cfgs, task, source,
                                                                          resume_dir, device, ranks)
    notes += built
    generation_config = load_generation_config(source) if source else None
    optimizer = torch.optim.AdamW(lora.trainable(model), lr=cfg.lr, betas=(0.9, 0.99),
                                  weight_decay=cfg.weight_decay, fused=True)  # run/plan.py's NOTE
    start = 0
    if resume_dir:
        start = checkpoint.load_checkpoint(resume_dir, optimizer, ranks.tp_rank, ranks.tp_size)
    local_prompts = cfg.prompts_per_step // ranks.dp_size
    cache = KVCache.for_batch(model.config, local_prompts, cfgs.rollout.num_samples,
                                      cfg.max_prompt_len, cfgs.rollout.max_new_tokens,
                                      next(sampler.parameters()).dtype, device,
                                      tp_size=ranks.tp_size)
    mem = plan.memory_phases(device, cfgs.memory, model, sampler, cache, optimizer, reference)
    # --memory_budget's micro-batch and chunk, or the default's bound
    cfgs.grpo = plan.fit(mem, cfgs, model, sampler, reference, local_prompts, ranks.tp_size,
                         device.type, explicit)
    stop_ids = stop_token_ids(model.config, generation_config)
    task, task_tools, note = tools.setup(task, tokenizer, stop_ids, cfgs.tools, cfgs.prompt, ranks)
    notes.append(note)
    run = Run(cfgs, rank, ranks, device, task, tokenizer, stop_ids, task_tools,
              generation_config, model, sampler, reference, optimizer, mem, cache, start=start,
              opt_step=start * cfgs.grpo.mu,
              health=report.Health(cfg.max_bad_steps, cfg.max_unscored_steps, cfg.max_flat_steps))
    if cfg.eval_every:  # the split may be empty: then there is no evaluation
        eval_task = None
        if cfg.eval_data:
            eval_task = tasks.load_task(cfg.task, cfg.eval_data, "--eval_data")
        run.eval = tasks.eval_split(task, eval_task, cfg.eval_prompts, cfg.seed)
        notes.append(run.eval.note)
    run.notes = [note for note in notes if note]
    if ranks.tp_size > 1:
        run.logits_fn = partial(tp.gather_vocab, ranks=ranks)
        run.logprob_fn = partial(tp.vocab_parallel_logprobs, ranks=ranks)
    return run



# -----------------------------------------------------------------------------
# Prompts and rewards


def draw_prompts(run: Run, step: int, round: int = 0) -> tuple[list[list[int]], list[tuple], int,
                                                              tools.Responder | None]:
    """This rank's prompts as token ids, its (prompt, reference) examples, how many prompts were
    truncated, and the rollout's tool (its environments reset, their text in the prompts). The
    whole batch is a function of (seed, step, round) alone, so a resumed run draws the same one."""
    cfg = run.cfgs.train
    rng = random.Random(cfg.seed * 1_000_003 + step if not round else f"{cfg.seed}:{step}:{round}")
    try:
        examples = [tasks.draw_training_example(run.task, run.eval, rng)
                    for _ in range(cfg.prompts_per_step)]
    except ValueError as e:
        raise StopTraining(str(e)) from None
    lo = run.ranks.dp_rank * run.local_prompts
    examples = examples[lo:lo + run.local_prompts]
    responder = run.tools.start(examples, run.cfgs.rollout.num_samples) if run.tools else None
    examples = responder.examples if responder else examples
    ids, truncated = encode_prompts(run, [prompt for prompt, _ in examples])
    return ids, examples, truncated, responder


def encode_prompts(run: Run, prompts: list) -> tuple[list[list[int]], int]:
    """Token ids as transformers/TRL would encode them (engine/tokenizer.py), left-truncated, and checked
    against the model's context."""
    hint = ""
    try:
        ids, truncated = run.tokenizer.encode_prompts(
            prompts, run.cfgs.prompt, run.cfgs.train.max_prompt_len,
            run.tools.schemas if run.tools else None)
        hint = " (lower --max_prompt_len or --max_new_tokens)"
        if ids:
            rollout.check_prompts(ids, run.stop_ids, run.cfgs.rollout.max_new_tokens,
                                  run.model.config)
    except ValueError as e:
        raise StopTraining(f"task {run.task.name}: {e}{hint}") from None
    return ids, truncated


def roll_out(run: Run, prompts: list[list[int]], cfg: rollout.RolloutConfig, seed: int | None,
             responder: tools.Responder | None) -> rollout.Rollout:
    """The rollout: rollout.generate with this run's sampler, cache and stops, and the task's
    tool (the responder's episodes)."""
    with run.phase("rollout"):
        rollout.sync_weights(run.sampler, run.model)
        return rollout.generate(run.sampler, prompts, cfg, stop_ids=run.stop_ids, seed=seed,
                                cache=run.cache, logits_fn=run.logits_fn,
                                episodes=responder.episodes if responder else None)


def completion_texts(run: Run, out: rollout.Rollout, responder: tools.Responder | None) -> list:
    """What the reward functions see: each row's text without its stop token; for a task with a
    tool, a tools.Completion each (the model's text told from the tool's observations, the messages,
    the environment). Error messages' characters the tokenizer lacks are said once."""
    ids, stopped = out.completions(), out.stopped.tolist()
    texts = run.tokenizer.decode_completions(ids, stopped)
    if responder is None:
        return texts
    note = run.tools.dropped_note()
    if note and run.rank == 0:
        print(note, flush=True)
    own = out.sampled.tolist() if out.sampled is not None else [[True] * len(x) for x in ids]
    return responder.completions(texts, ids, stopped, own)

# -----------------------------------------------------------------------------
# One step


def rollout_round(run: Run, step: int, round: int) -> tuple[grpo.GRPOBatch, torch.Tensor, dict]:
    """Pieces 1-4 once (round > 0: dynamic sampling's other prompts): this rank's batch with its
    advantages, every rank's rewards (dp * R,) and the rollout's counts."""
    cfgs, G = run.cfgs, run.cfgs.rollout.num_samples
    t0 = time.perf_counter()
    # 1. The step's prompts (each dp rank checks its own: they stop together).
    prompts, examples, truncated, responder = together(run, draw_prompts, run, step, round)
    # 2. Rollout: the sampler gets the trainer's weights, then samples G completions per prompt
    # (with a tool: episodes, each rank calling the tool for its own rows).
    seed = cfgs.train.seed * 1_000_003 + step * 7919 + run.ranks.dp_rank + (round << 40)
    out = together(run, roll_out, run, prompts, cfgs.rollout, seed, responder)
    counts = dict(rollout=time.perf_counter() - t0, truncated=truncated,
                  lengths=float(out.mask.sum()), new_tokens=float(out.stats["new_tokens"]),
                  tool_calls=sum(out.stats.get("calls", [])),
                  tool_errors=responder.errors(out.stats["calls"]) if run.calls_tools else 0)
    # 3. Rewards: each reward function's score, summed as TRL sums them (None leaves one out).
    stopped = out.stopped.tolist()
    texts = completion_texts(run, out, responder)
    examples = [example for example in examples for _ in range(G)]  # (R,)
    references = [ref for _, ref in examples]
    rewards = together(run, tasks.total_rewards, run.task, texts, references, examples)
    counts["correct"] = sum(together(run, tasks.correct_flags, run.task, texts, references) or [])
    counts["shown"] = [dict(prompt=p, completion=t, reference=r, reward=x, stopped=s)
                       for (p, r), t, x, s in zip(examples, texts, rewards.tolist(), stopped)
                       ][:cfgs.train.show_rollouts]  # this rank's first rows, for the log
    all_rewards = tp.dp_gather(rewards.to(run.device), run.ranks)  # (dp * R,)
    # 4. Group advantages over the whole generation batch; this rank keeps its rows.
    g = cfgs.grpo
    advantages = grpo.group_advantages(all_rewards, G, g.scale, g.std_eps, g.std_correction)
    rows = slice(run.ranks.dp_rank * len(rewards), (run.ranks.dp_rank + 1) * len(rewards))
    batch = grpo.GRPOBatch.from_rollout(prompts, out, cfgs.rollout.max_new_tokens, advantages[rows])
    return batch, all_rewards, counts


def step(run: Run, step: int) -> tuple[dict, list[dict]]:
    """One GRPO step (the numbered pieces of the module docstring); returns its metrics record
    and the first --show_rollouts of its sampled completions."""
    g, G = run.cfgs.grpo, run.cfgs.rollout.num_samples
    compiled = compiling.compile_seconds()  # so far in this process: the step's is the difference
    # 1-4. Prompts, rollout, rewards, advantages; with --dynamic_sampling N (DAPO) up to N more
    # rounds, until they hold prompts_per_step informative groups: only those are trained.
    rounds = [rollout_round(run, step, 0)]
    while len(rounds) <= g.dynamic_sampling and run.cfgs.train.prompts_per_step > sum(
            int(grpo.informative_groups(rewards, G).sum()) for _, rewards, _ in rounds):
        rounds.append(rollout_round(run, step, len(rounds)))
    batch, all_rewards = rounds[0][0], torch.cat([rewards for _, rewards, _ in rounds])
    if g.dynamic_sampling:  # from every rank's flags: the same choice on every rank
        batch = grpo.keep_informative([(b, grpo.informative_groups(r, G)) for b, r, _ in rounds],
                                      run.cfgs.train.prompts_per_step,
                                      run.ranks.dp_rank * run.local_prompts)
    shown = rounds[0][2].pop("shown")
    counts = {k: sum(c[k] for _, _, c in rounds) for k in rounds[0][2] if k != "shown"}
    counts.update(extra_rollouts=len(rounds) - 1, kept_groups=batch.prompt_ids.shape[0])
    # 5. Old and reference logprobs, without grad.
    t0 = time.perf_counter()
    if g.mu > 1:  # at mu = 1 the ratio is to the current policy: logp.detach() in the loss
        with precision.autocast(run.cfgs.train, run.device):
            batch.old_logp = grpo.batch_logprobs(run.model, batch, g, logprob_fn=run.logprob_fn)
    if g.beta > 0:  # with LoRA the reference is the trainer with its adapters off (lora.py)
        reference = run.model if run.reference is None else run.reference
        with run.phase("reference"), precision.autocast(run.cfgs.train, run.device), \
                lora.adapters_off(reference):
            batch.ref_logp = grpo.batch_logprobs(reference, batch, g, logprob_fn=run.logprob_fn)
    times = {"rollout": counts.pop("rollout"), "logprobs": time.perf_counter() - t0}
    # 6. Train: mu optimizer steps over the generation batch (none when nothing was scored).
    t0 = time.perf_counter()
    scored = int((~all_rewards.isnan()).sum())
    iterations = train_phase(run, batch) if scored else []
    times["train"] = time.perf_counter() - t0
    times["compile"] = compiling.compile_seconds() - compiled  # inside the times above
    # 7. Metrics, and the completions the log shows (not written to metrics.jsonl).
    return step_record(run, step, all_rewards, counts, iterations, times), shown


def train_phase(run: Run, batch: grpo.GRPOBatch) -> list[dict]:
    """mu optimizer steps over the one generation batch; each iteration's metrics, summed over
    the dp ranks (token-weighted sums with their token count), and whether its update ran."""
    cfgs = run.cfgs
    counts = [batch.mask.shape[0], float(batch.loss_mask(cfgs.grpo).sum())]  # rows, loss tokens
    num_seqs, num_tokens = tp.dp_all_reduce(counts, run.ranks, run.device)
    iterations = []
    trim = partial(memory.return_freed_memory, run.device) if run.device.type == "cpu" else None
    with run.phase("train"):
        for _ in range(cfgs.grpo.mu):
            lr = learning_rate(cfgs.train, run.opt_step, cfgs.train.steps * cfgs.grpo.mu)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            run.optimizer.zero_grad(set_to_none=True)
            sp = (tp.sequence_parallel(run.model, cfgs.parallel.sequence_parallel)
                  if run.ranks.tp_size > 1 else contextlib.nullcontext())
            with sp, run.mem.activations(run.model), precision.autocast(cfgs.train, run.device):
                m = grpo.accumulate(run.model, batch, cfgs.grpo, logprob_fn=run.logprob_fn,
                                    num_seqs=int(num_seqs), num_tokens=max(1, int(num_tokens)),
                                    before_backward=trim)  # the CPU's heap: memory.py
            tp.dp_sum_grads(run.model, run.ranks)
            m["grad_norm"] = tp.clip_grad_norm(run.model, cfgs.train.grad_clip or math.inf,
                                               run.ranks)
            # A non-finite loss or gradient anywhere: skip this update on every rank. A gradient
            # of exactly 0 (every advantage 0) still steps AdamW, as TRL does (its momentum
            # moves the weights), but is counted apart from the updates that learned something.
            # The schedule advances on every step, as torch's schedulers do: the lr is a
            # function of the step, and a resumed run rebuilds it from the step.
            finite = math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
            (all_finite,) = tp.dp_all_reduce([float(finite)], run.ranks, run.device,
                                          dist.ReduceOp.MIN)
            m["finite"] = bool(all_finite)
            m["updated"] = m["finite"] and m["grad_norm"] > 0
            if m["finite"]:
                run.optimizer.step()
            run.opt_step += 1
            run.optimizer.zero_grad(set_to_none=True)
            iterations.append(tp.dp_reduce_metrics(m, m["tokens"], run.ranks, run.device))
    return iterations


def step_record(run: Run, step: int, rewards: torch.Tensor, counts: dict,
                iterations: list[dict], times: dict) -> dict:
    """The step as one JSON-able dict (report.step_record); rewards: every round's, every rank's.
    `correct`: the share of the sampled completions the task's predicate calls fully correct."""
    keys = ("lengths", "new_tokens", "truncated", "kept_groups", "correct", "tool_calls",
            "tool_errors")
    summed = tp.dp_all_reduce([counts[k] for k in keys], run.ranks, run.device)  # over dp
    counts.update(zip(keys, summed))
    zero_std = (~grpo.informative_groups(rewards, run.cfgs.rollout.num_samples)).double().mean()
    correct = counts["correct"] / len(rewards) if run.task.correct is not None else None
    tool = {}
    if run.calls_tools:  # calls per sampled row (every round's), and calls the model got wrong
        tool = dict(tool_calls=counts["tool_calls"] / len(rewards),
                    tool_errors=int(counts["tool_errors"]))
    return report.step_record(step, rewards, counts, iterations, times, float(zero_std),
                              lr=run.optimizer.param_groups[0]["lr"], correct=correct, **tool,
                              **report.memory_figures(run.device, run.mem))


def evaluate(run: Run, step: int) -> tuple[dict, list[dict]]:
    """k = --eval_samples completions of each held-out prompt (each dp rank a share), greedy or
    sampled as --eval_temperature/--eval_top_p/--eval_top_k say, scored by the task's own reward
    functions: the mean reward and, where the task defines `correct`, the share of completions fully
    correct and (k > 1) pass@k, the share of prompts with at least one of its k correct; and every
    completion (samples.jsonl), prompt by prompt in the split's order, on every rank."""
    t0 = time.perf_counter()
    cfg, k = run.cfgs.train, run.cfgs.train.eval_samples
    items = run.eval.examples[run.ranks.dp_rank::run.ranks.dp_size]
    drawn = dataclasses.replace(run.cfgs.rollout, num_samples=k, temperature=cfg.eval_temperature,
                                top_k=cfg.eval_top_k, top_p=cfg.eval_top_p)
    # the rows the KV cache was sized for: as many prompts a batch as training's, fewer when k > G
    per_batch = max(1, run.local_prompts * min(run.cfgs.rollout.num_samples, k) // k)
    texts, stopped, shown = [], [], []  # shown: the prompts as the model saw them
    for first in range(0, len(items), per_batch):
        part = items[first:first + per_batch]
        responder = together(run, run.tools.start, part, k) if run.tools else None  # reset
        part = responder.examples if responder else part
        shown += part
        prompts = together(run, encode_prompts, run, [prompt for prompt, _ in part])[0]
        # sampled: a stream of its own per (seed, step, rank, batch), apart from training's rounds
        seed = (None if drawn.temperature == 0 else cfg.seed * 1_000_003 + step * 7919
                + run.ranks.dp_rank + ((first + 1) << 48))
        out = together(run, roll_out, run, prompts, drawn, seed, responder)
        stopped += out.stopped.tolist()
        texts += completion_texts(run, out, responder)
    examples = [example for example in shown for _ in range(k)]  # (prompts * k,), prompt-major
    references = [ref for _, ref in examples]
    scores = together(run, tasks.total_rewards, run.task, texts, references, examples)
    correct = together(run, tasks.correct_flags, run.task, texts, references)
    scored = scores[~scores.isnan()]
    passed = sum(any(correct[i:i + k]) for i in range(0, len(correct), k)) if correct else 0
    total, count, right, solved, prompts = tp.dp_all_reduce(
        [scored.sum().item(), len(scored), sum(correct or []), passed, len(items)], run.ranks,
        run.device)
    rewards = [None if math.isnan(x) else x for x in scores.tolist()]  # None: unscored
    samples = [dict(prompt=shown[i // k][0], completion=t, reference=r, reward=x, stopped=s,
                    correct=c, **(dict(sample=i % k) if k > 1 else {}))
               for i, (t, r, x, s, c) in enumerate(zip(texts, references, rewards, stopped,
                                                       correct or [None] * len(texts)))]
    by_prompt = [samples[i:i + k] for i in range(0, len(samples), k)]
    samples = [s for group in tp.dp_interleave(by_prompt, run.ranks) for s in group]  # every rank's
    record = dict(eval_reward=total / count if count else None,
                  eval_correct=right / (prompts * k) if run.task.correct is not None else None)
    if k > 1:
        record["eval_pass_at_k"] = solved / prompts if run.task.correct is not None else None
        record["eval_samples"] = k
    return dict(record, t_eval=time.perf_counter() - t0), samples


def print_plan(argv: list[str]) -> int:
    """--plan: each rank's bytes per tag and phase, the transients and the peak, from config.json
    (or the fresh model's flags) and the run's flags, on the meta device: no weight is read.
    WORLD_SIZE (as torchrun sets it) gives dp = world / tp."""
    cfgs = build_configs(values := parse_args([a for a in argv if a != "--plan"]))
    cli.check_config(cfgs)
    lora.check_flags(cfgs)
    cfg = cfgs.train
    task = tasks.load_task(cfg.task, cfg.task_data)
    world = int(os.environ.get("WORLD_SIZE", 1))
    ranks = tp.ParallelGroups(None, None, tp_size=cfgs.parallel.tp,
                               dp_size=max(1, world // cfgs.parallel.tp))
    budget = cfgs.rollout.max_new_tokens or task.max_new_tokens or 256  # as setup()
    cfgs.rollout = dataclasses.replace(cfgs.rollout, max_new_tokens=budget)
    model, sampler = models.shapes(cfg, task, ranks, cfgs)
    plan.print_run_plan(cfgs, model, sampler, ranks.tp_size, ranks.dp_size, values)
    return 0


def write_merged(values: dict[str, object]) -> int:
    """--model BASE --adapter DIR --merged OUT: the base with the PEFT adapter folded into its
    weights (lora.merge), written as a Hugging Face directory with the base's tokenizer and
    generation config; nothing else runs. Float32: the merge rounds nothing."""
    cfgs = build_configs(values)
    cfg, c = cfgs.train, cfgs.lora
    if not cfg.model or not c.adapter:
        raise ValueError("--merged OUT writes --model BASE merged with --adapter DIR: pass both")
    if os.path.isdir(c.merged) and os.listdir(c.merged):
        raise ValueError(f"--merged {c.merged}: the directory is not empty; name a new one")
    model = load_model(cfg.model, dtype=torch.float32)
    lora.check_base(c.adapter, cfg.model, model)
    lora.load_adapter(model, c.adapter)
    tokenizer = tk.load_tokenizer(cfg.model, model.config.vocab_size)
    save_model(lora.merge(model), c.merged, generation_config=load_generation_config(cfg.model),
               tokenizer=tokenizer)
    print(f"wrote {c.merged}: {cfg.model} with {c.adapter} merged (a Hugging Face directory)")
    return 0

# -----------------------------------------------------------------------------
# The loop


def save(run: Run, step: int) -> str:
    """A checkpoint (collective: every rank calls it). A sharded model is gathered into the full
    tensors a one-process model has, so TP and TP=1 checkpoints hold the same tensors."""
    g = run.ranks
    if g.tp_size > 1:
        tensors = tp.full_state_dict(run.model, g)  # collective over the tp ranks
    else:
        tensors = {name: p.detach() for name, p in run.model.named_parameters()}
    master = None
    if run.cfgs.lora.use_peft:  # the adapter as PEFT writes it; the base stays --model's
        return checkpoint.save_checkpoint(run.cfgs.train.out, step, run.model.config, tensors,
                                          run.tokenizer, run.optimizer,
                                          dataclasses.asdict(run.cfgs), tp_rank=g.tp_rank,
                                          tp_size=g.tp_size, dp_rank=g.dp_rank,
                                          adapter=partial(lora.save_adapter, cfg=run.cfgs.lora,
                                                          base=run.cfgs.train.model))
    if run.cfgs.train.dtype == "bfloat16":  # model.safetensors in bf16; master/ in fp32
        master, tensors = tensors, {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    return checkpoint.save_checkpoint(run.cfgs.train.out, step, run.model.config, tensors,
                                      run.tokenizer, run.optimizer, dataclasses.asdict(run.cfgs),
                                      tp_rank=g.tp_rank, tp_size=g.tp_size, dp_rank=g.dp_rank,
                                      generation_config=run.generation_config, master=master)


def check_health(run: Run, record: dict) -> None:
    """Stop a run that is going nowhere (report.Health), after a checkpoint of its last state."""
    why = run.health.update(record)
    if why:
        raise StopTraining(f"{why}; stopped, last state at {save(run, record['step'])}")


def train(run: Run) -> None:
    cfg = run.cfgs.train
    metrics = checkpoint.Metrics(cfg.out, cfg.resume, cfg.overwrite, run.start)
    # A bar redraws itself with carriage returns: on a terminal only, never into a log file.
    bar = tqdm(range(run.start, cfg.steps), initial=run.start, total=cfg.steps,
               disable=run.rank != 0 or not sys.stderr.isatty(), dynamic_ncols=True)
    path = ""
    for i in bar:
        try:
            record, rollouts = step(run, i)
        except StopTraining as e:
            if i > run.start:  # nothing lost: the state after the last finished step (at the
                raise StopTraining(f"{e}; the last finished step is saved at {save(run, i)}")
            raise              # first, --out holds it already, or nothing: never rewrite it)
        failed, samples = None, []
        try:
            if run.eval.examples and (i == 0 or (i + 1) % max(cfg.eval_every, 1) == 0
                                 or i + 1 == cfg.steps):
                evaluation, samples = evaluate(run, i)
                record.update(evaluation)
        except StopTraining as e:  # after step i's update: the checkpoint below holds i + 1
            failed = e
        if run.rank == 0:
            metrics.append(report.jsonable(record))  # the first: now --out is the new run's
            metrics.samples(record["step"], samples)
            bar.write(report.step_line(record, cfg.steps, run.cfgs.grpo.beta))
            if i == run.start:  # what setup decided, and the memory phases' table
                for line in run.notes + ([run.mem.report()] if cfg.phases else []):
                    bar.write(line)
            k = cfg.eval_samples  # shown: each prompt's first completion
            for line in report.sample_lines(rollouts, samples[::k][:cfg.show_samples],
                                            len(samples) // k):
                bar.write(line)
        if failed:
            raise StopTraining(f"{failed}; step {i + 1} is saved at {save(run, i + 1)}")
        check_health(run, record)
        stop = tp.any_rank(bool(run.signals.seen), run.device)  # every rank stops after this step
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
    if run.rank == 0 and not run.signals.seen:  # the run's last line: where it ended
        path = path or checkpoint.resolve("latest", cfg.out)  # a resume of a finished run
        print(f"done: {cfg.steps} steps; last checkpoint {path} (metrics.jsonl, samples.jsonl "
              f"and metrics.svg in {cfg.out})", flush=True)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        cli.print_help(SECTIONS, report.STEP_LINE)
        return 0
    finished = False  # every rank got through: the ranks can meet at a last barrier
    try:
        if "--plan" in argv:
            return print_plan(argv)
        values = parse_args(argv)
        if values.get("merged"):
            return write_merged(values)
        run = setup(values)
        run.signals.rank = run.rank
        with run.signals:  # Ctrl-C, SIGTERM: finish the step, checkpoint, exit 0
            train(run)
        finished = True
    except (ValueError, FileNotFoundError, StopTraining) as e:  # one line; else: a traceback
        # Under torchrun every rank finds a config error: rank 0 says it, the others exit quietly.
        if str(e) and int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        checkpoint.release_out_dir()
        if dist.is_initialized():
            tp.destroy_groups(barrier=finished)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
