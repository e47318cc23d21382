"""
The sampler that stands in for vLLM: a preallocated KV cache, each prompt prefilled once, G samples
per prompt decoded on top of that one shared prompt KV, finished rows dropped as the batch runs.

1. Prefill: the Bp ragged prompts, right-padded, in chunks of `prefill_tokens` (causal attention is exact for
   the valid positions: the pads come after them). Each layer's K/V is stored once per prompt, (Bp, Hkv, P, D).
2. Fan-out: each prompt's last-position logits are repeated G times and every row draws its own first
   token (nanochat once broadcast one first token to all G rows).
3. Decode: the attention hook writes each row's key/value into its own completion KV and runs
   model.prefix_attention: the G rows of a group are folded into the query dimension against the one
   prompt KV (Hydragen) and merged with the row's own keys by log-sum-exp. Prompt KV memory and reads / G.
4. Every `check_every` steps (the only host sync in the loop) rows that sampled a stop id are dropped:
   the linears run on the N active rows only; attention sees them in a Bp' x G' grid (see _Layout).
5. Sampling without host sync; each returned logprob is under the distribution actually sampled from,
   after temperature, top-k, top-p (trl#4159, trl#6789: otherwise the GRPO ratio is not 1).

Leaves out: paged KV and continuous batching (a GRPO rollout is one static batch), speculative decoding,
stop strings (stop ids only), prefix sharing across different prompts.
CPU: the prompt part goes through SDPA's fused kernel (it returns its log-sum-exp), which then enters the
own keys' softmax as one more score: the same merge in fewer kernels (_fused_prefix_attention).
CUDA: the decode step is a CUDA graph per layout of active rows; the private KV cache is bf16.

Shapes: Bp prompts, G samples per prompt, R = Bp*G rows, N active rows, S = Bp'*G' slots of the grid,
P longest prompt, Tc completion KV length, C width, H/Hkv heads, D head dim, V vocab (V/tp when the
lm_head is split by tensor parallelism), L layers. Tested by tests/test_rollout.py (bench_rollout.py).
"""

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from model import ModelConfig, causal_attention, prefix_attention

# -----------------------------------------------------------------------------
# Config and result


@dataclass
class RolloutConfig:
    """The sampling knobs; `generate(model, prompts, **vars(cfg))` takes every field."""
    num_samples: int = 8                  # G completions per prompt (the GRPO group)
    max_new_tokens: int = 64
    temperature: float = 1.0              # 0 = greedy
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0                    # 1 = off; keeps the smallest set of tokens whose mass reaches p
    stop_ids: tuple[int, ...] = ()        # e.g. the eos id; the stop token is the last of its completion
    seed: int | None = None               # None: a fresh seed (the global RNG is left alone)
    check_every: int = 8                  # decode steps between the host syncs that drop finished rows
    prefill_tokens: int = 2048            # padded prompt tokens per prefill forward (bounds activations)
    cuda_graphs: bool = True              # capture the decode step on CUDA (ignored on the CPU)

    def __post_init__(self):
        check_sampling(self.num_samples, self.max_new_tokens, self.temperature, self.top_k, self.top_p,
                       self.check_every, self.prefill_tokens)


@dataclass
class Rollout:
    completions: list[list[int]]          # Bp*G, prompt-major: prompt i owns rows i*G .. i*G+G-1
    logprobs: list[list[float]]           # per completion token, under the distribution sampled from
    finish_reasons: list[str]             # "stop" (ends with a stop id) or "length"
    stats: dict = field(default_factory=dict)


def check_sampling(num_samples: int, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                   check_every: int = 1, prefill_tokens: int = 1) -> None:
    checks = dict(num_samples=(num_samples, 1), max_new_tokens=(max_new_tokens, 0), top_k=(top_k, 0),
                  check_every=(check_every, 1), prefill_tokens=(prefill_tokens, 1))
    for name, (value, low) in checks.items():
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not temperature >= 0 or temperature == float("inf"):  # `not >=` also catches NaN
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")

# -----------------------------------------------------------------------------
# Sampling


