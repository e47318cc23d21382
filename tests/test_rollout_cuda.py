"""rollout.py on a CUDA GPU: the graph-captured decode step against eager decode and the trainer."""

import pytest
import torch

from model import Llama
from engine.decode import KVCache
from engine.sampling import draw
from rollout import NonFiniteLogits, RolloutConfig, generate
from test_rollout import CFG, PROMPTS, logprob_tol, poisoned_at, trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CFG).init_weights(seed=0, std=0.2).eval()


def test_cuda_graph_decode_equals_eager_decode(model):
    gpu = Llama(CFG).to("cuda")
    gpu.load_state_dict(model.state_dict())
    cache = KVCache.for_batch(CFG, len(PROMPTS), 4, 11, 30, torch.float32, "cuda")  # fp32 KV: exact comparison
    knobs = dict(num_samples=4, max_new_tokens=30, temperature=0.9, sync_every=2)
    # No stop id: no row is dropped, so both draw the same random numbers and sample alike.
    graphed = generate(gpu, PROMPTS, RolloutConfig(cuda_graphs=True, **knobs), seed=1, cache=cache)
    eager = generate(gpu, PROMPTS, RolloutConfig(cuda_graphs=False, **knobs), seed=1, cache=cache)
    assert torch.equal(graphed.tokens, eager.tokens)
    # float32 kernels of the two paths sum in their own orders (TF32 is off for matmuls)
    tol = logprob_tol(model, 0.9)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, **tol)
    # With stop ids rows are dropped: the graphed path pads the rest up to a graph's bucket (1, 2,
    # 4, 8, then every 16; none captured again) on the whole grid, eager compacts them: compare each
    # with the trainer's forward.
    for graphs in (True, False):
        out = generate(gpu, PROMPTS, RolloutConfig(cuda_graphs=graphs, **knobs),
                       stop_ids=(5, 9, 17, 23, 31), seed=1, cache=cache)
        assert out.stats["compactions"] >= 1 and not out.mask.all()
        logprobs = out.logprob_lists()
        for row, completion in enumerate(out.completions()):
            expected = trainer_logprobs(gpu, PROMPTS[row // 4], completion, 0.9, 0, 1.0).cpu()
            torch.testing.assert_close(torch.tensor(logprobs[row]), expected, **tol)
    # A private cache: bf16 on CUDA.
    bf16 = generate(gpu, PROMPTS, RolloutConfig(num_samples=4, max_new_tokens=30), seed=1)
    assert bf16.mask.all() and bf16.tokens.shape == (len(PROMPTS) * 4, 30)


def test_episodes_on_cuda_score_as_the_trainer_with_graphs_and_without(model):
    """A tool's observations fed into rows on the GPU (graphed lockstep steps until the first tool
    turn, then eager rows at their own lengths): each sampled token's logprob equals the trainer's
    forward of prompt + episode, as above; observation tokens carry 0."""
    from test_episodes import STOPS, episodes
    gpu = Llama(CFG).to("cuda")
    gpu.load_state_dict(model.state_dict())
    cache = KVCache.for_batch(CFG, len(PROMPTS), 4, 11, 30, torch.float32, "cuda")
    for graphs in (True, False):
        cfg = RolloutConfig(num_samples=4, max_new_tokens=30, temperature=0.9, sync_every=2,
                            cuda_graphs=graphs)
        out = generate(gpu, PROMPTS, cfg, stop_ids=STOPS, seed=1, cache=cache,
                       episodes=episodes(3))
        assert sum(out.stats["calls"]) > 0 and out.stats["tool_turns"] > 0
        for row, episode in enumerate(out.completions()):
            policy = out.sampled[row, :len(episode)].cpu()
            got = out.logprobs[row, :len(episode)].cpu()
            want = trainer_logprobs(gpu, PROMPTS[row // 4], episode, 0.9, 0, 1.0).cpu()
            assert (got[~policy] == 0).all()
            torch.testing.assert_close(got[policy], want[policy], **logprob_tol(model, 0.9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rollout_without_a_call_equals_the_tool_less_one_with_graphs_and_without(model, dtype):
    """Issue 43, item 5: the episode loop dropped finished rows at other syncs than the tool-less
    rollout: the rows, and then the draws, differed on CUDA. One loop, one rule (rows drop at
    every sync; a graph per bucket of rows, padded up): a task's tool that is never called
    leaves the rollout as it was, bit for bit, graphed (compiled in bf16) and eager, with the
    same drops."""
    from engine.episodes import Episodes
    gpu = Llama(CFG).to("cuda", dtype)
    gpu.load_state_dict(model.state_dict())
    cache = KVCache.for_batch(CFG, len(PROMPTS), 4, 11, 30, dtype, "cuda")
    # A call id outside the vocabulary: no row can sample it, whatever the GPU's draws.
    never = Episodes(lambda calls: [[9] for _ in calls], (CFG.vocab_size,), 2)
    stops = (5, 9, 17, 23, 31)  # most rows stop within 30 tokens: rows are dropped
    for graphs in (True, False):
        cfg = RolloutConfig(num_samples=4, max_new_tokens=30, temperature=1.0, sync_every=2,
                            cuda_graphs=graphs)
        plain = generate(gpu, PROMPTS, cfg, stop_ids=stops, seed=5, cache=cache)
        with_tool = generate(gpu, PROMPTS, cfg, stop_ids=stops, seed=5, cache=cache,
                             episodes=never)
        assert sum(with_tool.stats["calls"]) == 0 and plain.stats["compactions"] > 0
        assert with_tool.stats["compactions"] == plain.stats["compactions"]
        for key in ("tokens", "mask", "logprobs", "stopped"):
            assert torch.equal(getattr(plain, key), getattr(with_tool, key)), (graphs, key)


def test_sample_on_cuda_draws_the_distribution_by_its_exponential_race():
    """draw() on CUDA takes sampling.exponential_race (the CPU, inverse_cdf): the race's tokens
    on clocks wound from the same seed (it once drew by inverse_cdf on CUDA too), and goodness of
    fit of 200,000 draws against the softmax; the logprobs are the softmax's at the drawn
    tokens."""
    from engine import sampling
    from test_rollout import chi_square_excess
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 2
    logits[::7] = float("-inf")
    probs = logits.softmax(dim=-1)
    generator = torch.Generator("cuda").manual_seed(0)
    batch = logits.cuda().expand(20000, -1)
    draws = [draw(batch, 1.0, 0, 1.0, generator) for _ in range(10)]
    clocks = sampling.race_clocks(batch, 1.0, torch.Generator("cuda").manual_seed(0))
    assert torch.equal(draws[0][0], sampling.exponential_race(batch.softmax(-1), *clocks))
    tokens = torch.cat([t for t, _ in draws]).cpu()
    assert chi_square_excess(tokens, probs) < 5
    torch.testing.assert_close(torch.cat([lp for _, lp in draws]).cpu(), probs.log()[tokens])


def test_bf16_decode_attention_runs_the_fused_kernel_and_equals_the_plain_merge():
    """In bf16 the decode step's attention is decode.shared_prompt_attention_decode_cuda through SDPA's
    memory-efficient kernel (decode.efficient_attention) at the Qwen2.5-0.5B head shape, ragged
    prompts (the 16-aligned bias) and own keys past the step masked: against shared_prompt_attention in
    float64 on the same bf16 inputs. Tolerance: the kernel's bf16 partial outputs."""
    from engine import decode
    from engine.attention import shared_prompt_attention
    gen = torch.Generator().manual_seed(0)
    Bp, G, H, Hkv, D, P, T, t = 3, 4, 14, 2, 64, 70, 40, 25
    q, k, v = (torch.randn(shape, generator=gen).to("cuda", torch.bfloat16)
               for shape in [(Bp * G, H, 1, D)] + [(Bp * G, Hkv, T, D)] * 2)
    prompt_k, prompt_v = torch.randn(2, Bp, Hkv, P, D, generator=gen).to("cuda", torch.bfloat16)
    valid = torch.arange(P, device="cuda") < torch.tensor([70, 33, 1], device="cuda")[:, None]
    bias = torch.zeros(Bp, 80, dtype=torch.bfloat16, device="cuda")[:, :P]
    bias = bias.masked_fill_(~valid, float("-inf"))[:, None, None]
    unwritten = torch.arange(T, device="cuda") > t
    own_bias = torch.zeros(T, dtype=torch.bfloat16, device="cuda")
    own_bias = own_bias.masked_fill_(unwritten, float("-inf"))[None, None, None]
    got = decode.shared_prompt_attention_decode_cuda(q, k, v, own_bias, prompt_k, prompt_v, bias,
                                         decode.efficient_attention)
    wide = [x.double() for x in (q, k, v, prompt_k, prompt_v)]
    expected = shared_prompt_attention(*wide[:3], ~unwritten[None, None], *wide[3:], valid)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-2)


@pytest.mark.parametrize("compiled", ["true", "false"])
def test_bf16_decode_scores_as_the_trainer_with_graphs_and_without(model, compiled):
    """A bf16 sampler on the GPU (the fused kernel's route, compiled or eager, rows dropped and
    graphs re-captured): each sampled token's logprob equals the bf16 trainer forward's within
    bf16's rounding of logits of size ~5 (tests/test_rollout.py's bf16 CPU test: 0.1)."""
    gpu = Llama(CFG).to("cuda", torch.bfloat16)
    gpu.load_state_dict(model.state_dict())
    for graphs in (True, False):
        cfg = RolloutConfig(num_samples=4, max_new_tokens=30, temperature=0.9, sync_every=2,
                            cuda_graphs=graphs, compile_decode=compiled)
        out = generate(gpu, PROMPTS, cfg, stop_ids=(5, 9, 17, 23, 31), seed=1)
        assert out.stats["compactions"] >= 1
        logprobs = out.logprob_lists()
        for row, completion in enumerate(out.completions()):
            expected = trainer_logprobs(gpu, PROMPTS[row // 4], completion, 0.9, 0, 1.0).float()
            torch.testing.assert_close(torch.tensor(logprobs[row]), expected.cpu(), rtol=0,
                                       atol=0.1)


def test_nan_or_inf_logits_on_cuda_stop_the_rollout_naming_the_step(model):
    """The race on CUDA, with CUDA graphs and without: NaN or +inf logits at decode step 3 stop
    the rollout at the next check with one line naming step 3 (no sync of its own: the check
    finds the NaN logprob the race gave the row), where the race drew token 0 in silence."""
    gpu = Llama(CFG).to("cuda")
    gpu.load_state_dict(model.state_dict())
    for value in (float("nan"), float("inf")):
        for graphs in (True, False):
            cfg = RolloutConfig(num_samples=2, max_new_tokens=8, temperature=0.9, sync_every=2,
                                cuda_graphs=graphs)
            with pytest.raises(NonFiniteLogits, match="at decode step 3 "):
                generate(gpu, PROMPTS, cfg, stop_ids=(5,), seed=0,
                         logits_fn=poisoned_at(3, 1, value))
