"""grpo.py against its slow twins: one forward per sequence, unchunked logprobs, one big batch,
finite differences and hand-computed cases."""

import math

import pytest
import torch

import grpo
import model as M
from grpo import GRPOBatch, GRPOConfig

V = 128


def tiny_model(seed: int = 0) -> M.Llama:
    cfg = M.ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    # std 0.2 (not HF's 0.02): peaked logits and non-uniform attention, so indexing bugs show.
    return M.Llama(cfg).init_weights(seed, std=0.2)


def ragged_batch(G: int = 3, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of lengths 5, 11, 2 using token ids >= 100 only; completions of lengths 1..7 using ids < 100,
    so an embedding row with gradient tells which part of the sequence it came from."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, V, (n,), generator=gen).tolist() for n in (5, 11, 2)]
    lens = [1, 7, 4, 3, 6, 2, 5, 7, 1][:3 * G] + [3] * max(0, 3 * G - 9)
    completions = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in lens]
    return prompts, completions


def grads(m: M.Llama) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def assert_grads_close(got: dict, want: dict, rel: float):
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-12)
        err = (got[name] - want[name]).abs().max()
        assert err <= rel * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def oracle_logprobs(m: M.Llama, prompts, completions, G: int, temperature: float = 1.0):
    """One full causal forward per (prompt + completion) sequence; token t is scored by the logits at
    position len(prompt) - 1 + t. Returns per-row lists of logp and entropy."""
    logps, ents = [], []
    for i, c in enumerate(completions):
        p = prompts[i // G]
        lp = (m(torch.tensor([p + c]))[0] / temperature).log_softmax(-1)  # (L, V)
        rows = lp[len(p) - 1:len(p) - 1 + len(c)]  # (len(c), V)
        logps.append(rows.gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
        ents.append(-(rows.exp() * rows).sum(-1))
    return logps, ents


def weighted_sum(logp: torch.Tensor, mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A scalar that weighs every token differently, so any misrouted gradient shows."""
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))
    return (w * logp * mask).sum()

# -----------------------------------------------------------------------------
# Shared prompt == one forward per sequence (values and every parameter's gradient)


@pytest.mark.parametrize("shared,chunk_size", [(True, 4), (True, 0), (False, 0), (False, 5)])
def test_logprobs_and_grads_equal_one_forward_per_sequence(shared, chunk_size):
    G, temperature = 3, 0.7
    prompts, completions = ragged_batch(G)
    m = tiny_model()
    logp, entropy, mask = grpo.completion_logprobs(m, prompts, completions, num_samples=G, temperature=temperature,
                                                   chunk_size=chunk_size, shared_prompt=shared)
    weighted_sum(logp, mask).backward()
    got = grads(m)
    m.zero_grad()
    ref_logp, ref_ent = oracle_logprobs(m, prompts, completions, G, temperature)
    ref_mask = torch.zeros_like(mask)
    ref = torch.zeros_like(logp).detach()
    for i, c in enumerate(completions):
        ref_mask[i, :len(c)] = True
        # fp32, different summation orders (prefix attention merges two softmaxes): 1e-5
        torch.testing.assert_close(logp[i, :len(c)], ref_logp[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i, :len(c)], ref_ent[i].detach(), atol=1e-5, rtol=0)
        ref = ref.index_put((torch.tensor([i]), torch.arange(len(c))), ref_logp[i])
    assert torch.equal(mask, ref_mask)
    assert torch.all(logp[~mask] == 0) and torch.all(entropy[~mask] == 0)
    weighted_sum(ref, ref_mask).backward()
    assert_grads_close(got, grads(m), rel=1e-4)  # fp32 accumulation over ~40 tokens, relative to each grad's scale


def truncated_prompt_logprobs(m: M.Llama, prompts, completions, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What TRL PR #2669 first did: the prompt forward runs under no_grad and its cache is reused."""
    kv = {}

    def record(layer, q, k, v):
        kv[layer] = (k, v)
        return M.causal_attention(layer, q, k, v)

    ids, lens = grpo.pad_right(prompts, torch.device("cpu"))
    with torch.no_grad():
        last = m.hidden(ids, None, record)[torch.arange(len(prompts)), lens - 1]  # (Bp, C)
    comp, comp_lens = grpo.pad_right(completions, torch.device("cpu"))
    T = comp.shape[1] - 1
    positions = lens.repeat_interleave(G)[:, None] + torch.arange(T)
    valid = torch.arange(ids.shape[1]) < lens[:, None]
    own = torch.ones(T, T, dtype=torch.bool).tril()[None]
    h = m.hidden(comp[:, :-1], positions, lambda l, q, k, v: M.prefix_attention(q, k, v, own, *kv[l], valid))
    h = torch.cat([last.repeat_interleave(G, 0)[:, None], h], 1)
    logp = m.head(h).log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1)
    return logp, torch.arange(T + 1) < comp_lens[:, None]


def test_no_grad_prompt_gives_a_different_gradient():
    """Regression guard for TRL PR #2669's first version: with the prompt forward under no_grad the
    logprob VALUES are right but the gradient through the prompt's keys/values (and through the last
    prompt position, which scores the first completion token) is silently dropped."""
    G = 3
    prompts, completions = ragged_batch(G)
    m = tiny_model()
    logp, _, mask = grpo.completion_logprobs(m, prompts, completions, num_samples=G)
    weighted_sum(logp, mask).backward()
    exact = grads(m)
    m.zero_grad()
    bad_logp, bad_mask = truncated_prompt_logprobs(m, prompts, completions, G)
    assert torch.equal(mask, bad_mask)
    torch.testing.assert_close(bad_logp * mask, logp, atol=1e-5, rtol=0)  # same values...
    weighted_sum(bad_logp, mask).backward()
    bad = grads(m)
    prompt_only = sorted({t for p in prompts for t in p})  # ids >= 100 never occur in completions
    assert torch.all(bad["model.embed_tokens.weight"][prompt_only] == 0)  # ...but the prompt gets nothing
    assert torch.all(exact["model.embed_tokens.weight"][prompt_only].abs().sum(1) > 0)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        rel = (bad[name] - exact[name]).norm() / exact[name].norm()
        assert rel > 1e-2, f"{name}: truncated gradient only {rel:.2g} off"
    torch.testing.assert_close(bad["lm_head.weight"], exact["lm_head.weight"])  # the head sees the same values

# -----------------------------------------------------------------------------
# Chunked == unchunked; the token/position alignment


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize("path", ["softmax", "checkpoint"])
def test_chunked_equals_unchunked_and_never_holds_more_than_a_chunk(path, chunk_size):
    """Both chunked paths (the default ChunkedSoftmaxLogprobs; checkpoint around a given logprob_fn, as
    under tensor parallelism) against one log_softmax over all tokens; 7 does not divide n = 36."""
    G = 3
    prompts, completions = ragged_batch(G)
    n = sum(len(c) for c in completions)
    m = tiny_model()
    logp, ent, mask = grpo.completion_logprobs(m, prompts, completions, num_samples=G, chunk_size=0)
    weighted_sum(logp, mask).backward()
    want = grads(m)
    m.zero_grad()
    rows_seen, head = [], m.head

    def spy_head(h):  # every (rows, V) logits tensor is made here
        rows_seen.append(h.shape[0])
        return head(h)

    m.head = spy_head  # instance attribute shadows the method
    fn = grpo.logprobs_from_logits if path == "checkpoint" else None
    logp_c, ent_c, _ = grpo.completion_logprobs(m, prompts, completions, num_samples=G, chunk_size=chunk_size,
                                                logprob_fn=fn)
    chunks = math.ceil(n / chunk_size)
    assert len(rows_seen) == chunks and max(rows_seen) <= chunk_size and sum(rows_seen) == n
    weighted_sum(logp_c, mask).backward()
    assert len(rows_seen) == 2 * chunks and max(rows_seen) <= chunk_size  # backward rebuilt each chunk
    # Same math on row subsets; the matmul blocking changes with the row count: fp32 rounding of ~|5|.
    torch.testing.assert_close(logp_c, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_c, ent, atol=1e-5, rtol=0)
    assert_grads_close(grads(m), want, rel=1e-5)
    with torch.no_grad():  # no recompute without grad; same values
        rows_seen.clear()
        logp_n, _, _ = grpo.completion_logprobs(m, prompts, completions, num_samples=G, chunk_size=chunk_size,
                                                logprob_fn=fn)
    assert len(rows_seen) == chunks
    torch.testing.assert_close(logp_n, logp.detach(), atol=1e-5, rtol=0)


class TinyHead(torch.nn.Module):
    """A float64 stand-in for model.head (model.py normalises in float32, too coarse for gradcheck)."""
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 11, dtype=torch.float64)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(h)) * 4


