"""memory.py on the CPU: byte accounting per tag and phase, training with sleep/wake around every
rollout == training without it (bit for bit, same Python objects), wake -> sync_weights -> generate
== a never-released sampler, every use of released memory raising one clear error, offloaded state
readable, grads and scratch released whatever made them, and activation offload / per-block
checkpointing == the plain forward (values and gradients). CUDA-only: tests/test_memory_cuda.py."""

import ast
import copy
import dataclasses
import io
import os

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from safetensors.torch import load_file, save_file
import tolerance
from memtrace import allocator_peak

from engine import attention
from engine import decode
from engine import compiling
import memory
import model as M
from run import plan
import tp
from memory import MemoryConfig, PhaseManager, checkpoint_blocks, offload_activations
from engine.decode import KVCache
from rollout import RolloutConfig, generate, sync_weights

V = 128


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: OpenMP barriers cost more than the math, and on a busy 2-core
    machine its spinning threads made a 2-layer training step 100x slower (1.7 s, not 17 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Qwen3's block at the tiny width: its q/k norms' weights are tagged, released and woken as any
HEADS = {"LlamaForCausalLM": dict(num_attention_heads=4, num_key_value_heads=2),
         "Qwen3ForCausalLM": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16)}


def tiny_model(seed: int = 0, arch: str = "LlamaForCausalLM") -> M.Llama:
    cfg = M.ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        max_position_embeddings=128, architecture=arch, **HEADS[arch])
    # std 0.2 (not HF's 0.02): peaked attention and logits, so a wrong saved tensor shows in grads.
    return M.Llama(cfg).init_weights(seed, std=0.2)


def loss_fn(model: M.Llama, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))


def engine(cfg: MemoryConfig | None = None, sampler_dtype: torch.dtype | None = torch.float64,
           copies: bool = False, arch: str = "LlamaForCausalLM"):
    """A trainer with AdamW, a separate sampler copy (or the trainer itself), a reference, a KV
    cache in the sampler's dtype. copies=True: the offloaded tags copy into a host buffer as on a
    GPU (on a CPU they stay in place), so the copy path runs here too."""
    trainer = tiny_model(arch=arch)
    sampler = trainer if sampler_dtype is None else copy.deepcopy(trainer).to(sampler_dtype)
    reference = copy.deepcopy(trainer)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.1)
    cache = KVCache(8192, sampler_dtype or torch.float32, "cpu")
    mgr = PhaseManager("cpu", cfg)
    mgr.add_weights(trainer, sampler)
    mgr.add_kv_cache(cache.buffer)
    mgr.add_grads(trainer)
    mgr.add_optimizer(optimizer)
    mgr.add_reference(reference)
    for group in mgr.holders:
        if group.tag in ("optimizer", "reference"):
            group.in_place = not copies
    return mgr, trainer, sampler, reference, optimizer, cache


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(step))


def train_step(trainer, optimizer, step: int) -> None:
    loss_fn(trainer, batch(step)).backward()
    optimizer.step()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes(optimizer) -> int:
    return nbytes(v for state in optimizer.state.values() for v in state.values())

# -----------------------------------------------------------------------------
# Accounting


@pytest.mark.parametrize("copies", [False, True])
def test_sleep_releases_every_tag_and_wake_restores_its_bytes(copies):
    """On a CPU (copies=False) optimizer state and reference stay resident in every phase."""
    mgr, trainer, sampler, reference, optimizer, cache = engine(copies=copies)
    scratch = {}
    mgr.add_scratch(scratch)
    train_step(trainer, optimizer, 0)  # grads and AdamW state exist now
    params = list(trainer.parameters())
    awake = {"trainer": nbytes(params), "sampler": 2 * nbytes(params), "kv_cache": 8192 * 8,
             "grads": nbytes(params), "optimizer": optimizer_bytes(optimizer),
             "reference": nbytes(params), "scratch": 0}
    assert mgr.resident_bytes() == awake  # before any phase everything is as registered
    with mgr.phase("rollout"):
        asleep = {"grads", "optimizer", "reference"} if copies else {"grads"}
        assert mgr.resident_bytes() == {t: 0 if t in asleep else b for t, b in awake.items()}
    # Leaving a phase frees what it woke at once (not at the next phase): only the trainer stays.
    stay = {"trainer"} if copies else {"trainer", "optimizer", "reference"}
    between = {t: awake[t] if t in stay else 0 for t in awake}
    assert mgr.resident_bytes() == between
    with mgr.phase("reference"):
        assert mgr.resident_bytes() == {**between, "reference": awake["reference"]}
    with mgr.phase("train"):
        assert mgr.resident_bytes() == {**between, "optimizer": awake["optimizer"]}
        train_step(trainer, optimizer, 1)
        scratch["gather"] = torch.empty(100)
        assert mgr.resident_bytes() == {**between, "optimizer": awake["optimizer"],
                                        "grads": awake["grads"], "scratch": 400}
    assert mgr.resident_bytes() == between
    # What was measured is what the static plan predicts for each phase (scratch: no shapes).
    for phase, by_tag in mgr.plan().items():
        measured = {t: mgr.phase_bytes[phase].get(t, 0) for t in by_tag if t != "scratch"}
        assert {t: b for t, b in by_tag.items() if t != "scratch"} == measured, phase
    rollout = awake["trainer"] + awake["sampler"] + awake["kv_cache"]
    rollout += 0 if copies else awake["optimizer"] + awake["reference"]
    assert mgr.phase_peak["rollout"] == rollout
    assert mgr.peak_bytes() == max(mgr.phase_peak.values())


