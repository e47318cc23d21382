"""
The policy a run trains, and its two copies: the trainer (the weights the optimizer steps), the
sampler (the trainer itself, or a copy in --sampler_dtype that rollout.sync_weights refreshes
before each rollout) and the frozen reference (the initial policy, when beta > 0).

- build_model: from a Hugging Face directory (--model, or the checkpoint being resumed: its fp32
  master/ when it has one; under tensor parallelism each rank reads its slice), or fresh: a
  character tokenizer for the task's alphabet and a tiny Llama initialised from the seed, the same
  on every rank.
- master_dtype, autocast: --dtype bfloat16 is mixed precision (FSDP's and Megatron's): the trainer's
  weights and AdamW state in float32, forward and backward under bf16 autocast, a bf16 sampler.
- bf16_kernels, cpu_precision: where bf16 matmuls run. A CPU without native bf16 (no AVX512_BF16
  or AMX) falls back to kernels 5-40x slower than float32 (docs/measurements.md): there (--cpu_bf16
  auto) --dtype bfloat16 keeps bf16's values and multiplies in float32: the trainer's fp32 master
  without autocast, the sampler a float32 copy holding the weights rounded to bf16 (the rounding
  is what a bf16 run's sampler sees: float32's own weights learn the README's SmolLM2 tasks far
  slower); cpu_precision's line says so at start, with the cost it measured.
- compile_model: --compile_blocks, the trainer's blocks compiled (compiling.py); on CUDA the
  training attention's route (packing.cuda_route).
- build: the three from the run's flags, the trainer's blocks compiled and checkpointed
  (--activation_checkpoint), its embedding's gradient rows straight into .grad (memory.py);
  shapes: the trainer and the sampler on the meta device, for --plan.
- adapt: with --use_peft (lora.py) the base from --model, frozen in the compute dtype, its adapters
  fresh, from --adapter's PEFT directory or from the checkpoint being resumed; the sampler is the
  trainer itself, and there is no reference copy.

Leaves out: the optimizer and the memory phases (train.py, plan.py), the weight sync (rollout.py),
checkpoints (checkpoint.py). Handed train.py's configs (cfg: its TrainConfig, cfgs: its Configs),
it imports no file above it.
Tested by tests/test_train.py (fresh and loaded models, bf16's master weights, compiled blocks).
"""

import contextlib
import copy
import dataclasses
import functools
import time

import torch

import checkpoint
import compiling
import graphs
import lora
import memory
import packing
import rollout
import tokenizer as tk
import tp
from hf import load_config, load_model
from model import Llama, ModelConfig
from tasks import Task


def master_dtype(cfg) -> torch.dtype:
    """The trainer's weights and AdamW state: float32 under bf16 (an AdamW step of 1e-6 on a weight
    of 0.02 is below bf16's resolution: bf16 weights would round most updates away)."""
    return torch.float32 if cfg.dtype == "bfloat16" else getattr(torch, cfg.dtype)


def autocast(cfg, device: torch.device):
    """bf16 forward and backward from the fp32 master (FSDP's and Megatron's mixed precision).
    Autocast, not a bf16 working copy refreshed after each step: tests/bench_bf16.py measures both
    (docs/measurements.md); autocast keeps the gradients fp32 across micro-batches and ranks.
    Where bf16 has no kernels of its own (bf16_kernels), float32 matmuls: no autocast."""
    if cfg.dtype != "bfloat16" or not bf16_kernels(cfg, device):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@functools.cache  # autocast() asks at every micro-batch
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AVX512_BF16 or AMX, and oneDNN allowed to use
    bf16 (ONEDNN_MAX_CPU_ISA caps it: AVX2 runs an AVX-512 CPU as an AVX2 one)."""
    cpu = torch.cpu  # the flags' functions are private (torch >= 2.3): absent means unknown, no
    flags = [getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                               "_is_amx_tile_supported")]
    return (any(flags) and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_kernels(cfg, device: torch.device) -> bool:
    """Whether bf16 tensors are multiplied as bf16 on `device`: on a GPU (and the meta device of
    --plan), on a CPU with native bf16, or anywhere with --cpu_bf16 true."""
    return device.type != "cpu" or cfg.cpu_bf16 == "true" or native_bf16()


def bf16_cost(C: int, I: int, tokens: int = 64) -> tuple[float, float]:
    """Seconds of one linear's forward and backward (C -> I, the model's MLP, over `tokens` rows)
    under bf16 autocast, and in float32: the best of two each, after one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, C, generator=gen, requires_grad=True)  # both gradients, as a block's
    w = torch.randn(I, C, generator=gen, requires_grad=True)

    def seconds(dtype: torch.dtype) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                torch.nn.functional.linear(x, w).float().sum().backward()
            best = min(best, time.perf_counter() - t0)
        return best
    return seconds(torch.bfloat16), seconds(torch.float32)