def test_chunked_softmax_logprobs_gradients_float64():
    torch.manual_seed(0)
    m = TinyHead()
    h = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    f = lambda x: grpo.chunked_logprobs(m, x, targets, temperature=0.7, chunk_size=3)[0]
    assert torch.autograd.gradcheck(f, (h,))
    w = torch.randn(7, dtype=torch.float64)
    out = []
    for chunk_size in (3, 0):  # 0: the plain log_softmax twin
        m.zero_grad()
        logp, entropy = grpo.chunked_logprobs(m, h, targets, temperature=0.7, chunk_size=chunk_size)
        (w * logp).sum().backward()
        out.append((logp, entropy, m.lm_head.weight.grad.clone(), m.lm_head.bias.grad.clone()))
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)  # float64: summation order only


def test_entropy_gradient_float64_matches_the_plain_twin_and_finite_differences():
    """The entropy bonus's gradient, by hand in ChunkedSoftmaxLogprobs (-p * (log p + H)), against
    autograd through log_softmax: entropy alone (logp unused: its gradient is None) and both."""
    torch.manual_seed(0)
    m = TinyHead()
    h = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,))

    def entropy_only(x):
        return grpo.chunked_logprobs(m, x, targets, temperature=0.7, chunk_size=3)[1]
    assert torch.autograd.gradcheck(entropy_only, (h,))
    w = torch.randn(7, dtype=torch.float64)
    u = torch.randn(7, dtype=torch.float64)
    for use_logp in (False, True):
        out = []
        for chunk_size in (3, 0):  # 0: the plain log_softmax twin
            m.zero_grad()
            h.grad = None
            logp, entropy = grpo.chunked_logprobs(m, h, targets, temperature=0.7,
                                                  chunk_size=chunk_size)
            ((u * entropy).sum() + (w * logp).sum() * use_logp).backward()
            out.append((h.grad.clone(), m.lm_head.weight.grad.clone(), m.lm_head.bias.grad.clone()))
        for got, want in zip(*out):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)  # float64: order only


