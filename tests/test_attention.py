"""engine/attention.py: the attention over a prompt shared by a group of rows against its slow twin,
the prompt copied per row and one masked softmax (values and gradients)."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from engine import attention
import tolerance
from engine.attention import Segments

# Query heads / kv heads: the tiny models' 4/2, and published layouts (Qwen3-0.6B's 16/8, Qwen2.5-
# 0.5B's 14/2). At 4/2 rep = Hkv = 2, so a fold that reads the heads as (rep, Hkv) instead of (Hkv,
# rep), mapping query head h to kv head h // Hkv, gives the same numbers as h // rep; not at these.
HEADS = [(4, 2), (16, 8), (14, 2)]


@pytest.mark.parametrize("H, Hkv", HEADS)
def test_shared_prompt_attention_equals_concatenated_keys_values_and_grads(H, Hkv):
    torch.manual_seed(0)
    Bp, G, P, T, D = 2, 3, 5, 4, 8
    q = torch.randn(Bp * G, H, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(Bp * G, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(Bp * G, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    pk = torch.randn(Bp, Hkv, P, D, dtype=torch.float64, requires_grad=True)
    pv = torch.randn(Bp, Hkv, P, D, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(Bp, P, dtype=torch.bool)
    valid[1, 3:] = False  # right padding of the second prompt
    own = torch.ones(T, T, dtype=torch.bool).tril()[None]
    out = attention.shared_prompt_attention(q, k, v, own, pk, pv, valid)
    # Slow twin: copy the prompt G times, concatenate, one masked softmax.
    K = torch.cat([pk.repeat_interleave(G, 0), k], 2)
    V = torch.cat([pv.repeat_interleave(G, 0), v], 2)
    mask = torch.cat([valid.repeat_interleave(G, 0)[:, None, :].expand(-1, T, -1), own.expand(Bp * G, -1, -1)], 2)
    ref = F.scaled_dot_product_attention(q, K, V, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)  # float64: only summation order differs
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out * w).sum(), [q, k, v, pk, pv])
    grads_ref = torch.autograd.grad((ref * w).sum(), [q, k, v, pk, pv])
    for g, gr in zip(grads, grads_ref):
        torch.testing.assert_close(g, gr, atol=1e-12, rtol=1e-12)


def assert_values_and_grads_equal(out, ref, inputs, depth: int) -> tuple:
    """out equals ref, and so do their gradients (of a random projection) with respect to the
    inputs q, k, v, prompt_k, prompt_v; returns out's gradients. The same math summed in another
    order: float64 to 1e-12; float32 from `depth`, the longest chain of sums behind a value or a
    gradient, at that tensor's magnitude (tests/tolerance.py)."""
    tol = functools.partial(tolerance.twins, depth)
    torch.testing.assert_close(out, ref, **tol(ref))
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((ref * w).sum(), inputs)
    for name, a, b in zip("q k v prompt_k prompt_v".split(), got, want):
        torch.testing.assert_close(a, b, **tol(b), msg=name)
    return got


