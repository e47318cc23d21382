"""
Phases: what lives on the device while rolling out, computing reference logprobs, or training.

Rollout and training share one device: in rollout the optimizer state, grads and reference model
are dead weight, in training the KV cache and a separate sampler copy. Engines solved this with
sleep/wake (vLLM's sleep levels, SGLang's release/resume of memory, verl's offload flags). Here
memory has tags, each with a rule: one class per rule below, holding its sleep, wake and bytes.

    tag        rule      outside the phase that needs it                       awake in
    trainer    keep      stays: the trainer's weights                          every phase
    sampler    release   the sampler copy (unless it is the trainer) is freed  rollout
    kv_cache   release   freed                                                 rollout
    reference  offload   copied into one reused (pinned) host buffer           reference
    optimizer  offload   copied into one reused (pinned) host buffer           train
               guard     on a CPU (the host is the device): stays, guarded     (as offload)
    grads      discard   set to None; the next backward re-creates them        train
    scratch    discard   cleared; the owner re-creates them (tp's MemoryBuffer) train

Entering a phase sleeps what it does not need BEFORE waking what it needs, in stages (the
sampler's weights, then the KV cache): the peak never holds two phases' memory. Leaving a phase
sleeps what it woke. Parameters, buffers and optimizer state stay the same Python objects (`.data`
is swapped; addresses change, so re-capture CUDA graphs).

Any use of released memory raises one RuntimeError naming the tag and the phase (its class
becomes ReleasedTensor / ReleasedParameter, whose __torch_function__ refuses all but metadata,
until wake; awake tensors pay nothing). A woken tensor holds NaN until its owner fills it
(rollout.sync_weights; generate() zeroes the KV it uses). Offloaded memory stays readable on the
host (optimizer.state_dict() for a checkpoint); a forward or step on it raises until wake. On a
CPU an offload would copy into the memory it leaves: the tensors stay (rule "guard": no copy,
resident in every phase) and only the guard comes and goes.

Also, for the training forward: activation offloading, per-block checkpointing, an embedding
whose backward adds its rows into weight.grad. No shapes: tensors move whole.
Leaves out: offloading the trainer's own weights, disk offload, copy streams overlapping compute.
Tested by tests/test_memory.py and tests/test_memory_cuda.py; measured by tests/bench_memory.py.
"""

import ctypes
import functools
import time
from collections import namedtuple
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------
# Config and the phase table


@dataclass
class MemoryConfig:
    offload_optimizer: bool = True   # AdamW state is 2x the fp32 weights, idle during rollout
    offload_reference: bool = True   # the reference model runs one no-grad forward per step
    release_kv: bool = True          # the KV cache is dead outside rollout
    release_grads: bool = True       # grads are dead between optimizer.step and the next backward
    release_sampler: bool = True     # a separate sampler copy is re-synced every rollout anyway
    release_scratch: bool = True     # tp's gathered-activation buffers are dead outside training
    pin_memory: bool = True          # CUDA only: pinned host buffers: async copies, ~2x faster
    activation_offload: bool = False  # saved activations to the host in the train forward
    activation_checkpoint: bool = False  # recompute each block in backward (checkpoint_blocks)
    memory_budget: float = 0.0       # GB per rank the micro-batch fits; 0 off; unset on a GPU: 80%


# Tags each phase needs awake, in wake order (staged: the sampler's weights before the KV cache).
PHASE_TAGS = {"rollout": ("sampler", "kv_cache"), "reference": ("reference",),
              "train": ("optimizer", "grads", "scratch")}
# One sleep or wake of one holder: bytes freed or copied; seconds include a device synchronisation.
Transition = namedtuple("Transition", "phase tag action nbytes seconds")


def _nbytes(tensors: Iterable[Tensor]) -> int:  # from shapes alone: works on the meta device
    return sum(t.numel() * t.element_size() for t in tensors)


try:  # glibc's (Linux); elsewhere there is nothing to call
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
except (AttributeError, OSError):
    _MALLOC_TRIM = None