def filter_logits(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The logits of the distribution actually sampled from, (rows, V) float32: divided by the temperature
    (1 when greedy), then -inf outside the top-k, then outside the smallest set whose mass reaches top_p
    (taken after top-k, as vLLM does). log_softmax of this is what a trainer must use for ratio = 1."""
    x = logits.float()
    if temperature not in (0.0, 1.0):  # 0 is greedy: the logits as they are
        x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]  # (rows, 1); ties with the k-th are kept
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = x.softmax(dim=-1).sort(dim=-1, descending=True)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before each token; 0 for the top one, always kept
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))  # back to vocabulary order
    return x


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """logits (rows, V) -> tokens (rows,), logprobs (rows,). Inverse-CDF sampling, no host sync: one uniform per
    row (an exponential race draws V: 10x slower on the CPU). Greedy (temperature 0) returns the argmax's logprob
    under temperature 1 and the same masks: a point mass (logprob 0) is what no trainer forward reproduces."""
    x = filter_logits(logits, temperature, top_k, top_p)
    if temperature == 0:
        tokens = x.argmax(dim=-1)
        return tokens, x.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    probs = x.softmax(dim=-1)  # (rows, V)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (rows, V); in float32, tokens below its ulp were never drawn
    total = cdf[:, -1:]  # (rows, 1), 1 up to rounding
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=x.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total: some cdf exceeds it
    # The first index whose cdf exceeds u; a masked token adds exactly 0 to the cdf, so it is never first.
    tokens = torch.searchsorted(cdf, u, right=True)[:, 0]
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()

# -----------------------------------------------------------------------------
# KV cache: one flat buffer, carved into views per call


class KVCache:
    """A preallocated pool in ONE flat tensor `buffer` (1-D, on the device), so memory.py can free it with
    `buffer.untyped_storage().resize_(0)` and re-create it by resizing back. generate() carves, per layer,
    the shared prompt K/V (Bp, Hkv, P, D) and each row's completion K/V (Bp*G, Hkv, Tc, D) out of it."""

    def __init__(self, numel: int, dtype: torch.dtype, device: str | torch.device):
        self.buffer = torch.zeros(numel, dtype=dtype, device=device)

    @staticmethod
    def numel_for(num_layers: int, kv_heads: int, head_dim: int, num_prompts: int, num_samples: int,
                  max_prompt_len: int, max_new_tokens: int) -> int:
        completion_len = max(max_new_tokens - 1, 0)  # the last sampled token is never fed back
        return 2 * num_layers * kv_heads * head_dim * num_prompts * (max_prompt_len + num_samples * completion_len)

    @classmethod
    def for_batch(cls, model_config: ModelConfig, num_prompts: int, num_samples: int, max_prompt_len: int,
                  max_new_tokens: int, dtype: torch.dtype, device: str | torch.device, tp_size: int = 1) -> "KVCache":
        """Sized for this batch (or any smaller one). Under tensor parallelism a rank holds Hkv/tp heads."""
        if (kv_heads := model_config.num_key_value_heads) % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide num_key_value_heads={kv_heads}")
        return cls(cls.numel_for(model_config.num_hidden_layers, kv_heads // tp_size, model_config.head_dim,
                                 num_prompts, num_samples, max_prompt_len, max_new_tokens), dtype, device)

    @property
    def nbytes(self) -> int:  # capacity when awake
        return self.buffer.numel() * self.buffer.element_size()

    def carve(self, L: int, Hkv: int, D: int, Bp: int, G: int, P: int, new_tokens: int) -> tuple[list[Tensor], ...]:
        """Zeroed views, per layer: prompt K, prompt V (Bp, Hkv, P, D), completion K, V (Bp*G, Hkv, Tc, D).
        Zeroed because masked keys still meet 0 * value in attention, and 0 * NaN garbage is NaN."""
        if self.buffer.untyped_storage().nbytes() < self.nbytes:
            raise RuntimeError("the KV cache is released (asleep): wake the rollout phase before generate")
        if (need := self.numel_for(L, Hkv, D, Bp, G, P, new_tokens) * self.buffer.element_size()) > self.nbytes:
            raise ValueError(f"the KV cache is too small for this batch: it needs {need:,} bytes ({Bp} prompts x {G} "
                             f"samples, prompt length {P}, {new_tokens} new tokens) but holds {self.nbytes:,} bytes")
        shapes = [(Bp, Hkv, P, D)] * 2 + [(Bp * G, Hkv, max(new_tokens - 1, 0), D)] * 2
        views, offset = ([], [], [], []), 0
        for _, (kind, shape) in itertools.product(range(L), enumerate(shapes)):
            views[kind].append(self.buffer[offset:offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        self.buffer[:offset].zero_()
        return views

# -----------------------------------------------------------------------------
# Decode attention: the shared prompt KV plus each row's own completion KV


@dataclass
class _Layout:
    """Where the N active rows sit. prefix_attention wants G' query rows per group; once rows finish, groups
    hold different counts, so attention sees the rows scattered into a grid of Bp' groups x G' slots (G' =
    the largest count); empty slots compute garbage that nobody reads."""
    rows: list[int]          # global row id (prompt * G + sample) of each active row, ascending
    groups: list[int]        # the prompt of each of the Bp' groups
    group_size: int          # G'
    slots: list[int]         # slot of each active row in the grid
    prompt_len: int          # longest prompt among the groups

    @classmethod
    def of(cls, rows: list[int], G: int, prompt_lens: list[int]) -> "_Layout":
        counts = Counter(r // G for r in rows)  # in order of first appearance: rows are prompt-major
        group_size = max(counts.values())
        slots = [i * group_size + j for i, n in enumerate(counts.values()) for j in range(n)]
        return cls(rows, list(counts), group_size, slots, max(prompt_lens[p] for p in counts))


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_prefix_attention(q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor, prefix_v: Tensor,
                            prefix_bias: Tensor | None) -> Tensor:
    """prefix_attention for one token per row, all of k/v allowed, on the CPU, in few kernels (per-op overhead
    and memory latency, not FLOPs, are what cost here). The prompt part goes through SDPA's fused kernel, which also
    returns its log-sum-exp lse_p. The own part then merges it as one more key: softmax over [own scores, lse_p]
    weighs the prompt part's output exactly as the log-sum-exp merge does, and sums to 1 with the own keys.
    q (S, H, 1, D), k/v (S, Hkv, T, D) views of the cache, prefix_bias (Bp, 1, 1, P) 0 / -inf, or None: no padding."""
    (S, H, _, D), (Bp, Hkv), T = q.shape, prefix_k.shape[:2], k.shape[2]
    G, rep = S // Bp, H // Hkv
    qp = q.view(Bp, G, Hkv, rep, D).transpose(1, 2).reshape(Bp, Hkv, G * rep, D)  # (Bp, Hkv, G*rep, D)
    out_p, lse_p = _CPU_FLASH(qp, prefix_k, prefix_v, attn_mask=prefix_bias)  # (Bp, Hkv, G*rep, D), (Bp, Hkv, G*rep)
    # Back to row-major order (S*Hkv, rep): the G rows of a group were folded into the query dimension.
    dt = torch.promote_types(q.dtype, torch.float32)  # bf16 accumulates in float32
    out_p = out_p.view(Bp, Hkv, G, rep, D).transpose(1, 2).reshape(S * Hkv, rep, D).to(dt)  # (S*Hkv, rep, D)
    lse_p = lse_p.view(Bp, Hkv, G, rep, 1).transpose(1, 2).reshape(S * Hkv, rep, 1)  # (S*Hkv, rep, 1)
    # Own part: GQA by folding the rep heads into the query dimension (2 bmm; SDPA's kernel is 2x slower here).
    qs = q.reshape(S * Hkv, rep, D).to(dt) * D ** -0.5
    scores = torch.bmm(qs, k.reshape(S * Hkv, T, D).to(dt).transpose(1, 2))  # (S*Hkv, rep, T), views of the cache
    probs = torch.cat((scores, lse_p), dim=-1).softmax(dim=-1)  # (S*Hkv, rep, T + 1)
    y = torch.baddbmm(out_p * probs[..., T:], probs[..., :T], v.reshape(S * Hkv, T, D).to(dt))  # (S*Hkv, rep, D)
    return y.view(S, H, 1, D).to(q.dtype)  # a bf16 model gets bf16 back


class _DecodeAttention:
    """Writes the step's K/V into each row's completion KV (position `step`) and attends to the shared
    prompt KV plus the row's own keys. Every per-step input is a tensor, so a CUDA graph can replay it."""

    def __init__(self, views: tuple[list[Tensor], ...], step: Tensor, completion_len: int):
        self.prefix_k, self.prefix_v, self.own_k, self.own_v = views
        self.step = step  # (1,) long: the completion index of the token being fed
        self.own_len = completion_len  # keys attended per row; the CPU path shrinks it to step + 1
        self.key_positions = torch.arange(completion_len, device=step.device)
        self.fused, self.layout = step.device.type == "cpu" and _CPU_FLASH is not None, None

    def set_layout(self, layout: _Layout, prompt_lens: Tensor, filled: int = 0) -> None:
        """Switch to a new layout; move the surviving prompts' KV to the front of the prompt views and the
        surviving rows' `filled` completion KV positions to their new slots (via temporaries: they overlap)."""
        device, old, Bp, P = self.step.device, self.layout, len(layout.groups), layout.prompt_len
        if old is not None:
            group_of, slot_of = {p: i for i, p in enumerate(old.groups)}, dict(zip(old.rows, old.slots))
            old_groups = torch.tensor([group_of[p] for p in layout.groups], device=device)
            old_slots = torch.tensor([slot_of[r] for r in layout.rows], device=device)
            new_slots = torch.tensor(layout.slots, device=device)
            for x in self.prefix_k + self.prefix_v:
                x[:Bp, :, :P] = x[:len(old.groups), :, :P].index_select(0, old_groups)
            for x in self.own_k + self.own_v:
                moved = x[:len(old.groups) * old.group_size, :, :filled].index_select(0, old_slots)
                x[:Bp * layout.group_size, :, :filled].index_copy_(0, new_slots, moved)
        self.layout, self.num_slots = layout, Bp * layout.group_size
        identity = layout.slots == list(range(self.num_slots))  # no empty slots: skip the scatter/gather
        self.slots = None if identity else torch.tensor(layout.slots, device=device)
        self.prefix_valid = torch.arange(P, device=device) < prompt_lens[layout.groups][:, None]  # (Bp', P')
        zeros = torch.zeros(self.prefix_valid.shape, dtype=self.prefix_k[0].dtype, device=device)
        self.prefix_bias = (zeros.masked_fill(~self.prefix_valid, float("-inf"))[:, None, None]  # (Bp', 1, 1, P')
                            if not self.prefix_valid.all() else None)  # no padding: the fused kernel skips its mask

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.slots is not None:  # scatter the N rows into the grid; empty slots get zeros
            q, k, v = (x.new_zeros((self.num_slots,) + x.shape[1:]).index_copy_(0, self.slots, x)
                       for x in (q, k, v))  # (S, H or Hkv, 1, D)
        own_k, own_v = self.own_k[layer][:self.num_slots], self.own_v[layer][:self.num_slots]
        Bp, P = len(self.layout.groups), self.layout.prompt_len
        prefix_k, prefix_v = self.prefix_k[layer][:Bp, :, :P], self.prefix_v[layer][:Bp, :, :P]
        if self.fused and q.dtype == own_k.dtype:  # eager CPU: write at a Python index, attend to written keys only
            t = self.own_len - 1
            own_k[:, :, t:t + 1], own_v[:, :, t:t + 1] = k, v
            return self._gather(_fused_prefix_attention(q, own_k[:, :, :t + 1], own_v[:, :, :t + 1], prefix_k,
                                                        prefix_v, self.prefix_bias))
        own_k.index_copy_(2, self.step, k.to(own_k.dtype))  # a tensor index: a CUDA graph replays it
        own_v.index_copy_(2, self.step, v.to(own_v.dtype))
        own_k, own_v = own_k[:, :, :self.own_len], own_v[:, :, :self.own_len]  # (S, Hkv, Tc or t+1, D)
        own_allowed = (self.key_positions[:self.own_len] <= self.step)[None, None]  # (1, 1, Tc)
        return self._gather(prefix_attention(q, own_k, own_v, own_allowed, prefix_k, prefix_v, self.prefix_valid))

    def _gather(self, y: Tensor) -> Tensor:
        return y if self.slots is None else y.index_select(0, self.slots)  # (S, H, 1, D) -> (N, H, 1, D)


class _GraphedStep:
    """A CUDA graph of `step(tokens) -> logits` for one layout: warm up on a side stream, capture, replay.
    Replaying a step that already ran is harmless: it rewrites the same K/V at the same position."""

    def __init__(self, step: Callable[[Tensor], Tensor], tokens: Tensor):
        self.tokens, stream = tokens.clone(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(self.tokens)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(self.tokens)

    def __call__(self, tokens: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits

# -----------------------------------------------------------------------------
# generate


def _prefill(model: torch.nn.Module, prompts: list[list[int]], prefix_k: list[Tensor], prefix_v: list[Tensor],
             prefill_tokens: int, device: torch.device) -> Tensor:
    """Run the prompts a chunk at a time, right-padded to the chunk's longest (the views beyond stay zero, masked),
    storing each layer's K/V into the shared prompt views. Returns the logits (Bp, V) at each last position."""
    chunk, last_logits = max(1, prefill_tokens // max(map(len, prompts))), []
    for first in range(0, len(prompts), chunk):
        part = prompts[first:first + chunk]
        width = max(map(len, part))

        def store_kv(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            prefix_k[layer][first:first + len(part), :, :width] = k
            prefix_v[layer][first:first + len(part), :, :width] = v
            return causal_attention(layer, q, k, v)
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in part], device=device)  # (b, P)
        last = torch.tensor([len(p) - 1 for p in part], device=device)  # the final MLP runs on these alone
        last_logits.append(model.head(model.hidden(tokens, None, store_kv, last)[:, 0]))  # (b, V)
    return torch.cat(last_logits)  # (Bp, V)


@torch.inference_mode()
def generate(model: torch.nn.Module, prompts: list[list[int]], *, num_samples: int = 1, max_new_tokens: int = 64,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_ids: tuple[int, ...] = (),
             seed: int | None = None, check_every: int = 8, prefill_tokens: int = 2048, cuda_graphs: bool = True,
             cache: KVCache | None = None, logits_fn: Callable[[Tensor], Tensor] | None = None) -> Rollout:
    """Sample `num_samples` completions of each prompt (module docstring, RolloutConfig); `cache` None allocates
    one for this call. `logits_fn` maps every (rows, V') logits tensor before sampling (under tensor parallelism
    the all-gather of the vocab shards: every rank sees the same logits and, same seed, samples the same)."""
    started = time.perf_counter()
    cfg, G, stop_ids, logits_fn = model.config, num_samples, tuple(stop_ids), logits_fn or (lambda x: x)
    check_sampling(G, max_new_tokens, temperature, top_k, top_p, check_every, prefill_tokens)
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for name, ids in [(f"prompts[{i}]", p) for i, p in enumerate(prompts)] + [("stop_ids", stop_ids)]:
        if bad := [t for t in ids if not (isinstance(t, int) and 0 <= t < cfg.vocab_size)]:
            raise ValueError(f"{name} has token id {bad[0]!r} outside the vocabulary [0, {cfg.vocab_size})")
        if name != "stop_ids" and len(ids) == 0:
            raise ValueError(f"{name} is empty: every prompt needs at least one token")
        if name != "stop_ids" and len(ids) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"{name} has {len(ids)} tokens + max_new_tokens={max_new_tokens} > the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
    Bp, lens, R, Tc = len(prompts), [len(p) for p in prompts], len(prompts) * G, max_new_tokens - 1
    if max_new_tokens == 0:
        return Rollout([[] for _ in range(R)], [[] for _ in range(R)], ["length"] * R,
                       dict(prefill_tokens=0, decode_steps=0, new_tokens=0, seconds=0.0))
    weight, attn0 = next(model.parameters()), model.model.layers[0].self_attn
    device, generator, graphed = weight.device, torch.Generator(weight.device), weight.is_cuda and cuda_graphs
    generator.manual_seed(seed) if seed is not None else generator.seed()
    # Read the kv heads off the weights: a tensor-parallel shard has Hkv/tp of them.
    shape = (cfg.num_hidden_layers, attn0.k_proj.weight.shape[0] // attn0.head_dim, attn0.head_dim, Bp, G, max(lens))
    if cache is None:  # bf16 KV on the GPU, the model's dtype on the CPU
        kv_dtype = torch.bfloat16 if device.type == "cuda" else weight.dtype
        cache = KVCache(KVCache.numel_for(*shape, max_new_tokens), kv_dtype, device)
    views = cache.carve(*shape, max_new_tokens)

    logits = logits_fn(_prefill(model, prompts, views[0], views[1], prefill_tokens, device))  # (Bp, V)
    if device.type == "cuda":
        torch.cuda.synchronize()  # one sync so that prefill_seconds means something
    prefill_seconds = time.perf_counter() - started

    # Fan out: each of the G rows of a prompt draws its own first token from the same logits.
    out_tokens = torch.full((max_new_tokens, R), -1, dtype=torch.long, device=device)
    out_logprobs = torch.zeros((max_new_tokens, R), dtype=torch.float32, device=device)
    tokens, logprobs = sample(logits.repeat_interleave(G, dim=0), temperature, top_k, top_p, generator)  # (R,)
    out_tokens[0], out_logprobs[0] = tokens, logprobs
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=device)
    finished = torch.isin(tokens, stop_t)  # (N,)

    lens_t, rows, step = torch.tensor(lens, device=device), torch.arange(R, device=device), tokens.new_zeros(1)
    attn, layout = _DecodeAttention(views, step, Tc), _Layout.of(list(range(R)), G, lens)
    attn.set_layout(layout, lens_t)
    base_positions = lens_t[rows // G][:, None]  # (N, 1)
    run_graph, decode_steps, row_steps, compactions = None, 0, 0, 0

    def decode(tokens: Tensor) -> Tensor:  # (N, 1) -> (N, V); every other input is a tensor held by attn
        positions = base_positions + step  # (N, 1): completion token t of prompt i sits at len_i + t
        return model.head(model.hidden(tokens, positions, attn)[:, -1])  # (N, V)

    for t in range(Tc):  # feed completion token t, sample token t + 1
        step.fill_(t)
        if graphed:
            run_graph = run_graph or _GraphedStep(decode, tokens[:, None])
            logits = run_graph(tokens[:, None])
        else:
            attn.own_len = t + 1  # eager: attend only to the keys written so far
            logits = decode(tokens[:, None])
        tokens, logprobs = sample(logits_fn(logits), temperature, top_k, top_p, generator)  # (N,)
        out_tokens[t + 1].index_copy_(0, rows, tokens)
        out_logprobs[t + 1].index_copy_(0, rows, logprobs)
        decode_steps, row_steps = decode_steps + 1, row_steps + len(layout.rows)
        if stop_ids:
            finished |= torch.isin(tokens, stop_t)
        if not stop_ids or (t + 2) % check_every or t + 1 == Tc:
            continue
        # The occasional host sync: drop finished rows. A graph re-capture costs about a step, so on
        # the GPU rows are dropped only once at least 1/8 of them are finished.
        keep = (~finished).nonzero()[:, 0].tolist()
        if not keep:
            break
        if len(keep) == len(layout.rows) or (graphed and len(keep) > len(layout.rows) * 7 // 8):
            continue
        layout, compactions, run_graph = _Layout.of([layout.rows[i] for i in keep], G, lens), compactions + 1, None
        attn.set_layout(layout, lens_t, filled=t + 1)
        keep_t = torch.tensor(keep, device=device)
        rows, tokens, finished = rows[keep_t], tokens[keep_t], finished[keep_t]
        base_positions = lens_t[rows // G][:, None]  # (N', 1)

    # Back on the host: cut each row after its first stop id (rows decode on until the next check).
    token_rows = out_tokens.T.tolist()
    ends = [next((i + 1 for i, tok in enumerate(row) if tok in stop_ids), max_new_tokens) for row in token_rows]
    completions = [row[:end] for row, end in zip(token_rows, ends)]
    logprobs_out = [row[:end] for row, end in zip(out_logprobs.T.tolist(), ends)]
    reasons = ["stop" if row[-1] in stop_ids else "length" for row in completions]
    nbytes = [sum(x.numel() * x.element_size() for x in kind) for kind in views]
    return Rollout(completions, logprobs_out, reasons, dict(
        prefill_tokens=sum(lens), prefill_seconds=prefill_seconds, decode_steps=decode_steps, row_steps=row_steps,
        compactions=compactions, new_tokens=sum(map(len, completions)), prompt_kv_bytes=nbytes[0] + nbytes[1],
        completion_kv_bytes=nbytes[2] + nbytes[3], seconds=time.perf_counter() - started))

# -----------------------------------------------------------------------------
# Weight sync: the sampler receives the trainer's weights


@torch.no_grad()
def sync_weights(sampler: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy every parameter of the trainer `model` into the sampler's same-named parameter, in place
    and cast to the sampler's dtype (vLLM's and SGLang's update_weights): the sampler keeps its
    objects and addresses. Nothing to do when they are the same module. Call it before each rollout,
    with or without memory.py: a sampler that is not synced samples from stale weights."""
    if sampler is model:
        return
    targets, sources = dict(sampler.named_parameters()), dict(model.named_parameters())
    for name in sorted(targets.keys() | sources.keys()):  # check all before writing any
        if name not in targets or name not in sources:
            where = "sampler" if name in targets else "trainer"
            raise ValueError(f"sync_weights: parameter '{name}' exists in the {where} only: "
                             f"the sampler must be a copy of the trainer (deepcopy, .to(dtype))")
        if targets[name].shape != sources[name].shape:
            raise ValueError(f"sync_weights: parameter '{name}' has shape "
                             f"{tuple(targets[name].shape)} in the sampler, "
                             f"{tuple(sources[name].shape)} in the trainer")
    for name, target in targets.items():
        target.copy_(sources[name])
