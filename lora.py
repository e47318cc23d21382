"""
LoRA (arXiv:2106.09685) in plain PyTorch: the base model frozen, a trainable low-rank update beside
each targeted linear,

    y = W x + b + s * B A dropout(x),    A (r, in), B (out, r), s = alpha / r

(rsLoRA, arXiv:2312.03732: s = alpha / sqrt(r)). A is drawn as PEFT draws it (kaiming_uniform with
a = sqrt(5), i.e. uniform in +-1/sqrt(in)), B is zero: the adapted model starts as the base. The
dropout acts on the adapter's input alone, and only in a forward that builds gradients (the loss's):
the sampler and the no-grad logprobs see the adapted model without it. With beta > 0 the
reference policy is the base: the trainer with its adapters off (adapters_off), as TRL's.

The flags are TRL's ModelConfig's (--use_peft, --lora_r, --lora_alpha, --lora_dropout,
--lora_target_modules, --use_rslora) with its defaults; with no target named, PEFT's for the
architecture (q_proj, v_proj for Llama, Qwen2 and Qwen3). A targeted nn.Linear becomes a LoRALinear
in place (same object, its weight and bias under their names; tp.py swaps classes the same way),
so model.py knows nothing of LoRA. Adapters are float32 whatever the base's dtype (the master-weight
rule: a bf16 base stays bf16, frozen, with no gradient, optimizer state or master copy).

On disk an adapter is PEFT's: adapter_config.json and adapter_model.safetensors, keys
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (peft.PeftModel.from_pretrained reads
it); merge() folds it into the base weights for a plain Hugging Face directory.

Leaves out: DoRA, LoRA on embeddings or lm_head, modules_to_save, bias training, several adapters.
Shapes: r rank, in / out a linear's widths (in/tp, out/tp: a tensor-parallel shard), N tokens.
Tested by tests/test_lora.py; benchmarked by tests/bench_lora.py.
"""

import contextlib
import json
import math
import os
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from engine.hf import expected_shapes, load_config, read_json_object
from model import Llama

# -----------------------------------------------------------------------------
# Config


@dataclass
class LoRAConfig:
    use_peft: bool = False           # train LoRA adapters on a frozen base (TRL's switch)
    lora_r: int = 16                 # the adapters' rank r (TRL's default)
    lora_alpha: int = 32             # the update is (alpha / r) B A x (TRL's default)
    lora_dropout: float = 0.05       # dropout on the adapter's input in training (TRL's default)
    lora_target_modules: str = ""    # q_proj,v_proj or all-linear; "" = PEFT's for the arch
    use_rslora: bool = False         # scale by alpha / sqrt(r) (rsLoRA) instead of alpha / r
    adapter: str = ""                # a PEFT adapter directory to start from (--model: its base)
    merged: str = ""                 # with --adapter: write base + adapter merged here, then exit

    def __post_init__(self):
        if self.lora_r <= 0:
            raise ValueError(f"--lora_r must be >= 1 (the adapters' rank), got {self.lora_r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.adapter:  # an adapter to start from is LoRA training
            self.use_peft = True

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.lora_r) if self.use_rslora else self.lora_r)


# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the architectures model.py builds.
DEFAULT_TARGETS = {"LlamaForCausalLM": ("q_proj", "v_proj"),
                   "Qwen2ForCausalLM": ("q_proj", "v_proj"),
                   "Qwen3ForCausalLM": ("q_proj", "v_proj")}
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear but the output layer
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the base model's names

# -----------------------------------------------------------------------------
# The adapted linear