def return_freed_memory(device: torch.device) -> None:
    """Give what was freed back to the device, not to this process's cache of it. CUDA: PyTorch's
    caching allocator keeps freed blocks reserved, so a sleep would free nothing another process
    (or mem_get_info) could see. CPU: glibc keeps what a process frees, resident under the next
    phase (a rollout after training: 370 MiB of RSS over the baseline, 167 MiB with this) or under
    backward's large blocks, mapped apart (train.py calls it before each backward: 3.06 -> 2.93 GB
    on SmolLM2's 8 x 8 run); a no-op without glibc. Allocated bytes do not change."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "cpu" and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)

# -----------------------------------------------------------------------------
# Released tensors: the same Python object, no memory, and any use raises

# What may be read off a released tensor: metadata, never memory. __hash__ too: modules and
# optimizers keep parameters in sets and dicts.
_METADATA = {Tensor.shape.__get__, Tensor.dtype.__get__, Tensor.device.__get__,
             Tensor.ndim.__get__, Tensor.requires_grad.__get__, Tensor.is_leaf.__get__,
             Tensor.grad.__get__, Tensor.size, Tensor.dim, Tensor.numel, Tensor.element_size,
             Tensor.is_floating_point, Tensor.requires_grad_, Tensor.__hash__}


def _refuse(cls, func, types, args=(), kwargs=None):
    """__torch_function__ of a released tensor: every torch function, Tensor method or property
    given a released tensor comes here (sum, indexing, .data, .numpy(), F.linear, torch.cat...)."""
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    released = next(_released_in((args, kwargs)), None)
    if released is None:  # torch found it somewhere this search does not look: say so anyway
        raise RuntimeError(f"{func} was given a released tensor (memory.py): wake its phase first")
    name = getattr(func, "__name__", str(func))
    if name == "__get__":  # a property: name it (`.data`), not its getter
        name = f".{func.__self__.__name__}"
    raise RuntimeError(released.released_by.asleep_message(
        f"{name}() on {released!r}", released.released_tag, "released"))


def _released_in(obj) -> Iterator[Tensor]:
    if _is_released(obj):
        yield obj
    elif isinstance(obj, (list, tuple, dict)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _released_in(item)


def _is_released(t) -> bool:
    return isinstance(t, (ReleasedTensor, ReleasedParameter))


def _repr(self, spec: str = "") -> str:  # repr(), print(), f"{t}": no memory read
    return f"<released {self.released_tag} tensor {tuple(self.shape)} {self.dtype}>"


class ReleasedTensor(Tensor):
    """A released plain tensor (the KV cache). Released.sleep sets `released_tag`, `released_by`
    (its PhaseManager) and `released_from` (the class it goes back to)."""
    __torch_function__ = classmethod(_refuse)
    __repr__ = __format__ = _repr


class ReleasedParameter(nn.Parameter):
    """A released nn.Parameter (the sampler copy): still a Parameter to its module."""
    __torch_function__ = classmethod(_refuse)
    __repr__ = __format__ = _repr


def _poison(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    fill = float("nan") if dtype.is_floating_point else 0
    return torch.full(shape, fill, dtype=dtype, device=device)

# -----------------------------------------------------------------------------
# Policies: one class each, with what it holds now and awake, its sleep and its wake.
# sleep() and wake() return how many tensors they moved (0: no transition is recorded).


class Resident:
    """Never released: the trainer's weights ("keep"), or a sampler that is the trainer ("shared":
    no tensors of its own, counted once under the trainer)."""

    def __init__(self, tag: str, tensors: list[Tensor], rule: str = "keep"):
        self.tag, self.held, self.rule, self.releasable = tag, tensors, rule, False

    def resident(self) -> list[Tensor]:
        return self.held

    def full_bytes(self) -> int:
        return _nbytes(self.held)


class Released:
    """Freed outside its phase; re-allocated at wake holding NaN until its owner fills it (the
    sampler copy: rollout.sync_weights; the KV cache: KVCache.carve zeroes what generate uses)."""
    rule = "release"

    def __init__(self, tag: str, tensors: list[Tensor], releasable: bool):
        self.tag, self.held, self.releasable = tag, tensors, releasable

    def resident(self) -> list[Tensor]:
        return [t for t in self.held if not _is_released(t)]

    def full_bytes(self) -> int:  # a released tensor keeps its shape and dtype
        return _nbytes(self.held)

    def sleep(self, manager: "PhaseManager") -> int:
        awake = self.resident()
        for t in awake:
            # A one-element stand-in expanded to the shape: the metadata stays (plan(), KVCache.
            # nbytes), and a view taken earlier keeps the old storage alive: it never dangles.
            t.data = _poison((), t.dtype, t.device).expand(t.shape)
            t.released_tag, t.released_by, t.released_from = self.tag, manager, type(t)
            t.__class__ = ReleasedParameter if isinstance(t, nn.Parameter) else ReleasedTensor
        return len(awake)

    def wake(self) -> int:
        asleep = [t for t in self.held if _is_released(t)]
        for t in asleep:  # staged: one tensor at a time
            t.__class__ = t.released_from
            del t.released_tag, t.released_by, t.released_from  # exactly what it was before
            # NaN, not the allocator's old contents: a caller who forgets to sync the sampler gets
            # NaN logits, not silently stale weights.
            t.data = _poison(t.shape, t.dtype, t.device)
        return len(asleep)


class Discarded:
    """Dropped outside its phase, re-created by the owner on next use: grads (`params`' .grad, by
    the next backward) or a dict of scratch tensors (tp.py's MemoryBuffer.tensors). A sleep drops
    whatever is there, however it got there (a backward outside the train phase makes grads)."""
    rule = "discard"

    def __init__(self, tag: str, releasable: bool, params: list[Tensor] = (),
                 scratch: dict | None = None):
        self.tag, self.releasable, self.params = tag, releasable, params
        self.scratch = scratch if scratch is not None else {}

    def resident(self) -> list[Tensor]:
        return [p.grad for p in self.params if p.grad is not None] + list(self.scratch.values())

    def full_bytes(self) -> int:  # a grad per parameter; scratch: what it holds now
        return _nbytes(self.params) + _nbytes(self.scratch.values())

    def sleep(self, manager: "PhaseManager") -> int:
        dropped = len(self.resident())
        for p in self.params:
            p.grad = None
        self.scratch.clear()
        return dropped

    def wake(self) -> int:  # nothing to do: the owner re-creates them
        return 0


class Offloaded:
    """Copied into one host buffer outside its phase (allocated once, reused; pinned on CUDA) and
    back: an optimizer's state on the device (looked up at each sleep: AdamW creates it at its
    first step) or a reference model's parameters. Readable on the host while asleep; the module's
    forward and the optimizer's step raise until wake. On a CPU (in_place) nothing is copied: the
    host is the device, a copy would hold the same bytes twice; only the guard sleeps and wakes."""

    def __init__(self, tag: str, releasable: bool, device: torch.device, pin: bool,
                 module: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
        self.tag, self.releasable, self.device, self.pin = tag, releasable, device, pin
        self.in_place = device.type == "cpu"
        self.module, self.optimizer = module, optimizer
        self.params = list(module.parameters()) if module is not None else []
        self.host: Tensor | None = None  # flat uint8
        self.host_allocations = 0
        self.hooks: list = []  # the guard's handles, present while asleep

    @property
    def rule(self) -> str:
        return "guard" if self.in_place else "offload"

    def tensors(self) -> list[Tensor]:
        if self.optimizer is None:
            return self.params
        return [v for state in self.optimizer.state.values() for v in state.values()
                if isinstance(v, Tensor)]

    def _on_host(self, t: Tensor) -> bool:
        host = self.host.untyped_storage().data_ptr() if self.host is not None else None
        return t.untyped_storage().data_ptr() == host

    def resident(self) -> list[Tensor]:  # AdamW's CPU `step` next to GPU params is not ours
        return [t for t in self.tensors() if t.device == self.device and not self._on_host(t)]

    def full_bytes(self) -> int:
        """Before the first step (or on the meta device, planning) Adam and AdamW hold no state
        yet: they will hold two moments per parameter in its dtype (exp_avg, exp_avg_sq; the
        scalar `step` tensors are left out). Other optimizers: 0, unknown until they step."""
        if self.optimizer is None or self.optimizer.state:
            return _nbytes(self.tensors())
        if not isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            return 0
        return 2 * _nbytes([p for g in self.optimizer.param_groups for p in g["params"]])

    @torch.no_grad()  # moving a Parameter's bytes is not an operation to differentiate
    def sleep(self, manager: "PhaseManager") -> int:
        if self.resident() and any(self._on_host(t) for t in self.tensors()):
            self.wake()  # made on the device while asleep: all back, then one host layout for all
        if not self.hooks:
            self._guard(manager)
        if self.in_place:  # guarded where they are: nothing moved, no transition recorded
            return 0
        tensors = self.resident()
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // 64) * 64)  # 64-byte aligned: any dtype views it
        if offsets[-1] and (self.host is None or self.host.numel() < offsets[-1]):
            # Once, or again only if the state grew: pinning (cudaHostAlloc) is slow.
            self.host = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=self.pin)
            self.host_allocations += 1
        views = [self.host[o:o + n].view(t.dtype).view(t.shape)
                 for t, o, n in zip(tensors, offsets, sizes)]
        for t, view in zip(tensors, views):
            view.copy_(t, non_blocking=True)
        if self.device.type == "cuda":  # NOTE: copies must finish before a device block is freed
            torch.cuda.synchronize(self.device)
        for t, view in zip(tensors, views):
            t.data = view  # the same Python object (optimizer state, Parameter), now on the host
        return len(tensors)

    @torch.no_grad()
    def wake(self) -> int:
        while self.hooks:
            self.hooks.pop().remove()
        offloaded = [t for t in self.tensors() if self._on_host(t)]
        for t in offloaded:  # the host buffer outlives the async copies: it is kept for reuse
            device = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            t.data = device.copy_(t, non_blocking=True)
        return len(offloaded)

    def _guard(self, manager: "PhaseManager") -> None:
        """A forward pre-hook on every parameter owner (callers may skip the top module's forward,
        as rollout does with Llama.head) and a step pre-hook on the optimizer; removed at wake."""
        how = "asleep (in place: on a CPU)" if self.in_place else "offloaded to the host"
        owners = self.module.named_modules() if self.module is not None else []
        for name, owner in owners:
            if next(owner.parameters(recurse=False), None) is not None:
                what = f"{self.tag} module '{name or type(owner).__name__}'"
                hook = functools.partial(_raise_offloaded, manager, what, self.tag, how)
                self.hooks.append(owner.register_forward_pre_hook(hook))
        if self.optimizer is not None:
            what = f"{type(self.optimizer).__name__}.step(): the optimizer state"
            hook = functools.partial(_raise_offloaded, manager, what, self.tag, how)
            self.hooks.append(self.optimizer.register_step_pre_hook(hook))


def _raise_offloaded(manager: "PhaseManager", what: str, tag: str, how: str, *hook_args) -> None:
    raise RuntimeError(manager.asleep_message(what, tag, how))

# -----------------------------------------------------------------------------
# The phase manager


class PhaseManager:
    """Tagged memory moved between phases: `with mgr.phase("rollout"): ...` (or enter, exit)."""

    def __init__(self, device: str | torch.device, cfg: MemoryConfig | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cfg = cfg or MemoryConfig()
        self.pin = self.cfg.pin_memory and self.device.type == "cuda"
        self.holders: list = []  # a Resident, Released, Discarded or Offloaded per tag
        self.current: str | None = None
        self.transitions: list[Transition] = []
        self.phase_bytes: dict[str, dict[str, int]] = {}  # phase -> tag -> max bytes resident
        self.phase_peak: dict[str, int] = {}  # phase -> max allocated (CUDA), sum of tags (CPU)
        self.lifetime_peak = 0                # CUDA's max allocated before its last reset

    def _check_module(self, module: nn.Module, arg: str) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{arg} must be an nn.Module, got {type(module).__name__}")
        taken = {t.untyped_storage().data_ptr(): g.tag for g in self.holders
                 if not isinstance(g, Discarded) for t in g.resident()}
        taken.pop(0, None)  # meta (planning) and empty tensors have no storage to share
        for name, p in module.named_parameters():
            if (tag := taken.get(p.untyped_storage().data_ptr())) is not None:
                raise ValueError(f"{arg}: parameter '{name}' is already registered "
                                 f"under tag '{tag}'")

    def add_weights(self, trainer_model: nn.Module, sampler_model: nn.Module) -> None:
        """The trainer's parameters (always resident) and the sampler's: the trainer itself, or a
        copy (e.g. bf16 for an fp32 trainer) released outside rollout and NaN after each wake:
        call rollout.sync_weights(sampler_model, trainer_model) before sampling."""
        self._check_module(trainer_model, "trainer_model")
        self.holders.append(Resident("trainer", list(trainer_model.parameters())))
        if sampler_model is trainer_model:
            self.holders.append(Resident("sampler", [], rule="shared"))
            return
        self._check_module(sampler_model, "sampler_model")
        params = list(sampler_model.parameters())
        self.holders.append(Released("sampler", params, self.cfg.release_sampler))

    def add_kv_cache(self, buffer: Tensor) -> None:
        """rollout.py's KVCache.buffer: released outside rollout, the same Tensor throughout."""
        if not isinstance(buffer, Tensor):
            raise TypeError(f"buffer must be a Tensor (rollout's KVCache.buffer), "
                            f"got {type(buffer).__name__}")
        if buffer.device != self.device:
            raise ValueError(f"buffer is on {buffer.device}, the manager's device is {self.device}")
        if buffer.storage_offset() or buffer.untyped_storage().nbytes() != _nbytes([buffer]):
            raise ValueError("buffer must own its whole storage: a view's release frees nothing")
        self.holders.append(Released("kv_cache", [buffer], self.cfg.release_kv))

    def add_grads(self, model: nn.Module) -> None:
        """The .grad of every trainable parameter: set to None outside the train phase."""
        params = [p for p in model.parameters() if p.requires_grad]
        self.holders.append(Discarded("grads", self.cfg.release_grads, params=params))

    def add_scratch(self, tensors: dict) -> None:
        """A dict of scratch tensors that its owner re-creates on demand (tp.py's MemoryBuffer
        .tensors: gathered activations under sequence parallelism): cleared outside train."""
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict of scratch tensors (e.g. tp's MemoryBuffer"
                            f".tensors), got {type(tensors).__name__}")
        self.holders.append(Discarded("scratch", self.cfg.release_scratch, scratch=tensors))

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Its state tensors on the device, offloaded outside the train phase."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        self.holders.append(Offloaded("optimizer", self.cfg.offload_optimizer, self.device,
                                     self.pin, optimizer=optimizer))

    def add_reference(self, module: nn.Module) -> None:
        """A frozen model (its parameters; buffers stay) offloaded outside the reference phase."""
        self._check_module(module, "module")
        self.holders.append(Offloaded("reference", self.cfg.offload_reference, self.device,
                                     self.pin, module=module))

    # -------------------------------------------------------------------------
    # Phases

    def enter(self, phase: str) -> None:
        if phase not in PHASE_TAGS:
            raise ValueError(f"phase must be one of {list(PHASE_TAGS)}, got {phase!r}")
        if self.current is not None:
            raise RuntimeError(f"cannot enter phase '{phase}': phase '{self.current}' "
                               f"has not been exited")
        if self.device.type == "meta":
            raise RuntimeError("a PhaseManager on the meta device can only plan(), not move memory")
        if self.device.type == "cuda":  # NOTE: the peak counter is process-wide: fold it in first
            peak = torch.cuda.max_memory_allocated(self.device)
            self.lifetime_peak = max(self.lifetime_peak, peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.current = phase
        # Sleep what this phase does not need BEFORE waking what it needs: the peak never has both.
        for holder in self.holders:
            if holder.tag not in PHASE_TAGS[phase]:
                self._move(holder, "sleep")
        if self.device.type == "cuda":  # what slept goes back to the device before any wake
            return_freed_memory(self.device)
        for tag in PHASE_TAGS[phase]:  # in the table's order: a staged wake
            for holder in [g for g in self.holders if g.tag == tag]:
                self._move(holder, "wake")
        self._observe()

    def exit(self) -> None:
        """Sleep what the phase woke: between phases only the trainer's weights stay."""
        if self.current is None:
            raise RuntimeError("exit() outside a phase: call enter(phase) first")
        self._observe()
        for holder in [g for g in self.holders if g.tag in PHASE_TAGS[self.current]]:
            self._move(holder, "sleep")
        self.current = None
        return_freed_memory(self.device)  # released means returned

    @contextmanager
    def phase(self, phase: str) -> Iterator["PhaseManager"]:
        self.enter(phase)
        try:
            yield self
        finally:
            self.exit()

    def _move(self, holder, action: str) -> None:
        """holder.sleep(self) or holder.wake(), timed, and recorded if it moved anything."""
        if not holder.releasable:
            return
        start = time.perf_counter()
        before = self.resident_bytes(holder)
        moved = holder.sleep(self) if action == "sleep" else holder.wake()
        if self.device.type == "cuda":  # honest timing: the copies are asynchronous
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        nbytes = before if action == "sleep" else self.resident_bytes(holder)
        if moved:
            self.transitions.append(Transition(self.current, holder.tag, action, nbytes, seconds))

    def asleep_message(self, what: str, tag: str, how: str) -> str:
        """The line any use of asleep memory raises: what, which tag, which phase, what to do."""
        now = f"phase '{self.current}'" if self.current else "no phase"
        needed = next(phase for phase, tags in PHASE_TAGS.items() if tag in tags)
        return (f"{what}: its {tag} memory is {how} in {now}; use it inside "
                f"`with mgr.phase('{needed}')` (mgr: its PhaseManager)")

    # -------------------------------------------------------------------------
    # Accounting

    def resident_bytes(self, holder=None) -> int | dict[str, int]:
        """Bytes on the device of one holder, or of every tag (a dict) when no holder is given."""
        if holder is None:
            return {tag: sum(self.resident_bytes(g) for g in self.holders if g.tag == tag)
                    for tag in dict.fromkeys(g.tag for g in self.holders)}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # shared: once
                    for t in holder.resident() if t.device == self.device}
        return sum(storages.values())

    def _observe(self) -> None:
        by_tag = self.resident_bytes()
        seen = self.phase_bytes.setdefault(self.current, {})
        seen.update({tag: max(seen.get(tag, 0), nbytes) for tag, nbytes in by_tag.items()})
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = sum(by_tag.values())
        self.phase_peak[self.current] = max(self.phase_peak.get(self.current, 0), peak)

    def peak_bytes(self) -> int:
        """The peak since this manager exists, phases or not (CUDA's counter is reset per phase)."""
        if self.device.type == "cuda":
            return max(self.lifetime_peak, torch.cuda.max_memory_allocated(self.device))
        return max(self.phase_peak.values(), default=0)

    def plan(self, target: str | torch.device | None = None) -> dict[str, dict[str, int]]:
        """phase -> tag -> bytes resident, from the policies and shapes alone (works on meta), on
        `target` (default: this manager's device): on a CPU an offloaded tag stays in place."""
        cpu = None if target is None else torch.device(target).type == "cpu"

        def awake(g, tags) -> bool:
            stays = isinstance(g, Offloaded) and (g.in_place if cpu is None else cpu)
            return g.tag in tags or not g.releasable or stays
        return {phase: {g.tag: g.full_bytes() if awake(g, tags) else 0 for g in self.holders}
                for phase, tags in PHASE_TAGS.items()}

    def report(self) -> str:
        """A short table: bytes per tag in each phase seen, mean time (GB/s) of its transitions."""
        phases = [p for p in PHASE_TAGS if p in self.phase_bytes]
        rows = [["tag", "rule", *phases, "sleep", "wake"]]
        for tag, rule in dict.fromkeys((g.tag, g.rule) for g in self.holders):
            row = [tag, rule]
            row += [f"{self.phase_bytes[p].get(tag, 0) / 1e6:,.2f} MB" for p in phases]
            for action in ("sleep", "wake"):
                done = [t for t in self.transitions if t.tag == tag and t.action == action]
                seconds = sum(t.seconds for t in done)
                nbytes = sum(t.nbytes for t in done)
                copies = seconds and rule == "offload"  # others free or allocate: no GB/s
                rate = f" {nbytes / seconds / 1e9:.2f} GB/s" if copies else ""
                row.append(f"{seconds / len(done) * 1e3:.2f} ms{rate}" if done else "-")
            rows.append(row)
        peak = "max allocated" if self.device.type == "cuda" else "sum of tags"
        rows.append(["peak", peak, *[f"{self.phase_peak[p] / 1e6:,.2f} MB" for p in phases]])
        rows[-1] += ["", ""]
        fmt = "{:<10} {:<14}" + " {:>12}" * len(phases) + " {:>22} {:>22}"
        title = f"memory phases on {self.device}: bytes resident per tag, mean time per transition"
        return "\n".join([title] + [fmt.format(*row) for row in rows])

    def activations(self, model: nn.Module):
        """The context for a training forward (backward may run outside it): activation_offload."""
        if self.cfg.activation_offload:
            return offload_activations(model, self.pin)
        return nullcontext()