@pytest.mark.parametrize("copies", [False, True])
def test_transitions_and_report(copies):
    """A copy is a transition with its bytes and GB/s; on a CPU nothing moves: no transition."""
    mgr, trainer, sampler, reference, optimizer, cache = engine(copies=copies)
    train_step(trainer, optimizer, 0)
    with mgr.phase("rollout"):
        pass
    offload = [t for t in mgr.transitions if t.tag == "optimizer"]
    assert [(t.phase, t.action) for t in offload] == [("rollout", "sleep")][:copies]
    assert not copies or offload[0].nbytes == optimizer_bytes(optimizer) > 0
    with mgr.phase("train"):
        pass
    actions = ["sleep", "wake", "sleep"] if copies else []
    assert [t.action for t in mgr.transitions if t.tag == "optimizer"] == actions
    text = mgr.report()
    words = ["offload", "GB/s"] if copies else ["guard"]
    for word in ("rollout", "train", "trainer", "sampler", "kv_cache", "grads", "optimizer",
                 "reference", "release", "peak", *words):
        assert word in text, word
    assert ("offload" in text) == copies


def test_flags_off_keep_everything_resident():
    cfg = MemoryConfig(offload_optimizer=False, offload_reference=False, release_kv=False,
                       release_grads=False, release_sampler=False, release_scratch=False)
    mgr, trainer, sampler, reference, optimizer, cache = engine(cfg)
    train_step(trainer, optimizer, 0)
    before = mgr.resident_bytes()
    for phase in ("rollout", "reference", "train"):
        with mgr.phase(phase):
            assert mgr.resident_bytes() == before
    assert mgr.transitions == []


def test_plan_on_the_meta_device_counts_bytes_from_shapes():
    with torch.device("meta"):
        trainer = M.Llama(tiny_model().config)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    mgr = PhaseManager("meta")
    mgr.add_weights(trainer, sampler)
    mgr.add_grads(trainer)
    n = sum(p.numel() for p in trainer.parameters())
    assert mgr.plan()["rollout"] == {"trainer": 4 * n, "sampler": 2 * n, "grads": 0}
    assert mgr.plan()["train"] == {"trainer": 4 * n, "sampler": 0, "grads": 4 * n}
    with pytest.raises(RuntimeError, match="meta device can only plan"):
        mgr.enter("rollout")

def test_the_rollout_plan_holds_the_stacked_weights_of_the_compiled_decode():
    """The compiled decode step's stacked q/k/v and gate/up weights (model.fused_projections) are
    in the rollout's plan where generate makes them (a CUDA target, a bf16 sampler, compile on,
    one rank) and nowhere else: their planned bytes are the stacked tensors' own, less biases."""
    cfg = tiny_model().config
    sampler = M.Llama(cfg).to(torch.bfloat16)
    with M.fused_projections(sampler):
        made = sum(m.fused[0].nbytes for m in sampler.modules() if getattr(m, "fused", None))
    r = RolloutConfig(num_samples=4, max_new_tokens=8)
    args = (cfg, 2, 16, r, torch.bfloat16)
    plain = plan.rollout_memory(*args)
    stacked = plan.rollout_memory(*args, stacked=True)
    assert stacked["prefill"] == plain["prefill"]  # made after the prefill and the first draw
    assert stacked["sampling"] == plain["sampling"] + made  # here the decode's part is the larger
    assert plan.stacked_decode("true", sampler, "cuda", 1) == (decode.kernel_for(
        torch.device("cuda"), torch.bfloat16, cfg.head_dim) is not None and not compiling.unsupported())
    assert not plan.stacked_decode("true", sampler, "cpu", 1)
    assert not plan.stacked_decode("true", sampler, "cuda", 2)
    assert not plan.stacked_decode("false", sampler, "cuda", 1)
    assert not plan.stacked_decode("auto", sampler, "cuda", 1)  # the tiny model: not worth it
    assert not plan.stacked_decode("true", sampler.float(), "cuda", 1)