class LoRALinear(nn.Linear):
    """An nn.Linear (weight and bias frozen, under their names) plus lora_A (r, in) and lora_B
    (out, r), float32. add_adapters swaps a module's class to this one and gives it its adapter."""
    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float
    dropout: float

    def adapter_weights(self) -> tuple[Tensor, Tensor]:
        """A and B as the update reads them (tp.py's column-parallel linear wraps A in f)."""
        return self.lora_A, self.lora_B

    def update(self, x: Tensor) -> Tensor:
        """s * B A dropout(x): (..., in) -> (..., out), in x's dtype. A and B are cast to it: a
        bf16 sampler runs the bf16 matmuls autocast runs in the trainer's forward."""
        A, B = self.adapter_weights()
        if self.dropout and self.training and torch.is_grad_enabled():  # the loss's forward only
            x = F.dropout(x, self.dropout)
        return F.linear(F.linear(x, A.to(x.dtype)), B.to(x.dtype)) * self.scaling  # (..., out)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.update(x)  # (..., out)

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """W + s B A in W's dtype (computed in at least float32): a new tensor, W untouched."""
        dt = torch.promote_types(self.weight.dtype, torch.float32)
        delta = (self.lora_B.to(dt) @ self.lora_A.to(dt)) * self.scaling  # (out, in)
        return (self.weight.to(dt) + delta).to(self.weight.dtype)


def adapted(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """The model's adapted linears, (module name, module), in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def is_adapter(name: str) -> bool:
    """A parameter name of an adapter (`...q_proj.lora_A`)."""
    return name.endswith((".lora_A", ".lora_B"))

# -----------------------------------------------------------------------------
# Targets: which linears get an adapter


def linear_names(model: nn.Module) -> list[str]:
    """The short names of the model's linears an adapter may go on (every one but lm_head)."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name != "lm_head"}
    return sorted(names)


def target_modules(model: nn.Module, spec: str) -> list[str]:
    """The full module names the flag's targets pick: "" PEFT's default for the architecture,
    all-linear every linear but lm_head, else comma-separated names, each matching a module's
    name or its last parts (PEFT's rule). One that matches nothing is refused, naming the
    model's linears."""
    linears = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name != "lm_head"]
    if spec.strip().lower() == ALL_LINEAR:
        return linears
    wanted = [t.strip() for t in spec.split(",") if t.strip()] if spec.strip() else \
        list(DEFAULT_TARGETS[model.config.architecture])
    picked = []
    for target in wanted:
        hits = [n for n in linears if n == target or n.endswith("." + target)]
        if not hits:
            raise ValueError(f"--lora_target_modules {target!r} matches no linear of the model; "
                             f"its linears: {','.join(linear_names(model))} (or all-linear)")
        picked += hits
    return [n for n in linears if n in set(picked)]  # module order, each once

# -----------------------------------------------------------------------------
# Adding adapters


def shard_of(model: nn.Module, name: str) -> tuple[int, int, int] | None:
    """(dim, start, stop) of this rank's slice of linear `name`'s weight under tensor parallelism
    (tp.py's TPState.sharded), or None: the whole weight."""
    state = getattr(model, "tp_state", None)
    return None if state is None else state.sharded.get(name + ".weight")


def add_adapters(model: Llama, cfg: LoRAConfig, seed: int = 0,
                 targets: list[str] | None = None) -> list[str]:
    """In place: freeze every parameter, then give each target linear (target_modules, or the
    names given) an adapter: A drawn as PEFT draws it from (seed, module name), B zero, float32,
    on the weights' device. The draw is of the full (r, in) A, so a tensor-parallel rank slices
    the same numbers one process holds (row-parallel: A by columns; column-parallel: B by rows,
    zero anyway). Returns the module names."""
    targets = target_modules(model, cfg.lora_target_modules) if targets is None else targets
    model.requires_grad_(False)
    shapes = expected_shapes(model.config)  # the unsharded model's (out, in) of each weight
    for name in targets:
        out, in_ = shapes[name + ".weight"]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        # kaiming_uniform_(a=sqrt(5)) on (r, in): gain sqrt(2 / (1 + 5)), bound gain*sqrt(3/in)
        A = (torch.rand(cfg.lora_r, in_, generator=gen) * 2 - 1) / math.sqrt(in_)  # (r, in)
        B = torch.zeros(out, cfg.lora_r)  # (out, r)
        attach(model, name, A, B, cfg.scaling, cfg.lora_dropout)
    return targets


