"""tp.py on CPU with gloo, 2 and 4 processes, against one process on the full model, fp32.

Every spawned rank rebuilds the same full model from one seed, so the one-process oracle runs inside
each rank next to the sharded model. Spawning costs seconds, so each worker groups many checks; a
failed assert in any rank fails the test with that rank's traceback.
"""

import copy
import dataclasses
import functools
import json
import multiprocessing
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

import tolerance
from hf_reference import save_random_hf_model, store_tied_copy

import tp
import grpo
from engine import logprobs
from engine import hf
import memory
import model as M
import rollout
from engine.episodes import Episodes

V = 128


def tiny(**kw) -> M.ModelConfig:
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return M.ModelConfig(**{**base, **kw})


# fp32 everywhere: TP only regroups sums (partial sums over shards, all-reduced), the twins sum in
# their own order. One bound from the longest chain of sums here, a gradient's (the forward, the
# backward, a batch's tokens: tests/tolerance.py), relative and at each tensor's magnitude.
REL = tolerance.reordered_rel(tolerance.grad_depth(tiny(), 256, 256))


def assert_close(got: torch.Tensor, want: torch.Tensor, msg: str | None = None) -> None:
    torch.testing.assert_close(got, want, rtol=REL, atol=REL * want.abs().max().item(), msg=msg)


# GQA, untied; Qwen2-style q/k/v bias with tied embeddings; Llama's q/k/v/o and MLP biases; Qwen3's
# per-head q/k norms (replicated while the heads are sharded), 8/4 heads of 16 (H*D != C; rep 2 !=
# Hkv 4), tied: its heads split over 2 ranks and over 4
CONFIGS = {
    "llama": tiny(),
    "qwen_tied": tiny(architecture="Qwen2ForCausalLM", attention_bias=True, tie_word_embeddings=True),
    "llama_bias": tiny(attention_bias=True, mlp_bias=True),
    "qwen3": tiny(architecture="Qwen3ForCausalLM", num_attention_heads=8, num_key_value_heads=4,
                  head_dim=16, tie_word_embeddings=True),
}
# Megatron's layout, written out independently of tp.py's own table: the dim each parameter is split on.
# A row-parallel (dim 1) linear's bias is not split: it is added once, after the sum over ranks.
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "embed_tokens": 0,
             "lm_head": 0, "o_proj": 1, "down_proj": 1}


def full_model(cfg: M.ModelConfig) -> M.Llama:
    # std 0.2 (not HF's 0.02): peaked logits and attention, so a misrouted shard shows. Biases (zero
    # after init_weights) get it too: a row-parallel bias added on every rank instead of once shows;
    # and Qwen3's q/k norm weights, around their 1.
    m = M.Llama(cfg).init_weights(0, std=0.2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.2)
    return m


def spawn(worker, nprocs: int, tmp_path) -> None:
    # forkserver with torch and this module preloaded: the workers fork from one process that imported
    # them once, instead of 4 fresh interpreters importing torch at once on 2 cores (~15 s here). The
    # server runs no torch ops, so forking it is safe for the thread pools.
    multiprocessing.set_forkserver_preload(["torch", __name__])
    mp.start_processes(_entry, args=(worker, nprocs, str(tmp_path)), nprocs=nprocs, start_method="forkserver")


def _entry(rank: int, worker, world: int, tmp: str) -> None:
    torch.set_num_threads(1)  # 2-4 processes share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        worker(rank, tmp)
    except BaseException:
        tp.destroy_groups(barrier=False)  # the other ranks may never reach a barrier
        raise
    tp.destroy_groups()


