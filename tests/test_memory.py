"""memory.py on the CPU: byte accounting per tag and phase, training with sleep/wake around every rollout
== training without it (bit for bit, same Python objects), the sampler's in-place sync, the KV cache
re-created empty, the released-memory guard and its messages, and activation offload / per-block
checkpointing == the plain forward (values and gradients). CUDA-only checks: tests/test_memory_cuda.py."""

import copy

import pytest
import torch
import torch.nn.functional as F

import model as M
from memory import MemoryConfig, PhaseManager, checkpoint_blocks, offload_activations
from rollout import KVCache, RolloutConfig, generate

V = 128


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: OpenMP barriers cost more than the math, and on a busy 2-core machine its
    spinning threads made a 2-layer training step 100x slower (1.7 s instead of 17 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed: int = 0) -> M.Llama:
    cfg = M.ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    # std 0.2 (not HF's 0.02): peaked attention and logits, so a wrong saved tensor shows in the grads.
    return M.Llama(cfg).init_weights(seed, std=0.2)


def loss_fn(model: M.Llama, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))


def engine(cfg: MemoryConfig | None = None, sampler_dtype: torch.dtype | None = torch.float64):
    """A trainer with AdamW, a separate sampler copy (or the trainer itself), a reference, a KV cache."""
    trainer = tiny_model()
    sampler = trainer if sampler_dtype is None else copy.deepcopy(trainer).to(sampler_dtype)
    reference = copy.deepcopy(trainer)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.1)
    cache = KVCache(4096, torch.float32, "cpu")
    mgr = PhaseManager("cpu", cfg)
    mgr.add_weights(trainer, sampler)
    mgr.add_kv_cache(cache.buffer)
    mgr.add_grads(trainer)
    mgr.add_optimizer(optimizer)
    mgr.add_reference(reference)
    return mgr, trainer, sampler, reference, optimizer, cache


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(step))


def train_step(trainer, optimizer, step: int) -> None:
    loss_fn(trainer, batch(step)).backward()
    optimizer.step()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)

# -----------------------------------------------------------------------------
# Accounting


def test_sleep_releases_every_tag_and_wake_restores_its_bytes():
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    train_step(trainer, optimizer, 0)  # grads and AdamW state exist now
    params = list(trainer.parameters())
    awake = {"trainer": nbytes(params), "weights": 2 * nbytes(params), "kv_cache": 4096 * 4, "grads": nbytes(params),
             "optimizer": nbytes(optimizer.state[p]["exp_avg"] for p in params) * 2 + 4 * len(params),  # + steps
             "reference": nbytes(params)}
    assert mgr.resident_bytes() == awake  # before any phase everything is as registered
    with mgr.phase("rollout"):
        asleep = {"grads", "optimizer", "reference"}
        assert mgr.resident_bytes() == {t: 0 if t in asleep else b for t, b in awake.items()}
    # Leaving rollout frees its KV cache and sampler copy at once (not at the next phase).
    assert mgr.resident_bytes() == {t: awake[t] if t == "trainer" else 0 for t in awake}
    with mgr.phase("reference"):
        assert mgr.resident_bytes() == {t: awake[t] if t in ("trainer", "reference") else 0 for t in awake}
    with mgr.phase("train"):
        assert mgr.resident_bytes()["optimizer"] == awake["optimizer"]
        train_step(trainer, optimizer, 1)
        assert mgr.resident_bytes() == {t: 0 if t in ("weights", "kv_cache", "reference") else b
                                        for t, b in awake.items()}
    # What was measured is what the static plan predicts for each phase.
    for phase, by_tag in mgr.plan().items():
        assert by_tag == {t: mgr.phase_bytes[phase].get(t, 0) for t in by_tag}, phase
    assert mgr.phase_peak["rollout"] == awake["trainer"] + awake["weights"] + awake["kv_cache"]
    assert mgr.peak_bytes() == max(mgr.phase_peak.values())


