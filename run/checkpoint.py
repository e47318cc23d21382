"""
Checkpoints that a crash cannot corrupt and a resume continues from exactly.

A checkpoint is a directory `OUT/step-000123/` holding:
- the policy as a Hugging Face directory: config.json, model.safetensors (in the run's --dtype),
  tokenizer.json with the source's tokenizer_config.json, chat_template.jinja and
  special_tokens_map.json, and its generation_config.json (any HF tool, and `--model`, loads it);
- `master/` under bf16 mixed precision: the fp32 master weights, a Hugging Face directory of their
  own, from which a resume continues exactly;
- with LoRA, instead of the model: the adapter as PEFT writes it (adapter_config.json,
  adapter_model.safetensors; lora.py), the base being --model's;
- `optimizer-tp{r}.safetensors` + `optimizer-tp{r}.json`: the AdamW state of tensor-parallel rank
  r (tensors in safetensors, the rest in JSON: nothing is ever unpickled);
- `trainer_state.json`: step, every config section, the tp size, torch's RNG state.
It is written under `step-000123.tmp/` and renamed when complete (a rename is atomic), then
`OUT/latest` (a one-line file, also replaced atomically) points at it. The prompts and sampling
seeds of a step are a function of (seed, step), so weights + optimizer state + step are all a
resumed run needs. A sharded model is gathered and written as the same tensors a one-process model
writes (a tied lm_head once, as the embedding); loading checks every tensor's name and shape
(engine/hf.py), and the optimizer state is loaded only if it covers every parameter with its shape.

The output directory holds one run: a new run into an --out that holds one is refused, unless it
is resumed or explicitly overwritten, and nothing of the old run is touched (nor anything written
but the lock) before the new run's first step has finished. One process writes there at a time:
OUT/.lock names its pid and host; a second run is refused, a crashed run's lock is taken over. A
resumed run keeps what the checkpoint fixes (the model's shape, the task, the group size).

Leaves out: keeping only the last K checkpoints, asynchronous saving, sharded model files under TP.
"""

import atexit
import json
import os
import shutil
import signal
import socket
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from engine.hf import write_pretrained
from model import ModelConfig

MASTER = "master"  # the fp32 master weights' subdirectory of a bf16 run's checkpoint

# -----------------------------------------------------------------------------
# Save


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()  # every rank: the directory exists / every rank has written its files


def _optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The optimizer's state_dict split into tensors (safetensors) and everything else (JSON)."""
    sd = optimizer.state_dict()
    tensors = {}
    plain = {"param_groups": sd["param_groups"], "state": {}}
    for index, state in sd["state"].items():
        plain["state"][str(index)] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                plain["state"][str(index)][key] = value
    return tensors, plain


def save_checkpoint(out: str, step: int, model_config: ModelConfig, tensors: dict[str, Tensor],
                    tokenizer, optimizer: torch.optim.Optimizer, config: dict, *, tp_rank: int = 0,
                    tp_size: int = 1, dp_rank: int = 0,
                    generation_config: dict | None = None,
                    master: dict[str, Tensor] | None = None,
                    adapter: Callable[[str, dict[str, Tensor]], None] | None = None) -> str:
    """Collective under torchrun (every rank calls it). `tensors`: the model's full tensors as a
    one-process model names them (train.py gathers a sharded model's: tp.full_state_dict), and
    `master` the fp32 master weights when they differ; rank 0 writes them. With `adapter`
    (LoRA: lora.save_adapter) rank 0 calls adapter(dir, tensors) instead: the adapter alone, as
    PEFT writes it, the base being --model's. Returns the final directory."""
    final = os.path.join(out, f"step-{step:06d}")
    tmp = final + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crash mid-save leaves a .tmp, never half a step
        os.makedirs(tmp)
    _barrier()
    if rank == 0:
        if adapter is not None:
            adapter(tmp, tensors)
        else:
            write_pretrained(tmp, model_config, tensors, generation_config=generation_config)
        tokenizer.save_pretrained(tmp)
        if master is not None:
            write_pretrained(os.path.join(tmp, MASTER), model_config, master)
        world = dist.get_world_size() if dist.is_initialized() else 1
        state = {"step": step, "config": config, "world_size": world, "tp_size": tp_size,
                 "torch_rng_state": torch.get_rng_state().tolist()}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f)
    if dp_rank == 0:  # dp replicas hold identical optimizer state: one copy per tp rank
        state_tensors, plain = _optimizer_to_files(optimizer)
        save_file(state_tensors, os.path.join(tmp, f"optimizer-tp{tp_rank}.safetensors"))
        with open(os.path.join(tmp, f"optimizer-tp{tp_rank}.json"), "w") as f:
            json.dump(plain, f)
    _barrier()
    if rank == 0:
        if os.path.exists(final):  # saving the same step again (e.g. Ctrl-C right after a save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(out, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final) + "\n")
        os.replace(os.path.join(out, "latest.tmp"), os.path.join(out, "latest"))
    _barrier()
    return final

