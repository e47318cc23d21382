"""
A small Llama (also Qwen2) in plain PyTorch that reads and writes Hugging Face checkpoint
directories.

RMSNorm, rotary embeddings (HF rotate-half convention, Llama-3 / linear rope scaling), grouped-query
attention through F.scaled_dot_product_attention, SwiGLU MLP, optional tied embeddings, the biases
transformers builds (Llama: attention_bias on q/k/v/o, mlp_bias on gate/up/down; Qwen2: q/k/v).
Parameter names are HF's, so a checkpoint is a plain safetensors read.

Checkpoints in: config.json in the transformers 4 layout (top-level rope_theta / rope_scaling) or
the 5 layout (rope_parameters). Every field that changes the math is read; anything this model would
not compute exactly as transformers does (MoE, sliding windows, other rope types, partial rotary, a
field of the wrong type, a tensor no module uses) is refused with one line naming the file and the
field or tensor. Checkpoints out: a config.json both versions read alike, and generation_config.json
when given one. stop_token_ids: config.json's and generation_config.json's eos ids together.

Leaves out: any parallelism (tp.py swaps modules), sampling (rollout.py) or loss (grpo.py).

The one hook the other files need: `attention(layer, q, k, v) -> y`, an optional callable every
attention layer calls with rotated q/k/v. The default is causal SDPA; rollout.py passes one that
writes a KV cache, grpo.py one that attends completions to a shared prompt. A forward given `last`
(only each row's position last[b] is wanted: a prefill) asks the final layer for those queries
alone and calls `attention(layer, q, k, v, last=last)` there, q (B, H, 1, D): keys after last[b]
are that row's padding, which the hook masks (`causal_attention` does). `prefix_attention` is
the exact two-part attention (shared prefix KV + each row's own KV, merged by log-sum-exp) both use.

Shapes: B sequences, T tokens, S keys, C width, H/Hkv heads, D head dim, V vocab, L layers,
Bp prompts, G samples per prompt, P prompt length.
Tested by tests/test_model.py.
"""

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

# -----------------------------------------------------------------------------
# Config

# model_type -> architecture, for a config.json without "architectures" (a model's save_pretrained
# writes that field, LlamaConfig.save_pretrained alone does not).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ModelConfig:
    vocab_size: int = 2048
    hidden_size: int = 256            # C
    intermediate_size: int = 704      # SwiGLU width, ~8/3 C rounded
    num_hidden_layers: int = 4        # L
    num_attention_heads: int = 8      # H
    num_key_value_heads: int = 4      # Hkv; H % Hkv == 0 (GQA)
    head_dim: int = 0                 # D; 0 means C // H (some HF configs set it explicitly)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", HF's fields}, no theta
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # HF's: Llama q/k/v/o; Qwen2 always q/k/v; None: the arch's
    mlp_bias: bool = False            # Llama's gate/up/down bias (Qwen2 has none)
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        qwen = self.architecture == "Qwen2ForCausalLM"
        assert self.architecture in ARCHITECTURES.values(), f"unknown {self.architecture=}"
        if self.attention_bias is None:
            self.attention_bias = qwen
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        H, Hkv = self.num_attention_heads, self.num_key_value_heads
        assert H % Hkv == 0, "heads must be a multiple of kv heads"
        assert self.head_dim % 2 == 0, "rotary embeddings need an even head_dim"
        assert not qwen or (self.attention_bias and not self.mlp_bias), "Qwen2: q/k/v bias only"
        kind = None if self.rope_scaling is None else self.rope_scaling.get("rope_type")
        assert kind in (None, "linear", "llama3"), f"rope_scaling needs rope_type linear or llama3"

    @property
    def o_proj_bias(self) -> bool:
        """Llama's attention_bias covers o_proj too; Qwen2's q/k/v bias never does."""
        return self.attention_bias and self.architecture == "LlamaForCausalLM"

