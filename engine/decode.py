"""
The decode step of the sampler: the KV cache, attention to a prompt shared by a group of rows plus
each row's own keys, the rows that leave, and (for a tool's answer) a row extended in place.

- KVCache: one flat preallocated buffer (memory.py frees and re-creates it whole), carved per call
  into the shared prompt K/V (Bp, Hkv, P, D) and each row's completion K/V (R, Hkv, Tc, D).
- DecodeAttention: each row writes its key at its own completion index and attends to its group's
  prompt keys plus its own (shared-prompt attention, engine/attention.py: the prompt part, the G rows of
  a group folded against the one prompt K/V, and the own part, merged by log-sum-exp). Active rows
  sit in a grid of Bp' groups x G' slots (Layout). On the CPU, groups run in buckets of like
  prompt lengths through SDPA's fused kernel (shared_prompt_attention_decode_cpu); on CUDA the
  step is a CUDA graph per layout (compiling.GraphedStep), and in bf16 both parts run in SDPA's
  memory-efficient kernel, which reads the bf16 cache as it is
  (shared_prompt_attention_decode_cuda: no float32 copy of the KV, float32 accumulation inside
  the kernel). Float32 elsewhere: attention.shared_prompt_attention, the plain ops.
- Decoder: the step over the active rows (model.hidden with the attention hook), each row's
  completion index (one for all in lockstep, each row's own after a tool turn), the dropping of
  finished ones, and extend(): a tool's observation prefilled into a row's own cache at its
  position (ExtendAttention), rows then at their own lengths (engine/episodes.py). On the kernel route
  (bf16 / fp16 on CUDA) the step is compiled by torch.compile (compiling.CompiledStep: norms, RoPE,
  the cache writes, residual adds, SwiGLU's product and the merge fused; counted on the CPU, 15
  launches a layer where the eager step runs 45: tests/bench_rollout.py --kernels), then captured
  per layout as above; float32 stays the plain exact eager step.

Leaves out: sampling (engine/sampling.py), the prefill and the loop (rollout.py), which rows end and
what a tool answers (engine/episodes.py), compiling and capturing a step (engine/compiling.py).
Shapes: Bp prompts, G samples per prompt, R = Bp*G rows, N active rows, S = Bp'*G' slots of the
grid, P longest prompt, Tc completion length, H/Hkv heads, D head dim, V vocab.
Tested by tests/test_rollout.py, tests/test_episodes.py and tests/test_graphs.py (the compiled
step).
"""

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from engine.attention import length_buckets, padding_bias, shared_prompt_attention
from engine.compiling import CompiledStep, GraphedStep, dynamic
from model import ModelConfig

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
class Layout:
    """Where the N active rows sit. Shared-prompt attention wants G' query rows per group; once
    rows finish, groups hold different counts, so attention sees the rows scattered into a grid of
    Bp' groups x G' slots (G' = the largest count); empty slots compute garbage that nobody
    reads."""
    rows: list[int]          # global row id (prompt * G + sample) of each active row, ascending
    groups: list[int]        # the prompt of each of the Bp' groups
    group_size: int          # G'
    slots: list[int]         # slot of each active row in the grid
    prompt_len: int          # longest prompt among the groups

    @classmethod
    def of(cls, rows: list[int], G: int, prompt_lens: list[int]) -> "Layout":
        counts = Counter(r // G for r in rows)  # in order of first appearance: prompt-major rows
        group_size = max(counts.values())
        slots = [i * group_size + j for i, n in enumerate(counts.values()) for j in range(n)]
        prompt_len = max(prompt_lens[p] for p in counts)
        return cls(rows, list(counts), group_size, slots, prompt_len)


def to_grid(x: Tensor, slots: Tensor, num_slots: int, fill: int = 0) -> Tensor:
    """(N, ...) active rows -> (S, ...) the grid: row i at slots[i], `fill` in the empty slots.
    Its inverse is x.index_select(0, slots)."""
    return x.new_full((num_slots, *x.shape[1:]), fill).index_copy_(0, slots, x)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cpu_flash(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """SDPA's fused CPU kernel with its log-sum-exp, in efficient_attention's contract."""
    return _CPU_FLASH(q, k, v, attn_mask=bias)


def prompt_part(q: Tensor, prompt_k: Tensor, prompt_v: Tensor, prompt_bias: Tensor | None,
                attend: Callable) -> tuple[Tensor, Tensor]:
    """The prompt's share of one decode step's attention, in one call of a fused kernel that returns
    its log-sum-exp, attend(q, k, v, bias) -> (out, lse) (cpu_flash, efficient_attention): the G
    rows of a group and the rep query heads of a kv head share the prompt's keys, so they are
    folded into the query length against its (Bp, Hkv, P, D). q (S, H, 1, D) -> out (Bp, G, Hkv,
    rep, D) in the kernel's dtype, lse (Bp, G, Hkv, rep) float32: the rows' order (S = Bp*G,
    H = Hkv*rep) as strided views, not copied back: the merge's elementwise ops read them so."""
    S, H, _, D = q.shape
    Bp, Hkv = prompt_k.shape[:2]
    G, rep = S // Bp, H // Hkv
    qp = q.reshape(Bp, G, Hkv, rep, D).transpose(1, 2).reshape(Bp, Hkv, G * rep, D)  # a copy
    out, lse = attend(qp, prompt_k, prompt_v, prompt_bias)  # (Bp, Hkv, G*rep, D | -)
    return out.view(Bp, Hkv, G, rep, D).transpose(1, 2), lse.view(Bp, Hkv, G, rep).transpose(1, 2)


def shared_prompt_attention_decode_cpu(q: Tensor, k: Tensor, v: Tensor, prompt_k: Tensor,
                                       prompt_v: Tensor, prompt_bias: Tensor | None) -> Tensor:
    """Shared-prompt attention for one token per row, all of k/v allowed, on the CPU, in few
    kernels (per-op overhead and memory latency, not FLOPs, are what cost here). The prompt part
    goes through SDPA's fused kernel, which also returns its log-sum-exp lse_p. The own part merges
    it as one more key: softmax over [own scores, lse_p] weighs the prompt part's output exactly as
    the log-sum-exp merge does, and sums to 1 with the own keys.
    q (S, H, 1, D), k/v (S, Hkv, T, D) views of the cache, prompt_bias (Bp, 1, 1, P) 0 / -inf, or
    None: no padding."""
    S, H, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    rep = H // Hkv
    out_p, lse_p = prompt_part(q, prompt_k, prompt_v, prompt_bias, cpu_flash)  # (Bp,G,Hkv,rep,.)
    grid = out_p.shape[:-1]  # (Bp, G, Hkv, rep): the rows' and heads' order
    dt = torch.promote_types(q.dtype, torch.float32)  # bf16 accumulates in float32
    # The own part: GQA by folding the rep heads into the queries (2 bmm; SDPA is 2x slower).
    qo = q.reshape(S * Hkv, rep, D).to(dt) * D ** -0.5
    own_k = k.reshape(S * Hkv, T, D).to(dt)
    own_v = v.reshape(S * Hkv, T, D).to(dt)
    scores = torch.bmm(qo, own_k.transpose(1, 2)).view(*grid, T)
    probs = torch.cat((scores, lse_p[..., None]), dim=-1).softmax(dim=-1)  # (Bp, G, Hkv, rep, T+1)
    # probs first: its layout (the rows' order) is the product's, and bf16 * float32 is float32
    y = torch.baddbmm((probs[..., T:] * out_p).view(S * Hkv, rep, D),
                      probs[..., :T].reshape(S * Hkv, rep, T), own_v)  # (S*Hkv, rep, D)
    return y.view(S, H, 1, D).to(q.dtype)  # a bf16 model gets bf16 back


_EFFICIENT = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)


def efficient_attention(q: Tensor, k: Tensor, v: Tensor,
                        bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """SDPA's memory-efficient CUDA kernel with its log-sum-exp: q (B, Hkv, M, D), k/v
    (B, Hkv, S, D) of one dtype, bias (B or 1, 1, 1, S) 0 / -inf in it or None -> out
    (B, Hkv, M, D), lse (B, Hkv, M) float32. The kernel wants each bias row at a 16-element
    aligned stride (DecodeAttention.set_layout allocates it so) and pads its lse to a multiple of
    32 queries."""
    B, H, M, _ = q.shape
    if bias is not None:
        bias = bias.expand(B, H, M, k.shape[2])  # stride 0 over heads and queries
    out, lse = _EFFICIENT(q, k, v, bias, True)[:2]
    return out, lse[..., :M]


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> Callable | None:
    """The fused kernel DecodeAttention's step runs both parts through, or None:
    attention.shared_prompt_attention in plain float32 ops. SDPA's memory-efficient kernel on CUDA
    in bf16 / fp16, for head dims it takes (multiples of 8); float32 keeps the plain ops (the
    engine's exact path: the logits equal transformers')."""
    half = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda" and half and head_dim % 8 == 0 and _EFFICIENT:
        return efficient_attention
    return None


def shared_prompt_attention_decode_cuda(q: Tensor, k: Tensor, v: Tensor, own_bias: Tensor | None,
                                        prompt_k: Tensor, prompt_v: Tensor,
                                        prompt_bias: Tensor | None, attend: Callable) -> Tensor:
    """Shared-prompt attention for one token per row, each part in one call of a fused kernel that
    returns its log-sum-exp, attend(q, k, v, bias) -> (out, lse) (kernel_for: CUDA's, in bf16): the
    prompt part (prompt_part), then the own part, the rep heads of a row against its own keys; the
    kernel reads the K/V in
    their dtype and accumulates in float32, and only the two partial outputs (S, H, D) are merged
    in float32, by their log-sum-exp. q (S, H, 1, D), k/v (S, Hkv, T, D) the rows' own keys,
    own_bias (1, 1, 1, T) 0 / -inf or None, prompt_k/v (Bp, Hkv, P, D), prompt_bias (Bp, 1, 1, P)
    or None."""
    S, H, _, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    # The cache views' Hkv and D are the model's: under torch.compile static (compiling.dynamic
    # marks only their rows and lengths), so this costs nothing there.
    assert prompt_k.shape[1::2] == prompt_v.shape[1::2] == v.shape[1::2] == (Hkv, D)
    out_p, lse_p = prompt_part(q, prompt_k, prompt_v, prompt_bias, attend)  # (Bp,G,Hkv,rep,.)
    grid = out_p.shape[:-1]  # (Bp, G, Hkv, rep): the rows' and heads' order
    out_o, lse_o = attend(q.reshape(S, Hkv, rep, D), k, v, own_bias)  # (S, Hkv, rep, D | -)
    # The prompt part's weight exp(lse_p) / (exp(lse_p) + exp(lse_o)) is a sigmoid of the
    # difference: 5 small kernels for the merge where a logaddexp, two exps and the cast took 9.
    share = (lse_p - lse_o.view(grid)).sigmoid_()[..., None]  # (Bp, G, Hkv, rep, 1) float32
    # Computed in float32 and written once, rounded, into a (S, H, 1, D) tensor of q's dtype: the
    # kernel's outputs come in its own strided layouts (out_o (S, rep, Hkv, D) in memory on CUDA).
    own = out_o.view(*grid, D) * (1 - share)
    if torch.compiler.is_compiling():
        # torch.compile cannot trace an out= into a view of y when the result takes out_o's
        # strides (it views the result back as y and fails); inductor fuses this form into one
        # kernel anyway.
        return torch.addcmul(own, out_p, share).to(q.dtype).reshape(S, H, 1, D)
    y = q.new_empty(S, H, 1, D)
    torch.addcmul(own, out_p, share, out=y.view(*grid, D))
    return y


class DecodeAttention:
    """Writes the step's K/V into each row's completion KV (position `step`) and attends to the
    shared prompt KV plus the row's own keys. Every per-step input is a tensor, so a CUDA graph can
    replay it; `own_len` (keys attended per row) is None under a graph or a compile (all Tc slots,
    masked: no Python number a compiled step would guard on), and the step + 1 written ones in
    eager mode. The dims that vary with the batch and the layout are marked for a compiled step
    (compiling.dynamic): the rows, groups, slots, prompt and completion lengths, never the model's."""

    def __init__(self, views: tuple[list[Tensor], ...], step: Tensor, completion_len: int):
        self.prompt_k, self.prompt_v, self.own_k, self.own_v = views
        self.step = step  # (1,) long: the completion index of the token being fed
        self.own_len: int | None = None
        self.key_positions = torch.arange(completion_len, device=step.device)
        self.kernel = kernel_for(step.device, self.own_k[0].dtype, self.own_k[0].shape[-1])
        self.fused = self.kernel is None and step.device.type == "cpu" and _CPU_FLASH is not None
        self.own_bias: Tensor | None = None  # the step's own-key mask, made by layer 0
        self.layout: Layout | None = None
        self.row_pos: Tensor | None = None  # (N,) each row's own index, once rows differ (tools)

    def set_layout(self, layout: Layout, prompt_lens: Tensor, filled: int = 0) -> None:
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
            for x in self.prompt_k + self.prompt_v:
                x[:Bp, :, :P] = x[:len(old.groups), :, :P].index_select(0, old_groups)
            for x in self.own_k + self.own_v:
                old_part = x[:len(old.groups) * old.group_size, :, :filled]
                moved = old_part.index_select(0, old_slots)
                x[:Bp * layout.group_size, :, :filled].index_copy_(0, new_slots, moved)
        self.layout = layout
        self.num_slots = Bp * layout.group_size
        identity = layout.slots == list(range(self.num_slots))  # no empty slots: no scatter/gather
        self.slots = None if identity else torch.tensor(layout.slots, device=device)
        # (S,) the slots that hold a row: S as a tensor's dim, which a compiled step keeps dynamic
        # (the int num_slots would be guarded: a compile per layout)
        self.occupied = torch.zeros(self.num_slots, dtype=torch.bool, device=device)
        self.occupied[layout.slots] = True
        lens = prompt_lens[layout.groups]  # (Bp',) longest first: generate() sorts the prompts
        lens_list = lens.tolist()
        self.buckets = length_buckets(lens_list)
        self.prompt_valid = torch.arange(P, device=device) < lens[:, None]
        self.prompt_bias = None  # no padding: the fused kernel skips its mask
        if not self.prompt_valid.all():  # rows 16-aligned: efficient_attention's kernel wants it
            self.prompt_bias = padding_bias(self.prompt_valid, self.prompt_k[0].dtype, align=16)
        # Each bucket's slice of the mask, or None where its prompts fill all its keys.
        self.bucket_bias = [None if self.prompt_bias is None or min(lens_list[first:stop]) == keys
                            else self.prompt_bias[first:stop, ..., :keys]
                            for first, stop, keys in self.buckets]

    def mark_dynamic(self) -> None:
        """Mark the dims a compiled step keeps dynamic (compiling.dynamic): the cache views' rows and
        lengths (Bp, ., P, .) and (Bp*G, ., Tc, .), this batch's, and the layout's tensors."""
        for x in self.prompt_k + self.prompt_v + self.own_k + self.own_v:
            dynamic(x, 0, 2)
        dynamic(self.key_positions, 0)
        for x, dims in ((self.slots, (0,)), (self.occupied, (0,)), (self.prompt_valid, (0, 1)),
                        (self.prompt_bias, (0, 3))):
            if x is not None:
                dynamic(x, *dims)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        S = self.occupied.shape[0]
        if self.slots is not None:  # scatter the N rows into the grid; empty slots get zeros
            q, k, v = (to_grid(x, self.slots, S) for x in (q, k, v))  # (S, H|Hkv, 1, D)
        own_k = self.own_k[layer][:S]
        own_v = self.own_v[layer][:S]
        # The layout's groups and longest prompt as a tensor's shape: dims a compiled step keeps
        # dynamic (Python ints and list lengths would be guarded: a compile per layout).
        Bp, P = self.prompt_valid.shape
        prompt_k = self.prompt_k[layer][:Bp, :, :P]
        prompt_v = self.prompt_v[layer][:Bp, :, :P]
        if self.row_pos is not None:  # rows at their own lengths (a tool turn moved some on)
            every = torch.arange(S, device=q.device)
            own_k[every, :, self.slot_pos] = k[:, :, 0].to(own_k.dtype)  # each at its own index
            own_v[every, :, self.slot_pos] = v[:, :, 0].to(own_v.dtype)
            y = shared_prompt_attention(q, own_k[:, :, :self.own_len], own_v[:, :, :self.own_len],
                                        self.slot_allowed, prompt_k, prompt_v, self.prompt_valid)
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
                parts.append(shared_prompt_attention_decode_cpu(
                    q[slots], own_k[slots, :, :t + 1], own_v[slots, :, :t + 1],
                    prompt_k[first:stop, :, :keys], prompt_v[first:stop, :, :keys], bias))
            return self._gather(torch.cat(parts) if len(parts) > 1 else parts[0])
        own_k.index_copy_(2, self.step, k.to(own_k.dtype))  # a tensor index: a graph replays it
        own_v.index_copy_(2, self.step, v.to(own_v.dtype))
        own_k = own_k[:, :, :self.own_len]  # (S, Hkv, Tc or t+1, D)
        own_v = own_v[:, :, :self.own_len]
        if self.kernel is not None and q.dtype == own_k.dtype:
            if layer == 0:  # one mask for every layer: 0 up to `step`, -inf after (1, 1, 1, T)
                unwritten = self.key_positions[:self.own_len] > self.step
                bias = torch.zeros(unwritten.shape, dtype=q.dtype, device=q.device)
                self.own_bias = bias.masked_fill_(unwritten, float("-inf"))[None, None, None]
            y = shared_prompt_attention_decode_cuda(q, own_k, own_v, self.own_bias, prompt_k,
                                                    prompt_v, self.prompt_bias, self.kernel)
            return self._gather(y)
        own_allowed = (self.key_positions[:self.own_len] <= self.step)[None, None]  # (1, 1, Tc)
        y = shared_prompt_attention(q, own_k, own_v, own_allowed, prompt_k, prompt_v,
                                    self.prompt_valid)
        return self._gather(y)

    def at_positions(self, row_pos: Tensor, own_len: int) -> None:
        """Rows at their own lengths (after a tool turn, Decoder.seek): active row i writes its
        key at its own index row_pos[i] (N,) and attends to its own keys up to it; own_len =
        max(row_pos) + 1. The grid's positions and own-key mask, once per step for every layer."""
        self.row_pos = row_pos
        self.own_len = own_len
        self.slot_pos = (row_pos if self.slots is None
                         else to_grid(row_pos, self.slots, self.num_slots))  # (S,); empty: 0
        self.slot_allowed = self.key_positions[:own_len] <= self.slot_pos[:, None, None]

    def _gather(self, y: Tensor) -> Tensor:
        if self.slots is None:
            return y
        return y.index_select(0, self.slots)  # (S, H, 1, D) -> (N, H, 1, D)


class Decoder:
    """The decode step over the active rows, and the dropping of finished ones. It owns the state
    the steps share: which rows are active (`rows`, global ids), the attention's layout, each row's
    first position and completion index (`t`, every row's in lockstep; `at`, each row's own after
    a tool turn), the compiled step and the CUDA graph of the current layout. `compiled`: the
    step through torch.compile (compiling.CompiledStep) where the attention takes the kernel route
    (bf16 / fp16 on CUDA); float32 stays the plain exact eager one."""

    def __init__(self, model: torch.nn.Module, views: tuple[list[Tensor], ...],
                 prompt_lens: list[int], G: int, graphed: bool, compiled: bool = False):
        device = views[0][0].device
        self.model = model
        self.prompt_lens = prompt_lens
        self.G = G
        self.lens = torch.tensor(prompt_lens, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        completion_len = views[2][0].shape[2]
        self.attention = DecodeAttention(views, self.step_index, completion_len)
        self.layout = Layout.of(list(range(len(prompt_lens) * G)), G, prompt_lens)
        self.attention.set_layout(self.layout, self.lens)
        self.rows = torch.arange(len(prompt_lens) * G, device=device)  # (N,)
        self.first_position = self.lens[self.rows // G][:, None]  # (N, 1)
        self.lockstep = True  # every active row at one index, t: no tool turn yet (extend)
        self.t = 0  # the index the next step feeds: every row's in lockstep, else the furthest's
        self.at: Tensor | None = None  # (N,) each row's own next index once rows differ (seek)
        self.fed = self.step_index  # (1,) or (N,): where the last step fed each row
        self.graphed = graphed
        self.graph: GraphedStep | None = None
        self.marked = False  # the layout's dims marked for the compiled step (compiled_forward)
        # The unbound forward, called with the decoder: a bound one would make a reference cycle
        # (decoder -> compiled step -> decoder) that keeps the KV views and graphs until a gc.
        kernel_route = self.attention.kernel is not None
        step = CompiledStep(Decoder.forward, Decoder.structure) if compiled and kernel_route \
            else None
        # None where torch cannot compile here (said once): the eager route, draw and all
        self.compiled = step if step is not None and step.compiled is not None else None

    def forward(self, tokens: Tensor) -> Tensor:
        """(N, 1) -> (N, V); every other input is a tensor held here or by the attention."""
        row_pos = self.attention.row_pos  # (N,) or None: every row at step_index
        index = self.step_index if row_pos is None else row_pos[:, None]
        positions = self.first_position + index  # completion token t sits at len + t
        return self.model.head(self.model.hidden(tokens, positions, self.attention)[:, -1])

    def structure(self, tokens: Tensor) -> str:
        """What a compile of the step specialises on besides the sizes marked dynamic (a refused
        compile leaves that structure eager: compiling.CompiledStep): rows scattered into a grid with
        empty slots, padded prompts, the longest prompt gone, a dim of size 1."""
        a = self.attention
        Bp, P = a.prompt_valid.shape
        sizes = dict(rows=len(tokens), groups=Bp, slots_a_group=self.layout.group_size,
                     prompt_length=P)
        parts = [name for name, on in (("rows scattered into a grid", a.slots is not None),
                                       ("padded prompts", a.prompt_bias is not None),
                                       ("the longest prompt gone", P < a.prompt_k[0].shape[2]))
                 if on] + [f"{name} 1" for name, n in sizes.items() if n == 1]
        return "the decode step with " + (", ".join(parts) or "every row in its slot")

    def compiled_forward(self, tokens: Tensor) -> Tensor:
        """forward through the compiled step, the dims that vary with the layout and the batch
        marked (compiling.dynamic), once a layout (the first marks import dynamo: the eager route
        never does); tokens at every call: a CUDA graph captures on a copy, which has no mark."""
        if not self.marked:
            self.attention.mark_dynamic()
            dynamic(self.first_position, 0)
            self.marked = True
        return self.compiled(self, dynamic(tokens, 0))

    def decode(self, tokens: Tensor) -> Tensor:
        """Feed each active row its next token at its own completion index, tokens (N,) -> logits
        (N, V), and move every row on by one: the token drawn from a row's logits goes at
        fed + 1. In lockstep every row is at index t, a tensor a CUDA graph replays; once a tool
        turn moved rows apart, each is at its own (seek), in eager mode."""
        t = self.t
        self.t += 1
        if not self.lockstep:
            self.attention.at_positions(self.at, t + 1)
            self.fed, self.at = self.at, self.at + 1
            return self.forward(tokens[:, None])
        self.step_index.fill_(t)
        run = self.forward if self.compiled is None else self.compiled_forward
        if self.graphed:
            if self.graph is None:
                self.graph = GraphedStep(run, tokens[:, None])
            return self.graph(tokens[:, None])
        if self.compiled is None:  # eager: attend only to the keys written so far
            self.attention.own_len = t + 1
        return run(tokens[:, None])  # compiled: all Tc keys under the step's mask, as a graph

    def seek(self, at: list[int]) -> None:
        """Rows at their own lengths: active row i feeds its next token at index at[i]."""
        self.at = torch.tensor(at, device=self.rows.device)  # (N,)
        self.t = max(at)

    def drop(self, keep: list[int], filled: int) -> None:
        """Keep the active rows at positions `keep`; `filled` completion KV slots are written."""
        rows = [self.layout.rows[i] for i in keep]
        self.layout = Layout.of(rows, self.G, self.prompt_lens)
        self.attention.set_layout(self.layout, self.lens, filled=filled)
        self.rows = self.rows[torch.tensor(keep, device=self.rows.device)]  # (N',)
        self.first_position = self.lens[self.rows // self.G][:, None]  # (N', 1)
        self.marked = False
        self.graph = None  # addresses and shapes changed: capture again

    def extend(self, picks: list[int], feeds: list[list[int]], starts: list[int]) -> Tensor:
        """Feed active row picks[i] the tokens feeds[i] at its completion indices starts[i]...
        (a tool's observation after the token that called it) in one forward: their K/V go into
        the row's own cache, no earlier token is recomputed. Returns the logits (k, V) after each
        row's last fed token. From the first, rows are at their own lengths (seek)."""
        if self.lockstep:
            self.lockstep = False
            self._plain_linears()
        device = self.rows.device
        width = max(map(len, feeds))
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=device)  # (k, M)
        start = torch.tensor(starts, device=device)[:, None]  # (k, 1)
        rows = self.rows[torch.tensor(picks, device=device)]  # (k,) global ids
        positions = self.lens[rows // self.G][:, None] + start + torch.arange(width, device=device)
        attention = ExtendAttention(self.attention, picks, [len(f) for f in feeds], start, self.G,
                                    self.prompt_lens)
        last = torch.tensor([len(f) - 1 for f in feeds], device=device)
        return self.model.head(self.model.hidden(tokens, positions, attention, last)[:, 0])

    def _plain_linears(self) -> None:
        """F.linear from here on (after the first tool turn): rows at their own lengths come in
        new counts and shapes at every check, and rollout._prepacked_linears' oneDNN keeps a
        primitive for each (a tasks:lookup run grew by 0.5 GB in 100 steps). Undone with the rest
        at the end of generate."""
        for m in self.model.modules():
            m.__dict__.pop("forward", None)


class ExtendAttention:
    """Attention for Decoder.extend: the k extended rows in a grid of their groups (Layout, as the
    decode step's), so each group's prompt K/V is gathered once however many of its rows extend;
    each row attends to it and to its own keys up to each new token, whose K/V are written into
    the row's own cache first. The k rows' own keys are gathered (a copy of k rows, not of the
    batch)."""

    def __init__(self, decode: DecodeAttention, picks: list[int], counts: list[int],
                 start: Tensor, G: int, prompt_lens: list[int]):
        layout = decode.layout
        rows = [layout.rows[i] for i in picks]  # ascending: engine/episodes.py answers rows in order
        grid = Layout.of(rows, G, prompt_lens)
        group_of = {p: i for i, p in enumerate(layout.groups)}
        device = start.device
        self.decode, self.counts, self.start = decode, counts, start  # start (k, 1)
        self.starts = start[:, 0].tolist()
        self.cache_slots = [layout.slots[i] for i in picks]  # each row's slot in the cache views
        self.grid = torch.tensor(grid.slots, device=device)  # (k,) each row's slot in the grid
        self.num_slots = len(grid.groups) * grid.group_size
        self.cache_of_slot = to_grid(torch.tensor(self.cache_slots, device=device), self.grid,
                                     self.num_slots)  # (S,); empty slots: 0
        self.groups = torch.tensor([group_of[g] for g in grid.groups], device=device)  # (Bp_e,)
        self.prompt_len = grid.prompt_len
        self.keys = max(a + n for a, n in zip(self.starts, counts))  # own keys any row reaches

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                 last: Tensor | None = None) -> Tensor:
        d = self.decode
        own_k, own_v = d.own_k[layer], d.own_v[layer]
        for i, (slot, first, n) in enumerate(zip(self.cache_slots, self.starts, self.counts)):
            own_k[slot, :, first:first + n] = k[i, :, :n].to(own_k.dtype)
            own_v[slot, :, first:first + n] = v[i, :, :n].to(own_v.dtype)
        P = self.prompt_len
        prompt_k = d.prompt_k[layer][self.groups, :, :P]  # (Bp_e, Hkv, P, D): once per group
        prompt_v = d.prompt_v[layer][self.groups, :, :P]
        index = self.start + torch.arange(q.shape[2], device=q.device)  # (k, Tq) own indices
        if last is not None:
            index = self.start + last[:, None]  # (k, 1): the last fed token's queries alone
        S = self.num_slots
        q = to_grid(q, self.grid, S)  # (S, H, Tq, D)
        index = to_grid(index, self.grid, S, fill=-1)  # (S, Tq): empty slots see no own key
        own_allowed = torch.arange(self.keys, device=q.device) <= index[:, :, None]  # (S, Tq, .)
        y = shared_prompt_attention(q, own_k[self.cache_of_slot, :, :self.keys],
                                    own_v[self.cache_of_slot, :, :self.keys], own_allowed,
                                    prompt_k, prompt_v, d.prompt_valid[self.groups, :P])
        return y.index_select(0, self.grid)  # (k, H, Tq, D)