def saved_bytes_per_token(m: M.Llama, dtype: torch.dtype, autocast: bool) -> float:
    """Bytes autograd keeps for backward in one block's training forward, per token: unique
    storages, the weights and the rope tables left out (tests/bench_tp.py's count)."""
    B, T = 2, 24
    block = m.model.layers[0]
    act = torch.float32 if autocast else dtype  # autocast: over fp32 weights, an fp32 stream
    cos, sin = M.rope_cos_sin(m.inv_freq, torch.arange(T).expand(B, T), act)
    skip = {t.untyped_storage().data_ptr() for t in [*m.parameters(), cos, sin]}
    x = torch.randn(B, T, m.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(act).requires_grad_()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        block(x, cos, sin, M.causal_attention)
    return sum(seen.values()) / (B * T)


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.bfloat16, True)])
def test_the_plan_counts_what_qwen3s_q_k_norms_keep_for_backward(dtype, autocast):
    """plan.block_bytes' Qwen3 term against autograd: a Qwen3 block keeps exactly what its q/k
    norms add to the same block without them, (4 + a)(Q + K) + 4(H + Hkv) bytes a token (each
    norm's float32 input, its a-byte output, a float32 rstd a head); and the memory tags count the
    norms' weights (the trainer's bytes are every parameter's)."""
    measured, planned = {}, {}
    for arch in HEADS:
        model = tiny_model(arch="Qwen3ForCausalLM")
        if arch != "Qwen3ForCausalLM":  # the same shapes, no q/k norms
            config = dataclasses.replace(model.config, architecture=arch)
            model = M.Llama(config).init_weights(0)
        model = model if autocast else model.to(dtype)
        measured[arch] = saved_bytes_per_token(model, dtype, autocast)
        per_token = plan.block_bytes(model.config, dtype, autocast=autocast)
        planned[arch] = per_token["norms"] + per_token["attention"] + per_token["mlp"]
    added = measured["Qwen3ForCausalLM"] - measured["LlamaForCausalLM"]
    assert added == planned["Qwen3ForCausalLM"] - planned["LlamaForCausalLM"] > 0
    with torch.device("meta"):
        trainer = M.Llama(tiny_model(arch="Qwen3ForCausalLM").config)
    mgr = PhaseManager("meta")
    mgr.add_weights(trainer, trainer)
    assert mgr.plan()["train"]["trainer"] == 4 * sum(p.numel() for p in trainer.parameters())
    assert any(name.endswith("q_norm.weight") for name, _ in trainer.named_parameters())


def test_phase_peaks_add_adam_state_and_transients_and_count_a_cpu_offload_once():
    """Before AdamW's first step (always, on the meta device) its state is planned from the
    parameters: two moments each. On a CPU target the offloaded tags stay in place: resident in
    every phase, counted once (regression: a host-buffer column counted them a second time)."""
    with torch.device("meta"):
        trainer = M.Llama(tiny_model().config)
    reference = copy.deepcopy(trainer).requires_grad_(False)
    mgr = PhaseManager("meta")
    mgr.add_weights(trainer, trainer)
    mgr.add_grads(trainer)
    mgr.add_optimizer(torch.optim.AdamW(trainer.parameters()))
    mgr.add_reference(reference)
    n = 4 * sum(p.numel() for p in trainer.parameters())  # float32 bytes
    transients = {"rollout": 1, "reference": 2, "train": 3, "idle": 4}
    gpu = plan.phase_peaks(mgr, transients, "cuda")
    assert {p: row["peak"] for p, row in gpu.items()} == {
        "idle": n + 4, "rollout": n + 1, "reference": 2 * n + 2, "train": 4 * n + 3}
    assert gpu["train"]["optimizer"] == 2 * n and gpu["rollout"]["optimizer"] == 0
    cpu = plan.phase_peaks(mgr, transients, "cpu")
    assert {p: row["peak"] for p, row in cpu.items()} == {  # trainer, AdamW, reference throughout
        "idle": 4 * n + 4, "rollout": 4 * n + 1, "reference": 4 * n + 2, "train": 5 * n + 3}
    assert all("host" not in row and row["optimizer"] == 2 * n for row in cpu.values())
    everything = plan.phase_peaks(mgr, transients, "cpu", phases=False)
    assert everything["rollout"]["peak"] == 5 * n + 1  # all resident


# -----------------------------------------------------------------------------
# Exactness and identity


