"""
Shared-prompt attention: the G rows of a group attend to their group's one prompt K/V plus their
own keys, and the prompt's keys and values exist once per group, never copied G times (Hydragen,
arXiv:2402.05099).

Every row of a group attends to [the group's prompt keys; its own keys], in two parts: the prompt
part (the G rows of a group, and the rep query heads of a kv head, folded into the query length
against the one prompt K/V) and the own part (each row against its own keys). Their two partial
softmaxes are merged by their log-sum-exp: softmax over both = each part weighed by
exp(lse_part - lse_all). One name, a suffix per implementation (docs/design.md's glossary):
- shared_prompt_attention: the merge in plain tensor ops, any device, no gradient kernel of its
  own (engine/decode.py's float32 step and a tool's extend); the decode kernels' reference.
- shared_prompt_attention_repeated: the slow twin (the prompt repeated per row, one SDPA call
  under an (N, 1, T, P + T) mask), and the path of padded rows off the CPU.
- SharedPromptAttentionPadded: the CPU's two flash kernels, forward and backward, on rows
  padded to one length (engine/packing.py's padded twin).
- SharedPromptAttentionRagged: the same kernels on the packed row's rows at any lengths
  (engine/packing.py's training forward on a CPU): a group's tokens folded against its prompt, rows in
  buckets of like lengths (length_buckets, which engine/decode.py uses for its prompts too), no row
  padded to the longest.
- SharedPromptAttentionVarlen: CUDA's varlen flash kernel (torch >= 2.10's varlen_attn) on the
  packed row's tokens as they are (engine/packing.py's bf16 training forward there): three calls, the
  prompts causal, each group's rows as one query sequence against its prompt (the prompt part),
  each row causal (the own part); nothing padded at all. Its CPU twin (the kernel's math in tensor
  ops) is in the tests.
The decode step's kernels (one query token per row) are engine/decode.py's
shared_prompt_attention_decode_cpu and _decode_cuda.

Leaves out: the KV cache (engine/decode.py), the model (model.py calls whichever hook it is given).
Shapes: Bp prompts, G rows per prompt, N = Bp*G, H/Hkv heads (rep = H/Hkv), T query tokens,
S own keys, P prompt length, D head dim.
Tested by tests/test_attention.py (and on CUDA by tests/test_grpo_cuda.py); benchmarked by
tests/bench_shared_prompt.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def merge(out_p: Tensor, lse_p: Tensor, out_o: Tensor,
          lse_o: Tensor) -> tuple[Tensor, Tensor]:
    """The log-sum-exp merge of the prompt part and the own part (two partial softmaxes over
    disjoint keys) into the joint one: softmax over both = each part weighed by
    exp(lse_part - lse_all). out (..., D), lse (...) of like shapes; out comes back in float32
    (float64 for float64), the caller casts it."""
    lse = torch.logaddexp(lse_p, lse_o)  # (...)
    out = out_p * (lse_p - lse).exp()[..., None] + out_o * (lse_o - lse).exp()[..., None]
    return out, lse


def padding_bias(valid: Tensor, dtype: torch.dtype, align: int = 1) -> Tensor:
    """The prompt part's mask for a flash kernel: (Bp, P) bool, True on a prompt's tokens ->
    (Bp, 1, 1, P) additive, 0 there and -inf on the padding, in dtype; each row at a stride that is
    a multiple of `align` elements (decode.efficient_attention's kernel wants 16)."""
    Bp, P = valid.shape
    bias = torch.zeros(Bp, -(-P // align) * align, dtype=dtype, device=valid.device)[:, :P]
    return bias.masked_fill_(~valid, float("-inf"))[:, None, None]


def causal_bias(T: int, rep: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The own part's mask for a flash kernel on rows of T tokens with the rep query heads of a kv
    head folded into the query length: (1, 1, rep*T, T) additive, each head causal."""
    future = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)  # (T, T)
    bias = torch.zeros(T, T, dtype=dtype, device=device).masked_fill(future, float("-inf"))
    return bias.repeat(rep, 1)[None, None]


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


def shared_prompt_attention(q: Tensor, k: Tensor, v: Tensor, own_allowed: Tensor,
                            prompt_k: Tensor, prompt_v: Tensor, prompt_valid: Tensor) -> Tensor:
    """Exact attention of Bp*G rows to their group's one prompt plus their own keys (Hydragen),
    in plain tensor ops.

    q (Bp*G, H, T, D); k/v (Bp*G, Hkv, S, D) each row's own keys; own_allowed (Bp*G or 1, T, S)
    bool. prompt_k/v (Bp, Hkv, P, D) computed once per group; prompt_valid (Bp, P) bool (False =
    padding). The G rows are folded into the query dimension, so the prompt K/V is read once per
    group and never copied G times; the two partial softmaxes are merged by their log-sum-exp.
    Returns (Bp*G, H, T, D).
    """
    N, H, T, D = q.shape
    Bp, Hkv, P, _ = prompt_k.shape
    G = N // Bp
    rep = H // Hkv
    assert N == Bp * G and k.shape[0] == N and prompt_valid.shape == (Bp, P), "shapes do not match"
    # The prompt part: all G rows of a group (and the rep query heads of a kv head) against it.
    qp = q.view(Bp, G, Hkv, rep, T, D).transpose(1, 2).reshape(Bp, Hkv, G * rep * T, D)
    out_p, lse_p = attention_with_lse(qp, prompt_k, prompt_v, prompt_valid[:, None, None, :])
    out_p = out_p.view(Bp, Hkv, G, rep, T, D).transpose(1, 2).reshape(N, H, T, D)  # (Bp*G, H, T, D)
    lse_p = lse_p.view(Bp, Hkv, G, rep, T).transpose(1, 2).reshape(N, H, T)  # (Bp*G, H, T)
    # The own part: each row against its own keys (GQA: the rep heads folded into the queries).
    qo = q.reshape(N, Hkv, rep * T, D)  # (Bp*G, Hkv, rep*T, D)
    allowed = own_allowed[:, None, None].expand(-1, Hkv, rep, -1, -1)
    allowed = allowed.reshape(-1, Hkv, rep * T, k.shape[2])  # (Bp*G or 1, Hkv, rep*T, S)
    out_o, lse_o = attention_with_lse(qo, k, v, allowed)
    out_o = out_o.view(N, H, T, D)
    lse_o = lse_o.view(N, H, T)
    return merge(out_p, lse_p, out_o, lse_o)[0].to(q.dtype)

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)
CPU_FLASH = _CPU_FLASH is not None and _CPU_FLASH_BACKWARD is not None  # the CPU's classes run


def _by_group(x: Tensor, Bp: int, Hkv: int) -> Tensor:
    """(N, H, T, ...) -> (Bp, Hkv, G*rep*T, ...): a group's G rows and a kv head's rep query heads
    folded into the query length, so that they all read the group's one prompt K/V."""
    N, H, T = x.shape[:3]
    x = x.reshape(Bp, N // Bp, Hkv, H // Hkv, T, *x.shape[3:]).transpose(1, 2)
    return x.reshape(Bp, Hkv, -1, *x.shape[5:])


def _by_row(x: Tensor, N: int, H: int) -> Tensor:
    """_by_group's inverse: (Bp, Hkv, G*rep*T, ...) -> (N, H, T, ...)."""
    Bp, Hkv = x.shape[:2]
    x = x.reshape(Bp, Hkv, N // Bp, H // Hkv, -1, *x.shape[3:]).transpose(1, 2)
    return x.reshape(N, H, *x.shape[4:])


class SharedPromptAttentionPadded(torch.autograd.Function):
    """Shared-prompt attention on rows padded to one length, in the CPU's flash kernels: each
    completion row attends to [its group's prompt keys; its own keys, causally], with the prompt's
    K/V read once per group: no G-fold copy, no (N, T, P + T) mask. Two CPU flash calls: the
    prompt part (the G rows of a group and the rep query heads of a kv head folded into the query
    length against the prompt's (Bp, Hkv, P, D), non-causal) and the own part (each row against its
    own keys, the rep heads folded too). They merge by log-sum-exp (shared_prompt_attention's
    merge). Backward runs the flash backward on each part with the MERGED output and log-sum-exp: it
    rebuilds the
    probabilities as exp(scores - lse) and uses rowsum(dout * out), so with the joint lse and out
    these are the joint softmax's, restricted to that part's keys: each part's share of the exact
    gradient (the two dq add up). Saves q, k, v, out and the lse, not the
    (N, Hkv, P, D) copy. q (N, H, T, D), k/v (N, Hkv, T, D), prompt_k/v (Bp, Hkv, P, D); the
    biases are additive 0 / -inf: prompt_bias (Bp, 1, 1, P) its padding, own_bias
    (1, 1, rep*T, T) causal per folded head."""

    @staticmethod
    def forward(ctx, q, k, v, prompt_k, prompt_v, prompt_bias, own_bias):
        N, H, T, D = q.shape
        Bp, Hkv = prompt_k.shape[:2]
        out_p, lse_p = _CPU_FLASH(_by_group(q, Bp, Hkv), prompt_k, prompt_v, attn_mask=prompt_bias)
        out_p, lse_p = _by_row(out_p, N, H), _by_row(lse_p, N, H)  # (N, H, T, D), (N, H, T)
        out_o, lse_o = _CPU_FLASH(q.reshape(N, Hkv, -1, D), k, v, attn_mask=own_bias)
        out_o, lse_o = out_o.reshape(N, H, T, D), lse_o.reshape(N, H, T)
        out, lse = merge(out_p, lse_p, out_o, lse_o)  # (N, H, T, D), (N, H, T) float32 or 64
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, prompt_k, prompt_v, prompt_bias, own_bias, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, prompt_k, prompt_v, prompt_bias, own_bias, out, lse = ctx.saved_tensors
        N, H, T, D = q.shape
        Bp, Hkv = prompt_k.shape[:2]

        def by_group(x: Tensor) -> Tensor:  # (Bp, Hkv, G*rep*T, ...)
            return _by_group(x, Bp, Hkv)

        def heads_folded(x: Tensor) -> Tensor:  # (N, Hkv, rep*T, ...)
            return x.reshape(N, Hkv, -1, *x.shape[3:])
        grad = grad.contiguous()
        dq_p, dprompt_k, dprompt_v = _CPU_FLASH_BACKWARD(
            by_group(grad), by_group(q), prompt_k, prompt_v, by_group(out), by_group(lse),
            0.0, False, attn_mask=prompt_bias)
        dq_o, dk, dv = _CPU_FLASH_BACKWARD(
            heads_folded(grad), heads_folded(q), k, v, heads_folded(out), heads_folded(lse),
            0.0, False, attn_mask=own_bias)
        dq = dq_o.reshape(N, H, T, D) + _by_row(dq_p, N, H)
        return dq, dk, dv, dprompt_k, dprompt_v, None, None


def shared_prompt_attention_repeated(q: Tensor, k: Tensor, v: Tensor, prompt_k: Tensor,
                                     prompt_v: Tensor, prompt_valid: Tensor) -> Tensor:
    """The slow twin (of SharedPromptAttentionPadded and _Ragged), and padded rows' path off the
    CPU: the prompt's K/V repeated for each of the G rows of its group and one SDPA call under an
    (N, 1, T, P + T) bool mask. prompt_valid (Bp, P) bool. Returns (N, H, T, D)."""
    N, _, T, _ = q.shape
    Bp, _, P, _ = prompt_k.shape
    G = N // Bp
    arange = torch.arange(T, device=q.device)
    own_causal = arange[:, None] >= arange[None, :]  # (T, T)
    allowed = torch.cat([prompt_valid.repeat_interleave(G, 0)[:, None, :].expand(N, T, P),
                         own_causal.expand(N, T, T)], dim=-1)[:, None]  # (N, 1, T, P + T)
    keys = torch.cat([prompt_k.repeat_interleave(G, 0), k], dim=2)  # (N, Hkv, P + T, D)
    values = torch.cat([prompt_v.repeat_interleave(G, 0), v], dim=2)  # (N, Hkv, P + T, D)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                          enable_gqa=q.shape[1] != k.shape[1])  # (N, H, T, D)

# -----------------------------------------------------------------------------
# The same on packed rows of any lengths: no row padded to the longest


def length_buckets(lens: list[int]) -> list[tuple[int, int, int]]:
    """Runs of groups whose prompt lengths (longest first) are at least half the run's first:
    (first, stop, keys) each, keys its longest. A decode step attends to each run's keys only, so
    it reads at most twice a group's own prompt, not the longest prompt of the batch."""
    runs: list[tuple[int, int, int]] = []
    for i, n in enumerate(lens):
        if runs and 2 * n >= runs[-1][2]:
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, n))
    return runs


@dataclass
class RaggedLayout:
    """Where the n packed completion tokens go in the kernels' rectangles (engine/packing.py builds it
    once per micro-batch). The prompt part folds each group's tokens, its rows one after the other,
    into (Bp, M) slots, M its largest group's; the own part runs rows in buckets of like lengths,
    each (rows_b, T_b) slots with a causal bias."""
    fold: Tensor  # (n,) each token's slot in the (Bp*M) fold
    M: int
    buckets: list[tuple[Tensor, Tensor, int, int, Tensor]]  # tokens, slots, rows_b, T_b, bias


def _slots(x: Tensor, index: Tensor, count: int) -> Tensor:
    """(m, ...) -> (count, ...): x's rows at index, zeros elsewhere (no autograd: inside a
    Function)."""
    return x.new_zeros(count, *x.shape[1:]).index_put_((index,), x)


class SharedPromptAttentionRagged(torch.autograd.Function):
    """Shared-prompt attention on the packed row's rows at any lengths, in the CPU's flash kernels:
    q (n, H, D), k/v (n, Hkv, D) the rows' tokens back to back, prompt_k/v (Bp, Hkv, P, D),
    prompt_bias (Bp, 1, 1, P) its padding. The prompt part is one flash call with every group's
    tokens (and the rep query heads) folded into the query length, padded to the largest group's
    token count, not to G rows x the longest row; the own part one causal call per bucket of rows
    of like lengths. Merge and backward are SharedPromptAttentionPadded's (each part's flash
    backward with the merged output and log-sum-exp), so the gradient is exact. Returns
    (n, H, D)."""

    @staticmethod
    def forward(ctx, q, k, v, prompt_k, prompt_v, prompt_bias, layout: RaggedLayout):
        n, H, D = q.shape
        Bp, Hkv = prompt_k.shape[:2]
        out_p, lse_p = _CPU_FLASH(_fold(q, layout, Bp, Hkv), prompt_k, prompt_v,
                                  attn_mask=prompt_bias)
        out_p, lse_p = _unfold(out_p, layout, H), _unfold(lse_p, layout, H)  # (n, H, D), (n, H)
        out_o, lse_o = torch.zeros_like(out_p), torch.zeros_like(lse_p)
        for tokens, slots, rows, T, bias in layout.buckets:
            qb, kb, vb = (_by_row_slots(x[tokens], slots, rows, T, Hkv) for x in (q, k, v))
            o, lse = _CPU_FLASH(qb, kb, vb, attn_mask=bias)  # (rows, Hkv, rep*T, D)
            out_o[tokens] = _from_row_slots(o, slots, rows, T, H)
            lse_o[tokens] = _from_row_slots(lse, slots, rows, T, H)
        out, lse = merge(out_p, lse_p, out_o, lse_o)  # (n, H, D), (n, H) float32 or 64
        out = out.to(q.dtype)
        ctx.layout = layout
        ctx.save_for_backward(q, k, v, prompt_k, prompt_v, prompt_bias, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, prompt_k, prompt_v, prompt_bias, out, lse = ctx.saved_tensors
        layout = ctx.layout
        n, H, D = q.shape
        Bp, Hkv = prompt_k.shape[:2]
        grad = grad.contiguous()
        folded = [_fold(x, layout, Bp, Hkv) for x in (grad, q, out, lse)]
        dq_p, dprompt_k, dprompt_v = _CPU_FLASH_BACKWARD(
            folded[0], folded[1], prompt_k, prompt_v, folded[2], folded[3], 0.0, False,
            attn_mask=prompt_bias)
        dq = _unfold(dq_p, layout, H)  # (n, H, D)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for tokens, slots, rows, T, bias in layout.buckets:
            gb, qb, ob, lb, kb, vb = (_by_row_slots(x[tokens], slots, rows, T, Hkv)
                                      for x in (grad, q, out, lse, k, v))
            dqb, dkb, dvb = _CPU_FLASH_BACKWARD(gb, qb, kb, vb, ob, lb, 0.0, False,
                                                attn_mask=bias)
            dq[tokens] += _from_row_slots(dqb, slots, rows, T, H)
            dk[tokens] = _from_row_slots(dkb, slots, rows, T, Hkv)
            dv[tokens] = _from_row_slots(dvb, slots, rows, T, Hkv)
        return dq, dk, dv, dprompt_k, dprompt_v, None, None


def _fold(x: Tensor, layout: RaggedLayout, Bp: int, Hkv: int) -> Tensor:
    """(n, H, ...) packed -> (Bp, Hkv, M*rep, ...): each group's tokens and a kv head's rep query
    heads in the query length (a kv-head-wide x, k or v, has rep = 1)."""
    M = layout.M
    x = _slots(x, layout.fold, Bp * M)  # (Bp*M, H, ...)
    x = x.view(Bp, M, Hkv, -1, *x.shape[2:]).transpose(1, 2)  # (Bp, Hkv, M, rep, ...)
    return x.reshape(Bp, Hkv, -1, *x.shape[4:])


def _unfold(x: Tensor, layout: RaggedLayout, H: int) -> Tensor:
    """_fold's inverse: (Bp, Hkv, M*rep, ...) -> (n, H, ...)."""
    Bp, Hkv = x.shape[:2]
    x = x.view(Bp, Hkv, layout.M, H // Hkv, *x.shape[3:]).transpose(1, 2)
    return x.reshape(Bp * layout.M, H, *x.shape[4:])[layout.fold]


def _by_row_slots(x: Tensor, slots: Tensor, rows: int, T: int, Hkv: int) -> Tensor:
    """(m, H|Hkv, ...) a bucket's tokens -> (rows, Hkv, rep*T, ...): each row's tokens in T slots,
    its rep query heads one after the other (rep-major, as own_bias repeats the causal mask)."""
    x = _slots(x, slots, rows * T).view(rows, T, Hkv, -1, *x.shape[2:])  # (rows, T, Hkv, rep, .)
    return x.permute(0, 2, 3, 1, *range(4, x.dim())).reshape(rows, Hkv, -1, *x.shape[4:])


def _from_row_slots(x: Tensor, slots: Tensor, rows: int, T: int, H: int) -> Tensor:
    """_by_row_slots' inverse: (rows, Hkv, rep*T, ...) -> (m, H, ...)."""
    Hkv = x.shape[1]
    x = x.view(rows, Hkv, H // Hkv, T, *x.shape[3:]).permute(0, 3, 1, 2, *range(4, x.dim() + 1))
    return x.reshape(rows * T, H, *x.shape[4:])[slots]

# -----------------------------------------------------------------------------
# The same on CUDA: varlen flash kernels over the packed tokens themselves, nothing padded


@dataclass
class Segments:
    """One varlen kernel call: its sequences' cumulative offsets (S+1,) int32 into the packed
    queries and keys, the longest of each, and whether each sequence is causal (a query sees the
    keys up to its own position; the calls here that are causal have as many queries as keys)."""
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal: bool


@dataclass
class VarlenLayout:
    """The three calls of SharedPromptAttentionVarlen over Lp prompt tokens then the rows' tokens:
    the prompts causal; the prompt part, the rows of a group folded into one query sequence against
    their prompt's keys (one segment a group: Hydragen's fold, the prompt K/V read once per group);
    the own part, each row causal on its own keys."""
    prompt_tokens: int
    prompts: Segments
    prompt_part: Segments
    own_part: Segments


def flash_varlen(q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> tuple[Tensor, ...]:
    """CUDA's flash kernel on packed sequences (what torch >= 2.10's varlen_attn calls): q (Tq, H,
    D), k/v (Tk, Hkv, D) in bf16 or fp16, GQA by head count. Returns out (Tq, H, D), the log-sum-exp
    (H, Tq) float32, and the two tensors its backward takes back."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal, False)
    return out, lse, rng_state, unused


def flash_varlen_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          seg: Segments, rng_state: Tensor, unused: Tensor) -> tuple[Tensor, ...]:
    """flash_varlen's backward with the given out and lse (the merged ones: each part's exact
    share, as SharedPromptAttentionPadded's): dq (Tq, H, D), dk and dv (Tk, Hkv, D)."""
    return torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal,
        rng_state, unused)


FLASH_VARLEN = (flash_varlen, flash_varlen_backward)  # tests/test_attention.py: its twin


class SharedPromptAttentionVarlen(torch.autograd.Function):
    """Shared-prompt attention in CUDA's varlen flash kernel, on the packed row's tokens themselves
    (engine/packing.py's training attention on CUDA): q (L, H, D), k/v (L, Hkv, D), the Lp prompt tokens
    first, then the rows' tokens (a group's rows back to back). Three varlen calls (VarlenLayout):
    the prompts causal; the prompt part (each group's rows folded into one query sequence against
    its prompt's keys); the own part (each row causal on its own keys); the rows' two parts merged
    by log-sum-exp. Backward is SharedPromptAttentionPadded's: each part's kernel backward with the
    merged output and log-sum-exp, so the gradient is exact (the kernel's own autograd would not do:
    varlen_attn's backward drops the log-sum-exp's gradient, which a merge needs). `kernels` is the
    (forward, backward) pair: FLASH_VARLEN on CUDA (the tests' math twin on the CPU). Returns
    (L, H, D)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: VarlenLayout, kernels):
        forward, _ = kernels
        Lp = layout.prompt_tokens
        qp, kp, vp, qr, kr, vr = q[:Lp], k[:Lp], v[:Lp], q[Lp:], k[Lp:], v[Lp:]
        out_c, lse_c, *rng_c = forward(qp, kp, vp, layout.prompts)  # (Lp, H, D), (H, Lp) causal
        saved, rng_r = [out_c, lse_c], []
        out = out_c
        if len(qr):
            out_p, lse_p, *rng_p = forward(qr, kp, vp, layout.prompt_part)  # (Lc, H, D), (H, Lc)
            out_o, lse_o, *rng_o = forward(qr, kr, vr, layout.own_part)
            # merge() on the kernel's (H, Lc) log-sum-exps seen as (Lc, H): elementwise, the
            # result's memory stays (H, Lc), as the kernel's backward takes it back.
            out_r, lse_r = merge(out_p, lse_p.T, out_o, lse_o.T)
            out_r, lse_r = out_r.to(out_p.dtype), lse_r.T
            out = torch.cat([out_c, out_r])  # (L, H, D)
            saved, rng_r = saved + [out_r, lse_r], [rng_p, rng_o]
        ctx.layout, ctx.kernels, ctx.rng = layout, kernels, [rng_c] + rng_r
        ctx.save_for_backward(q, k, v, *saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out_c, lse_c, *rows = ctx.saved_tensors
        layout, (_, backward) = ctx.layout, ctx.kernels
        Lp = layout.prompt_tokens
        grad = grad.contiguous()
        qp, kp, vp, qr, kr, vr = q[:Lp], k[:Lp], v[:Lp], q[Lp:], k[Lp:], v[Lp:]
        dq, dk, dv = backward(grad[:Lp], qp, kp, vp, out_c, lse_c, layout.prompts, *ctx.rng[0])
        if rows:
            out_r, lse_r = rows
            gr = grad[Lp:]
            dq_p, dk_p, dv_p = backward(gr, qr, kp, vp, out_r, lse_r, layout.prompt_part,
                                        *ctx.rng[1])
            dq_o, dk_o, dv_o = backward(gr, qr, kr, vr, out_r, lse_r, layout.own_part,
                                        *ctx.rng[2])
            dq = torch.cat([dq, dq_p + dq_o])
            dk = torch.cat([dk + dk_p, dk_o])
            dv = torch.cat([dv + dv_p, dv_o])
        return dq, dk, dv, None, None
