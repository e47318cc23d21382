"""
The run's models, built from its flags: the trainer (the weights the optimizer steps), the sampler
(the trainer itself, or a copy in --sampler_dtype that rollout.sync_weights refreshes before each
rollout) and the frozen reference (the initial policy, when beta > 0); with --use_peft (lora.py)
the base frozen and adapted, the sampler the trainer itself, no reference copy.

- build_model: from a Hugging Face directory (--model, or the checkpoint being resumed: its fp32
  master/ when it has one; under tensor parallelism each rank reads its slice), or fresh: a
  character tokenizer for the task's alphabet and a tiny Llama initialised from the seed.
- compile_model: --compile_blocks (engine/compiling.py) and, on CUDA, the training attention's route.
- build: the three, the trainer's blocks compiled and checkpointed; adapt: LoRA's adapters;
  shapes: the trainer and the sampler on the meta device, for --plan.

Handed train.py's configs (cfg: its TrainConfig, cfgs: its Configs); it imports nothing above it.
Leaves out: the optimizer and the memory phases (train.py, run/plan.py), the weight sync
(rollout.py), checkpoints (run/checkpoint.py).
Tested by tests/test_train.py (fresh and loaded models, bf16's master weights, compiled blocks) and
tests/test_lora.py.
"""

import copy
import dataclasses

import torch

import lora
import memory
import rollout
import tp
from engine import compiling, packing, precision
from engine import tokenizer as tk
from engine.hf import load_config, load_model
from model import Llama, ModelConfig
from run import checkpoint
from tasks import Task


def build_model(cfg, task: Task, source: str, device: torch.device, ranks: tp.ParallelGroups,
                frozen: bool = False) -> tuple[Llama, tk.PromptTokenizer]:
    """From a HF directory (--model, or a checkpoint being resumed: its fp32 master/ when it has
    one), or fresh: a char tokenizer for the task's alphabet and a tiny Llama initialised from the
    seed (the same on every rank). In the trainer's dtype: float32 under bf16 mixed precision; a
    frozen base (LoRA's) in the compute dtype, bf16 stays bf16, but where bf16 has no kernels
    (engine/precision.py) it holds bf16's values in float32."""
    dtype = getattr(torch, cfg.dtype) if frozen else precision.master_dtype(cfg)
    if source:
        weights = checkpoint.master_dir(source) or source
        if ranks.tp_size > 1:
            model = tp.load_sharded(weights, ranks, device, dtype)  # each rank reads its slice
        else:
            model = load_model(weights, device=device, dtype=dtype)
        return multiplied(cfg, model, device), tk.load_tokenizer(source, model.config.vocab_size)
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
    if ranks.tp_size > 1:
        tp.shard_model(model, ranks)
    return multiplied(cfg, model, device), tokenizer


def multiplied(cfg, model: Llama, device: torch.device) -> Llama:
    """A bf16 model (LoRA's frozen base) where bf16 has no kernels (precision.bf16_kernels): its
    bf16 values held in float32, so its matmuls run float32's kernels (bf16's are 5-40x slower
    there: SmolLM2-135M's LoRA step took 21x native bf16's, docs/measurements.md); the trainer runs
    without autocast, as full fine-tuning's fp32 master does there. Else the model as it is."""
    bf16 = model.model.embed_tokens.weight.dtype == torch.bfloat16
    return model.float() if bf16 and not precision.bf16_kernels(cfg, device) else model


def compile_model(cfg, model: Llama, device: torch.device, ranks: tp.ParallelGroups) -> list[str]:
    """--compile_blocks: the blocks' training forward compiled once per model (engine/compiling.py);
    torch's caches in --compile_cache (for the decode step's compile too: --compile_decode,
    rollout.py); and on CUDA the training attention's route (packing.cuda_route). Returns the lines
    the first step prints: what was compiled, or why not, and any fallback."""
    cache = compiling.use_cache(cfg.compile_cache)
    notes = []
    if device.type == "cuda":
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else precision.master_dtype(cfg)
        notes.append(packing.cuda_route(dtype, model.config.head_dim,
                                        compiling.worth_compiling(model))[1])
    if cfg.compile_blocks == "false" or (cfg.compile_blocks == "auto" and device.type != "cuda"):
        return notes
    if not compiling.decide(cfg.compile_blocks, model):  # auto on CUDA, a model too small to pay
        blocks = sum(p.numel() for p in model.model.layers.parameters())
        return notes + [f"--compile_blocks auto: the blocks run eager ({blocks / 1e6:.1f} M "
                        f"parameters: a compile pays from {compiling.MIN_COMPILE_PARAMS / 1e6:.0f} "
                        "M)"]
    why = compiling.unsupported()
    if not why and ranks.tp_size > 1:
        why = "a tensor-parallel block has collectives inside it"
    if why:
        return notes + [f"--compile_blocks: the blocks run eager: {why}"]
    compiling.compile_blocks(model.model.layers)
    return notes + [f"compile: each block's training forward, one graph for every layer and "
                    f"length, paid at the first step (caches in {cache})"]


