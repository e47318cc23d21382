"""
The memory plan: what a run will hold per rank in each phase, from shapes alone, before any weight
is read (`train.py --plan`), and the micro-batch that fits `--memory_budget`. memory_phases is the
one list of memory tags: setup() registers them on the real tensors, --plan on the meta device.

Each phase's peak = the tagged tensors awake in it (phase_peaks: weights, KV
cache, grads, optimizer state, reference; on a CPU the last two stay in place) + its largest
transient, which the formulas below give: rollout_memory (the sampler's prefill and first sampling),
micro_batch_memory (one training micro-batch forward and backward, with or without activation
checkpointing), batch_bytes (the generation batch's tensors kept through the step). Each formula
sits in a docstring next to its terms; tests/test_train.py checks the plan against the allocator
peak it predicts, tests/bench_plan.py measures it phase by phase.

NOTE AdamW runs fused (train.py): one kernel per parameter, no temporaries, so the state is all the
step holds. torch's default elsewhere, foreach, keeps sqrt(exp_avg_sq) of every weight at once
during the step (the weights' bytes: 538 MB on SmolLM2-135M, whose step it ran 4.4x slower on
the CPU; tests/bench_memory.py --adamw).

Leaves out: tp's sequence-parallel gather buffers, --activation_offload, allocator fragmentation
and the CUDA context (~1 GB on a GPU).
"""

import copy
import dataclasses
from functools import partial

import torch
import torch.nn as nn

from engine.decode import kernel_for
from engine.compiling import decide, unsupported, worth_compiling
from grpo import GRPOConfig
from engine.logprobs import chunk_rows
from lora import adapted, trainable
from memory import MemoryConfig, PhaseManager
from model import ModelConfig
from engine.packing import cuda_route
from engine.decode import KVCache
from rollout import RolloutConfig, prepacks

# -----------------------------------------------------------------------------
# Rollout: what generate() allocates besides the weights and the KV cache