def test_entropy_bonus_adds_minus_coef_times_the_aggregated_entropy():
    """The bonus is one more per-token term under the same aggregation; accumulate passes the
    policy's differentiable entropy, and without the bonus nothing changes."""
    logp, old, ref, adv, mask = loss_inputs()
    entropy = torch.rand(logp.shape, dtype=torch.float64, requires_grad=True)
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        plain = GRPOConfig(num_samples=2, loss_type=loss_type, max_completion_len=8)
        bonus = GRPOConfig(num_samples=2, loss_type=loss_type, max_completion_len=8,
                           entropy_coef=0.01)
        base, _ = grpo.grpo_loss(logp, old, ref, adv, mask, plain, num_seqs=4, num_tokens=12)
        got, _ = grpo.grpo_loss(logp, old, ref, adv, mask, bonus, num_seqs=4, num_tokens=12,
                                entropy=entropy)
        # The bonus alone is the loss of advantages 0 (no clip term) with entropy in logp's role.
        zero_adv = torch.zeros_like(adv)
        alone, _ = grpo.grpo_loss(logp, old, ref, zero_adv, mask, bonus, num_seqs=4,
                                  num_tokens=12, entropy=entropy)
        torch.testing.assert_close(got, base + alone, atol=1e-12, rtol=0)
        (grad,) = torch.autograd.grad(got, entropy)
        normaliser = {"dapo": 12, "grpo": 4 * mask.sum(1, keepdim=True), "dr_grpo": 4 * 8}
        want = torch.where(mask, torch.full_like(grad, -0.01) / normaliser[loss_type], 0.0)
        torch.testing.assert_close(grad, want, atol=1e-15, rtol=0)  # float64: one division
    with pytest.raises(ValueError, match="entropy_coef = 0.01 > 0 needs the entropy"):
        grpo.grpo_loss(logp, old, ref, adv, mask, bonus, num_seqs=4, num_tokens=12)
    # accumulate: the bonus's gradient is -coef * d(mean entropy); the twin computes it directly.
    m = tiny_model()
    batch, cfg = training_batch(m)
    cfg.beta = 0.0
    grpo.accumulate(m, batch, cfg)
    without = grads(m)
    m.zero_grad()
    cfg.entropy_coef = 0.05
    grpo.accumulate(m, batch, cfg)
    with_bonus = grads(m)
    m.zero_grad()
    _, ent, mask = grpo.completion_logprobs(m, batch.prompts, batch.completions,
                                            num_samples=cfg.num_samples, chunk_size=0)
    (-0.05 * (ent * mask).sum() / mask.sum()).backward()
    bonus_only = grads(m)
    want = {k: without[k] + bonus_only[k] for k in without}
    assert_grads_close(with_bonus, want, rel=1e-5)  # fp32, chunked vs plain: summation order



