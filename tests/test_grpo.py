"""grpo.py against its slow twins: one forward per sequence, unchunked logprobs, one big batch,
finite differences and hand-computed cases; and against TRL 1.16 itself where it is importable."""

import dataclasses
import math
import statistics
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tolerance
from memtrace import allocator_peak

from engine import attention
from engine import sampling
import grpo
from engine import logprobs
from engine import packing
from engine import hf
import model as M
import rollout
from grpo import GRPOBatch, GRPOConfig
from rollout import RolloutConfig

V = 128
TINY = M.ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


# Published GQA layouts at TINY's width: Qwen3-0.6B's 16/8 (rep 2 != Hkv 8, its q/k norms, heads
# of 16: FlexAttention's CUDA kernel takes no fewer) and Qwen2.5-0.5B's 14/2 (rep 7, q/k/v biases,
# heads of 8) beside TINY's 4/2, where rep = Hkv: a kernel that maps query head h to kv head
# h // Hkv instead of h // rep passes at 4/2, not at these.
LAYOUTS = {
    "4/2": TINY,
    "qwen3_16/8": dataclasses.replace(TINY, architecture="Qwen3ForCausalLM", num_attention_heads=16,
                                      num_key_value_heads=8, head_dim=16),
    "qwen2.5_14/2": dataclasses.replace(TINY, architecture="Qwen2ForCausalLM",
                                        num_attention_heads=14, num_key_value_heads=2, head_dim=8,
                                        attention_bias=True),
}


def tiny_model(seed: int = 0, cls: type = M.Llama, layout: str = "4/2") -> M.Llama:
    # std 0.2 (not HF's 0.02): peaked logits and non-uniform attention, so indexing bugs show.
    return cls(LAYOUTS[layout]).init_weights(seed, std=0.2)


# Float32 values computed in another order (shared-prompt attention merges two softmaxes, chunks change
# the matmul blocking, another CPU's vector width another summation order): tolerances from the
# tiny models' chain of sums over up to 256 keys, at their logits' magnitude (tests/tolerance.py).
with torch.no_grad():
    LOGIT_SCALE = tiny_model()(torch.arange(V).view(2, -1)).abs().max().item()  # ~7


def logp_tol(temperature: float = 1.0) -> dict:
    """Logprobs and entropies: a log-softmax's error is its logits' (over the temperature)."""
    depth = tolerance.model_depth(TINY, TINY.max_position_embeddings)
    return tolerance.reordered(depth, LOGIT_SCALE / temperature)


LOGP_TOL = logp_tol()
# A metric of logprobs (a ratio exp(logp - old), a loss of A * ratio, their means) moves
# relatively as far as the logprobs move absolutely.
METRIC_REL = LOGP_TOL["atol"]
# A gradient, against its largest entry: the forward's and the backward's chains and the sum
# over a batch's tokens (< 256 here).
GRAD_REL = tolerance.reordered_rel(tolerance.grad_depth(TINY, TINY.max_position_embeddings, 256))


def ragged_batch(G: int = 3, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of lengths 5, 11, 2 using token ids >= 100 only; completions of lengths 1..7 using
    ids < 100, so an embedding row with gradient tells which part of the sequence it came from."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, V, (n,), generator=gen).tolist() for n in (5, 11, 2)]
    lens = [1, 7, 4, 3, 6, 2, 5, 7, 1][:3 * G] + [3] * max(0, 3 * G - 9)
    completions = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in lens]
    return prompts, completions


def grads(m: M.Llama) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def assert_rel(got: float, want: float, rel: float, floor: float = 1e-6, what: str = ""):
    """|got - want| <= rel * max(|want|, floor): relative; the floor keeps values near 0 sane."""
    assert abs(got - want) <= rel * max(abs(want), floor), f"{what}: {got!r} vs {want!r}"