def rollout_memory(config: ModelConfig, num_prompts: int, prompt_len: int, cfg: RolloutConfig,
                   dtype: torch.dtype, tp_size: int = 1, cpu: bool = False,
                   stacked: bool = False) -> dict[str, int]:
    """Bytes generate() holds at each of its two largest moments, besides the weights and the KV
    cache (memory.py plans those from shapes), per rank, for Bp prompts of P tokens whose R = Bp*G
    rows all decode Tc = max_new_tokens. a: bytes per element of the sampler's dtype; b*P tokens
    per prefill forward (b = prefill_tokens // P prompts, at most Bp); V the full vocabulary (tensor
    parallelism gathers it before sampling), I/tp the SwiGLU width on this rank.
        outputs   R*Tc*(8 + 4)             tokens and logprobs, (Tc, R) each, filled as it goes
        prefill   b*P*a*(3C + 3I/tp + 2D)  inside a block: its input, the residual after attention,
                                           the normed input, then silu(gate), up and their product;
                                           the rope tables cos, sin (D wide)
        sampling  R*V*(a + 8) + Bp*V*a     the first tokens: each prompt's logits repeated G times,
                                           their float32 filtered copy (4) and softmax (4) (see
                                           sample: its cdf is a few bytes per row);
                                           a decode step's block (R*a*(3C + 3I/tp)) is far smaller
        prepacked a*(L*(2CQ + 2CK + 3CI) + VC)/tp   (Q = H*D, K = Hkv*D) on a CPU, float32 or
                                           native bf16 (rollout.prepacks), with
                                           cfg.prepacked_linears and no compiled step: the linear
                                           weights prepacked for oneDNN, held through generate
        stacked   a*L*C*(Q + 2K + 2I)          with `stacked` (the compiled decode step's route):
                                           q/k/v's and gate/up's weights stacked, held while the
                                           rows decode (model.fused_projections; biases left out)
    Returns {"prefill": outputs + prefill + prepacked, "sampling": outputs + sampling +
    prepacked}, the decode's part of sampling with the stacked weights."""
    a = torch.empty((), dtype=dtype).element_size()
    C = config.hidden_size
    I = config.intermediate_size // tp_size
    V = config.vocab_size
    D = config.head_dim
    R = num_prompts * cfg.num_samples
    outputs = R * cfg.max_new_tokens * (8 + 4)
    per_chunk = min(num_prompts, max(1, cfg.prefill_tokens // prompt_len))
    prefill = per_chunk * prompt_len * a * (3 * C + 3 * I + 2 * D)
    decode_block = R * a * (3 * C + 3 * I)
    Q, K = config.num_attention_heads * D, config.num_key_value_heads * D
    stacked_bytes = a * config.num_hidden_layers * C * (Q + 2 * K + 2 * I) if stacked else 0
    sampling = max(R * V * (a + 8) + num_prompts * V * a,
                   decode_block + R * V * (a + 8) + stacked_bytes)
    linears = config.num_hidden_layers * (2 * C * Q + 2 * C * K + 3 * C * config.intermediate_size)
    packed = cpu and cfg.prepacked_linears and prepacks(dtype) and not stacked  # see generate
    prepacked = a * (linears + V * C) // tp_size if packed else 0
    return {"prefill": outputs + prefill + prepacked, "sampling": outputs + sampling + prepacked}

# -----------------------------------------------------------------------------
# Training: what one micro-batch allocates, forward and backward

def block_bytes(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1,
                sequence_parallel: bool = False, autocast: bool = False) -> dict[str, int]:
    """Bytes per token one block saves for backward, per rank (tests/bench_tp.py counts them).
    a: bytes per element; Q = H*D, K = Hkv*D; the residual stream's C becomes C/tp under sequence
    parallelism (its tokens are split, and the fused gather-linears keep only the local shard).
        norms      2*(4 + 2a)*C           each RMSNorm: its float32 input, normed and scaled outputs
                   (16 + 5a)*C autocast   over fp32 weights the residual stream and both norm
                                          outputs are fp32, and each of q, k, v, gate, up keeps its
                                          own a-byte cast of its input
        attention  (a*(2Q + 2K) + 4H)/tp  q and k after rope, v, SDPA's output; its float32 lse;
                   + ((4 + a)*(Q + K)     with Qwen3's per-head q/k norms: each keeps its float32
                   + 4(H + Hkv))/tp       input, its normed a-byte output and a float32 rstd a head
        mlp        4a*I/tp                gate, up, silu(gate), their product
    "kv" is the 2a*K/tp of k and v: a completion token's are kept per row with its prompt's."""
    a = torch.empty((), dtype=dtype).element_size()
    C = config.hidden_size // (tp_size if sequence_parallel else 1)
    H = config.num_attention_heads // tp_size
    Hkv = config.num_key_value_heads // tp_size
    Q = H * config.head_dim
    K = Hkv * config.head_dim
    I = config.intermediate_size // tp_size
    norms = (16 + 5 * a) * C if autocast else 2 * (4 + 2 * a) * C
    qk_norms = config.qk_norm * ((4 + a) * (Q + K) + 4 * (H + Hkv))
    return dict(norms=norms, attention=a * (2 * Q + 2 * K) + 4 * H + qk_norms, mlp=4 * a * I,
                kv=2 * a * K, residual=a * C, inference=a * (3 * C + 3 * I))


def micro_batch_memory(config: ModelConfig, groups: float, G: int, prompt_len: int,
                       completion_len: int, dtype: torch.dtype, *, checkpoint: bool,
                       chunk_size: int, tp_size: int = 1, sequence_parallel: bool = False,
                       repeated_prompt: bool = False, autocast: bool = False,
                       frozen: bool = False, adapter_bytes: int = 0) -> dict[str, int]:
    """Bytes one micro-batch of `groups` prompts of P tokens and their R = groups*G completions of
    Tc tokens (T = Tc - 1 fed) holds at its largest moments, per rank, besides the weights, grads
    and optimizer state (memory.py plans those): {"forward", "backward", "no grad"} (the last:
    old or reference logprobs). The prompts and completions run packed, one row through every
    block (engine/packing.py; `groups` may be a fraction: a token budget's share). Per layer, with
    block_bytes' per-token terms:
        prompt tokens      full blocks
        completion tokens  full blocks; with repeated_prompt (packing.cuda_route's "padded":
                           training_route) also each row's copy of its prompt's keys and values,
                           2a*K/tp*P, and a bool (T, P + T) mask per row
    With activation checkpointing a block keeps only its input (a*C) and backward recomputes one
    packed block at a time. Outside: the rope tables, the hidden states at the head (a*C + 16 per
    token), the loss's (R, Tc) float32 tensors. Transients: a chunk of head logits (8 bytes per
    entry forward: float32 logits and exp; 16 + a backward, and a (V, C) lm_head grad per chunk),
    the SwiGLU's 3 (inference) or 2 (gradients) I-wide tensors, the hidden states' (R, Tc, C).
    Under tensor parallelism a tied head's (V/tp, C) gradient waits in autograd for the
    embedding's, the last node of backward (on one rank both go into .grad: engine/logprobs.py,
    memory.grads_into_weight). autocast (bf16 over fp32 weights): block_bytes' autocast norms,
    the a-byte copy of every block weight autocast caches for its context (block_weight_bytes).
    frozen (LoRA, lora.py): the base's weights are in the compute dtype, so autocast casts and
    caches none, and there is no lm_head gradient; adapter_bytes per token (all layers) is what
    the adapters save besides: lora_activation_bytes."""
    autocast = autocast and not frozen  # a frozen base is in the compute dtype already
    b = block_bytes(config, dtype, tp_size, sequence_parallel, autocast)
    a = b["residual"] * (tp_size if sequence_parallel else 1) // config.hidden_size
    L = config.num_hidden_layers
    C = config.hidden_size
    V = config.vocab_size // tp_size
    T = max(completion_len - 1, 0)
    rows = groups * G
    prompt = groups * prompt_len  # tokens
    completion = rows * T
    n = rows * completion_len  # completion tokens scored (every row at full length)
    full = b["norms"] + b["attention"] + b["mlp"]  # a prompt token's block
    row_keys = completion * b["kv"] + repeated_prompt * rows * b["kv"] * prompt_len
    completion_block = completion * (full - b["kv"]) + row_keys
    outside = (2 * a * config.head_dim * (prompt + completion)
               + repeated_prompt * rows * T * (prompt_len + T)
               + n * (a * C + 16) + rows * completion_len * 4 * 8
               + autocast * L * block_weight_bytes(config, dtype, tp_size))
    chunk = min(chunk_size or n, n)
    head = chunk * V * 8
    head_backward = chunk * V * (16 + a) + (not frozen) * V * C * a
    adapters = (prompt + completion) * adapter_bytes
    if checkpoint:
        saved = L * (prompt + completion) * b["residual"] + outside
        recompute = prompt * full + completion_block + adapters // L
        forward = saved + max((prompt + completion) * b["inference"] + row_keys, head)
    else:
        saved = L * prompt * full + L * completion_block + outside + adapters
        recompute = 0
        forward = saved + max(rows * completion_len * C * a, head)
    gradients = (prompt + completion) * 2 * a * config.intermediate_size // tp_size
    tied = tp_size > 1 and config.tie_word_embeddings and not frozen  # the tied head's, under tp
    pending = tied * V * C * (4 if autocast else a)
    backward = saved + recompute + max(gradients, head_backward) + pending
    no_grad = n * a * C * 2 + max((prompt + completion) * b["inference"] + row_keys, head)
    return {"forward": int(forward), "backward": int(backward), "no grad": int(no_grad)}


def block_weight_bytes(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """One block's weights per rank in dtype: a*C*(2Q + 2K + 3I)/tp."""
    a = torch.empty((), dtype=dtype).element_size()
    Q = config.num_attention_heads // tp_size * config.head_dim
    K = config.num_key_value_heads // tp_size * config.head_dim
    I = config.intermediate_size // tp_size
    return a * config.hidden_size * (2 * Q + 2 * K + 3 * I)


def batch_bytes(rows: int, completion_len: int, old: bool, reference: bool) -> int:
    """The generation batch's (R, Tc) tensors kept through the step: tokens (int64), mask (bool),
    the sampler's logprobs, and old / reference logprobs when computed (float32)."""
    return rows * completion_len * (8 + 1 + 4 + 4 * old + 4 * reference)

# -----------------------------------------------------------------------------
# The step's plan, per phase


def step_transients(config: ModelConfig, prompts: int, prompt_len: int, r: RolloutConfig,
                    g: GRPOConfig, dtype: torch.dtype, sampler_dtype: torch.dtype, *,
                    checkpoint: bool, tp_size: int = 1, sequence_parallel: bool = False,
                    old: bool = False, repeated_prompt: bool = False,
                    cpu: bool = False, stacked: bool = False, frozen: bool = False,
                    adapter_bytes: int = 0) -> dict[str, int]:
    """Each phase's largest transient (bytes per rank) for `prompts` prompts of prompt_len tokens
    and r.max_new_tokens completion tokens: the largest of rollout_memory in rollout; the batch
    kept through the step plus a micro-batch's no-grad forward (old or reference logprobs) or its
    forward/backward (train). A micro-batch is g.micro_batch_groups groups at full length, or with
    g.micro_batch_tokens that many valid tokens (at least one group): the packed forward runs on
    valid tokens only, so its activations follow them, as many groups' worth as they make."""
    Tc = r.max_new_tokens
    groups = min(g.micro_batch_groups, prompts)
    if g.micro_batch_tokens:
        group_tokens = prompt_len + r.num_samples * Tc  # a group at full length
        groups = max(1.0, min(prompts, g.micro_batch_tokens / group_tokens))  # may be fractional
    micro = micro_batch_memory(config, groups, r.num_samples,
                               prompt_len, Tc, dtype, checkpoint=checkpoint,
                               autocast=dtype == torch.bfloat16,  # train.py's bf16: fp32 master
                               chunk_size=chunk_rows(g.chunk_bytes, config.vocab_size, dtype),
                               tp_size=tp_size,
                               sequence_parallel=sequence_parallel,
                               repeated_prompt=repeated_prompt, frozen=frozen,
                               adapter_bytes=adapter_bytes)
    kept = batch_bytes(prompts * r.num_samples, Tc, old, g.beta > 0)  # through the step
    sampling = rollout_memory(config, prompts, prompt_len, r, sampler_dtype, tp_size, cpu=cpu,
                              stacked=stacked)
    return {"rollout": max(sampling.values()), "idle": kept + old * micro["no grad"],
            "reference": kept + micro["no grad"],
            "train": kept + max(micro["forward"], micro["backward"])}


def memory_phases(device: torch.device | str, cfg: MemoryConfig, model: nn.Module,
                  sampler: nn.Module, cache: KVCache, optimizer: torch.optim.Optimizer,
                  reference: nn.Module | None) -> PhaseManager:
    """The one list of memory tags, for setup() and for --plan (on the meta device)."""
    mem = PhaseManager(device, cfg)
    mem.add_weights(model, sampler)
    mem.add_kv_cache(cache.buffer)
    mem.add_grads(model)
    mem.add_optimizer(optimizer)
    if reference is not None:
        mem.add_reference(reference)
    if getattr(model, "tp_state", None) is not None:  # sequence parallelism's gathered activations
        mem.add_scratch(model.tp_state.buffer.tensors)
    return mem


def phase_peaks(mem: PhaseManager, transients: dict[str, int], target: str | torch.device,
                phases: bool = True) -> dict[str, dict[str, int]]:
    """phase -> {tag: bytes, ..., "transient": bytes, "peak": bytes}: each phase's peak allocated
    on `target` (what torch.cuda.max_memory_allocated reads there), from shapes alone:
        peak = the tags awake in the phase (mem.plan(target)) + its largest transient
    "idle" is outside every phase (the old logprobs' forward): only what no phase releases. On a
    CPU the offloaded tags stay in place (policy "guard"): counted once, in every phase; on a GPU
    their pinned host buffers are not device memory. phases=False (train.py --phases false): every
    tag resident throughout. transients: phase -> bytes (step_transients)."""
    plan = mem.plan(target)
    tags = {"idle": {tag: min(p[tag] for p in plan.values()) for tag in plan["train"]}, **plan}
    if not phases:
        tags = {phase: {g.tag: g.full_bytes() for g in mem.holders} for phase in tags}
    out = {}
    for phase, by_tag in tags.items():
        row = {**by_tag, "transient": transients.get(phase, 0)}
        out[phase] = {**row, "peak": sum(row.values())}
    return out


def stacked_decode(setting: str, sampler: nn.Module, target: str, tp_size: int) -> bool:
    """Whether generate's decode runs compiled on stacked weights (rollout.py, decode.Decoder):
    compiling.decide on the target's device, where the step takes a fused kernel (decode.kernel_for:
    CUDA, bf16 / fp16) and torch compiles (compiling.unsupported), on one tensor-parallel rank (tp's
    vocab gather keeps the step eager)."""
    kernel = kernel_for(torch.device(target), next(sampler.parameters()).dtype,
                        sampler.config.head_dim)
    return (decide(setting, sampler, target) and kernel is not None and tp_size == 1
            and not unsupported())


def training_route(model: nn.Module, target: str, dtype: str) -> str:
    """The training attention's route on `target` for a model trained in `dtype` (train.py's
    --dtype: bf16 autocast hands the attention bf16): "cpu" off CUDA, else packing.cuda_route's,
    as packed_hidden takes it. Its "padded" repeats each prompt's K/V per row (micro_batch_memory's
    repeated_prompt): a model under compiling.MIN_COMPILE_PARAMS or with head_dim < 16, in float32
    or without the varlen kernel."""
    if torch.device(target).type != "cuda":
        return "cpu"
    return cuda_route(getattr(torch, dtype), model.config.head_dim, worth_compiling(model))[0]


def lora_activation_bytes(model: nn.Module, dtype: torch.dtype, dropout: float) -> int:
    """What a model's LoRA adapters save for backward per token, over all layers, per rank: each
    adapted linear's r-wide A x (a*r), and with dropout its own dropped copy of its input and the
    mask (in*(a + 1): q, k and v each drop their shared input apart). 0 without adapters."""
    a = torch.empty((), dtype=dtype).element_size()
    return sum(m.lora_A.shape[0] * a + (dropout > 0) * m.lora_A.shape[1] * (a + 1)
               for _, m in adapted(model))


def step_plan(mem: PhaseManager, cfgs, model, sampler, reference, prompts: int, tp_size: int,
              target: str, g: GRPOConfig) -> dict[str, dict[str, int]]:
    """phase_peaks for one step of train.py's configs `cfgs` (rollout.max_new_tokens resolved)
    with the GRPO knobs g, `prompts` prompts per rank of cfgs.train.max_prompt_len tokens:
    phase -> {tag: bytes, "transient", "peak"}; no "reference" phase at beta 0."""
    transients = step_transients(
        model.config, prompts, cfgs.train.max_prompt_len, cfgs.rollout, g,
        getattr(torch, cfgs.train.dtype), next(sampler.parameters()).dtype,  # activations' dtype
        checkpoint=cfgs.memory.activation_checkpoint, tp_size=tp_size,
        sequence_parallel=cfgs.parallel.sequence_parallel, old=g.mu > 1,
        repeated_prompt=training_route(model, target, cfgs.train.dtype) == "padded",
        cpu=torch.device(target).type == "cpu",
        stacked=stacked_decode(cfgs.rollout.compile_decode, sampler, target, tp_size),
        frozen=cfgs.lora.use_peft,
        adapter_bytes=lora_activation_bytes(model, getattr(torch, cfgs.train.dtype),
                                            cfgs.lora.lora_dropout))
    plan = phase_peaks(mem, transients, target, cfgs.train.phases)
    if g.beta == 0:  # no reference (LoRA's is the trainer with its adapters off)
        del plan["reference"]
    return plan


# Logprob chunks on a GPU (unless --chunk_bytes is given): 1 GiB of float32 logits, 1,766 tokens at
# V = 151,936. Every chunk writes and adds a whole (V, C) gradient of lm_head (~12 bytes a weight:
# its bf16 gradient written and read, the float32 .grad read and written) beside a few tens of
# bytes for each of its logits over forward and backward: at the CPU's 64 MiB (110 tokens at
# V = 151,936, C = 896) those gradient passes move more bytes than the logits, at 1 GiB a tenth
# to a fifth as many. The plan counts the larger transient; --memory_budget halves the chunk
# when the run does not fit.
GPU_CHUNK_BYTES = 2**30
# On a GPU without --memory_budget or a micro-batch flag, the budget is this share of the device's
# memory: the largest micro-batch the plan fits there (larger matmuls, fewer kernel launches and
# lm_head passes a step), the rest left to the CUDA context, the allocator's slack and the plan's
# error (2-7% under the allocator's peak on an H100, docs/measurements.md).
GPU_MEMORY_SHARE = 0.8


def device_memory(target: str) -> int:
    """Bytes of memory on the GPU `target` names (the current device for a bare "cuda")."""
    return torch.cuda.get_device_properties(torch.device(target)).total_memory


def fit(mem: PhaseManager, cfgs, model, sampler, reference, prompts: int, tp_size: int,
        target: str, explicit=()) -> GRPOConfig:
    """cfgs.grpo with the micro-batch and logprob chunk this run fits (the caller assigns it): on
    a GPU, unless chunk_bytes is among the explicit flags, GPU_CHUNK_BYTES; then with
    cfgs.memory.memory_budget, fit_memory_budget's; unless micro_batch_groups or
    micro_batch_tokens is among the explicit flags, on a GPU with no --memory_budget flag
    fit_memory_budget's for GPU_MEMORY_SHARE of its memory (its matmuls want the rows), on a CPU
    with no budget bound_micro_batch's."""
    g = cfgs.grpo
    gpu = torch.device(target).type != "cpu"
    if gpu and "chunk_bytes" not in explicit:
        g = dataclasses.replace(g, chunk_bytes=GPU_CHUNK_BYTES)
    # plan_of(g) -> step_plan of this run with the GRPO knobs g (the rest of cfgs, as given)
    plan_of = partial(step_plan, mem, cfgs, model, sampler, reference, prompts, tp_size, target)
    r = cfgs.rollout
    group_tokens = cfgs.train.max_prompt_len + r.num_samples * r.max_new_tokens  # at full length
    budget, source = cfgs.memory.memory_budget, ""
    sized = {"micro_batch_groups", "micro_batch_tokens"} & set(explicit)
    if gpu and not sized and "memory_budget" not in explicit:  # --memory_budget 0: off
        total = device_memory(target) / 1e9
        budget = GPU_MEMORY_SHARE * total
        source = f" ({GPU_MEMORY_SHARE:.0%} of the GPU's {total:.2f} GB; --memory_budget sets it)"
    if budget:
        return fit_memory_budget(budget, plan_of, g, prompts, group_tokens,
                                 None if cfgs.memory.activation_checkpoint
                                 else partial(step_plan, mem, with_checkpointing(cfgs), model,
                                              sampler, reference, prompts, tp_size, target),
                                 source)
    if not sized and not gpu:
        return bound_micro_batch(plan_of, g, group_tokens)
    return g


# Training transients under this many bytes are never traded for speed (bound_micro_batch).
SMALL_TRANSIENT = 256 * 2**20


def bound_micro_batch(plan_of, g: GRPOConfig, group_tokens: int) -> GRPOConfig:
    """The default micro-batch: g.micro_batch_groups (4), lowered to the largest count whose
    planned training transient holds at most the trainer's weights' bytes (or SMALL_TRANSIENT).
    A real model's fp32 state is 4x its weights (weights, grads, AdamW's two moments), so this
    keeps the step's peak near 1.25x that floor; beyond 2-4 groups a micro-batch buys a few
    percent of speed for hundreds of MB at a real vocabulary (SmolLM2-135M, 8 prompts x 8 x 16
    tokens: 4 groups plan 1,302 MB, one group 452 MB, beside 538 MB of weights). Prints the
    choice when it lowers it. The count becomes a token budget, that many groups at full length
    (group_tokens each) as micro_batch_tokens: the plan's bytes, which follow the valid tokens,
    hold for any groups within it, so short completions pack more groups a micro-batch (fewer,
    fuller ones: a step of many small micro-batches is launch-bound on a GPU)."""
    limit = max(plan_of(g)["train"]["trainer"], SMALL_TRANSIENT)
    for groups in range(g.micro_batch_groups, 0, -1):
        fit = dataclasses.replace(g, micro_batch_groups=groups, micro_batch_tokens=0)
        transient = plan_of(fit)["train"]["transient"]
        if transient <= limit or groups == 1:
            break
    if groups < g.micro_batch_groups:
        fits = "within" if transient <= limit else "the least; over"
        print(f"--micro_batch_groups {groups} (the default {g.micro_batch_groups} lowered): its "
              f"planned training transient {transient / 1e6:,.0f} MB is {fits} the bound of "
              f"{limit / 1e6:,.0f} MB ({'the weights' if limit > SMALL_TRANSIENT else 'the floor'}"
              f"); micro-batches of whole groups up to {groups * group_tokens} valid tokens; "
              f"pass --micro_batch_groups to choose")
    return dataclasses.replace(fit, micro_batch_tokens=groups * group_tokens)


def peak(plan: dict[str, dict[str, int]]) -> int:
    return max(row["peak"] for row in plan.values())


def with_checkpointing(cfgs):
    """train.py's configs with --activation_checkpoint true."""
    memory = dataclasses.replace(cfgs.memory, activation_checkpoint=True)
    return dataclasses.replace(cfgs, memory=memory)


def smallest_fit(budget_gb: float, plan_of, g: GRPOConfig, prompts: int, group_tokens: int
                 ) -> tuple[GRPOConfig | None, int, list[int]]:
    """The g with the largest micro_batch_tokens (the tokens of `prompts` groups at full length,
    group_tokens each, down to one group's), then the largest logprob chunk (g.chunk_bytes halved
    down to 1 MiB; 0, unchunked, first tries 64 MiB), whose planned peak (plan_of(g) ->
    step_plan's dict) fits budget_gb per rank, or None; its planned peak (or the smallest one
    tried), and the chunks tried."""
    chunks = [g.chunk_bytes] if g.chunk_bytes else [0, 2**26]
    while chunks[-1] > 2**20:
        chunks.append(max(2**20, chunks[-1] // 2))
    smallest = None
    for groups in range(prompts, 0, -1):
        for chunk in chunks:
            fit = dataclasses.replace(g, micro_batch_tokens=groups * group_tokens,
                                      chunk_bytes=chunk)
            planned = peak(plan_of(fit))
            if planned <= budget_gb * 1e9:
                return fit, planned, chunks
            smallest = planned if smallest is None else min(smallest, planned)
    return None, smallest, chunks


def fit_memory_budget(budget_gb: float, plan_of, g: GRPOConfig, prompts: int, group_tokens: int,
                      plan_checkpointed=None, source: str = "") -> GRPOConfig:
    """--memory_budget: smallest_fit's choice, printed. Micro-batches then take whole groups up to
    that many valid tokens: real completions shorter than the budget make fewer, fuller ones
    within the same planned peak (verl's dynamic batch size). When nothing fits, one line naming
    the smallest peak it could reach, and --activation_checkpoint true when plan_checkpointed (the
    same run with it; None when it is on already) fits. The micro-batch changes no loss: the
    normalisers are the generation batch's. source: where a budget not given came from (fit's
    share of the GPU), said in both lines."""
    fit, planned, chunks = smallest_fit(budget_gb, plan_of, g, prompts, group_tokens)
    if fit is not None:
        print(f"memory budget {budget_gb:.3g} GB per rank{source}: --micro_batch_tokens "
              f"{fit.micro_batch_tokens} ({fit.micro_batch_tokens // group_tokens} groups at full "
              f"length) --chunk_bytes {fit.chunk_bytes}, planned peak {planned / 1e9:.3f} GB")
        return fit
    advice = ("raise it, or lower --prompts_per_step, --num_samples, --max_prompt_len or "
              "--max_new_tokens")
    if plan_checkpointed is not None:
        ckpt, ckpt_peak, _ = smallest_fit(budget_gb, plan_checkpointed, g, prompts, group_tokens)
        if ckpt is not None:
            advice = (f"pass --activation_checkpoint true (each block recomputed in backward): "
                      f"then --micro_batch_tokens {ckpt.micro_batch_tokens} fits, planned peak "
                      f"{ckpt_peak / 1e9:.3f} GB; or {advice}")
    raise ValueError(f"--memory_budget {budget_gb:.3g} GB per rank{source}: nothing fits; the "
                     f"smallest planned peak is {planned / 1e9:.3f} GB (at one group, "
                     f"{group_tokens} tokens, --chunk_bytes {chunks[-1]}, the least it tries); "
                     f"{advice}")


def print_plan(plan: dict[str, dict[str, int]], target: str, title: str) -> None:
    """The table `train.py --plan` prints: MB per tag, transient, peak, per phase."""
    columns = list(plan["train"])
    note = ""
    if target == "cpu":  # memory.py's "guard": nothing copied, counted once
        note = "; optimizer and reference stay in place (the host is the device)"
    print(f"memory plan per rank on {target} ({title}), MB{note}:")
    print(f"{'phase':<10}" + "".join(f"{c:>11}" for c in columns))
    for phase, row in plan.items():
        print(f"{phase:<10}" + "".join(f"{row[c] / 1e6:>11,.1f}" for c in columns))
    print(f"peak {peak(plan) / 1e9:.3f} GB (max_memory_allocated); a GPU needs about that plus its "
          "CUDA context and allocator slack (~1 GB)")


def print_run_plan(cfgs, model: nn.Module, sampler: nn.Module, tp_size: int, dp_size: int,
                   explicit=()) -> None:
    """--plan for a run's configs and its model and sampler on the meta device: the KV cache,
    AdamW and a reference built as setup() builds them, the tags from memory_phases, the
    micro-batch --memory_budget picks, and the table."""
    r, Bp, P = cfgs.rollout, cfgs.train.prompts_per_step // dp_size, cfgs.train.max_prompt_len
    cache = KVCache.for_batch(model.config, Bp, r.num_samples, P, r.max_new_tokens,
                              next(sampler.parameters()).dtype, "meta", tp_size=tp_size)
    reference = None
    if cfgs.grpo.beta > 0:
        reference = copy.deepcopy(model).requires_grad_(False)
    mem = memory_phases("meta", cfgs.memory, model, sampler, cache,
                        torch.optim.AdamW(trainable(model)), reference)
    target = "cuda" if torch.cuda.is_available() else "cpu"
    g = fit(mem, cfgs, model, sampler, reference, Bp, tp_size, target, explicit)
    title = (f"tp {tp_size} x dp {dp_size}; {Bp} prompts x {P} + {r.max_new_tokens} tokens x "
             f"G {r.num_samples}")
    print_plan(step_plan(mem, cfgs, model, sampler, reference, Bp, tp_size, target, g), target,
               title)