def unshard(name: str, t: torch.Tensor, ranks: tp.ParallelGroups) -> torch.Tensor:
    """The full tensor from the tp ranks' slices (replicated tensors as they are)."""
    dim = next((d for key, d in SPLIT_DIM.items() if f"{key}." in name), None)
    if dim is None or (dim == 1 and name.endswith(".bias")):
        return t
    parts = [torch.empty_like(t) for _ in range(ranks.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=ranks.tp_group)
    return torch.cat(parts, dim)


def assert_same_on_all_ranks(t: torch.Tensor) -> None:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    assert all(torch.equal(p, parts[0]) for p in parts), "ranks disagree"


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor):
    logp_all = logits.float().log_softmax(-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def grpo_batch(cfg: M.ModelConfig, G: int = 2):
    """3 prompts of lengths 5, 4, 7 and ragged completions. With one group per micro-batch each packed
    forward holds an odd number of tokens (9, 9, 13): under SP on 2 ranks TPLlama pads each to an even
    length (sequence parallelism used to stay off, silently, when tp did not divide it)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (5, 4, 7)]
    completions = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (4, 2, 6, 1, 3, 5)[:3 * G]]
    advantages = torch.randn(3 * G, generator=gen)
    return prompts, completions, advantages


def grpo_step(model, prompts, completions, advantages, logprob_fn=None, *, old_logp=None, ref_logp=None,
              num_seqs=None, num_tokens=None):
    beta = 0.0 if ref_logp is None else 0.05
    # chunks of 5 tokens: several, recomputed; one group per micro-batch (see grpo_batch)
    cfg = grpo.GRPOConfig(chunk_bytes=5 * V * 4, beta=beta, micro_batch_groups=1)  # float32 rows
    batch = grpo.GRPOBatch.from_lists(prompts, completions, advantages=advantages,
                                      old_logp=old_logp, ref_logp=ref_logp)
    return grpo.accumulate(model, batch, cfg, logprob_fn=logprob_fn, num_seqs=num_seqs,
                           num_tokens=num_tokens)

# -----------------------------------------------------------------------------
# 2 processes: TP = 2


def check_vocab_parallel_logprobs(ranks: tp.ParallelGroups) -> None:
    rank, n = ranks.tp_rank, 9
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(n, V, generator=gen) * 3
    targets = torch.randint(0, V, (n,), generator=gen)
    targets[:4] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])  # both edges of both shards
    cols = slice(rank * V // 2, (rank + 1) * V // 2)
    shard = logits[:, cols].clone().requires_grad_()
    before = shard.detach().clone()
    full = logits.clone().requires_grad_()
    logp, entropy = tp.vocab_parallel_logprobs(shard, targets, ranks)
    want_logp, want_entropy = plain_logprobs(full, targets)
    assert_close(logp, want_logp)
    assert_close(entropy, want_entropy)
    assert_same_on_all_ranks(torch.stack([logp, entropy]).detach())  # bitwise: ranks must sample/score alike
    w1, w2 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    (w1 * logp + w2 * entropy).sum().backward()
    (w1 * want_logp + w2 * want_entropy).sum().backward()
    assert_close(shard.grad, full.grad[:, cols])
    assert torch.equal(shard.detach(), before), "the input logits were modified"
    # Recomputed under checkpoint, as grpo.py runs it: the same values and gradients.
    again = before.clone().requires_grad_()
    fn = functools.partial(tp.vocab_parallel_logprobs, ranks=ranks)
    logp2, entropy2 = checkpoint(fn, again, targets, use_reentrant=False)
    (w1 * logp2 + w2 * entropy2).sum().backward()
    assert torch.equal(logp2, logp) and torch.equal(entropy2, entropy)
    torch.testing.assert_close(again.grad, shard.grad, atol=0, rtol=0)


def check_entropy_gradient(ranks: tp.ParallelGroups) -> None:
    """grpo.py's contract for its three logprob routes: the entropy is differentiable. The
    vocab-parallel route against autograd of the float64 definitions, then inside
    logprobs.chunked_logprobs on a sharded head (checkpointed chunks) against TP = 1's chunked
    Function, with an entropy term in the loss: every parameter's gradient."""
    rank, n = ranks.tp_rank, 9
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(n, V, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (n,), generator=gen)
    w1 = torch.randn(n, generator=gen, dtype=torch.float64)
    w2 = torch.randn(n, generator=gen, dtype=torch.float64)
    cols = slice(rank * V // 2, (rank + 1) * V // 2)
    shard = logits[:, cols].clone().requires_grad_()
    logp, entropy = tp.vocab_parallel_logprobs(shard, targets, ranks)
    (w1 * logp + w2 * entropy).sum().backward()
    full = logits.clone().requires_grad_()
    p = full.softmax(-1)  # (n, V)
    want_logp = p.gather(-1, targets[:, None]).squeeze(-1).log()
    want_entropy = -(p * p.log()).sum(-1)
    (w1 * want_logp + w2 * want_entropy).sum().backward()
    # The route computes in float32 (logits.float()): a softmax's sums over V, at the logits' size
    tol = tolerance.reordered(V, logits.abs().max())
    torch.testing.assert_close(entropy.double(), want_entropy, **tol)
    torch.testing.assert_close(shard.grad, full.grad[:, cols], **tol)
    # The whole head, sharded: checkpointed chunks of 4 rows of vocab-parallel logprobs.
    one = full_model(CONFIGS["llama"])
    m = tp.shard_model(copy.deepcopy(one), ranks)
    h = torch.randn(n, one.config.hidden_size, generator=gen)
    logprob_fn = functools.partial(tp.vocab_parallel_logprobs, ranks=ranks)
    grad_h = []
    for model, fn in ((m, logprob_fn), (one, None)):
        x = h.clone().requires_grad_()
        logp, entropy = logprobs.chunked_logprobs(model, x, targets, temperature=0.7, chunk_size=4,
                                              logprob_fn=fn)
        (w1.float() * logp + w2.float() * entropy).sum().backward()
        grad_h.append(x.grad)
    assert_close(grad_h[0], grad_h[1])
    for (name, p), (_, q) in zip(m.named_parameters(), one.named_parameters()):
        if q.grad is not None:  # the head's: final norm and lm_head
            assert_close(unshard(name, p.grad, ranks), q.grad, msg=name)


class Bug203(torch.autograd.Function):
    """nanotron #203's first version: the gathered input lives in the shared buffer AND is kept for
    backward (as F.linear keeps its input), so a later gather overwrites it before backward reads it.
    `stash` keeps it as a ctx attribute, which autograd's version check does not see."""
    @staticmethod
    def forward(ctx, x, weight, group, buffer, stash):
        full = buffer.get("gather", (x.shape[0] * 2, x.shape[1]), x.dtype, x.device)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(full, x.contiguous(), group=group)
        if stash:
            ctx.full = full
        else:
            ctx.save_for_backward(full)
        ctx.weight, ctx.group = weight.detach(), group
        return full @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        full = ctx.full if hasattr(ctx, "full") else ctx.saved_tensors[0]
        grad_x = grad.new_empty(full.shape[0] // 2, full.shape[1])
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # renamed in torch 2.13
        reduce_scatter(grad_x, (grad @ ctx.weight).contiguous(), group=ctx.group)
        return grad_x, grad.t() @ full, None, None, None


def check_two_fused_gather_linears(ranks: tp.ParallelGroups) -> None:
    """x -> gather+linear(W1) -> silu -> row-parallel W2 -> reduce-scatter -> tanh -> gather+linear(W3):
    both gathers share one buffer, and the second overwrites the first before backward (the #203 bug)."""
    rank, group, N, C, O = ranks.tp_rank, ranks.tp_group, 8, 6, 10
    gen = torch.Generator().manual_seed(4)
    x, W1, b1, W2, W3, R = (torch.randn(*s, generator=gen) for s in [(N, C), (O, C), (O,), (C, O), (O, C), (N, O)])
    xf, W1f, b1f, W2f, W3f = (t.clone().requires_grad_() for t in (x, W1, b1, W2, W3))
    ((torch.tanh(F.silu(xf @ W1f.t() + b1f) @ W2f.t()) @ W3f.t()) * R).sum().backward()
    rows, cols = slice(rank * N // 2, (rank + 1) * N // 2), slice(rank * O // 2, (rank + 1) * O // 2)

    def run(gather_linear):
        shards = (x[rows], W1[cols], b1[cols], W2[:, cols], W3[cols])
        xs, W1s, b1s, W2s, W3s = (t.clone().requires_grad_() for t in shards)
        buffer = tp.MemoryBuffer()
        a = gather_linear(xs, W1s, b1s, group, buffer)  # (N, O/2)
        c = tp.ReduceScatterToSP.apply(F.silu(a) @ W2s.t(), group)  # (N/2, C)
        d = gather_linear(torch.tanh(c), W3s, None, group, buffer)  # (N, O/2)
        (d * R[:, cols]).sum().backward()  # this rank's columns; the collectives sum the rest
        return buffer, [xs.grad, W1s.grad, b1s.grad, W2s.grad, W3s.grad]

    buffer, got = run(lambda x, w, b, g, buf: tp.GatherLinears.apply(x, g, buf, w, b)[0])
    want = [xf.grad[rows], W1f.grad[cols], b1f.grad[cols], W2f.grad[:, cols], W3f.grad[cols]]
    for g, w in zip(got, want):
        assert_close(g, w)
    assert set(buffer.tensors) == {("gather", torch.float32), ("reduce", torch.float32)}  # one per (name, dtype)
    # The controls, so the check above can fail. #203's bug in this chain gives a silently wrong W1 gradient
    # when the buffer view is kept where autograd's version check does not look; saved for backward, it is
    # caught by that check where collectives bump the version counter (torch 2.13 here), else wrong too.
    def buggy(stash):
        return lambda x, w, b, g, buf: Bug203.apply(x, w, g, buf, stash) + (0 if b is None else b)
    assert (run(buggy(stash=True))[1][1] - want[1]).abs().max() > 1e-2, "the #203 bug went unnoticed"
    try:
        assert (run(buggy(stash=False))[1][1] - want[1]).abs().max() > 1e-2, "the #203 bug went unnoticed"
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)


def check_tp_equals_one_process(cfg: M.ModelConfig, ranks: tp.ParallelGroups) -> None:
    full = full_model(cfg)
    prompts, completions, advantages = grpo_batch(cfg)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (3, 6), generator=gen)  # B*T = 18: SP runs on 2 ranks
    ref = copy.deepcopy(full)
    with torch.no_grad():
        want_logits = ref(tokens)
        batch = grpo.GRPOBatch.from_lists(prompts, completions)
        old_logp = grpo.batch_logprobs(ref, batch, grpo.GRPOConfig(micro_batch_groups=1))
        old_logp = old_logp + 0.1 * torch.randn(old_logp.shape, generator=gen)  # ratio != 1: clipping acts
        ref_logp = old_logp + 0.1 * torch.randn(old_logp.shape, generator=gen)
    want = grpo_step(ref, prompts, completions, advantages, old_logp=old_logp, ref_logp=ref_logp)
    logprob_fn = functools.partial(tp.vocab_parallel_logprobs, ranks=ranks)
    for sp, recompute in ((False, False), (True, False), (True, True)):
        m = tp.shard_model(copy.deepcopy(full), ranks, sequence_parallel=sp)
        if recompute:  # blocks rerun in backward (train.py's activation_checkpoint): SP must take the same path
            assert memory.checkpoint_blocks(m.model.layers) == cfg.num_hidden_layers
        assert [n for n, _ in m.named_parameters()] == [n for n, _ in full.named_parameters()]
        got = grpo_step(m, prompts, completions, advantages, logprob_fn, old_logp=old_logp, ref_logp=ref_logp)
        assert bool(m.tp_state.buffer.tensors) == sp, "SP did (not) run on the odd packed rows"
        with torch.no_grad():
            logits = m(tokens)
        assert logits.shape == (3, 6, V // ranks.tp_size)
        assert_close(tp.gather_vocab(logits, ranks), want_logits)
        assert bool(m.tp_state.buffer.tensors) == sp, "SP did (not) run"  # only SP's gathers use the buffer
        for key in ("loss", "kl", "clip_low", "clip_high", "entropy"):
            assert abs(got[key] - want[key]) <= REL * max(1.0, abs(want[key])), (key, got[key], want[key])
        for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            assert_close(unshard(name, p.grad, ranks), q.grad, msg=f"{sp=} {recompute=} {name}")
    # The switch: plain TP by default, SP inside the scope only; a deep copy (a reference model) works too.
    m = tp.shard_model(copy.deepcopy(full), ranks)
    with tp.sequence_parallel(m), torch.no_grad():
        logits = m(tokens)
    assert m.tp_state.buffer.tensors and not m.tp_state.sequence_parallel
    assert_close(tp.gather_vocab(logits, ranks), want_logits)
    twin = copy.deepcopy(m)
    with torch.no_grad():
        assert_close(tp.gather_vocab(twin(tokens), ranks), want_logits)


# Tensors that do not fit config.json, and load_sharded's refusal (hf.check_checkpoint's, as in
# one process): a wider MLP, biases the config does not declare (never dropped), missing biases.
WRONG = {
    "llama": [(dict(intermediate_size=128), r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                            r"\(128, 64\), config.json implies \(96, 64\)"),
              (dict(attention_bias=True),
               r"tensor 'model.layers.0.self_attn.k_proj.bias' is not used \(8 such tensors\)")],
    "qwen_tied": [(dict(attention_bias=False, architecture="LlamaForCausalLM"),
                   "checkpoint is missing 6 tensors, e.g. 'model.layers.0.self_attn.k_proj.bias'")],
    "llama_bias": [(dict(mlp_bias=False),
                    "checkpoint is missing 6 tensors, e.g. 'model.layers.0.mlp.down_proj.bias'")],
    "qwen3": [(dict(architecture="LlamaForCausalLM"),
               "checkpoint is missing 4 tensors, e.g. 'model.layers.0.self_attn.k_norm.weight'")],
}


def check_load_and_full_state_dict(name: str, cfg: M.ModelConfig, ranks: tp.ParallelGroups, tmp: str) -> None:
    full, path = full_model(cfg), f"{tmp}/{name}"
    if dist.get_rank() == 0:
        hf.save_model(full, path, max_shard_bytes=40_000)  # several files + index.json
        for i, (wrong, _) in enumerate(WRONG[name]):
            hf.save_model(M.Llama(dataclasses.replace(cfg, **wrong)), f"{path}_wrong{i}")
            shutil.copy(f"{path}/config.json", f"{path}_wrong{i}/config.json")
        if cfg.tie_word_embeddings:  # the Hub's layout: the embedding stored again as lm_head
            for copy, rows in (("copy", None), ("other", slice(V - 1, V))):
                shutil.copytree(path, f"{path}_{copy}")
                store_tied_copy(f"{path}_{copy}", rows)
    dist.barrier()
    for i, (_, error) in enumerate(WRONG[name]):
        with pytest.raises(ValueError, match=error):
            tp.load_sharded(f"{path}_wrong{i}", ranks, "cpu", torch.float32)
    loaded = tp.load_sharded(path, ranks, "cpu", torch.float32)
    sliced = tp.shard_model(hf.load_model(path), ranks)
    assert loaded.state_dict().keys() == sliced.state_dict().keys()
    for (n, a), b in zip(loaded.state_dict().items(), sliced.state_dict().values()):
        assert torch.equal(a, b), n
    if cfg.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        # with its stored copy, the same model; a copy that differs in the last rank's rows alone
        # is refused by every rank (each compares its own rows: the flag is all-reduced)
        with_copy = tp.load_sharded(f"{path}_copy", ranks, "cpu", torch.float32)
        for (n, a), b in zip(with_copy.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(a, b), n
        with pytest.raises(ValueError, match="tensor 'lm_head.weight' differs from 'model.embed"):
            tp.load_sharded(f"{path}_other", ranks, "cpu", torch.float32)
    # The same tensors, under the same names, as a TP=1 model's (a tied lm_head once, as the
    # embedding: a TP checkpoint of a tied model once held an extra lm_head.weight).
    gathered = tp.full_state_dict(loaded, ranks)
    want = dict(full.named_parameters())
    assert list(gathered) == list(want)
    for n, t in gathered.items():
        assert torch.equal(t, want[n]), n


def check_sampling(ranks: tp.ParallelGroups, cfg: M.ModelConfig = CONFIGS["llama"]) -> None:
    """rollout.generate on the sharded model, plain TP and SP (prefill of 2 x 5 and decode of 6 x 1 tokens
    run SP; the sampler's KV-cache attention sees the same q/k/v either way).
    Regression (torch 2.5.1): gloo wrote the gathers' outputs, made under the sampler's inference_mode, on
    its own thread and raised "Inplace update to inference tensor outside InferenceMode"."""
    full = full_model(cfg)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    gather = functools.partial(tp.gather_vocab, ranks=ranks)
    greedy_cfg = rollout.RolloutConfig(num_samples=3, max_new_tokens=6, temperature=0.0)
    sample_cfg = rollout.RolloutConfig(num_samples=3, max_new_tokens=6)
    want = rollout.generate(full, prompts, greedy_cfg).tokens
    episodes = Episodes(lambda calls: [[(r + len(t)) % 7 + 1, 3] for r, t in calls],
                        tuple(range(0, V, 3)), 2)
    want_episodes = rollout.generate(full, prompts, greedy_cfg, episodes=episodes)
    for sp in (False, True):
        m = tp.shard_model(copy.deepcopy(full), ranks, sequence_parallel=sp)
        sampled = rollout.generate(m, prompts, sample_cfg, seed=0, logits_fn=gather)
        assert_same_on_all_ranks(sampled.tokens)
        greedy = rollout.generate(m, prompts, greedy_cfg, logits_fn=gather)
        assert torch.equal(greedy.tokens, want)
        # episodes (engine/episodes.py): a tool's answers extend the sharded rows in place
        with_tool = rollout.generate(m, prompts, greedy_cfg, logits_fn=gather, episodes=episodes)
        assert torch.equal(with_tool.tokens, want_episodes.tokens) and sum(with_tool.stats["calls"])
        assert torch.equal(with_tool.sampled, want_episodes.sampled)
        m(torch.tensor([[1, 2, 3, 4]])).sum().backward()  # training after inference_mode reuses the buffer


def _tp2_worker(rank: int, tmp: str) -> None:
    ranks = tp.make_groups(2)
    assert (ranks.tp_rank, ranks.tp_size, ranks.dp_rank, ranks.dp_size, ranks.dp_group) == (rank, 2, 0, 1, None)
    check_vocab_parallel_logprobs(ranks)
    check_entropy_gradient(ranks)
    check_two_fused_gather_linears(ranks)
    for name, cfg in CONFIGS.items():
        check_tp_equals_one_process(cfg, ranks)
        check_load_and_full_state_dict(name, cfg, ranks, tmp)
    check_sampling(ranks)


def test_tp2_equals_one_process_logits_grpo_loss_grads_logprobs_loading_sampling(tmp_path):
    spawn(_tp2_worker, 2, tmp_path)


def _tp4_worker(rank: int, tmp: str) -> None:
    ranks = tp.make_groups(4)
    cfg = CONFIGS["qwen3"]  # 2 query heads, 1 kv head a rank: a q/k norm's grad from 1/4 of them
    check_tp_equals_one_process(cfg, ranks)
    check_load_and_full_state_dict("qwen3", cfg, ranks, tmp)
    check_sampling(ranks, cfg)


def test_tp4_equals_one_process_on_qwen3(tmp_path):
    """TP = 4 (plain, SP, SP recomputed in backward) against one process on Qwen3's layout: logits,
    GRPO loss and every gradient (the replicated q/k norms' summed over the ranks' heads), sharded
    loading, greedy sampling and episodes."""
    spawn(_tp4_worker, 4, tmp_path)


# transformers config class and arguments, for checkpoints written by transformers' own writer: the
# fields TP slices or adds differently (q/k/v/o and MLP biases, D != C/H, a tied vocab-split head).
HF_CASES = {
    "llama_bias": ("LlamaConfig", dict(
        attention_bias=True, mlp_bias=True, head_dim=32,
        rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16,
                             rope_theta=500000.0))),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3_tied": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=24,
                                       rope_theta=1000000.0)),
}


def write_hf_checkpoint(path, config_class: str, kw: dict, x: torch.Tensor) -> None:
    """A transformers model with random weights, saved by its own writer, and its logits on x."""
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    theirs = save_random_hf_model(path, config_class, {**base, **kw})
    with torch.no_grad():
        save_file({"x": x, "logits": theirs(x).logits}, str(path / "expected.safetensors"))


def _hf_worker(rank: int, tmp: str) -> None:
    ranks = tp.make_groups(2)
    for name in HF_CASES:
        expected = load_file(f"{tmp}/{name}/expected.safetensors")
        for sp in (False, True):
            m = tp.load_sharded(f"{tmp}/{name}", ranks, "cpu", torch.float32, sequence_parallel=sp)
            with torch.no_grad():
                logits = tp.gather_vocab(m(expected["x"]), ranks)
            # fp32, as tests/test_model.py's one-process parity: summation order only.
            want = expected["logits"]
            depth = tolerance.model_depth(m.config, want.shape[1], "logits")
            torch.testing.assert_close(logits, want, msg=f"{name} {sp=}",
                                       **tolerance.reordered(depth, want.abs().max()))
    unused = r"tensor 'model.layers.0.self_attn.k_proj.bias' is not used"
    with pytest.raises(ValueError, match=unused):
        tp.load_sharded(f"{tmp}/unused", ranks, "cpu", torch.float32)


def test_tp2_loads_checkpoints_written_by_transformers_to_its_logits(tmp_path):
    """load_sharded on 2 processes, plain TP and SP, against transformers' own logits (computed
    here, so the workers need not import transformers); and it refuses an unused tensor too."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, 40), generator=gen)  # B*T even: SP runs
    for name, (config_class, kw) in HF_CASES.items():
        write_hf_checkpoint(tmp_path / name, config_class, kw, x)
    shutil.copytree(tmp_path / "llama_bias", tmp_path / "unused")  # its 8 attention biases: unused
    config = json.loads((tmp_path / "unused" / "config.json").read_text())
    (tmp_path / "unused" / "config.json").write_text(json.dumps(dict(config, attention_bias=False)))
    spawn(_hf_worker, 2, tmp_path)

# -----------------------------------------------------------------------------
# 4 processes: TP = 2 x DP = 2


def _dp_tp_worker(rank: int, tmp: str) -> None:
    ranks = tp.make_groups(2)
    assert (ranks.tp_rank, ranks.dp_rank, ranks.dp_size) == (rank % 2, rank // 2, 2)  # tp ranks contiguous
    with pytest.raises(ValueError, match="tp_size=3 must be >= 1 and divide the world size 4"):
        tp.make_groups(3)
    full = full_model(CONFIGS["llama"])
    prompts, completions, advantages = grpo_batch(CONFIGS["llama"])
    num_tokens, lr, max_norm = sum(map(len, completions)), 0.1, 0.5
    ref = copy.deepcopy(full)
    grpo_step(ref, prompts, completions, advantages)  # one process, the whole batch
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    assert want_norm > 2 * max_norm, "the clip must act for the check to mean something"
    torch.optim.SGD(ref.parameters(), lr=lr).step()  # SGD: the update is linear in the gradient
    logprob_fn = functools.partial(tp.vocab_parallel_logprobs, ranks=ranks)
    mine = [slice(0, 1), slice(1, 3)][ranks.dp_rank]  # prompt 0 | prompts 1, 2: uneven on purpose
    rows = slice(mine.start * 2, mine.stop * 2)
    for sp in (False, True):
        m = tp.shard_model(copy.deepcopy(full), ranks, sequence_parallel=sp)
        grpo_step(m, prompts[mine], completions[rows], advantages[rows], logprob_fn,
                  num_seqs=len(completions), num_tokens=num_tokens)  # global counts: SUM over dp is the big batch
        tp.dp_sum_grads(m, ranks)
        norm = tp.clip_grad_norm(m, max_norm, ranks)
        assert abs(norm - want_norm) <= REL * want_norm, (norm, want_norm)
        torch.optim.SGD(m.parameters(), lr=lr).step()
        got = tp.full_state_dict(m, ranks)
        for name, want in ref.named_parameters():
            assert_close(got[name], want, msg=f"sp={sp} {name}")


def test_dp2_x_tp2_update_equals_one_process_on_the_whole_batch(tmp_path):
    spawn(_dp_tp_worker, 4, tmp_path)

# -----------------------------------------------------------------------------
# One process: world size 1 and the clear errors


def test_clip_grad_norm_sums_in_float32_and_a_norm_under_the_limit_changes_no_bit():
    """The multi-tensor clip: bf16 grads' norm summed in float32 (a bf16 sum of squares would be
    off by ~1e-3 relative); under max_norm the grads stay as they were, bit for bit; over it each
    is scaled by max_norm / norm, as torch's clip_grad_norm_ scales."""
    ranks = tp.make_groups(1)
    m = full_model(tiny()).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    before = [p.grad.clone() for p in m.parameters()]
    want = torch.cat([g.float().flatten() for g in before]).norm().item()
    assert tp.clip_grad_norm(m, 2 * want, ranks) == pytest.approx(want, rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), before))
    assert tp.clip_grad_norm(m, want / 4, ranks) == pytest.approx(want, rel=1e-6)
    for p, g in zip(m.parameters(), before):
        torch.testing.assert_close(p.grad, g * (want / 4 / (want + 1e-6)), rtol=8e-3, atol=0)