def attach(model: nn.Module, name: str, A: Tensor, B: Tensor, scaling: float,
           dropout: float) -> None:
    """Give linear `name` the full adapter A (r, in), B (out, r), as this rank's slice of it."""
    m = model.get_submodule(name)
    shard = shard_of(model, name)
    if shard is not None:  # column-parallel (dim 0): B's rows; row-parallel (dim 1): A's columns
        dim, start, stop = shard
        A, B = (A, B[start:stop]) if dim == 0 else (A[:, start:stop], B)
        # the sharded one: B by rows as the weight (dim 0), or A by columns as the weight (dim 1)
        model.tp_state.sharded[f"{name}.lora_{'B' if dim == 0 else 'A'}"] = (dim, start, stop)
    device = m.weight.device
    if type(m) is nn.Linear:  # a tensor-parallel row-parallel linear keeps its class: tp.adapt
        m.__class__ = LoRALinear
    m.lora_A = nn.Parameter(A.to(device=device, dtype=torch.float32).contiguous())
    m.lora_B = nn.Parameter(B.to(device=device, dtype=torch.float32).contiguous())
    m.scaling = scaling
    m.dropout = dropout


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Meanwhile every adapted linear computes its base alone: the scale 0, so W x + b + 0, the
    base's values exactly. A LoRA run's reference policy (beta > 0) is its trainer so, as TRL's
    is the PEFT model with its adapter disabled: no copy of the base."""
    modules = [m for _, m in adapted(model)]
    scales = [m.scaling for m in modules]
    try:
        for m in modules:
            m.scaling = 0.0
        yield model
    finally:
        for m, s in zip(modules, scales):
            m.scaling = s


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer steps: all of them, or with LoRA the adapters alone."""
    return [p for p in model.parameters() if p.requires_grad]


def check_flags(cfgs) -> None:
    """What LoRA cannot run with (cfgs: train.py's Configs), one line each."""
    if not cfgs.lora.use_peft:
        if cfgs.lora.merged:
            raise ValueError("--merged writes a base merged with --adapter DIR: pass both")
        return
    if cfgs.parallel.sequence_parallel:
        raise ValueError("--use_peft with --sequence_parallel: the fused all-gather linears "
                         "take no adapter; drop --sequence_parallel")
    if cfgs.train.sampler_dtype not in ("", cfgs.train.dtype):
        raise ValueError("--use_peft samples from the adapted model itself, in --dtype: drop "
                         "--sampler_dtype")

# -----------------------------------------------------------------------------
# PEFT's files


def peft_tensors(named: dict[str, Tensor]) -> dict[str, Tensor]:
    """Adapter tensors under PEFT's saved names, from {`<module>.lora_A`: tensor, ...} (full
    tensors: tp.full_state_dict gathers a sharded model's)."""
    return {f"{PEFT_PREFIX}{name}.weight": t.detach().float().cpu().contiguous()
            for name, t in named.items() if is_adapter(name)}


