"""grpo.py on a CUDA GPU: the shared-prompt chunked path against the naive one, fp32 and bf16."""

import pytest
import torch

import grpo
from test_grpo import GRAD_REL, logp_tol, ragged_batch, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_shared_chunked_equals_naive_in_fp32_and_bf16():
    G = 3
    prompts, completions = ragged_batch(G)
    batch = grpo.GRPOBatch.from_lists(prompts, completions, device="cuda")
    m = tiny_model().cuda()
    got = grpo.completion_logprobs(m, batch, chunk_size=5)
    want = grpo.completion_logprobs(m, batch, chunk_size=0, forward="naive")
    # fp32 SDPA kernels sum in their own order (TF32 is off for matmuls)
    torch.testing.assert_close(got[0], want[0], **logp_tol())
    m = m.bfloat16()
    m.inv_freq = m.inv_freq.float()  # rope tables stay float32, as from_pretrained keeps them
    with torch.no_grad():
        got = grpo.completion_logprobs(m, batch, chunk_size=5)
        want = grpo.completion_logprobs(m, batch, chunk_size=0, forward="naive")
    assert got[0].dtype == torch.float32
    # bf16 has 8 mantissa bits; logits up to ~10
    torch.testing.assert_close(got[0], want[0], atol=0.15, rtol=0)


@pytest.mark.parametrize("layout", ["4/2", "qwen3_16/8"])
def test_cuda_packed_forward_flex_attention_equals_the_padded_one_values_and_grads(monkeypatch,
                                                                                  layout):
    """The CUDA route of the padding-free forward (FlexAttention under the packed block mask,
    compiled; taken here for a tiny model, which otherwise runs padded rows eagerly) against the
    padded twin on ragged groups (1-token prompts, empty rows, an all-empty group): logprobs and
    every gradient, float32: logp_tol of values; 4 GRAD_REL of each gradient's norm (the CPU's
    bound, with room for a compiled Triton kernel's blocking that no CPU run measures). On TINY
    and on Qwen3's layout (16/8 heads of 16, its q/k norms)."""
    from engine import compiling
    from engine import packing
    from test_grpo import grads, ragged_groups, weighted_sum
    monkeypatch.setattr(compiling, "MIN_COMPILE_PARAMS", 0)
    prompts, completions = ragged_groups()
    m = tiny_model(layout=layout).cuda()
    route = packing.cuda_route(torch.float32, m.config.head_dim)
    if route[0] != "flex":
        pytest.skip(route[1])
    batch = grpo.GRPOBatch.from_lists(prompts, completions, device="cuda")
    out = {}
    for forward in ("packed", "padded"):
        logp, _ = grpo.completion_logprobs(m, batch, chunk_size=7, forward=forward)
        weighted_sum(logp.cpu(), batch.mask.cpu()).backward()
        out[forward] = logp.detach(), grads(m)
        m.zero_grad()
    torch.testing.assert_close(out["packed"][0], out["padded"][0], **logp_tol())
    for name, want in out["padded"][1].items():
        error = (out["packed"][1][name] - want).norm() / want.norm()
        assert error <= 4 * GRAD_REL, (name, float(error))


@pytest.mark.parametrize("layout", ["4/2", "qwen3_16/8"])
def test_cuda_bf16_takes_the_varlen_route_and_equals_its_math_twin_and_the_padded_one(
        monkeypatch, layout):
    """Under bf16 autocast (train.py --dtype bfloat16) the CUDA route is varlen_attn's flash kernel
    (torch >= 2.10) fed bf16 q, k, v: its logprobs and gradients against the same route with the
    kernel's math twin in its place and against the padded twin, both bf16 all through (8-bit
    mantissas: 0.1 and 0.15 on logprobs of magnitude ~5, 3% and 4% of a gradient's norm, as the
    CPU's autocast test; a dropped log-sum-exp term is tens of percent)."""
    from test_attention import MATH_VARLEN
    from test_grpo import grads, ragged_groups, weighted_sum
    from engine import attention
    from engine import packing
    if packing.cuda_route(torch.bfloat16, 16)[0] != "varlen":
        pytest.skip(packing.cuda_route(torch.bfloat16, 16)[1])
    prompts, completions = ragged_groups()
    m = tiny_model(layout=layout).cuda()  # TINY; Qwen3's 16/8 heads of 16 and q/k norms
    batch = grpo.GRPOBatch.from_lists(prompts, completions, device="cuda")
    seen = []
    forward, backward = attention.FLASH_VARLEN

    def flash(q, k, v, seg):
        seen.append((q.dtype, k.dtype, v.dtype))
        return forward(q, k, v, seg)

    def run(route, name="packed"):
        if route is not None:
            monkeypatch.setattr(packing, "packed_attention", route)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, _ = grpo.completion_logprobs(m, batch, chunk_size=7, forward=name)
        weighted_sum(logp.float().cpu(), batch.mask.cpu()).backward()
        out = logp.detach(), grads(m)
        m.zero_grad()
        return out
    got = run(lambda p, rep, compiles=True: packing.packed_attention_varlen(p, (flash, backward)))
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    twin = run(lambda p, rep, compiles=True: packing.packed_attention_varlen(p, MATH_VARLEN))
    padded = run(None, "padded")
    for want, atol, rel in ((twin, 0.1, 0.03), (padded, 0.15, 0.04)):
        torch.testing.assert_close(got[0], want[0], atol=atol, rtol=0)
        for name, g in want[1].items():
            assert (got[1][name] - g).norm() <= rel * g.norm(), name



@pytest.mark.parametrize("layout", ["4/2", "qwen3_16/8"])
def test_cuda_compiled_blocks_equal_the_eager_ones_in_bf16_one_graph_for_every_length(layout):
    """train.py's default on CUDA: the blocks' regions compiled by inductor (Triton kernels) with
    the bf16 attention route between them, against the same model eager, on micro-batches of three
    packed lengths: logprobs and gradients within bf16's resolution (0.1 on logprobs, 3% of a
    gradient's norm, 5% of a q/k norm's: fused kernels round in another order), and two graphs
    in all. On TINY and
    on Qwen3's layout (its q/k norms inside the region before the attention)."""
    import copy
    from torch._dynamo.utils import counters
    from engine import compiling
    from test_grpo import grads, ragged_batch, ragged_groups, weighted_sum
    eager = tiny_model(layout=layout).cuda()
    m = copy.deepcopy(eager)
    compiling.compile_blocks(m.model.layers)
    torch._dynamo.reset()
    counters.clear()
    for prompts, completions in (ragged_groups(), ragged_batch(3), ragged_groups(seed=5)):
        batch = grpo.GRPOBatch.from_lists(prompts, completions, device="cuda")
        out = []
        for model in (m, eager):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp, _ = grpo.completion_logprobs(model, batch, chunk_size=7)
            weighted_sum(logp.cpu(), batch.mask.cpu()).backward()
            out.append((logp.detach(), grads(model)))
            model.zero_grad()
        torch.testing.assert_close(out[0][0], out[1][0], atol=0.1, rtol=0)
        for name, g in out[1][1].items():
            # A q/k norm's weight (D of them) sums its gradient over every token and head, with
            # more cancellation than a matrix's: 3.04% of its norm on an H200 (k_norm, Qwen3).
            rel = 0.05 if name.endswith(("q_norm.weight", "k_norm.weight")) else 0.03
            assert (out[0][1][name] - g).norm() <= rel * g.norm(), name
        assert counters["stats"]["unique_graphs"] == 2
