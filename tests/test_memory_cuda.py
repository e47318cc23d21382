"""memory.py on a CUDA GPU: releasing a tag really returns its bytes to the allocator, pinned host
buffers are allocated once and reused, offload/reload with non-blocking copies is bit exact over
training steps, the bf16 sampler copy follows the fp32 trainer through sync_weights, a released
tensor raises instead of touching freed device memory, and activation offloading moves saved
tensors off the GPU with identical gradients. Skipped without a GPU; the CPU twin of each check is
in tests/test_memory.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import model as M
from memory import PhaseManager, checkpoint_blocks, offload_activations
from engine.decode import KVCache
from rollout import sync_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V = 2048


def tiny_model(width: int = 256, layers: int = 4, kv_heads: int = 4) -> M.Llama:
    cfg = M.ModelConfig(vocab_size=V, hidden_size=width, intermediate_size=width * 11 // 4,
                        num_hidden_layers=layers, num_attention_heads=8,
                        num_key_value_heads=kv_heads)
    return M.Llama(cfg).init_weights(0).cuda()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, V, (4, 64), generator=torch.Generator().manual_seed(step)).cuda()


def train_step(trainer, optimizer, step: int) -> None:
    # The math SDPA kernel: flash / memory-efficient backward kernels may sum in a varying order.
    with sdpa_kernel(SDPBackend.MATH):
        logits = trainer(batch(step)[:, :-1])  # (B, T-1, V)
        F.cross_entropy(logits.reshape(-1, V), batch(step)[:, 1:].reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad()


def engine(reference: bool = True, **shape):
    trainer = tiny_model(**shape)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    cache = KVCache(8 * 2**20, torch.bfloat16, "cuda")  # 16 MB
    mgr = PhaseManager("cuda")
    mgr.add_weights(trainer, sampler)
    mgr.add_kv_cache(cache.buffer)
    mgr.add_grads(trainer)
    mgr.add_optimizer(optimizer)
    ref = copy.deepcopy(trainer).to(torch.bfloat16) if reference else None
    if reference:
        mgr.add_reference(ref)
    return mgr, trainer, sampler, ref, optimizer, cache


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_memory_allocated_drops_by_the_released_bytes():
    mgr, trainer, sampler, ref, optimizer, cache = engine(reference=False)
    with mgr.phase("train"):
        with sdpa_kernel(SDPBackend.MATH):
            logits = trainer(batch(0)[:, :-1])
            F.cross_entropy(logits.reshape(-1, V), batch(0)[:, 1:].reshape(-1)).backward()
        optimizer.step()  # grads kept until the phase ends
        del logits
        released = mgr.resident_bytes()["grads"] + mgr.resident_bytes()["optimizer"]
        before = allocated()
    # Leaving train sleeps grads + optimizer state.
    assert mgr.resident_bytes()["grads"] == mgr.resident_bytes()["optimizer"] == 0
    assert before - allocated() >= 0.99 * released
    with mgr.phase("rollout"):
        released = mgr.resident_bytes()["sampler"] + mgr.resident_bytes()["kv_cache"]
        assert released > 16 * 2**20
        before = allocated()
    # Leaving rollout frees the KV cache and the bf16 sampler copy and wakes nothing.
    assert before - allocated() >= 0.99 * released
    with pytest.raises(RuntimeError, match=r"its kv_cache memory is released in no phase"):
        cache.buffer.sum()  # freed device memory is never read: the class swap refuses first


def device_free_and_reserved() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()


def test_released_bytes_go_back_to_the_device_not_to_the_allocators_cache():
    """memory_allocated drops at a sleep whatever happens next; the device's free bytes
    (another process's view) and the allocator's reserved bytes drop only if the cache is
    emptied. Fails without memory.return_freed_memory at the phase ends. Width 2048: fp32
    matrices of 16 MB, as in any real model (the allocator packs tensors under 10 MB into shared
    20 MB segments, and a segment that also holds a live tensor cannot be returned)."""
    mgr, trainer, sampler, ref, optimizer, cache = engine(reference=False, width=2048, layers=2,
                                                          kv_heads=8)
    with mgr.phase("train"):
        train_step(trainer, optimizer, 0)
        for p in trainer.parameters():  # grads exist at the phase end, as after accumulate
            p.grad = torch.zeros_like(p)
        free, reserved = device_free_and_reserved()
        tagged = mgr.resident_bytes()["grads"] + mgr.resident_bytes()["optimizer"]
    free_after, reserved_after = device_free_and_reserved()
    assert free_after - free >= 0.95 * tagged, (free_after - free, tagged)
    assert reserved - reserved_after >= 0.95 * tagged, (reserved - reserved_after, tagged)
    with mgr.phase("rollout"):
        free, reserved = device_free_and_reserved()
        tagged = mgr.resident_bytes()["sampler"] + mgr.resident_bytes()["kv_cache"]
    free_after, reserved_after = device_free_and_reserved()
    assert free_after - free >= 0.95 * tagged, (free_after - free, tagged)


def test_pinned_host_buffers_are_allocated_once_and_reused():
    mgr, trainer, sampler, ref, optimizer, cache = engine()
    offloaded = [g for g in mgr.holders if g.rule == "offload"]
    pointers = None
    for step in range(3):
        with mgr.phase("rollout"):
            pass
        with mgr.phase("reference"):
            pass
        with mgr.phase("train"):
            train_step(trainer, optimizer, step)
        if step >= 1:  # the optimizer's state exists from the first step on
            now = [g.host.data_ptr() for g in offloaded]
            assert pointers is None or now == pointers
            pointers = now
    assert all(g.host.is_pinned() for g in offloaded)
    assert [g.host_allocations for g in offloaded] == [1, 1]


def test_offload_round_trips_are_bit_exact_and_training_matches():
    plain = tiny_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    mgr, trainer, sampler, ref, optimizer, cache = engine()
    ref_before = [p.clone() for p in ref.parameters()]
    ids = None
    for step in range(3):
        train_step(plain, plain_opt, step)
        state_before = [v.clone() for s in optimizer.state.values() for v in s.values()]
        with mgr.phase("rollout"):  # non-blocking copies to pinned memory and back: must be exact
            sync_weights(sampler, trainer)
            for s, t in zip(sampler.parameters(), trainer.parameters()):
                assert torch.equal(s, t.detach().to(torch.bfloat16))
            assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
        with mgr.phase("reference"):
            assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), ref_before))
        with mgr.phase("train"):
            state_after = [v for s in optimizer.state.values() for v in s.values()]
            # between phases the state lived on the host (state_before was copied there)
            assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(state_after, state_before))
            assert [id(v) for v in state_after] == ids or ids is None
            train_step(trainer, optimizer, step)
        ids = [id(v) for s in optimizer.state.values() for v in s.values()]
    # Two runs of the same kernels on the same inputs: identical unless a CUDA kernel reduces in a
    # varying order; allow that (~1 ulp per step through Adam's normalisation), not more.
    for p, q in zip(trainer.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        for k in ("exp_avg", "exp_avg_sq"):  # outside the train phase the state is on the host
            torch.testing.assert_close(optimizer.state[p][k].cpu(), plain_opt.state[q][k].cpu(),
                                       rtol=1e-5, atol=1e-9)


def test_offload_activations_moves_saved_tensors_off_the_gpu_with_identical_grads():
    model, tokens = tiny_model(), batch(0)

    def forward():
        with sdpa_kernel(SDPBackend.MATH):
            logits = model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))

    base = allocated()
    loss = forward()
    plain_bytes = allocated() - base  # what autograd keeps alive for backward
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    del loss
    base = allocated()
    with offload_activations(model):
        loss = forward()
    assert allocated() - base < 0.25 * plain_bytes
    loss.backward()
    for p, w in zip(model.parameters(), want):  # same kernels, exact copies; slack: CUDA reductions
        torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-8)


def test_checkpoint_blocks_lowers_the_saved_bytes_with_identical_grads():
    model, tokens = tiny_model(), batch(0)

    def run():
        start = allocated()  # the previous run's grads are alive: count from here
        with sdpa_kernel(SDPBackend.MATH):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
        kept = allocated() - start
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return kept, grads

    run()  # warm-up: the cuBLAS workspace and the like stay allocated after the first run
    plain_kept, want = run()
    checkpoint_blocks(model.model.layers)
    ckpt_kept, got = run()
    assert ckpt_kept < 0.5 * plain_kept
    for g, w in zip(got, want):  # recompute replays the same kernels; slack: CUDA reductions
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)


def test_peak_bytes_survives_the_resets_of_each_phase():
    mgr, trainer, sampler, ref, optimizer, cache = engine(reference=False)
    spike = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MB outside any phase
    del spike
    with mgr.phase("rollout"):
        pass
    with mgr.phase("train"):
        pass
    assert torch.cuda.max_memory_allocated() < mgr.peak_bytes()  # CUDA's counter forgot the spike
    assert mgr.peak_bytes() >= 256 * 2**20
