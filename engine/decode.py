"""
The decode state of the sampler: the KV cache, each active row's state, and the one forward that
feeds rows new tokens (one each at a decode step, several at a tool's observation) against a
prompt shared by a group of rows plus each row's own keys.

- KVCache: one flat preallocated buffer (memory.py frees and re-creates it whole), carved per call
  into the shared prompt K/V (Bp, Hkv, P, D) and each row's completion K/V (R, Hkv, Tc, D).
- Decoder: one state per active row, on the device: its id (its group: id // G; the position of
  its completion index 0 is its prompt's length) and the index it feeds next, always per row
  (lockstep is equal values); live or done is the decode loop's ledger (rollout.py, with
  engine/episodes.py), which drops the done rows (Decoder.drop: the survivors' K/V moved to the
  front). Its forward feeds B rows T tokens each: each layer writes the new keys and values at
  the rows' own indices, then attends through one entry (Decoder.attention) on the decoder's
  route (Decoder.route, picked once from the device and dtypes), its kernel picked once per call:
  the rows sit in a grid of Bp' groups x G' slots (Grid), the G' rows of a group folded against
  the one prompt K/V (shared-prompt attention, engine/attention.py: a prompt part and an own part
  merged by log-sum-exp). Routes: on the CPU in lockstep, SDPA's flash kernel in buckets of like
  prompt lengths (shared_prompt_attention_decode_cpu: a short prompt's padding is not read); on
  CUDA in bf16 / fp16, SDPA's memory-efficient kernel for both parts, reading the bf16 cache as
  it is (shared_prompt_attention_decode_cuda), each row's own keys under its bias; else, and for
  rows apart (after a tool turn) or fed several tokens, attention.shared_prompt_attention's
  plain float32 ops under each row's mask.
- A tool's observation (Decoder.feed) is the same forward over the answered rows, on their own grid,
  several tokens a row: no earlier token is recomputed, and from then on each row feeds at its own
  index.
- On the kernel route the lockstep step is compiled by torch.compile (compiling.CompiledStep:
  norms, RoPE, the cache writes, residual adds, SwiGLU's product and the merge fused; counted on
  the CPU by tests/bench_rollout.py --kernels); float32 stays the plain exact eager step. On CUDA
  the lockstep step is captured in a CUDA graph per bucket of rows (`bucket`: 1, 2, 4, 8, then
  every 16; compiling.GraphedStep), the rows padded up to it, never captured again as rows drop:
  a graphed decoder's grid is whole (every row in the slot it was carved in, nothing moved at a
  drop), so a graph's shapes are its bucket's; what it costs: attention keeps reading every
  prompt and every row's own keys (masked) after rows drop, where the eager grid shrinks.

Leaves out: sampling (engine/sampling.py), the prefill and the loop (rollout.py), which rows end and
what a tool answers (engine/episodes.py), compiling and capturing a step (engine/compiling.py);
paged KV.
Shapes: Bp prompts, G rows per prompt (a group), R = Bp*G rows, B active rows (the forward's), T new
tokens a row, S = Bp'*G' slots of the grid, P longest prompt, Tc completion length, H/Hkv heads,
D head dim, V vocab.
Tested by tests/test_rollout.py, tests/test_episodes.py and tests/test_graphs.py (the compiled
step).
"""