# -----------------------------------------------------------------------------
# Activation memory for the training forward


@contextmanager
def offload_activations(model: nn.Module | None = None, pin_memory: bool = True) -> Iterator[None]:
    """Tensors autograd saves in the context go to the host (pinned on CUDA) and come back in
    backward, except `model`'s parameters and views of them (resident anyway).
    NOTE: this skips autograd's in-place check."""
    keep = set()
    if model is not None:
        keep = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: Tensor):
        if t.untyped_storage().data_ptr() in keep:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin_memory and t.is_cuda)
        host.copy_(t, non_blocking=True)  # on the current stream: a reuse of t's block waits
        return t.device, host

    def unpack(packed) -> Tensor:
        return packed if isinstance(packed, Tensor) else packed[1].to(packed[0], non_blocking=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class Checkpointed:
    """Put in front of a module's class by checkpoint_blocks: its forward recomputes in backward."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # rollout, no-grad logprobs: nothing to save or recompute
            return super().forward(*args, **kwargs)
        # Non-reentrant: outputs may be used anywhere (a prompt's K/V reused by its completions).
        # NOTE: the block and its attention callable run again in backward: a callable's side
        # effects (appends) happen twice.
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


class RowsIntoGrad(torch.autograd.Function):
    """F.embedding whose backward adds each row's gradient into weight.grad (index_add_): autograd
    builds a dense (V, C) one per lookup (113 MB at V = 49,152; twice with the shared prompt) at the
    end of backward. NOTE: the weight's gradient comes from backward() only, not autograd.grad."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return nn.functional.embedding(ids, weight)  # (..., C)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,), weight = ctx.saved_tensors, ctx.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids.reshape(-1), grad.reshape(ids.numel(), -1).to(weight.dtype))
        return None, None


class GradIntoWeightEmbedding(nn.Embedding):
    def forward(self, ids: Tensor) -> Tensor:  # rollout and no-grad logprobs: the plain lookup
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return RowsIntoGrad.apply(ids, self.weight)
        return super().forward(ids)


def grads_into_weight(e: nn.Module) -> bool:
    """A plain nn.Embedding becomes a GradIntoWeightEmbedding (names and state dict unchanged); one
    with padding_idx, max_norm or sparse grads, or another class (tp.py's), is left as it is."""
    if type(e) is not nn.Embedding or e.padding_idx is not None or e.max_norm is not None \
            or e.sparse or e.scale_grad_by_freq:
        return False
    e.__class__ = GradIntoWeightEmbedding
    return True


@functools.cache  # one class per module class: Block, or any class tp.py swapped in
def checkpointed_class(cls: type) -> type:
    return type(f"Checkpointed{cls.__name__}", (Checkpointed, cls), {})


def checkpoint_blocks(blocks: Iterable[nn.Module], enabled: bool = True) -> int:
    """Make each module (e.g. model.model.layers) recompute its activations in backward: its class
    becomes a checkpointed subclass (tp.py swaps classes the same way; parameter names and state
    dict unchanged, copy.deepcopy keeps it). enabled=False swaps back. Returns how many modules."""
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"blocks must be an iterable of modules (e.g. model.model.layers), "
                        f"got {type(blocks).__name__}")
    blocks = list(blocks)
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise TypeError(f"blocks must be nn.Modules (e.g. model.model.layers), "
                            f"got {type(block).__name__}")
        plain = type(block).__bases__[1] if isinstance(block, Checkpointed) else type(block)
        block.__class__ = checkpointed_class(plain) if enabled else plain
    return len(blocks)
