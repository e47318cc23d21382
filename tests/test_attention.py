"""attention.py: the attention over a prompt shared by a group of rows against its slow twin,
the prompt copied per row and one masked softmax (values and gradients)."""

import math

import pytest
import torch
import torch.nn.functional as F

import attention
import tolerance


def test_prefix_attention_equals_concatenated_keys_values_and_grads():
    torch.manual_seed(0)
    Bp, G, H, Hkv, P, T, D = 2, 3, 4, 2, 5, 4, 8
    q = torch.randn(Bp * G, H, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(Bp * G, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(Bp * G, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    pk = torch.randn(Bp, Hkv, P, D, dtype=torch.float64, requires_grad=True)
    pv = torch.randn(Bp, Hkv, P, D, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(Bp, P, dtype=torch.bool)
    valid[1, 3:] = False  # right padding of the second prompt
    own = torch.ones(T, T, dtype=torch.bool).tril()[None]
    out = attention.prefix_attention(q, k, v, own, pk, pv, valid)
    # Slow twin: copy the prefix G times, concatenate, one masked softmax.
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
    inputs q, k, v, prefix_k, prefix_v; returns out's gradients. The same math summed in another
    order: float64 to 1e-12; float32 from `depth`, the longest chain of sums behind a value or a
    gradient, at that tensor's magnitude (tests/tolerance.py)."""
    def tol(want: torch.Tensor) -> dict:
        if want.dtype == torch.float64:
            return dict(rtol=1e-12, atol=1e-12)
        return tolerance.reordered(depth, want.abs().max())
    torch.testing.assert_close(out, ref, **tol(ref))
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((ref * w).sum(), inputs)
    for name, a, b in zip("q k v prefix_k prefix_v".split(), got, want):
        torch.testing.assert_close(a, b, **tol(b), msg=name)
    return got


@pytest.mark.skipif(not attention.CPU_FLASH, reason="this torch has no CPU flash attention kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shared_prefix_attention_equals_repeated_prefix_values_and_grads(dtype):
    """The training path (two flash kernels, merged by log-sum-exp, flash backward with the merged
    output) against its slow twin (the prefix copied per row, one masked SDPA), ragged prefixes,
    GQA (rep 2). Only the summation order differs: a score sums D terms, a softmax and its
    output the P + T keys, a prompt key's gradient the G*rep*T queries of its group."""
    torch.manual_seed(0)
    Bp, G, H, Hkv, P, T, D = 3, 4, 4, 2, 9, 6, 8

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)
    q, k, v = leaf(Bp * G, H, T, D), leaf(Bp * G, Hkv, T, D), leaf(Bp * G, Hkv, T, D)
    pk, pv = leaf(Bp, Hkv, P, D), leaf(Bp, Hkv, P, D)
    valid = torch.arange(P) < torch.tensor([9, 4, 1])[:, None]  # right padding, one 1-token prompt
    prompt_bias = torch.zeros(Bp, 1, 1, P, dtype=dtype)
    prompt_bias = prompt_bias.masked_fill(~valid[:, None, None], -math.inf)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    own_bias = torch.zeros(T, T, dtype=dtype).masked_fill(future, -math.inf).repeat(H // Hkv, 1)
    out = attention.SharedPrefixAttention.apply(q, k, v, pk, pv, prompt_bias, own_bias[None, None])
    ref = attention.repeated_prefix_attention(q, k, v, pk, pv, valid)
    depth = D + P + T + G * (H // Hkv) * T
    got = assert_values_and_grads_equal(out, ref, [q, k, v, pk, pv], depth)
    assert got[3][1, :, 4:].abs().max() == 0  # the padding of prefix 1 gets no gradient


@pytest.mark.skipif(not attention.CPU_FLASH, reason="this torch has no CPU flash attention kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ragged_prefix_attention_equals_repeated_prefix_values_and_grads(dtype):
    """The packed route (rows of any lengths back to back: each group's tokens folded against its
    prompt, rows in buckets of like lengths) against the slow twin on the same rows padded: rows
    of 0 to 9 tokens, a group of empty rows, ragged prompts, GQA (rep 2). Tolerances as above."""
    import packing
    torch.manual_seed(1)
    Bp, G, H, Hkv, P, D = 3, 3, 4, 2, 7, 8
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
    out = attention.RaggedPrefixAttention.apply(q, k, v, pk, pv, bias, layout)  # (n, H, D)
    # The twin: the same tokens padded to (N, T) rows, the prompt repeated per row.
    where = (torch.arange(T) < lens[:, None]).flatten().nonzero()[:, 0]  # (n,) slots in N*T

    def padded(x):  # (n, h, D) -> (N, h, T, D)
        return x.new_zeros(N * T, *x.shape[1:]).index_put((where,), x).view(
            N, T, *x.shape[1:]).transpose(1, 2)
    ref = attention.repeated_prefix_attention(padded(q), padded(k), padded(v), pk, pv, valid)
    ref = ref.transpose(1, 2).reshape(N * T, H, D)[where]  # (n, H, D)
    depth = D + P + T + (H // Hkv) * n  # a prompt key's gradient: its group's queries, < n
    got = assert_values_and_grads_equal(out, ref, [q, k, v, pk, pv], depth)
    assert got[3][1].abs().max() == 0  # the empty group's prompt gets no gradient
    assert layout.M == 9 + 4 and len(layout.buckets) == 3  # rows of 9, 8 | 4, 2 | 1