def cpu_precision(cfg, device: torch.device, config: ModelConfig | None) -> str:
    """The line a run prints at start when it asks for bf16 (--dtype or --sampler_dtype) where
    bf16 has no kernels (bf16_kernels): what it does instead and the cost of one of the model's
    linears measured here (config: the checkpoint's, None: the fresh model's); else ""."""
    if "bfloat16" not in (cfg.dtype, cfg.sampler_dtype) or bf16_kernels(cfg, device):
        return ""
    C = config.hidden_size if config else cfg.dim
    I = config.intermediate_size if config else cfg.dim * 11 // 4  # build_model's
    bf16, fp32 = bf16_cost(C, I)
    isa = torch.backends.cpu.get_cpu_capability()
    return (f"note: bf16 multiplies in float32 here: this CPU ({isa}) has no native bf16 "
            f"(AVX512_BF16 or AMX), and a bf16 linear of this model's MLP ({C} -> {I}, 64 tokens, "
            f"forward and backward) took {bf16 * 1e3:.1f} ms against {fp32 * 1e3:.1f} ms in "
            f"float32 ({bf16 / fp32:.0f}x); the sampler holds bf16's values in float32, the "
            "trainer runs without autocast (--cpu_bf16 true: bf16 kernels anyway)")


def build_model(cfg, task: Task, source: str, device: torch.device, groups: tp.ParallelGroups,
                frozen: bool = False) -> tuple[Llama, tk.PromptTokenizer]:
    """From a HF directory (--model, or a checkpoint being resumed: its fp32 master/ when it has
    one), or fresh: a char tokenizer for the task's alphabet and a tiny Llama initialised from the
    seed (the same on every rank). In the trainer's dtype: float32 under bf16 mixed precision; a
    frozen base (LoRA's) in the compute dtype, bf16 stays bf16."""
    dtype = getattr(torch, cfg.dtype) if frozen else master_dtype(cfg)
    if source:
        weights = checkpoint.master_dir(source) or source
        if groups.tp_size > 1:
            model = tp.load_sharded(weights, groups, device, dtype)  # each rank reads its slice
        else:
            model = load_model(weights, device=device, dtype=dtype)
        return model, tk.load_tokenizer(source, model.config.vocab_size)
    if not task.alphabet:
        raise ValueError(f"task {task.name} has no alphabet for a fresh tokenizer: pass --model "
                         "DIR")
    tokenizer = tk.PromptTokenizer(tk.build_char_tokenizer(task.alphabet))
    mcfg = ModelConfig(vocab_size=tokenizer.num_ids, hidden_size=cfg.dim,
                       intermediate_size=cfg.dim * 11 // 4, num_hidden_layers=cfg.layers,
                       num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       max_position_embeddings=1024,
                       bos_token_id=tokenizer.tok.token_to_id("<bos>"),
                       eos_token_id=tokenizer.tok.token_to_id("<eos>"))
    model = Llama(mcfg).init_weights(cfg.seed).to(device=device, dtype=dtype)  # same on every rank
    if groups.tp_size > 1:
        tp.shard_model(model, groups)
    return model, tokenizer


def compile_model(cfg, model: Llama, device: torch.device, groups: tp.ParallelGroups) -> list[str]:
    """--compile_blocks: the blocks' training forward compiled once per model (compiling.py);
    torch's caches in --compile_cache (for the decode step's compile too: --compile_decode,
    rollout.py); and on CUDA the training attention's route (packing.cuda_route). Returns the lines
    the first step prints: what was compiled, or why not, and any fallback."""
    cache = compiling.use_cache(cfg.compile_cache)
    notes = []
    if device.type == "cuda":
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else master_dtype(cfg)
        notes.append(packing.cuda_route(dtype, model.config.head_dim,
                                        graphs.worth_compiling(model))[1])
    if cfg.compile_blocks == "false" or (cfg.compile_blocks == "auto" and device.type != "cuda"):
        return notes
    if not graphs.decide(cfg.compile_blocks, model):  # auto on CUDA, a model too small to pay
        blocks = sum(p.numel() for p in model.model.layers.parameters())
        return notes + [f"--compile_blocks auto: the blocks run eager ({blocks / 1e6:.1f} M "
                        f"parameters: a compile pays from {graphs.MIN_COMPILE_PARAMS / 1e6:.0f} "
                        "M)"]
    why = graphs.unsupported()
    if not why and groups.tp_size > 1:
        why = "a tensor-parallel block has collectives inside it"
    if why:
        return notes + [f"--compile_blocks: the blocks run eager: {why}"]
    compiling.compile_blocks(model.model.layers)
    return notes + [f"compile: each block's training forward, one graph for every layer and "
                    f"length, paid at the first step (caches in {cache})"]