# -----------------------------------------------------------------------------
# Stateless math: rotary embeddings and attention


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies (D/2,), in HF's exact float32 arithmetic, with optional rope scaling."""
    D = cfg.head_dim
    # device="cpu" explicitly: the model may be built under `with torch.device("meta")`.
    exponents = torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D  # (D/2,)
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # Llama-3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables (B, T, D) for integer positions (B, T), computed in float32 like
    HF. The sin table's first half is negated, so that apply_rotary_emb's rotate-half is a roll
    (the same values as HF)."""
    freqs = positions[..., None].float() * inv_freq.float()  # (B, T, D/2)
    cos = freqs.cos()
    sin = freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF rotate-half on (B, H, T, D): pairs dimension i with i + D/2 (not interleaved pairs).
    HF's x*cos + cat(-x2, x1)*sin, with the sign folded into `sin` (rope_cos_sin) and cat(x2, x1)
    a roll."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin[:, None]


def causal_attention(layer: int, q: Tensor, k: Tensor, v: Tensor,
                     last: Tensor | None = None) -> Tensor:
    """The default attention: causal over the T tokens given. q (B, H, T, D), k/v (B, Hkv, T, D).
    With last (B,), q (B, H, 1, D) is each row's position last[b] alone: it sees keys 0..last[b]."""
    gqa = q.shape[1] != k.shape[1]
    if last is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    allowed = torch.arange(k.shape[2], device=k.device) <= last[:, None]  # (B, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None, None],
                                          enable_gqa=gqa)  # (B, H, 1, D)


