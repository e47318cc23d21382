"""
Tests of rollout.py, each clever path against its slow twin: the KV-cached, prefill-once, shared-prompt,
row-dropping sampler against full recomputation with model(tokens) on every step.

Tiny fp32 model with large init std (0.2, entropy ~3.8 of 4.85 nats) so the next-token distributions are far from flat.
Float32 logprobs by two paths (the cached decode and one full forward, fused and plain kernels) sum
the same terms in other orders: logprob_tol, from the forward's chain of sums and the logits'
magnitude (tests/tolerance.py), not from what one CPU printed.
"""

import dataclasses

import pytest
import torch

import tolerance
from memtrace import allocator_peak

from engine import attention
from engine import decode
import rollout
from engine import sampling
from engine.attention import shared_prompt_attention
from model import Llama, ModelConfig
from engine.decode import KVCache
from engine.sampling import draw, filter_logits
from engine.precision import native_bf16
from rollout import Rollout, RolloutConfig

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96)
# Qwen3's block at the same width: per-head q/k norms, 8/4 heads of 16 (H*D != C, rep 2 != Hkv 4)
QWEN3 = dataclasses.replace(CFG, architecture="Qwen3ForCausalLM", num_attention_heads=8,
                            num_key_value_heads=4, head_dim=16)
PROMPTS = [[3, 17, 5, 99, 42, 8, 1], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7]]


def generate(model: Llama, prompts: list[list[int]], *, stop_ids=(), seed=None, cache=None,
             logits_fn=None, **knobs) -> Rollout:
    """rollout.generate with the sampling knobs given as keywords (a RolloutConfig is built)."""
    return rollout.generate(model, prompts, RolloutConfig(**knobs), stop_ids=stop_ids, seed=seed,
                            cache=cache, logits_fn=logits_fn)


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CFG).init_weights(seed=0, std=0.2).eval()


def qwen3_model(seed: int = 0) -> Llama:
    """A Qwen3 model at std 0.2, its q/k norm weights around 1 (not 1: a misplaced one shows)."""
    m = Llama(QWEN3).init_weights(seed=seed, std=0.2).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return m


@pytest.fixture(scope="module")
def qwen3() -> Llama:
    return qwen3_model()


def last_logits(model: Llama, seqs: list[list[int]]) -> torch.Tensor:
    """The slow twin of a decode step: the whole right-padded batch from scratch, each row's last logits."""
    width = max(map(len, seqs))
    tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logits = model(tokens)  # (B, T, V)
    return logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]  # (B, V)


def trainer_logprobs(model: Llama, prompt: list[int], completion: list[int], temperature: float,
                     top_k: int, top_p: float) -> torch.Tensor:
    """What the trainer computes: one forward of prompt + completion, token t scored by logits at t-1."""
    device = model.lm_head.weight.device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion], device=device))[0]  # (T, V)
    x = filter_logits(logits[len(prompt) - 1:-1], temperature, top_k, top_p)  # (Tr, V)
    return x.log_softmax(-1).gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0]


def logprob_tol(model: Llama, temperature: float = 1.0) -> dict:
    """assert_close's tolerance for this model's float32 logprobs computed by two paths: the
    forward's chain of sums over up to max_position_embeddings keys, at the logits' magnitude
    over the temperature (a log-softmax's error is its logits'; they reach ~6 here)."""
    width = max(map(len, PROMPTS))
    with torch.no_grad():
        logits = model(torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS]))  # (B, T, V)
    scale = logits.abs().max().item() / (temperature or 1.0)
    cfg = model.config
    return tolerance.reordered(tolerance.model_depth(cfg, cfg.max_position_embeddings), scale)

# -----------------------------------------------------------------------------
# The sampler against full recomputation


@pytest.mark.parametrize("arch", ["model", "qwen3"])
def test_greedy_cached_equals_full_recompute_on_a_ragged_batch(arch, request):
    model = request.getfixturevalue(arch)  # a Llama, a Qwen3
    G, steps = 2, 12
    out = generate(model, PROMPTS, num_samples=G, max_new_tokens=steps, temperature=0)
    seqs = [list(p) for p in PROMPTS]
    for _ in range(steps):
        next_tokens = last_logits(model, seqs).argmax(-1).tolist()
        seqs = [s + [t] for s, t in zip(seqs, next_tokens)]
    for i, prompt in enumerate(PROMPTS):
        expected = seqs[i][len(prompt):]
        for row in range(i * G, i * G + G):
            assert out.completions()[row] == expected
            got = torch.tensor(out.logprob_lists()[row])
            torch.testing.assert_close(got, trainer_logprobs(model, prompt, expected, 1.0, 0, 1.0),
                                       **logprob_tol(model))
    assert not out.stopped.any()