def peft_config(cfg: LoRAConfig, targets: list[str], base: str) -> dict:
    """adapter_config.json as PEFT writes it for a LoRA of a causal LM (the fields it reads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
            "target_modules": sorted({t.rsplit(".", 1)[-1] for t in targets}),
            "use_rslora": cfg.use_rslora, "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "use_dora": False, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def save_adapter(path: str, named: dict[str, Tensor], cfg: LoRAConfig, base: str) -> None:
    """adapter_config.json and adapter_model.safetensors into `path` (which exists), from the
    model's full tensors by name (its adapters' are picked out)."""
    targets = sorted({name.rsplit(".", 1)[0] for name in named if is_adapter(name)})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config(cfg, targets, base), f, indent=2)
    save_file(peft_tensors(named), os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def read_adapter(path: str, model: Llama) -> tuple[LoRAConfig, dict[str, tuple[Tensor, Tensor]]]:
    """A PEFT LoRA adapter directory for `model`: its config (r, alpha, rsLoRA) and each module's
    full (A, B), checked against the model's linears; one ValueError saying what does not fit."""
    config_file = os.path.join(path, "adapter_config.json")
    weights = os.path.join(path, "adapter_model.safetensors")
    for file in (config_file, weights):
        if not os.path.isfile(file):
            raise FileNotFoundError(f"--adapter {path}: {os.path.basename(file)} not found (a "
                                    "PEFT adapter directory holds adapter_config.json and "
                                    "adapter_model.safetensors)")
    d = read_json_object(config_file)
    if d.get("peft_type", "LORA") != "LORA" or d.get("use_dora") or d.get("modules_to_save"):
        raise ValueError(f"--adapter {path}: only plain LoRA adapters load here (peft_type LORA, "
                         "no DoRA, no modules_to_save)")
    if d.get("rank_pattern") or d.get("alpha_pattern"):
        raise ValueError(f"--adapter {path}: per-module ranks or alphas are not supported")
    cfg = LoRAConfig(use_peft=True, lora_r=int(d["r"]), lora_alpha=d["lora_alpha"],
                     lora_dropout=float(d.get("lora_dropout", 0.0)),
                     use_rslora=bool(d.get("use_rslora", False)))
    modules = {}
    shapes = expected_shapes(model.config)
    with safe_open(weights, framework="pt", device="cpu") as f:
        for key in f.keys():
            name = key.removeprefix(PEFT_PREFIX)
            part = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
            module = name.rsplit(".", 2)[0]
            if part not in ("lora_A", "lora_B") or module + ".weight" not in shapes:
                raise ValueError(f"--adapter {path}: tensor {key} fits no linear of this model "
                                 f"(is --model its base?)")
            modules.setdefault(module, {})[part] = f.get_tensor(key)
    for module, parts in modules.items():
        out, in_ = shapes[module + ".weight"]
        want = dict(lora_A=(cfg.lora_r, in_), lora_B=(out, cfg.lora_r))
        got = {k: tuple(parts[k].shape) if k in parts else None for k in want}
        if got != want:
            raise ValueError(f"--adapter {path}: {module} holds A, B of shapes {got['lora_A']}, "
                             f"{got['lora_B']}; this model's needs {want['lora_A']}, "
                             f"{want['lora_B']} (r {cfg.lora_r}): is --model its base?")
    if not modules:
        raise ValueError(f"--adapter {path}: adapter_model.safetensors holds no LoRA tensor")
    return cfg, {m: (p["lora_A"], p["lora_B"]) for m, p in modules.items()}


def load_adapter(model: Llama, path: str, dropout: float | None = None) -> tuple[LoRAConfig,
                                                                                list[str]]:
    """In place: freeze the model and attach the adapter of a PEFT directory (read_adapter), this
    rank's slice of it under tensor parallelism. Returns its config and the module names."""
    cfg, modules = read_adapter(path, model)
    model.requires_grad_(False)
    for name, (A, B) in modules.items():
        attach(model, name, A, B, cfg.scaling, cfg.lora_dropout if dropout is None else dropout)
    return cfg, list(modules)


def check_base(path: str, base: str, model: Llama) -> None:
    """An adapter whose adapter_config.json names a base directory that exists here and whose
    config.json is not this model's is refused: its shapes may fit a different model."""
    named = read_json_object(os.path.join(path, "adapter_config.json")).get(
        "base_model_name_or_path") or ""
    config = os.path.join(named, "config.json")
    if not named or os.path.abspath(named) == os.path.abspath(base) or not os.path.isfile(config):
        return
    if load_config(named) != model.config:
        raise ValueError(f"--adapter {path} was trained on {named}, whose config.json differs "
                         f"from --model {base}'s; pass its base as --model")

# -----------------------------------------------------------------------------
# Merging


@torch.no_grad()
def merge(model: Llama) -> Llama:
    """In place: each adapted linear becomes a plain nn.Linear of weight W + s B A (its dtype),
    its adapter gone: the model hf.save_model writes as a Hugging Face directory."""
    for _, m in adapted(model):
        m.weight = nn.Parameter(m.merged_weight(), requires_grad=False)
        del m.lora_A, m.lora_B
        m.__class__ = nn.Linear
    return model