def test_world_size_1_needs_no_process_group(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert tp.init_distributed()[:2] == (0, 1) and not dist.is_initialized()
    ranks = tp.make_groups(1)
    assert (ranks.tp_group, ranks.dp_group, ranks.tp_size, ranks.dp_size) == (None, None, 1, 1)
    m = full_model(tiny())
    assert tp.shard_model(m, ranks) is m and not hasattr(m, "tp_state")
    with tp.sequence_parallel(m):  # a no-op on an unsharded model
        pass
    tokens = torch.randint(0, V, (2, 5))
    logits = m(tokens).flatten(0, 1)[:-1]
    logp, entropy = tp.vocab_parallel_logprobs(logits, tokens.flatten()[1:], ranks)
    want_logp, want_entropy = plain_logprobs(logits, tokens.flatten()[1:])
    assert_close(logp, want_logp)
    assert_close(entropy, want_entropy)
    ref = copy.deepcopy(m)
    logp.sum().backward()
    plain_logprobs(ref(tokens).flatten(0, 1)[:-1], tokens.flatten()[1:])[0].sum().backward()
    tp.dp_sum_grads(m, ranks)  # dp 1: nothing to do
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item()
    assert tp.clip_grad_norm(m, 0.1, ranks) == pytest.approx(want_norm, rel=1e-6)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)