def at_last(x: Tensor, last: Tensor) -> Tensor:
    """Position last[b] of each row: (B, T, ...) -> (B, 1, ...)."""
    return x[torch.arange(x.shape[0], device=x.device), last][:, None]


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention that also returns its log-sum-exp, so partial results can be merged.
    q (B, Hkv, M, D), k/v (B, Hkv, S, D), allowed broadcastable to (B, Hkv, M, S) bool.
    Returns out (B, Hkv, M, D) and lse (B, Hkv, M) in float32 (or float64); a query with no allowed
    key gets out 0 and lse -inf (it then contributes nothing to a merge)."""
    dt = torch.promote_types(q.dtype, torch.float32)  # bf16 accumulates in float32, float64 stays
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, Hkv, M, S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, M)
    probs = torch.exp(scores - lse.clamp_min(-1e30)[..., None])  # all-masked rows: 0, not NaN
    return probs @ v.to(dt), lse


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, own_allowed: Tensor,
                     prefix_k: Tensor, prefix_v: Tensor, prefix_valid: Tensor) -> Tensor:
    """Exact attention of Bp*G rows to one shared prefix per group plus their own keys (Hydragen).

    q (Bp*G, H, T, D); k/v (Bp*G, Hkv, S, D) each row's own keys; own_allowed (Bp*G or 1, T, S)
    bool. prefix_k/v (Bp, Hkv, P, D) computed once per group; prefix_valid (Bp, P) bool (False =
    padding). The G rows are folded into the query dimension, so the prefix KV is read once per
    group and never copied G times; the two partial softmaxes are merged by their log-sum-exp.
    Returns (Bp*G, H, T, D).
    """
    N, H, T, D = q.shape
    Bp, Hkv, P, _ = prefix_k.shape
    G = N // Bp
    rep = H // Hkv
    assert N == Bp * G and k.shape[0] == N and prefix_valid.shape == (Bp, P), "shapes do not match"
    # Part 1: all G rows of a group (and the rep query heads of a kv head) against the prefix.
    qp = q.view(Bp, G, Hkv, rep, T, D).transpose(1, 2).reshape(Bp, Hkv, G * rep * T, D)
    out_p, lse_p = attention_with_lse(qp, prefix_k, prefix_v, prefix_valid[:, None, None, :])
    out_p = out_p.view(Bp, Hkv, G, rep, T, D).transpose(1, 2).reshape(N, H, T, D)  # (Bp*G, H, T, D)
    lse_p = lse_p.view(Bp, Hkv, G, rep, T).transpose(1, 2).reshape(N, H, T)  # (Bp*G, H, T)
    # Part 2: each row against its own keys (GQA by folding the rep heads into the query dimension).
    qs = q.reshape(N, Hkv, rep * T, D)  # (Bp*G, Hkv, rep*T, D)
    allowed = own_allowed[:, None, None].expand(-1, Hkv, rep, -1, -1)
    allowed = allowed.reshape(-1, Hkv, rep * T, k.shape[2])  # (Bp*G or 1, Hkv, rep*T, S)
    out_s, lse_s = attention_with_lse(qs, k, v, allowed)
    out_s = out_s.view(N, H, T, D)
    lse_s = lse_s.view(N, H, T)
    # Merge: softmax over [prefix keys, own keys] = each part weighed by exp(lse_part - lse_all).
    lse = torch.logaddexp(lse_p, lse_s)  # (Bp*G, H, T)
    out = out_p * torch.exp(lse_p - lse)[..., None] + out_s * torch.exp(lse_s - lse)[..., None]
    return out.to(q.dtype)

# -----------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) in float32, cast back, then scaled: HF's order, which matters in
    bf16. F.rms_norm is that formula in one call (3x faster than five separate ops at prefill sizes
    on the CPU)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        C, D = cfg.hidden_size, cfg.head_dim
        H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer = layer
        self.head_dim = D
        self.q_proj = nn.Linear(C, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, C, bias=cfg.o_proj_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable,
                last: Tensor | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C), or (B, 1, C) with last: the queries (and o_proj) of position
        last[b] alone, the keys/values of every position (a prefill's final layer)."""
        B, T, _ = x.shape
        xq, cos_q, sin_q = (x, cos, sin) if last is None else (at_last(x, last), at_last(cos, last),
                                                               at_last(sin, last))
        # Head counts come from the tensor shapes: a tensor-parallel shard (H/tp heads) runs as is.
        q = self.q_proj(xq).view(B, xq.shape[1], -1, self.head_dim).transpose(1, 2)  # (B, H, Tq, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q = apply_rotary_emb(q, cos_q, sin_q)
        k = apply_rotary_emb(k, cos, sin)
        if last is None:
            y = attention(self.layer, q, k, v)  # (B, H, T, D)
        else:
            y = attention(self.layer, q, k, v, last=last)  # (B, H, 1, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, xq.shape[1], -1))  # (B, Tq, C)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, C, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable,
                last: Tensor | None = None) -> Tensor:
        # With last only those positions reach the output: their queries, o_proj and MLP run alone.
        y = self.self_attn(self.input_layernorm(x), cos, sin, attention, last)  # (B, T|1, C)
        x = (x if last is None else at_last(x, last)) + y
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's `model.` prefix: embeddings, blocks, final norm."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not a parameter, not saved, and not a buffer: module.to(bfloat16) would round the
        # frequencies (HF keeps them in float32). It follows the tokens' device on first use.
        self.inv_freq = rope_inv_freq(cfg)  # (D/2,) float32

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Llama":
        """HF's initialisation (normal(0, initializer_range), norms at 1, biases 0), reproducible
        by seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():  # tied lm_head appears once
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def rope(self, tokens: Tensor, positions: Tensor | None,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The cos/sin tables (B, T, D) of (B, T) tokens at positions (default 0..T-1)."""
        assert tokens.dim() == 2, f"tokens must be (B, T), got {tuple(tokens.shape)}"
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        if self.inv_freq.device != tokens.device:
            self.inv_freq = self.inv_freq.to(tokens.device)
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def hidden(self, tokens: Tensor, positions: Tensor | None = None,
               attention: Callable | None = None, last: Tensor | None = None) -> Tensor:
        """The residual stream before the final norm, (B, T) ids -> (B, T, C).
        positions (B, T) default to 0..T-1; `attention(layer, q, k, v)` defaults to causal SDPA.
        last (B,): only position last[b] of each row is wanted (a prefill before sampling), so the
        final block's queries, o_proj and MLP run on those alone (its keys/values, which the hook
        still gets, cover every position): (B, 1, C)."""
        for x in self.hidden_steps(tokens, positions, attention, last):
            pass
        return x

    def hidden_steps(self, tokens: Tensor, positions: Tensor | None = None,
                     attention: Callable | None = None,
                     last: Tensor | None = None) -> Iterator[Tensor]:
        """hidden() one block at a time: yields the residual stream after each block, the last
        one hidden()'s result. Two forwards stepped in turn run interleaved layer by layer
        (grpo.shared_prompt_hidden: then backward, too, alternates between them)."""
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        cos, sin = self.rope(tokens, positions, x.dtype)  # (B, T, D)
        final = len(self.model.layers) - 1
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, attention or causal_attention, last if i == final else None)
            yield x

    def head(self, h: Tensor) -> Tensor:
        """Final norm + lm_head: (..., C) -> (..., V) logits; grpo.py calls it chunk by chunk."""
        return self.lm_head(self.model.norm(h))

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                attention: Callable | None = None) -> Tensor:
        return self.head(self.hidden(tokens, positions, attention))  # (B, T, V)

    # -------------------------------------------------------------------------
    # Hugging Face checkpoint directories

    @classmethod
    def from_pretrained(cls, path: str, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "Llama":
        """The model an HF checkpoint directory describes, or one ValueError saying why not."""
        cfg = load_config(path)
        files = check_checkpoint(path, expected_shapes(cfg))  # name -> file; names, shapes checked
        with torch.device("meta"):
            model = cls(cfg)
        allocate(model, device, dtype)  # NOTE: re-creates every parameter, which unties lm_head
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
        with torch.no_grad():
            for file in sorted(set(files.values())):
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in [n for n in params if files[n] == file]:
                        params[name].copy_(f.get_tensor(name))
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int | None = None,
                        generation_config: dict | None = None) -> None:
        """Write config.json and model.safetensors (or shards + model.safetensors.index.json), and
        generation_config.json when given one (the source's, from load_generation_config)."""
        # A tied lm_head appears once, as the embedding: not written, as HF does (and safetensors
        # refuses shared storage anyway).
        tensors = {n: p.detach() for n, p in self.named_parameters()}
        write_pretrained(path, self.config, tensors, max_shard_bytes, generation_config)


