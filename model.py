"""
A small Llama (also Qwen2 and Qwen3) in plain PyTorch: the model and nothing else.

RMSNorm, rotary embeddings (HF rotate-half convention, Llama-3 / linear rope scaling), grouped-query
attention through F.scaled_dot_product_attention, SwiGLU MLP, optional tied embeddings, the biases
transformers builds (Llama: attention_bias on q/k/v/o, mlp_bias on gate/up/down; Qwen2: q/k/v;
Qwen3: attention_bias on q/k/v/o), and Qwen3's RMSNorm over each head's q and k before RoPE
(q_norm, k_norm: one weight of D shared by the heads).
Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`), so engine/hf.py reads and
writes checkpoints as plain safetensors.

Leaves out: file formats (engine/hf.py), any parallelism (tp.py swaps modules), sampling (rollout.py) or
loss (grpo.py).

The one hook the other files need: `attention(layer, q, k, v) -> y`, an optional callable every
attention layer calls with rotated q/k/v. The default is causal SDPA; rollout.py passes one that
writes a KV cache, grpo.py one that attends completions to a shared prompt. A forward given `last`
(only each row's position last[b] is wanted: a prefill) asks the final layer for those queries
alone and calls `attention(layer, q, k, v, last=last)` there, q (B, H, 1, D): keys after last[b]
are that row's padding, which the hook masks (`causal_attention` does). The attention over a
prompt shared by a group of rows, which rollout.py and grpo.py pass as hooks, is engine/attention.py.

`fused_projections(model)`: meanwhile q/k/v run as one matmul on their weights stacked, and
gate/up as one (a compiled decode step's fewer kernels; the weights stay where they are).

Shapes: B sequences, T tokens, S keys, C width, H/Hkv heads, D head dim, V vocab, L layers.
Tested by tests/test_model.py.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# -----------------------------------------------------------------------------
# Config

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    attention_bias: bool | None = None  # HF's: Llama, Qwen3 q/k/v/o; Qwen2 q/k/v; None: the arch's
    mlp_bias: bool = False            # Llama's gate/up/down bias (Qwen2 and Qwen3 have none)
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        qwen = self.architecture == "Qwen2ForCausalLM"
        assert self.architecture in ARCHITECTURES, f"unknown {self.architecture=}"
        if self.attention_bias is None:
            self.attention_bias = qwen
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        H, Hkv = self.num_attention_heads, self.num_key_value_heads
        assert H % Hkv == 0, "heads must be a multiple of kv heads"
        assert self.head_dim % 2 == 0, "rotary embeddings need an even head_dim"
        assert not qwen or (self.attention_bias and not self.mlp_bias), "Qwen2: q/k/v bias only"
        assert not self.qk_norm or not self.mlp_bias, "Qwen3: no MLP bias"
        kind = None if self.rope_scaling is None else self.rope_scaling.get("rope_type")
        assert kind in (None, "linear", "llama3"), "rope_scaling needs rope_type linear or llama3"

    @property
    def o_proj_bias(self) -> bool:
        """Llama's and Qwen3's attention_bias covers o_proj too; Qwen2's q/k/v bias never does."""
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's q and k (RMSNorm over D) before RoPE."""
        return self.architecture == "Qwen3ForCausalLM"

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
    """x * rsqrt(mean(x^2) + eps) in float32 (float64 stays float64), cast back, then scaled: HF's
    order, which matters in bf16. F.rms_norm is that formula in one call (3x faster than five
    separate ops at prefill sizes on the CPU)."""
    # NOTE a footgun: x.float() would round a float64 model's norms, and every gradient through
    # them, to float32; twins that sum a shared prompt's gradients in another order then differ
    # by 1e-7 (HF's norm does that too)
    dt = torch.promote_types(x.dtype, torch.float32)
    return weight * F.rms_norm(x.to(dt), x.shape[-1:], eps=eps).to(x.dtype)


