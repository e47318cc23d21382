"""
Phases: what lives on the device while rolling out, computing reference logprobs, or training.

Rollout and training share one device: in rollout the optimizer state, grads and reference model are dead
weight, in training the KV cache and a separate sampler copy. Engines solved this with sleep/wake (vLLM's
sleep levels, SGLang's release/resume of memory, verl's offload flags). Here memory has tags and policies:

    trainer    keep                                                   awake in every phase
    weights    shared with the trainer, or a separate (bf16) copy     rollout (synced IN PLACE at wake)
    kv_cache   discard: storage resized to 0, re-created zeroed       rollout
    reference  offload to one reused (pinned) host buffer             reference
    optimizer  offload to one reused (pinned) host buffer             train
    grads      discard: set to None, backward re-creates them         train

Entering a phase sleeps what it does not need BEFORE waking what it needs, in stages (sampler weights,
their sync, then the KV cache): the peak never holds two phases' memory. Parameters and optimizer state
stay the same Python objects (`.data` is swapped; addresses change, so re-capture CUDA graphs). Using
released memory raises a clear RuntimeError. Also: activation offloading and per-block checkpointing.
On a CPU the same code runs (offload is a copy into a separate buffer). No shapes: tensors move whole.
Leaves out: offloading the trainer's own weights, disk offload, copy streams overlapping compute.
Tested by tests/test_memory.py and tests/test_memory_cuda.py; measured by tests/bench_memory.py.
"""

import time
import types
from collections import namedtuple
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------
# Config, the phase table, tagged groups


@dataclass
class MemoryConfig:
    offload_optimizer: bool = True       # AdamW state is 2x the fp32 weights, idle during rollout
    offload_reference: bool = True       # the reference model runs one no-grad forward per step
    release_kv: bool = True              # the KV cache is dead outside rollout; re-created zeroed
    release_grads: bool = True           # grads are dead between optimizer.step and the next backward
    release_sampler: bool = True         # a separate sampler copy is re-synced every rollout anyway
    pin_memory: bool = True              # CUDA only: pinned host buffers make copies async and ~2x faster
    activation_offload: bool = False     # saved activations to the host in the train forward: PCIe for memory
    activation_checkpoint: bool = False  # recompute each block in backward: ~1/3 more compute, O(1) blocks saved


# Tags each phase needs awake, in wake order (staged wake: sampler weights + sync before the KV cache).
PHASE_TAGS = {"rollout": ("weights", "kv_cache"), "reference": ("reference",), "train": ("optimizer", "grads")}
# Tags released on leaving a phase, not at the next one: dead once the outputs exist, and freeing them early
# lowers the peak of the old-logprob forward in between. Train keeps its optimizer state for a checkpoint.
RELEASE_ON_EXIT = {"rollout": ("kv_cache", "weights"), "reference": ("reference",), "train": ()}
# One sleep or wake of one group: bytes freed, copied or synced; seconds include a device synchronisation.
Transition = namedtuple("Transition", "phase tag action nbytes seconds")


