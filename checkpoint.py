"""
Checkpoints that a crash cannot corrupt and a resume continues from exactly.

A checkpoint is a directory `OUT/step-000123/` holding:
- the policy as a Hugging Face directory: config.json, model.safetensors (in the run's --dtype),
  tokenizer.json with the source's tokenizer_config.json, chat_template.jinja and
  special_tokens_map.json, and its generation_config.json (any HF tool, and `--model`, loads it);
- `master/` under bf16 mixed precision: the fp32 master weights, a Hugging Face directory of their
  own, from which a resume continues exactly;
- `optimizer-tp{r}.safetensors` + `optimizer-tp{r}.json`: the AdamW state of tensor-parallel rank
  r (tensors in safetensors, the rest in JSON: nothing is ever unpickled);
- `trainer_state.json`: step, every config section, the tp size, torch's RNG state.
It is written under `step-000123.tmp/` and renamed when complete (a rename is atomic), then
`OUT/latest` (a one-line file, also replaced atomically) points at it. The prompts and sampling
seeds of a step are a function of (seed, step), so weights + optimizer state + step are all a
resumed run needs. A sharded model is gathered and written as the same tensors a one-process model
writes (a tied lm_head once, as the embedding); loading checks every tensor's name and shape
(hf.py), and the optimizer state is loaded only if it covers every parameter with its shape.

The output directory holds one run: a new run into an --out that holds one is refused, unless it
is resumed or explicitly overwritten, and nothing of the old run is touched before the new one is
set up.

Leaves out: keeping only the last K checkpoints, asynchronous saving, sharded model files under TP.
"""

import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from hf import write_pretrained
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
                    master: dict[str, Tensor] | None = None) -> str:
    """Collective under torchrun (every rank calls it). `tensors`: the model's full tensors as a
    one-process model names them (train.py gathers a sharded model's: tp.full_state_dict), and
    `master` the fp32 master weights when they differ; rank 0 writes them. Returns the final
    directory."""
    final = os.path.join(out, f"step-{step:06d}")
    tmp = final + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crash mid-save leaves a .tmp, never half a step
        os.makedirs(tmp)
    _barrier()
    if rank == 0:
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
    names = ("metrics.jsonl", "latest")
    return sorted(n for n in os.listdir(out) if n in names or n.startswith("step-"))


def check_out_dir(out: str, resume: str, overwrite: bool) -> None:
    """Before anything is built: an --out that holds a run is resumed, or overwritten on request."""
    found = holds_a_run(out)
    if found and not resume and not overwrite:
        raise ValueError(f"--out {out} already holds a run ({', '.join(found[:4])}); continue it "
                         f"with --resume latest, start over with --overwrite true (deletes them), "
                         f"or choose another --out")


def start_out_dir(out: str, resume: str, overwrite: bool, start: int) -> str:
    """Once the new run is set up (rank 0 only): clear an overwritten run, and drop the metrics
    records a resume will recompute. Returns the metrics file."""
    metrics_file = os.path.join(out, "metrics.jsonl")
    os.makedirs(out, exist_ok=True)
    if overwrite and not resume:
        for name in holds_a_run(out):
            path = os.path.join(out, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    if os.path.exists(metrics_file):
        with open(metrics_file) as f:
            kept = [line for line in f if json.loads(line)["step"] <= start]
        with open(metrics_file + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(metrics_file + ".tmp", metrics_file)  # atomic, like the checkpoints
    return metrics_file
