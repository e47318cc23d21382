"""
The sampler that stands in for vLLM: a preallocated KV cache, each prompt prefilled once, G samples
per prompt decoded on top of that one shared prompt KV, finished rows dropped as the batch runs.

1. Prefill: the Bp ragged prompts, right-padded, go through the model in one batch (causal attention
   is exact for the valid positions because the pads come after them). Each layer's keys/values are
   stored once per prompt: (Bp, Hkv, P, D), not (Bp*G, ...).
2. Fan-out: the logits at each prompt's last valid position are repeated G times and every row draws
   its own first token (nanochat once broadcast one first token to all G rows).
3. Decode: one token per active row per step. The attention hook writes the row's key/value into its
   own completion KV and calls model.prefix_attention: the G rows of a group are folded into the
   query dimension against the one prompt KV (Hydragen), merged with the row's own keys by log-sum-exp.
4. Every `check_every` steps (the only host sync in the loop) rows that sampled a stop id are dropped:
   the active rows are re-laid into a padded (Bp', G') grid of slots, the linears run on the N active
   rows only, and just the attention sees the grid (see _Layout).
5. Sampling without host sync: temperature, top-k, top-p, then inverse-CDF sampling. The returned
   logprob of each token is under exactly that filtered distribution (trl#4159, trl#6789).

Leaves out: paged KV and continuous batching (a GRPO rollout is one static batch), speculative decoding,
stop strings (stop ids only), prefix sharing across different prompts.

On CUDA the decode step is captured as a CUDA graph per layout of active rows; the private KV cache is
bf16 there. memory.py releases `KVCache.buffer` between rollouts and re-creates it in place.

Shapes: Bp prompts, G samples per prompt, N active rows (<= Bp*G), S = Bp'*G' slots of the padded grid,
P longest prompt, Tc completion KV length, C width, H/Hkv heads, D head dim, V vocab (V/tp when the
lm_head is split by tensor parallelism), L layers.
Tested by tests/test_rollout.py; benchmarked by tests/bench_rollout.py.
"""