def build(cfgs, task: Task, source: str, resume_dir: str, device: torch.device,
          groups: tp.ParallelGroups) -> tuple[Llama, tk.PromptTokenizer, Llama, Llama | None,
                                              list[str]]:
    """The trainer (from `source`, or fresh), its tokenizer, the sampler, the reference (None
    when beta = 0), and compile_model's lines; the trainer's blocks compiled and checkpointed as
    the flags say (after the copies are made: they stay plain)."""
    cfg = cfgs.train
    if cfgs.lora.use_peft:  # the base from --model (a resumed run's adapter is in its checkpoint)
        model, tokenizer = build_model(cfg, task, cfg.model, device, groups, frozen=True)
        notes = [adapt(cfgs, model, resume_dir)]
        sampler = model  # the adapted model samples itself: no copy of the base
        notes += compile_model(cfg, model, device, groups)
        memory.checkpoint_blocks(model.model.layers, cfgs.memory.activation_checkpoint)
        return model, tokenizer, sampler, None, notes
    model, tokenizer = build_model(cfg, task, source, device, groups)
    reference = None
    if cfgs.grpo.beta > 0:  # on resume, rebuilt from --model (or the seed): the initial policy
        reference = (build_model(cfg, task, cfg.model, device, groups)[0] if resume_dir
                     else copy.deepcopy(model)).requires_grad_(False)
    sampler = _sampler(cfg, model)
    notes = compile_model(cfg, model, device, groups)
    memory.checkpoint_blocks(model.model.layers, cfgs.memory.activation_checkpoint)
    memory.grads_into_weight(model.model.embed_tokens)
    return model, tokenizer, sampler, reference, notes


def adapt(cfgs, model: Llama, resume_dir: str) -> str:
    """LoRA (lora.py): the base frozen, adapters from a resumed checkpoint, --adapter's PEFT
    directory, or fresh from the seed; under tensor parallelism each rank's slice (tp.adapt).
    Returns the line the first step prints."""
    c = cfgs.lora
    if resume_dir or c.adapter:
        path = resume_dir or c.adapter
        if not resume_dir:
            lora.check_base(path, cfgs.train.model, model)
        got, targets = lora.load_adapter(model, path, dropout=c.lora_dropout)
        cfgs.lora = dataclasses.replace(c, lora_r=got.lora_r, lora_alpha=got.lora_alpha,
                                        use_rslora=got.use_rslora,
                                        lora_target_modules=",".join(targets))
    else:
        targets = lora.add_adapters(model, c, cfgs.train.seed)
        cfgs.lora = dataclasses.replace(c, lora_target_modules=",".join(targets))
    tp.adapt(model)
    # The adapters' dropout draws from torch's global generator: its masks a function of the seed,
    # as the rest of the run (not of what happened to draw before; a resume restores its state)
    torch.manual_seed(cfgs.train.seed)
    c = cfgs.lora
    state = getattr(model, "tp_state", None)  # a shard counts tp times, a replicated one once
    sharded, tp_size = ({}, 1) if state is None else (state.sharded, state.groups.tp_size)
    count = sum(p.numel() * (tp_size if name in sharded else 1)
                for name, p in model.named_parameters() if p.requires_grad)
    kinds = sorted({t.rsplit(".", 1)[-1] for t in targets})
    return (f"LoRA: r {c.lora_r}, alpha {c.lora_alpha}, scale {c.scaling:g}, on "
            f"{len(targets)} linears ({','.join(kinds)}): {count / 1e6:.2f} M trainable "
            f"parameters, the base frozen" + (f", from {c.adapter}" if c.adapter and not resume_dir
                                              else ""))


def shapes(cfg, task: Task, groups: tp.ParallelGroups, cfgs=None) -> tuple[Llama, Llama]:
    """The trainer and the sampler on the meta device, for --plan: from config.json (--model) or
    the fresh model's flags; no weight is read. With LoRA (cfgs.lora) the base in the compute
    dtype, the adapters fresh, the sampler the trainer itself."""
    frozen = cfgs is not None and cfgs.lora.use_peft
    with torch.device("meta"):  # shapes only
        if cfg.model:
            dtype = getattr(torch, cfg.dtype) if frozen else master_dtype(cfg)
            model = tp.shard_model(Llama(load_config(cfg.model)).to(dtype), groups)
        else:
            model = build_model(cfg, task, "", torch.device("meta"), groups, frozen)[0]
    if frozen:
        lora.add_adapters(model, cfgs.lora)
        tp.adapt(model)
        return model, model
    return model, _sampler(cfg, model)


def _sampler(cfg, model: Llama) -> Llama:
    """The trainer itself when it is in the sampler's dtype (--sampler_dtype, or --dtype: bf16's is
    a copy of the fp32 master), else a frozen copy in it (rollout.sampler_for). bf16 where it has
    no kernels (bf16_kernels): a float32 copy holding the weights rounded to bf16."""
    dtype = getattr(torch, cfg.sampler_dtype or cfg.dtype)
    if dtype == torch.bfloat16 and not bf16_kernels(cfg, next(model.parameters()).device):
        return rollout.sampler_for(model, torch.float32, values=torch.bfloat16)
    return rollout.sampler_for(model, dtype)