def allocate(model: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """Uninitialised memory on `device` in `dtype` for every parameter of a model built on the meta
    device (the loaders then fill it). Not module.to_empty(device).to(dtype): that allocates the
    whole model in float32 first, so a bf16 load peaked at 4 bytes a parameter on the device
    instead of 2. Re-creates each parameter: a tied lm_head comes out untied (re-tie it)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=p.requires_grad))
    return model


def write_pretrained(path: str, config: ModelConfig, tensors: dict[str, Tensor],
                     max_shard_bytes: int | None = None,
                     generation_config: dict | None = None) -> None:
    """A Hugging Face checkpoint directory from a config and the full tensors named as
    Llama.named_parameters() names them (tp.py gathers a sharded model's into such a dict)."""
    if generation_config is not None and not isinstance(generation_config, dict):
        kind = type(generation_config).__name__
        raise TypeError(f"generation_config must be a dict, got a {kind}")
    expected = expected_shapes(config)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        wrong = sorted(set(got.items()) ^ set(expected.items()))
        raise ValueError(f"write_pretrained: tensors do not match the config, e.g. {wrong[0]}")
    os.makedirs(path, exist_ok=True)
    if generation_config is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config, f, indent=2)
    state = {n: t.cpu().contiguous() for n, t in tensors.items()}
    dtype = next(iter(state.values())).dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config, dtype), f, indent=2)
    shards = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

# -----------------------------------------------------------------------------
# config.json: transformers 4 and 5 layouts in, one layout both read out

# Every config.json field read below and the JSON value it must hold ("?": null allowed = absent).
FIELD_TYPES = {
    "architectures": "names?", "model_type": "name?", "hidden_act": "name",
    "vocab_size": "size", "hidden_size": "size", "intermediate_size": "size",
    "num_hidden_layers": "size", "num_attention_heads": "size", "num_key_value_heads": "size?",
    "head_dim": "size?", "max_position_embeddings": "size", "rms_norm_eps": "number",
    "rope_theta": "number?", "rope_scaling": "object?", "rope_parameters": "object?",
    "partial_rotary_factor": "number?", "tie_word_embeddings": "bool", "attention_bias": "bool",
    "mlp_bias": "bool", "use_sliding_window": "bool", "sliding_window": "size?",
    "layer_types": "names?",
    "pretraining_tp": "size?", "attention_dropout": "number",
    "bos_token_id": "id?", "pad_token_id": "id?", "eos_token_id": "ids?",
}
EXPECTED = {"names": "a list of strings", "name": "a string", "size": "a positive integer",
            "number": "a number", "object": "a JSON object", "bool": "true or false",
            "id": "a token id (an integer >= 0)", "ids": "a token id or a list of token ids"}