@pytest.mark.parametrize("shared", [True, False])
def test_logprob_of_token_t_comes_from_logits_at_t_minus_1(shared):
    m = tiny_model()
    prompt, completion = [3, 17, 42], [5, 9, 11, 60]
    logits = m(torch.tensor([prompt + completion]))[0]  # (7, V)
    logp, _, _ = grpo.completion_logprobs(m, [prompt], [completion], num_samples=1, shared_prompt=shared)
    for t, tok in enumerate(completion):
        # completion token t sits at sequence position 3 + t and is predicted by position 2 + t
        want = logits[2 + t].log_softmax(-1)[tok]
        off_by_one = logits[3 + t].log_softmax(-1)[tok] if t < 3 else None
        assert abs(logp[0, t].item() - want.item()) < 1e-5
        if off_by_one is not None:
            assert abs(logp[0, t].item() - off_by_one.item()) > 1e-3

# -----------------------------------------------------------------------------
# Micro-batches and accumulation == one big batch


def training_batch(m: M.Llama, G: int = 2) -> tuple[GRPOBatch, GRPOConfig]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (4, 9, 2, 6)]
    completions = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (3, 6, 1, 5, 4, 4, 2, 6)][:4 * G]
    cfg = GRPOConfig(num_samples=G, beta=0.05, max_completion_len=8)
    adv = grpo.group_advantages(torch.randn(4 * G, generator=gen), G)
    current = grpo.batch_logprobs(m, prompts, completions, cfg)
    mask = current != 0
    # Off-policy old logprobs (as at mu > 1) so that some ratios leave the clip range.
    old = current + 0.3 * torch.randn(current.shape, generator=gen) * mask
    ref = current + 0.5 * torch.randn(current.shape, generator=gen) * mask
    return GRPOBatch(prompts, completions, adv, old, ref), cfg


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_of_1_2_4_groups_equal_one_big_batch(loss_type):
    m = tiny_model()
    batch, cfg = training_batch(m)
    cfg.loss_type = loss_type
    logp, ent, mask = grpo.completion_logprobs(m, batch.prompts, batch.completions, num_samples=cfg.num_samples)
    loss, metrics = grpo.grpo_loss(logp, batch.old_logp, batch.ref_logp, batch.advantages, mask, cfg,
                                   num_seqs=len(batch.completions), num_tokens=int(mask.sum()))
    loss.backward()
    want = grads(m)
    assert metrics["clip_low"] + metrics["clip_high"] > 0  # the clip is exercised
    for groups in (1, 2, 4):
        m.zero_grad()
        cfg.micro_batch_groups = groups
        got = grpo.accumulate(m, batch, cfg)
        assert abs(got["loss"] - loss.item()) <= 1e-6 * max(1.0, abs(loss.item()))  # fp32 summation order
        assert_grads_close(grads(m), want, rel=1e-5)
        for key in ("clip_low", "clip_high", "ratio_mean", "ratio_min", "ratio_max", "kl"):
            assert abs(got[key] - metrics[key]) < 1e-6, key  # token-weighted, not micro-batch-weighted
        assert abs(got["entropy"] - ((ent * mask).sum() / mask.sum()).item()) < 1e-5


def test_accumulate_adds_to_existing_grads_and_batch_logprobs_match_one_pass():
    m = tiny_model()
    batch, cfg = training_batch(m)
    cfg.micro_batch_groups = 3  # 4 groups: slices of 3 and 1
    grpo.accumulate(m, batch, cfg)
    once = grads(m)
    grpo.accumulate(m, batch, cfg)
    assert_grads_close(grads(m), {k: 2 * v for k, v in once.items()}, rel=1e-6)
    with torch.no_grad():
        whole, _, _ = grpo.completion_logprobs(m, batch.prompts, batch.completions, num_samples=cfg.num_samples)
    # fp32; a different batch shape changes the matmul blocking, logp ~ -5: a few ulps
    torch.testing.assert_close(grpo.batch_logprobs(m, batch.prompts, batch.completions, cfg), whole,
                               atol=1e-5, rtol=0)

# -----------------------------------------------------------------------------
# The loss: finite differences, hand-built clipping, mu = 1