def assert_grads_close(got: dict, want: dict, rel: float):
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-12)
        err = (got[name] - want[name]).abs().max()
        assert err <= rel * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def oracle_logprobs(m: M.Llama, prompts, completions, G: int, temperature: float = 1.0):
    """One full causal forward per (prompt + completion) sequence; token t is scored by the logits
    at position len(prompt) - 1 + t. Returns per-row lists of logp and entropy."""
    logps, ents = [], []
    for i, c in enumerate(completions):
        p = prompts[i // G]
        lp = (m(torch.tensor([p + c]))[0] / temperature).log_softmax(-1)  # (L, V)
        rows = lp[len(p) - 1:len(p) - 1 + len(c)]  # (len(c), V)
        logps.append(rows.gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
        ents.append(-(rows.exp() * rows).sum(-1))
    return logps, ents


def completion_logprobs(m, prompts, completions, *, num_samples: int, temperature: float = 1.0,
                        **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grpo.completion_logprobs on the tests' ragged lists: logp, entropy and the batch's mask."""
    batch = GRPOBatch.from_lists(prompts, completions, temperature=temperature)
    assert batch.num_samples == num_samples
    logp, entropy = grpo.completion_logprobs(m, batch, **kwargs)
    return logp, entropy, batch.mask


def weighted_sum(logp: torch.Tensor, mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A scalar that weighs every token differently, so any misrouted gradient shows."""
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))
    return (w * logp * mask).sum()

# -----------------------------------------------------------------------------
# Shared prompt == one forward per sequence (values and every parameter's gradient)


@pytest.mark.parametrize("forward,chunk_size", [("packed", 4), ("packed", 0), ("padded", 4),
                                                ("naive", 0), ("naive", 5)])
def test_logprobs_and_grads_equal_one_forward_per_sequence(forward, chunk_size):
    G, temperature = 3, 0.7
    prompts, completions = ragged_batch(G)
    m = tiny_model()
    logp, entropy, mask = completion_logprobs(m, prompts, completions, num_samples=G,
                                                   temperature=temperature, chunk_size=chunk_size,
                                                   forward=forward)
    # The entropy is differentiable too (an entropy bonus trains through it): weigh both.
    (weighted_sum(logp, mask) + weighted_sum(entropy, mask, seed=2)).backward()
    got = grads(m)
    m.zero_grad()
    ref_logp, ref_ent = oracle_logprobs(m, prompts, completions, G, temperature)
    ref_mask = torch.zeros_like(mask)
    ref = torch.zeros_like(logp).detach()
    ref_entropy = torch.zeros_like(logp).detach()
    for i, c in enumerate(completions):
        ref_mask[i, :len(c)] = True
        torch.testing.assert_close(logp[i, :len(c)], ref_logp[i], **logp_tol(temperature))
        torch.testing.assert_close(entropy[i, :len(c)], ref_ent[i], **logp_tol(temperature))
        rows_cols = (torch.tensor([i]), torch.arange(len(c)))
        ref = ref.index_put(rows_cols, ref_logp[i])
        ref_entropy = ref_entropy.index_put(rows_cols, ref_ent[i])
    assert torch.equal(mask, ref_mask)
    assert torch.all(logp[~mask] == 0) and torch.all(entropy[~mask] == 0)
    (weighted_sum(ref, ref_mask) + weighted_sum(ref_entropy, ref_mask, seed=2)).backward()
    assert_grads_close(got, grads(m), rel=GRAD_REL)


def ragged_groups(G: int = 3, seed: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """The shapes padding hides bugs in: prompts of 1 to 9 tokens, completions of 0 to 8 (the
    longest prompt and row set P and T), one group whose rows are all empty."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, V, (n,), generator=gen).tolist() for n in (1, 6, 9, 3)]
    lens = [0, 5, 2] + [0, 0, 0] + [8, 1, 3] + [4, 0, 6]
    completions = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in lens[:4 * G]]
    return prompts, completions


@pytest.mark.parametrize("ragged_from", [1.5, math.inf])  # the rows' ragged kernel, padded views
@pytest.mark.parametrize("dtype,layout", [(torch.float32, "4/2"), (torch.float64, "4/2"),
                                          (torch.float64, "qwen3_16/8"),
                                          (torch.float64, "qwen2.5_14/2")])
def test_the_packed_forward_equals_the_padded_one_on_ragged_batches(dtype, layout, ragged_from,
                                                                    monkeypatch):
    """Padding-free (only valid tokens, the default) against the padded twin (every prompt padded
    to P, every row to T): logprobs, entropies and every parameter's gradient on ragged groups, an
    all-empty group included. The same kernels on the same valid tokens, summed in another order:
    in float32 logp_tol and each gradient within GRAD_REL of its norm, in float64 1e-12. Both
    routes of the CPU's packed rows: the ragged kernel
    (these rows' padding is 3.8x their tokens) and padded views (RAGGED_FROM inf)."""
    monkeypatch.setattr(packing, "RAGGED_FROM", ragged_from)
    prompts, completions = ragged_groups()
    m = tiny_model(layout=layout).to(dtype)
    batch = GRPOBatch.from_lists(prompts, completions, temperature=0.8)
    out = {}
    for forward in ("packed", "padded"):
        logp, entropy = grpo.completion_logprobs(m, batch, chunk_size=7, forward=forward)
        (weighted_sum(logp, batch.mask) + weighted_sum(entropy, batch.mask, seed=2)).backward()
        out[forward] = logp.detach(), entropy.detach(), grads(m)
        m.zero_grad()
    float32 = dtype == torch.float32
    for got, want in zip(out["packed"][:2], out["padded"][:2]):
        torch.testing.assert_close(got, want, **(logp_tol(0.8) if float32 else
                                                 dict(rtol=1e-12, atol=1e-12)))
    rel = GRAD_REL if float32 else 1e-12
    for name, want in out["padded"][2].items():
        error = (out["packed"][2][name] - want).norm() / want.norm()
        assert error <= rel, (name, float(error))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("forward,ragged_from", [("packed", 1.5), ("packed", math.inf),
                                                  ("padded", math.inf)])
def test_float64_grads_of_the_shared_prompt_forwards_equal_the_naive_twins(forward, ragged_from,
                                                                           layout, monkeypatch):
    """The prompt once per group (packed: both CPU routes of its rows; padded) against the naive
    twin (the prompt repeated per row, causal SDPA's own GQA) in float64, on each of LAYOUTS:
    logprobs, entropies and every parameter's gradient within 1e-12 of its largest entry, the
    same math summed in another order.
    Regression: model.rms_norm rounded a float64 model's norms to float32, so the G rows'
    gradients into a shared prompt, summed before the norms' backward here and after it in the
    twin, were 1e-7 apart."""
    monkeypatch.setattr(packing, "RAGGED_FROM", ragged_from)
    prompts, completions = ragged_groups()
    m = tiny_model(layout=layout).double()
    batch = GRPOBatch.from_lists(prompts, completions, temperature=0.8)
    out = {}
    for name in (forward, "naive"):
        logp, entropy = grpo.completion_logprobs(m, batch, chunk_size=7, forward=name)
        (weighted_sum(logp, batch.mask) + weighted_sum(entropy, batch.mask, seed=2)).backward()
        out[name] = logp.detach(), entropy.detach(), grads(m)
        m.zero_grad()
    for got, want in zip(out[forward][:2], out["naive"][:2]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_close(out[forward][2], out["naive"][2], rel=1e-12)


def test_the_packed_forward_runs_on_valid_tokens_only():
    """The packed row holds each prompt's valid tokens once and each row's first c_i - 1 tokens:
    no linear runs on padding (the padded twin's row is Bp*P + N*(T-1) long)."""
    prompts, completions = ragged_groups()
    batch = GRPOBatch.from_lists(prompts, completions)
    packed = packing.pack(batch.prompt_ids, batch.prompt_lens, batch.tokens, batch.mask, 3)
    valid = sum(map(len, prompts)) + sum(max(len(c) - 1, 0) for c in completions)
    assert packed.tokens.shape == (1, valid) == packed.positions.shape
    assert len(packed.predict) == sum(map(len, completions))
    # Positions: a prompt from 0, a row from its prompt's length.
    assert packed.positions[0, :1].tolist() == [0] and packed.positions[0, 1:7].tolist() == list(
        range(6))
    first_row = sum(map(len, prompts))  # row 1 (5 tokens) after the 4 prompts; row 0 is empty
    assert packed.positions[0, first_row:first_row + 4].tolist() == [1, 2, 3, 4]


def test_flex_attention_on_the_packed_row_equals_the_padded_forward():
    """The CUDA route's attention (FlexAttention under the packed block mask) run eagerly on the
    CPU, where it has no backward: its hidden states equal the padded twin's (float32, another
    kernel: the stack's chain of sums at the residual stream's magnitude)."""
    if packing.flex_attention is None:
        pytest.skip("torch without flex_attention")
    prompts, completions = ragged_groups()
    m = tiny_model()
    batch = GRPOBatch.from_lists(prompts, completions)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention says it is for debugging
        h = packing.packed_hidden(m, batch.prompt_ids, batch.prompt_lens, batch.tokens,
                                  batch.mask, 3, attention=lambda p, rep:
                                  packing.packed_attention_flex(p))
        want = packing.padded_hidden(m, batch.prompt_ids, batch.prompt_lens,
                                     batch.tokens[:, :-1], 3)[batch.mask]
    depth = tolerance.model_depth(TINY, TINY.max_position_embeddings, "hidden")
    torch.testing.assert_close(h, want, **tolerance.reordered(depth, want.abs().max()))


def varlen_route(monkeypatch, record: list | None = None):
    """Make the packed forward take the CUDA bf16 route (packing.packed_attention_varlen) on the
    CPU, the varlen kernel's math twin in its place; record: the dtypes of each q, k, v the kernel
    gets."""
    from test_attention import MATH_VARLEN
    forward, backward = MATH_VARLEN

    def recorded(q, k, v, seg):
        if record is not None:
            record.append((q.dtype, k.dtype, v.dtype))
        return forward(q, k, v, seg)
    monkeypatch.setattr(packing, "packed_attention",
                        lambda p, rep, compiles=True: packing.packed_attention_varlen(
                            p, (recorded, backward)))


@pytest.mark.parametrize("dtype,twin,layout", [(torch.float32, "padded", "4/2"),
                                               (torch.float64, "padded", "4/2"),
                                               (torch.float64, "naive", "4/2"),
                                               (torch.float64, "naive", "qwen3_16/8"),
                                               (torch.float64, "naive", "qwen2.5_14/2")])
def test_the_cuda_varlen_route_equals_the_padded_and_naive_twins(dtype, twin, layout,
                                                                 monkeypatch):
    """The CUDA route in bf16 (SharedPromptAttentionVarlen over the packed tokens: the prompts causal,
    each group's rows folded against its prompt, each row causal, merged by log-sum-exp), with the
    varlen kernel's math twin standing in for the CUDA kernel, against the padded and the naive
    twins: logprobs, entropies and every gradient on ragged groups (1-token prompts, empty rows,
    an all-empty group). float32: the twin's softmax is exp(scores - logsumexp), not the flash
    kernels' running max, another summation order: logp_tol and GRAD_REL of each gradient's
    norm; float64: 1e-12, the same math."""
    varlen_route(monkeypatch)
    prompts, completions = ragged_groups()
    m = tiny_model(layout=layout).to(dtype)
    batch = GRPOBatch.from_lists(prompts, completions, temperature=0.8)
    out = {}
    for forward in ("packed", twin):
        logp, entropy = grpo.completion_logprobs(m, batch, chunk_size=7, forward=forward)
        (weighted_sum(logp, batch.mask) + weighted_sum(entropy, batch.mask, seed=2)).backward()
        out[forward] = logp.detach(), entropy.detach(), grads(m)
        m.zero_grad()
    float32 = dtype == torch.float32
    for got, want in zip(out["packed"][:2], out[twin][:2]):
        torch.testing.assert_close(got, want, **(logp_tol(0.8) if float32 else
                                                 dict(rtol=1e-12, atol=1e-12)))
    rel = GRAD_REL if float32 else 1e-12
    for name, want in out[twin][2].items():
        error = (out["packed"][2][name] - want).norm() / want.norm()
        assert error <= rel, (name, float(error))


def test_under_bf16_autocast_every_attention_gets_q_k_v_in_bf16(monkeypatch):
    """Regression: under bf16 autocast over fp32 weights the rope tables are fp32, so q and k left
    RoPE in fp32 while v was bf16; FlexAttention (not covered by autocast) then ran in fp32, its
    q's dtype. Now model.Attention.qkv returns all three in v's dtype: the hook, the varlen
    kernel and FlexAttention all get bf16."""
    prompts, completions = ragged_groups()
    m = tiny_model()
    batch = GRPOBatch.from_lists(prompts, completions)
    seen = []

    def hook(layer, q, k, v):
        seen.append((q.dtype, k.dtype, v.dtype))
        return M.causal_attention(layer, q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.hidden(batch.prompt_ids, attention=hook)
    kernel = []
    varlen_route(monkeypatch, kernel)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grpo.completion_logprobs(m, batch, chunk_size=0)[0].sum().backward()
    flex = []
    if packing.flex_attention is not None:
        def recorded_flex(q, k, v, **kwargs):
            flex.append((q.dtype, k.dtype, v.dtype))
            return packing.flex_attention(q, k, v, **kwargs)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex_attention says it is for debugging
            packing.packed_hidden(m, batch.prompt_ids, batch.prompt_lens, batch.tokens,
                                  batch.mask, 3, lambda p, rep: packing.packed_attention_flex(
                                      p, recorded_flex))
    assert len(seen) == 2 and len(kernel) == 3 * 2 and len(flex) in (0, 2)
    assert set(seen + kernel + flex) == {(torch.bfloat16,) * 3}


def test_the_cuda_route_falls_back_in_one_line_saying_why(monkeypatch):
    """cuda_route: varlen_attn where it can run, else FlexAttention (head dims of 16 or more),
    else padded rows, each fallback with one line naming what is missing (train.py prints it at
    the first step)."""
    name, why = packing.cuda_route(torch.float32, 64)
    assert name == "flex" and "bf16 or fp16, not float32" in why and "\n" not in why
    # Regression: FlexAttention's CUDA lowering refuses head dims under 16 (an InductorError at
    # the first training step of a float32 model with 8-wide heads, on an H200)
    name, why = packing.cuda_route(torch.float32, 8)
    assert name == "padded" and "takes head_dim 16 or more, not 8" in why
    # A model whose steps never pay FlexAttention's compile back runs padded rows eagerly
    name, why = packing.cuda_route(torch.float32, 64, compiles=False)
    assert name == "padded" and "never pay" in why
    monkeypatch.setattr(packing, "VARLEN", True)  # as on torch >= 2.10
    assert "multiple of 8" in packing.cuda_route(torch.bfloat16, 12)[1]
    monkeypatch.setattr(packing, "VARLEN", False)
    assert "has no varlen_attn (2.10 and later)" in packing.cuda_route(torch.bfloat16, 64)[1]
    monkeypatch.setattr(packing, "FLEX_ON_CUDA", False)
    name, why = packing.cuda_route(torch.bfloat16, 64)
    assert name == "padded" and "no FlexAttention" in why


def test_flex_attention_is_compiled_once_per_process():
    """Regression: packed_attention_flex wrapped flex_attention in a new torch.compile in every
    forward (the CUDA route's kernel); it is one per process."""
    if packing.flex_attention is None:
        pytest.skip("torch without flex_attention")
    assert packing.compiled_flex() is packing.compiled_flex()


def truncated_prompt_logprobs(m: M.Llama, prompts, completions,
                              G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What TRL PR #2669 first did: the prompt forward runs under no_grad and its cache is
    reused."""
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
    h = m.hidden(comp[:, :-1], positions,
                 lambda l, q, k, v: attention.shared_prompt_attention(q, k, v, own, *kv[l], valid))
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
    logp, _, mask = completion_logprobs(m, prompts, completions, num_samples=G)
    weighted_sum(logp, mask).backward()
    exact = grads(m)
    m.zero_grad()
    bad_logp, bad_mask = truncated_prompt_logprobs(m, prompts, completions, G)
    assert torch.equal(mask, bad_mask)
    torch.testing.assert_close(bad_logp * mask, logp, **LOGP_TOL)  # same values...
    weighted_sum(bad_logp, mask).backward()
    bad = grads(m)
    prompt_only = sorted({t for p in prompts for t in p})  # ids >= 100 never occur in completions
    # ...but the prompt gets nothing
    assert torch.all(bad["model.embed_tokens.weight"][prompt_only] == 0)
    assert torch.all(exact["model.embed_tokens.weight"][prompt_only].abs().sum(1) > 0)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        rel = (bad[name] - exact[name]).norm() / exact[name].norm()
        assert rel > 1e-2, f"{name}: truncated gradient only {rel:.2g} off"
    # the head sees the same values (in another summation order)
    head = exact["lm_head.weight"]
    torch.testing.assert_close(bad["lm_head.weight"], head, rtol=GRAD_REL,
                               atol=GRAD_REL * head.abs().max().item())


def hidden_states(forward: str, m, prompt_ids, prompt_lens, inputs, G: int) -> torch.Tensor:
    """packing's padded forward, or its packed one fed the same rows (one token more each, so that
    every input feeds a state)."""
    if forward == "padded":
        return packing.padded_hidden(m, prompt_ids, prompt_lens, inputs, G)  # (N, T+1, C)
    tokens = torch.cat([inputs, inputs[:, :1]], 1)  # (N, T+1)
    return packing.packed_hidden(m, prompt_ids, prompt_lens, tokens, torch.ones_like(
        tokens, dtype=torch.bool), G)  # (n, C)


@pytest.mark.parametrize("forward", ["packed", "padded"])
def test_shared_prompt_backward_holds_no_pending_weight_gradient(forward):
    """Regression: the prompt and the completions ran as two forwards, so every weight got two
    gradients and autograd held one until the other came: all blocks' at once when the prompt ran
    first (+9-10 MB beside 11.8 MB of grads in tests/bench_plan.py), one block's when the two
    alternated block by block. Packed into one forward, each weight gets one. Few tokens, wide
    blocks, many of them: weight gradients dominate the peak."""
    cfg = M.ModelConfig(vocab_size=16, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)
    m = M.Llama(cfg).init_weights(0)
    G = 2
    prompt_ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    prompt_lens = torch.tensor([4, 3])
    inputs = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(0))

    def backward():
        h = hidden_states(forward, m, prompt_ids, prompt_lens, inputs, G)
        h.square().sum().backward()
    backward()  # the grads exist now, as in every micro-batch after the first
    block = sum(p.numel() * 4 for p in m.model.layers[0].parameters())  # float32
    peak = allocator_peak(backward)  # above the grads: pending ones and activations
    # The saved activations of 20 tokens and transients: 3.6 MB, 1.5 blocks (2.4 MB). One pending
    # block made it 6.1 MB; the whole-forward-first order, all 8 blocks' gradients, 21.1 MB.
    assert peak < 2 * block, (peak, block)


@pytest.mark.parametrize("forward", ["packed", "padded"])
def test_shared_prompt_forward_saves_no_repeated_prompt(forward):
    """The completions read the prompt's K/V once per group: nothing saved for backward is as
    large as a per-row copy of the prompt's keys, (N, Hkv, P, D), nor a per-row (T, P + T) mask
    (both were saved per layer when the prompt was repeated for one fused SDPA call)."""
    cfg = M.ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    m = M.Llama(cfg).init_weights(0)
    Bp, G, P, T = 2, 8, 40, 3
    prompt_ids = torch.randint(0, 16, (Bp, P), generator=torch.Generator().manual_seed(0))
    inputs = torch.randint(0, 16, (Bp * G, T), generator=torch.Generator().manual_seed(1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        hidden_states(forward, m, prompt_ids, torch.tensor([P, 31]), inputs, G)
    # A per-row copy has N rows and the prompt's P (or P + T) keys: (N, Hkv, P + T, D) K/V, or
    # the (N, 1, T, P + T) mask. The prompt's own tensors have Bp rows (torch 2.5's SDPA saves
    # the prompt's (Bp, H, P, P) probabilities under GQA: once per group, not per row).
    per_row = [s for s in saved if s[0] == Bp * G and (P in s[1:] or P + T in s[1:])]
    assert not per_row, per_row

@pytest.mark.parametrize("layout", ["4/2", "qwen3_16/8"])
def test_shared_prompt_attention_under_bf16_autocast_equals_its_twin(monkeypatch, layout):
    """bf16 autocast over fp32 weights (train.py --dtype bfloat16) hands the attention q, k in
    fp32 (rope) and v in bf16: the flash path runs in one dtype and matches the repeated-prompt
    twin to bf16's resolution (8 bits: 1e-1 on logprobs of magnitude ~8, 3% on a gradient); on
    TINY and on Qwen3's layout (its q/k norms under autocast too)."""
    G = 3
    prompts, completions = ragged_batch(G)
    m = tiny_model(layout=layout)
    batch = grpo.GRPOBatch.from_lists(prompts, completions)

    def logp_and_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = grpo.completion_logprobs(m, batch, chunk_size=0)
        weighted_sum(logp, batch.mask).backward()
        grad = m.model.layers[0].self_attn.k_proj.weight.grad.clone()
        m.zero_grad()
        return logp.detach(), grad
    got, got_grad = logp_and_grad()
    monkeypatch.setattr(packing, "CPU_FLASH", False)  # the repeated-prompt twin
    want, want_grad = logp_and_grad()
    torch.testing.assert_close(got, want, atol=1e-1, rtol=0)
    assert (got_grad - want_grad).norm() <= 0.03 * want_grad.norm()

# -----------------------------------------------------------------------------
# Chunked == unchunked; the token/position alignment


class HeadSpy(M.Llama):
    """Records the rows of every (rows, V) logits tensor: they are all made in head()."""
    def __init__(self, cfg: M.ModelConfig):
        super().__init__(cfg)
        self.rows_seen: list[int] = []

    def head(self, h: torch.Tensor) -> torch.Tensor:
        self.rows_seen.append(h.shape[0])
        return super().head(h)


def test_chunked_logprobs_under_bf16_autocast_give_the_head_its_gradient():
    """Regression (torch 2.5): autocast cached a graph-less bf16 copy of lm_head's weight inside
    the chunked Function's forward (grad off) and reused it in the backward's rebuild: lm_head got
    no gradient, so bf16 training never moved it. The chunked path against the plain one, both
    under autocast: the same gradients (bf16 logits, fp32 accumulation: 2e-2 relative)."""
    torch.manual_seed(0)
    m = M.Llama(M.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1)).init_weights(0)
    h, targets = torch.randn(10, 32), torch.randint(0, 32, (10,))
    grads = []
    for chunk_size in (3, 0):  # 0: the plain log_softmax twin
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = logprobs.chunked_logprobs(m, h, targets, chunk_size=chunk_size)
            logp.sum().backward()
        grads.append([p.grad for p in (m.lm_head.weight, m.model.norm.weight)])
    for got, want in zip(*grads):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_chunked_logprobs_backward_outside_autocast_rebuilds_chunks_as_forward_ran():
    """torch's advice is backward outside the autocast block (the GPU tests call it so): the
    chunked Function's backward rebuilds each chunk's logits under forward's autocast, not the
    caller's at backward time, which mixed float32 hidden states with the bf16 head copy (a
    RuntimeError on an H200). The Function's gradients (its hidden states', the head's and the
    final norm's) the same, bit for bit, as a backward inside the block. The blocks' own backward
    is torch's: outside autocast torch 2.5's differs in the last bits, torch 2.14's does not."""
    cfg = M.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    model = M.Llama(cfg).init_weights(0)
    tokens = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        hidden = model.hidden(tokens)[0]  # (T, C): the Function's input, as the blocks give it
    grads = []
    for inside in (True, False):
        model.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, entropy = logprobs.chunked_logprobs(model, h, targets, chunk_size=3)
            loss = logp.sum() - 0.3 * entropy.sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([h.grad] + [p.grad.clone() for p in (model.lm_head.weight,
                                                          model.model.norm.weight)])
    assert all(g is not None for g in grads[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class CastCounter(TorchDispatchMode):
    """Counts the casts of a (V, C) tensor between float32 and bf16, both ways."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.down, self.up = tuple(shape), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
            self.down += args[0].dtype == torch.float32 and out.dtype == torch.bfloat16
            self.up += args[0].dtype == torch.bfloat16 and out.dtype == torch.float32
        return out


@pytest.mark.parametrize("tied", [False, True])
def test_the_chunked_head_casts_its_weight_once_and_equals_autocasts_casts(monkeypatch, tied):
    """Under bf16 autocast the chunked Function casts lm_head's weight to bf16 once
    (logprobs.head_copy) and adds each chunk's gradient of that copy into the float32 .grad itself.
    Its slow twin, autocast's own casts (head_copy off: the weight cast again in every chunk's
    forward and rebuild, every chunk's gradient cast back by autograd), gives the same logprobs,
    entropies and gradients bit for bit: the same roundings, summed in the same order. With an
    entropy term, the kept last chunk, and a tied embedding whose rows add into the same .grad.
    The (V, C) casts: 1 down and 1 up, against 2 down (1 for the kept chunk) and 1 up per chunk."""
    cfg = M.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = M.Llama(cfg).init_weights(0)
    tokens = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(2))
    results = []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(logprobs, "head_copy", lambda model, device_type: None)
        model.zero_grad(set_to_none=True)
        counter = CastCounter(model.lm_head.weight.shape)
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.hidden(tokens)[0]  # (11, C): the embedding's rows in the graph too
            logp, entropy = logprobs.chunked_logprobs(model, h, targets, chunk_size=3)
            (logp.sum() - 0.3 * entropy.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((logp.detach(), entropy.detach(), grads, counter.down, counter.up))
    (logp, entropy, grads, down, up), (logp2, entropy2, grads2, down2, up2) = results
    assert torch.equal(logp, logp2) and torch.equal(entropy, entropy2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    chunks = 4  # 11 tokens, 3 a chunk
    assert (down, up) == (1, 1)  # up: the first chunk's gradient makes .grad; the rest add into it
    assert (down2, up2) == (2 * chunks - 1, chunks)  # the kept last chunk is not rebuilt


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize("path", ["softmax", "checkpoint"])
def test_chunked_equals_unchunked_and_never_holds_more_than_a_chunk(path, chunk_size):
    """Both chunked paths (the default ChunkedSoftmaxLogprobs; checkpoint around a given
    logprob_fn, as under tensor parallelism) against one log_softmax over all tokens; 7 does not
    divide n = 36."""
    G = 3
    prompts, completions = ragged_batch(G)
    n = sum(len(c) for c in completions)
    m = tiny_model(cls=HeadSpy)
    logp, ent, mask = completion_logprobs(m, prompts, completions, num_samples=G, chunk_size=0)
    weighted_sum(logp, mask).backward()
    want = grads(m)
    m.zero_grad()
    rows_seen = m.rows_seen
    rows_seen.clear()  # the unchunked twin's rows
    fn = logprobs.logprobs_from_logits if path == "checkpoint" else None
    logp_c, ent_c, _ = completion_logprobs(m, prompts, completions, num_samples=G,
                                                chunk_size=chunk_size, logprob_fn=fn)
    chunks = math.ceil(n / chunk_size)
    assert len(rows_seen) == chunks and max(rows_seen) <= chunk_size and sum(rows_seen) == n
    weighted_sum(logp_c, mask).backward()
    # backward rebuilt each chunk, but the softmax path's last, kept from forward
    rebuilt = chunks - (path == "softmax")
    assert len(rows_seen) == chunks + rebuilt and max(rows_seen) <= chunk_size
    # Same math on row subsets; the matmul blocking changes with the row count.
    torch.testing.assert_close(logp_c, logp, **LOGP_TOL)
    torch.testing.assert_close(ent_c, ent, **LOGP_TOL)
    assert_grads_close(grads(m), want, rel=GRAD_REL)
    with torch.no_grad():  # no recompute without grad; same values
        rows_seen.clear()
        logp_n, _, _ = completion_logprobs(m, prompts, completions, num_samples=G,
                                                chunk_size=chunk_size, logprob_fn=fn)
    assert len(rows_seen) == chunks
    torch.testing.assert_close(logp_n, logp.detach(), **LOGP_TOL)


def test_the_heads_weight_gradient_does_not_wait_under_the_saved_activations():
    """Regression: the chunked head returned its (V, C) weight gradient to autograd, which held
    it until the tied embedding's gradient arrived, the last node of backward: one more V x C
    (113 MB at SmolLM2's 49,152 x 576) under every saved activation. It now goes into .grad
    chunk by chunk, so it is there when the last block's backward starts; the values stay those
    of the unchunked twin (test_chunked_equals_unchunked_and_never_holds_more_than_a_chunk)."""
    cfg = M.ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    m = M.Llama(cfg).init_weights(0, std=0.2)
    batch, grpo_cfg = training_batch(m)
    grpo_cfg.chunk_bytes = 4 * V * 4  # 4 rows a chunk: several chunks
    seen = []

    def on_output(module, args, out):  # returns None: the output stays as it is
        out.register_hook(lambda g: seen.append(m.lm_head.weight.grad is not None))
    m.model.layers[-1].register_forward_hook(on_output)
    m.zero_grad(set_to_none=True)
    grpo.accumulate(m, batch, grpo_cfg)
    assert seen and seen[0], seen  # already in .grad when the first block gradient arrives


def test_before_backward_runs_between_each_forward_and_its_backward():
    """train.py trims the CPU heap there: once per micro-batch, after its forward (the loss has a
    graph) and before its backward (the first micro-batch's weights have no grad yet)."""
    m = tiny_model()
    batch, cfg = training_batch(m)
    cfg.micro_batch_groups = 1  # 4 micro-batches
    seen = []
    m.zero_grad(set_to_none=True)
    grpo.accumulate(m, batch, cfg, before_backward=lambda: seen.append(m.lm_head.weight.grad))
    assert len(seen) == 4 and seen[0] is None and all(g is not None for g in seen[1:])


@pytest.mark.parametrize("vocab,dtype,rows", [(V, torch.float32, 4), (4 * V, torch.float32, 1),
                                              (V, torch.float64, 2), (V, torch.bfloat16, 4)])
def test_a_logprob_chunk_holds_at_most_chunk_bytes_of_logits(vocab, dtype, rows):
    """Regression: chunks were a token count (1,024), so one chunk's float32 logits grew with the
    vocabulary (201 MB at V = 49,152). Now accumulate and batch_logprobs cut chunks of as many
    rows as chunk_bytes holds (logits in float32, float64 for a float64 model), at least one."""
    cfg = M.ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    m = HeadSpy(cfg).init_weights(0, std=0.2).to(dtype)
    batch, grpo_cfg = training_batch(tiny_model())  # token ids < V <= vocab
    grpo_cfg.chunk_bytes = 2048
    assert logprobs.chunk_rows(2048, vocab, dtype) == rows
    m.rows_seen.clear()
    grpo.batch_logprobs(m, batch, grpo_cfg)
    grpo.accumulate(m, batch, grpo_cfg)
    itemsize = torch.promote_types(dtype, torch.float32).itemsize
    assert max(m.rows_seen) == rows and rows * vocab * itemsize <= 2048 or rows == 1
    assert logprobs.chunk_rows(0, vocab, dtype) == 0  # the unchunked twin stays reachable


class TinyHead(torch.nn.Module):
    """A small float64 stand-in for model.head."""
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
    f = lambda x: logprobs.chunked_logprobs(m, x, targets, temperature=0.7, chunk_size=3)[0]
    assert torch.autograd.gradcheck(f, (h,))
    w = torch.randn(7, dtype=torch.float64)
    out = []
    for chunk_size in (3, 0):  # 0: the plain log_softmax twin
        m.zero_grad()
        logp, entropy = logprobs.chunked_logprobs(m, h, targets, temperature=0.7,
                                                  chunk_size=chunk_size)
        (w * logp).sum().backward()
        out.append((logp, entropy, m.lm_head.weight.grad.clone(), m.lm_head.bias.grad.clone()))
    for got, want in zip(*out):
        # float64: summation order only (values ~1: relative, and a floor for grads near 0)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # The last chunk's graph is kept from forward and spent by the first backward: a second one
    # (retain_graph) rebuilds it and adds the same gradient again.
    m.zero_grad()
    loss = (w * logprobs.chunked_logprobs(m, h, targets, temperature=0.7, chunk_size=3)[0]).sum()
    loss.backward(retain_graph=True)
    once = m.lm_head.weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(m.lm_head.weight.grad, 2 * once, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(once, out[1][2], rtol=1e-10, atol=1e-12)


def float64_twin(m: TinyHead, h: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The definitions, autograd all the way: p = softmax(z), logp = log p[target],
    H = -sum p log p."""
    p = (m.head(h) / temperature).softmax(-1)  # (n, V)
    logp = p.gather(-1, targets[:, None]).squeeze(-1).log()
    return logp, -(p * p.log()).sum(-1)


@pytest.mark.parametrize("route", ["plain", "chunked", "checkpoint"])
def test_entropy_is_differentiable_on_every_logprob_route(route):
    """Regression: the chunked Function marked the entropy non-differentiable and the plain twin
    computed it without grad, while tp.py's route differentiated it: an entropy term in a loss
    trained under tensor parallelism and was silently dropped at TP = 1. Each route's gradient of
    w1 logp + w2 H against autograd of the float64 definitions (tests/test_tp.py: the TP route)."""
    torch.manual_seed(0)
    m = TinyHead()
    h = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    w1 = torch.randn(7, dtype=torch.float64)
    w2 = torch.randn(7, dtype=torch.float64)
    kw = dict(temperature=0.7, chunk_size=0 if route == "plain" else 3,
              logprob_fn=logprobs.logprobs_from_logits if route == "checkpoint" else None)
    logp, entropy = logprobs.chunked_logprobs(m, h, targets, **kw)
    assert entropy.requires_grad
    (w1 * logp + w2 * entropy).sum().backward()
    got = [h.grad.clone(), m.lm_head.weight.grad.clone(), m.lm_head.bias.grad.clone()]
    h.grad = None
    m.zero_grad()
    want_logp, want_entropy = float64_twin(m, h, targets, 0.7)
    (w1 * want_logp + w2 * want_entropy).sum().backward()
    want = [h.grad, m.lm_head.weight.grad, m.lm_head.bias.grad]
    # float64, values ~1: summation order only (relative, with a floor for grads near 0)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    # The entropy alone, and finite differences through the hand-written backward.
    entropy_only = lambda x: logprobs.chunked_logprobs(m, x, targets, **kw)[1]
    assert torch.autograd.gradcheck(entropy_only, (h.detach().requires_grad_(),))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_entropy_bonus_adds_minus_coef_times_the_aggregated_entropy(loss_type):
    """The bonus is one more per-token term under the loss's own aggregation, and without it
    nothing changes; the gradient reaching the entropy is -coef / normaliser on valid tokens."""
    logp, old, ref, adv, mask = loss_inputs()
    entropy = torch.rand(logp.shape, dtype=torch.float64, requires_grad=True)
    counts = dict(num_seqs=4, num_tokens=12, max_completion_len=8)
    plain = GRPOConfig(loss_type=loss_type)
    bonus = GRPOConfig(loss_type=loss_type, entropy_coef=0.01)
    base, _ = grpo.grpo_loss(logp, old, ref, adv, mask, plain, **counts)
    got, _ = grpo.grpo_loss(logp, old, ref, adv, mask, bonus, **counts, entropy=entropy)
    same, _ = grpo.grpo_loss(logp, old, ref, adv, mask, plain, **counts, entropy=entropy)
    assert same.item() == base.item()  # entropy_coef 0: the entropy is not read
    (grad,) = torch.autograd.grad(got, entropy)
    per_row = 4 * mask.sum(1, keepdim=True).double()  # grpo: each row's token mean, / num_seqs
    normaliser = {"dapo": 12, "grpo": per_row, "dr_grpo": 4 * 8}[loss_type]
    want = torch.where(mask, -0.01 / normaliser * torch.ones_like(grad), 0.0)  # float64
    torch.testing.assert_close(grad, want, atol=1e-15, rtol=0)  # float64: one division
    torch.testing.assert_close(got, base + (want * entropy).sum(), atol=1e-15, rtol=0)
    with pytest.raises(ValueError, match="entropy is None but entropy_coef = 0.01 needs it"):
        grpo.grpo_loss(logp, old, ref, adv, mask, bonus, **counts)


@pytest.mark.parametrize("chunk_size", [0, 4])
def test_entropy_bonus_trains_the_policy_entropy_through_accumulate(chunk_size):
    """accumulate with the bonus = accumulate without it + the gradient of -coef * the token mean
    of the entropy, computed by the plain twin (one forward per sequence, log_softmax)."""
    m = tiny_model()
    batch, cfg = training_batch(m)
    cfg.chunk_bytes = chunk_size * V * 4  # rows of float32 logits
    grpo.accumulate(m, batch, cfg)
    without = grads(m)
    m.zero_grad()
    cfg.entropy_coef = 0.05
    grpo.accumulate(m, batch, cfg)
    with_bonus = grads(m)
    m.zero_grad()
    prompts, completions = batch.lists()
    _, ents = oracle_logprobs(m, prompts, completions, batch.num_samples)
    total = sum(e.sum() for e in ents)
    (-0.05 * total / batch.mask.sum()).backward()
    want = {k: without[k] + v for k, v in grads(m).items()}
    assert_grads_close(with_bonus, want, rel=GRAD_REL)  # chunked/shared vs one forward each


@pytest.mark.parametrize("forward", grpo.FORWARDS)
def test_logprob_of_token_t_comes_from_logits_at_t_minus_1(forward):
    m = tiny_model()
    prompt, completion = [3, 17, 42], [5, 9, 11, 60]
    logits = m(torch.tensor([prompt + completion]))[0]  # (7, V)
    logp, _, _ = completion_logprobs(m, [prompt], [completion], num_samples=1,
                                          forward=forward)
    for t, tok in enumerate(completion):
        # completion token t sits at sequence position 3 + t and is predicted by position 2 + t
        want = logits[2 + t].log_softmax(-1)[tok]
        off_by_one = logits[3 + t].log_softmax(-1)[tok] if t < 3 else None
        assert abs(logp[0, t].item() - want.item()) <= LOGP_TOL["atol"], f"token {t}"
        if off_by_one is not None:
            assert abs(logp[0, t].item() - off_by_one.item()) > 1e-3

# -----------------------------------------------------------------------------
# Micro-batches and accumulation == one big batch


def training_batch(m: M.Llama, G: int = 2) -> tuple[GRPOBatch, GRPOConfig]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (4, 9, 2, 6)]
    lens = (3, 6, 1, 5, 4, 4, 2, 6)[:4 * G]
    completions = [torch.randint(0, V, (n,), generator=gen).tolist() for n in lens]
    cfg = GRPOConfig(beta=0.05, micro_batch_groups=4)
    adv = grpo.group_advantages(torch.randn(4 * G, generator=gen), G)
    batch = GRPOBatch.from_lists(prompts, completions, max_new_tokens=8, advantages=adv)
    current = grpo.batch_logprobs(m, batch, cfg)
    mask = batch.mask
    # Off-policy old logprobs (as at mu > 1) so that some ratios leave the clip range.
    batch.old_logp = current + 0.3 * torch.randn(current.shape, generator=gen) * mask
    batch.ref_logp = current + 0.5 * torch.randn(current.shape, generator=gen) * mask
    return batch, cfg


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_of_1_2_4_groups_equal_one_big_batch(loss_type):
    m = tiny_model()
    batch, cfg = training_batch(m)
    cfg.loss_type = loss_type
    logp, ent = grpo.completion_logprobs(m, batch)
    mask = batch.mask
    loss, metrics = grpo.grpo_loss(logp, batch.old_logp, batch.ref_logp, batch.advantages, mask,
                                   cfg, num_seqs=mask.shape[0], num_tokens=int(mask.sum()),
                                   max_completion_len=batch.max_new_tokens)
    loss.backward()
    want = grads(m)
    assert metrics["clip_low"] + metrics["clip_high"] > 0  # the clip is exercised
    token_budgets = (1, 60, 10**6)  # one group each, balanced bins of several, all at once
    for groups, tokens in [(1, 0), (2, 0), (4, 0)] + [(4, t) for t in token_budgets]:
        m.zero_grad()
        cfg.micro_batch_groups, cfg.micro_batch_tokens = groups, tokens
        got = grpo.accumulate(m, batch, cfg)
        # The loss is a sum of terms ~1 that nearly cancel (advantages sum to 0 in each group):
        # its fp32 error scales with the terms, not with the small result, hence the floor of 1.
        # logp in another batch shape is off in the last bits, and so are ratios exp(logp - old).
        assert_rel(got["loss"], loss.item(), METRIC_REL, floor=1.0, what="loss")
        assert_grads_close(grads(m), want, rel=GRAD_REL)
        for key in ("clip_low", "clip_high", "ratio_mean", "ratio_min", "ratio_max", "kl"):
            # token-weighted, not micro-batch-weighted; the floor covers clip fractions near 0
            assert_rel(got[key], metrics[key], METRIC_REL, what=key)
        want_entropy = ((ent * mask).sum() / mask.sum()).item()
        assert_rel(got["entropy"], want_entropy, METRIC_REL, what="entropy")


def test_the_default_micro_batch_is_a_token_budget_short_groups_pack_fewer_and_fuller():
    """Regression: the CPU's default micro-batch (plan.bound_micro_batch) was a count of groups,
    so a batch of short completions ran in as many micro-batches as one at full length (on an
    H200 four micro-batches of short rows cost 2.44x their token share: launch-bound). The count
    is now a token budget, that many groups at full length: here 8 groups whose completions
    average a third of the budget run in 2 micro-batches where 2 groups each ran 4, and the loss
    and every gradient equal the one big batch's (the tolerances of the test above)."""
    from run import plan
    m = tiny_model()
    gen = torch.Generator().manual_seed(5)
    G, budget = 2, 9
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (6, 3, 5, 2, 4, 6, 1, 3)]
    lens = [9, 2, 1, 3, 2, 1, 4, 2, 1, 1, 3, 2, 2, 5, 1, 3]  # mean 2.6 of 9
    completions = [torch.randint(0, V, (n,), generator=gen).tolist() for n in lens]
    adv = grpo.group_advantages(torch.randn(len(lens), generator=gen), G)
    batch = GRPOBatch.from_lists(prompts, completions, max_new_tokens=budget, advantages=adv)
    group_tokens = 6 + G * budget  # a group at full length: the plan's unit
    small = {"train": {"trainer": 1, "transient": 1}}  # the plan's bound holds 2 groups
    cfg = plan.bound_micro_batch(lambda g: small, GRPOConfig(micro_batch_groups=2), group_tokens)
    assert cfg.micro_batch_tokens == 2 * group_tokens
    by_count = grpo.micro_batches(batch, dataclasses.replace(cfg, micro_batch_tokens=0))
    assert len(grpo.micro_batches(batch, cfg)) == 2 < len(by_count) == 4
    one = GRPOConfig(micro_batch_groups=len(prompts))
    want = grpo.accumulate(m, batch, one)
    want_grads = grads(m)
    m.zero_grad()
    got = grpo.accumulate(m, batch, cfg)
    assert_rel(got["loss"], want["loss"], METRIC_REL, floor=1.0, what="loss")
    assert_grads_close(grads(m), want_grads, rel=GRAD_REL)


def test_micro_batches_by_tokens_are_whole_groups_balanced_under_the_cap():
    """--micro_batch_tokens: every group in exactly one micro-batch, none over the cap unless it
    is a group alone, the heaviest first; on ragged groups of several per micro-batch no
    micro-batch carries more than 1.3x their mean; batch_logprobs puts each row back in place."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        sizes = torch.randint(40, 2400, (int(torch.randint(2, 64, (1,), generator=gen)),),
                              generator=gen).tolist()
        cap = [3000, 6000, 12000][trial % 3]
        bins = grpo.balanced_bins(sizes, cap)
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in b) for b in bins]
        assert all(load <= cap or len(b) == 1 for b, load in zip(bins, loads))
        assert loads == sorted(loads, reverse=True)
        if min(map(len, bins)) >= 3:
            assert max(loads) <= 1.3 * sum(loads) / len(loads), loads
    m = tiny_model()
    prompts, completions = ragged_groups()
    batch = GRPOBatch.from_lists(prompts, completions)
    cfg = GRPOConfig(micro_batch_tokens=12)
    micro = grpo.micro_batches(batch, cfg)
    assert sorted(torch.cat([rows for rows, _ in micro]).tolist()) == list(range(12))
    assert len(micro) > 1
    with torch.no_grad():
        whole, _ = grpo.completion_logprobs(m, batch)
    torch.testing.assert_close(grpo.batch_logprobs(m, batch, cfg), whole, **LOGP_TOL)


def test_accumulate_adds_to_existing_grads_and_batch_logprobs_match_one_pass():
    m = tiny_model()
    batch, cfg = training_batch(m)
    cfg.micro_batch_groups = 3  # 4 groups: slices of 3 and 1
    grpo.accumulate(m, batch, cfg)
    once = grads(m)
    grpo.accumulate(m, batch, cfg)
    # each micro-batch's gradient added twice: a sum of 4 terms in another order
    assert_grads_close(grads(m), {k: 2 * v for k, v in once.items()},
                       rel=tolerance.reordered_rel(4))
    with torch.no_grad():
        whole, _ = grpo.completion_logprobs(m, batch)
    # a different batch shape changes the matmul blocking
    torch.testing.assert_close(grpo.batch_logprobs(m, batch, cfg), whole, **LOGP_TOL)
    # A float64 model's old/reference logprobs stay float64 (they used to be rounded to float32).
    m64 = m.double()
    assert grpo.batch_logprobs(m64, batch, cfg).dtype == torch.float64

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


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_gradient_matches_finite_differences(loss_type, bias_correction):
    logp, old, ref, adv, mask = loss_inputs()
    cfg = GRPOConfig(loss_type=loss_type, beta=0.1,
                     use_bias_correction_kl=bias_correction)
    ratio = (logp - old).exp()
    # Finite differences are meaningless at the clip kinks: make sure no ratio sits near one.
    assert ((ratio - (1 - cfg.eps_low)).abs() > 1e-3).all()
    assert ((ratio - (1 + cfg.eps_high)).abs() > 1e-3).all()
    before = [t.clone() for t in (logp, old, ref, adv, mask)]
    def f(lp):
        return grpo.grpo_loss(lp, old, ref, adv, mask, cfg, num_seqs=4, num_tokens=12,
                              max_completion_len=8)[0]
    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(),), eps=1e-6, atol=1e-8)
    lp = logp.clone().requires_grad_()
    f(lp).backward()
    assert torch.all(lp.grad[~mask] == 0)
    for b, a in zip(before, (logp, old, ref, adv, mask)):
        assert torch.equal(b, a)  # pure: inputs untouched


def slow_loss(logp, old, ref, adv, mask, cfg: GRPOConfig, num_seqs: int, num_tokens: int):
    """TRL's formulas written out token by token on 0-d tensors (autograd through the loop is the
    twin's gradient): ratio r = exp(logp - old), -min(r A, clip(r) A), + beta k3 (times r with
    the bias correction), each sequence's mean ("grpo") or sum, over the batch normaliser."""
    total = logp.new_zeros(())
    for i in range(logp.shape[0]):
        length = int(mask[i].sum())
        for t in range(length):  # the mask is a prefix: completions are right-padded
            lp = logp[i, t]
            r = torch.exp(lp - (lp.detach() if old is None else old[i, t]))
            clipped = r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
            term = -torch.minimum(r * adv[i], clipped * adv[i])
            if cfg.beta > 0:
                d = ref[i, t] - lp
                k3 = torch.exp(d) - d - 1
                term = term + cfg.beta * (k3 * r if cfg.use_bias_correction_kl else k3)
            total = total + (term / length if cfg.loss_type == "grpo" else term)
    normaliser = {"grpo": num_seqs, "dapo": num_tokens,
                  "dr_grpo": num_seqs * 8}[cfg.loss_type]  # the tests' budget: 8
    return total / normaliser


@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("beta,bias_correction", [(0.0, True), (0.1, True), (0.1, False)])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_and_gradient_equal_the_token_by_token_twin(loss_type, beta, bias_correction, mu):
    logp, old, ref, adv, mask = loss_inputs()
    old = None if mu == 1 else old  # mu = 1: old_logp is the current policy, detached
    cfg = GRPOConfig(loss_type=loss_type, beta=beta,
                     use_bias_correction_kl=bias_correction)
    got_lp = logp.clone().requires_grad_()
    loss, metrics = grpo.grpo_loss(got_lp, old, ref, adv, mask, cfg, num_seqs=4, num_tokens=12,
                                   max_completion_len=8)
    loss.backward()
    want_lp = logp.clone().requires_grad_()
    want = slow_loss(want_lp, old, ref, adv, mask, cfg, num_seqs=4, num_tokens=12)
    want.backward()
    # float64, ~12 terms of ~1 that partly cancel: relative to the terms' scale
    assert_rel(loss.item(), want.item(), 1e-12, floor=1.0, what="loss")
    torch.testing.assert_close(got_lp.grad, want_lp.grad, rtol=1e-12, atol=1e-15)
    if mu == 2 and beta > 0:
        assert metrics["clip_low"] + metrics["clip_high"] > 0  # the clip is exercised


def slow_family_loss(logp, old, ref, adv, mask, cfg: GRPOConfig, entropy, sampler,
                     num_seqs: int, num_tokens: int):
    """The GRPO family written out row by row and token by token on 0-d tensors (autograd through
    the loops is the twin's gradient): GSPO's exp(mean log-ratio), cispo's detached capped
    weight, delta's cap, the off-policy row mask, the entropy quantile (numpy's linear rule by
    hand), the sampler weight per token or per row, truncated or masked; then the KL and the
    bonus, and the aggregation of slow_loss."""
    valid = sorted(entropy[mask].float().double().tolist())
    pos = (len(valid) - 1) * (1 - cfg.top_entropy_quantile)
    lo = math.floor(pos)
    threshold = valid[lo] + (valid[min(lo + 1, len(valid) - 1)] - valid[lo]) * (pos - lo)
    low, high = cfg.sampler_correction_min, cfg.sampler_correction_max

    def correct(ratio: float) -> float:
        if cfg.sampler_correction_mode.endswith("truncate"):
            return min(max(ratio, low), high)
        return ratio if low <= ratio <= high else 0.0
    total = logp.new_zeros(())
    for i in range(logp.shape[0]):
        L = int(mask[i].sum())
        behaviour = [float((old if old is not None else logp.detach())[i, t]) for t in range(L)]
        log_ratios = [logp[i, t] - (logp[i, t].detach() if old is None else old[i, t])
                      for t in range(L)]
        if cfg.importance_sampling_level == "sequence":
            log_ratios = [sum(log_ratios) / L] * L
        gaps = [behaviour[t] - float(sampler[i, t]) for t in range(L)]
        weights = [correct(math.exp(g)) for g in gaps]
        if cfg.sampler_correction_mode.startswith("sequence"):
            weights = [correct(math.exp(sum(gaps)))] * L
        drift = sum(float(sampler[i, t] - logp[i, t].detach()) for t in range(L)) / max(L, 1)
        keep = float(adv[i] >= 0 or drift <= cfg.off_policy_mask_threshold)
        for t in range(L):
            r = torch.exp(log_ratios[t])
            if cfg.loss_type == "cispo":
                term = -torch.clamp(r, max=cfg.eps_high).detach() * adv[i] * logp[i, t]
            else:
                clipped = r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
                term = -torch.minimum(torch.clamp(r, max=cfg.delta) * adv[i], clipped * adv[i])
            top = float(float(entropy[i, t].detach()) >= threshold)
            term = term * keep * top * (weights[t] if cfg.sampler_correction else 1.0)
            d = ref[i, t] - logp[i, t]
            k3 = torch.exp(d) - d - 1
            term = term + cfg.beta * (k3 * r if cfg.use_bias_correction_kl else k3)
            term = term - cfg.entropy_coef * entropy[i, t] * top
            total = total + (term / L if cfg.loss_type == "grpo" else term)
    normaliser = {"grpo": num_seqs, "dapo": num_tokens, "cispo": num_tokens,
                  "dr_grpo": num_seqs * 8}[cfg.loss_type]  # the tests' budget: 8
    return total / normaliser


FAMILY = [dict(importance_sampling_level="sequence", loss_type="grpo"),
          dict(importance_sampling_level="sequence"),
          dict(loss_type="cispo", eps_high=1.2), dict(delta=1.1),
          dict(top_entropy_quantile=0.4, entropy_coef=0.01),
          dict(off_policy_mask_threshold=0.05),
          *[dict(sampler_correction_mode=mode, sampler_correction_min=0.8,
                 sampler_correction_max=1.25) for mode in grpo.CORRECTION_MODES],
          dict(importance_sampling_level="sequence", loss_type="cispo", eps_high=1.1,
               top_entropy_quantile=0.5, off_policy_mask_threshold=0.0,
               sampler_correction_mode="token_truncate", sampler_correction_max=1.1)]


@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("knobs", FAMILY, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_family_loss_and_gradient_equal_the_token_by_token_twin(knobs, mu):
    """float64, no TRL needed: every knob (and all at once) against slow_family_loss, loss to
    1e-12 and d loss / d logp and d loss / d entropy to 1e-12 (float64 sums of ~20 terms)."""
    logp, old, ref, adv, mask = loss_inputs()
    old = None if mu == 1 else old
    gen = torch.Generator().manual_seed(5)
    entropy = 3 * torch.rand(logp.shape, generator=gen, dtype=torch.float64)
    sampler = logp + 0.2 * torch.randn(logp.shape, generator=gen, dtype=torch.float64)
    cfg = GRPOConfig(beta=0.1, **knobs)
    counts = dict(num_seqs=4, num_tokens=12)
    got_lp, got_h = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    loss, metrics = grpo.grpo_loss(got_lp, old, ref, adv, mask, cfg, **counts,
                                   max_completion_len=8, entropy=got_h, sampler_logp=sampler)
    (loss * 3).backward()  # not 1: a gradient scaled twice would show
    want_lp, want_h = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    want = slow_family_loss(want_lp, old, ref, adv, mask, cfg, want_h, sampler, **counts)
    (want * 3).backward()
    assert_rel(loss.item(), want.item(), 1e-12, floor=1.0, what="loss")
    torch.testing.assert_close(got_lp.grad, want_lp.grad, rtol=1e-12, atol=1e-15)
    zeros = torch.zeros_like(entropy)  # no entropy_coef: ours never reads the entropy's grad
    torch.testing.assert_close(zeros if got_h.grad is None else got_h.grad, want_h.grad,
                               rtol=1e-12, atol=1e-15)
    assert metrics["sampler_ratio_min"] <= metrics["sampler_ratio_mean"]
    assert metrics["sampler_ratio_mean"] <= metrics["sampler_ratio_max"]


def test_cispo_weight_is_a_detached_capped_constant_and_gspo_one_ratio_per_row():
    """Hand-built: cispo's gradient is -min(r, eps_high) A / n per token even where PPO's clip
    would zero it; GSPO's ratio is exp(mean log-ratio) of the row, the same on all its tokens,
    and its gradient spreads r A / (n L) over the row's L tokens."""
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)).requires_grad_()
    one = dict(num_seqs=1, num_tokens=2, max_completion_len=2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=torch.float64)
    cfg = GRPOConfig(loss_type="cispo", eps_high=1.5, sampler_correction=False)
    loss, metrics = grpo.grpo_loss(logp, old, None, adv, mask, cfg, **one)
    loss.backward()
    # weights min(2, 1.5) = 1.5 and 1; gradient -w A / 2 (dapo's token mean), value -w A logp / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.75, -0.5]], dtype=torch.float64))
    assert_rel(loss.item(), -(1.5 * logp[0, 0] + logp[0, 1]).item() / 2, 1e-12, what="loss")
    assert metrics["clip_high"] == 0.5  # one token of two held by the cap
    logp.grad = None
    cfg = GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", eps_high=1.0)
    loss, metrics = grpo.grpo_loss(logp, old, None, adv, mask, cfg, **one)
    loss.backward()
    r = math.sqrt(2.0)  # exp(mean(log 2, 0))
    assert_rel(metrics["ratio_mean"], r, 2 * tolerance.EPS32, what="ratio")  # metrics: float32
    assert metrics["clip_high"] == 0.0  # eps_high 1: 1 + 1 = 2 > sqrt(2)
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -r / 2, dtype=torch.float64))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampler_logp_is_the_sampled_distributions_and_the_correction_is_trainer_over_it(top_p):
    """rollout.generate records each token's logprob under the distribution it drew from: the
    logits / temperature, then top-p. Oracle: one full forward per row, filter_logits by hand.
    At top_p = 1 that is the trainer's logprob at the same temperature (weight 1 up to float32);
    under top-p the sampler's is higher by -log(kept mass), and the token-level correction weight
    pi_trainer / pi_sampler is exactly that mass: the importance weight for a trainer scoring the
    untruncated policy (trl#4159, trl#6789). The batch carries rollout.Rollout.stopped."""
    m = tiny_model()
    G, T, budget = 3, 0.7, 6
    prompts = [[100, 101, 102], [110, 111]]
    cfg = RolloutConfig(num_samples=G, max_new_tokens=budget, temperature=T, top_p=top_p)
    out = rollout.generate(m, prompts, cfg, stop_ids=(4, 7, 72), seed=3)
    batch = GRPOBatch.from_rollout(prompts, out, budget, torch.zeros(len(prompts) * G))
    batch.check()
    trainer = grpo.batch_logprobs(m, batch, GRPOConfig())  # (N, Tr) at the batch's temperature
    kept_mass = torch.ones_like(trainer)
    with torch.no_grad():
        for i, row in enumerate(batch.lists()[1]):
            p = prompts[i // G]
            logits = m(torch.tensor([p + row]))[0, len(p) - 1:len(p) - 1 + len(row)]  # (L, V)
            sampled = sampling.filter_logits(logits, T, 0, top_p).log_softmax(-1)
            want = sampled.gather(-1, torch.tensor(row)[:, None])[:, 0]
            torch.testing.assert_close(out.logprobs[i, :len(row)], want, **logp_tol(T))
            kept = sampled.isfinite()
            kept_mass[i, :len(row)] = ((logits / T).softmax(-1) * kept).sum(-1)
        ends = [r[-1] in (4, 7, 72) for r in batch.lists()[1]]
        assert torch.equal(out.stopped, torch.tensor(ends))
    assert out.stopped.any() and not out.stopped.all()  # both kinds of row
    if top_p == 1.0:  # the same distribution: the sampler's logprob is the trainer's
        torch.testing.assert_close(out.logprobs, trainer.float(), **logp_tol(T))
        # a softmax's V probabilities summed: 1 up to that sum's rounding
        torch.testing.assert_close(kept_mass, torch.ones_like(kept_mass), **tolerance.reordered(V))
    else:
        assert (kept_mass[batch.mask] < 1).any()
    weights, stats = grpo.sampler_weights(trainer, out.logprobs, batch.mask, GRPOConfig(
        sampler_correction_mode="token_truncate", sampler_correction_max=math.inf))
    # a weight exp(logp - logp') moves relatively as far as the logprobs absolutely
    rel = logp_tol(T)["atol"]
    torch.testing.assert_close(weights[batch.mask], kept_mass[batch.mask], rtol=rel, atol=rel)


def test_mask_truncated_completions_drops_rows_without_a_stop_id_from_loss_and_counts():
    """DAPO's overlong filtering through accumulate: the loss and gradient equal those of a batch
    whose truncated rows carry advantage 0 and are left out of the token count; without
    batch.stopped it is one clear error."""
    G = 3
    prompts, completions = ragged_batch(G)
    adv = grpo.group_advantages(torch.tensor([1.0, 0, 0, 2, 1, 1, 0, 0, 3]), G)
    stopped = torch.tensor([True, False, True, True, True, False, False, True, True])
    m = tiny_model()
    cfg = GRPOConfig(mask_truncated_completions=True, micro_batch_groups=2)
    batch = GRPOBatch.from_lists(prompts, completions, advantages=adv, stopped=stopped)
    got = grpo.accumulate(m, batch, cfg)
    got_grads = grads(m)
    m.zero_grad()
    kept_tokens = int((batch.mask & stopped[:, None]).sum())
    twin = GRPOBatch.from_lists(prompts, completions, advantages=adv * stopped)
    want = grpo.accumulate(m, twin, GRPOConfig(micro_batch_groups=2), num_tokens=kept_tokens)
    assert_rel(got["loss"], want["loss"], METRIC_REL, floor=1.0, what="loss")
    assert_grads_close(got_grads, grads(m), rel=GRAD_REL)
    assert got["tokens"] == kept_tokens
    with pytest.raises(ValueError, match="mask_truncated_completions needs batch.stopped"):
        grpo.accumulate(m, dataclasses.replace(batch, stopped=None), cfg)


def test_cat_groups_equals_the_batch_built_from_the_same_lists():
    """Dynamic sampling's join: groups picked from two batches of different widths equal one
    batch built from those groups' token lists, every per-row tensor cut alike."""
    G = 3
    prompts, completions = ragged_batch(G)
    gen = torch.Generator().manual_seed(2)

    def with_tensors(p, c):
        b = GRPOBatch.from_lists(p, c)
        extra = dict(advantages=torch.randn(b.mask.shape[0], generator=gen),
                     sampler_logp=torch.randn(b.mask.shape, generator=gen) * b.mask,
                     stopped=torch.rand(b.mask.shape[0], generator=gen) > 0.5)
        return dataclasses.replace(b, **extra)
    first = with_tensors(prompts, completions)
    second = with_tensors(prompts[::-1], completions[::-1])
    picked = grpo.cat_groups([(first, torch.tensor([2])), (second, torch.tensor([0, 1]))])
    rows = [6, 7, 8]
    want = GRPOBatch.from_lists([prompts[2], prompts[2], prompts[1]],
                                [completions[i] for i in rows + rows[::-1] + [5, 4, 3]])
    assert picked.lists() == want.lists()
    assert torch.equal(picked.mask, want.mask)
    for name, source in (("advantages", None), ("stopped", None), ("sampler_logp", None)):
        got = getattr(picked, name)
        parts = [getattr(first, name)[6:9], getattr(second, name)[0:6]]
        if got.dim() == 2:
            width = got.shape[1]
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
        assert torch.equal(got, torch.cat(parts)), name


def test_bias_corrected_kl_gradient_at_mu_1_is_hand_derived():
    """Regression: grpo.py had only the plain k3 term. TRL's default multiplies it by the ratio,
    which is 1 at mu = 1 but whose gradient adds beta * k3 per token: with d = ref - logp,
    d/dlogp [-A r + beta k3 r] at r = 1 is -A + beta (1 - exp(d) + k3)."""
    logp, _, ref, adv, mask = loss_inputs()
    beta = 0.1
    d = ref - logp
    k3 = d.exp() - d - 1
    for bias_correction in (True, False):
        cfg = GRPOConfig(beta=beta, use_bias_correction_kl=bias_correction)
        lp = logp.clone().requires_grad_()
        loss = grpo.grpo_loss(lp, None, ref, adv, mask, cfg, num_seqs=4, num_tokens=12,
                              max_completion_len=8)[0]
        loss.backward()
        kl_grad = 1 - d.exp() + (k3 if bias_correction else 0)
        want = (-adv[:, None] + beta * kl_grad) * mask / 12  # dapo: sum over the 12 tokens / 12
        torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-15)  # float64


@pytest.mark.parametrize("ratio,adv,loss,grad,clip_low,clip_high", [
    (1.5, 1.0, -1.28, 0.0, 0, 1),   # above 1 + eps_high, A > 0: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5, 0, 0),    # above, A < 0: min() keeps the unclipped (worse) term
    (0.5, 1.0, -0.5, -0.5, 0, 0),   # below 1 - eps_low, A > 0: unclipped
    (0.5, -1.0, 0.8, 0.0, 1, 0),    # below, A < 0: clipped, no gradient
    (1.1, 1.0, -1.1, -1.1, 0, 0),   # inside the range: plain ratio * A
    (1.1, -1.0, 1.1, 1.1, 0, 0),
])
def test_clipping_on_hand_built_cases(ratio, adv, loss, grad, clip_low, clip_high):
    cfg = GRPOConfig(eps_low=0.2, eps_high=0.28)
    old = torch.full((1, 1), -1.0, dtype=torch.float64)
    logp = (old + math.log(ratio)).requires_grad_()
    out, metrics = grpo.grpo_loss(logp, old, None, torch.tensor([adv], dtype=torch.float64),
                                  torch.ones(1, 1, dtype=torch.bool), cfg, num_seqs=1, num_tokens=1,
                                  max_completion_len=1)
    out.backward()
    # float64, values ~1: exp(log(ratio)) is a few ulps off ratio
    assert_rel(out.item(), loss, 1e-12, floor=1e-3, what="loss")
    # d(-ratio * A)/d logp = -ratio * A when unclipped, exactly 0 when clipped
    assert_rel(logp.grad.item(), grad, 1e-12, floor=1e-3, what="grad")
    assert (metrics["clip_low"], metrics["clip_high"]) == (clip_low, clip_high)


def test_mu_1_ratio_is_one_and_gradient_is_the_policy_gradient():
    G = 3
    prompts, completions = ragged_batch(G)
    m = tiny_model()
    adv = grpo.group_advantages(torch.tensor([1.0, 0, 0, 2, 1, 1, 0, 0, 3]), G)
    logp, _, mask = completion_logprobs(m, prompts, completions, num_samples=G)
    num_tokens = int(mask.sum())
    cfg = GRPOConfig(loss_type="dapo")
    loss, metrics = grpo.grpo_loss(logp, None, None, adv, mask, cfg, num_seqs=9,
                                   num_tokens=num_tokens, max_completion_len=8)
    assert metrics["ratio_min"] == metrics["ratio_max"] == metrics["ratio_mean"] == 1.0
    assert metrics["clip_low"] == metrics["clip_high"] == 0
    # Value: -sum(A * 1) / num_tokens (~0, not exactly: dapo weighs sequences by length).
    # a sum of terms ~1 that nearly cancel: the floor of 1 is their scale
    assert_rel(loss.item(), -(adv[:, None] * mask).sum().item() / num_tokens, METRIC_REL,
               floor=1.0, what="loss")
    # REINFORCE with the group-mean baseline
    surrogate = -(adv[:, None] * logp * mask).sum() / num_tokens
    loss.backward(retain_graph=True)
    got = grads(m)
    m.zero_grad()
    surrogate.backward(retain_graph=True)
    assert_grads_close(got, grads(m), rel=GRAD_REL)
    cfg.loss_type = "grpo"  # sequence means: -mean(A), and A sums to 0 in every group
    seq_loss, _ = grpo.grpo_loss(logp, None, None, adv, mask, cfg, num_seqs=9,
                                 num_tokens=num_tokens, max_completion_len=8)
    # a value near 0: absolute, fp32 sums of terms ~1
    assert abs(seq_loss.item()) < tolerance.reordered_rel(num_tokens)

# -----------------------------------------------------------------------------
# Advantages


NAN = float("nan")
# Groups of 3: spread; all equal (0.1 * 3 / 3 != 0.1 in floats); one missing; all missing; one
# valid; two equal and one not.
REWARDS = [1.0, 2.0, 3.0, 0.1, 0.1, 0.1, 1.0, NAN, 3.0, NAN, NAN, NAN, 7.0, NAN, NAN, 0.0, 1.0, 1.0]


def slow_advantages(rewards: list[float], G: int, scale: str, eps: float,
                    correction: int) -> list[float]:
    """The obvious twin in Python floats: statistics.stdev (n-1) or pstdev over the valid rewards
    of the group ("group") or of the whole batch ("batch"); 0 for a missing reward and for a
    group with fewer than two distinct valid rewards."""
    std_of = statistics.stdev if correction else statistics.pstdev
    batch = [x for x in rewards if not math.isnan(x)]
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        valid = [x for x in group if not math.isnan(x)]
        for x in group:
            if math.isnan(x) or len(set(valid)) < 2:
                out.append(0.0)
            elif scale == "none":
                out.append(x - statistics.fmean(valid))
            else:
                std = std_of(valid if scale == "group" else batch)
                out.append((x - statistics.fmean(valid)) / (std + eps))
    return out


@pytest.mark.parametrize("correction", [1, 0])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_the_python_twin(scale, correction):
    got = grpo.group_advantages(torch.tensor(REWARDS), 3, scale, std_eps=1e-4,
                                std_correction=correction)
    want = torch.tensor(slow_advantages(REWARDS, 3, scale, 1e-4, correction))
    # float64 inside, float32 out: an ulp relative; the zeros must be exact zeros
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.all(got[want == 0] == 0) and not torch.isnan(got).any()


def test_group_advantages_default_to_the_n_minus_1_std_of_trl_and_verl():
    """Regression: the population std made advantages sqrt(G / (G-1)) larger than TRL's and
    verl's (29% at G = 2), and not uniformly so once some rewards are missing."""
    eps = 1e-4
    a = grpo.group_advantages(torch.tensor(REWARDS[:9]), 3, std_eps=eps)
    # n-1 std: 1 for (1, 2, 3); sqrt(2) for (1, 3)
    root2 = 2 ** 0.5
    want = [-1 / (1 + eps), 0, 1 / (1 + eps), 0, 0, 0, -1 / (root2 + eps), 0, 1 / (root2 + eps)]
    torch.testing.assert_close(a, torch.tensor(want), rtol=1e-6, atol=0)  # an ulp of float32
    assert GRPOConfig().std_correction == 1
    two = grpo.group_advantages(torch.tensor([0.0, 1.0]), 2, std_eps=0.0)
    torch.testing.assert_close(two, torch.tensor([-0.5, 0.5]) / 0.5 ** 0.5, rtol=1e-6, atol=0)


def test_combine_rewards_skips_missing_functions_like_trl():
    """Regression: train.py made a row missing when ANY reward function returned None; TRL sums
    the others (nansum), and a row is missing only when every function returned None."""
    per_function = [[1.0, 0.5, NAN], [NAN, 2.0, 1.0], [NAN, NAN, NAN], [0.0, 0.0, 0.0],
                    [NAN, NAN, -3.0]]
    weights = [1.0, 0.5, 2.0]
    want = []  # the obvious twin: a Python loop
    for row in per_function:
        valid = [w * r for w, r in zip(weights, row) if not math.isnan(r)]
        want.append(sum(valid) if valid else NAN)
    got = grpo.combine_rewards(torch.tensor(per_function, dtype=torch.float64), weights)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=0,
                               equal_nan=True)  # sums of 2-3 exact binary fractions: exact
    assert torch.isnan(got).tolist() == [False, False, True, False, False]


def test_informative_groups_are_those_group_advantages_does_not_zero():
    """Groups whose scored rewards are all equal (one scored, or none, included) get advantage 0:
    dynamic sampling drops exactly those."""
    nan = math.nan
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.5,   # equal: no gradient
                            0.0, 1.0, 0.0, 1.0,   # varied
                            nan, 0.2, 0.2, nan,   # equal among the scored
                            nan, nan, nan, nan],  # nothing scored
                           dtype=torch.float64)
    assert grpo.informative_groups(rewards, 4).tolist() == [False, True, False, False]
    zero_groups = (grpo.group_advantages(rewards, 4).view(-1, 4) == 0).all(1)
    assert torch.equal(zero_groups, ~grpo.informative_groups(rewards, 4))


def test_group_advantages_with_every_reward_missing_are_zero():
    for scale in ("group", "batch", "none"):
        a = grpo.group_advantages(torch.full((6,), NAN), 3, scale)
        assert torch.equal(a, torch.zeros(6)), scale  # never NaN

# -----------------------------------------------------------------------------
# Bad input: clear errors naming the argument


def bad_inputs():
    m = tiny_model()
    cfg = GRPOConfig(beta=0.1)
    z = torch.zeros(2, 3)
    ok_mask = torch.ones(2, 3, dtype=torch.bool)

    def loss(*tensors):
        return grpo.grpo_loss(*tensors, cfg, num_seqs=2, num_tokens=6, max_completion_len=3)

    return [
        (lambda: GRPOConfig(eps_low=-0.1), "eps_low"),
        (lambda: GRPOConfig(eps_high=-0.1), "eps_high"),
        (lambda: GRPOConfig(loss_type="ppo"), "loss_type"),
        (lambda: GRPOConfig(scale="rank"), "scale"),
        (lambda: GRPOConfig(micro_batch_groups=0), "micro_batch_groups"),
        (lambda: GRPOConfig(beta=-1.0), "beta"),
        (lambda: GRPOConfig(std_correction=2), "std_correction"),
        (lambda: grpo.group_advantages(torch.zeros(4), 2, std_correction=-1), "std_correction"),
        (lambda: grpo.combine_rewards(torch.zeros(4), [1.0]), "per_function"),
        (lambda: grpo.combine_rewards(torch.zeros(4, 2, dtype=torch.long), [1.0, 1.0]),
         "per_function"),
        (lambda: grpo.combine_rewards(torch.zeros(4, 2), [1.0]), "weights"),
        (lambda: grpo.group_advantages(torch.zeros(5), 2), "num_samples"),
        (lambda: grpo.group_advantages(torch.zeros(2, 2), 2), "rewards"),
        (lambda: grpo.group_advantages(torch.zeros(4), 2, scale="rank"), "scale"),
        (lambda: grpo.batch_logprobs(m, GRPOBatch.from_lists([[1], [2]], [[2]] * 3), cfg),
         "batch.tokens has 3 rows for 2 prompts"),
        (lambda: grpo.batch_logprobs(m, GRPOBatch.from_lists([[]], [[2]]), cfg),
         "batch.prompt_lens"),
        (lambda: grpo.batch_logprobs(m, GRPOBatch.from_lists([[1]], [[2]], temperature=0.0), cfg),
         "batch.temperature"),
        (lambda: loss(z, torch.zeros(2, 4), z, torch.zeros(2), ok_mask), "old_logp"),
        (lambda: loss(z, z, z, torch.zeros(3), ok_mask), "advantages"),
        (lambda: loss(z, z, z, torch.zeros(2), ok_mask[:, :2]), "mask"),
        (lambda: loss(z, z, None, torch.zeros(2), ok_mask), "ref_logp"),
        (lambda: grpo.accumulate(m, GRPOBatch.from_lists([[1]], [[2]],
                                                         advantages=torch.zeros(2)), cfg),
         "batch.advantages"),
        (lambda: grpo.accumulate(m, GRPOBatch.from_lists([[1]], [[2]]), cfg), "batch.advantages"),
        (lambda: grpo.accumulate(m, GRPOBatch.from_lists([[1]], [[2]], advantages=torch.zeros(1),
                                                         old_logp=torch.zeros(1, 2)), cfg),
         "batch.old_logp"),
    ]


@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_bad_input_raises_a_clear_error_naming_the_argument(case):
    call, match = bad_inputs()[case]
    with pytest.raises(ValueError, match=match):
        call()

# -----------------------------------------------------------------------------
# Against TRL 1.16 itself, on the same weights. Each test skips when trl is not importable: trl is
# a reference here, never a requirement. TRL runs its own code: a real GRPOTrainer on the CPU whose
# generation is its rollout_func hook returning fixed completions, its own reward scoring and
# advantages (_generate_and_score_completions) and its own loss (_compute_loss).

TRL_MICRO_BATCHES = 2  # TRL's gradient_accumulation_steps; ours: as many micro-batches of groups
TRL_TEMPERATURE = 0.7
# Rows of (reward_a, reward_b), weights 1.0 and 0.5; None: the function could not score the row.
# Some rows miss one function (TRL sums the other), one misses both (missing: advantage 0).
TRL_REWARDS = [(1.0, 0.5), (0.0, None), (None, None), (2.0, 1.0), (1.0, None), (None, 3.0),
               (0.5, 0.5), (1.5, 0.0), (0.5, None), (None, 1.0), (0.5, 0.0), (0.5, 0.0)]
TRL_WEIGHTS = [1.0, 0.5]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[str, object]:
    """A tiny transformers Llama saved as safetensors (TRL's policy and model.Llama both load it)
    and a word-level tokenizer built in memory, token i = "t{i}"."""
    pytest.importorskip("trl")  # transformers, tokenizers and datasets come with it
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = str(tmp_path_factory.mktemp("hf_llama"))
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2,  # peaked logits, non-uniform attention (as tiny_model)
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(V)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0",
                                                     eos_token="t1", unk_token="t0")
    return path, tokenizer


def trl_batch(G: int, seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """len(TRL_REWARDS) // G prompts of 5 tokens and ragged completions, ids >= 2 (not pad/eos).
    Equal prompt lengths: TRL left-pads prompts and passes no position_ids, so a shorter prompt
    sits at shifted positions; rope makes that exact in exact arithmetic, but its angles are
    float32, and ragged prompts alone put ~1.3e-6 between the two models' logprobs (2.7e-15
    with equal lengths). Ragged prompts are tested against our own slow twin above."""
    gen = torch.Generator().manual_seed(seed)
    N = len(TRL_REWARDS)
    prompts = [torch.randint(2, V, (5,), generator=gen).tolist() for _ in range(N // G)]
    lens = [3, 6, 1, 5, 4, 4, 2, 6, 3, 1, 5, 2]
    completions = [torch.randint(2, V, (n,), generator=gen).tolist() for n in lens]
    return prompts, completions


def trl_trainer(hf_checkpoint, tmp_path, prompts: list[list[int]], completions: list[list[int]],
                sampler_logp: list[list[float]] | None = None, vllm: bool = False,
                env_mask: list[list[int]] | None = None, **trl_config):
    """A real trl.GRPOTrainer on the CPU in float64. Its rollout_func hook returns our prompts and
    completions, the sampler's logprobs (or None) and the reward columns; the two reward
    functions return those columns. vllm: TRL takes the rollout for vLLM's (use_vllm, set after
    construction: vLLM is not installed), so its vllm_importance_sampling_* code runs. env_mask:
    multi-turn rows, TRL's mask of the tokens its loss trains (0 on a tool's or an environment's
    tokens)."""
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    path, tokenizer = hf_checkpoint
    N = len(completions)
    G = N // len(prompts)

    def rollout_func(prompt_texts: list[str], trainer) -> dict:
        out = {"prompt_ids": [prompts[i // G] for i in range(N)], "completion_ids": completions,
               "logprobs": sampler_logp, "reward_a": [r[0] for r in TRL_REWARDS],
               "reward_b": [r[1] for r in TRL_REWARDS]}
        if env_mask is not None:  # multi-turn: 1 on the policy's tokens, 0 on the environment's
            out["env_mask"] = env_mask
        return out

    def reward_a(completions, reward_a, **kwargs):
        return reward_a

    def reward_b(completions, reward_b, **kwargs):
        return reward_b

    policy = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float64)
    dataset = datasets.Dataset.from_dict({"prompt": ["t2"] * N})
    with warnings.catch_warnings():  # rollout_func is "experimental"; a renamed TrainingArguments
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
            gradient_checkpointing=False, num_generations=G,
            per_device_train_batch_size=N // TRL_MICRO_BATCHES,
            gradient_accumulation_steps=TRL_MICRO_BATCHES, reward_weights=TRL_WEIGHTS,
            temperature=TRL_TEMPERATURE, **trl_config)
        trainer = trl.GRPOTrainer(model=policy, reward_funcs=[reward_a, reward_b], args=args,
                                  train_dataset=dataset, processing_class=tokenizer,
                                  rollout_func=rollout_func)
    trainer.model.train()
    if vllm:
        trainer.use_vllm = True
        trainer._last_loaded_step = trainer.state.global_step  # no weight sync to a vLLM engine
    return trainer


def trl_scored(trainer, N: int) -> dict:
    """TRL's generation batch: its padding, reward sums and advantages (and old/ref logprobs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer._generate_and_score_completions([{"prompt": "t2"} for _ in range(N)])


def our_advantages(G: int, scale: str) -> torch.Tensor:
    nan = float("nan")
    rows = [[nan if r is None else r for r in row] for row in TRL_REWARDS]
    rewards = grpo.combine_rewards(torch.tensor(rows), TRL_WEIGHTS)
    return grpo.group_advantages(rewards, G, scale)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_with_missing_rewards(hf_checkpoint, tmp_path, scale):
    """TRL's own reward sums (nansum over functions, missing only when all are None) and advantages
    ((r - group mean) / (n-1 std + 1e-4), NaN rows 0) against combine_rewards + group_advantages
    with our defaults, G = 4 (one group has a missing row and a row scored by one function)."""
    G = 4
    prompts, completions = trl_batch(G)
    trainer = trl_trainer(hf_checkpoint, tmp_path, prompts, completions, scale_rewards=scale)
    want = trl_scored(trainer, len(completions))["advantages"]
    got = our_advantages(G, scale)
    # TRL computes in float32, we in float64 rounded to float32: a few ulps, relative; zeros exact
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got[2] == 0 and want[2] == 0  # the unscorable row


def trl_micro_batches(scored: dict, old: torch.Tensor | None, ref: torch.Tensor | None):
    """TRL's inputs to _compute_loss, one per micro-batch: equal slices of whole groups (TRL
    shuffles rows first; with equal sizes its normalisers do not depend on which rows)."""
    N = scored["completion_ids"].shape[0]
    size = N // TRL_MICRO_BATCHES
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    for start in range(0, N, size):
        rows = slice(start, start + size)
        inputs = {key: scored[key][rows] for key in keys}
        inputs["num_items_in_batch"] = scored["num_items_in_batch"]  # the generation batch's
        if old is not None:
            inputs["old_per_token_logps"] = old[rows]
        if ref is not None:
            inputs["ref_per_token_logps"] = ref[rows]
        for key in ("sampling_per_token_logps", "importance_sampling_ratio", "tool_mask"):
            if key in scored:
                inputs[key] = scored[key][rows]
        yield inputs


def check_against_trl(trainer, scored: dict, ours: M.Llama, batch: GRPOBatch, cfg: GRPOConfig):
    """TRL's _compute_loss run as its Trainer runs it (each micro-batch's loss, normalised per
    micro-batch and by gradient_accumulation_steps, then backward) against accumulate with global
    normalisers, equal for equal micro-batches: loss, metrics, every parameter's gradient."""
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    trainer.current_gradient_accumulation_steps = TRL_MICRO_BATCHES  # set by Trainer's loop
    trl_loss = 0.0
    tokens = []
    for inputs in trl_micro_batches(scored, batch.old_logp, batch.ref_logp):
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        trl_loss += loss.item()
        tokens.append(float((inputs["completion_mask"] * inputs.get("tool_mask", 1)).sum()))
    ours.zero_grad()
    got = grpo.accumulate(ours, batch, cfg)
    # The loss sums terms ~1 that nearly cancel (advantages sum to 0 per group): floor 1. TRL's
    # model runs in float32 (ours in float64): its rounding against the exact values, as
    # METRIC_REL and GRAD_REL bound it for this model's shape.
    assert_rel(got["loss"], trl_loss, METRIC_REL, floor=1.0, what="loss")
    logged = trainer._metrics["train"]  # one value per micro-batch: weigh by its tokens
    names = {"entropy": "entropy", "clip_low": "clip_ratio/low_mean",
             "clip_high": "clip_ratio/high_mean"}
    if cfg.loss_type == "cispo":
        names = {"entropy": "entropy", "clip_high": "cispo_clip_ratio"}
    if cfg.beta > 0:
        names["kl"] = "kl"
    for our_name, trl_name in names.items():
        # TRL's sequence-level clip shares are over rows; equal rows per micro-batch: a plain mean
        weights = tokens
        if cfg.importance_sampling_level == "sequence" and our_name.startswith("clip"):
            weights = [1.0] * len(tokens)
        want = sum(v * t for v, t in zip(logged[trl_name], weights)) / sum(weights)
        assert_rel(got[our_name], want, METRIC_REL, floor=1e-3, what=our_name)
    theirs = dict(trainer.model.named_parameters())
    assert set(theirs) == {name for name, _ in ours.named_parameters()}
    # Each parameter's gradient relative to its largest entry.
    assert_grads_close(grads(ours), {name: p.grad for name, p in theirs.items()}, rel=GRAD_REL)
    return got


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_metrics_and_grads_equal_trls_on_the_same_weights(hf_checkpoint, tmp_path, loss_type,
                                                               beta):
    """mu = 1 (no old_logp: TRL's own detached logp) and mu = 2 (old_logp given, off-policy, so the
    clip acts); beta > 0 with ref_logp given, off the reference, so the KL (with TRL's default bias
    correction) acts. Advantages from TRL's own scoring with missing rewards."""
    G = 2
    prompts, completions = trl_batch(G)
    N = len(completions)
    # num_iterations = 2 makes TRL compute old logprobs too; _compute_loss never reads it.
    trainer = trl_trainer(hf_checkpoint, tmp_path, prompts, completions, loss_type=loss_type,
                          beta=beta, num_iterations=2, epsilon=0.2, epsilon_high=0.28,
                          max_completion_length=8)
    scored = trl_scored(trainer, N)
    ours = hf.load_model(hf_checkpoint[0], dtype=torch.float64)
    cfg = GRPOConfig(loss_type=loss_type, beta=beta, eps_low=0.2, eps_high=0.28,
                     chunk_bytes=5 * V * 8,  # 5 rows of float64 logits
                     micro_batch_groups=N // G // TRL_MICRO_BATCHES)
    advantages = our_advantages(G, "group")
    torch.testing.assert_close(advantages, scored["advantages"], rtol=1e-6, atol=0)

    def batch(**tensors) -> GRPOBatch:  # sampled at TRL's temperature, within its budget of 8
        return GRPOBatch.from_lists(prompts, completions, temperature=TRL_TEMPERATURE,
                                    max_new_tokens=8, advantages=advantages, **tensors)
    current = grpo.batch_logprobs(ours, batch(), cfg)  # (N, Tr)
    mask = scored["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):  # TRL's own, when it made them
        if key in scored:  # TRL's are float32, at its temperature
            torch.testing.assert_close(scored[key] * mask, current.to(scored[key].dtype),
                                       **logp_tol(TRL_TEMPERATURE))
    gen = torch.Generator().manual_seed(7)
    ref = None
    if beta > 0:
        ref = current + 0.5 * torch.randn(current.shape, generator=gen, dtype=current.dtype) * mask
    check_against_trl(trainer, scored, ours, batch(ref_logp=ref), cfg)
    old = current + 0.3 * torch.randn(current.shape, generator=gen, dtype=current.dtype) * mask
    got = check_against_trl(trainer, scored, ours, batch(old_logp=old, ref_logp=ref), cfg)
    assert got["clip_low"] + got["clip_high"] > 0  # the clip acts


def test_defaults_are_trls_except_the_documented_differences():
    """Our GRPOConfig and RolloutConfig defaults against TRL's GRPOConfig field defaults; the
    differences are on purpose and listed in docs/trl.md's table."""
    trl = pytest.importorskip("trl")
    theirs = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    ours = GRPOConfig()
    same = {"loss_type": "loss_type", "scale": "scale_rewards", "eps_low": "epsilon",
            "beta": "beta", "mu": "num_iterations",
            "use_bias_correction_kl": "use_bias_correction_kl"}
    for our_name, trl_name in same.items():
        assert getattr(ours, our_name) == theirs[trl_name], (our_name, trl_name)
    # The GRPO family: TRL's None (off, or no bound) is inf or 0 here, the same loss.
    family = {"importance_sampling_level": "importance_sampling_level",
              "mask_truncated_completions": "mask_truncated_completions",
              "top_entropy_quantile": "top_entropy_quantile",
              "sampler_correction": "vllm_importance_sampling_correction",
              "sampler_correction_mode": "vllm_importance_sampling_mode",
              "sampler_correction_max": "vllm_importance_sampling_clip_max"}
    for our_name, trl_name in family.items():
        assert getattr(ours, our_name) == theirs[trl_name], (our_name, trl_name)
    for our_name, off in (("delta", math.inf), ("off_policy_mask_threshold", math.inf),
                          ("sampler_correction_min", 0.0)):
        trl_name = {"sampler_correction_min": "vllm_importance_sampling_clip_min"}.get(our_name,
                                                                                 our_name)
        assert (getattr(ours, our_name), theirs[trl_name]) == (off, None), our_name
    assert ours.dynamic_sampling == 0  # not in TRL: off
    assert RolloutConfig().temperature == theirs["temperature"]
    # Clip-higher (DAPO) 0.28; TRL's epsilon_high None means epsilon, 0.2.
    assert (ours.eps_high, theirs["epsilon_high"]) == (0.28, None)
    # The group: 16 samples per prompt for the tiny default task (more signal per prompt); TRL 8.
    assert (RolloutConfig().num_samples, theirs["num_generations"]) == (16, 8)
    # The completion budget (also Dr. GRPO's constant): the task's own (0); TRL 512.
    assert (RolloutConfig().max_new_tokens, theirs["max_completion_length"]) == (0, 512)


# Each knob of the GRPO family on TRL's own code: (ours, TRL's config, the sampler's logprobs given,
# TRL's vLLM importance-sampling path on). The sampler's logprobs are the policy's plus noise (a
# bf16 sampler, say); the correction's bounds are tight so that its truncation or mask acts.
BOUNDS = dict(sampler_correction_min=0.9, sampler_correction_max=1.1)
TRL_BOUNDS = dict(vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1)
VARIANTS = {
    "gspo": (dict(importance_sampling_level="sequence", loss_type="grpo"),
             dict(importance_sampling_level="sequence", loss_type="grpo"), False, False),
    "gspo_dapo": (dict(importance_sampling_level="sequence"),
                  dict(importance_sampling_level="sequence"), False, False),
    "cispo": (dict(loss_type="cispo", eps_high=5.0), dict(loss_type="cispo", epsilon_high=5.0),
              False, False),
    "cispo_cap_acts": (dict(loss_type="cispo", eps_high=1.1),
                       dict(loss_type="cispo", epsilon_high=1.1), False, False),
    "delta": (dict(delta=1.1), dict(delta=1.1), False, False),
    "top_entropy": (dict(top_entropy_quantile=0.3), dict(top_entropy_quantile=0.3), False, False),
    "mask_truncated": (dict(mask_truncated_completions=True),
                       dict(mask_truncated_completions=True), False, False),
    "off_policy": (dict(off_policy_mask_threshold=0.05, sampler_correction=False),
                   dict(off_policy_mask_threshold=0.05), True, False),
    **{mode: (dict(sampler_correction_mode=mode, **BOUNDS),
              dict(vllm_importance_sampling_mode=mode, **TRL_BOUNDS), True, True)
       for mode in grpo.CORRECTION_MODES},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_knob_equals_trls_loss_metrics_and_grads(hf_checkpoint, tmp_path, variant):
    """Each knob against TRL's _compute_loss (and, for the correction, the weights its
    _generate_and_score_completions makes), beta 0.1 with the bias-corrected KL, at mu = 1 and,
    where TRL's weights do not depend on it, mu = 2 (old_logp given, off the policy, so clips and
    masks act). Rows 0, 3, 6, 9 end with the eos id (stopped); the others are truncated."""
    ours_cfg, trl_cfg, with_sampler, vllm = VARIANTS[variant]
    G = 2
    prompts, completions = trl_batch(G)
    N = len(completions)
    completions = [c[:-1] + [1] if i % 3 == 0 else c for i, c in enumerate(completions)]
    stopped = torch.tensor([i % 3 == 0 for i in range(N)])
    ours = hf.load_model(hf_checkpoint[0], dtype=torch.float64)
    cfg = GRPOConfig(beta=0.1, chunk_bytes=5 * ours.config.vocab_size * 8,  # 5 float64 rows
                     micro_batch_groups=N // G // TRL_MICRO_BATCHES, **ours_cfg)
    advantages = our_advantages(G, "group")

    def batch(**tensors) -> GRPOBatch:
        return GRPOBatch.from_lists(prompts, completions, temperature=TRL_TEMPERATURE,
                                    max_new_tokens=8, advantages=advantages, stopped=stopped,
                                    **tensors)
    current = grpo.batch_logprobs(ours, batch(), cfg)  # (N, Tr)
    mask = batch().mask
    gen = torch.Generator().manual_seed(11)
    sampler = lists = None
    if with_sampler:  # float32, as TRL tensors the rollout's lists
        noise = 0.3 * torch.randn(current.shape, generator=gen, dtype=current.dtype)
        # off-policy masking: a sampler 0.1 nat above the policy on average, so that rows go
        offset = 0.1 if "off_policy_mask_threshold" in ours_cfg else 0.0
        sampler = ((current + noise + offset) * mask).float()
        lists = [row[:int(n)] for row, n in zip(sampler.tolist(), mask.sum(1))]
        sampler = sampler.double()
    trl_cfg = dict(beta=0.1, num_iterations=2, epsilon=0.2, epsilon_high=0.28,
                   max_completion_length=8) | trl_cfg
    trainer = trl_trainer(hf_checkpoint, tmp_path, prompts, completions, sampler_logp=lists,
                          vllm=vllm, **trl_cfg)
    scored = trl_scored(trainer, N)
    if ours_cfg.get("mask_truncated_completions"):  # TRL's rule: the last id is not eos or pad
        assert torch.equal(scored["completion_mask"].bool(), mask & stopped[:, None])
    ref = current + 0.5 * torch.randn(current.shape, generator=gen, dtype=current.dtype) * mask
    logged = trainer._metrics["train"]  # what TRL logged at generation time
    if vllm:  # TRL's weights come from its own old logprobs: ours read the same ones
        old = scored["old_per_token_logps"] * mask
        weights, stats = grpo.sampler_weights(old, sampler, mask, cfg)
        # TRL's weights are float32 (its logprobs are): ours from the same values, in float64
        want = scored["importance_sampling_ratio"]
        torch.testing.assert_close(weights.expand_as(want).to(want.dtype), want, rtol=1e-6,
                                   atol=0)
        # TRL logs the weights' stats (after the clamp or mask)
        units = mask if cfg.sampler_correction_mode.startswith("token") else torch.ones_like(
            weights, dtype=torch.bool)
        for name, value in grpo.ratio_stats("w", weights, units).items():
            want = logged[f"sampling/importance_sampling_ratio/{name[2:]}"][-1]
            assert_rel(value.item(), want, METRIC_REL, what=name)
        assert 0 < stats["sampler_corrected"] < 1  # the bounds act, not on everything
        logp_diff = logged["sampling/sampling_logp_difference/mean"][-1]
    else:  # mu = 1 (old_logp None: TRL's own detached logp), then mu = 2 below
        check_against_trl(trainer, scored, ours, batch(ref_logp=ref, sampler_logp=sampler), cfg)
        # mu = 2: old_logp off the policy, pushed out of the clip range (the sign of A),
        # against it for delta (whose cap acts where A < 0 and the ratio is high)
        push = (-1.0 if "delta" in ours_cfg else 1.0) * advantages.sign()[:, None]
        old = current - (0.5 * push + 0.3 * torch.randn(current.shape, generator=gen,
                                                        dtype=current.dtype)) * mask
    final = batch(old_logp=old, ref_logp=ref, sampler_logp=sampler)
    got = check_against_trl(trainer, scored, ours, final, cfg)
    if vllm:
        assert_rel(got["sampler_logp_diff"], logp_diff, METRIC_REL, what="sampler_logp_diff")
    elif variant not in ("cispo", "delta"):  # cispo's cap at 5 holds nothing; delta: pushed up
        assert got["clip_low"] + got["clip_high"] > 0  # the clip (or cispo's cap) acts
    if "off_policy_mask_threshold" in ours_cfg:
        assert 0 < got["off_policy_masked"] < 1  # some rows dropped, not all
    # Each knob acts: the loss differs from the one with the knob at its default.
    defaults = {k: getattr(GRPOConfig(), k) for k in ours_cfg}
    plain = dataclasses.replace(cfg, **(defaults | dict(sampler_correction=False)))
    ours.zero_grad()
    assert abs(grpo.accumulate(ours, final, plain)["loss"] - got["loss"]) > 1e-4
