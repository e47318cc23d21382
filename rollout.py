"""
The sampler that stands in for vLLM: a preallocated KV cache, each prompt prefilled once, G samples
per prompt decoded on top of that one shared prompt KV, finished rows dropped as the batch runs.

1. Prefill: the Bp ragged prompts, longest first, right-padded, in chunks of `prefill_tokens`
   padded tokens (like lengths together: little padding; causal attention is exact for the valid
   positions, the pads come after them). Each layer's K/V is stored once per prompt, (Bp, Hkv, P,
   D).
2. Fan-out: each prompt's last-position logits are repeated G times and every row draws its own
   first token (nanochat once broadcast one first token to all G rows).
3. Decode: the attention hook writes each row's key/value into its own completion KV and runs
   attention.prefix_attention: the G rows of a group are folded into the query dimension against the
   one prompt KV (Hydragen) and merged with the row's own keys by log-sum-exp. Prompt KV memory and
   reads / G. On the CPU the groups run in buckets of like prompt lengths (length_buckets), each
   reading its own prompts' keys: a short prompt's padding is not read.
4. Every `check_every` steps (the only host sync in the loop) rows that sampled a stop id are
   dropped: the linears run on the N active rows only; attention sees them in a Bp' x G' grid.
5. Sampling (sampling.py) without host sync; each returned logprob is under the distribution
   actually sampled from, after temperature, top-k, top-p (trl#4159, trl#6789: otherwise the GRPO
   ratio is not 1).
6. The result stays on the device as tensors: tokens, mask and logprobs (R, Tc). GRPO trains on
   them as they are; only the text for the rewards is decoded on the host (train.py).
With a tool (generate(episodes=...)), rows are multi-turn episodes: episodes.py runs the decode
loop, and a tool's answer is prefilled into the row's own KV cache (_Decoder.extend).

Leaves out: paged KV and continuous batching (a GRPO rollout is one static batch), speculative
decoding, stop strings (stop ids only), prefix sharing across different prompts.
CPU: the prompt part goes through SDPA's fused kernel, whose log-sum-exp then enters the own keys'
softmax as one more score: the same merge in fewer kernels (_fused_prefix_attention); float32
linears run on weights prepacked once per call (_packed_linears).
CUDA: the decode step is a CUDA graph per layout of active rows; the private KV cache is bf16.

Shapes: Bp prompts, G samples per prompt, R = Bp*G rows, N active rows, S = Bp'*G' slots of the
grid, P longest prompt, Tc completion length, C width, H/Hkv heads, D head dim, V vocab (V/tp when
the lm_head is split by tensor parallelism), L layers.
Tested by tests/test_rollout.py; benchmarked by tests/bench_rollout.py.
"""

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from attention import length_buckets, prefix_attention
from episodes import Episodes, decode_episodes
from model import ModelConfig, causal_attention
from sampling import filter_logits, inverse_cdf, sample  # noqa: F401 (rollout.sample: benches)

# -----------------------------------------------------------------------------
# Config and result


@dataclass
class RolloutConfig:
    """The sampling knobs: the one home of each (GRPO scores under this same temperature)."""
    num_samples: int = 16        # G completions per prompt (the GRPO group)
    max_new_tokens: int = 0      # completion budget; 0 in train.py: the task's own (or 256)
    temperature: float = 1.0     # 0 = greedy (evaluation only: GRPO needs distinct samples)
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off; keeps the smallest set of tokens whose mass reaches p
    check_every: int = 8         # decode steps between the host syncs that drop finished rows
    prefill_tokens: int = 2048   # padded prompt tokens per prefill forward (bounds activations)
    cuda_graphs: bool = True     # capture the decode step on CUDA (ignored on the CPU)
    packed_linears: bool = True  # CPU, float32: linears via oneDNN, weights prepacked per call

    def __post_init__(self):
        checks = dict(num_samples=1, max_new_tokens=0, top_k=0, check_every=1, prefill_tokens=1)
        for name, low in checks.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):  # `not >=`: NaN too
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")


@dataclass
class Rollout:
    """Completions on the device, prompt-major: prompt i owns rows i*G .. i*G+G-1."""
    tokens: Tensor       # (R, Tc) long; each row's tokens, the stop token included, then 0
    mask: Tensor         # (R, Tc) bool; True on each row's tokens
    logprobs: Tensor     # (R, Tc) float32; under the distribution sampled from, 0 off the mask
    stopped: Tensor      # (R,) bool; the row ends with a stop id (else it hit max_new_tokens)
    temperature: float   # the distribution the trainer scores them under (trl#4159)
    stats: dict = field(default_factory=dict)
    policy: Tensor | None = None  # (R, Tc) bool; True on sampled tokens, False on a tool's
                                  # observations (episodes.py); None: every token was sampled

    def completions(self) -> list[list[int]]:
        """Each row's tokens as a Python list (one host copy): for decoding text and for tests."""
        lengths = self.mask.sum(1).tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), lengths)]

    def logprob_lists(self) -> list[list[float]]:
        lengths = self.mask.sum(1).tolist()
        return [row[:n] for row, n in zip(self.logprobs.tolist(), lengths)]