# The rope types computed here, with the fields each needs (transformers' names). A missing one is
# refused: transformers 5 would default original_max_position_embeddings to max_position_embeddings,
# transformers 4 would fail.
ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def json_value_is(value, kind: str) -> bool:
    """Whether a JSON value is of one of FIELD_TYPES' kinds (bool is never a number here)."""
    if value is None:
        return kind.endswith("?")
    kind = kind.rstrip("?")
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "ids":
        return json_value_is(value, "id") or (isinstance(value, list) and len(value) > 0
                                              and all(json_value_is(v, "id") for v in value))
    if kind == "names":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return {"name": isinstance(value, str),
            "size": is_int and value > 0,
            "id": is_int and value >= 0,
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "object": isinstance(value, dict),
            "bool": isinstance(value, bool)}[kind]


def config_from_hf(d: dict, source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json (transformers 4 or 5 layout). Anything this model would not
    compute exactly as transformers does is refused by one ValueError naming the file and field."""
    def refuse(field: str, why: str):
        raise ValueError(f"{source}: field '{field}' {why}")
    if not isinstance(d, dict):
        raise ValueError(f"{source}: is a JSON {type(d).__name__}, expected an object")
    for field, kind in FIELD_TYPES.items():
        if field in d and not json_value_is(d[field], kind):
            refuse(field, f"is {json.dumps(d[field])[:60]}, expected {EXPECTED[kind.rstrip('?')]}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    for field in required:
        if d.get(field) is None:
            refuse(field, "is missing")
    arch = hf_architecture(d, refuse)
    refuse_unsupported(d, arch, refuse)
    theta, scaling = rope_from_hf(d, refuse)
    qwen = arch == "Qwen2ForCausalLM"
    C, H = d["hidden_size"], d["num_attention_heads"]
    if qwen and d.get("num_key_value_heads") is None:  # transformers' Qwen2 would take 32, not H
        refuse("num_key_value_heads", "is missing")
    Hkv = d.get("num_key_value_heads") or H  # Llama: a missing one means H (multi-head attention)
    if H % Hkv:
        refuse("num_key_value_heads", f"is {Hkv}, which does not divide num_attention_heads={H}")
    if d.get("head_dim") is None and C % H:
        refuse("hidden_size", f"is {C}, not a multiple of num_attention_heads={H} (no head_dim)")
    D = d.get("head_dim") or C // H
    if D % 2:
        refuse("head_dim", f"is {D}; rotary embeddings need an even head_dim")
    return ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=C, intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=H, num_key_value_heads=Hkv,
        head_dim=d.get("head_dim") or 0,
        # transformers' defaults: Qwen2 32768, Llama 2048
        max_position_embeddings=d.get("max_position_embeddings", 32768 if qwen else 2048),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        # Qwen2 has no such fields (transformers ignores them): q/k/v bias, no o_proj or MLP bias.
        attention_bias=True if qwen else d.get("attention_bias", False),
        mlp_bias=False if qwen else d.get("mlp_bias", False),
        architecture=arch, bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )


def hf_architecture(d: dict, refuse: Callable) -> str:
    """The architecture "architectures" names (it must agree with model_type), else model_type's."""
    archs, model_type = d.get("architectures"), d.get("model_type")
    if archs is None:
        if model_type not in ARCHITECTURES:
            refuse("model_type", f"is {model_type!r} and there is no 'architectures' field; "
                                 f"expected one of {tuple(ARCHITECTURES)}")
        return ARCHITECTURES[model_type]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES.values():
        refuse("architectures", f"is {archs!r}, expected one of {tuple(ARCHITECTURES.values())}")
    if model_type is not None and ARCHITECTURES.get(model_type) != archs[0]:
        refuse("model_type", f"is {model_type!r} but architectures is {archs!r}")
    return archs[0]


def refuse_unsupported(d: dict, arch: str, refuse: Callable) -> None:
    """Fields that would change the output and that this model does not implement."""
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts",
                    "moe_intermediate_size"):
        if d.get(moe_key):
            refuse(moe_key, "declares a mixture of experts; this engine runs dense models only")
    if d.get("use_sliding_window"):
        refuse("use_sliding_window", "asks for sliding-window attention, which is not supported")
    if arch == "LlamaForCausalLM" and d.get("sliding_window"):
        refuse("sliding_window", "asks for sliding-window attention, which is not supported")
    if other := [t for t in d.get("layer_types") or [] if t != "full_attention"]:
        refuse("layer_types", f"has {other[0]!r}; only 'full_attention' layers are supported")
    if d.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {d['hidden_act']!r}, only 'silu' (SwiGLU) is supported")
    if d.get("pretraining_tp") not in (None, 1):
        refuse("pretraining_tp", "is not 1")
    if d.get("attention_dropout", 0.0) != 0:
        refuse("attention_dropout", "is not 0; this model has no dropout")
    if d.get("quantization_config") is not None:
        refuse("quantization_config", "is set; only unquantized checkpoints are loaded")
    if d.get("partial_rotary_factor") not in (None, 1.0):
        refuse("partial_rotary_factor", "is not 1; rotary embeddings here cover the whole head")


