"""
The training forward of a generation batch without padding: each prompt once per group at its own
length, each completion at its own length, packed into one row of valid tokens. Every linear, norm
and MLP runs once over that row (each weight used once, one gradient each); attention alone tells
the segments apart:

    [ prompt 0 | ... | prompt Bp-1 | row 0 | ... | row R-1 | tail ]

- a prompt attends causally to itself;
- completion row i (of group g = i // G) attends to all of prompt g and causally to itself;
- a tail, if the model adds one (tensor parallelism pads the row to a multiple of tp to split its
  tokens), attends to nothing that matters and is dropped.
The state predicting completion token t of row i is prompt g's last position for t = 0 and the
row's own position t - 1 after it: a row of c_i tokens feeds its first c_i - 1 (its last predicts
nothing). The forward runs sum(p_g) + sum(c_i - 1) tokens where the padded one ran Bp*P + R*Ti,
and the prompt stays in the graph: the gradients of all G rows sum into it (TRL PR #2669, exact).

Attention over the packed row (packed_attention, a suffix per device): the prompts causal, the
rows in shared-prompt attention (engine/attention.py: the prompt part and the own part, merged by
log-sum-exp).
- packed_attention_cpu: the project's flash kernels. The prompts are scattered into (Bp, H, P, D)
  and run causal SDPA; the rows go to attention.SharedPromptAttentionRagged as they are: each
  group's tokens folded against its prompt's K/V (read once per group, never copied), each row
  against its own keys in buckets of like lengths (ragged_layout): a few padded slots per bucket,
  none to the batch's longest row. Everything (tokens x C)-sized runs on valid tokens only.
- packed_attention_cuda (cuda_route, chosen by the dtype the attention meets): in bf16 (or fp16)
  on torch >= 2.10 packed_attention_varlen, the varlen flash kernel on the packed tokens as they
  lie (attention.SharedPromptAttentionVarlen: the prompts causal, each group's rows folded into one
  query sequence against its prompt, each row causal on itself, merged by log-sum-exp;
  varlen_layout's offsets built once per micro-batch): no padding, no prompt copied. Otherwise
  (float32, older torch) packed_attention_flex, FlexAttention over the packed row under a block
  mask built from per-token tensors (segment, group, is-prompt, position), compiled once per
  process, the mask once per micro-batch, for a model whose steps pay a compile back
  (compiling.worth_compiling); else packed_attention_cpu with padded views of the repeated-prompt
  twin. A fallback says why in one line (train.py prints it at the first
  step). The varlen route's fold, merge and backward are tested on the CPU with the kernel's math
  twin in its place, the flex route's values on the CPU (eager flex_attention has no CPU
  backward); both on CUDA.
Twins (tests/test_grpo.py): padded_hidden, the same forward with every prompt right-padded to P
and every row to Ti, and naive_hidden, each prompt repeated G times in one causal forward.

Leaves out: packing several micro-batches' rows across groups (a micro-batch is whole groups).
Shapes: Bp prompts, G rows per prompt, R = Bp*G rows, P longest prompt, Tc completion length,
Ti = Tc - 1 the longest row's inputs (a row feeds its tokens but the last), L packed length, n predicted
(valid) completion tokens, C width, H/Hkv heads (rep = H/Hkv), D head dim.
Tested by tests/test_grpo.py and tests/test_grpo_cuda.py; benchmarked by tests/bench_ragged.py.
"""

import functools
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention import (CPU_FLASH, FLASH_VARLEN, RaggedLayout, Segments, SharedPromptAttentionPadded,
                       SharedPromptAttentionRagged, SharedPromptAttentionVarlen, VarlenLayout,
                       causal_bias, length_buckets, padding_bias, shared_prompt_attention_repeated)
from engine.compiling import worth_compiling
from model import causal_attention

try:  # torch >= 2.5; compiled on CUDA, where it has a backward
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    flex_attention = None
# torch >= 2.10 (varlen_attn): the varlen flash kernel's log-sum-exp comes as (H, Tq), as the merge
# reads it. Looked up, not imported: importing it loads dynamo, seconds at every start.
VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None
FLEX_ON_CUDA = flex_attention is not None  # the CUDA route without varlen (cuda_route)
RAGGED_FROM = 1.5  # padded row slots / row tokens from which the CPU's rows run unpadded