@pytest.mark.parametrize("arch", list(HEADS))
@pytest.mark.parametrize("copies", [False, True])
def test_training_with_sleep_wake_around_every_rollout_is_bit_exact_with_the_same_objects(copies,
                                                                                        arch):
    steps = 4
    plain = tiny_model(arch=arch)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        train_step(plain, plain_opt, step)
        plain_opt.zero_grad()

    mgr, trainer, sampler, reference, optimizer, cache = engine(copies=copies, arch=arch)
    ids = None
    for step in range(steps):
        with mgr.phase("rollout"):
            sync_weights(sampler, trainer)
            sampler(batch(step))  # a fake rollout on the synced copy
        with mgr.phase("reference"):
            reference(batch(step))
        with mgr.phase("train"):
            train_step(trainer, optimizer, step)
            optimizer.zero_grad()
        now = [id(p) for p in trainer.parameters()]
        now += [id(v) for s in optimizer.state.values() for v in s.values()]
        assert ids is None or now == ids, "parameters and optimizer state: the same objects"
        ids = now
    for p, q in zip(trainer.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], plain_opt.state[q][key]), key
    # One host buffer per offloaded group, allocated at its first offload with state, and reused;
    # none on a CPU.
    offloaded = [g for g in mgr.holders if g.tag in ("optimizer", "reference")]
    assert [g.host_allocations for g in offloaded] == [int(copies)] * 2
    # The reference went through 4 offload/reload cycles and is still the initial model.
    assert all(torch.equal(p, q) for p, q in zip(reference.parameters(),
                                                 tiny_model(arch=arch).parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(reference.parameters(), plain.parameters()))


def test_leaving_train_offloads_the_optimizer_and_a_checkpoint_reads_the_same_values(tmp_path):
    """Regression: the phase table kept optimizer state on the device after training "for a
    checkpoint". Offloaded state is readable on the host: state_dict() and a safetensors file
    written from it hold the same values, and nothing in memory.py knows about checkpoints."""
    mgr, trainer, sampler, reference, optimizer, cache = engine(copies=True)
    with mgr.phase("train"):
        train_step(trainer, optimizer, 0)
        awake = copy.deepcopy(optimizer.state_dict())
    assert mgr.resident_bytes()["optimizer"] == 0
    host = next(g.host for g in mgr.holders if g.tag == "optimizer").untyped_storage().data_ptr()
    asleep = optimizer.state_dict()
    tensors = {}
    for i, state in awake["state"].items():
        for key, value in state.items():
            assert torch.equal(asleep["state"][i][key], value)
            assert asleep["state"][i][key].untyped_storage().data_ptr() == host  # offloaded
            tensors[f"{i}.{key}"] = asleep["state"][i][key]
    save_file(tensors, str(tmp_path / "optimizer.safetensors"))  # as run/checkpoint.py writes it
    loaded = load_file(str(tmp_path / "optimizer.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_on_a_cpu_offload_copies_nothing_keeps_every_bit_and_still_guards():
    """Regression: on a CPU the optimizer's and the reference's offload copied them into a second
    buffer in the same memory (for a 135M model 1,076 MB beside the 1,076 MB of AdamW state, and
    1.3 s a step). Now sleep and wake keep the same storages (data_ptr), bit for bit, allocate
    no buffer (awake again, the resident set has not grown by the state's bytes), and the guard
    still raises."""
    trainer, reference = torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)  # 16 MB each
    optimizer = torch.optim.AdamW(trainer.parameters())
    trainer(torch.ones(1, 2048)).sum().backward()
    optimizer.step()  # AdamW state: 32 MB
    mgr = PhaseManager("cpu")
    mgr.add_weights(trainer, trainer)
    mgr.add_optimizer(optimizer)
    mgr.add_reference(reference)
    state = [v for values in optimizer.state.values() for v in values.values()]
    tensors = [*reference.parameters(), *state]
    before = [(t.data_ptr(), t.clone()) for t in tensors]
    rss = resident_kib()
    with mgr.phase("rollout"):
        with pytest.raises(RuntimeError, match="optimizer memory is asleep"):
            optimizer.step()
        with pytest.raises(RuntimeError, match="reference memory is asleep"):
            reference(torch.ones(1, 2048))
        assert mgr.resident_bytes()["optimizer"] == optimizer_bytes(optimizer)  # still here
    with mgr.phase("reference"):
        reference(torch.ones(1, 2048))
    assert [t.data_ptr() for t in tensors] == [ptr for ptr, _ in before]
    assert all(torch.equal(t, old) for t, (_, old) in zip(tensors, before))
    with mgr.phase("train"):
        # A copy's host buffer is kept for reuse: awake, the state would be there twice.
        assert resident_kib() - rss < 8 * 1024, "no second copy of the 32 MB state (in KiB)"
        optimizer.step()  # awake: no hook left behind
    offloaded = [g for g in mgr.holders if g.tag in ("optimizer", "reference")]
    assert all(g.host is None and g.host_allocations == 0 for g in offloaded)
    assert all(g.rule == "guard" for g in offloaded) and not mgr.transitions


def test_wake_sync_generate_is_bit_exact_with_a_never_released_sampler():
    """The loop's order: wake the rollout phase, sync_weights, generate. The released sampler copy
    and KV cache then sample exactly what a copy that was never released samples."""
    mgr, trainer, sampler, reference, optimizer, cache = engine(sampler_dtype=torch.bfloat16)
    control = copy.deepcopy(sampler)  # never registered: never released
    control_cache = KVCache(cache.buffer.numel(), cache.buffer.dtype, "cpu")
    stale = copy.deepcopy(sampler)  # never synced: what a sampler without sync_weights samples
    prompts = [[1, 2, 3, 4], [5, 6]]
    cfg = RolloutConfig(num_samples=3, max_new_tokens=6)
    for step in range(3):
        with mgr.phase("rollout"):
            sync_weights(sampler, trainer)
            assert all(torch.equal(s, t.to(torch.bfloat16)) for s, t in  # cast as .to casts
                       zip(sampler.parameters(), trainer.parameters()))
            got = generate(sampler, prompts, cfg, seed=step, cache=cache)
        sync_weights(control, trainer)
        want = generate(control, prompts, cfg, seed=step, cache=control_cache)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
        with mgr.phase("train"):
            train_step(trainer, optimizer, step)
    stale_out = generate(stale, prompts, cfg, seed=2)
    assert not torch.equal(got.logprobs, stale_out.logprobs)  # sync mattered


def test_a_woken_sampler_holds_nan_until_synced():
    """memory.py only re-allocates: the weights come from sync_weights, never from the allocator's
    leftovers (on a GPU often the previous weights: a silently stale sampler)."""
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    ids = [id(p) for p in sampler.parameters()]
    with mgr.phase("train"):
        train_step(trainer, optimizer, 0)  # the sampler is released, the trainer moves on
    with mgr.phase("rollout"):
        assert all(p.isnan().all() for p in sampler.parameters())
        sync_weights(sampler, trainer)
        assert all(torch.equal(s, t.double()) for s, t in zip(sampler.parameters(),
                                                              trainer.parameters()))
    assert [id(p) for p in sampler.parameters()] == ids


def test_shared_weights_are_left_alone():
    mgr, trainer, sampler, reference, optimizer, cache = engine(sampler_dtype=None)
    data = [p.data_ptr() for p in trainer.parameters()]
    for phase in ("rollout", "reference", "train", "rollout"):
        with mgr.phase(phase):
            sync_weights(sampler, trainer)  # the same module: nothing to do
    assert [p.data_ptr() for p in trainer.parameters()] == data
    assert not [t for t in mgr.transitions if t.tag in ("sampler", "trainer")]
    assert mgr.resident_bytes()["sampler"] == 0  # counted once, under "trainer"


def test_kv_cache_is_released_and_woken_as_the_same_object():
    mgr, trainer, sampler, reference, optimizer, cache = engine(sampler_dtype=None)
    buffer, shape = cache.buffer, cache.buffer.shape
    cfg = RolloutConfig(num_samples=2, max_new_tokens=3)
    want = generate(trainer, [[1, 2, 3]], cfg, seed=0)
    with mgr.phase("train"):
        assert mgr.resident_bytes()["kv_cache"] == 0 and cache.buffer.shape == shape
        with pytest.raises(RuntimeError, match=r"its kv_cache memory is released in phase 'train'; "
                                               r"use it inside `with mgr.phase\('rollout'\)`"):
            generate(trainer, [[1, 2, 3]], RolloutConfig(num_samples=2, max_new_tokens=3), cache=cache)
    with mgr.phase("rollout"):
        assert cache.buffer is buffer and type(buffer) is torch.Tensor
        assert mgr.resident_bytes()["kv_cache"] == 8192 * 4
        out = generate(trainer, [[1, 2, 3]], cfg, cache=cache, seed=0)
        assert torch.equal(out.tokens, want.tokens) and torch.equal(out.logprobs, want.logprobs)

# -----------------------------------------------------------------------------
# Released memory: every use raises one clear error


USES = {
    "sum": lambda t: t.sum(), "norm": lambda t: t.norm(), "clone": lambda t: t.clone(),
    "zero_": lambda t: t.zero_(), "to": lambda t: t.to(torch.float32), "numpy": lambda t: t.numpy(),
    "tolist": lambda t: t.tolist(), "index": lambda t: t[0], "item": lambda t: t.item(),
    "linear": lambda t: F.linear(torch.ones(2, t.shape[-1], dtype=t.dtype), t),
    "cat": lambda t: torch.cat([torch.zeros(t.shape, dtype=t.dtype), t]),
    "add": lambda t: torch.ones((), dtype=t.dtype) + t, "data": lambda t: t.data,
    "copy_into": lambda t: t.copy_(torch.zeros(t.shape)), "deepcopy": copy.deepcopy,
    "save": lambda t: torch.save(t, io.BytesIO()), "bool": bool,
}


@pytest.mark.parametrize("use", USES)
@pytest.mark.parametrize("tag", ["kv_cache", "sampler"])
def test_any_use_of_released_memory_raises_one_clear_error(tag, use):
    """Regression: the released KV cache (storage resized to 0 under its full shape) segfaulted on
    whole-tensor use (sum, clone, zero_, to; numpy() gave a dangling array), and a released sampler
    weight, a (0,) stand-in, summed to 0 without a word."""
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    t = cache.buffer if tag == "kv_cache" else sampler.model.layers[0].mlp.up_proj.weight
    mgr.enter("train")
    message = (rf"\(\) on <released {tag} tensor \(\d+,( \d+)?\) torch.float64>: its {tag} memory "
               rf"is released in phase 'train'; use it inside `with mgr.phase\('rollout'\)`")
    with pytest.raises(RuntimeError, match=message):
        USES[use](t)
    mgr.exit()


def test_released_modules_raise_and_metadata_and_repr_stay_readable():
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    weight = sampler.lm_head.weight
    with mgr.phase("reference"):
        message = r"its sampler memory is released in phase 'reference'"
        for use in (lambda: sampler(batch(0)), lambda: sampler.state_dict(),
                    lambda: copy.deepcopy(sampler), lambda: sync_weights(sampler, trainer),
                    lambda: sampler.head(torch.zeros(1, 64, dtype=torch.float64))):
            with pytest.raises(RuntimeError, match=message):
                use()
        # Metadata reads no memory; repr and f-strings say what the tensor is.
        assert weight.shape == (V, 64) and weight.numel() == V * 64
        assert weight.dtype == torch.float64 and weight.device.type == "cpu"
        assert isinstance(weight, torch.nn.Parameter) and weight in set(sampler.parameters())
        assert repr(weight) == f"{weight}" == "<released sampler tensor (128, 64) torch.float64>"
    with pytest.raises(RuntimeError, match=r"released in no phase; use it inside `with mgr.phase"):
        weight.sum()


def test_awake_tensors_are_exactly_what_they_were():
    """The guard lives in the class of a released tensor only: woken, a parameter is a plain
    nn.Parameter again and the KV buffer a plain Tensor (no __torch_function__ on any use)."""
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    before = [(type(p), dict(vars(p))) for p in sampler.parameters()]
    with mgr.phase("train"):
        assert type(cache.buffer) is memory.ReleasedTensor
    with mgr.phase("rollout"):
        assert [(type(p), dict(vars(p))) for p in sampler.parameters()] == before
        assert type(cache.buffer) is torch.Tensor and not vars(cache.buffer)
    assert before[0] == (torch.nn.Parameter, {})


def test_a_view_taken_before_the_release_keeps_its_memory_instead_of_dangling():
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    with mgr.phase("rollout"):
        view = cache.buffer[:8]
        view.fill_(3.0)
    assert mgr.resident_bytes()["kv_cache"] == 0
    assert view.sum().item() == 24.0  # the old storage lives on with the view, never freed under it


@pytest.mark.parametrize("copies", [False, True])
def test_offloaded_modules_and_optimizer_raise_a_clear_error(copies):
    """On a CPU too (nothing copied), a step or forward outside the phase raises."""
    mgr, trainer, sampler, reference, optimizer, cache = engine(copies=copies)
    train_step(trainer, optimizer, 0)
    how = r"offloaded to the host" if copies else r"asleep \(in place: on a CPU\)"
    with mgr.phase("rollout"):
        with pytest.raises(RuntimeError, match=r"AdamW.step\(\): the optimizer state: its "
                                               rf"optimizer memory is {how} in "
                                               r"phase 'rollout'"):
            optimizer.step()
        with pytest.raises(RuntimeError, match=r"reference module 'model.embed_tokens': its "
                                               rf"reference memory is {how}.*"
                                               r"phase\('reference'\)"):
            reference(batch(0))
        with pytest.raises(RuntimeError, match=r"reference module 'model.norm'"):
            reference.head(torch.zeros(1, 64))  # head() skips forward(): every owner is guarded
        sync_weights(sampler, trainer)
        sampler(batch(0))  # awake here
    with mgr.phase("train"):
        optimizer.step()  # awake again: no hook left behind
    with mgr.phase("reference"):
        reference(batch(0))


def test_grads_made_outside_the_train_phase_are_released_by_the_next_sleep():
    """Regression: an `asleep` flag skipped the sleep of grads that a backward outside the train
    phase had re-created: they stayed on the device through the next phases."""
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    with mgr.phase("rollout"):
        pass
    loss_fn(trainer, batch(0)).backward()  # outside the train phase: grads exist again
    assert mgr.resident_bytes()["grads"] == nbytes(trainer.parameters())
    with mgr.phase("reference"):
        assert mgr.resident_bytes()["grads"] == 0
        assert all(p.grad is None for p in trainer.parameters())


def test_a_tensor_put_on_the_device_while_offloaded_is_offloaded_by_the_next_sleep():
    """Sleeps act on what is resident now: one parameter moved back to the device while the rest
    sit on the host goes to the host with them, and the module stays guarded."""
    mgr, trainer, sampler, reference, optimizer, cache = engine(copies=True)
    mgr.enter("rollout")
    mgr.exit()
    weight = reference.lm_head.weight
    weight.data = torch.full(weight.shape, 2.0)  # e.g. a load_state_dict that replaced tensors
    mgr.enter("train")
    assert mgr.resident_bytes()["reference"] == 0
    with pytest.raises(RuntimeError, match="reference module 'model.embed_tokens'"):
        reference(batch(0))
    mgr.exit()
    with mgr.phase("reference"):
        assert torch.equal(weight, torch.full(weight.shape, 2.0))
        first = tiny_model().model.layers[0].mlp.up_proj.weight
        assert torch.equal(reference.model.layers[0].mlp.up_proj.weight, first)


def test_scratch_tensors_are_accounted_in_train_and_cleared_outside():
    """tp.py's MemoryBuffer (gathered activations under sequence parallelism) is one more tag."""
    mgr, trainer, sampler, reference, optimizer, cache = engine()
    buffer = tp.MemoryBuffer()
    mgr.add_scratch(buffer.tensors)
    with mgr.phase("train"):
        buffer.get("gather", (4, 16), torch.float32, torch.device("cpu"))
        assert mgr.resident_bytes()["scratch"] == 4 * 16 * 4
    assert buffer.tensors == {} and mgr.phase_bytes["train"]["scratch"] == 256
    assert [(t.tag, t.action, t.nbytes) for t in mgr.transitions if t.tag == "scratch"] == [
        ("scratch", "sleep", 256)]
    assert "scratch" in mgr.report()


def resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(memory._MALLOC_TRIM is None or not os.path.exists("/proc/self/status"),
                    reason="glibc's malloc_trim and Linux's /proc")
def test_leaving_a_phase_on_the_cpu_gives_the_freed_heap_back():
    """Regression: glibc keeps freed heap memory, so on a CPU one phase's freed activations stayed
    resident under the next phase's allocations (a rollout after training: 370 MiB of RSS over the
    baseline, 167 MiB with the heap given back; tests/bench_plan.py)."""
    mgr = PhaseManager("cpu")
    with mgr.phase("train"):
        # 64 KiB each, below glibc's mmap threshold: heap memory, touched, then freed.
        chunks = [torch.ones(16384) for _ in range(1024)]
        pin = torch.ones(16384)  # above them: the heap's top cannot simply shrink
        del chunks
        freed = resident_kib()
    given_back = freed - resident_kib()
    assert given_back > 0.8 * 64 * 1024, given_back  # of the 64 MiB freed, in KiB
    assert pin.sum() == 16384


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
    with pytest.raises(TypeError, match="tensors must be a dict of scratch tensors"):
        mgr.add_scratch(tp.MemoryBuffer())
    with pytest.raises(ValueError, match="module: parameter 'model.embed_tokens.weight' is "
                                         "already registered under tag 'trainer'"):
        mgr.add_reference(trainer)
    with pytest.raises(TypeError, match=r"blocks must be an iterable of modules \(e.g. model.model"
                                        r".layers\), got Llama"):
        checkpoint_blocks(trainer)
    with pytest.raises(TypeError, match="blocks must be nn.Modules"):
        checkpoint_blocks([torch.zeros(2)])

# -----------------------------------------------------------------------------
# Activation memory


def grads_of(model: M.Llama, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def shared_prompt_loss(model: M.Llama, prompt: torch.Tensor, completion: torch.Tensor,
                       calls: list) -> torch.Tensor:
    """grpo.py's pattern: the prompt's K/V, captured during its forward, are reused by a second
    forward and must still carry gradient into the prompt. `calls` counts attention calls."""
    kv = {}

    def record(layer, q, k, v):
        calls.append(layer)
        kv[layer] = (k, v)
        return M.causal_attention(layer, q, k, v)

    def attend(layer, q, k, v):
        calls.append(layer)
        T, P = q.shape[2], kv[layer][0].shape[2]
        own = torch.ones(T, T, dtype=torch.bool).tril()[None]
        return attention.shared_prompt_attention(q, k, v, own, *kv[layer], torch.ones(1, P, dtype=torch.bool))

    model.hidden(prompt, None, record)
    start = prompt.shape[1]
    positions = torch.arange(start, start + completion.shape[1])[None].expand(completion.shape)
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
    """The blocks are an argument and recompute through their class (no forward bound on an
    instance): a deep copy recomputes its own blocks, and enabled=False gives the plain class."""
    model = tiny_model()
    prompt, completion = batch(1)[:1, :7], batch(2)[:, :5]  # one prompt, G = 3 completions
    plain_calls, ckpt_calls = [], []
    want_loss, want = grads_of(model, lambda: shared_prompt_loss(model, prompt, completion,
                                                                 plain_calls))
    assert checkpoint_blocks(model.model.layers) == 2
    block = model.model.layers[0]
    assert isinstance(block, M.Block) and type(block).__name__ == "CheckpointedBlock"
    assert "forward" not in vars(block)
    loss, got = grads_of(model, lambda: shared_prompt_loss(model, prompt, completion, ckpt_calls))
    # Recomputation replays the same kernels on the same inputs: bit for bit.
    assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)
    assert len(plain_calls) == 4 and len(ckpt_calls) == 8  # every block ran again in backward
    with torch.no_grad():  # rollout / no-grad logprobs: no checkpoint machinery, one call per block
        calls = []
        shared_prompt_loss(model, prompt, completion, calls)
        assert len(calls) == 4
    clone = copy.deepcopy(model)
    calls = []
    loss, got = grads_of(clone, lambda: shared_prompt_loss(clone, prompt, completion, calls))
    assert len(calls) == 8 and all(torch.equal(got[n], want[n]) for n in want)
    assert checkpoint_blocks(model.model.layers, enabled=False) == 2
    assert type(model.model.layers[0]) is M.Block
    calls = []
    grads_of(model, lambda: shared_prompt_loss(model, prompt, completion, calls))
    assert len(calls) == 4


def test_checkpoint_blocks_works_on_classes_tp_swapped_in():
    """tp.py turns modules into its own classes by swapping __class__; checkpointing stacks on top
    (either order) and comes off again, and a deep copy keeps both."""
    model, tokens = tiny_model(), batch(3)
    want_loss, want = grads_of(model, lambda: loss_fn(model, tokens))
    norms = [block.input_layernorm for block in model.model.layers]
    for norm in norms:
        norm.__class__ = tp.TPRMSNorm  # as shard_model does; (B, T, C) input: plain RMSNorm math
    checkpoint_blocks(norms)
    checkpoint_blocks(model.model.layers)
    assert isinstance(norms[0], tp.TPRMSNorm) and type(norms[0]).__name__ == "CheckpointedTPRMSNorm"
    clone = copy.deepcopy(model)
    for m in (model, clone):
        loss, got = grads_of(m, lambda: loss_fn(m, tokens))
        assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)
    assert type(clone.model.layers[1].input_layernorm) is type(norms[0])
    checkpoint_blocks(norms, enabled=False)
    assert type(norms[0]) is tp.TPRMSNorm


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_grads_into_weight_equal_autograds_and_skip_the_dense_gradient(tied):
    """grads_into_weight against the plain nn.Embedding: the same gradients (a tied head too, with
    .grad absent and present), and backward holds no dense (V, C) gradient: measured side by side,
    the plain one allocates at least V*C*4 bytes above the grads, the swapped one a few rows."""
    model = tiny_model()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    twin = copy.deepcopy(model)
    assert memory.grads_into_weight(twin.model.embed_tokens)
    assert type(twin.model.embed_tokens).__name__ == "GradIntoWeightEmbedding"
    tokens = batch(4)
    for m in (model, twin):
        m.zero_grad(set_to_none=True)
        for _ in range(2):  # .grad absent, then accumulating into it
            loss_fn(m, tokens).backward()
    for (name, got), want in zip(twin.named_parameters(), model.parameters()):
        # the same rows summed in another order (each row over the tokens that look it up, twice)
        torch.testing.assert_close(got.grad, want.grad, msg=name,
                                   **tolerance.reordered(2 * tokens.numel(), want.grad.abs().max()))
    assert twin.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():  # rollout: the plain lookup
        torch.testing.assert_close(twin(tokens), model(tokens), rtol=0, atol=0)

    big_v, c = 1 << 16, 16  # a dense gradient of 4 MiB, 48 looked-up rows
    peaks = []
    for swap in (False, True):
        emb = torch.nn.Embedding(big_v, c)
        if swap:
            memory.grads_into_weight(emb)
        ids = torch.randint(0, big_v, (4, 12), generator=torch.Generator().manual_seed(0))
        emb(ids).square().sum().backward()  # the grad exists: as in every micro-batch but one
        peaks.append(allocator_peak(lambda: emb(ids).square().sum().backward()))
    assert peaks[0] >= big_v * c * 4 > 16 * peaks[1], peaks
    padded = torch.nn.Embedding(V, 8, padding_idx=0)  # its gradient skips a row: left as it is
    assert not memory.grads_into_weight(padded) and type(padded) is torch.nn.Embedding


def test_activations_context_follows_the_config():
    model, tokens = tiny_model(), batch(0)
    want_loss, want = grads_of(model, lambda: loss_fn(model, tokens))
    on = PhaseManager("cpu", MemoryConfig(activation_offload=True))
    x = torch.randn(5, requires_grad=True)
    for mgr, offloaded in ((PhaseManager("cpu"), False), (on, True)):  # the default: off
        with mgr.activations(model):
            y = x.exp()  # autograd saves its result: the tensor itself, or a host copy
        assert (y.grad_fn._saved_result.data_ptr() != y.data_ptr()) == offloaded

    def run():
        with on.activations(model):
            return loss_fn(model, tokens)
    loss, got = grads_of(model, run)
    assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)

# -----------------------------------------------------------------------------
# The file itself


def test_memory_py_reads_in_short_lines_and_functions_and_imports_no_other_concept():
    """memory.py reads in lines of at most 100 columns and functions of at most 60 lines, and
    knows neither tp.py (it takes a dict of scratch tensors) nor any other file of ours."""
    path = memory.__file__
    with open(path) as f:
        source = f.read()
    assert max(len(line) for line in source.splitlines()) <= 100
    tree = ast.parse(source)
    for node in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        assert node.end_lineno - node.lineno + 1 <= 60, f"{node.name} in {os.path.basename(path)}"
    imported = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for alias in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"ctypes", "functools", "time", "collections", "contextlib", "dataclasses",
                        "typing", "torch"}