@pytest.mark.skipif(not attention.CPU_FLASH, reason="this torch has no CPU flash attention kernels")
@pytest.mark.parametrize("H, Hkv", HEADS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shared_prompt_attention_padded_equals_the_repeated_prompt_values_and_grads(dtype, H, Hkv):
    """The training path (two flash kernels, merged by log-sum-exp, flash backward with the merged
    output) against its slow twin (the prompt copied per row, one masked SDPA), ragged prompts,
    GQA layouts (HEADS). Only the summation order differs: a score sums D terms, a softmax and its
    output the P + T keys, a prompt key's gradient the G*rep*T queries of its group."""
    torch.manual_seed(0)
    Bp, G, P, T, D = 3, 4, 9, 6, 8

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)
    q, k, v = leaf(Bp * G, H, T, D), leaf(Bp * G, Hkv, T, D), leaf(Bp * G, Hkv, T, D)
    pk, pv = leaf(Bp, Hkv, P, D), leaf(Bp, Hkv, P, D)
    valid = torch.arange(P) < torch.tensor([9, 4, 1])[:, None]  # right padding, one 1-token prompt
    prompt_bias = torch.zeros(Bp, 1, 1, P, dtype=dtype)
    prompt_bias = prompt_bias.masked_fill(~valid[:, None, None], -math.inf)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    own_bias = torch.zeros(T, T, dtype=dtype).masked_fill(future, -math.inf).repeat(H // Hkv, 1)
    out = attention.SharedPromptAttentionPadded.apply(q, k, v, pk, pv, prompt_bias, own_bias[None, None])
    ref = attention.shared_prompt_attention_repeated(q, k, v, pk, pv, valid)
    depth = D + P + T + G * (H // Hkv) * T
    got = assert_values_and_grads_equal(out, ref, [q, k, v, pk, pv], depth)
    assert got[3][1, :, 4:].abs().max() == 0  # the padding of prompt 1 gets no gradient


@pytest.mark.skipif(not attention.CPU_FLASH, reason="this torch has no CPU flash attention kernels")
@pytest.mark.parametrize("H, Hkv", HEADS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shared_prompt_attention_ragged_equals_the_repeated_prompt_values_and_grads(dtype, H, Hkv):
    """The packed route (rows of any lengths back to back: each group's tokens folded against its
    prompt, rows in buckets of like lengths) against the slow twin on the same rows padded: rows
    of 0 to 9 tokens, a group of empty rows, ragged prompts, GQA layouts (HEADS). Tolerances as
    above."""
    from engine import packing
    torch.manual_seed(1)
    Bp, G, P, D = 3, 3, 7, 8
    lens = torch.tensor([9, 0, 4, 0, 0, 0, 2, 8, 1])  # (N,) row inputs; group 1 is empty
    T = int(lens.max())
    N = Bp * G
    prompt_lens = torch.tensor([7, 3, 1])
    valid = torch.arange(P) < prompt_lens[:, None]
    n = int(lens.sum())

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)
    q, k, v = leaf(n, H, D), leaf(n, Hkv, D), leaf(n, Hkv, D)  # packed, row after row
    pk, pv = leaf(Bp, Hkv, P, D), leaf(Bp, Hkv, P, D)
    fake = packing.Packing(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(0), torch.zeros(0),
                           torch.zeros(0), prompt_lens, lens, (Bp, P, N, T))
    layout = packing.ragged_layout(fake, H // Hkv, dtype)
    bias = torch.zeros(Bp, P, dtype=dtype).masked_fill(~valid, -math.inf)[:, None, None]
    out = attention.SharedPromptAttentionRagged.apply(q, k, v, pk, pv, bias, layout)  # (n, H, D)
    # The twin: the same tokens padded to (N, T) rows, the prompt repeated per row.
    where = (torch.arange(T) < lens[:, None]).flatten().nonzero()[:, 0]  # (n,) slots in N*T

    def padded(x):  # (n, h, D) -> (N, h, T, D)
        return x.new_zeros(N * T, *x.shape[1:]).index_put((where,), x).view(
            N, T, *x.shape[1:]).transpose(1, 2)
    ref = attention.shared_prompt_attention_repeated(padded(q), padded(k), padded(v), pk, pv, valid)
    ref = ref.transpose(1, 2).reshape(N * T, H, D)[where]  # (n, H, D)
    depth = D + P + T + (H // Hkv) * n  # a prompt key's gradient: its group's queries, < n
    got = assert_values_and_grads_equal(out, ref, [q, k, v, pk, pv], depth)
    assert got[3][1].abs().max() == 0  # the empty group's prompt gets no gradient
    assert layout.M == 9 + 4 and len(layout.buckets) == 3  # rows of 9, 8 | 4, 2 | 1

# -----------------------------------------------------------------------------
# The CUDA route's varlen kernels, with their math twin standing in on the CPU

def _segment_mask(seg: Segments, Tq: int, Tk: int) -> Tensor:
    """(Tq, Tk) bool: a query sees the keys of its own sequence (up to its position if causal)."""
    cu_q, cu_k = seg.cu_q.long(), seg.cu_k.long()
    of_q = torch.searchsorted(cu_q, torch.arange(Tq, device=cu_q.device), right=True) - 1
    of_k = torch.searchsorted(cu_k, torch.arange(Tk, device=cu_k.device), right=True) - 1
    allowed = of_q[:, None] == of_k[None, :]
    if seg.causal:  # as many queries as keys: position within the sequence, both sides
        at_q = torch.arange(Tq, device=cu_q.device) - cu_q[of_q]
        at_k = torch.arange(Tk, device=cu_k.device) - cu_k[of_k]
        allowed &= at_k[None, :] <= at_q[:, None]
    return allowed


def math_varlen(q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> tuple[Tensor, ...]:
    """flash_varlen's slow twin in plain tensor ops, any device and dtype (float64 included): the
    CPU stands it in for the CUDA kernel to test SharedPromptAttentionVarlen's fold, merge and
    backward. The log-sum-exp in float32 (float64 for float64), as the kernel's."""
    dt = torch.promote_types(q.dtype, torch.float32)
    rep = q.shape[1] // k.shape[1]
    kr, vr = (x.to(dt).repeat_interleave(rep, 1) for x in (k, v))  # (Tk, H, D)
    scores = torch.einsum("qhd,khd->hqk", q.to(dt), kr) / math.sqrt(q.shape[-1])  # (H, Tq, Tk)
    scores = scores.masked_fill(~_segment_mask(seg, q.shape[0], k.shape[0]), -torch.inf)
    lse = torch.logsumexp(scores, -1)  # (H, Tq)
    probs = torch.exp(scores - lse.clamp_min(-1e30)[..., None])  # a query with no key: 0
    out = torch.einsum("hqk,khd->qhd", probs, vr).to(q.dtype)  # (Tq, H, D)
    return out, lse, None, None


def math_varlen_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         seg: Segments, rng_state=None, unused=None) -> tuple[Tensor, ...]:
    """flash_varlen_backward's slow twin: the flash backward's formulas with the given out and
    lse, probabilities exp(scores - lse), dS = P * (dP - rowsum(dO * O))."""
    dt = torch.promote_types(q.dtype, torch.float32)
    H, Hkv, scale = q.shape[1], k.shape[1], 1 / math.sqrt(q.shape[-1])
    rep = H // Hkv
    qf, gf, of = (x.to(dt) for x in (q, grad, out))
    kr, vr = (x.to(dt).repeat_interleave(rep, 1) for x in (k, v))  # (Tk, H, D)
    scores = torch.einsum("qhd,khd->hqk", qf, kr) * scale
    scores = scores.masked_fill(~_segment_mask(seg, q.shape[0], k.shape[0]), -torch.inf)
    probs = torch.exp(scores - lse.to(dt).clamp_min(-1e30)[..., None])  # (H, Tq, Tk)
    dv = torch.einsum("hqk,qhd->khd", probs, gf)  # (Tk, H, D)
    dprobs = torch.einsum("qhd,khd->hqk", gf, vr)
    dscores = probs * (dprobs - (gf * of).sum(-1).T[..., None])  # (H, Tq, Tk)
    dq = torch.einsum("hqk,khd->qhd", dscores, kr) * scale
    dk = torch.einsum("hqk,qhd->khd", dscores, qf) * scale  # (Tk, H, D)

    def per_kv_head(x: Tensor) -> Tensor:  # (Tk, H, D) -> (Tk, Hkv, D): the rep heads' sum
        return x.view(x.shape[0], Hkv, rep, -1).sum(2)
    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


MATH_VARLEN = (math_varlen, math_varlen_backward)


def packed_mask(prompt_lens: list[int], row_lens: list[int], G: int) -> torch.Tensor:
    """(L, L) bool over [prompts; rows]: a prompt causal on itself, a row on its group's whole
    prompt and causally on itself (what the packed row's attention must compute)."""
    segment, group, position = [], [], []
    for b, n in enumerate(prompt_lens):
        segment += [b] * n
        group += [b] * n
        position += list(range(n))
    for i, n in enumerate(row_lens):
        segment += [len(prompt_lens) + i] * n
        group += [i // G] * n
        position += list(range(n))
    segment, group, position = (torch.tensor(x) for x in (segment, group, position))
    is_prompt = torch.arange(len(segment)) < sum(prompt_lens)
    own = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    prompt_part = ~is_prompt[:, None] & is_prompt[None, :] & (group[:, None] == group[None, :])
    return own | prompt_part


@pytest.mark.parametrize("H, Hkv", HEADS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shared_prompt_attention_varlen_equals_one_masked_softmax_values_and_grads(dtype, H, Hkv):
    """The CUDA route's fold and merge (packing.varlen_layout's three calls: prompts causal, each
    group's rows against its prompt, each row causal; merged by log-sum-exp; backward with the
    merged output) with the kernel's math twin in its place, against one masked softmax over the
    packed tokens: ragged prompts (1 token too), rows of 0 to 9 tokens, a group of empty rows, GQA
    layouts (HEADS). Tolerances as above: a prompt key's gradient sums its group's queries
    (< L rep)."""
    from engine import packing
    torch.manual_seed(2)
    Bp, G, D = 3, 3, 8
    prompt_lens, row_lens = [7, 3, 1], [9, 0, 4, 0, 0, 0, 2, 8, 1]
    L = sum(prompt_lens) + sum(row_lens)
    fake = packing.Packing(torch.zeros(1, L), torch.zeros(1, L), torch.zeros(sum(prompt_lens)),
                           torch.zeros(sum(row_lens)), torch.zeros(0), torch.tensor(prompt_lens),
                           torch.tensor(row_lens), (Bp, 7, Bp * G, 9))
    layout = packing.varlen_layout(fake)

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)
    q, k, v = leaf(L, H, D), leaf(L, Hkv, D), leaf(L, Hkv, D)
    out = attention.SharedPromptAttentionVarlen.apply(q, k, v, layout, MATH_VARLEN)  # (L, H, D)
    mask = packed_mask(prompt_lens, row_lens, G)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True).transpose(0, 1)
    depth = D + max(prompt_lens) + max(row_lens) + (H // Hkv) * L
    tol = functools.partial(tolerance.twins, depth)
    torch.testing.assert_close(out, ref, **tol(ref))
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), [q, k, v])
    want = torch.autograd.grad((ref * w).sum(), [q, k, v])
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, **tol(b), msg=name)
    assert (layout.prompt_part.max_q, layout.own_part.max_q, layout.prompts.max_k) == (13, 9, 7)