def loss_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    N, Tr = 4, 5
    logp = -3 * torch.rand(N, Tr, generator=gen, dtype=torch.float64)
    mask = torch.arange(Tr) < torch.tensor([5, 2, 4, 1])[:, None]
    old = logp + 0.3 * torch.randn(N, Tr, generator=gen, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(N, Tr, generator=gen, dtype=torch.float64)
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_gradient_matches_finite_differences(loss_type):
    logp, old, ref, adv, mask = loss_inputs()
    cfg = GRPOConfig(num_samples=2, loss_type=loss_type, beta=0.1, max_completion_len=8)
    ratio = (logp - old).exp()
    # Finite differences are meaningless at the clip kinks: make sure no ratio sits near one.
    assert ((ratio - (1 - cfg.eps_low)).abs() > 1e-3).all() and ((ratio - (1 + cfg.eps_high)).abs() > 1e-3).all()
    before = [t.clone() for t in (logp, old, ref, adv, mask)]
    f = lambda lp: grpo.grpo_loss(lp, old, ref, adv, mask, cfg, num_seqs=4, num_tokens=12)[0]
    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(),), eps=1e-6, atol=1e-8)
    lp = logp.clone().requires_grad_()
    f(lp).backward()
    assert torch.all(lp.grad[~mask] == 0)
    for b, a in zip(before, (logp, old, ref, adv, mask)):
        assert torch.equal(b, a)  # pure: inputs untouched


@pytest.mark.parametrize("ratio,adv,loss,grad,clip_low,clip_high", [
    (1.5, 1.0, -1.28, 0.0, 0, 1),   # above 1 + eps_high, A > 0: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5, 0, 0),    # above, A < 0: min() keeps the unclipped (worse) term
    (0.5, 1.0, -0.5, -0.5, 0, 0),   # below 1 - eps_low, A > 0: unclipped
    (0.5, -1.0, 0.8, 0.0, 1, 0),    # below, A < 0: clipped, no gradient
    (1.1, 1.0, -1.1, -1.1, 0, 0),   # inside the range: plain ratio * A
    (1.1, -1.0, 1.1, 1.1, 0, 0),
])
def test_clipping_on_hand_built_cases(ratio, adv, loss, grad, clip_low, clip_high):
    cfg = GRPOConfig(num_samples=1, eps_low=0.2, eps_high=0.28)
    old = torch.full((1, 1), -1.0, dtype=torch.float64)
    logp = (old + math.log(ratio)).requires_grad_()
    out, metrics = grpo.grpo_loss(logp, old, None, torch.tensor([adv], dtype=torch.float64),
                                  torch.ones(1, 1, dtype=torch.bool), cfg, num_seqs=1, num_tokens=1)
    out.backward()
    assert abs(out.item() - loss) < 1e-12
    assert abs(logp.grad.item() - grad) < 1e-12  # d(-ratio * A)/d logp = -ratio * A when unclipped
    assert (metrics["clip_low"], metrics["clip_high"]) == (clip_low, clip_high)


def test_mu_1_ratio_is_one_and_gradient_is_the_policy_gradient():
    G = 3
    prompts, completions = ragged_batch(G)
    m = tiny_model()
    adv = grpo.group_advantages(torch.tensor([1.0, 0, 0, 2, 1, 1, 0, 0, 3]), G)
    logp, _, mask = grpo.completion_logprobs(m, prompts, completions, num_samples=G)
    num_tokens = int(mask.sum())
    cfg = GRPOConfig(num_samples=G, loss_type="dapo")
    loss, metrics = grpo.grpo_loss(logp, None, None, adv, mask, cfg, num_seqs=9, num_tokens=num_tokens)
    assert metrics["ratio_min"] == metrics["ratio_max"] == metrics["ratio_mean"] == 1.0
    assert metrics["clip_low"] == metrics["clip_high"] == 0
    # Value: -sum(A * 1) / num_tokens (~0, not exactly: dapo weighs sequences by length).
    assert abs(loss.item() + (adv[:, None] * mask).sum().item() / num_tokens) < 1e-6
    surrogate = -(adv[:, None] * logp * mask).sum() / num_tokens  # REINFORCE with the group-mean baseline
    loss.backward(retain_graph=True)
    got = grads(m)
    m.zero_grad()
    surrogate.backward(retain_graph=True)
    assert_grads_close(got, grads(m), rel=1e-6)
    cfg.loss_type = "grpo"  # sequence means: -mean(A), and A sums to 0 in every group
    assert abs(grpo.grpo_loss(logp, None, None, adv, mask, cfg, num_seqs=9, num_tokens=num_tokens)[0].item()) < 1e-6