def build(cfgs, task: Task, source: str, resume_dir: str, device: torch.device,
          ranks: tp.ParallelGroups) -> tuple[Llama, tk.PromptTokenizer, Llama, Llama | None,
                                              lora.LoRAConfig, list[str]]:
    """The trainer (from `source`, or fresh), its tokenizer, the sampler, the reference (None
    when beta = 0), the adapters' config as adapt applied it (cfgs.lora without LoRA), and
    compile_model's lines; the trainer's blocks compiled and checkpointed as the flags say (after
    the copies are made: they stay plain)."""
    cfg = cfgs.train
    if cfgs.lora.use_peft:  # the base from --model (a resumed run's adapter is in its checkpoint)
        model, tokenizer = build_model(cfg, task, cfg.model, device, ranks, frozen=True)
        applied, line = adapt(cfgs, model, resume_dir)
        sampler = model  # the adapted model samples itself: no copy of the base
        notes = [line] + compile_model(cfg, model, device, ranks)
        memory.checkpoint_blocks(model.model.layers, cfgs.memory.activation_checkpoint)
        return model, tokenizer, sampler, None, applied, notes
    model, tokenizer = build_model(cfg, task, source, device, ranks)
    reference = None
    if cfgs.grpo.beta > 0:  # on resume, rebuilt from --model (or the seed): the initial policy
        reference = (build_model(cfg, task, cfg.model, device, ranks)[0] if resume_dir
                     else copy.deepcopy(model)).requires_grad_(False)
    sampler = sampler_copy(cfg, model)
    notes = compile_model(cfg, model, device, ranks)
    memory.checkpoint_blocks(model.model.layers, cfgs.memory.activation_checkpoint)
    memory.grads_into_weight(model.model.embed_tokens)
    return model, tokenizer, sampler, reference, cfgs.lora, notes


def adapt(cfgs, model: Llama, resume_dir: str) -> tuple[lora.LoRAConfig, str]:
    """LoRA (lora.py): the base frozen, adapters from a resumed checkpoint, --adapter's PEFT
    directory, or fresh from the seed; under tensor parallelism each rank's slice (tp.adapt).
    Returns the adapters' config as applied (a loaded adapter's r, alpha and rsLoRA; the full
    names of the linears it is on, for the checkpoint's adapter_config.json) and the line the
    first step prints."""
    c = cfgs.lora
    if resume_dir or c.adapter:
        path = resume_dir or c.adapter
        if not resume_dir:
            lora.check_base(path, cfgs.train.model, model)
        got, targets = lora.load_adapter(model, path, dropout=c.lora_dropout)
        c = dataclasses.replace(c, lora_r=got.lora_r, lora_alpha=got.lora_alpha,
                                use_rslora=got.use_rslora, lora_target_modules=",".join(targets))
    else:
        targets = lora.add_adapters(model, c, cfgs.train.seed)
        c = dataclasses.replace(c, lora_target_modules=",".join(targets))
    tp.adapt(model)
    # The adapters' dropout draws from torch's global generator: its masks a function of the seed,
    # as the rest of the run (not of what happened to draw before; a resume restores its state)
    torch.manual_seed(cfgs.train.seed)
    state = getattr(model, "tp_state", None)  # a shard counts tp times, a replicated one once
    sharded, tp_size = ({}, 1) if state is None else (state.sharded, state.ranks.tp_size)
    count = sum(p.numel() * (tp_size if name in sharded else 1)
                for name, p in model.named_parameters() if p.requires_grad)
    kinds = sorted({t.rsplit(".", 1)[-1] for t in targets})
    line = (f"LoRA: r {c.lora_r}, alpha {c.lora_alpha}, scale {c.scaling:g}, on {len(targets)} "
            f"linears ({','.join(kinds)}): {count / 1e6:.2f} M trainable parameters, the base "
            "frozen" + (f", from {c.adapter}" if c.adapter and not resume_dir else ""))
    return c, line


def shapes(cfg, task: Task, ranks: tp.ParallelGroups, cfgs=None) -> tuple[Llama, Llama]:
    """The trainer and the sampler on the meta device, for --plan: from config.json (--model) or
    the fresh model's flags; no weight is read. With LoRA (cfgs.lora) the base in the compute
    dtype, the adapters fresh, the sampler the trainer itself."""
    frozen = cfgs is not None and cfgs.lora.use_peft
    with torch.device("meta"):  # shapes only
        if cfg.model:
            dtype = getattr(torch, cfg.dtype) if frozen else precision.master_dtype(cfg)
            model = tp.shard_model(Llama(load_config(cfg.model)).to(dtype), ranks)
        else:
            model = build_model(cfg, task, "", torch.device("meta"), ranks, frozen)[0]
    if frozen:
        lora.add_adapters(model, cfgs.lora)
        tp.adapt(model)
        return model, model
    return model, sampler_copy(cfg, model)


def sampler_copy(cfg, model: Llama) -> Llama:
    """The trainer itself when it is in the sampler's dtype (--sampler_dtype, or --dtype: bf16's is
    a copy of the fp32 master), else a frozen copy in it (rollout.sampler_for). bf16 where it has
    no kernels (bf16_kernels): a float32 copy holding the weights rounded to bf16."""
    dtype = getattr(torch, cfg.sampler_dtype or cfg.dtype)
    if dtype == torch.bfloat16 and not precision.bf16_kernels(cfg, next(model.parameters()).device):
        return rollout.sampler_for(model, torch.float32, values=torch.bfloat16)
    return rollout.sampler_for(model, dtype)
