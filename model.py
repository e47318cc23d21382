"""
A small Llama (also Qwen2) in plain PyTorch that reads and writes Hugging Face checkpoint directories.

RMSNorm, rotary embeddings (HF rotate-half convention, Llama-3 / linear rope scaling), grouped-query
attention through F.scaled_dot_product_attention, SwiGLU MLP, optional tied embeddings, optional
q/k/v bias (Qwen2). Parameter names are HF's, so a checkpoint is a plain safetensors read.

Leaves out: MoE, sliding-window attention, other rope types (all refused with a clear error), and
any parallelism (tp.py swaps modules), sampling (rollout.py) or loss (grpo.py).

The one hook the other files need: `attention(layer, q, k, v) -> y`, an optional callable every
attention layer calls with rotated q/k/v. The default is causal SDPA; rollout.py passes one that
writes a KV cache, grpo.py one that attends completions to a shared prompt. `prefix_attention` is
the exact two-part attention (shared prefix KV + each row's own KV, merged by log-sum-exp) both use.

Shapes: B sequences, T tokens, S keys, C width, H/Hkv heads, D head dim, V vocab, L layers,
Bp prompts, G samples per prompt, P prompt length.
Tested by tests/test_model.py.
"""

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

# -----------------------------------------------------------------------------
# Config


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
    rope_scaling: dict | None = None  # HF dict: {"rope_type": "llama3" | "linear", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # Qwen2 has q/k/v bias
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        assert self.num_attention_heads % self.num_key_value_heads == 0, "heads must be a multiple of kv heads"
        assert self.head_dim % 2 == 0, "rotary embeddings need an even head_dim"


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def config_from_hf(d: dict, source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict; refuse anything this model cannot run exactly."""
    def refuse(field: str, why: str):
        raise ValueError(f"{source}: field '{field}' {why}; this engine runs dense Llama/Qwen2 models only")
    archs = d.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        refuse("architectures", f"is {archs!r}, expected one of {SUPPORTED_ARCHITECTURES}")
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
        if d.get(moe_key):
            refuse(moe_key, "declares a mixture of experts")
    if d.get("use_sliding_window") or (archs[0] == "LlamaForCausalLM" and d.get("sliding_window")):
        refuse("use_sliding_window", "asks for sliding-window attention")
    if d.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {d['hidden_act']!r}, only 'silu' (SwiGLU) is supported")
    if d.get("mlp_bias"):
        refuse("mlp_bias", "is true, MLP biases are not supported")
    if d.get("pretraining_tp", 1) != 1:
        refuse("pretraining_tp", "is not 1")
    scaling = d.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "linear", "default"):
            refuse("rope_scaling", f"has rope_type {kind!r}, only 'llama3', 'linear' and 'default' are supported")
        if kind == "default":
            scaling = None
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in d:
            refuse(key, "is missing")
    qwen = archs[0] == "Qwen2ForCausalLM"
    return ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or 0, max_position_embeddings=d.get("max_position_embeddings", 2048),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
        rope_scaling=scaling, tie_word_embeddings=d.get("tie_word_embeddings", False),
        attention_bias=d.get("attention_bias", qwen), architecture=archs[0],
        bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
    )


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    qwen = cfg.architecture == "Qwen2ForCausalLM"
    d = dict(
        architectures=[cfg.architecture], model_type="qwen2" if qwen else "llama", hidden_act="silu",
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, initializer_range=0.02,
        torch_dtype=str(dtype).removeprefix("torch."), attention_dropout=0.0,
    )
    if qwen:  # Qwen2 always has q/k/v bias; it has no attention_bias field
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers)
    else:
        d.update(attention_bias=cfg.attention_bias, mlp_bias=False, pretraining_tp=1)
    return d

# -----------------------------------------------------------------------------
# Stateless math: rotary embeddings and attention


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies (D/2,), in HF's exact float32 arithmetic, with optional rope scaling."""
    D = cfg.head_dim
    # device="cpu" explicitly: the model may be built under `with torch.device("meta")`.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.get("rope_type", s.get("type")) == "linear":
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
    """cos and signed sin tables (B, T, D) for integer positions (B, T), computed in float32 like HF. The sin
    table's first half is negated, so that apply_rotary_emb's rotate-half is a roll (the same values as HF)."""
    freqs = positions[..., None].float() * inv_freq.float()  # (B, T, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)  # (B, T, D)


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF rotate-half on (B, H, T, D): pairs dimension i with i + D/2 (not interleaved pairs).
    HF's x*cos + cat(-x2, x1)*sin, with the sign folded into `sin` (rope_cos_sin) and cat(x2, x1) a roll."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin[:, None]


def causal_attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The default attention: causal over the T tokens given. q (B, H, T, D), k/v (B, Hkv, T, D)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention that also returns its log-sum-exp, so partial results can be merged.
    q (B, Hkv, M, D), k/v (B, Hkv, S, D), allowed broadcastable to (B, Hkv, M, S) bool.
    Returns out (B, Hkv, M, D) and lse (B, Hkv, M) in float32 (or float64); a query with no allowed key gets
    out 0 and lse -inf (it then contributes nothing to a merge)."""
    dt = torch.promote_types(q.dtype, torch.float32)  # bf16 inputs accumulate in float32; float64 stays float64
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, Hkv, M, S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, M)
    probs = torch.exp(scores - lse.clamp_min(-1e30)[..., None])  # all-masked rows: exp(-inf) = 0, not NaN
    return probs @ v.to(dt), lse


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, own_allowed: Tensor,
                     prefix_k: Tensor, prefix_v: Tensor, prefix_valid: Tensor) -> Tensor:
    """Exact attention of Bp*G rows to one shared prefix per group plus their own keys (Hydragen).

    q (Bp*G, H, T, D); k/v (Bp*G, Hkv, S, D) each row's own keys; own_allowed (Bp*G or 1, T, S) bool.
    prefix_k/v (Bp, Hkv, P, D) computed once per group; prefix_valid (Bp, P) bool (False = padding).
    The G rows are folded into the query dimension, so the prefix KV is read once per group and never
    copied G times; the two partial softmaxes are merged by their log-sum-exp. Returns (Bp*G, H, T, D).
    """
    N, H, T, D = q.shape
    Bp, Hkv, P, _ = prefix_k.shape
    G, rep = N // Bp, H // Hkv
    assert N == Bp * G and k.shape[0] == N and prefix_valid.shape == (Bp, P), "shapes do not match"
    # Part 1: all G rows of a group (and the rep query heads of a kv head) against the shared prefix.
    qp = q.view(Bp, G, Hkv, rep, T, D).transpose(1, 2).reshape(Bp, Hkv, G * rep * T, D)  # (Bp, Hkv, G*rep*T, D)
    out_p, lse_p = attention_with_lse(qp, prefix_k, prefix_v, prefix_valid[:, None, None, :])
    out_p = out_p.view(Bp, Hkv, G, rep, T, D).transpose(1, 2).reshape(N, H, T, D)  # (Bp*G, H, T, D)
    lse_p = lse_p.view(Bp, Hkv, G, rep, T).transpose(1, 2).reshape(N, H, T)  # (Bp*G, H, T)
    # Part 2: each row against its own keys (GQA by folding the rep heads into the query dimension).
    qs = q.reshape(N, Hkv, rep * T, D)  # (Bp*G, Hkv, rep*T, D)
    allowed = own_allowed[:, None, None].expand(-1, Hkv, rep, -1, -1).reshape(-1, Hkv, rep * T, k.shape[2])
    out_s, lse_s = attention_with_lse(qs, k, v, allowed)
    out_s, lse_s = out_s.view(N, H, T, D), lse_s.view(N, H, T)
    # Merge: softmax over [prefix keys, own keys] = each part re-weighted by exp(lse_part - lse_all).
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
    """x * rsqrt(mean(x^2) + eps) in float32, cast back, then scaled: HF's order, which matters in bf16.
    F.rms_norm is that formula in one call (3x faster than five separate ops at prefill sizes on the CPU)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        C, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer, self.head_dim = layer, D
        self.q_proj = nn.Linear(C, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable) -> Tensor:
        B, T, _ = x.shape
        # Head counts come from the tensor shapes, so a tensor-parallel shard (H/tp heads) runs unchanged.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        y = attention(self.layer, q, k, v)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable, last: Tensor | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        if last is not None:  # only these positions reach the output: the MLP runs on them alone
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]  # (B, 1, C)
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
        # Not a parameter, not saved, and not a buffer: module.to(bfloat16) would round the frequencies
        # (HF keeps them in float32). It follows the tokens' device on first use instead.
        self.inv_freq = rope_inv_freq(cfg)  # (D/2,) float32

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Llama":
        """HF's initialisation (normal(0, initializer_range), norms at 1, biases 0), reproducible by seed."""
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

    def hidden(self, tokens: Tensor, positions: Tensor | None = None, attention: Callable | None = None,
               last: Tensor | None = None) -> Tensor:
        """The residual stream before the final norm, (B, T) ids -> (B, T, C).
        positions (B, T) default to 0..T-1; `attention(layer, q, k, v)` defaults to causal SDPA.
        last (B,): only position last[b] of each row is wanted (a prefill before sampling), so the final block's
        MLP runs on those alone (its attention still sees, and the hook still gets, every position): (B, 1, C)."""
        assert tokens.dim() == 2, f"tokens must be (B, T), got {tuple(tokens.shape)}"
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        if self.inv_freq.device != tokens.device:
            self.inv_freq = self.inv_freq.to(tokens.device)
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # (B, T, D)
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, attention or causal_attention, last if i == len(self.model.layers) - 1 else None)
        return x

    def head(self, h: Tensor) -> Tensor:
        """Final norm + lm_head: (..., C) -> (..., V) logits. grpo.py calls it one chunk at a time."""
        return self.lm_head(self.model.norm(h))

    def forward(self, tokens: Tensor, positions: Tensor | None = None, attention: Callable | None = None) -> Tensor:
        return self.head(self.hidden(tokens, positions, attention))  # (B, T, V)

    # -------------------------------------------------------------------------
    # Hugging Face checkpoint directories

    @classmethod
    def from_pretrained(cls, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "Llama":
        cfg = load_config(path)
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)  # NOTE: to_empty re-creates every parameter, which unties lm_head
        model.to(dtype)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        files = checkpoint_files(path)
        expected = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
        missing = sorted(set(expected) - set(files))
        if missing:
            raise ValueError(f"{path}: checkpoint is missing {len(missing)} tensors, e.g. '{missing[0]}'")
        by_file: dict[str, list[str]] = {}
        for name in expected:
            by_file.setdefault(files[name], []).append(name)
        with torch.no_grad():
            for file, names in by_file.items():
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in names:
                        t = f.get_tensor(name)
                        if tuple(t.shape) != tuple(expected[name].shape):
                            raise ValueError(f"{file}: tensor '{name}' has shape {tuple(t.shape)}, "
                                             f"config.json implies {tuple(expected[name].shape)}")
                        expected[name].copy_(t)
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int | None = None) -> None:
        """Write config.json and model.safetensors (or shards + model.safetensors.index.json)."""
        os.makedirs(path, exist_ok=True)
        # Tied lm_head is not written, as HF does (and safetensors refuses shared storage anyway).
        state = {n: p.detach().cpu().contiguous() for n, p in self.named_parameters()}
        dtype = next(iter(state.values())).dtype
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config_to_hf(self.config, dtype), f, indent=2)
        shards, size = [{}], 0
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
# Checkpoint directory helpers (tp.py reuses them to read its slices lazily)


def load_config(path: str) -> ModelConfig:
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory; expected a Hugging Face checkpoint directory")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found; a checkpoint directory needs config.json")
    try:
        with open(file) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    return config_from_hf(d, source=file)


def checkpoint_files(path: str) -> dict[str, str]:
    """Map each tensor name to the safetensors file that holds it (single file or sharded index)."""
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
        return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
    if os.path.isfile(single):
        try:
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise ValueError(f"{single}: not a readable safetensors file ({e})") from None
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                            "(only safetensors checkpoints are loaded, never pickled .bin files)")

# -----------------------------------------------------------------------------
# Tokenizers (the `tokenizers` library; tokenizer.json is the HF format)


def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found; the checkpoint directory needs a tokenizer.json")
    return Tokenizer.from_file(file)


def build_char_tokenizer(chars: str, specials: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")):
    """A character-level tokenizer (one id per character, specials first) for synthetic tasks and
    tests, saved and loaded as a standard tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    chars = "".join(dict.fromkeys(chars))  # unique, order kept
    vocab = {tok: i for i, tok in enumerate(list(specials) + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a token
    tok.decoder = decoders.Fuse()  # join tokens without spaces
    tok.add_special_tokens(list(specials))
    return tok