@pytest.mark.parametrize("kw, tp_size, field", [
    (dict(num_attention_heads=4, num_key_value_heads=4), 3, "num_attention_heads=4"),
    (dict(num_attention_heads=8, num_key_value_heads=2), 4, "num_key_value_heads=2"),
    (dict(intermediate_size=99), 2, "intermediate_size=99"),
    (dict(vocab_size=127), 2, "vocab_size=127"),
])
def test_shard_model_refuses_sizes_tp_does_not_divide(kw, tp_size, field):
    ranks = tp.ParallelGroups(None, None, tp_rank=0, tp_size=tp_size)  # refused before any collective
    with pytest.raises(ValueError, match=f"tp_size={tp_size} must divide {field}"):
        tp.shard_model(M.Llama(tiny(**kw)), ranks)


@pytest.mark.parametrize("logits, targets, match", [
    (torch.zeros(2, 3, 8), torch.zeros(2, dtype=torch.long), "logits must be"),
    (torch.zeros(4, 8), torch.zeros(3, dtype=torch.long), "targets must be int64 of shape"),
    (torch.zeros(4, 8), torch.zeros(4), "targets must be int64"),
    (torch.zeros(4, 8), torch.tensor([0, 1, 8, 2]), r"targets must be global ids in \[0, 8\)"),
    (torch.zeros(4, 8), torch.tensor([0, -1, 2, 2]), r"targets must be global ids in \[0, 8\)"),
])
def test_vocab_parallel_logprobs_refuses_bad_input(logits, targets, match):
    with pytest.raises(ValueError, match=match):
        tp.vocab_parallel_logprobs(logits, targets, tp.ParallelGroups(None, None))


def test_bad_tp_size_and_missing_rank_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="tp_size=0 must be >= 1"):
        tp.make_groups(0)
    with pytest.raises(ValueError, match="tp_size=2 must be >= 1 and divide the world size 1"):
        tp.make_groups(2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        tp.init_distributed()


def test_more_processes_than_gpus_is_one_line_on_every_rank(monkeypatch):
    """Regression: `torchrun --nproc_per_node 2` on a one-GPU node: rank 1 died in
    torch.cuda.set_device(cuda:1) with a traceback, rank 0 said nothing. Now every rank raises the
    same ValueError (train.main prints rank 0's) before touching a device; CPU-only, by faking one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(ValueError, match="more processes on this node than its 1 CUDA devices"):
            tp.init_distributed()