# -----------------------------------------------------------------------------
# Where every valid token sits


@dataclass
class Packing:
    """A generation batch's valid tokens in one row, and the maps back to the padded layout."""
    tokens: Tensor       # (1, L) ids: the prompts' valid tokens, then the rows' inputs
    positions: Tensor    # (1, L) rope positions: a prompt from 0, a row from its prompt's length
    prompt_at: Tensor    # (Lp,) each packed prompt token's index in the padded (Bp*P)
    row_at: Tensor       # (Lc,) each packed row input's index in the padded (R*Ti)
    predict: Tensor      # (n,) the packed index of the state predicting each valid token
    prompt_lens: Tensor  # (Bp,)
    row_lens: Tensor     # (R,) each row's inputs (its c_i - 1 fed tokens)
    shape: tuple[int, int, int, int]  # Bp, P, R, Ti


def row_positions(prompt_lens: Tensor, G: int, Ti: int) -> Tensor:
    """(R, Ti) the rope positions of the rows' inputs: a row goes on after its prompt, so token t
    of row i sits at len(prompt i // G) + t."""
    return prompt_lens.repeat_interleave(G)[:, None] + torch.arange(Ti, device=prompt_lens.device)


def pack(prompt_ids: Tensor, prompt_lens: Tensor, tokens: Tensor, mask: Tensor,
         G: int) -> Packing:
    """prompt_ids (Bp, P) right-padded, prompt_lens (Bp,), tokens and mask (R, Tc) (each row's mask
    a prefix) -> the packed row. `predict` follows mask order (row-major over valid tokens), the
    order of tokens[mask]."""
    Bp, P = prompt_ids.shape
    R, Tc = tokens.shape
    Ti = max(Tc - 1, 0)
    device = tokens.device
    prompt_valid = torch.arange(P, device=device) < prompt_lens[:, None]  # (Bp, P)
    inputs_valid = mask[:, 1:]  # (R, Ti): token t feeds the state predicting token t + 1
    positions = torch.cat([torch.arange(P, device=device).expand(Bp, P)[prompt_valid],
                           row_positions(prompt_lens, G, Ti)[inputs_valid]])
    packed = torch.cat([prompt_ids[prompt_valid], tokens[:, :Ti][inputs_valid]])  # (L,)
    Lp = int(prompt_lens.sum())
    # Token 0 of row i is predicted by its prompt's last position, token t >= 1 by input t - 1.
    prompt_last = torch.cumsum(prompt_lens, 0) - 1  # (Bp,)
    input_index = Lp + torch.cumsum(inputs_valid.flatten(), 0).view(R, Ti) - 1  # (R, Ti)
    first = prompt_last.repeat_interleave(G)[:, None]  # (R, 1)
    predict = torch.cat([first, input_index], 1)[:, :Tc][mask]  # (n,); Tc = 0: none
    return Packing(packed[None], positions[None], prompt_valid.flatten().nonzero()[:, 0],
                   inputs_valid.flatten().nonzero()[:, 0], predict, prompt_lens,
                   inputs_valid.sum(1), (Bp, P, R, Ti))