# -----------------------------------------------------------------------------
# Load


def master_dir(path: str) -> str:
    """A checkpoint's fp32 master weights directory, or "" when it has none."""
    master = os.path.join(path, MASTER)
    return master if os.path.isfile(os.path.join(master, "config.json")) else ""


def resolve(resume: str, out: str) -> str:
    """--resume DIR, or --resume latest (the checkpoint OUT/latest names)."""
    if resume == "latest":
        pointer = os.path.join(out, "latest")
        if not os.path.isfile(pointer):
            raise FileNotFoundError(f"--resume latest: {pointer} not found (no checkpoint was "
                                    f"written to --out {out})")
        with open(pointer) as f:
            resume = os.path.join(out, f.read().strip())
    if not os.path.isdir(resume):
        raise FileNotFoundError(f"--resume {resume}: not a directory")
    return resume


def saved_config(resume: str, out: str) -> dict[str, dict]:
    """The configs a checkpoint was written with: {section: {field: value}}."""
    path = os.path.join(resolve(resume, out), "trainer_state.json")
    try:
        with open(path) as f:
            state = json.load(f)
        return {section: dict(values) for section, values in state["config"].items()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: corrupt or missing trainer state ({e!r}); pick another "
                         "checkpoint") from None


# What a checkpoint fixes: its weights' shape, the task and group size its optimizer state learned.
FIXED_ON_RESUME = ("model", "dim", "layers", "heads", "kv_heads", "task", "task_data",
                   "num_samples", "use_peft")


def resume_values(values: dict[str, object], owners: dict[str, str], out_default: str,
                  renamed: dict[str, str] | None = None) -> tuple[dict[str, object], list[str]]:
    """The checkpoint's flags with this command line's on top, and what changes ("lr 0.0001, was
    0.0005"). A flag the checkpoint fixes is refused when it differs: never half-applied. A field
    saved under its former name (renamed: {former: new}) is read as the new one."""
    saved = saved_config(str(values["resume"]), str(values.get("out", out_default)))
    renamed = renamed or {}
    flat = {renamed.get(name, name): value for section, fields in saved.items()
            for name, value in fields.items() if owners.get(renamed.get(name, name)) == section}
    changes = []
    for name, value in values.items():
        if name in ("resume", "overwrite") or name not in flat or flat[name] == value:
            continue
        if name in FIXED_ON_RESUME:
            raise ValueError(f"--{name} {value!r}: the checkpoint being resumed fixes it to "
                             f"{flat[name]!r}; leave --{name} out, or start a new run")
        changes.append(f"{name} {value}, was {flat[name]}")
    return {**flat, **values}, changes