def rope_from_hf(d: dict, refuse: Callable) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's rope_parameters or 4's rope_theta + rope_scaling. Both
    layouts may be present (config_to_hf writes both, so both versions read it) but must agree."""
    thetas: dict[str, float] = {}  # the field that states it -> what it says
    scalings: dict[str, dict | None] = {}
    for field in ("rope_parameters", "rope_scaling"):
        if (rope := d.get(field)) is not None:
            scalings[field] = rope_scaling_from_hf(rope, field, refuse)
            if rope.get("rope_theta") is not None:
                thetas[field] = rope["rope_theta"]
    if d.get("rope_theta") is not None:
        thetas["rope_theta"] = d["rope_theta"]
    for field, theta in thetas.items():
        if not json_value_is(theta, "number") or theta <= 0:
            refuse(field, f"has rope_theta {theta!r}, expected a positive number")
    for stated in (thetas, scalings):
        items = list(stated.items())
        for field, value in items[1:]:
            if value != items[0][1]:
                refuse(field, f"says {value!r} but {items[0][0]} says {items[0][1]!r}; "
                              "the two config layouts disagree")
    theta = float(next(iter(thetas.values()), 10000.0))  # 10000: transformers' default
    return theta, next(iter(scalings.values()), None)


def rope_scaling_from_hf(rope: dict, field: str, refuse: Callable) -> dict | None:
    """ModelConfig.rope_scaling (None for the default rope) from one rope dict of either layout."""
    kind = rope.get("rope_type", rope.get("type", "default"))  # "type": early transformers 4
    if not isinstance(kind, str) or kind not in ROPE_FIELDS:
        refuse(field, f"has rope_type {kind!r}; supported: {', '.join(ROPE_FIELDS)}")
    if extra := sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor",
                                    *ROPE_FIELDS[kind]}):
        refuse(field, f"has {extra[0]!r}, which rope_type {kind!r} does not use")
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        refuse(field, "has partial_rotary_factor != 1; rotary embeddings here cover the whole head")
    scaling = {"rope_type": kind}
    for key in ROPE_FIELDS[kind]:
        kind_of_key = "size" if key == "original_max_position_embeddings" else "number"
        if not json_value_is(rope.get(key), kind_of_key) or rope[key] <= 0:
            refuse(field, f"has {key} {rope.get(key)!r}, expected {EXPECTED[kind_of_key]} > 0")
        scaling[key] = rope[key] if kind_of_key == "size" else float(rope[key])
    return None if kind == "default" else scaling


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json that transformers 4 and 5 both read as `cfg`: rope in 5's rope_parameters and in
    4's rope_theta / rope_scaling (5 prefers a non-null rope_scaling: the same values), the dtype
    under both versions' names."""
    qwen = cfg.architecture == "Qwen2ForCausalLM"
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    d = dict(
        architectures=[cfg.architecture], model_type="qwen2" if qwen else "llama",
        hidden_act="silu", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, initializer_range=0.02,
        dtype=str(dtype).removeprefix("torch."), torch_dtype=str(dtype).removeprefix("torch."),
        attention_dropout=0.0,
    )
    if qwen:  # no attention_bias/mlp_bias: Qwen2 always has q/k/v bias, never o_proj/MLP bias
        d.update(use_sliding_window=False, sliding_window=None,
                 max_window_layers=cfg.num_hidden_layers)
    else:
        d.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    return d

# -----------------------------------------------------------------------------
# Checkpoint directories: config, generation config, tensors (tp.py's load_sharded uses them too)


def read_json_object(file: str) -> dict:
    try:
        with open(file) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: is a JSON {type(d).__name__}, expected an object")
    return d


def load_config(path: str) -> ModelConfig:
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory; expected a Hugging Face checkpoint "
                                "directory")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found; a checkpoint directory needs config.json")
    return config_from_hf(read_json_object(file), source=file)