@dataclass(eq=False)  # compared by identity, never field by field (tensors)
class Group:
    """The tensors registered by one add_* call: one tag, one policy, and the state of its sleep."""
    tag: str
    policy: str      # keep, shared, sync (sampler copy), discard_kv, discard_grads, offload
    releasable: bool
    asleep: bool = False
    params: list[Tensor] = field(default_factory=list)       # module parameters (for grads: their owners)
    sources: list[Tensor] = field(default_factory=list)      # sync: the trainer parameter each one copies
    modules: list[nn.Module] = field(default_factory=list)   # where the forward guard goes while asleep
    buffers: list[Tensor] = field(default_factory=list)      # the KV cache
    optimizer: torch.optim.Optimizer | None = None
    host: Tensor | None = None                               # flat uint8 host buffer, allocated once, reused
    host_allocations: int = 0
    offloaded: list[Tensor] = field(default_factory=list)    # tensors whose .data views `host` right now
    hooks: list = field(default_factory=list)                # guard handles, removed on wake

    def tensors(self) -> list[Tensor]:  # what it holds right now: grads and optimizer state come and go
        if self.policy == "discard_grads":
            return [p.grad for p in self.params if p.grad is not None]
        if self.optimizer is not None:
            return [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
        return self.params + self.buffers

    def full_bytes(self) -> int:  # bytes when awake, from shapes alone, so plans work on the meta device
        if self.policy in ("discard_grads", "sync"):  # released sampler params are (0,): use the sources'
            return sum(s.numel() * p.element_size() for p, s in zip(self.params, self.sources or self.params))
        return sum(t.numel() * t.element_size() for t in self.tensors())

# -----------------------------------------------------------------------------
# The phase manager


class PhaseManager:
    """Tagged groups moved between phases: `with mgr.phase("rollout"): ...` (or enter(phase) ... exit())."""

    def __init__(self, device: str | torch.device, cfg: MemoryConfig | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cfg = cfg or MemoryConfig()
        self.pin = self.cfg.pin_memory and self.device.type == "cuda"
        self.groups: list[Group] = []
        self.current: str | None = None
        self.transitions: list[Transition] = []
        self.phase_bytes: dict[str, dict[str, int]] = {}  # phase -> tag -> max bytes resident seen
        self.phase_peak: dict[str, int] = {}              # phase -> max allocated (CUDA) or tag bytes (CPU)
        self.lifetime_peak = 0                            # CUDA's max allocated before its last reset

    def _add(self, tag: str, policy: str, releasable: bool, module: nn.Module | None = None, arg: str = "") -> Group:
        group = Group(tag, policy, releasable)
        if module is not None:
            if not isinstance(module, nn.Module):
                raise TypeError(f"{arg} must be an nn.Module, got {type(module).__name__}")
            taken = {p.untyped_storage().data_ptr(): g.tag for g in self.groups if g.modules for p in g.params}
            taken.pop(0, None)  # meta (planning) and empty tensors have no storage to share
            for name, p in module.named_parameters():
                if p.untyped_storage().data_ptr() in taken:  # e.g. the trainer passed as its own reference
                    raise ValueError(f"{arg}: parameter '{name}' is already registered under tag "
                                     f"'{taken[p.untyped_storage().data_ptr()]}'")
            group.params, group.modules = list(module.parameters()), [module]
        self.groups.append(group)
        return group

    def add_kv_cache(self, buffer: Tensor) -> None:
        """rollout.py's KVCache.buffer: released with storage().resize_(0), re-created zeroed on wake."""
        if not isinstance(buffer, Tensor):
            raise TypeError(f"buffer must be a Tensor (rollout's KVCache.buffer), got {type(buffer).__name__}")
        if buffer.device != self.device:
            raise ValueError(f"buffer is on {buffer.device}, the manager's device is {self.device}")
        if buffer.storage_offset() or buffer.untyped_storage().nbytes() != buffer.numel() * buffer.element_size():
            raise ValueError("buffer must own its whole storage: releasing a view would free its base too")
        self._add("kv_cache", "discard_kv", self.cfg.release_kv).buffers.append(buffer)

    def add_grads(self, model: nn.Module) -> None:
        """The .grad of every trainable parameter: set to None outside the train phase."""
        self._add("grads", "discard_grads", self.cfg.release_grads).params = [
            p for p in model.parameters() if p.requires_grad]

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Its state tensors on the device, looked up at each sleep (AdamW creates them at its first step),
        are offloaded outside the train phase; others (AdamW's CPU `step` next to a GPU) are left alone."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._add("optimizer", "offload", self.cfg.offload_optimizer).optimizer = optimizer

    def add_reference(self, module: nn.Module) -> None:
        """A frozen model (its parameters; buffers stay) offloaded outside the reference phase."""
        self._add("reference", "offload", self.cfg.offload_reference, module, "module")

    def add_weights(self, trainer_model: nn.Module, sampler_model: nn.Module) -> None:
        """The trainer's parameters (always resident) and the sampler's: the same module (shared, nothing to
        do) or a separate copy (e.g. bf16 for an fp32 trainer) synced in place at every rollout wake."""
        self._add("trainer", "keep", False, trainer_model, "trainer_model")
        if sampler_model is trainer_model:
            self._add("weights", "shared", False)
            return
        trainer_params, sampler_params = dict(trainer_model.named_parameters()), dict(sampler_model.named_parameters())
        for name in sorted(trainer_params.keys() | sampler_params.keys()):
            shapes = [tuple(ps[name].shape) if name in ps else None for ps in (sampler_params, trainer_params)]
            if shapes[0] != shapes[1]:
                raise ValueError(f"sampler_model: parameter '{name}' has shape {shapes[0]}, the trainer's {shapes[1]}")
        group = self._add("weights", "sync", self.cfg.release_sampler, sampler_model, "sampler_model")
        group.params, group.sources = list(sampler_params.values()), [trainer_params[n] for n in sampler_params]

    # -------------------------------------------------------------------------
    # Phases

    def enter(self, phase: str) -> None:
        if phase not in PHASE_TAGS:
            raise ValueError(f"phase must be one of {list(PHASE_TAGS)}, got {phase!r}")
        if self.current is not None:
            raise RuntimeError(f"cannot enter phase '{phase}': phase '{self.current}' has not been exited")
        if self.device.type == "meta":
            raise RuntimeError("a PhaseManager on the meta device can only plan(), not move memory")
        if self.device.type == "cuda":  # NOTE: CUDA's peak counter is process-wide: fold it in before the reset
            self.lifetime_peak = max(self.lifetime_peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        self.current = phase
        # Sleep what this phase does not need BEFORE waking what it needs: the peak never holds both.
        self._apply(self._sleep, [t for t in dict.fromkeys(g.tag for g in self.groups) if t not in PHASE_TAGS[phase]])
        self._apply(self._wake, PHASE_TAGS[phase])
        self._observe()

    def exit(self) -> None:
        if self.current is None:
            raise RuntimeError("exit() outside a phase: call enter(phase) first")
        self._observe()
        self._apply(self._sleep, RELEASE_ON_EXIT[self.current])
        self.current = None

    @contextmanager
    def phase(self, phase: str) -> Iterator["PhaseManager"]:
        self.enter(phase)
        try:
            yield self
        finally:
            self.exit()

    def _apply(self, action, tags) -> None:
        for group in [g for tag in tags for g in self.groups if g.tag == tag]:  # in the order of `tags`
            action(group)

    # -------------------------------------------------------------------------
    # Sleep and wake, per policy

    def _record(self, group: Group, action: str, nbytes: int, start: float) -> None:
        if self.device.type == "cuda":  # honest timing: the copies are asynchronous
            torch.cuda.synchronize(self.device)
        self.transitions.append(Transition(self.current, group.tag, action, nbytes, time.perf_counter() - start))

    def _sleep(self, group: Group) -> None:
        if group.asleep or not group.releasable:
            return
        start, nbytes = time.perf_counter(), self.resident_bytes(group)
        if group.policy == "discard_kv":
            for buffer in group.buffers:
                buffer.untyped_storage().resize_(0)  # same Tensor object and shape; rollout checks the size
        elif group.policy == "discard_grads":
            for p in group.params:
                p.grad = None
        elif group.policy == "sync":
            for p in group.params:  # a (0,)-shaped stand-in: any use fails on shapes, nothing dangles
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        elif group.policy == "offload":
            self._offload(group)
        self._record(group, "sleep", nbytes, start)
        self._guard(group)
        group.asleep = True

    @torch.no_grad()  # moving a Parameter's bytes is not an operation to differentiate
    def _offload(self, group: Group) -> None:
        """Copy every resident tensor into one host buffer (reused), then point its .data there."""
        tensors = [t for t in group.tensors() if self._resident(t)]  # distinct storages: no views in here
        sizes, offsets = [t.numel() * t.element_size() for t in tensors], [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // 64) * 64)  # 64-byte aligned slices: any dtype can view them
        if offsets[-1] and (group.host is None or group.host.numel() < offsets[-1]):
            # Pinned (page-locked) so the copies are truly async DMA; allocated once, grown only if the
            # state grew (AdamW's appears at the first step), because pinning is slow (cudaHostAlloc).
            group.host = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=self.pin)
            group.host_allocations += 1
        views = [group.host[o:o + n].view(t.dtype).view(t.shape) for t, o, n in zip(tensors, offsets, sizes)]
        for t, view in zip(tensors, views):
            view.copy_(t, non_blocking=True)
        if self.device.type == "cuda":  # NOTE: the copies must be complete before a device block is freed
            torch.cuda.synchronize(self.device)
        for t, view in zip(tensors, views):
            t.data = view  # same Python object (optimizer state / Parameter), now in the host buffer
        group.offloaded = tensors

    @torch.no_grad()
    def _wake(self, group: Group) -> None:
        if not group.asleep and group.policy != "sync":  # a sampler copy is synced every rollout, asleep or not
            return
        start = time.perf_counter()
        while group.hooks:
            group.hooks.pop().remove()
        if group.policy == "discard_kv":
            for buffer in group.buffers:
                buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
                buffer.zero_()  # re-created empty, never last rollout's (or the allocator's) garbage
        elif group.policy == "offload":
            for t in group.offloaded:  # the host buffer outlives the async copies: it is kept for reuse
                t.data = torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t, non_blocking=True)
            group.offloaded = []
        elif group.policy == "sync":
            # Staged: allocate and fill (cast) one parameter at a time: the transient is one tensor, not a copy.
            for p, source in zip(group.params, group.sources):
                if p.shape != source.shape:  # released: re-create in the sampler's own dtype
                    p.data = torch.empty(source.shape, dtype=p.dtype, device=self.device)
                p.copy_(source)
        group.asleep = False
        self._record(group, "wake", self.resident_bytes(group), start)

    def _asleep_error(self, what: str, group: Group) -> RuntimeError:
        needed = next(phase for phase, tags in PHASE_TAGS.items() if group.tag in tags)
        moved = "offloaded to the host" if group.policy == "offload" else "released"
        return RuntimeError(f"{what} is asleep (phase '{self.current or 'none'}'): its {group.tag} memory is "
                            f"{moved}; use it inside `with phase('{needed}')`")

    def _guard(self, group: Group) -> None:
        """Make any use of released memory raise; hooks exist only while asleep: awake models pay nothing."""
        for root in group.modules:
            for name, module in root.named_modules():
                if next(module.parameters(recurse=False), None) is not None:  # hooks on every owner, because
                    def hook(mod, args, name=name):                           # callers may skip forward()
                        raise self._asleep_error(f"{group.tag} module '{name or type(mod).__name__}'", group)
                    group.hooks.append(module.register_forward_pre_hook(hook))
        if group.optimizer is not None:
            def step_hook(optimizer, args, kwargs):
                raise self._asleep_error(f"{type(optimizer).__name__}.step(): the optimizer state", group)
            group.hooks.append(group.optimizer.register_step_pre_hook(step_hook))

    # -------------------------------------------------------------------------
    # Accounting

    def _resident(self, t: Tensor) -> bool:
        hosts = {g.host.untyped_storage().data_ptr() for g in self.groups if g.host is not None}
        storage = t.untyped_storage()
        return t.device == self.device and storage.nbytes() > 0 and storage.data_ptr() not in hosts

    def resident_bytes(self, group: Group | None = None) -> int | dict[str, int]:
        """Bytes on the device of one group, or of every tag (a dict) when no group is given."""
        if group is None:
            return {tag: sum(self.resident_bytes(g) for g in self.groups if g.tag == tag)
                    for tag in dict.fromkeys(g.tag for g in self.groups)}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # shared storage counted once
                    for t in group.tensors() if self._resident(t)}
        return sum(storages.values())

    def _observe(self) -> None:
        by_tag, seen = self.resident_bytes(), self.phase_bytes.setdefault(self.current, {})
        seen.update({tag: max(seen.get(tag, 0), nbytes) for tag, nbytes in by_tag.items()})
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else sum(by_tag.values())
        self.phase_peak[self.current] = max(self.phase_peak.get(self.current, 0), peak)

    def peak_bytes(self) -> int:
        """The peak since this manager exists, phases or not (CUDA's own counter is reset at each phase)."""
        if self.device.type == "cuda":
            return max(self.lifetime_peak, torch.cuda.max_memory_allocated(self.device))
        return max(self.phase_peak.values(), default=0)

    def plan(self) -> dict[str, dict[str, int]]:
        """phase -> tag -> bytes resident, from the policies and shapes alone (works on the meta device)."""
        return {phase: {g.tag: (g.full_bytes() if g.tag in tags or not g.releasable else 0) for g in self.groups}
                for phase, tags in PHASE_TAGS.items()}

    def report(self) -> str:
        """A short table: bytes per tag in each phase seen, and the mean time (GB/s) of its transitions."""
        phases = [p for p in PHASE_TAGS if p in self.phase_bytes]
        rows = [["tag", "policy", *phases, "sleep", "wake"]]
        for tag, policy in dict.fromkeys((g.tag, g.policy) for g in self.groups):
            row = [tag, policy] + [f"{self.phase_bytes[p].get(tag, 0) / 1e6:,.2f} MB" for p in phases]
            for action in ("sleep", "wake"):
                done = [t for t in self.transitions if t.tag == tag and t.action == action]
                seconds, nbytes = sum(t.seconds for t in done), sum(t.nbytes for t in done)
                copies = seconds and (policy == "offload" or (policy, action) == ("sync", "wake"))  # not discards
                rate = f" {nbytes / seconds / 1e9:.2f} GB/s" if copies else ""
                row.append(f"{seconds / len(done) * 1e3:.2f} ms{rate}" if done else "-")
            rows.append(row)
        peak = "max allocated" if self.device.type == "cuda" else "sum of tags"
        rows.append(["peak", peak, *[f"{self.phase_peak[p] / 1e6:,.2f} MB" for p in phases], "", ""])
        fmt = "{:<10} {:<14}" + " {:>12}" * len(phases) + " {:>22} {:>22}"
        title = f"memory phases on {self.device}: bytes resident per tag, mean time per transition"
        return "\n".join([title] + [fmt.format(*row) for row in rows])

    def activations(self, model: nn.Module):
        """The context for a training forward (backward may run outside it), per cfg.activation_*."""
        checkpoint_blocks(model, enabled=self.cfg.activation_checkpoint)
        return offload_activations(model, self.pin) if self.cfg.activation_offload else nullcontext()

# -----------------------------------------------------------------------------
# Activation memory for the training forward


@contextmanager
def offload_activations(model: nn.Module | None = None, pin_memory: bool = True) -> Iterator[None]:
    """Tensors autograd saves in the context go to the host (pinned on CUDA) and come back in backward, except
    `model`'s parameters and views of them (resident anyway). NOTE: this skips autograd's in-place check."""
    keep = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()

    def pack(t: Tensor):
        if t.untyped_storage().data_ptr() in keep:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin_memory and t.is_cuda)
        host.copy_(t, non_blocking=True)  # on the current stream: a reuse of t's block is ordered after it
        return t.device, host

    def unpack(packed) -> Tensor:
        return packed if isinstance(packed, Tensor) else packed[1].to(packed[0], non_blocking=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward  # the class's forward; this function shadows it on the instance only
    if not torch.is_grad_enabled():  # rollout and no-grad logprobs: nothing to save, nothing to recompute
        return forward(self, *args, **kwargs)
    # Non-reentrant: outputs may be used anywhere (a prompt's K/V reused by its completions). NOTE: the block
    # and its attention callable run again in backward: a callable's side effects (appends) would repeat.
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module, enabled: bool = True) -> int:
    """Make each transformer block (model.model.layers[i]) recompute its activations in backward by binding
    a checkpointed forward to the instance (model.py untouched; enabled=False undoes it). A bound method, not
    a closure, so copy.deepcopy(model) gives blocks that recompute themselves. Returns the number of blocks."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"model: expected transformer blocks at model.model.layers, got {type(model).__name__}")
    for block in layers:
        if enabled:
            block.forward = types.MethodType(_checkpointed_forward, block)
        else:
            block.__dict__.pop("forward", None)
    return len(layers)