import time
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
    stop_ids: tuple[int, ...] = ()        # e.g. the tokenizer's eos id; the stop token ends its completion
    seed: int | None = None               # None draws a seed from torch's global RNG
    check_every: int = 8                  # decode steps between host syncs that drop finished rows
    prefill_tokens: int = 16384           # padded prompt tokens per prefill forward (bounds activations)
    cuda_graphs: bool = True              # capture the decode step on CUDA (ignored on CPU)

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
    for name, value, low in (("num_samples", num_samples, 1), ("max_new_tokens", max_new_tokens, 0),
                             ("top_k", top_k, 0), ("check_every", check_every, 1),
                             ("prefill_tokens", prefill_tokens, 1)):
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
    (computed after top-k, as vLLM does). log_softmax of this is what a trainer must use for ratio = 1."""
    x = logits.float() / (temperature if temperature > 0 else 1.0)
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]  # (rows, 1); ties with the k-th are kept
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # 0 for the top token, so at least one is always kept
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter_(-1, order, mass_before >= top_p)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """One token per row from logits (rows, V) -> tokens (rows,) long, logprobs (rows,) float32.
    Inverse-CDF sampling, no host sync: one uniform per row, located in the row's cumulative distribution
    (V exponential draws per row for an exponential race cost 10x more on the CPU). Greedy (temperature 0)
    takes the argmax and returns its logprob under temperature 1 with the same top-k/top-p mask: a point
    mass would make every logprob 0, which no trainer forward reproduces."""
    x = filter_logits(logits, temperature, top_k, top_p)
    logp = x.log_softmax(dim=-1)  # (rows, V)
    if temperature == 0:
        tokens = x.argmax(dim=-1)
    else:
        # float64: in float32 a token whose probability is below the ulp of the running sum is never drawn.
        cdf = logp.exp().double().cumsum(dim=-1)  # (rows, V)
        total = cdf[:, -1:]  # (rows, 1), 1 up to rounding
        u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=x.device) * total
        u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total: some cdf exceeds it
        # The first index whose cdf exceeds u; a masked token adds exactly 0 to the cdf, so it is never first.
        tokens = torch.searchsorted(cdf, u, right=True)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


# -----------------------------------------------------------------------------
# KV cache: one flat buffer, carved into views per call


class KVCache:
    """A preallocated pool in ONE flat tensor `buffer` (1-D, on the device), so memory.py can release it
    with `buffer.untyped_storage().resize_(0)` and wake it by resizing back. generate() carves, per layer,
    the shared prompt K/V (Bp, Hkv, P, D) and each row's completion K/V (Bp*G, Hkv, Tc, D) out of it."""

    def __init__(self, numel: int, dtype: torch.dtype, device: str | torch.device):
        self.buffer = torch.zeros(numel, dtype=dtype, device=device)

    @staticmethod
    def numel_for(num_layers: int, kv_heads: int, head_dim: int, num_prompts: int, num_samples: int,
                  max_prompt_len: int, max_new_tokens: int) -> int:
        completion_len = max(max_new_tokens - 1, 0)  # the last sampled token is never fed back
        per_position = 2 * num_layers * kv_heads * head_dim  # K and V of every layer
        return per_position * num_prompts * (max_prompt_len + num_samples * completion_len)

    @classmethod
    def for_batch(cls, model_config: ModelConfig, num_prompts: int, num_samples: int, max_prompt_len: int,
                  max_new_tokens: int, dtype: torch.dtype, device: str | torch.device,
                  tp_size: int = 1) -> "KVCache":
        """Sized for this batch (or any smaller one). Under tensor parallelism each rank holds Hkv/tp heads."""
        kv_heads = model_config.num_key_value_heads
        if kv_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide num_key_value_heads={kv_heads}")
        return cls(cls.numel_for(model_config.num_hidden_layers, kv_heads // tp_size, model_config.head_dim,
                                 num_prompts, num_samples, max_prompt_len, max_new_tokens), dtype, device)

    @property
    def nbytes(self) -> int:
        """Capacity in bytes when awake."""
        return self.buffer.numel() * self.buffer.element_size()

    def check_awake(self) -> None:
        if self.buffer.untyped_storage().nbytes() < self.nbytes:
            raise RuntimeError("the KV cache is released (asleep): wake the rollout phase before generate")

    def carve(self, num_layers: int, kv_heads: int, head_dim: int, num_prompts: int, num_samples: int,
              prompt_len: int, completion_len: int) -> tuple[list[Tensor], ...]:
        """Zeroed views: prompt K, prompt V (Bp, Hkv, P, D) and completion K, V (Bp*G, Hkv, Tc, D) per layer.
        Zeroed because masked keys still meet 0 * value in attention, and 0 * NaN garbage is NaN."""
        need = self.numel_for(num_layers, kv_heads, head_dim, num_prompts, num_samples, prompt_len,
                              completion_len + 1)
        element = self.buffer.element_size()
        if need > self.buffer.numel():
            raise ValueError(f"the KV cache is too small for this batch: it needs {need * element:,} bytes "
                             f"({num_prompts} prompts x {num_samples} samples, prompt length {prompt_len}, "
                             f"{completion_len + 1} new tokens) but holds {self.nbytes:,} bytes")
        shapes = [(num_prompts, kv_heads, prompt_len, head_dim)] * 2 + \
                 [(num_prompts * num_samples, kv_heads, completion_len, head_dim)] * 2
        views, offset = ([], [], [], []), 0
        for _ in range(num_layers):
            for kind, shape in enumerate(shapes):
                n = shape[0] * shape[1] * shape[2] * shape[3]
                views[kind].append(self.buffer[offset:offset + n].view(shape))
                offset += n
        self.buffer[:offset].zero_()
        return views

# -----------------------------------------------------------------------------
# Attention hooks: prefill writes the shared prompt KV, decode reads it


class _PrefillAttention:
    """Causal attention over a chunk of right-padded prompts (rows first..first+b of the batch) that also
    stores each layer's K/V as the shared prompt KV. The views are carved at the first call, where the
    K/V shapes say how many kv heads this (possibly tensor-parallel) model has."""

    def __init__(self, carve: Callable[[int, int], tuple[list[Tensor], ...]]):
        self.carve, self.views, self.first = carve, None, 0

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.views is None:
            self.views = self.carve(k.shape[1], k.shape[3])
        B, _, T, _ = k.shape
        self.views[0][layer][self.first:self.first + B, :, :T] = k
        self.views[1][layer][self.first:self.first + B, :, :T] = v
        return causal_attention(layer, q, k, v)