# -----------------------------------------------------------------------------
# KV cache: one flat buffer, carved into views per call


class KVCache:
    """A preallocated pool in ONE flat tensor `buffer` (1-D, on the device), so memory.py can free
    it whole and re-create it. generate() carves, per layer, the shared prompt K/V (Bp, Hkv, P, D)
    and each row's completion K/V (Bp*G, Hkv, Tc, D) out of it."""

    def __init__(self, numel: int, dtype: torch.dtype, device: str | torch.device):
        self.buffer = torch.zeros(numel, dtype=dtype, device=device)

    @staticmethod
    def numel_for(num_layers: int, kv_heads: int, head_dim: int, num_prompts: int,
                  num_samples: int, max_prompt_len: int, max_new_tokens: int) -> int:
        completion_len = max(max_new_tokens - 1, 0)  # the last sampled token is never fed back
        per_prompt = max_prompt_len + num_samples * completion_len
        return 2 * num_layers * kv_heads * head_dim * num_prompts * per_prompt

    @classmethod
    def for_batch(cls, model_config: ModelConfig, num_prompts: int, num_samples: int,
                  max_prompt_len: int, max_new_tokens: int, dtype: torch.dtype,
                  device: str | torch.device, tp_size: int = 1) -> "KVCache":
        """Sized for this batch (or any smaller one). Under tensor parallelism a rank holds Hkv/tp
        heads."""
        kv_heads = model_config.num_key_value_heads
        if kv_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide num_key_value_heads={kv_heads}")
        numel = cls.numel_for(model_config.num_hidden_layers, kv_heads // tp_size,
                              model_config.head_dim, num_prompts, num_samples, max_prompt_len,
                              max_new_tokens)
        return cls(numel, dtype, device)

    @property
    def nbytes(self) -> int:  # capacity when awake
        return self.buffer.numel() * self.buffer.element_size()

    def carve(self, L: int, Hkv: int, D: int, Bp: int, G: int, P: int,
              new_tokens: int) -> tuple[list[Tensor], ...]:
        """Zeroed views, per layer: prompt K, prompt V (Bp, Hkv, P, D), completion K, V
        (Bp*G, Hkv, Tc, D). Zeroed because masked keys still meet 0 * value in attention, and
        0 * NaN garbage is NaN."""
        if self.buffer.untyped_storage().nbytes() < self.nbytes:
            raise RuntimeError("the KV cache is released (asleep): wake the rollout phase before "
                               "generate")
        need = self.numel_for(L, Hkv, D, Bp, G, P, new_tokens) * self.buffer.element_size()
        if need > self.nbytes:
            raise ValueError(f"the KV cache is too small for this batch: it needs {need:,} bytes "
                             f"({Bp} prompts x {G} samples, prompt length {P}, {new_tokens} new "
                             f"tokens) but holds {self.nbytes:,} bytes")
        shapes = [(Bp, Hkv, P, D)] * 2 + [(Bp * G, Hkv, max(new_tokens - 1, 0), D)] * 2
        views = ([], [], [], [])
        offset = 0
        for _, (kind, shape) in itertools.product(range(L), enumerate(shapes)):
            views[kind].append(self.buffer[offset:offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        self.buffer[:offset].zero_()
        return views

# -----------------------------------------------------------------------------
# Decode attention: the shared prompt KV plus each row's own completion KV


@dataclass
class _Layout:
    """Where the N active rows sit. prefix_attention wants G' query rows per group; once rows
    finish, groups hold different counts, so attention sees the rows scattered into a grid of Bp'
    groups x G' slots (G' = the largest count); empty slots compute garbage that nobody reads."""
    rows: list[int]          # global row id (prompt * G + sample) of each active row, ascending
    groups: list[int]        # the prompt of each of the Bp' groups
    group_size: int          # G'
    slots: list[int]         # slot of each active row in the grid
    prompt_len: int          # longest prompt among the groups

    @classmethod
    def of(cls, rows: list[int], G: int, prompt_lens: list[int]) -> "_Layout":
        counts = Counter(r // G for r in rows)  # in order of first appearance: prompt-major rows
        group_size = max(counts.values())
        slots = [i * group_size + j for i, n in enumerate(counts.values()) for j in range(n)]
        prompt_len = max(prompt_lens[p] for p in counts)
        return cls(rows, list(counts), group_size, slots, prompt_len)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_prefix_attention(q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor, prefix_v: Tensor,
                            prefix_bias: Tensor | None) -> Tensor:
    """prefix_attention for one token per row, all of k/v allowed, on the CPU, in few kernels
    (per-op overhead and memory latency, not FLOPs, are what cost here). The prompt part goes
    through SDPA's fused kernel, which also returns its log-sum-exp lse_p. The own part then merges
    it as one more key: softmax over [own scores, lse_p] weighs the prompt part's output exactly as
    the log-sum-exp merge does, and sums to 1 with the own keys.
    q (S, H, 1, D), k/v (S, Hkv, T, D) views of the cache, prefix_bias (Bp, 1, 1, P) 0 / -inf, or
    None: no padding."""
    S, H, _, D = q.shape
    Bp, Hkv = prefix_k.shape[:2]
    T = k.shape[2]
    G = S // Bp
    rep = H // Hkv
    # The G rows of a group and the rep query heads of a kv head share the prompt's keys.
    qp = q.view(Bp, G, Hkv, rep, D).transpose(1, 2).reshape(Bp, Hkv, G * rep, D)
    out_p, lse_p = _CPU_FLASH(qp, prefix_k, prefix_v, attn_mask=prefix_bias)  # (Bp, Hkv, G*rep, .)
    # Back to row-major order (S*Hkv, rep).
    dt = torch.promote_types(q.dtype, torch.float32)  # bf16 accumulates in float32
    out_p = out_p.view(Bp, Hkv, G, rep, D).transpose(1, 2).reshape(S * Hkv, rep, D).to(dt)
    lse_p = lse_p.view(Bp, Hkv, G, rep, 1).transpose(1, 2).reshape(S * Hkv, rep, 1)
    # Own part: GQA by folding the rep heads into the query dimension (2 bmm; SDPA is 2x slower).
    qs = q.reshape(S * Hkv, rep, D).to(dt) * D ** -0.5
    own_k = k.reshape(S * Hkv, T, D).to(dt)
    own_v = v.reshape(S * Hkv, T, D).to(dt)
    scores = torch.bmm(qs, own_k.transpose(1, 2))  # (S*Hkv, rep, T)
    probs = torch.cat((scores, lse_p), dim=-1).softmax(dim=-1)  # (S*Hkv, rep, T + 1)
    y = torch.baddbmm(out_p * probs[..., T:], probs[..., :T], own_v)  # (S*Hkv, rep, D)
    return y.view(S, H, 1, D).to(q.dtype)  # a bf16 model gets bf16 back


class _DecodeAttention:
    """Writes the step's K/V into each row's completion KV (position `step`) and attends to the
    shared prompt KV plus the row's own keys. Every per-step input is a tensor, so a CUDA graph can
    replay it; `own_len` (keys attended per row) is all Tc slots, masked, under a graph, and the
    step + 1 written ones in eager mode."""

    def __init__(self, views: tuple[list[Tensor], ...], step: Tensor, completion_len: int):
        self.prefix_k, self.prefix_v, self.own_k, self.own_v = views
        self.step = step  # (1,) long: the completion index of the token being fed
        self.own_len = completion_len
        self.key_positions = torch.arange(completion_len, device=step.device)
        self.fused = step.device.type == "cpu" and _CPU_FLASH is not None
        self.layout: _Layout | None = None
        self.row_pos: Tensor | None = None  # (N,) each row's own index, once rows differ (tools)

    def set_layout(self, layout: _Layout, prompt_lens: Tensor, filled: int = 0) -> None:
        """Switch to a new layout; move the surviving prompts' KV to the front of the prompt views
        and the surviving rows' `filled` completion KV positions to their new slots (via
        temporaries: they overlap)."""
        device = self.step.device
        old = self.layout
        Bp = len(layout.groups)
        P = layout.prompt_len
        if old is not None:
            group_of = {p: i for i, p in enumerate(old.groups)}
            slot_of = dict(zip(old.rows, old.slots))
            old_groups = torch.tensor([group_of[p] for p in layout.groups], device=device)
            old_slots = torch.tensor([slot_of[r] for r in layout.rows], device=device)
            new_slots = torch.tensor(layout.slots, device=device)
            for x in self.prefix_k + self.prefix_v:
                x[:Bp, :, :P] = x[:len(old.groups), :, :P].index_select(0, old_groups)
            for x in self.own_k + self.own_v:
                old_part = x[:len(old.groups) * old.group_size, :, :filled]
                moved = old_part.index_select(0, old_slots)
                x[:Bp * layout.group_size, :, :filled].index_copy_(0, new_slots, moved)
        self.layout = layout
        self.num_slots = Bp * layout.group_size
        identity = layout.slots == list(range(self.num_slots))  # no empty slots: no scatter/gather
        self.slots = None if identity else torch.tensor(layout.slots, device=device)
        lens = prompt_lens[layout.groups]  # (Bp',) longest first: generate() sorts the prompts
        lens_list = lens.tolist()
        self.buckets = length_buckets(lens_list)
        self.prefix_valid = torch.arange(P, device=device) < lens[:, None]
        self.prefix_bias = None  # no padding: the fused kernel skips its mask
        if not self.prefix_valid.all():
            dtype = self.prefix_k[0].dtype
            zeros = torch.zeros(self.prefix_valid.shape, dtype=dtype, device=device)
            self.prefix_bias = zeros.masked_fill(~self.prefix_valid, float("-inf"))[:, None, None]
        # Each bucket's slice of the mask, or None where its prompts fill all its keys.
        self.bucket_bias = [None if self.prefix_bias is None or min(lens_list[first:stop]) == keys
                            else self.prefix_bias[first:stop, ..., :keys]
                            for first, stop, keys in self.buckets]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.slots is not None:  # scatter the N rows into the grid; empty slots get zeros
            q, k, v = (x.new_zeros((self.num_slots,) + x.shape[1:]).index_copy_(0, self.slots, x)
                       for x in (q, k, v))  # (S, H or Hkv, 1, D)
        own_k = self.own_k[layer][:self.num_slots]
        own_v = self.own_v[layer][:self.num_slots]
        Bp = len(self.layout.groups)
        P = self.layout.prompt_len
        prefix_k = self.prefix_k[layer][:Bp, :, :P]
        prefix_v = self.prefix_v[layer][:Bp, :, :P]
        if self.row_pos is not None:  # rows at their own lengths (a tool turn moved some on)
            pos = self.row_pos if self.slots is None else self.row_pos.new_zeros(
                self.num_slots).index_copy_(0, self.slots, self.row_pos)  # (S,)
            every = torch.arange(self.num_slots, device=q.device)
            own_k[every, :, pos] = k[:, :, 0].to(own_k.dtype)  # each slot at its own index
            own_v[every, :, pos] = v[:, :, 0].to(own_v.dtype)
            own_allowed = self.key_positions[:self.own_len] <= pos[:, None, None]  # (S, 1, Tc)
            y = prefix_attention(q, own_k[:, :, :self.own_len], own_v[:, :, :self.own_len],
                                 own_allowed, prefix_k, prefix_v, self.prefix_valid)
            return self._gather(y)
        if self.fused and q.dtype == own_k.dtype:
            # Eager CPU: write at a Python index, attend to the written keys only, and to each
            # bucket's prompt keys only (a short prompt's padding is not read).
            t = self.own_len - 1
            own_k[:, :, t:t + 1] = k
            own_v[:, :, t:t + 1] = v
            G = self.layout.group_size
            parts = []
            for (first, stop, keys), bias in zip(self.buckets, self.bucket_bias):
                slots = slice(first * G, stop * G)
                parts.append(_fused_prefix_attention(
                    q[slots], own_k[slots, :, :t + 1], own_v[slots, :, :t + 1],
                    prefix_k[first:stop, :, :keys], prefix_v[first:stop, :, :keys], bias))
            return self._gather(torch.cat(parts) if len(parts) > 1 else parts[0])
        own_k.index_copy_(2, self.step, k.to(own_k.dtype))  # a tensor index: a graph replays it
        own_v.index_copy_(2, self.step, v.to(own_v.dtype))
        own_k = own_k[:, :, :self.own_len]  # (S, Hkv, Tc or t+1, D)
        own_v = own_v[:, :, :self.own_len]
        own_allowed = (self.key_positions[:self.own_len] <= self.step)[None, None]  # (1, 1, Tc)
        y = prefix_attention(q, own_k, own_v, own_allowed, prefix_k, prefix_v, self.prefix_valid)
        return self._gather(y)

    def _gather(self, y: Tensor) -> Tensor:
        if self.slots is None:
            return y
        return y.index_select(0, self.slots)  # (S, H, 1, D) -> (N, H, 1, D)


class _GraphedStep:
    """A CUDA graph of `step(tokens) -> logits` for one layout: warm up on a side stream, capture,
    replay. Replaying a step that already ran is harmless: it rewrites the same K/V."""

    def __init__(self, step: Callable[[Tensor], Tensor], tokens: Tensor):
        self.tokens = tokens.clone()
        stream = torch.cuda.Stream()
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


class _Decoder:
    """The decode step over the active rows, and the dropping of finished ones. It owns the state
    the steps share: which rows are active (`rows`, global ids), the attention's layout, each row's
    first position, and the CUDA graph of the current layout."""

    def __init__(self, model: torch.nn.Module, views: tuple[list[Tensor], ...],
                 prompt_lens: list[int], G: int, graphed: bool):
        device = views[0][0].device
        self.model = model
        self.prompt_lens = prompt_lens
        self.G = G
        self.lens = torch.tensor(prompt_lens, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        completion_len = views[2][0].shape[2]
        self.attention = _DecodeAttention(views, self.step_index, completion_len)
        self.layout = _Layout.of(list(range(len(prompt_lens) * G)), G, prompt_lens)
        self.attention.set_layout(self.layout, self.lens)
        self.rows = torch.arange(len(prompt_lens) * G, device=device)  # (N,)
        self.first_position = self.lens[self.rows // G][:, None]  # (N, 1)
        self.graphed = graphed
        self.graph: _GraphedStep | None = None

    def forward(self, tokens: Tensor) -> Tensor:
        """(N, 1) -> (N, V); every other input is a tensor held here or by the attention."""
        row_pos = self.attention.row_pos  # (N,) or None: every row at step_index
        index = self.step_index if row_pos is None else row_pos[:, None]
        positions = self.first_position + index  # completion token t sits at len + t
        return self.model.head(self.model.hidden(tokens, positions, self.attention)[:, -1])

    def step(self, tokens: Tensor, t: int | list[int]) -> Tensor:
        """Feed completion token t of each active row, tokens (N,) -> logits (N, V); t a list:
        each row's own index (rows at different lengths: episodes.py), in eager mode."""
        if isinstance(t, list):
            self.attention.row_pos = torch.tensor(t, device=tokens.device)  # (N,)
            self.attention.own_len = max(t) + 1
            return self.forward(tokens[:, None])
        self.step_index.fill_(t)
        if self.graphed:
            if self.graph is None:
                self.graph = _GraphedStep(self.forward, tokens[:, None])
            return self.graph(tokens[:, None])
        self.attention.own_len = t + 1  # eager: attend only to the keys written so far
        return self.forward(tokens[:, None])

    def drop(self, keep: list[int], filled: int) -> None:
        """Keep the active rows at positions `keep`; `filled` completion KV slots are written."""
        rows = [self.layout.rows[i] for i in keep]
        self.layout = _Layout.of(rows, self.G, self.prompt_lens)
        self.attention.set_layout(self.layout, self.lens, filled=filled)
        self.rows = self.rows[torch.tensor(keep, device=self.rows.device)]  # (N',)
        self.first_position = self.lens[self.rows // self.G][:, None]  # (N', 1)
        self.graph = None  # addresses and shapes changed: capture again

    def extend(self, picks: list[int], feeds: list[list[int]], starts: list[int]) -> Tensor:
        """Feed active row picks[i] the tokens feeds[i] at its completion indices starts[i]...
        (a tool's observation after the token that called it) in one forward: their K/V go into
        the row's own cache, no earlier token is recomputed. Returns the logits (k, V) after each
        row's last fed token."""
        device = self.rows.device
        width = max(map(len, feeds))
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=device)  # (k, M)
        start = torch.tensor(starts, device=device)[:, None]  # (k, 1)
        rows = self.rows[torch.tensor(picks, device=device)]  # (k,) global ids
        positions = self.lens[rows // self.G][:, None] + start + torch.arange(width, device=device)
        attention = _ExtendAttention(self.attention, picks, [len(f) for f in feeds], start, self.G)
        last = torch.tensor([len(f) - 1 for f in feeds], device=device)
        return self.model.head(self.model.hidden(tokens, positions, attention, last)[:, 0])

    def plain_linears(self) -> None:
        """F.linear from here on (episodes.py, after the first tool turn): rows at their own
        lengths come in new counts and shapes at every check, and _packed_linears' oneDNN keeps a
        primitive for each (a tasks:lookup run grew by 0.5 GB in 100 steps). Undone with the
        rest at the end of generate."""
        for m in self.model.modules():
            m.__dict__.pop("forward", None)


class _ExtendAttention:
    """Attention for Decoder.extend: k rows, each its own group of one (prefix_attention with
    G = 1), against its prompt's K/V and its own keys up to each new token; the new tokens' K/V are
    written into the row's own cache first. The prompt and own K/V of the k rows are gathered (a
    copy of k rows, not of the batch)."""

    def __init__(self, decode: _DecodeAttention, picks: list[int], counts: list[int],
                 start: Tensor, G: int):
        layout = decode.layout
        group_of = {p: i for i, p in enumerate(layout.groups)}
        self.decode = decode
        self.counts = counts
        self.starts = start[:, 0].tolist()
        self.start = start  # (k, 1)
        self.slots = [layout.slots[i] for i in picks]
        device = start.device
        self.slot_t = torch.tensor(self.slots, device=device)
        self.group_t = torch.tensor([group_of[layout.rows[i] // G] for i in picks], device=device)
        self.keys = max(a + n for a, n in zip(self.starts, counts))  # own keys any row reaches

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                 last: Tensor | None = None) -> Tensor:
        d = self.decode
        own_k, own_v = d.own_k[layer], d.own_v[layer]
        for i, (slot, first, n) in enumerate(zip(self.slots, self.starts, self.counts)):
            own_k[slot, :, first:first + n] = k[i, :, :n].to(own_k.dtype)
            own_v[slot, :, first:first + n] = v[i, :, :n].to(own_v.dtype)
        P = d.layout.prompt_len
        prefix_k = d.prefix_k[layer][self.group_t, :, :P]  # (k, Hkv, P, D)
        prefix_v = d.prefix_v[layer][self.group_t, :, :P]
        index = self.start + torch.arange(q.shape[2], device=q.device)  # (k, Tq) own indices
        if last is not None:
            index = self.start + last[:, None]  # (k, 1): the last fed token's queries alone
        keys = torch.arange(self.keys, device=q.device)
        own_allowed = keys <= index[:, :, None]  # (k, Tq, keys)
        return prefix_attention(q, own_k[self.slot_t, :, :self.keys],
                                own_v[self.slot_t, :, :self.keys], own_allowed, prefix_k,
                                prefix_v, d.prefix_valid[self.group_t])

# -----------------------------------------------------------------------------
# generate


_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_PACK = _PACK if torch.backends.mkldnn.is_available() else None


@contextlib.contextmanager
def _packed_linears(model: torch.nn.Module, rows: int, enabled: bool):
    """Meanwhile each float32 nn.Linear of a CPU model runs through oneDNN on its weight reordered
    once (for `rows` rows) into the kernel's blocked layout; F.linear (MKL) packs it on every call,
    a large share of the matmul at decode's 128 rows. The cost: a second copy of the linear weights
    while it runs. Outputs equal F.linear's up to summation order (tests/test_rollout.py)."""
    linears = [m for m in model.modules() if enabled and _PACK is not None and type(m) is nn.Linear
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    try:
        for m in linears:  # an instance attribute shadows the class's forward
            m.forward = functools.partial(torch.ops.mkldnn._linear_pointwise, B=m.bias, attr="none",
                                          W=_PACK(m.weight.detach(), rows), scalars=[],
                                          algorithm="")  # (..., in) -> (..., out)
        yield
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)


def check_prompts(prompts: list[list[int]], stop_ids: tuple[int, ...], max_new_tokens: int,
                  model_config: ModelConfig) -> None:
    """One clear error for a prompt or stop id the model cannot take."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    vocab = model_config.vocab_size
    named = [(f"prompts[{i}]", p) for i, p in enumerate(prompts)] + [("stop_ids", stop_ids)]
    for name, ids in named:
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]!r} outside the vocabulary [0, {vocab})")
        if name == "stop_ids":
            continue
        if len(ids) == 0:
            raise ValueError(f"{name} is empty: every prompt needs at least one token")
        if len(ids) + max_new_tokens > model_config.max_position_embeddings:
            raise ValueError(f"{name} has {len(ids)} tokens + max_new_tokens={max_new_tokens} > "
                             f"the model's max_position_embeddings="
                             f"{model_config.max_position_embeddings}")


def prefill_chunks(lens: list[int], prefill_tokens: int) -> list[tuple[int, int]]:
    """(first, stop) runs of the prompts (longest first: generate sorts them), each up to
    prefill_tokens padded tokens at its first prompt's length, none under half of it (as
    length_buckets): a chunk holds like lengths and pads little."""
    chunks = []
    first = 0
    while first < len(lens):
        stop = first + 1
        while (stop < len(lens) and (stop - first + 1) * lens[first] <= prefill_tokens
               and 2 * lens[stop] >= lens[first]):
            stop += 1
        chunks.append((first, stop))
        first = stop
    return chunks


def _prefill(model: torch.nn.Module, prompts: list[list[int]], prefix_k: list[Tensor],
             prefix_v: list[Tensor], prefill_tokens: int, device: torch.device) -> Tensor:
    """Run the prompts a chunk at a time (prefill_chunks), right-padded to the chunk's longest (the
    views beyond stay zero, masked), storing each layer's K/V into the shared prompt views. Returns
    the logits (Bp, V) at each prompt's last position."""
    last_logits = []
    for first, stop in prefill_chunks([len(p) for p in prompts], prefill_tokens):
        part = prompts[first:stop]
        width = max(map(len, part))
        rows = slice(first, first + len(part))

        def store_kv(layer: int, q: Tensor, k: Tensor, v: Tensor, last: Tensor | None = None):
            # k, v (b, Hkv, width or more, D): sequence parallelism may pad the rows' ends
            prefix_k[layer][rows, :, :width] = k[:, :, :width]
            prefix_v[layer][rows, :, :width] = v[:, :, :width]
            return causal_attention(layer, q, k, v, last)
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in part], device=device)  # (b, P)
        last = torch.tensor([len(p) - 1 for p in part], device=device)  # final layer's queries
        h = model.hidden(tokens, None, store_kv, last)[:, 0]  # (b, C)
        last_logits.append(model.head(h))  # (b, V)
    return torch.cat(last_logits)  # (Bp, V)


def _cut_at_stop(tokens: Tensor, logprobs: Tensor, stop_ids: tuple[int, ...]) -> tuple[Tensor, ...]:
    """Each row ends at its first stop id (rows decode on until the next check): tokens, logprobs
    (R, T) -> tokens (R, Tc) with 0 after the end, mask, logprobs with 0 after the end, and
    stopped (R,); Tc is the longest row. One host sync (Tc)."""
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=tokens.device)
    is_stop = torch.isin(tokens, stop_t)  # (R, T)
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0  # strictly after the first stop
    mask = ~after_stop & (tokens >= 0)  # -1: never sampled (the row was dropped or all had stopped)
    Tc = int(mask.sum(1).max())
    mask = mask[:, :Tc]
    tokens = tokens[:, :Tc].masked_fill(~mask, 0)
    logprobs = logprobs[:, :Tc].masked_fill(~mask, 0.0)
    return tokens, mask, logprobs, (is_stop & ~after_stop).any(1)


def _carve(model: torch.nn.Module, cache: KVCache | None, num_prompts: int, G: int, P: int,
           new: int) -> tuple[list[Tensor], ...]:
    """The KV views of this call (a private cache when none is given: bf16 on the GPU, the model's
    dtype on the CPU). The kv heads are read off the weights: a tensor-parallel shard has Hkv/tp."""
    attn0 = model.model.layers[0].self_attn
    weight = attn0.k_proj.weight
    kv_heads = weight.shape[0] // attn0.head_dim
    shape = (model.config.num_hidden_layers, kv_heads, attn0.head_dim, num_prompts, G, P)
    if cache is None:
        kv_dtype = torch.bfloat16 if weight.is_cuda else weight.dtype
        cache = KVCache(KVCache.numel_for(*shape, new), kv_dtype, weight.device)
    return cache.carve(*shape, new)


@torch.inference_mode()
def generate(model: torch.nn.Module, prompts: list[list[int]], cfg: RolloutConfig | None = None,
             *, stop_ids: tuple[int, ...] = (), seed: int | None = None,
             cache: KVCache | None = None,
             logits_fn: Callable[[Tensor], Tensor] | None = None,
             episodes: Episodes | None = None) -> Rollout:
    """Sample cfg.num_samples completions of each prompt (the module docstring's steps 1-6).
    `cache` None allocates one for this call; seed None draws a fresh one (the global RNG is left
    alone). `logits_fn` maps every (rows, V') logits tensor before sampling (under tensor
    parallelism the all-gather of the vocab shards: every rank sees the same logits and, with the
    same seed, samples the same tokens). `episodes`: rows are multi-turn episodes with a tool
    (episodes.py); its respond() gets the caller's row ids."""
    started = time.perf_counter()
    cfg = cfg or RolloutConfig()
    stop_ids = tuple(stop_ids)
    check_prompts(prompts, stop_ids, cfg.max_new_tokens, model.config)
    logits_fn = logits_fn or (lambda x: x)
    G = cfg.num_samples
    new = cfg.max_new_tokens
    # Longest prompt first (a stable sort: equal lengths keep their order): prefill chunks and
    # decode's attention buckets then hold like lengths. Rows go back to the caller's order at 6.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    prompts = [prompts[i] for i in order]
    lens = [len(p) for p in prompts]
    device = next(model.parameters()).device
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    def draw(logits: Tensor) -> tuple[Tensor, Tensor]:  # (rows, V') -> tokens, logprobs (rows,)
        return sample(logits_fn(logits), cfg.temperature, cfg.top_k, cfg.top_p, generator)
    out_tokens = torch.full((new, len(prompts) * G), -1, dtype=torch.long, device=device)  # (Tc, R)
    out_logprobs = torch.zeros(out_tokens.shape, dtype=torch.float32, device=device)
    policy = torch.ones(out_tokens.shape, dtype=torch.bool, device=device)  # False: observations
    stats = dict(prefill_tokens=sum(lens), prefill_seconds=0.0, decode_steps=0, row_steps=0,
                 compactions=0, prompt_kv_bytes=0, completion_kv_bytes=0)
    if new > 0:
        with _packed_linears(model, len(prompts) * G, cfg.packed_linears):
            views = _carve(model, cache, len(prompts), G, max(lens), new)
            # 1. Prefill each prompt once.
            logits = _prefill(model, prompts, views[0], views[1], cfg.prefill_tokens, device)
            if device.type == "cuda":
                torch.cuda.synchronize()  # one sync so that prefill_seconds means something
            stats["prefill_seconds"] = time.perf_counter() - started
            # 2. Fan out: each of the G rows of a prompt draws its own first token (logits_fn once
            # per prompt, then repeated).
            first = logits_fn(logits).repeat_interleave(G, dim=0)  # (R, V')
            out_tokens[0], out_logprobs[0] = sample(first, cfg.temperature, cfg.top_k, cfg.top_p,
                                                    generator)
            # 3-4. Decode, dropping finished rows.
            decoder = _Decoder(model, views, lens, G, device.type == "cuda" and cfg.cuda_graphs)
            if episodes is None:
                stats.update(_decode(decoder, out_tokens, out_logprobs, draw, stop_ids,
                                     cfg.check_every))
            else:  # multi-turn rows: each at its own length (episodes.py)
                def respond(calls):  # the decoder's (sorted) row ids -> the caller's
                    return episodes.respond([(order[r // G] * G + r % G, t) for r, t in calls])
                stats.update(decode_episodes(decoder, out_tokens, out_logprobs, policy, draw,
                                             stop_ids, cfg.check_every,
                                             dataclasses.replace(episodes, respond=respond),
                                             model.config.vocab_size))
        nbytes = [sum(x.numel() * x.element_size() for x in kind) for kind in views]
        stats.update(prompt_kv_bytes=sum(nbytes[:2]), completion_kv_bytes=sum(nbytes[2:]))
    # 6. Cut each row at its stop id, rows in the caller's prompt order; it stays on the device.
    rank = sorted(range(len(order)), key=order.__getitem__)  # each prompt's place in the sort
    rows = torch.tensor([rank[i // G] * G + i % G for i in range(len(order) * G)], device=device)
    if episodes is None:
        tokens, mask, logprobs, stopped = _cut_at_stop(out_tokens.T[rows], out_logprobs.T[rows],
                                                       stop_ids)
        sampled = None
    else:  # each row's length and end as the episode loop left them
        lengths = torch.tensor(stats.pop("lengths", [0] * len(rows)), device=device)[rows]
        Tc = int(lengths.max()) if new else 0
        mask = torch.arange(Tc, device=device) < lengths[:, None]  # (R, Tc)
        tokens = out_tokens.T[rows, :Tc].masked_fill(~mask, 0)
        sampled = policy.T[rows, :Tc] & mask
        logprobs = out_logprobs.T[rows, :Tc].masked_fill(~sampled, 0.0)
        stopped = torch.tensor(stats.pop("stopped", [False] * len(rows)), device=device)[rows]
        stats["calls"] = torch.tensor(stats.pop("calls", [0] * len(rows)))[rows.cpu()].tolist()
    stats.update(new_tokens=int(mask.sum()), seconds=time.perf_counter() - started)
    with torch.inference_mode(False):  # normal tensors: training may index with them (autograd)
        tokens, mask, logprobs, stopped = (t.clone() for t in (tokens, mask, logprobs, stopped))
        sampled = None if sampled is None else sampled.clone()
    return Rollout(tokens, mask, logprobs, stopped, cfg.temperature, stats, sampled)


def _decode(decoder: _Decoder, out_tokens: Tensor, out_logprobs: Tensor,
            draw: Callable[[Tensor], tuple[Tensor, Tensor]], stop_ids: tuple[int, ...],
            check_every: int) -> dict:
    """Feed completion token t and sample token t + 1 for every active row until every row has
    stopped or the budget is spent; out_tokens/out_logprobs (Tc, R) are filled in place."""
    new = out_tokens.shape[0]
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=out_tokens.device)
    tokens = out_tokens[0]  # (N,)
    finished = torch.isin(tokens, stop_t)  # (N,)
    decode_steps = row_steps = compactions = 0
    for t in range(new - 1):
        logits = decoder.step(tokens, t)  # (N, V)
        tokens, logprobs = draw(logits)  # (N,)
        out_tokens[t + 1].index_copy_(0, decoder.rows, tokens)
        out_logprobs[t + 1].index_copy_(0, decoder.rows, logprobs)
        decode_steps += 1
        row_steps += len(decoder.layout.rows)
        if not stop_ids:
            continue
        finished |= torch.isin(tokens, stop_t)
        if (t + 2) % check_every or t + 2 == new:
            continue
        # The occasional host sync: drop finished rows. A graph re-capture costs about a step, so
        # on the GPU rows are dropped only once at least 1/8 of them are finished.
        keep = (~finished).nonzero()[:, 0].tolist()
        if not keep:
            break
        active = len(decoder.layout.rows)
        if len(keep) == active or (decoder.graphed and len(keep) > active * 7 // 8):
            continue
        decoder.drop(keep, filled=t + 1)
        compactions += 1
        keep_t = torch.tensor(keep, device=tokens.device)
        tokens = tokens[keep_t]
        finished = finished[keep_t]
    return dict(decode_steps=decode_steps, row_steps=row_steps, compactions=compactions)


# -----------------------------------------------------------------------------
# Weight sync: the sampler receives the trainer's weights


def sampler_for(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The trainer itself when it is in the sampler's dtype, else a frozen copy in that dtype (a
    bf16 sampler of an fp32 master: --dtype bfloat16, or --sampler_dtype), synced before each
    rollout."""
    if dtype == next(model.parameters()).dtype:
        return model
    return copy.deepcopy(model).to(dtype).requires_grad_(False)


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