def naive_sampler(model: Llama, prompts: list[list[int]], G: int, steps: int, temperature: float, top_k: int,
                  top_p: float, seed: int) -> tuple[list[list[int]], list[list[float]]]:
    """G independent copies of every prompt, recomputed from scratch each step, drawing from one
    generator seeded like the engine's, one (rows, V) draw per step in the same order: prompt-major,
    the longest prompt first (the engine's order: equal lengths keep theirs)."""
    generator = torch.Generator().manual_seed(seed)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    rows = [i * G + j for i in order for j in range(G)]  # the draw order
    seqs = [list(p) for p in prompts for _ in range(G)]
    logprobs = [[] for _ in seqs]
    for _ in range(steps):
        tokens, lps = draw(last_logits(model, [seqs[r] for r in rows]), temperature, top_k, top_p,
                             generator)
        for row, t, lp in zip(rows, tokens.tolist(), lps.tolist()):
            seqs[row].append(t)
            logprobs[row].append(lp)
    return [s[len(prompts[r // G]):] for r, s in enumerate(seqs)], logprobs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_prefill_once_fan_out_equals_independent_prefills(model, temperature, top_k, top_p):
    G, steps, seed = 3, 10, 1234
    out = generate(model, PROMPTS, num_samples=G, max_new_tokens=steps, temperature=temperature, top_k=top_k,
                   top_p=top_p, seed=seed)
    completions, logprobs = naive_sampler(model, PROMPTS, G, steps, temperature, top_k, top_p, seed)
    assert out.completions() == completions
    torch.testing.assert_close(torch.tensor(out.logprob_lists()), torch.tensor(logprobs),
                               **logprob_tol(model, temperature))
    # The prompt KV is stored once per prompt, not once per row.
    assert out.stats["prompt_kv_bytes"] == 2 * 2 * len(PROMPTS) * 11 * CFG.num_key_value_heads * CFG.head_dim * 4


def test_first_tokens_differ_across_the_rows_of_a_prompt(model):
    G = 8
    out = generate(model, PROMPTS, num_samples=G, max_new_tokens=1, seed=0)
    for i in range(len(PROMPTS)):
        firsts = [out.completions()[row][0] for row in range(i * G, i * G + G)]
        assert len(set(firsts)) > 1, f"prompt {i}: all {G} rows started with the same token {firsts[0]}"


@pytest.mark.parametrize("arch", ["model", "qwen3"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 30, 0.85)])
def test_logprobs_equal_trainer_forward_with_the_same_mask_while_rows_are_dropped(arch, request,
                                                                                  temperature,
                                                                                  top_k, top_p):
    model = request.getfixturevalue(arch)  # a Llama, a Qwen3
    G, stop_ids = 4, (5, 9, 17, 23, 31, 40, 64, 77, 90, 101)
    out = generate(model, PROMPTS, num_samples=G, max_new_tokens=40, temperature=temperature, top_k=top_k,
                   top_p=top_p, stop_ids=stop_ids, seed=7, sync_every=2)
    # Rows were dropped mid-run, and the rows of one group at different checks (2 steps apart), so the
    # padded (Bp', G') grid with empty slots was used.
    assert out.stats["compactions"] > 0
    assert out.stats["row_steps"] < out.stats["decode_steps"] * len(PROMPTS) * G
    lengths = [[len(c) for c in out.completions()[i * G:i * G + G]] for i in range(len(PROMPTS))]
    assert any(max(group) - min(group) > 2 for group in lengths)
    for row, (completion, stopped) in enumerate(zip(out.completions(), out.stopped.tolist())):
        expected = trainer_logprobs(model, PROMPTS[row // G], completion, temperature, top_k, top_p)
        torch.testing.assert_close(torch.tensor(out.logprob_lists()[row]), expected,
                                   **logprob_tol(model, temperature))
        assert all(t not in stop_ids for t in completion[:-1]), "a stop id inside a completion"
        assert stopped == (completion[-1] in stop_ids)
        assert stopped or len(completion) == 40


def test_stop_id_cuts_the_completion_after_it(model):
    reference = generate(model, PROMPTS, num_samples=1, max_new_tokens=12, temperature=0)
    stop = reference.completions()[0][5]
    cut = reference.completions()[0].index(stop) + 1
    out = generate(model, PROMPTS, num_samples=2, max_new_tokens=12, temperature=0, stop_ids=(stop,), sync_every=3)
    assert out.completions()[0] == out.completions()[1] == reference.completions()[0][:cut]
    assert out.stopped[:2].tolist() == [True, True]
    for i in range(1, len(PROMPTS)):
        expected = reference.completions()[i]
        if stop in expected:
            expected = expected[:expected.index(stop) + 1]
        assert out.completions()[2 * i] == expected
        assert out.stopped[2 * i] == (expected[-1] == stop)


def test_result_is_one_set_of_device_tensors_cut_at_the_stop(model):
    """The tensor contract GRPO trains on: tokens, mask, logprobs (R, Tc), Tc the longest row, 0 off
    the mask; the stop token is the last masked token of a stopped row."""
    G, stop_ids = 3, (5, 9, 17, 23, 31, 40, 64, 77, 90, 101)
    out = generate(model, PROMPTS, num_samples=G, max_new_tokens=30, stop_ids=stop_ids, seed=4,
                   temperature=0.7)  # a seed whose rows end both ways (11 of 12 stop)
    R = len(PROMPTS) * G
    lengths = out.mask.sum(1)
    assert out.tokens.shape == out.mask.shape == out.logprobs.shape == (R, int(lengths.max()))
    assert out.tokens.dtype == torch.long and out.logprobs.dtype == torch.float32
    assert (out.tokens[~out.mask] == 0).all() and (out.logprobs[~out.mask] == 0).all()
    assert (out.logprobs[out.mask] < 0).all()
    assert out.mask[:, 0].all() and (out.mask[:, 1:] <= out.mask[:, :-1]).all()  # a prefix
    last = out.tokens[torch.arange(R), lengths - 1]
    assert torch.equal(out.stopped, torch.isin(last, torch.tensor(stop_ids)))
    assert out.stopped.any() and not out.stopped.all()
    assert out.temperature == 0.7 and out.stats["new_tokens"] == int(lengths.sum())


def test_max_new_tokens_zero_and_one(model):
    out = generate(model, PROMPTS, num_samples=2, max_new_tokens=0)
    assert out.tokens.shape == out.mask.shape == out.logprobs.shape == (8, 0)
    assert out.completions() == [[]] * 8 and not out.stopped.any()
    out = generate(model, PROMPTS, num_samples=2, max_new_tokens=1, temperature=0)
    assert [len(c) for c in out.completions()] == [1] * 8 and out.stats["decode_steps"] == 0


def test_same_seed_same_completions_and_no_global_rng_side_effect(model):
    kwargs = dict(num_samples=4, max_new_tokens=16, stop_ids=(5, 9), seed=3)
    state = torch.get_rng_state()
    a, b = generate(model, PROMPTS, **kwargs), generate(model, PROMPTS, **kwargs)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert generate(model, PROMPTS, **{**kwargs, "seed": 4}).completions() != a.completions()
    generate(model, PROMPTS, num_samples=2, max_new_tokens=4)  # seed=None draws its own seed
    assert torch.equal(torch.get_rng_state(), state)


def test_generate_takes_a_rollout_config_and_applies_logits_fn(model):
    cfg = RolloutConfig(num_samples=3, max_new_tokens=8, top_k=50)
    calls = []

    def ban_token_10(logits):  # stands in for the TP all-gather: it sees every logits tensor before sampling
        calls.append(tuple(logits.shape))
        return logits.index_fill(-1, torch.tensor([10]), float("-inf"))
    out = rollout.generate(model, PROMPTS, cfg, stop_ids=(2,), seed=5, logits_fn=ban_token_10)
    assert isinstance(out, Rollout) and all(10 not in c for c in out.completions())
    assert calls[0] == (len(PROMPTS), CFG.vocab_size) and len(calls) == out.stats["decode_steps"] + 1

def poisoned_at(step: int, row: int, value: float):
    """A logits_fn (the sampler's last hook before the draw) that writes value into row `row`'s
    logits at decode step `step` (call 0 is the fan-out's, per prompt), or the whole row for
    -inf (every logit -inf: no distribution)."""
    calls = []

    def poison(logits):
        calls.append(1)
        if len(calls) - 1 == step:
            logits = logits.clone()
            logits[row, :None if value == float("-inf") else 5] = value
        return logits
    return poison


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("knobs", [dict(temperature=0.0), dict(temperature=0.9),
                                   dict(temperature=0.9, top_k=20, top_p=0.8)])
def test_nan_or_inf_logits_stop_the_rollout_in_one_line_naming_the_step(model, knobs, value):
    """Regression: NaN logits drew token 0 with a NaN logprob in silence (the race, greedy), and
    the CPU's inverse CDF indexed past its blocks (a stack trace). Now NaN, +inf, or a row of
    -inf at a decode step stops the rollout at the next check (no sync of its own) with one line
    naming that step, on the CPU's draw and the race alike; a lone -inf logit is a masked token,
    no error."""
    for step in (0, 3, 6):
        cfg = RolloutConfig(num_samples=2, max_new_tokens=8, sync_every=2, **knobs)
        with pytest.raises(rollout.NonFiniteLogits, match=f"at decode step {step} ") as caught:
            rollout.generate(model, PROMPTS, cfg, stop_ids=(5,), seed=0,
                             logits_fn=poisoned_at(step, 1, value))
        assert caught.value.step == step and "\n" not in str(caught.value)
        assert "lower --lr" in str(caught.value)
    masked = rollout.generate(model, PROMPTS, cfg, seed=0, logits_fn=lambda x: x.index_fill(
        -1, torch.tensor([7]), float("-inf")))
    assert masked.logprobs.isfinite().all()
    raced = sampling.draw_raced(torch.full((2, 512), float("nan")), 0.9, 0, 1.0,
                                  sampling.race_clocks(torch.zeros(2, 512), 0.9, None))
    assert raced[1].isnan().all()  # the race's NaN row: what the check finds


def test_a_rank_whose_logits_turn_nan_stops_every_rank_in_one_line():
    """train.together turns the rollout's NonFiniteLogits into StopTraining (one line, every rank
    at the same step), as a reward function's failure: it was a traceback, and under data
    parallelism the other ranks would wait in their next collective."""
    import train

    class Run:
        rank, device = 0, torch.device("cpu")

    def sample():
        raise rollout.NonFiniteLogits(4)
    with pytest.raises(train.StopTraining, match="at decode step 4 "):
        train.together(Run(), sample)


@pytest.mark.parametrize("padded", [True, False])
def test_shared_prompt_attention_decode_cpu_equals_the_plain_merge(padded):
    """The CPU fast path (SDPA's fused kernel + lse merge) against the plain merge
    (attention.shared_prompt_attention), ragged prompts (a -inf bias on the padding) and equal ones
    (no bias at all)."""
    gen = torch.Generator().manual_seed(0)
    Bp, G, H, Hkv, D, P, T = 3, 4, 4, 2, 16, 9, 5
    q, k, v = (torch.randn(shape, generator=gen) for shape in [(Bp * G, H, 1, D)] + [(Bp * G, Hkv, T, D)] * 2)
    prompt_k, prompt_v = torch.randn(2, Bp, Hkv, P, D, generator=gen)
    valid = torch.arange(P) < torch.tensor([9, 4, 1] if padded else [9, 9, 9])[:, None]  # (Bp, P)
    bias = torch.zeros(Bp, P).masked_fill(~valid, float("-inf"))[:, None, None] if padded else None
    expected = shared_prompt_attention(q, k, v, torch.ones(1, 1, T, dtype=torch.bool), prompt_k, prompt_v, valid)
    got = decode.shared_prompt_attention_decode_cpu(q, k, v, prompt_k, prompt_v, bias)
    # fp32, the same math in another summation order: scores sum D terms, the softmax and its
    # weighted sum the P + T keys; the output is a mix of the values
    torch.testing.assert_close(got, expected, **tolerance.reordered(D + P + T, v.abs().max()))


def cpu_kernel(q, k, v, bias):
    """decode.efficient_attention's contract, (out, lse), from SDPA's fused CPU kernel: the CUDA
    route's code run on the CPU. decode.cpu_flash is the same call through decode._CPU_FLASH,
    which the tests below switch off to leave the CPU's own fused path."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)


@pytest.mark.skipif(decode._CPU_FLASH is None, reason="no fused CPU attention kernel in this torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [True, False])
def test_shared_prompt_attention_decode_cuda_equals_the_plain_merge(dtype, padded):
    """CUDA's bf16 decode attention (decode.shared_prompt_attention_decode_cuda: each part one fused call with
    its log-sum-exp, merged in float32), the CPU's kernel standing in for CUDA's, against
    shared_prompt_attention in float64 on the same inputs: ragged prompts (a -inf bias in a 16-aligned
    buffer, as set_layout makes it) or none, own keys past the step masked (garbage in them).
    Tolerance: float32, summation order (tests/tolerance.py); bf16, the kernel's bf16 partial
    outputs (2^-8 = 4e-3 relative, on outputs up to ~3)."""
    gen = torch.Generator().manual_seed(0)
    Bp, G, H, Hkv, D, P, T, t = 3, 4, 4, 2, 16, 9, 7, 4
    q, k, v = (torch.randn(shape, generator=gen).to(dtype)
               for shape in [(Bp * G, H, 1, D)] + [(Bp * G, Hkv, T, D)] * 2)
    prompt_k, prompt_v = torch.randn(2, Bp, Hkv, P, D, generator=gen).to(dtype)
    valid = torch.arange(P) < torch.tensor([9, 4, 1] if padded else [9, 9, 9])[:, None]  # (Bp, P)
    bias = None
    if padded:
        bias = torch.zeros(Bp, 16, dtype=dtype)[:, :P].masked_fill_(~valid, float("-inf"))[:, None, None]
    unwritten = torch.arange(T) > t
    own_bias = torch.zeros(T, dtype=dtype).masked_fill_(unwritten, float("-inf"))[None, None, None]
    got = decode.shared_prompt_attention_decode_cuda(q, k, v, own_bias, prompt_k, prompt_v, bias, cpu_kernel)
    assert got.dtype == dtype
    wide = [x.double() for x in (q, k, v, prompt_k, prompt_v)]
    expected = shared_prompt_attention(*wide[:3], ~unwritten[None, None], *wide[3:], valid)
    tol = (tolerance.reordered(D + P + T, v.abs().max()) if dtype == torch.float32
           else dict(rtol=0, atol=2e-2))
    torch.testing.assert_close(got.double(), expected, **tol)


def test_the_fused_decode_kernel_is_cudas_in_bf16_only():
    """kernel_for: SDPA's memory-efficient kernel for a bf16 / fp16 cache on CUDA at head dims it
    takes; float32 keeps the exact plain ops, and the CPU its own fused path."""
    cuda = torch.device("cuda")  # a device name: no GPU needed
    assert decode.kernel_for(cuda, torch.bfloat16, 64) is decode.efficient_attention
    assert decode.kernel_for(cuda, torch.float16, 128) is decode.efficient_attention
    assert decode.kernel_for(cuda, torch.float32, 64) is None
    assert decode.kernel_for(cuda, torch.bfloat16, 12) is None
    assert decode.kernel_for(torch.device("cpu"), torch.bfloat16, 64) is None


def test_efficient_attention_shapes_on_the_meta_device():
    """CUDA's kernel through its meta kernel (the shapes it returns on a GPU), at the Qwen2.5-0.5B
    shape (14 heads over 2 kv heads, D = 64): its log-sum-exp comes padded to 32 queries and
    efficient_attention cuts it back, so the merge gets (S, H, 1, D) in bf16."""
    Bp, G, H, Hkv, D, P, T = 3, 4, 14, 2, 64, 70, 255
    meta = dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty(Bp * G, H, 1, D, **meta)
    k = torch.empty(Bp * G, Hkv, T, D, **meta)
    prefix = torch.empty(Bp, Hkv, P, D, **meta)
    bias = torch.empty(Bp, 80, **meta)[:, :P][:, None, None]
    out, lse = decode.efficient_attention(q.view(Bp * G, Hkv, H // Hkv, D), k, k, None)
    assert out.shape == (Bp * G, Hkv, H // Hkv, D) and lse.shape == (Bp * G, Hkv, H // Hkv)
    y = decode.shared_prompt_attention_decode_cuda(q, k, k, torch.empty(1, 1, 1, T, **meta), prefix, prefix,
                                       bias, decode.efficient_attention)
    assert y.shape == q.shape and y.dtype == torch.bfloat16


def test_ragged_prompts_run_in_length_buckets_that_read_each_prompt_at_most_twice():
    """Prompts sorted longest first: prefill chunks and decode buckets hold like lengths. Each
    bucket reads its longest prompt's keys, at most twice any of its prompts' own (the padded decode
    read the batch's longest for every group)."""
    lens = [300, 290, 160, 151, 150, 90, 40, 39, 20, 3, 1]
    buckets = attention.length_buckets(lens)
    assert [(a, b) for a, b, _ in buckets] == [(0, 5), (5, 6), (6, 9), (9, 10), (10, 11)]
    for first, stop, keys in buckets:
        assert keys == lens[first] and all(keys <= 2 * n for n in lens[first:stop])
    read = sum((stop - first) * keys for first, stop, keys in buckets)  # 1,714 keys per head
    assert read <= 2 * sum(lens) and read < 0.55 * len(lens) * max(lens)  # padded: 3,300
    assert attention.length_buckets([7, 7, 7]) == [(0, 3, 7)]  # equal lengths: one call


def test_prefill_pads_each_chunk_to_its_own_longest_prompt(model, monkeypatch):
    """Longest first, a chunk of at most prefill_tokens padded tokens holds like lengths: prompts
    of 1 to 40 tokens (198 in all) pad to 212, not the 400 of one width for all; greedy rows do not
    change."""
    prompts = [[(7 * i + j) % 100 + 1 for j in range(n)] for i, n in enumerate(
        [3, 40, 1, 38, 12, 20, 2, 33, 9, 40])]
    widths = []
    hidden = model.hidden

    def spy(tokens, *args, **kwargs):
        if tokens.shape[1] > 1:  # a prefill chunk (decode feeds one token a row)
            widths.append(tokens.shape)
        return hidden(tokens, *args, **kwargs)
    monkeypatch.setattr(model, "hidden", spy)
    out = generate(model, prompts, num_samples=2, max_new_tokens=6, temperature=0,
                   prefill_tokens=80)
    monkeypatch.undo()
    padded = sum(b * w for b, w in widths)
    assert all(b * w <= 80 or b == 1 for b, w in widths)
    assert padded <= sum(map(len, prompts)) + 20 < 0.6 * len(prompts) * 40
    for i, prompt in enumerate(prompts):  # each row as if generated alone
        alone = generate(model, [prompt], num_samples=1, max_new_tokens=6, temperature=0)
        assert out.completions()[2 * i] == out.completions()[2 * i + 1] == alone.completions()[0]


@pytest.mark.parametrize("config_class, heads", [("LlamaConfig", dict()),
                                                 ("Qwen3Config", dict(num_attention_heads=8,
                                                                      num_key_value_heads=4,
                                                                      head_dim=16))])
def test_greedy_on_ragged_prompts_equals_transformers_generate(tmp_path, config_class, heads):
    """Prompts of 1 to 23 tokens in one batch (sorted, bucketed, rows dropped as they stop): each
    greedy row equals transformers' generate on that prompt alone, on a checkpoint transformers
    wrote (a Llama; a Qwen3 with its q/k norms, 8/4 heads of 16)."""
    from hf_reference import save_random_hf_model
    from engine import hf
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  eos_token_id=7, bos_token_id=1)
    config.update(heads)
    theirs = save_random_hf_model(tmp_path, config_class, config)
    ours = hf.load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(8, 128, (n,), generator=gen).tolist() for n in (1, 23, 5, 12, 2, 17)]
    out = rollout.generate(ours, prompts, RolloutConfig(num_samples=2, max_new_tokens=10,
                                                        temperature=0.0, sync_every=2),
                           stop_ids=(7,))
    for i, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        with torch.no_grad():
            want = theirs.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=10, eos_token_id=7, pad_token_id=0)
        want = want[0, len(prompt):].tolist()
        if 7 in want:
            want = want[:want.index(7) + 1]
        assert out.completions()[2 * i] == out.completions()[2 * i + 1] == want, i


@pytest.mark.parametrize("kernel", [False, True])
def test_generic_decode_path_equals_fused_path(model, monkeypatch, kernel):
    """The paths CUDA takes, run on the CPU, with rows dropped: float32's (attention.shared_prompt_attention
    with a mask) and, with kernel, bf16's (shared_prompt_attention_decode_cuda, the CPU's kernel standing in
    for CUDA's: called by every layer of every step here; eager: the compiled step has its own
    tests below)."""
    kwargs = dict(num_samples=3, max_new_tokens=24, temperature=0.9, stop_ids=(5, 9, 17, 23),
                  seed=5, sync_every=2, compile_decode="false")
    fused = generate(model, PROMPTS, **kwargs)
    monkeypatch.setattr(decode, "_CPU_FLASH", None)
    calls = []
    if kernel:
        monkeypatch.setattr(decode, "kernel_for", lambda device, dtype, head_dim: lambda *a: (
            calls.append(1), cpu_kernel(*a))[1])
    generic = generate(model, PROMPTS, **kwargs)
    assert len(calls) == (2 * CFG.num_hidden_layers * generic.stats["decode_steps"] if kernel else 0)
    assert torch.equal(generic.tokens, fused.tokens) and fused.stats["compactions"] > 0
    torch.testing.assert_close(generic.logprobs, fused.logprobs, **logprob_tol(model, 0.9))


@pytest.mark.skipif(rollout._PREPACK is None,
                    reason="no oneDNN in this torch build")
def test_prepacked_linears_equal_f_linear_and_are_undone(model):
    """Inside _prepacked_linears every float32 nn.Linear runs on its prepacked weight: outputs equal
    F.linear's within 1e-5 relative (float32, another summation order), at any row count and
    with a bias; afterwards the modules are plain again. generate with and without prepacking:
    the same tokens (a logit moved by ~1e-6 could move a draw that sits on a cdf boundary: none
    here) and logprobs within logprob_tol."""
    linear = torch.nn.Linear(64, 96)
    layers = torch.nn.Sequential(model.lm_head, linear)
    with torch.inference_mode():
        for rows in (1, 12, 300):
            x = torch.randn(rows, 1, 64, generator=torch.Generator().manual_seed(rows))
            want = [m(x) for m in layers]
            with rollout._prepacked_linears(layers, 12, enabled=True):
                assert all("forward" in vars(m) for m in layers)
                got = [m(x) for m in layers]
            for g, w in zip(got, want):  # 64 terms a dot product, in another order
                torch.testing.assert_close(g, w, **tolerance.reordered(64, w.abs().max()))
    assert not any("forward" in vars(m) for m in layers)
    kwargs = dict(num_samples=3, max_new_tokens=24, temperature=0.9, stop_ids=(5, 9), seed=3)
    prepacked = generate(model, PROMPTS, **kwargs)
    plain = generate(model, PROMPTS, prepacked_linears=False, **kwargs)
    assert torch.equal(prepacked.tokens, plain.tokens)
    torch.testing.assert_close(prepacked.logprobs, plain.logprobs, **logprob_tol(model, 0.9))


@pytest.mark.skipif(rollout._PREPACK is None,
                    reason="no oneDNN in this torch build")
@pytest.mark.parametrize("native", [True, False])
def test_bf16_linears_are_prepacked_where_the_cpu_multiplies_bf16(model, monkeypatch, native):
    """Where the CPU has native bf16 (engine/precision.py) a bf16 sampler's linears run on
    prepacked weights too (a bf16 decode step's linears took 0.85-0.95 of F.linear's time,
    docs/measurements.md): outputs within one bf16 rounding of F.linear's (oneDNN's bf16 kernel
    behind both; bit-equal on the shapes measured, not promised), generate's tokens the same.
    Elsewhere bf16 is never prepacked (a run holds bf16's values in float32 there)."""
    if native and not native_bf16():
        pytest.skip("this CPU has no native bf16: oneDNN's bf16 kernels are not there to pack for")
    monkeypatch.setattr(rollout, "native_bf16", lambda: native)
    bf16 = Llama(CFG).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    layers = torch.nn.Sequential(bf16.lm_head, torch.nn.Linear(64, 96).to(torch.bfloat16))
    with torch.inference_mode():
        for rows in (1, 12, 300):
            x = torch.randn(rows, 1, 64, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            want = [m(x) for m in layers]
            with rollout._prepacked_linears(layers, 12, enabled=True):
                assert all(("forward" in vars(m)) == native for m in layers)
                got = [m(x) for m in layers]
            for g, w in zip(got, want):  # float32 sums rounded once to bf16 (2^-8 relative)
                torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -8, atol=1e-6)
    assert not any("forward" in vars(m) for m in layers)
    kwargs = dict(num_samples=3, max_new_tokens=24, temperature=0.9, stop_ids=(5, 9), seed=3)
    prepacked = generate(bf16, PROMPTS, **kwargs)
    plain = generate(bf16, PROMPTS, prepacked_linears=False, **kwargs)
    assert torch.equal(prepacked.tokens, plain.tokens)
    torch.testing.assert_close(prepacked.logprobs, plain.logprobs, rtol=0, atol=0.05)


@pytest.mark.parametrize("kernel", [False, True])
def test_decode_attention_over_all_completion_slots_masks_the_unwritten_ones(monkeypatch, kernel):
    """A CUDA graph attends to all Tc completion slots under each row's mask (static shapes); the CPU
    path slices to the keys written so far. Both must agree, also with garbage in the unwritten slots,
    with the rows in lockstep (equal indices) and apart (each its own, as after a tool turn).
    kernel: CUDA's bf16 route (shared_prompt_attention_decode_cuda, the rows' own bias, the aligned
    prompt bias), the CPU's fused kernel standing in for CUDA's; it equals the plain route too."""
    monkeypatch.setattr(decode, "_CPU_FLASH", None)
    if kernel:
        monkeypatch.setattr(decode, "kernel_for", lambda device, dtype, head_dim: cpu_kernel)
    gen = torch.Generator().manual_seed(1)
    Bp, G, H, Hkv, D, P, Tc, t = 2, 3, 4, 2, 8, 6, 7, 3
    cache = KVCache(KVCache.numel_for(1, Hkv, D, Bp, G, P, Tc + 1), torch.float32, "cpu")
    views = cache.carve(1, Hkv, D, Bp, G, P, Tc + 1)
    for x in sum(views, []):
        x.copy_(torch.randn(x.shape, generator=gen))  # written slots and garbage alike
    one_layer = Llama(ModelConfig(vocab_size=16, hidden_size=H * D, intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=H,
                                  num_key_value_heads=Hkv))
    decoder = decode.Decoder(one_layer, views, [6, 3], graphed=False)
    decoder.drop([0, 1, 2, 4, 5], filled=0)  # row 3 finished: an empty slot in the grid
    assert decoder.grid.scatter is not None and (decoder.route == "kernel") == kernel
    q, k, v = (torch.randn(shape, generator=gen) for shape in [(5, H, 1, D)] + [(5, Hkv, 1, D)] * 2)
    tol = tolerance.reordered(D + P + Tc, views[1][0].abs().max())  # another summation order
    for index in (torch.full((5, 1), t), torch.tensor([[3], [1], [5], [0], [2]])):
        lockstep = "kernel" if kernel else "plain"
        decoder.route = "apart" if index.unique().numel() > 1 else lockstep  # apart: each its own
        full = decoder.attention(index, None)(0, q, k, v)  # (B, H, 1, D)
        torch.testing.assert_close(decoder.attention(index, int(index.max()) + 1)(0, q, k, v),
                                   full, **tol)
        if decoder.route == "kernel":
            decoder.route = "plain"  # shared_prompt_attention's plain float32 ops
            torch.testing.assert_close(decoder.attention(index, None)(0, q, k, v), full, **tol)


def test_bf16_model_on_the_cpu(model):
    """A bf16 sampler on the CPU takes the fused path with bf16 inputs (it once returned float32 and crashed)."""
    bf16 = Llama(CFG).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    out = generate(bf16, PROMPTS, num_samples=2, max_new_tokens=10, temperature=0)
    assert [len(c) for c in out.completions()] == [10] * 8
    for row, completion in enumerate(out.completions()):  # bf16 rounding (8e-3 relative) of logits of size ~5
        expected = trainer_logprobs(bf16, PROMPTS[row // 2], completion, 1.0, 0, 1.0).float()
        torch.testing.assert_close(torch.tensor(out.logprob_lists()[row]), expected, rtol=0, atol=0.1)


# -----------------------------------------------------------------------------
# Sampling masks on hand-built distributions


def test_top_k_and_top_p_masks():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, 1.0, **kw))[0].tolist()
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_k=4) == kept(top_k=0) == [True] * 4
    assert kept(top_p=0.7) == [True, True, False, False]       # 0.5 < 0.7 <= 0.5 + 0.3
    assert kept(top_p=0.9) == [True, True, True, False]        # 0.8 < 0.9 <= 0.95
    assert kept(top_p=0.45) == [True, False, False, False]
    assert kept(top_p=1e-9) == [True, False, False, False]     # always at least one token
    # top-p is taken after top-k renormalises: [0.526, 0.316, 0.158] reaches 0.83 with two tokens,
    # the unfiltered distribution needs three.
    assert kept(top_k=3, top_p=0.83) == [True, True, False, False]
    assert kept(top_p=0.83) == [True, True, True, False]
    shuffled = logits[:, [2, 0, 3, 1]]  # the mask follows the tokens, not their positions
    assert torch.isfinite(filter_logits(shuffled, 1.0, 0, 0.7))[0].tolist() == [False, True, False, True]
    # Temperature divides the logits before any mask; greedy (0) leaves them as they are.
    torch.testing.assert_close(filter_logits(logits, 0.5), logits / 0.5)
    torch.testing.assert_close(filter_logits(logits, 0.0), logits)


def test_sample_draws_from_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = draw(logits, 1.0, 0, 1.0, generator)
    freq = torch.bincount(tokens, minlength=4) / len(tokens)
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.015)  # ~4 binomial standard deviations
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    tokens, logprobs = draw(logits, 1.0, 0, 0.7, generator)  # renormalised over the first two
    torch.testing.assert_close(torch.bincount(tokens, minlength=4) / 20000., torch.tensor([0.625, 0.375, 0, 0]),
                               rtol=0, atol=0.015)
    tokens, logprobs = draw(logits[:2], 0.0, 0, 1.0, generator)  # greedy: temperature-1 logprob of the argmax
    assert tokens.tolist() == [0, 0] and torch.allclose(logprobs, probs[0].log())