def ragged_layout(packing: Packing, rep: int, dtype: torch.dtype) -> RaggedLayout:
    """Where the packed row inputs go in SharedPromptAttentionRagged's rectangles: each group's
    tokens (its rows back to back) folded in (Bp, M) slots, M the largest group's count; each row
    in a bucket of like lengths (attention.length_buckets over the rows, longest first), its tokens
    in T_b slots under a causal bias (in dtype, repeated for the rep folded query heads)."""
    Bp, _, R, _ = packing.shape
    G = R // Bp
    lens = packing.row_lens  # (R,)
    device = lens.device
    Lc = int(lens.sum())
    row_of = torch.repeat_interleave(torch.arange(R, device=device), lens)  # (Lc,)
    row_start = torch.cumsum(lens, 0) - lens  # (R,)
    position = torch.arange(Lc, device=device) - row_start[row_of]  # (Lc,) within its row
    group_lens = lens.view(Bp, G).sum(1)  # (Bp,)
    group_start = torch.cumsum(group_lens, 0) - group_lens
    M = int(group_lens.max())
    group_of = row_of.div(G, rounding_mode="floor")
    fold = group_of * M + torch.arange(Lc, device=device) - group_start[group_of]  # (Lc,)
    row_lens = lens.tolist()
    order = sorted((i for i, n in enumerate(row_lens) if n), key=lambda i: -row_lens[i])
    rank = torch.zeros(R, dtype=torch.long, device=device)  # each row's place in its bucket
    in_bucket = torch.zeros(R, dtype=torch.bool, device=device)
    buckets = []
    for first, stop, T in length_buckets([row_lens[i] for i in order]):
        rows = torch.tensor(order[first:stop], device=device)
        rank[rows] = torch.arange(stop - first, device=device)
        in_bucket.zero_()[rows] = True
        tokens = in_bucket[row_of].nonzero()[:, 0]  # (m,) this bucket's packed tokens
        buckets.append((tokens, rank[row_of[tokens]] * T + position[tokens], stop - first, T,
                        causal_bias(T, rep, dtype, device)))  # bias (1, 1, rep*T, T)
    return RaggedLayout(fold, M, buckets)

# -----------------------------------------------------------------------------
# Attention over the packed row


def padded_rows_attention(prompt_lens: Tensor, P: int, Ti: int, rep: int):
    """attention(q, k, v, prompt_k, prompt_v) -> (R, H, Ti, D): shared-prompt attention of rows
    padded to Ti on their group's prompt K/V: attention.SharedPromptAttentionPadded on the CPU, its
    repeated-prompt twin elsewhere (the CUDA route runs varlen or FlexAttention instead,
    cuda_route, or this). Its masks are built once for all layers (in v's dtype: bf16 under
    autocast over fp32 weights): rep*Ti*Ti and Bp*P entries."""
    device = prompt_lens.device
    prompt_valid = torch.arange(P, device=device) < prompt_lens[:, None]  # (Bp, P)
    if device.type != "cpu" or not CPU_FLASH:
        return lambda q, k, v, pk, pv: shared_prompt_attention_repeated(q, k, v, pk, pv,
                                                                        prompt_valid)
    biases: dict[torch.dtype, tuple[Tensor, Tensor]] = {}

    def attend(q: Tensor, k: Tensor, v: Tensor, pk: Tensor, pv: Tensor) -> Tensor:
        # The flash kernel takes one dtype, v's (the linears': bf16 under autocast). model.py's
        # q and k come in it already; a hook's caller may hand others
        q, k, pk, pv = (x.to(v.dtype) for x in (q, k, pk, pv))
        if q.dtype not in biases:  # (Bp, 1, 1, P) and (1, 1, rep*Ti, Ti)
            biases[q.dtype] = (padding_bias(prompt_valid, q.dtype),
                               causal_bias(Ti, rep, q.dtype, device))
        return SharedPromptAttentionPadded.apply(q, k, v, pk, pv, *biases[q.dtype])
    return attend