def _optimizer_state(path: str, tp_rank: int) -> dict:
    """The state_dict saved by _optimizer_to_files, reassembled."""
    tensors = load_file(os.path.join(path, f"optimizer-tp{tp_rank}.safetensors"))
    with open(os.path.join(path, f"optimizer-tp{tp_rank}.json")) as f:
        plain = json.load(f)
    state = {int(index): dict(values) for index, values in plain["state"].items()}
    for key, t in tensors.items():
        index, _, name = key.partition(".")
        state.setdefault(int(index), {})[name] = t
    return {"param_groups": plain["param_groups"], "state": state}


def _check_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter has its state, each tensor the parameter's shape: torch's load_state_dict
    would leave a missing one to be re-initialised silently (its moments lost)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not saved["state"]:
        return  # saved before the first optimizer step: nothing to restore
    for index, p in enumerate(params):
        state = saved["state"].get(index)
        if state is None:
            raise ValueError(f"the optimizer state has no entry for parameter {index} of "
                             f"{len(params)}")
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() and value.shape != p.shape:
                raise ValueError(f"optimizer state {index}.{key} has shape {tuple(value.shape)}, "
                                 f"its parameter {tuple(p.shape)}")


def load_checkpoint(path: str, optimizer: torch.optim.Optimizer, tp_rank: int = 0,
                    tp_size: int = 1) -> int:
    """Load this tp rank's optimizer state in place and torch's RNG state; return the step. (The
    weights are the HF directory itself: train.py loads them like any --model.)"""
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        saved_tp = state.get("tp_size", tp_size)
        if saved_tp != tp_size:
            raise ValueError(f"it was written with --tp {saved_tp}: resume with the same --tp "
                             f"(each tp rank's optimizer state is its own shard)")
        saved = _optimizer_state(path, tp_rank)
        _check_optimizer_state(saved, optimizer)
        optimizer.load_state_dict(saved)
        torch.set_rng_state(torch.tensor(state["torch_rng_state"], dtype=torch.uint8))
        return int(state["step"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, SafetensorError) as e:
        raise ValueError(f"--resume {path}: corrupt or incomplete checkpoint ({e!r}); pick "
                         "another one") from None
    except ValueError as e:  # e.g. optimizer state that does not fit this model's parameters
        raise ValueError(f"--resume {path}: {e}") from None

# -----------------------------------------------------------------------------
# The output directory: never mix two runs, never lose one before the new one has started


def holds_a_run(out: str) -> list[str]:
    """The names in `out` that belong to a run (metrics, checkpoints, the latest pointer)."""
    if not os.path.isdir(out):
        return []
    names = ("metrics.jsonl", "samples.jsonl", "latest")
    return sorted(n for n in os.listdir(out) if n in names or n.startswith("step-"))


def check_out_dir(out: str, resume: str, overwrite: bool) -> None:
    """Before anything is built: an --out that holds a run is resumed, or overwritten on request."""
    found = holds_a_run(out)
    if found and not resume and not overwrite:
        raise ValueError(f"--out {out} already holds a run ({', '.join(found[:4])}); continue it "
                         f"with --resume latest, start over with --overwrite true (deletes them), "
                         f"or choose another --out")


_held: list[tuple[str, bool]] = []  # (lock file, whether this process made its --out)


def _lock_holder(path: str) -> tuple[int, str] | None:
    """The (pid, host) a lock file names; None when it is stale (that pid is gone on this host)."""
    for _ in range(40):  # O_EXCL made the file before its line is in: a run starting this instant
        try:
            with open(path) as f:
                pid, host = f.read().split()
            pid = int(pid)
            break
        except (OSError, ValueError):
            time.sleep(0.05)
    else:
        return 0, "an unknown host"  # unreadable for 2 s: not ours to judge
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return None
        except PermissionError:  # another user's process
            pass
    return pid, host


def lock_out_dir(out: str) -> None:
    """Collective under torchrun: rank 0 takes the lock, every rank raises its refusal (main
    prints it once, from rank 0)."""
    error = ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _take_lock(out)
        except ValueError as e:
            error = str(e)
    if dist.is_initialized():
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0)  # rank 0's verdict to every rank
        error = verdict[0]
    if error:
        raise ValueError(error)