def full_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The slow twin of sampling.inverse_cdf: the whole (rows, V) cdf in float64, one search."""
    cdf = probs.double().cumsum(dim=-1)  # (rows, V)
    total = cdf[:, -1:]
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[:, 0]


@pytest.mark.parametrize("V", [49152, 151936, 1000, 14, 251])  # 251 is prime: blocks of one token
def test_two_level_inverse_cdf_equals_the_full_cdf(V):
    """Same tokens as the whole-vocabulary float64 cdf for the same uniforms. Tolerance: none, yet
    not guaranteed: a block's float32 sum moves its boundary by ~1e-7 of its mass, so a uniform
    that close to a boundary could land one token over; at these seeds none does (about 1e-4 of
    a chance over all the draws)."""
    gen = torch.Generator().manual_seed(V)
    rows = 64 if V > 100000 else 256
    scale = torch.linspace(0.1, 12, rows)[:, None]  # flat to peaked
    logits = torch.randn(rows, V, generator=gen) * scale
    logits[::3] = filter_logits(logits[::3], 1.0, top_k=min(40, V - 1))  # masked tokens: -inf
    logits[1::3] = filter_logits(logits[1::3], 1.0, top_p=0.9)
    probs = logits.softmax(dim=-1)
    u = torch.rand(rows, 1, generator=gen, dtype=torch.float64)
    u[:2] = torch.tensor([[0.0], [1 - 2 ** -53]])  # the two ends of [0, 1)
    tokens = sampling.inverse_cdf(probs, u)
    assert torch.equal(tokens, full_inverse_cdf(probs, u))
    assert (probs.gather(-1, tokens[:, None]) > 0).all()  # never a masked token
    assert tokens[0] == (probs[0] > 0).nonzero()[0, 0]  # u = 0: the first token with mass


def test_sample_equals_its_slow_twin_for_the_same_seed():
    """draw() = softmax of the filtered logits, then the whole-vocabulary cdf, drawing the same
    uniforms: same tokens, logprobs bit for bit (the same softmax gathered)."""
    logits = torch.randn(128, 4096, generator=torch.Generator().manual_seed(0)) * 4
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.8)]:
        generator = torch.Generator().manual_seed(5)
        tokens, logprobs = draw(logits, temperature, top_k, top_p, generator)
        probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
        u = torch.rand(128, 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        slow = full_inverse_cdf(probs, u)
        assert torch.equal(tokens, slow)
        assert torch.equal(logprobs, probs.gather(-1, slow[:, None])[:, 0].log())


def chi_square_excess(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of the drawn tokens against probs (V,), in standard deviations above
    its mean (degrees of freedom k: mean k, variance 2k), over the ids expected >= 5 times and the
    rest pooled in one bin. A masked id (probability 0) drawn even once fails outright."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "a masked token was drawn"
    expected = probs.double() * tokens.numel()
    big = expected >= 5
    observed = torch.cat((counts[big], counts[~big].sum()[None]))
    expected = torch.cat((expected[big], expected[~big].sum()[None]))
    chi2 = float(((observed - expected) ** 2 / expected.clamp_min(1e-300)).sum())
    k = int(big.sum())  # bins - 1
    return (chi2 - k) / (2 * k) ** 0.5


def draw_with(sampler: str, probs: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """rows tokens from probs (V,) by one of engine/sampling.py's two samplers."""
    batch = probs.expand(rows, -1)
    if sampler == "exponential_race":
        return sampling.exponential_race(batch, *sampling.race_clocks(batch, 1.0, generator))
    u = torch.rand((rows, 1), generator=generator, dtype=torch.float64)
    return sampling.inverse_cdf(batch, u)