def test_transitions_and_report():
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    train_step(trainer, optimizer, 0)
    with mgr.phase("rollout"):
        pass
    offload = [t for t in mgr.transitions if t.tag == "optimizer"]
    assert [(t.phase, t.action) for t in offload] == [("rollout", "sleep")]
    assert offload[0].nbytes == nbytes(v for s in optimizer.state.values() for v in s.values()) and offload[0].seconds > 0
    text = mgr.report()
    for word in ("rollout", "trainer", "weights", "kv_cache", "grads", "optimizer", "reference", "GB/s", "peak"):
        assert word in text, word


def test_flags_off_keep_everything_resident_but_still_sync_the_sampler():
    cfg = MemoryConfig(offload_optimizer=False, offload_reference=False, release_kv=False, release_grads=False,
                       release_sampler=False)
    mgr, trainer, sampler, reference, optimizer, cache = engine(cfg)
    train_step(trainer, optimizer, 0)
    before = mgr.resident_bytes()
    for phase in ("rollout", "reference", "train"):
        with mgr.phase(phase):
            assert mgr.resident_bytes() == before
    assert all(t.action == "wake" and t.tag == "weights" for t in mgr.transitions)
    with mgr.phase("rollout"):
        assert all(torch.equal(s, t.double()) for s, t in zip(sampler.parameters(), trainer.parameters()))


def test_plan_on_the_meta_device_counts_bytes_from_shapes():
    with torch.device("meta"):
        trainer = M.Llama(tiny_model().config)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    mgr = PhaseManager("meta")
    mgr.add_weights(trainer, sampler)
    mgr.add_grads(trainer)
    n = sum(p.numel() for p in trainer.parameters())
    assert mgr.plan()["rollout"] == {"trainer": 4 * n, "weights": 2 * n, "grads": 0}
    assert mgr.plan()["train"] == {"trainer": 4 * n, "weights": 0, "grads": 4 * n}
    with pytest.raises(RuntimeError, match="meta device can only plan"):
        mgr.enter("rollout")

# -----------------------------------------------------------------------------
# Exactness and identity