def _take_lock(out: str) -> None:
    """One run per output directory: OUT/.lock ("pid host"), made with O_EXCL, so of two runs
    started at once one gets it. A lock whose process is gone on this host (a crash) is stale and
    taken over. Also finds a read-only --out before any work. Released by release_out_dir."""
    made = not os.path.isdir(out)
    path = os.path.join(out, ".lock")
    for _ in range(3):
        try:
            os.makedirs(out, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = _lock_holder(path)
            if holder is not None:
                raise ValueError(f"--out {out} is in use by the run of pid {holder[0]} on "
                                 f"{holder[1]} ({path}); wait for it, stop it, or choose another "
                                 "--out (delete the lock only if that run is gone)") from None
            os.remove(path)  # a crashed run's
            continue
        except OSError as e:
            raise ValueError(f"--out {out}: cannot write there ({e.strerror}); choose another "
                             "--out") from None
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
        if not _held:
            atexit.register(release_out_dir)
        _held.append((path, made))
        return
    raise ValueError(f"--out {out}: another run keeps taking {path}; choose another --out")


def release_out_dir() -> None:
    """Drop this process's locks; an --out it made and left empty (a refused start) goes too."""
    while _held:
        path, made = _held.pop()
        try:
            os.remove(path)
            if made:
                os.rmdir(os.path.dirname(path))  # fails, as it should, unless it is empty
        except OSError:
            pass


def start_out_dir(out: str, resume: str, overwrite: bool, start: int) -> None:
    """After the new run's first step (rank 0 only): clear an overwritten run, and drop the
    metrics and samples records a resume will recompute."""
    os.makedirs(out, exist_ok=True)
    if overwrite and not resume:
        for name in holds_a_run(out):
            path = os.path.join(out, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(out, name)
        if os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= start]
            with open(path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(path + ".tmp", path)  # atomic, like the checkpoints


class Metrics:
    """OUT/metrics.jsonl (rank 0), one JSON record per step, and OUT/samples.jsonl, one per
    evaluated prompt. The first append, once the new run's first step has finished, makes --out
    the new run's (start_out_dir)."""

    def __init__(self, out: str, resume: str, overwrite: bool, start: int):
        self.args = (out, resume, overwrite, start)
        self.started = False

    def write(self, name: str, records: list[dict]) -> None:
        if not self.started:
            start_out_dir(*self.args)
            self.started = True
        with open(os.path.join(self.args[0], name), "a") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in records)

    def append(self, record: dict) -> None:
        self.write("metrics.jsonl", [record])

    def samples(self, step: int, samples: list[dict]) -> None:
        """The evaluation's completions after `step` (step, prompt, completion, reference, ...)."""
        if samples:
            self.write("samples.jsonl", [dict(step=step, **s) for s in samples])

# -----------------------------------------------------------------------------
# Stop signals: an interrupt loses nothing


class StopSignals:
    """Ctrl-C (SIGINT) or preemption (SIGTERM from torchrun, Slurm, Kubernetes), while installed:
    the first is noted (the loop finishes its step, checkpoints, exits 0); a second exits at once,
    without a checkpoint (e.g. a reward function that never returns). A context manager: the
    previous handlers come back on exit."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.seen: list[int] = []

    def __enter__(self):
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self.previous:
            signal.signal(s, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum: int, frame) -> None:
        if self.seen:
            release_out_dir()
            print("second stop signal: exiting now, without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.seen.append(signum)
        if self.rank == 0:
            print(f"{signal.Signals(signum).name}: the step finishes, then a checkpoint is "
                  "written (send it again to exit at once, without one)", file=sys.stderr,
                  flush=True)