@pytest.mark.parametrize("sampler", ["inverse_cdf", "exponential_race"])
def test_both_samplers_draw_the_distribution(sampler):
    """Goodness of fit: 200,000 draws from a distribution with masked ids and blocks of 8 ids
    (gcd(1000, 256)), against its probabilities. The statistic is a fixed number at this seed;
    5 standard deviations above the mean would be a chance of ~1e-6 for a correct sampler."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=gen) * 2
    logits[::7] = float("-inf")  # masked ids, as top-k / top-p leave them
    probs = logits.softmax(dim=-1)
    tokens = torch.cat([draw_with(sampler, probs, 20000, gen) for _ in range(10)])
    assert chi_square_excess(tokens, probs) < 5


@pytest.mark.parametrize("sampler", ["inverse_cdf", "exponential_race"])
def test_both_samplers_draw_the_tail_of_a_peaked_distribution(sampler):
    """A trained model's shape: one token holds 0.999 and the other 49,151 share the rest at
    2e-8 each, below float32's ulp near 1 (6e-8). The tail must come up at its rate: 1e-3 of
    60,000 draws, 60 +- 7.7."""
    V = 49152
    probs = torch.full((V,), 1e-3 / (V - 1))
    probs[123] = 0.999
    gen = torch.Generator().manual_seed(1)
    tokens = torch.cat([draw_with(sampler, probs, 2000, gen) for _ in range(30)])
    tail = int((tokens != 123).sum())
    assert abs(tail - 60) < 5 * 7.7, tail


@pytest.mark.parametrize("dtype,temperature,nbytes", [
    (torch.float32, 1.0, 4), (torch.float32, 0.7, 8), (torch.bfloat16, 1.0, 8),
    (torch.bfloat16, 0.7, 8)])
def test_sampling_holds_at_most_8_bytes_per_logit_beyond_the_logits(dtype, temperature, nbytes):
    """Regression: draw() held the filtered float32 copy, the softmax, a float64 copy of it and
    the float64 cdf at once: 20-24 bytes per (row, vocab) entry, 400 MB at 128 rows x 128k vocab.
    Now the softmax (4), beside the filtered float32 copy (4) while it is softmaxed when there is
    one; the cdf is the block sums' and one block's (a few bytes per row)."""
    rows, V = 16, 32768
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(0)).to(dtype)
    generator = torch.Generator().manual_seed(1)
    peak = allocator_peak(lambda: draw(logits, temperature, 0, 1.0, generator))
    per_entry = peak / (rows * V)
    # + per row: one block gathered and its float64 cdf (12 bytes x 256), the block sums' float32,
    # float64 and cdf (20 bytes x V/256): 0.17 bytes per entry here.
    assert nbytes <= per_entry < nbytes + 0.2

# -----------------------------------------------------------------------------
# The KV cache buffer and errors


def test_kv_cache_is_one_buffer_sized_for_the_batch_and_too_small_is_an_error(model):
    P, G, new = max(map(len, PROMPTS)), 3, 6
    cache = KVCache.for_batch(CFG, len(PROMPTS), G, P, new, torch.float32, "cpu")
    per_token = 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * CFG.head_dim * 4
    assert cache.buffer.dim() == 1 and cache.nbytes == per_token * len(PROMPTS) * (P + G * (new - 1))
    kwargs = dict(num_samples=G, max_new_tokens=new, seed=11)
    out = generate(model, PROMPTS, cache=cache, **kwargs)
    assert out.completions() == generate(model, PROMPTS, **kwargs).completions()
    assert cache.buffer.abs().sum() > 0  # the KV lived in this buffer
    with pytest.raises(ValueError, match=r"KV cache is too small.*needs [\d,]+ bytes.*holds [\d,]+ bytes"):
        generate(model, PROMPTS, cache=cache, num_samples=G + 1, max_new_tokens=new)
    with pytest.raises(ValueError, match="tp_size=3 does not divide num_key_value_heads=2"):
        KVCache.for_batch(CFG, 1, 1, 1, 1, torch.float32, "cpu", tp_size=3)


def test_released_kv_cache_is_a_clear_error_and_wakes_in_place(model):
    cache = KVCache.for_batch(CFG, len(PROMPTS), 2, 11, 5, torch.float32, "cpu")
    cache.buffer.untyped_storage().resize_(0)  # what memory.py does to sleep the rollout phase
    with pytest.raises(RuntimeError, match=r"KV cache is released \(asleep\): wake the rollout phase"):
        generate(model, PROMPTS, num_samples=2, max_new_tokens=5, cache=cache)
    cache.buffer.untyped_storage().resize_(cache.nbytes)  # wake: garbage contents, carve() zeroes them
    out = generate(model, PROMPTS, num_samples=2, max_new_tokens=5, cache=cache, seed=2)
    assert out.completions() == generate(model, PROMPTS, num_samples=2, max_new_tokens=5, seed=2).completions()


@pytest.mark.parametrize("prompts,kwargs,message", [
    ([], {}, "prompts must be a non-empty list"),
    ([[1, 2], []], {}, r"prompts\[1\] is empty"),
    ([[1, 128]], {}, r"prompts\[0\] has token id 128 outside the vocabulary \[0, 128\)"),
    ([[1], [-1]], {}, r"prompts\[1\] has token id -1 outside"),
    ([[1] * 90], {"max_new_tokens": 7}, r"prompts\[0\] has 90 tokens \+ max_new_tokens=7 > .*max_position_embeddings=96"),
    ([[1]], {"num_samples": 0}, "num_samples must be an integer >= 1, got 0"),
    ([[1]], {"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
    ([[1]], {"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ([[1]], {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ([[1]], {"top_k": -1}, "top_k must be an integer >= 0"),
    ([[1]], {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ([[1]], {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ([[1]], {"stop_ids": (3, 500)}, r"stop_ids has token id 500 outside the vocabulary"),
    ([[1]], {"sync_every": 0}, "sync_every must be an integer >= 1"),
])
def test_bad_input_is_a_clear_error(model, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, **kwargs)


def test_rollout_config_validates():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        RolloutConfig(top_p=2.0)

# -----------------------------------------------------------------------------
# sync_weights


def test_sync_weights_copies_and_casts_the_trainer_into_the_sampler_in_place(model):
    """With or without memory.py: the sampler must follow the trainer every rollout, or it samples
    from its initial weights (the stale-sampler bug of a run with memory management off)."""
    import copy
    trainer = copy.deepcopy(model)
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    objects = [(id(p), p.data_ptr()) for p in sampler.parameters()]
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)  # a training step
    rollout.sync_weights(sampler, trainer)
    assert [(id(p), p.data_ptr()) for p in sampler.parameters()] == objects  # in place
    for (name, s), t in zip(sampler.named_parameters(), trainer.parameters()):
        assert s.dtype == torch.bfloat16 and torch.equal(s, t.to(torch.bfloat16)), name
    want = generate(trainer.to(torch.bfloat16), PROMPTS, num_samples=2, max_new_tokens=4, seed=1)
    got = generate(sampler, PROMPTS, num_samples=2, max_new_tokens=4, seed=1)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


def test_sync_weights_is_a_no_op_on_the_same_module_and_refuses_other_models(model):
    before = [p.clone() for p in model.parameters()]
    rollout.sync_weights(model, model)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    narrow = Llama(ModelConfig(**{**vars(CFG), "intermediate_size": 96}))
    narrow_before = [p.clone() for p in narrow.parameters()]
    message = (r"sync_weights: parameter 'model.layers.0.mlp.down_proj.weight' has shape "
               r"\(64, 96\) in the sampler, \(64, 176\) in the trainer")
    with pytest.raises(ValueError, match=message):
        rollout.sync_weights(narrow, model)
    # Checked before any write: lm_head.weight (same shape, sorted first) was not copied either.
    assert all(torch.equal(p, q) for p, q in zip(narrow.parameters(), narrow_before))
    tied = Llama(ModelConfig(**{**vars(CFG), "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"parameter 'lm_head.weight' exists in the trainer only"):
        rollout.sync_weights(tied, model)