@dataclass
class _Layout:
    """Where the N active rows sit. prefix_attention wants Bp'*G' query rows, G' per group; once some rows
    finish, groups hold different counts, so the active rows are scattered into a grid of Bp' groups x G'
    slots (G' = the largest count) for attention only. `slots` is None when the grid is exactly the rows."""
    rows: list[int]          # global row id (prompt * G + sample) of each active row, ascending
    groups: list[int]        # the prompt of each of the Bp' groups
    group_size: int          # G'
    slots: list[int]         # slot of each active row in the grid
    prompt_len: int          # longest prompt among the groups

    @classmethod
    def of(cls, rows: list[int], G: int, prompt_lens: list[int]) -> "_Layout":
        groups = sorted({r // G for r in rows})
        rank = {p: [] for p in groups}
        for r in rows:
            rank[r // G].append(r)
        group_size = max(len(members) for members in rank.values())
        where = {p: i for i, p in enumerate(groups)}
        slots = [where[r // G] * group_size + rank[r // G].index(r) for r in rows]
        return cls(rows, groups, group_size, slots, max(prompt_lens[p] for p in groups))


class _DecodeAttention:
    """Writes the step's K/V into each row's completion KV (slot `step`) and attends to the shared prompt
    KV plus the row's own keys. Every per-step input is a tensor, so a CUDA graph can replay it."""

    def __init__(self, views: tuple[list[Tensor], ...], step: Tensor, completion_len: int):
        self.prefix_k, self.prefix_v, self.own_k, self.own_v = views
        self.step = step  # (1,) long: the completion index of the token being fed
        self.own_len = completion_len  # keys attended per row; the CPU path shrinks it to step + 1
        self.positions = torch.arange(completion_len, device=step.device)

    def set_layout(self, layout: _Layout, prompt_lens: Tensor) -> None:
        device, Bp, P = self.step.device, len(layout.groups), layout.prompt_len
        self.num_slots = Bp * layout.group_size
        identity = layout.slots == list(range(self.num_slots))
        self.slots = None if identity else torch.tensor(layout.slots, device=device)
        self.prefix_valid = torch.arange(P, device=device) < prompt_lens[layout.groups][:, None]  # (Bp', P')
        self.prefix = [(k[:Bp, :, :P], v[:Bp, :, :P]) for k, v in zip(self.prefix_k, self.prefix_v)]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.slots is not None:  # scatter the N rows into the grid; empty slots get zeros
            q, k, v = (x.new_zeros((self.num_slots,) + x.shape[1:]).index_copy_(0, self.slots, x)
                       for x in (q, k, v))  # (S, H or Hkv, 1, D)
        own_k, own_v = self.own_k[layer][:self.num_slots], self.own_v[layer][:self.num_slots]
        own_k.index_copy_(2, self.step, k.to(own_k.dtype))
        own_v.index_copy_(2, self.step, v.to(own_v.dtype))
        own_allowed = (self.positions[:self.own_len] <= self.step)[None, None]  # (1, 1, own_len)
        prefix_k, prefix_v = self.prefix[layer]
        y = prefix_attention(q, own_k[:, :, :self.own_len], own_v[:, :, :self.own_len], own_allowed,
                             prefix_k, prefix_v, self.prefix_valid)  # (S, H, 1, D)
        return y if self.slots is None else y.index_select(0, self.slots)  # (N, H, 1, D)


def _relayout(attn: _DecodeAttention, old: _Layout, new: _Layout, filled: int) -> None:
    """Move the surviving prompts' KV to the front of the prompt views and the surviving rows' completion
    KV to their new slots. Each source is gathered into a temporary first: old and new views overlap."""
    device = attn.step.device
    group_of, slot_of = {p: i for i, p in enumerate(old.groups)}, dict(zip(old.rows, old.slots))
    old_groups = torch.tensor([group_of[p] for p in new.groups], device=device)
    old_slots = torch.tensor([slot_of[r] for r in new.rows], device=device)
    new_slots = torch.tensor(new.slots, device=device)
    Bp, P, S = len(new.groups), new.prompt_len, len(old.groups) * old.group_size
    for views in (attn.prefix_k, attn.prefix_v):
        for x in views:
            x[:Bp, :, :P] = x[:len(old.groups), :, :P].index_select(0, old_groups)
    for views in (attn.own_k, attn.own_v):
        for x in views:
            moved = x[:S, :, :filled].index_select(0, old_slots)  # (N', Hkv, filled, D)
            x[:len(new.groups) * new.group_size, :, :filled].index_copy_(0, new_slots, moved)


class _GraphedStep:
    """A CUDA graph of `step(tokens) -> logits` for one layout. The warm-up run on a side stream gives
    this step's real logits (its KV writes are the ones the graph repeats), then capture, then replay."""

    def __init__(self, step: Callable[[Tensor], Tensor], tokens: Tensor):
        self.tokens = tokens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.first = step(self.tokens)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(self.tokens)

    def __call__(self, tokens: Tensor) -> Tensor:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits

# -----------------------------------------------------------------------------
# generate


def _check_prompts(prompts: list[list[int]], vocab_size: int, max_positions: int, max_new_tokens: int,
                   stop_ids: tuple[int, ...]) -> None:
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"prompts[{i}] has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
        if len(prompt) + max_new_tokens > max_positions:
            raise ValueError(f"prompts[{i}] has {len(prompt)} tokens + max_new_tokens={max_new_tokens} > the "
                             f"model's max_position_embeddings={max_positions}")
    bad = [t for t in stop_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"stop_ids has {bad[0]!r} outside the vocabulary [0, {vocab_size})")


def _prefill(model: torch.nn.Module, prompts: list[list[int]], attn: _PrefillAttention,
             prefill_tokens: int) -> Tensor:
    """Run the prompts, a chunk at a time, through `attn`; return the logits (Bp, V) of each prompt's last
    valid position. Each chunk is right-padded to its own longest prompt: pads come after the valid
    tokens, so causal attention needs no mask, and the prompt views beyond stay zero (masked later)."""
    device = next(model.parameters()).device
    chunk = max(1, prefill_tokens // max(map(len, prompts)))
    last_logits = []
    for attn.first in range(0, len(prompts), chunk):
        part = prompts[attn.first:attn.first + chunk]
        width = max(map(len, part))
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in part], device=device)  # (b, P)
        h = model.hidden(tokens, None, attn)  # (b, P, C)
        last = torch.tensor([len(p) - 1 for p in part], device=device)
        last_logits.append(model.head(h[torch.arange(len(part), device=device), last]))  # (b, V)
    return torch.cat(last_logits)  # (Bp, V)


@torch.inference_mode()
def generate(model: torch.nn.Module, prompts: list[list[int]], *, num_samples: int = 1, max_new_tokens: int = 64,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_ids: tuple[int, ...] = (),
             seed: int | None = None, check_every: int = 8, prefill_tokens: int = 16384, cuda_graphs: bool = True,
             cache: KVCache | None = None, logits_fn: Callable[[Tensor], Tensor] | None = None) -> Rollout:
    """Sample `num_samples` completions of each prompt (see the module docstring).
    `cache` None allocates one for this call. `logits_fn` maps every (rows, V') logits tensor the model
    returns before sampling (under tensor parallelism: the all-gather of vocab shards), so every rank
    sees the same logits and, with the same seed, samples the same tokens."""
    started = time.perf_counter()
    cfg, G, stop_ids = model.config, num_samples, tuple(stop_ids)
    check_sampling(G, max_new_tokens, temperature, top_k, top_p, check_every, prefill_tokens)
    _check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens, stop_ids)
    if cache is not None:
        cache.check_awake()
    Bp, lens, L = len(prompts), [len(p) for p in prompts], cfg.num_hidden_layers
    if max_new_tokens == 0:
        return Rollout([[] for _ in range(Bp * G)], [[] for _ in range(Bp * G)], ["length"] * Bp * G,
                       dict(prefill_tokens=0, decode_steps=0, new_tokens=0, seconds=0.0))
    weight = next(model.parameters())
    device, P, Tc = weight.device, max(lens), max_new_tokens - 1
    graphed = device.type == "cuda" and cuda_graphs
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # a fresh seed for this generator only; the global RNG is untouched
    else:
        generator.manual_seed(seed)
    lens_t = torch.tensor(lens, device=device)
    logits_fn = logits_fn or (lambda x: x)

    def carve(kv_heads: int, head_dim: int) -> tuple[list[Tensor], ...]:
        nonlocal cache
        if cache is None:  # bf16 KV on the GPU, the model's dtype on the CPU
            kv_dtype = torch.bfloat16 if device.type == "cuda" else weight.dtype
            cache = KVCache(KVCache.numel_for(L, kv_heads, head_dim, Bp, G, P, max_new_tokens), kv_dtype, device)
        return cache.carve(L, kv_heads, head_dim, Bp, G, P, Tc)

    prefill = _PrefillAttention(carve)
    logits = logits_fn(_prefill(model, prompts, prefill, prefill_tokens)).repeat_interleave(G, dim=0)  # (Bp*G, V)
    views = prefill.views
    if device.type == "cuda":
        torch.cuda.synchronize()  # one sync so that prefill_seconds means something
    prefill_seconds = time.perf_counter() - started

    # Fan out: each of the G rows of a prompt draws its own first token from the same logits.
    out_tokens = torch.full((max_new_tokens, Bp * G), -1, dtype=torch.long, device=device)
    out_logprobs = torch.zeros((max_new_tokens, Bp * G), dtype=torch.float32, device=device)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, generator)  # (Bp*G,)
    out_tokens[0], out_logprobs[0] = tokens, logprobs
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=device)
    finished = torch.isin(tokens, stop_t)  # (N,)

    step = torch.zeros(1, dtype=torch.long, device=device)
    attn = _DecodeAttention(views, step, Tc)
    layout = _Layout.of(list(range(Bp * G)), G, lens)
    attn.set_layout(layout, lens_t)
    rows = torch.arange(Bp * G, device=device)
    base_positions = lens_t[rows // G][:, None]  # (N, 1)
    decode_steps = row_steps = compactions = 0
    run_step: Callable | None = None

    def decode(tokens: Tensor) -> Tensor:  # (N, 1) -> (N, V); every other input is a tensor held by attn
        positions = base_positions + step  # (N, 1): completion token t of prompt i sits at len_i + t
        h = model.hidden(tokens, positions, attn)  # (N, 1, C)
        return model.head(h[:, -1])  # (N, V)

    for t in range(Tc):  # feed completion token t, sample token t + 1
        step.fill_(t)
        if graphed:
            run_step = run_step or _GraphedStep(decode, tokens[:, None])
            logits = run_step(tokens[:, None])
        else:
            attn.own_len = t + 1  # on the CPU attend only to the keys written so far
            logits = decode(tokens[:, None])
        tokens, logprobs = sample(logits_fn(logits), temperature, top_k, top_p, generator)  # (N,)
        out_tokens[t + 1].index_copy_(0, rows, tokens)
        out_logprobs[t + 1].index_copy_(0, rows, logprobs)
        decode_steps, row_steps = decode_steps + 1, row_steps + len(layout.rows)
        if not stop_ids:
            continue
        finished |= torch.isin(tokens, stop_t)
        if (t + 2) % check_every or t + 1 == Tc:
            continue
        # The occasional host sync: drop finished rows. A graph re-capture costs about a step, so on
        # the GPU rows are dropped only once at least 1/8 of them are finished.
        keep = (~finished).nonzero()[:, 0].tolist()
        if not keep:
            break
        if len(keep) == len(layout.rows) or (graphed and len(keep) > len(layout.rows) * 7 // 8):
            continue
        new_layout = _Layout.of([layout.rows[i] for i in keep], G, lens)
        _relayout(attn, layout, new_layout, t + 1)
        layout, compactions, run_step = new_layout, compactions + 1, None
        attn.set_layout(layout, lens_t)
        keep_t = torch.tensor(keep, device=device)
        rows, tokens, finished = rows[keep_t], tokens[keep_t], finished[keep_t]
        base_positions = lens_t[rows // G][:, None]  # (N', 1)

    # Back on the host: cut each row after its first stop id (rows decode on until the next check).
    completions, logprobs_out, reasons = [], [], []
    stop_set = set(stop_ids)
    for row_tokens, row_logprobs in zip(out_tokens.T.tolist(), out_logprobs.T.tolist()):
        end = next((i + 1 for i, tok in enumerate(row_tokens) if tok in stop_set), len(row_tokens))
        reasons.append("stop" if row_tokens[end - 1] in stop_set else "length")
        completions.append(row_tokens[:end])
        logprobs_out.append(row_logprobs[:end])
    nbytes = [sum(x.numel() * x.element_size() for x in kind) for kind in views]
    stats = dict(prefill_tokens=sum(lens), prefill_seconds=prefill_seconds, decode_steps=decode_steps,
                 row_steps=row_steps, compactions=compactions, new_tokens=sum(map(len, completions)),
                 prompt_kv_bytes=nbytes[0] + nbytes[1], completion_kv_bytes=nbytes[2] + nbytes[3],
                 seconds=time.perf_counter() - started)
    return Rollout(completions, logprobs_out, reasons, stats)