def load_generation_config(path: str) -> dict | None:
    """generation_config.json as a dict, or None when the directory has none. Its eos_token_id (an
    id or a list) is checked here, because stop_token_ids trusts it."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return None
    d = read_json_object(file)
    if not json_value_is(d.get("eos_token_id"), "ids?"):
        raise ValueError(f"{file}: field 'eos_token_id' is {json.dumps(d['eos_token_id'])[:60]}, "
                         f"expected {EXPECTED['ids']}")
    return d


def stop_token_ids(config: ModelConfig, generation_config: dict | None) -> tuple[int, ...]:
    """The ids that end a completion: the union of config.json's and generation_config.json's
    eos_token_id, each an id or a list (Llama-3-Instruct's generation_config.json adds <|eot_id|> to
    config.json's <|end_of_text|>). config.json's come first; no id twice."""
    ids: list[int] = []
    for eos in (config.eos_token_id, (generation_config or {}).get("eos_token_id")):
        ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(ids))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor a checkpoint of `cfg` holds (a tied lm_head is none)."""
    with torch.device("meta"):  # shapes only: allocates nothing
        return {name: tuple(p.shape) for name, p in Llama(cfg).named_parameters()}


def checkpoint_tensors(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (file, shape) of every tensor of a checkpoint directory, from the safetensors headers
    only: model.safetensors, or the files model.safetensors.index.json lists."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        listed_files = weight_map.values() if isinstance(weight_map, dict) else [None]
        if not all(isinstance(f, str) for f in listed_files):
            raise ValueError(f"{index}: not a safetensors index (no 'weight_map': tensor -> file)")
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    elif os.path.isfile(single):
        weight_map = {}
        files = [single]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                                "(only safetensors are loaded, never pickled .bin files)")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for missing/corrupt files
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        for name, shape in found.items():
            if name in tensors:
                raise ValueError(f"{file}: tensor '{name}' is also in {tensors[name][0]}")
            tensors[name] = (file, shape)
    for name, fname in weight_map.items():
        if tensors.get(name, ("",))[0] != os.path.join(path, fname):
            raise ValueError(f"{index}: lists tensor '{name}' in {fname}, which does not hold it")
    return tensors


def check_checkpoint(path: str, expected: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Refuse a checkpoint whose tensors are not exactly `expected` (names and full shapes, from
    expected_shapes): a missing, unused or misshaped tensor is one error naming the file and tensor.
    An unused tensor means the model is not the one the file describes: refused, never dropped.
    Returns name -> file. Both loaders call it: Llama.from_pretrained, and tp.load_sharded before it
    reads its slices."""
    tensors = checkpoint_tensors(path)
    if missing := sorted(set(expected) - set(tensors)):
        raise ValueError(f"{path}: checkpoint is missing {len(missing)} tensors, "
                         f"e.g. '{missing[0]}'")
    if unused := sorted(set(tensors) - set(expected)):
        name = unused[0]
        why = "no module of the model config.json describes uses it"
        if name == "lm_head.weight":  # transformers would untie them if they differ: ambiguous
            why = "config.json ties lm_head to the embedding (set tie_word_embeddings false)"
        elif name.endswith(".bias"):
            why = "config.json declares no such bias (see its attention_bias / mlp_bias)"
        raise ValueError(f"{tensors[name][0]}: tensor '{name}' is not used ({len(unused)} such "
                         f"tensors): {why}")
    for name, shape in expected.items():
        file, found = tensors[name]
        if found != shape:
            raise ValueError(f"{file}: tensor '{name}' has shape {found}, "
                             f"config.json implies {shape}")
    return {name: tensors[name][0] for name in expected}

# -----------------------------------------------------------------------------
# Tokenizers (the `tokenizers` library; tokenizer.json is the HF format)


def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found; the checkpoint directory needs a "
                                "tokenizer.json")
    return Tokenizer.from_file(file)


def build_char_tokenizer(chars: str, specials: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")):
    """A character-level tokenizer (one id per character, specials first) for synthetic tasks and
    tests, saved and loaded as a standard tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    chars = "".join(dict.fromkeys(chars))  # unique, order kept
    vocab = {tok: i for i, tok in enumerate(list(specials) + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # every character is a token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join tokens without spaces
    tok.add_special_tokens(list(specials))
    return tok