def test_training_with_sleep_wake_around_every_rollout_is_bit_exact_with_the_same_objects():
    steps = 4
    plain = tiny_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        train_step(plain, plain_opt, step)
        plain_opt.zero_grad()

    mgr, trainer, sampler, reference, optimizer, cache = engine()
    ids = None
    for step in range(steps):
        with mgr.phase("rollout"):
            sampler(batch(step))  # a fake rollout on the synced copy
        with mgr.phase("reference"):
            reference(batch(step))
        with mgr.phase("train"):
            train_step(trainer, optimizer, step)
            optimizer.zero_grad()
        now = [id(p) for p in trainer.parameters()] + [id(v) for s in optimizer.state.values() for v in s.values()]
        assert ids is None or now == ids, "parameters and optimizer state must stay the same Python objects"
        ids = now
    for p, q in zip(trainer.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], plain_opt.state[q][key]), key
    # One host buffer per offloaded group, allocated once (the first offload with any state) and reused.
    assert [g.host_allocations for g in mgr.groups if g.policy == "offload"] == [1, 1]
    # The reference went through 4 offload/reload cycles and is still the initial model, bit for bit.
    assert all(torch.equal(p, q) for p, q in zip(reference.parameters(), tiny_model().parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(reference.parameters(), plain.parameters()))  # it trained


def test_offloaded_optimizer_state_reads_the_same_values():
    """state_dict() while asleep returns the host copies: a checkpoint written then is still right."""
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    train_step(trainer, optimizer, 0)
    awake = copy.deepcopy(optimizer.state_dict())
    with mgr.phase("rollout"):
        host = next(g.host for g in mgr.groups if g.tag == "optimizer").untyped_storage().data_ptr()
        asleep = optimizer.state_dict()
        for i, state in awake["state"].items():
            for key, value in state.items():
                assert torch.equal(asleep["state"][i][key], value)
                assert asleep["state"][i][key].untyped_storage().data_ptr() == host  # really offloaded


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sampler_copy_is_synced_in_place_from_the_trainer(dtype):
    mgr, trainer, sampler, reference, optimizer, cache = engine(sampler_dtype=dtype)
    ids = [id(p) for p in sampler.parameters()]
    for step in range(2):
        with mgr.phase("train"):
            train_step(trainer, optimizer, step)  # the trainer moves; the sampler must follow
        with mgr.phase("rollout"):
            for s, t in zip(sampler.parameters(), trainer.parameters()):
                assert s.dtype == dtype and torch.equal(s, t.detach().to(dtype))
            assert [id(p) for p in sampler.parameters()] == ids
            want = trainer(batch(9)).double()
            # float64 copy of fp32 weights: only the fp32 vs fp64 arithmetic differs (~1e-6 on logits of
            # size ~5); bf16 weights carry ~3 significant digits, so a bf16 forward is only ~5e-2 close.
            tol = 1e-4 if dtype == torch.float64 else 0.3
            torch.testing.assert_close(sampler(batch(9)).double(), want, rtol=0, atol=tol)
        assert mgr.resident_bytes()["weights"] == 0


def test_shared_weights_are_left_alone():
    mgr, trainer, sampler, reference, optimizer, cache = engine(sampler_dtype=None)
    data = [p.data_ptr() for p in trainer.parameters()]
    for phase in ("rollout", "reference", "train", "rollout"):
        with mgr.phase(phase):
            pass
    assert [p.data_ptr() for p in trainer.parameters()] == data
    assert not [t for t in mgr.transitions if t.tag in ("weights", "trainer")]
    assert mgr.resident_bytes()["weights"] == 0  # counted once, under "trainer"


def test_kv_cache_is_recreated_empty_as_the_same_object():
    mgr, trainer, sampler, reference, optimizer, cache = engine(sampler_dtype=None)
    buffer, shape = cache.buffer, cache.buffer.shape
    cache.buffer.fill_(7.0)  # last rollout's keys and values
    with mgr.phase("train"):
        assert cache.buffer.untyped_storage().nbytes() == 0
        with pytest.raises(RuntimeError, match="KV cache is released"):
            generate(trainer, [[1, 2, 3]], RolloutConfig(num_samples=2, max_new_tokens=3), cache=cache)
    with mgr.phase("rollout"):
        assert cache.buffer is buffer and cache.buffer.shape == shape
        assert cache.buffer.untyped_storage().nbytes() == 4096 * 4 and not cache.buffer.any()
        cfg = RolloutConfig(num_samples=2, max_new_tokens=3)
        out = generate(trainer, [[1, 2, 3]], cfg, cache=cache, seed=0)
        assert out.mask.sum(1).tolist() == [3, 3]

# -----------------------------------------------------------------------------
# The guard and bad input


def test_using_released_memory_raises_a_clear_error():
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    train_step(trainer, optimizer, 0)
    with mgr.phase("rollout"):
        with pytest.raises(RuntimeError, match=r"AdamW.step\(\): the optimizer state is asleep \(phase 'rollout'\)"):
            optimizer.step()
        with pytest.raises(RuntimeError, match=r"reference module 'model.embed_tokens' is asleep \(phase 'rollout'\).*"
                                               r"offloaded.*phase\('reference'\)"):
            reference(batch(0))
        sampler(batch(0))  # awake here
    with mgr.phase("train"):
        # hidden()/head() skip the top module's forward: every parameter owner carries the guard.
        with pytest.raises(RuntimeError, match=r"weights module 'model.norm' is asleep \(phase 'train'\).*released"):
            sampler.head(torch.zeros(1, 64, dtype=torch.float64))
        optimizer.step()  # awake again: no hook left behind
    with mgr.phase("reference"):
        reference(batch(0))


def test_bad_input_names_the_argument():
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    with pytest.raises(ValueError, match="phase must be one of"):
        mgr.enter("decode")
    with pytest.raises(RuntimeError, match="outside a phase"):
        mgr.exit()
    with mgr.phase("train"), pytest.raises(RuntimeError, match="phase 'train' has not been exited"):
        mgr.enter("rollout")
    with pytest.raises(TypeError, match="buffer must be a Tensor"):
        mgr.add_kv_cache(cache)
    with pytest.raises(ValueError, match="buffer must own its whole storage"):
        mgr.add_kv_cache(torch.zeros(10)[2:])
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        mgr.add_optimizer(trainer)
    with pytest.raises(ValueError, match="module: parameter 'model.embed_tokens.weight' is already registered under "
                                         "tag 'trainer'"):
        mgr.add_reference(trainer)
    other = M.Llama(M.ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"sampler_model: parameter '.*' has shape \(128, 32\), the trainer's \(128, 64\)"):
        PhaseManager("cpu").add_weights(trainer, other)
    with pytest.raises(ValueError, match="model: expected transformer blocks at model.model.layers"):
        checkpoint_blocks(torch.nn.Linear(2, 2))

# -----------------------------------------------------------------------------
# Activation memory


def grads_of(model: M.Llama, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def shared_prompt_loss(model: M.Llama, prompt: torch.Tensor, completion: torch.Tensor, calls: list) -> torch.Tensor:
    """grpo.py's pattern: the prompt's K/V, captured during its forward, are reused by a second forward
    and must still carry gradient into the prompt. `calls` counts attention calls (recompute shows)."""
    kv = {}

    def record(layer, q, k, v):
        calls.append(layer)
        kv[layer] = (k, v)
        return M.causal_attention(layer, q, k, v)

    def attend(layer, q, k, v):
        calls.append(layer)
        T, P = q.shape[2], kv[layer][0].shape[2]
        own = torch.ones(T, T, dtype=torch.bool).tril()[None]
        return M.prefix_attention(q, k, v, own, *kv[layer], torch.ones(1, P, dtype=torch.bool))

    model.hidden(prompt, None, record)
    positions = torch.arange(prompt.shape[1], prompt.shape[1] + completion.shape[1])[None].expand(completion.shape)
    logits = model.head(model.hidden(completion, positions, attend))  # (G, T, V)
    return logits.float().logsumexp(-1).mean()


def test_offload_activations_gives_identical_grads():
    model, tokens = tiny_model(), batch(0)
    want_loss, want = grads_of(model, lambda: loss_fn(model, tokens))
    for keep in (model, None):  # with and without leaving the parameters in place
        with offload_activations(keep):
            loss, got = grads_of(model, lambda: loss_fn(model, tokens))
        # Same kernels on the same values (the copies are exact): bit for bit.
        assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)


def test_checkpoint_blocks_recomputes_and_gives_identical_grads():
    model = tiny_model()
    prompt, completion = batch(1)[:1, :7], batch(2)[:, :5]  # one prompt, G = 3 completions
    plain_calls, ckpt_calls = [], []
    want_loss, want = grads_of(model, lambda: shared_prompt_loss(model, prompt, completion, plain_calls))
    assert checkpoint_blocks(model) == 2
    loss, got = grads_of(model, lambda: shared_prompt_loss(model, prompt, completion, ckpt_calls))
    # Recomputation replays the same kernels on the same inputs: bit for bit.
    assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)
    assert len(plain_calls) == 4 and len(ckpt_calls) == 8  # every block ran again in backward
    with torch.no_grad():  # rollout / no-grad logprobs: no checkpoint machinery, one call per block
        calls = []
        shared_prompt_loss(model, prompt, completion, calls)
        assert len(calls) == 4
    clone = copy.deepcopy(model)
    assert clone.model.layers[0].forward.__self__ is clone.model.layers[0]  # recomputes its own block
    checkpoint_blocks(model, enabled=False)
    assert "forward" not in vars(model.model.layers[0])
    calls = []
    grads_of(model, lambda: shared_prompt_loss(model, prompt, completion, calls))
    assert len(calls) == 4


def test_activations_context_follows_the_config():
    model, tokens = tiny_model(), batch(0)
    want_loss, want = grads_of(model, lambda: loss_fn(model, tokens))
    on = PhaseManager("cpu", MemoryConfig(activation_offload=True, activation_checkpoint=True))
    x = torch.randn(5, requires_grad=True)
    for mgr, offloaded in ((PhaseManager("cpu"), False), (on, True)):  # the defaults: neither option
        with mgr.activations(model):
            y = x.exp()  # autograd saves its result: the tensor itself, or a host copy when offloaded
        assert (y.grad_fn._saved_result.data_ptr() != y.data_ptr()) == offloaded
        assert ("forward" in vars(model.model.layers[0])) == offloaded  # checkpointing switched on

    def run():
        with on.activations(model):
            return loss_fn(model, tokens)
    loss, got = grads_of(model, run)
    assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)