# -----------------------------------------------------------------------------
# Advantages


def test_group_advantages_edge_cases():
    nan, eps = float("nan"), 1e-4
    r = torch.tensor([1.0, 2.0, 3.0, 0.1, 0.1, 0.1, 1.0, nan, 3.0, nan, nan, nan, 7.0, nan, nan])
    a = grpo.group_advantages(r, 3, "group", std_eps=eps)
    s = math.sqrt(2 / 3)  # population std of 1, 2, 3
    want = [-1 / (s + eps), 0, 1 / (s + eps), 0, 0, 0, -1 / (1 + eps), 0, 1 / (1 + eps), 0, 0, 0, 0, 0, 0]
    torch.testing.assert_close(a, torch.tensor(want), atol=1e-6, rtol=0)
    assert torch.all(a[3:6] == 0)  # all-equal group: exactly 0 (0.1 * 3 / 3 != 0.1 in floats)
    assert not torch.isnan(a).any()  # NaN rewards and all-NaN groups get 0, never NaN
    torch.testing.assert_close(grpo.group_advantages(r, 3, "none"),
                               torch.tensor([-1.0, 0, 1, 0, 0, 0, -1, 0, 1, 0, 0, 0, 0, 0, 0]), atol=1e-6, rtol=0)
    valid = r[~torch.isnan(r)].double()
    batch_std = ((valid - valid.mean()) ** 2).mean().sqrt().item()
    torch.testing.assert_close(grpo.group_advantages(r, 3, "batch", std_eps=eps),
                               grpo.group_advantages(r, 3, "none") / (batch_std + eps), atol=1e-6, rtol=0)

# -----------------------------------------------------------------------------
# Bad input: clear errors naming the argument


def bad_inputs():
    m = tiny_model()
    cfg = GRPOConfig(num_samples=1, beta=0.1)
    z = torch.zeros(2, 3)
    ok_mask = torch.ones(2, 3, dtype=torch.bool)
    return [
        (lambda: GRPOConfig(eps_low=-0.1), "eps_low"),
        (lambda: GRPOConfig(eps_high=-0.1), "eps_high"),
        (lambda: GRPOConfig(loss_type="ppo"), "loss_type"),
        (lambda: GRPOConfig(scale="rank"), "scale"),
        (lambda: GRPOConfig(num_samples=0), "num_samples"),
        (lambda: GRPOConfig(temperature=0.0), "temperature"),
        (lambda: GRPOConfig(beta=-1.0), "beta"),
        (lambda: grpo.group_advantages(torch.zeros(5), 2), "num_samples"),
        (lambda: grpo.group_advantages(torch.zeros(2, 2), 2), "rewards"),
        (lambda: grpo.group_advantages(torch.zeros(4), 2, scale="rank"), "scale"),
        (lambda: grpo.completion_logprobs(m, [[1]], [[2]] * 3, num_samples=2), "completions"),
        (lambda: grpo.completion_logprobs(m, [[]], [[2]], num_samples=1), r"prompts\[0\]"),
        (lambda: grpo.grpo_loss(z, torch.zeros(2, 4), z, torch.zeros(2), ok_mask, cfg, num_seqs=2, num_tokens=6),
         "old_logp"),
        (lambda: grpo.grpo_loss(z, z, z, torch.zeros(3), ok_mask, cfg, num_seqs=2, num_tokens=6), "advantages"),
        (lambda: grpo.grpo_loss(z, z, z, torch.zeros(2), ok_mask[:, :2], cfg, num_seqs=2, num_tokens=6), "mask"),
        (lambda: grpo.grpo_loss(z, z, None, torch.zeros(2), ok_mask, cfg, num_seqs=2, num_tokens=6), "ref_logp"),
        (lambda: grpo.accumulate(m, GRPOBatch([[1]], [[2]], torch.zeros(2)), cfg), "batch.advantages"),
        (lambda: grpo.accumulate(m, GRPOBatch([[1]], [[2]], torch.zeros(1), torch.zeros(1, 2)), cfg), "batch.old_logp"),
    ]


@pytest.mark.parametrize("case", range(18))
def test_bad_input_raises_a_clear_error_naming_the_argument(case):
    call, match = bad_inputs()[case]
    with pytest.raises(ValueError, match=match):
        call()