import dataclasses
import itertools
import math
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
class Grid:
    """Where B rows sit for attention. Shared-prompt attention wants G' query rows per group; once
    rows finish, groups hold different counts, so attention sees the rows scattered into a grid of
    Bp' groups x G' slots (G' the largest count); empty slots compute garbage nobody reads. The
    decode step's grid reads the first Bp' prompt views and the first S cache rows (Decoder.drop
    moves the survivors' K/V there; a graphed decoder's grid is whole: every prompt's G slots, each
    row in the one it was carved in); a feed's grid (the rows a tool answered) reads its groups'
    prompt views and its rows' cache rows by index (`reads`). Which rows sit in it is the
    decoder's (Decoder.ids): a grid holds the layout on the device only."""
    scatter: Tensor | None        # (B,) each row's slot (group * G' + j); None: row i in slot i
    occupied: Tensor              # (S,) bool: S as a tensor's dim (a compiled step's, dynamic)
    prompt_valid: Tensor          # (Bp', P') bool; False on a prompt's padding
    prompt_bias: Tensor | None    # (Bp', 1, 1, P') 0 / -inf, rows 16-aligned; None: no padding
    buckets: list[tuple]          # the CPU's runs of like prompt lengths: (first, stop, keys, bias)
    reads: tuple[Tensor, Tensor] | None = None  # a feed's: its groups' prompt views (Bp',), its
                                                # rows' cache rows (B,); None: the leading ones

    @classmethod
    def of(cls, ids: Tensor, G: int, prompt_lens: Tensor, dtype: torch.dtype, whole: bool = False,
           within: "Grid | None" = None, picked: Tensor | None = None) -> "Grid":
        """The grid of the rows `ids` (B,), global ids ascending (prompt-major); whole: every
        prompt's G slots, each row in its own (row r in slot r: the cache as carved); within: the
        grid the rows sit in now, picked (B,) their places in it: the new grid's `reads` say where
        its groups' prompt views and its rows' cache rows are there. One host read: the groups'
        row counts and prompt lengths."""
        device = ids.device
        if whole:
            groups, size, slots = torch.arange(len(prompt_lens), device=device), G, ids
            lens_list = prompt_lens.tolist()
        else:
            groups, counts = torch.unique_consecutive(ids // G, return_counts=True)  # (Bp',)
            counts, lens_list = torch.stack((counts, prompt_lens[groups])).tolist()
            size = max(counts)
            slots = torch.tensor([i * size + j for i, n in enumerate(counts) for j in range(n)],
                                 device=device)
        S = len(lens_list) * size
        scatter = None if len(ids) == S else slots  # every slot taken: row i sits in slot i
        occupied = torch.zeros(S, dtype=torch.bool, device=device).index_fill_(0, slots, True)
        lens = prompt_lens[groups]  # (Bp',) longest first: generate() sorts the prompts
        prompt_valid = torch.arange(max(lens_list), device=device) < lens[:, None]
        bias = None  # no padding: the fused kernels skip their mask
        if not prompt_valid.all():  # rows 16-aligned: efficient_attention's kernel wants it
            bias = padding_bias(prompt_valid, dtype, align=16)
        # Each bucket's slice of the mask, or None where its prompts fill all its keys.
        buckets = [(first, stop, keys, None if bias is None or min(lens_list[first:stop]) == keys
                    else bias[first:stop, ..., :keys])
                   for first, stop, keys in length_buckets(lens_list)]
        reads = None
        if within is not None:  # a row's slot there is its cache row; its group's, slot // G'
            cache_rows = picked if within.scatter is None else within.scatter[picked]  # (B,)
            leaders = torch.tensor([0, *itertools.accumulate(counts)][:-1], device=device)
            G_within = within.occupied.shape[0] // within.prompt_valid.shape[0]
            reads = (cache_rows[leaders] // G_within, cache_rows)
        return cls(scatter, occupied, prompt_valid, bias, buckets, reads)

    def place(self, x: Tensor, fill: int = 0) -> Tensor:
        """(B, ...) rows -> (S, ...) the grid: row i at its slot, `fill` in the empty ones."""
        return x if self.scatter is None else to_grid(x, self.scatter, self.occupied.shape[0], fill)


def to_grid(x: Tensor, slots: Tensor, num_slots: int, fill: int = 0) -> Tensor:
    """(B, ...) active rows -> (S, ...) the grid: row i at slots[i], `fill` in the empty slots.
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
    aligned stride (Grid.of and the own bias are allocated so) and pads its lse to a multiple of
    32 queries."""
    B, H, M, _ = q.shape
    if bias is not None:
        bias = bias.expand(B, H, M, k.shape[2])  # stride 0 over heads and queries
    out, lse = _EFFICIENT(q, k, v, bias, True)[:2]
    return out, lse[..., :M]


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> Callable | None:
    """The fused kernel the decode step runs both parts through (the kernel route), or None:
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


def bucket(rows: int) -> int:
    """The rows a CUDA graph of the step is captured for: 1, 2, 4, 8, then every 16."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 16) * 16


class Decoder:
    """The decode state over the active rows and its one forward. Each active row holds one state,
    on the device: its global id (`ids`; its group is id // G, the position of its completion
    index 0 its prompt's length: `first`) and the completion index it feeds next (`index`):
    always per row, equal values while the rows run in lockstep. Where the rows sit for attention
    is `grid`. `route`: how the step attends (Decoder.attention), picked once from the device and
    the dtypes: "kernel" (bf16 / fp16 on CUDA), "flash" (the CPU), "plain" (float32 off the CPU),
    then "apart" from the first tool turn on (each row at its own index).
    `compiled`: the step through torch.compile (compiling.CompiledStep) where the attention takes
    the kernel route; float32 stays the plain exact eager one. `graphs` (None: no graphs): the
    lockstep step's CUDA graphs, one per bucket of rows (1, 2, 4, 8, then every 16), the rows
    padded up to it and never captured again as rows drop: a graphed decoder's grid is whole
    (every row in the slot it was carved in), so a drop moves no K/V."""

    def __init__(self, model: torch.nn.Module, views: tuple[list[Tensor], ...],
                 prompt_lens: list[int], graphed: bool, compiled: bool = False):
        own = views[2][0]
        device = own.device
        self.model, self.views = model, views
        self.prompt_lens = torch.tensor(prompt_lens, device=device)  # (Bp,)
        self.graphs: dict[int, GraphedStep] | None = {} if graphed else None
        self.ids = torch.arange(own.shape[0], device=device)  # (B,) of R = Bp*G rows
        self.index = torch.zeros_like(self.ids)  # (B,)
        self.grid = self._grid(self.ids, whole=graphed)
        # The kernel route: both parts of the step's attention through one fused kernel (kernel_for,
        # CUDA in bf16 / fp16) when the cache holds the model's dtype; else, on the CPU, SDPA's
        # flash kernel for the prompt part; else the plain float32 ops.
        same = next(model.parameters()).dtype == own.dtype
        kernel = same and kernel_for(device, own.dtype, own.shape[-1]) is not None
        flash = same and device.type == "cpu" and _CPU_FLASH is not None
        self.route = "kernel" if kernel else "flash" if flash else "plain"
        # The unbound forward, called with the decoder: a bound one would make a reference cycle
        # (decoder -> compiled step -> decoder) that keeps the KV views and graphs until a gc.
        step = CompiledStep(Decoder.forward, Decoder.structure) \
            if compiled and self.route == "kernel" else None
        # None where torch cannot compile here (said once): the eager route, draw and all
        self.compiled = step if step is not None and step.compiled is not None else None
        self._mark()

    @property
    def G(self) -> int:
        """Rows per prompt: the cache is carved as Bp prompts and Bp*G rows."""
        return self.views[2][0].shape[0] // self.views[0][0].shape[0]

    def first(self, ids: Tensor) -> Tensor:
        """(B,) the position of each row's completion index 0: its prompt's length."""
        return self.prompt_lens[ids // self.G]

    def _grid(self, ids: Tensor, **where) -> Grid:
        """Grid.of the rows `ids` over this decoder's prompts and cache."""
        return Grid.of(ids, self.G, self.prompt_lens, self.views[0][0].dtype, **where)

    # -------------------------------------------------------------------------
    # The forward: B rows, T new tokens each, one attention entry

    def forward(self, tokens: Tensor, index: Tensor, first: Tensor, keys: int | None,
                grid: Grid | None = None, last: Tensor | None = None) -> Tensor:
        """Feed tokens (B, T) at their completion indices index (B, T) -> the logits (B, V) after
        each row's last token (last (B,) its place, for rows of fewer tokens; None: the T-th).
        first (B,): each row's completion index 0's position. grid: where the rows sit (a feed's
        own, a graph's bucket); None: the decode grid. keys: the own keys attended (None: all Tc
        under their mask, a graph's or a compile's static shapes)."""
        positions = first[:, None] + index  # completion index j sits at its prompt's length + j
        attention = self.attention(index, keys, grid, last)
        return self.model.head(self.model.hidden(tokens, positions, attention, last)[:, -1])

    def attention(self, index: Tensor, keys: int | None, grid: Grid | None = None,
                  last: Tensor | None = None) -> Callable:
        """The attention hook of one forward (model.hidden's `attention`) on the decoder's route,
        its kernel picked once:
        - plain, apart: shared_prompt_attention's float32 ops, each row's own keys up to each
          query's index (float32 off the CPU; apart: a feed's rows, rows after a tool turn);
        - kernel: both parts through kernel_for's fused kernel
          (shared_prompt_attention_decode_cuda), the own keys under a per-row bias: a CUDA
          graph's and a compile's route;
        - flash: the CPU's, in buckets of like prompt lengths, each reading its prompts' keys only
          (shared_prompt_attention_decode_cpu), the own keys up to `keys` (rows in lockstep).
        Each layer first writes its new keys and values into the rows' own cache at their indices;
        rows of a feed write their tokens up to `last` only."""
        grid = grid or self.grid
        feed = grid.reads is not None  # a feed's rows are apart
        route = self.route
        prompt_k, prompt_v, own_k, own_v = self.views
        kernel = kernel_for(index.device, own_k[0].dtype, own_k[0].shape[-1]) \
            if route == "kernel" else None
        B, T = index.shape
        S = grid.occupied.shape[0]
        Bp, P = grid.prompt_valid.shape  # dims a compiled step keeps dynamic, as tensor shapes
        # Where the new keys go. In lockstep every row writes at the one index, a slice of the grid
        # (eager: `keys` - 1) or an index tensor (a graph's, a compile's: the first row's index);
        # else each row at its own: its cache row, a feed's rows their tokens up to `last`.
        lockstep = route != "apart"
        at = keys - 1 if lockstep and keys is not None else index[:1, 0] if lockstep else None
        keys = own_k[0].shape[2] if keys is None else keys
        device = index.device
        written = None
        if not lockstep:
            cache_rows = (grid.reads[1] if feed else
                          torch.arange(B, device=device) if grid.scatter is None else grid.scatter)
            if last is not None:
                written = (torch.arange(T, device=device) <= last[:, None]).nonzero()  # (n, 2)
                at = (cache_rows[written[:, 0]], index[written[:, 0], written[:, 1]])  # (n,), (n,)
            else:
                at = (cache_rows[:, None].expand(B, T).reshape(-1), index.reshape(-1))  # (B*T,)
        # The own keys each query may see, once for every layer: up to its own index; an empty
        # slot sees key 0 (the decode grid's: no kernel meets a row with no key) or none (a feed's).
        fill = -1 if feed else 0
        queries = index if last is None else index.gather(1, last[:, None])  # (B, Tq)
        key_positions = torch.arange(keys, device=device) if route != "flash" else None
        if route == "kernel":  # additive, rows 16-aligned (efficient_attention)
            unseen = key_positions > grid.place(queries[:, -1], fill)[:, None]  # (S, Tc)
            own_bias = torch.zeros(S, -(-keys // 16) * 16, dtype=own_k[0].dtype,
                                   device=device)[:, :keys]
            own_bias = own_bias.masked_fill_(unseen, float("-inf"))[:, None, None]  # (S, 1, 1, Tc)
        allowed = {}  # (S, Tq, keys) bool, made by the first layer that meets Tq queries a row

        def own_mask(tq: int) -> Tensor:
            # The final layer's query is the last token's alone; tensor parallelism's sequence
            # parallelism may pad a feed's rows past T (the pads come after every real token).
            qi = queries if tq == 1 else index[:, :1] + torch.arange(tq, device=device)
            if tq not in allowed:
                allowed[tq] = key_positions <= grid.place(qi, fill)[:, :, None]
            return allowed[tq]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, last: Tensor | None = None):
            if isinstance(at, int):  # lockstep, eager: the grid's slots at index `at`
                own_k[layer][:S, :, at:at + 1] = grid.place(k).to(own_k[layer].dtype)
                own_v[layer][:S, :, at:at + 1] = grid.place(v).to(own_v[layer].dtype)
            elif isinstance(at, Tensor):  # lockstep, a tensor index: a graph replays it
                own_k[layer][:S].index_copy_(2, at, grid.place(k).to(own_k[layer].dtype))
                own_v[layer][:S].index_copy_(2, at, grid.place(v).to(own_v[layer].dtype))
            else:  # each row at its own index
                if written is None:  # (B, Hkv, T, D) -> (B*T, Hkv, D)
                    new_k, new_v = (x.transpose(1, 2).reshape(-1, *x.shape[1::2]) for x in (k, v))
                else:
                    new_k, new_v = (x[written[:, 0], :, written[:, 1]] for x in (k, v))
                own_k[layer][at[0], :, at[1]] = new_k.to(own_k[layer].dtype)
                own_v[layer][at[0], :, at[1]] = new_v.to(own_v[layer].dtype)
            q = grid.place(q)  # (S, H, Tq, D): the B rows into the grid, empty slots zeros
            if feed:  # its groups' prompts and its rows' own keys, gathered
                pk = prompt_k[layer][grid.reads[0], :, :P]  # (Bp', Hkv, P', D): once per group
                pv = prompt_v[layer][grid.reads[0], :, :P]
                ok = own_k[layer][grid.place(grid.reads[1]), :, :keys]  # (S, Hkv, ., D)
                ov = own_v[layer][grid.place(grid.reads[1]), :, :keys]
            else:
                pk, pv = prompt_k[layer][:Bp, :, :P], prompt_v[layer][:Bp, :, :P]
                ok, ov = own_k[layer][:S, :, :keys], own_v[layer][:S, :, :keys]  # (S, Hkv, ., D)
            if route == "flash":
                G = S // Bp
                parts = [shared_prompt_attention_decode_cpu(
                    q[first * G:stop * G], ok[first * G:stop * G], ov[first * G:stop * G],
                    pk[first:stop, :, :n], pv[first:stop, :, :n], bias)
                    for first, stop, n, bias in grid.buckets]
                y = torch.cat(parts) if len(parts) > 1 else parts[0]
            elif route == "kernel":
                y = shared_prompt_attention_decode_cuda(q, ok, ov, own_bias, pk, pv,
                                                        grid.prompt_bias, kernel)
            else:
                y = shared_prompt_attention(q, ok, ov, own_mask(q.shape[2]), pk, pv,
                                            grid.prompt_valid)
            return y if grid.scatter is None else y.index_select(0, grid.scatter)  # (B, H, Tq, D)
        return attend

    def structure(self, tokens: Tensor, index: Tensor, first: Tensor, keys: int | None,
                  grid: Grid | None = None) -> str:
        """What a compile of the step specialises on besides the sizes marked dynamic (a refused
        compile leaves that structure eager: compiling.CompiledStep): rows scattered into a grid
        with empty slots, padded prompts, the longest prompt gone, a dim of size 1."""
        g = grid or self.grid
        Bp, P = g.prompt_valid.shape
        sizes = dict(rows=len(tokens), groups=Bp, slots_a_group=g.occupied.shape[0] // Bp,
                     prompt_length=P)
        parts = [name for name, on in (("rows scattered into a grid", g.scatter is not None),
                                       ("padded prompts", g.prompt_bias is not None),
                                       ("the longest prompt gone", P < self.views[0][0].shape[2]))
                 if on] + [f"{name} 1" for name, n in sizes.items() if n == 1]
        return "the decode step with " + (", ".join(parts) or "every row in its slot")

    def _mark(self) -> None:
        """For a compiled step, mark the dims that vary with the batch and the grid
        (compiling.dynamic), once a grid: the cache views' rows and lengths (Bp, ., P, .) and
        (Bp*G, ., Tc, .), the rows' index and the grid's tensors; never the model's (the first
        marks import dynamo: the eager route never does)."""
        if self.compiled is None:
            return
        for x in sum(self.views, []):
            dynamic(x, 0, 2)
        g = self.grid
        for x, dims in ((self.index, (0,)), (g.scatter, (0,)), (g.occupied, (0,)),
                        (g.prompt_valid, (0, 1)), (g.prompt_bias, (0, 3))):
            if x is not None:
                dynamic(x, *dims)

    # -------------------------------------------------------------------------
    # The rows' state: a decode step, a feed, a drop

    def decode(self, tokens: Tensor) -> Tensor:
        """Feed each active row its next token at its own completion index, tokens (B,) ->
        logits (B, V), and move every row on by one: the token drawn from a row's logits goes at
        its index (`index` after the call). In lockstep a CUDA graph of the bucket of rows
        replays the step, the rows padded up to it (the padding repeats the last row: it writes
        what that row writes); once a tool turn moved rows apart, each attends to the own keys up
        to the furthest row's, in eager mode."""
        B = len(tokens)
        if self.graphs is not None and self.route != "apart":
            b = bucket(B)
            pad = torch.arange(b, device=tokens.device).clamp_(max=B - 1)  # (b,)
            inputs = (tokens[pad][:, None], self.index[pad][:, None], self.ids[pad])
            if b not in self.graphs:
                self.graphs[b] = GraphedStep(self._lockstep, *inputs)
            logits = self.graphs[b](*inputs)[:B]
        elif self.compiled is not None and self.route != "apart":
            logits = self._lockstep(tokens[:, None], self.index[:, None], self.ids)
        else:  # eager: attend only to the keys written so far (one host read, eager anyway)
            logits = self.forward(tokens[:, None], self.index[:, None], self.first(self.ids),
                                  int(self.index.max()) + 1)
        self.index += 1
        return logits

    def _lockstep(self, tokens: Tensor, index: Tensor, ids: Tensor) -> Tensor:
        """The step a graph captures and a compile traces: every own key under its mask. ids (b,):
        the rows' (a graph's: its bucket's, in the whole grid, where a row's slot is its id)."""
        grid = None if self.graphs is None else dataclasses.replace(self.grid, scatter=ids)
        first = self.first(ids)
        if self.compiled is None:
            return self.forward(tokens, index, first, None, grid)
        if grid is not None:
            dynamic(ids, 0)
        return self.compiled(self, dynamic(tokens, 0), dynamic(index, 0), dynamic(first, 0), None,
                             grid)

    def feed(self, picks: list[int], feeds: list[list[int]], starts: list[int]) -> Tensor:
        """Feed active row picks[i] the tokens feeds[i] from its completion index starts[i] on (a
        tool's observation after the token that called it), the rows on their own grid, in one
        forward: their K/V go into the rows' own cache, no earlier token is recomputed. Returns
        the logits (k, V) after each row's last fed token; each row then feeds from the index
        after it. From the first feed on, rows are apart."""
        self.route = "apart"
        device = self.index.device
        width = max(map(len, feeds))
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=device)  # (k, M)
        start = torch.tensor(starts, device=device)  # (k,)
        index = start[:, None] + torch.arange(width, device=device)  # (k, M)
        last = torch.tensor([len(f) - 1 for f in feeds], device=device)  # (k,)
        # ascending: engine/episodes.py answers rows in order
        picked = torch.tensor(picks, device=device)
        ids = self.ids[picked]
        grid = self._grid(ids, within=self.grid, picked=picked)
        keys = max(a + len(f) for a, f in zip(starts, feeds))  # the own keys any row reaches
        logits = self.forward(tokens, index, self.first(ids), keys, grid, last)
        self.index[picked] = start + last + 1
        return logits

    def drop(self, keep: list[int], filled: int) -> None:
        """Keep the active rows at positions `keep`: the survivors' prompts' KV move to the front
        of the prompt views and their `filled` completion KV positions to their new slots (via
        temporaries: they overlap). A graphed decoder's grid stays whole: nothing moves, and its
        tensors stay the ones its graphs read."""
        old = self.grid
        picked = torch.tensor(keep, device=self.index.device)
        self.ids, self.index = self.ids[picked], self.index[picked]
        if self.graphs is not None:
            self.grid = dataclasses.replace(old, scatter=self.ids)
            return
        new = self._grid(self.ids, within=old, picked=picked)
        old_groups, old_slots = new.reads  # where the survivors' prompts and rows sit now
        new_slots = torch.arange(len(keep), device=picked.device) if new.scatter is None \
            else new.scatter
        Bp, P = new.prompt_valid.shape
        prompt_k, prompt_v, own_k, own_v = self.views
        for x in prompt_k + prompt_v:
            x[:Bp, :, :P] = x[:old.prompt_valid.shape[0], :, :P].index_select(0, old_groups)
        for x in own_k + own_v:
            moved = x[:old.occupied.shape[0], :, :filled].index_select(0, old_slots)
            x[:new.occupied.shape[0], :, :filled].index_copy_(0, new_slots, moved)
        self.grid = dataclasses.replace(new, reads=None)
        self._mark()
