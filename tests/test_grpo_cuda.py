"""grpo.py on a CUDA GPU: the shared-prompt chunked path against the naive one, fp32 and bf16."""

import pytest
import torch

import grpo
from test_grpo import ragged_batch, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_shared_chunked_equals_naive_in_fp32_and_bf16():
    G = 3
    prompts, completions = ragged_batch(G)
    batch = grpo.GRPOBatch.from_lists(prompts, completions, device="cuda")
    m = tiny_model().cuda()
    got = grpo.completion_logprobs(m, batch, chunk_size=5)
    want = grpo.completion_logprobs(m, batch, chunk_size=0, forward="naive")
    # fp32 SDPA kernels differ from the CPU's
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
    m = m.bfloat16()
    m.inv_freq = m.inv_freq.float()  # rope tables stay float32, as from_pretrained keeps them
    with torch.no_grad():
        got = grpo.completion_logprobs(m, batch, chunk_size=5)
        want = grpo.completion_logprobs(m, batch, chunk_size=0, forward="naive")
    assert got[0].dtype == torch.float32
    # bf16 has 8 mantissa bits; logits up to ~10
    torch.testing.assert_close(got[0], want[0], atol=0.15, rtol=0)


def test_cuda_packed_forward_flex_attention_equals_the_padded_one_values_and_grads():
    """The CUDA route of the padding-free forward (FlexAttention under the packed block mask,
    compiled) against the padded twin on ragged groups (1-token prompts, empty rows, an all-empty
    group): logprobs and every gradient, float32 (other kernels: 1e-4 of values, 1e-4 of each
    gradient's norm)."""
    from test_grpo import grads, ragged_groups, weighted_sum
    prompts, completions = ragged_groups()
    m = tiny_model().cuda()
    batch = grpo.GRPOBatch.from_lists(prompts, completions, device="cuda")
    out = {}
    for forward in ("packed", "padded"):
        logp, _ = grpo.completion_logprobs(m, batch, chunk_size=7, forward=forward)
        weighted_sum(logp.cpu(), batch.mask.cpu()).backward()
        out[forward] = logp.detach(), grads(m)
        m.zero_grad()
    torch.testing.assert_close(out["packed"][0], out["padded"][0], atol=1e-4, rtol=0)
    for name, want in out["padded"][1].items():
        error = (out["packed"][1][name] - want).norm() / want.norm()
        assert error <= 1e-4, (name, float(error))