class Attention(nn.Module):
    fused: "Stacked | None" = None  # q/k/v's weights stacked while fused_projections runs

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
        # Qwen3's per-head norms: one (D,) weight each, shared by all heads; Llama and Qwen2 have
        # none (an Identity: no parameter, the same code path).
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor,
            last: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> q (B, H, T, D), k and v (B, Hkv, T, D): projected, q and k normed per head
        (Qwen3) and rotated, all three in v's dtype. With last, q (B, H, 1, D) is position
        last[b]'s alone."""
        xq, cos_q, sin_q = (x, cos, sin) if last is None else (at_last(x, last), at_last(cos, last),
                                                               at_last(sin, last))
        if self.fused is not None and last is None:  # one matmul (fused_projections)
            q, k, v = F.linear(x, self.fused[0], self.fused[1]).split(self.fused[2], -1)
        else:
            q, k, v = self.q_proj(xq), self.k_proj(x), self.v_proj(x)
        return self.heads(q, k, v, (cos_q, sin_q), (cos, sin))

    def heads(self, q: Tensor, k: Tensor, v: Tensor, rope_q: tuple[Tensor, Tensor],
              rope_k: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The projections (B, Tq, H*D), (B, T, Hkv*D) x2 split into heads: q (B, H, Tq, D), k and
        v (B, Hkv, T, D); q and k normed per head, then rotated by their (cos, sin) tables."""
        # Head counts come from the tensor shapes: a tensor-parallel shard (H/tp heads) runs as is.
        B, T = k.shape[:2]
        q = q.view(B, q.shape[1], -1, self.head_dim)  # (B, Tq, H, D)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        q = self.q_norm(q).transpose(1, 2)  # (B, H, Tq, D): Qwen3's RMSNorm over each head's D
        k = self.k_norm(k).transpose(1, 2)  # (B, Hkv, T, D): likewise, before RoPE
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        # NOTE a footgun: under bf16 autocast over fp32 weights the rope tables are fp32 (the
        # embedding's dtype), so q * cos is fp32 while v is the linears' bf16. SDPA's autocast
        # casts them back, but an attention it does not cover (FlexAttention, varlen_attn, a
        # hook's own cast to q's dtype) would run in fp32: q and k go back to v's dtype here.
        q = apply_rotary_emb(q, *rope_q).to(v.dtype)
        k = apply_rotary_emb(k, *rope_k).to(v.dtype)
        return q, k, v

    def output(self, y: Tensor) -> Tensor:
        """o_proj over the heads: (B, H, T, D) -> (B, T, C)."""
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable,
                last: Tensor | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C), or (B, 1, C) with last: the queries (and o_proj) of position
        last[b] alone, the keys/values of every position (a prefill's final layer)."""
        q, k, v = self.qkv(x, cos, sin, last)
        if last is None:
            return self.output(attention(self.layer, q, k, v))  # (B, T, C)
        return self.output(attention(self.layer, q, k, v, last=last))  # (B, 1, C)


class MLP(nn.Module):
    fused: "Stacked | None" = None  # gate/up's weights stacked while fused_projections runs

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, C, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is not None:  # one matmul (fused_projections)
            gate, up = F.linear(x, self.fused[0], self.fused[1]).split(self.fused[2], -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


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
        return self.residual_mlp(x if last is None else at_last(x, last), y)

    def residual_mlp(self, x: Tensor, y: Tensor) -> Tensor:
        """The block after its attention: x + y (B, T, C), then the MLP's residual."""
        x = x + y
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
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        cos, sin = self.rope(tokens, positions, x.dtype)  # (B, T, D)
        final = len(self.model.layers) - 1
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, attention or causal_attention, last if i == final else None)
        return x

    def head(self, h: Tensor) -> Tensor:
        """Final norm + lm_head: (..., C) -> (..., V) logits; grpo.py calls it chunk by chunk."""
        return self.lm_head(self.model.norm(h))

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                attention: Callable | None = None) -> Tensor:
        return self.head(self.hidden(tokens, positions, attention))  # (B, T, V)


# -----------------------------------------------------------------------------
# Fused projections

# Linears that read the same input, their weights stacked: (weight (sum of outs, C), bias or None,
# each linear's out size to split the output by).
Stacked = tuple[Tensor, "Tensor | None", list[int]]


def stack_linears(linears: tuple[nn.Linear, ...]) -> Stacked:
    """Linears that read one input as one: their weights and biases stacked along the outputs.
    Refused when some have a bias and some not: the first's choice would drop the others' biases
    without a word, or fail on the missing one."""
    biased = [m.bias is not None for m in linears]
    if any(biased) and not all(biased):
        shapes = ", ".join(f"{m.out_features} out {'with' if b else 'without'} a bias"
                           for m, b in zip(linears, biased))
        raise ValueError(f"stack_linears: some of these projections have a bias and some not "
                         f"({shapes}): stack only projections that all have one or none")
    bias = torch.cat([m.bias.detach() for m in linears]) if all(biased) else None
    return (torch.cat([m.weight.detach() for m in linears]), bias,
            [m.out_features for m in linears])


@contextlib.contextmanager
def fused_projections(model: nn.Module, enabled: bool = True):
    """Meanwhile each attention's q, k and v run as one matmul on their weights stacked, and each
    MLP's gate and up as one: a decode step's 7 matmuls a layer become 4 (torch.compile does not
    stack weights itself: they may change between its calls). The weights are stacked on entry:
    a change to them inside is not seen. The cost: a second copy of those weights while it runs.
    A projection that is not a plain nn.Linear (tensor parallelism's shards) stays as it is.
    For inference: the stacked weights carry no gradient. Outputs equal the separate matmuls' up
    to the kernel's summation order."""
    fused = []
    try:
        for m in model.modules() if enabled else ():
            parts = ((m.q_proj, m.k_proj, m.v_proj) if isinstance(m, Attention) else
                     (m.gate_proj, m.up_proj) if isinstance(m, MLP) else ())
            if parts and all(type(p) is nn.Linear for p in parts):
                m.fused = stack_linears(parts)
                fused.append(m)
        yield
    finally:
        for m in fused:
            del m.fused  # back to the class's None
