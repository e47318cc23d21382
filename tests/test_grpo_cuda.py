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