def packed_attention_cpu(packing: Packing, rep: int):
    """The CPU route: attention(layer, q, k, v) on the packed row, (1, H|Hkv, L, D) -> (1, H, L,
    D): the prompts through padded views, the rows through SharedPromptAttentionRagged, or padded
    views of SharedPromptAttentionPadded (rows of like lengths), or, off the CPU without
    FlexAttention, padded views of the repeated-prompt twin. Tokens past the prompts and rows (a
    tail) get zeros."""
    Bp, P, R, Ti = packing.shape
    Lp, Lc = len(packing.prompt_at), len(packing.row_at)
    # The ragged kernel where the rows' padding is worth its extra calls: when padded rows would
    # hold 1.5x their tokens or more. Below that (rows of like lengths: the default task's 1-4
    # tokens) padded views cost less than its bookkeeping (tests/bench_ragged.py, docs).
    ragged = (CPU_FLASH and packing.tokens.device.type == "cpu"
              and R * Ti >= RAGGED_FROM * max(Lc, 1))
    attend_rows = padded_rows_attention(packing.prompt_lens, P, Ti, rep) if Ti and not ragged \
        else None
    layouts: dict[torch.dtype, tuple[RaggedLayout, Tensor]] = {}  # built once, for all layers

    def padded(x: Tensor, at: Tensor, rows: int, length: int) -> Tensor:
        # (m, h, D) packed -> (rows, h, length, D), zeros where no token sits. index_put along the
        # first dimension saves only `at` for backward (index_copy would save x too)
        out = x.new_zeros(rows * length, *x.shape[1:]).index_put((at,), x)
        return out.view(rows, length, *x.shape[1:]).transpose(1, 2)

    def packed(y: Tensor, at: Tensor) -> Tensor:  # (rows, H, length, D) -> (m, H, D)
        return y.transpose(1, 2).flatten(0, 1)[at]

    def attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # (L, H|Hkv, D), views
        pq, pk, pv = (padded(x[:Lp], packing.prompt_at, Bp, P) for x in (q, k, v))
        out = [packed(causal_attention(layer, pq, pk, pv), packing.prompt_at)]  # (Lp, H, D)
        if Lc and ragged:  # the rows' tokens as they are, in the kernels' rectangles
            rq, rk, rv = (x[Lp:Lp + Lc].to(v.dtype) for x in (q, k, v))  # autocast: v's dtype
            if v.dtype not in layouts:
                prompt_valid = torch.arange(P, device=v.device) < packing.prompt_lens[:, None]
                bias = padding_bias(prompt_valid, v.dtype)  # (Bp, 1, 1, P)
                layouts[v.dtype] = ragged_layout(packing, q.shape[1] // k.shape[1], v.dtype), bias
            layout, bias = layouts[v.dtype]
            out.append(SharedPromptAttentionRagged.apply(rq, rk, rv, pk.to(v.dtype), pv, bias,
                                                         layout))
        elif Lc:
            rows = [padded(x[Lp:Lp + Lc], packing.row_at, R, Ti) for x in (q, k, v)]
            out.append(packed(attend_rows(*rows, pk, pv), packing.row_at))  # (Lc, H, D)
        out.append(q.new_zeros(q.shape[0] - Lp - Lc, *q.shape[1:]))  # a tail, if any
        return torch.cat(out).transpose(0, 1)[None]  # (1, H, L, D)
    return attention


def varlen_layout(packing: Packing) -> VarlenLayout:
    """SharedPromptAttentionVarlen's three calls over the packed prompts and rows: cumulative
    offsets of the prompts, of each group's tokens (its rows back to back) and of each row, as
    int32 on the packing's device, and their longest (one host sync a micro-batch, not one a
    layer)."""
    Bp, _, R, _ = packing.shape
    prompt_lens, row_lens = packing.prompt_lens, packing.row_lens
    group_lens = row_lens.view(Bp, R // Bp).sum(1)  # (Bp,) tokens of a group's rows

    def offsets(lens: Tensor) -> Tensor:  # (S,) -> (S+1,) int32, from 0
        return torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
    longest_prompt, longest_group, longest_row = torch.stack(
        [prompt_lens.max(), group_lens.max(), row_lens.max()]).tolist()
    prompts, rows = offsets(prompt_lens), offsets(row_lens)
    return VarlenLayout(
        len(packing.prompt_at),
        prompts=Segments(prompts, prompts, longest_prompt, longest_prompt, causal=True),
        prompt_part=Segments(offsets(group_lens), prompts, longest_group, longest_prompt,
                             causal=False),
        own_part=Segments(rows, rows, longest_row, longest_row, causal=True))


def packed_attention_varlen(packing: Packing, kernels=FLASH_VARLEN):
    """The CUDA route in bf16 (or fp16): attention(layer, q, k, v) on the packed row, (1, H|Hkv,
    L, D) -> (1, H, L, D), through attention.SharedPromptAttentionVarlen on the valid tokens as they
    lie (no padding, no copy of a prompt), under one layout for all layers. A tail gets zeros.
    kernels: the varlen (forward, backward) pair; the tests pass the CPU's math twin."""
    layout = varlen_layout(packing)
    valid = len(packing.prompt_at) + len(packing.row_at)

    def attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # (1, h, L, D) -> (valid, h, D): the linears' own layout, so contiguous() copies nothing
        q, k, v = (x[0, :, :valid].transpose(0, 1).contiguous() for x in (q, k, v))
        y = SharedPromptAttentionVarlen.apply(q, k, v, layout, kernels)  # (valid, H, D)
        tail = q.shape[0] - valid
        if tail:
            y = torch.cat([y, y.new_zeros(tail, *y.shape[1:])])
        return y.transpose(0, 1)[None]  # (1, H, L, D)
    return attention


@functools.cache
def compiled_flex():
    """flex_attention compiled once per process (a torch.compile in every forward re-traced it),
    for any length (dynamic): what the block masks call on CUDA."""
    return torch.compile(flex_attention, dynamic=True)


def packed_attention_flex(packing: Packing, kernel=None):
    """The CUDA route without varlen (float32, or torch < 2.10): one flex_attention call per layer
    over the packed row, under a block mask of "same segment and not in the future, or a row's look
    at its group's prompt". The mask is built once per micro-batch and length L (a tail makes it
    longer) and shared by every layer. kernel: compiled_flex() on CUDA, the eager flex_attention
    elsewhere (no backward there)."""
    Bp, P, R, Ti = packing.shape
    device = packing.tokens.device
    Lp, Lc = len(packing.prompt_at), len(packing.row_at)
    prompt_of = packing.prompt_at.div(P, rounding_mode="floor")  # (Lp,) prompt b of each token
    row_of = packing.row_at.div(Ti, rounding_mode="floor") if Ti else prompt_of[:0]  # (Lc,)
    masks: dict[int, object] = {}
    on_cuda = device.type == "cuda"
    kernel = kernel or (compiled_flex() if on_cuda else flex_attention)

    def block_mask(L: int):
        # Tail tokens, and up to the next 128-token block (torch 2.5 calls the mask there too),
        # each a segment of its own.
        tail = torch.arange(-(-L // 128) * 128 - Lp - Lc, device=device)
        segment = torch.cat([prompt_of, Bp + row_of, Bp + R + tail])  # (L',)
        group = torch.cat([prompt_of, row_of.div(R // Bp, rounding_mode="floor"), -1 - tail])
        is_prompt = torch.arange(len(segment), device=device) < Lp
        position = torch.arange(len(segment), device=device)  # packed order: each segment's order

        def allowed(b, h, q, kv):
            own = (segment[q] == segment[kv]) & (position[kv] <= position[q])
            return own | (is_prompt[kv] & ~is_prompt[q] & (group[kv] == group[q]))
        return create_block_mask(allowed, None, None, L, L, device=device,
                                 _compile=on_cuda)

    def attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        L = q.shape[2]
        if L not in masks:
            masks[L] = block_mask(L)
        # One dtype, v's (the linears'): under bf16 autocast that is bf16 (model.Attention.qkv)
        q, k = q.to(v.dtype), k.to(v.dtype)
        return kernel(q, k, v, block_mask=masks[L],
                      enable_gqa=q.shape[1] != k.shape[1])  # (1, H, L, D)
    return attention


def device_capability() -> tuple[int, int] | None:
    """The current GPU's compute capability, or None where there is none to read: --plan for a
    CUDA target on a machine (or in a test) without a GPU, or on a torch built without CUDA."""
    try:
        return torch.cuda.get_device_capability()
    except (RuntimeError, AssertionError):  # no GPU visible; "Torch not compiled with CUDA"
        return None


def cuda_route(dtype: torch.dtype, head_dim: int, compiles: bool = True) -> tuple[str, str]:
    """The CUDA training attention for the compute dtype: "varlen" (bf16 or fp16, torch >= 2.10,
    head_dim a multiple of 8 up to 256, flash kernels built), else "flex" (FlexAttention,
    compiled) where a compile pays (`compiles`: compiling.worth_compiling; FlexAttention's compile
    took 25 s of the default run's first two steps on an H200), else "padded" (padded views of
    the repeated-prompt twin, eager); and, when it is not varlen, the one line that says why.
    FlexAttention's CUDA lowering refuses a head_dim under 16 (inductor raises
    NotImplementedError at the first training step: Triton's tl.dot). Without a GPU to ask (a
    plan for one) the GPU is taken to be of compute capability 8.0 or later."""
    why = ""
    if dtype not in (torch.bfloat16, torch.float16):
        why = f"the flash kernel takes bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    elif not VARLEN:
        why = f"torch {torch.__version__} has no varlen_attn (2.10 and later)"
    elif head_dim % 8 or head_dim > 256:
        why = f"the flash kernel takes head_dim a multiple of 8 up to 256, not {head_dim}"
    elif torch.version.hip or not torch.backends.cuda.is_flash_attention_available():
        why = "this torch build has no CUDA flash attention kernels"
    elif (device_capability() or (8, 0)) < (8, 0):  # a GPU it cannot see: an A100 or later
        why = "the flash kernel needs a GPU of compute capability 8.0 or later"
    if not why:
        return "varlen", ""
    if FLEX_ON_CUDA and head_dim >= 16 and compiles:  # Triton's tl.dot: 16 or more
        return "flex", f"training attention: FlexAttention, not varlen_attn: {why}"
    flex = ("this torch has no FlexAttention" if not FLEX_ON_CUDA else
            f"FlexAttention's CUDA kernel takes head_dim 16 or more, not {head_dim}"
            if head_dim < 16 else "FlexAttention compiles, which this model's steps never pay "
            "back (compiling.worth_compiling)")
    return "padded", f"training attention: padded rows, the prompt repeated per row: {why}; {flex}"


def packed_attention_cuda(packing: Packing, rep: int, compiles: bool = True):
    """The CUDA route for the dtype the attention meets (known at the first layer's call, under
    autocast too), chosen by cuda_route and built once for all layers."""
    routes: dict[torch.dtype, object] = {}

    def attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if v.dtype not in routes:
            name, _ = cuda_route(v.dtype, v.shape[-1], compiles)
            routes[v.dtype] = (packed_attention_varlen(packing) if name == "varlen" else
                               packed_attention_flex(packing) if name == "flex" else
                               packed_attention_cpu(packing, rep))
        return routes[v.dtype](layer, q, k, v)
    return attention


def packed_attention(packing: Packing, rep: int, compiles: bool = True):
    """Attention over the packed row, the route for the packing's device: packed_attention_cuda
    (varlen_attn in bf16, FlexAttention otherwise where a compile pays: cuda_route),
    packed_attention_cpu elsewhere."""
    if packing.tokens.device.type == "cuda":
        return packed_attention_cuda(packing, rep, compiles)
    return packed_attention_cpu(packing, rep)

# -----------------------------------------------------------------------------
# The forwards: packed, and its two twins


def packed_hidden(model, prompt_ids: Tensor, prompt_lens: Tensor, tokens: Tensor, mask: Tensor,
                  G: int, attention=None) -> Tensor:
    """(n, C): the state predicting each valid completion token, in mask order (tokens[mask]'s).
    `attention(packing, rep)` builds the hook (default: packed_attention)."""
    packing = pack(prompt_ids, prompt_lens, tokens, mask, G)
    config = model.config
    rep = config.num_attention_heads // config.num_key_value_heads
    default = functools.partial(packed_attention, compiles=worth_compiling(model))
    hook = (attention or default)(packing, rep)
    h = model.hidden(packing.tokens, packing.positions, hook)[0]  # (L, C); a tail is dropped here
    return h[packing.predict]  # (n, C)


def padded_hidden(model, prompt_ids: Tensor, prompt_lens: Tensor, inputs: Tensor,
                  G: int) -> Tensor:
    """The padded twin: (R, Ti+1, C) for inputs (R, Ti) = completions without their last token.
    Row i's first state is its prompt's last valid position; the rest come from the completions
    attending to their prompt's keys/values, which stay in the graph. The prompts right-padded to
    P and the rows to Ti are packed into one row of Bp*P + R*Ti tokens: every linear and norm runs
    over the padding too."""
    Bp, P = prompt_ids.shape
    R, Ti = inputs.shape
    if Ti == 0:  # only the prompt's last state: the final block's queries and MLP run there alone
        last = model.hidden(prompt_ids, None, causal_attention, last=prompt_lens - 1)  # (Bp, 1, C)
        return last[:, 0].repeat_interleave(G, 0)[:, None]  # (R, 1, C)
    device = inputs.device
    config = model.config
    attend = padded_rows_attention(prompt_lens, P, Ti, config.num_attention_heads //
                                   config.num_key_value_heads)
    split = Bp * P  # packed: [prompt 0 .. prompt Bp-1 (right-padded to P); row 0 .. row R-1]

    def unpack(x: Tensor, first: int, rows: int, length: int) -> Tensor:
        # (1, h, L, D) -> (rows, h, length, D), a view
        return x[0, :, first:first + rows * length].unflatten(1, (rows, length)).transpose(0, 1)

    def padded_attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # the prompts causal (right padding comes after valid tokens); each completion on its
        # group's prompt K/V and its own keys, causal. (1, H, L, D) -> (1, H, L, D)
        pq, pk, pv = (unpack(x, 0, Bp, P) for x in (q, k, v))  # (Bp, H|Hkv, P, D)
        cq, ck, cv = (unpack(x, split, R, Ti) for x in (q, k, v))  # (R, H|Hkv, Ti, D)
        y = [causal_attention(layer, pq, pk, pv), attend(cq, ck, cv, pk, pv)]
        y = torch.cat([part.transpose(0, 1).flatten(1, 2) for part in y], 1)  # (H, Bp*P+R*Ti, D)
        tail = q.shape[2] - y.shape[1]  # tensor parallelism's, if any
        return torch.cat([y, y.new_zeros(y.shape[0], tail, y.shape[2])], 1)[None]

    tokens = torch.cat([prompt_ids.reshape(-1), inputs.reshape(-1)])[None]  # (1, L)
    positions = torch.cat([torch.arange(P, device=device).repeat(Bp),  # (1, L)
                           row_positions(prompt_lens, G, Ti).reshape(-1)])[None]
    h = model.hidden(tokens, positions, padded_attention)[0]  # (L, C)
    last = h[:split].view(Bp, P, -1)[torch.arange(Bp, device=device), prompt_lens - 1]  # (Bp, C)
    first = last.repeat_interleave(G, 0)[:, None]  # (R, 1, C): R*C floats, not G copies
    return torch.cat([first, h[split:split + R * Ti].view(R, Ti, -1)], 1)  # (R, Ti+1, C)


def naive_hidden(model, prompts: list[list[int]], completions: list[list[int]], G: int,
                 device: torch.device) -> Tensor:
    """The slow twin: each prompt repeated G times in one causal forward. Returns (R, Tc, C), the
    states at positions len(prompt)-1+t, which predict completion token t."""
    Tc = max((len(c) for c in completions), default=0)
    rows = [prompts[i // G] + c[:-1] for i, c in enumerate(completions)]
    L = max(map(len, rows))
    ids = torch.tensor([r + [0] * (L - len(r)) for r in rows], device=device)  # (R, L)
    h = model.hidden(ids)  # (R, L, C)
    prompt_lens = torch.tensor([len(prompts[i // G]) for i in range(len(completions))],
                               device=device)  # (R,)
    idx = prompt_lens[:, None] - 1 + torch.arange(Tc, device=device)  # (R, Tc)
    idx = idx.clamp(max=h.shape[1] - 1)
    return h.gather(1, idx[..., None].expand(-1, -1, h.shape[2]))  # (R, Tc, C)
