"""
The decode step as few launches: compiled by torch.compile into fused kernels, then captured in a
CUDA graph that replays all of them in one call.

- CompiledStep: torch.compile of a step, fullgraph (one graph or an error, never a silent split)
  and inductor's fusion: norms, RoPE, the cache writes, residual adds, SwiGLU's product and the
  attention merge become a few kernels around the matmuls and the attention kernels. Its
  batch-like dims (active rows, the grid's groups and slots, the prompt and completion lengths)
  are marked dynamic (`dynamic`), every other dim is the number it is (heads, head dim, width,
  vocabulary: inductor specialises on them), so one compile serves every layout of active rows
  and every batch a process meets: a layout is a new CUDA graph, not a new compile (a static
  compile per layout would compile again at every compaction and at every new longest prompt,
  and a compile takes seconds, several on a CPU with a warm cache, where a decode step takes
  milliseconds). What may compile again is a different structure:
  rows scattered into a grid with empty slots (Layout.slots), the longest prompt gone (its K/V
  views no longer whole), prompts with and without padding, a dim of size 1 (torch specializes
  0 and 1): tests/test_graphs.py meets four structures in one rollout. It counts its compiles and
  the seconds they took; torch's caches (FX graph, AOT) make a later process's compile cheaper.
  Where torch cannot compile (an unsupported platform, a torch older than MIN_TORCH:
  `unsupported`), the step runs eagerly and one line says so, once a process; where it refuses
  one structure of one compiled function (no C++ compiler or Triton, a lowering it lacks), that
  structure runs eagerly, one line each (REFUSED), and the rest compiles as before.
- GraphedStep: a CUDA graph of step(tokens) -> logits for one layout: warm up (the compile, if
  any, happens there) on a side stream, capture, replay.
rollout.py compiles the draw beside a compiled step (sampling.sample_raced: the logits' float32
copy, softmax, the race's reductions fused), outside the graph: the race's clocks come from the
rollout's torch.Generator, which a traced graph cannot hold, so they are wound eagerly before it.

Leaves out: what the step computes (decode.py), when a layout changes (rollout.py).
Tested by tests/test_graphs.py (the compiled step on the CPU, the CPU's fused attention kernel in
CUDA's place) and tests/test_graphs_cuda.py; kernels counted by tests/bench_rollout.py --kernels.
"""

import contextlib
import time
from typing import Callable

import torch
from torch import Tensor


def compile_settings() -> contextlib.ExitStack:
    """torch's settings while a step compiles (read when it traces): no equalities between sizes
    that happen to be equal then (torch's "duck shapes": the first layout's rows equal the cache's
    slots, its longest prompt the carved one: a later layout would fail those guards and compile
    again), and room for the structures of the module docstring (torch's limit, 8, would run the
    ninth eagerly for the rest of the process)."""
    from torch.fx.experimental import _config as shapes
    settings = contextlib.ExitStack()
    if hasattr(shapes, "use_duck_shape"):
        settings.enter_context(shapes.patch(use_duck_shape=False))
    settings.enter_context(torch._dynamo.config.patch(cache_size_limit=64))  # 2.5's name too
    return settings


# A compile costs tens of seconds once: 24 s for the default run's 2-block, width-64 model on an
# H200, whose whole step then takes 50 ms (tests/gpu_check.py). Fusing a step that small saves
# milliseconds: no run of a few thousand steps pays the compile back. "auto" compiles models of at
# least this many parameters in their blocks (SmolLM2-135M's 106 M and Qwen2.5-0.5B's 358 M do).
MIN_COMPILE_PARAMS = 50_000_000


def worth_compiling(model: torch.nn.Module) -> bool:
    """Whether "auto" compiles this model: its blocks' parameters reach MIN_COMPILE_PARAMS."""
    blocks = model.model.layers
    return sum(p.numel() for p in blocks.parameters()) >= MIN_COMPILE_PARAMS


def decide(setting: str, model: torch.nn.Module, device: str = "") -> bool:
    """A compile knob (--compile_blocks, --compile_decode): "true", "false", or "auto" (a CUDA
    model worth compiling). device: where the model will run (default: where it is; --plan's
    models are on the meta device)."""
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"a compile setting is auto, true or false, got {setting!r}")
    on_cuda = torch.device(device or next(model.parameters()).device).type == "cuda"
    return setting == "true" or (setting == "auto" and on_cuda and worth_compiling(model))


# The compiled paths (this decode step, compiling.py's block regions) need this torch or newer:
# torch 2.5 compiles the step again for every layout of active rows (it guards the sizes of the
# tensors the step reaches through the decoder) and the regions again for every layer, and 2.6
# compiles the regions again at a packed length that one of inductor's patterns guarded.
MIN_TORCH = (2, 7)


def unsupported() -> str:
    """Why the compiled paths do not run here ("" when they do): one line for the run's log."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        return (f"the compiled paths need torch {'.'.join(map(str, MIN_TORCH))} or newer, this is "
                f"{torch.__version__}")
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile is not supported on this Python or torch ({torch.__version__})"
    return ""


def dynamic(x: Tensor, *dims: int) -> Tensor:
    """x, its dims `dims` marked as varying for a CompiledStep (torch._dynamo.maybe_mark_dynamic):
    they compile as symbols, one graph for all their sizes; every other dim of every input compiles
    as the number it is (the model's heads, head dim, width, vocabulary: inductor specialises its
    kernels on them). A dim of size 0 or 1 is still specialised (torch's rule: another structure).
    A mark lives on the tensor object: a copy (GraphedStep's) has none."""
    torch._dynamo.maybe_mark_dynamic(x, list(dims))
    return x


def graphs_compiled() -> int:
    """Graphs torch.compile compiled so far in this process (dynamo's counter; a cache hit counts:
    the graph was traced again)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


# What torch.compile refused in this process, (the compiled function, the structure) -> why: that
# structure of that function runs eagerly from then on and is never tried again; every other
# function and structure still compiles.
REFUSED: dict[tuple[str, str], str] = {}
_SAID: set[str] = set()  # lines said once a process


def say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, flush=True)


class CompiledStep:
    """fn compiled once for all layouts (module docstring), called like fn. `compiles` and
    `seconds`: the graphs compiled during its calls and the wall clock of those calls.
    structure(*args) -> a few words naming what a compile of these arguments specialises on
    besides the sizes marked dynamic (decode.Decoder.structure); a structure torch refuses runs
    eagerly, said in one line (REFUSED), and the others compile on."""

    def __init__(self, fn: Callable, structure: Callable[..., str] | None = None):
        self.fn = fn
        self.name = fn.__qualname__
        self.structure = structure or (lambda *args: "every call")
        self.compiles = 0
        self.seconds = 0.0
        self.compiled = None
        why = unsupported()
        if why:  # a Python, platform or torch it does not support: nothing compiles here
            say_once(f"torch.compile does not run here ({why}): the decode step runs eagerly "
                     f"(--compile_decode false skips the attempt)")
            return
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def __call__(self, *args):
        if self.compiled is None:
            return self.fn(*args)
        key = (self.name, self.structure(*args))
        if key in REFUSED:
            return self.fn(*args)
        before = graphs_compiled()
        started = time.perf_counter()
        try:
            with compile_settings():
                out = self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as error:  # raised while compiling
            self._refuse(key, error)
            return self.fn(*args)
        if graphs_compiled() > before:
            self.compiles += graphs_compiled() - before
            self.seconds += time.perf_counter() - started
        return out

    def _refuse(self, key: tuple[str, str], error: Exception) -> None:
        inner = getattr(error, "inner_exception", error)  # the backend's own error
        first = (str(inner).strip().splitlines() or [""])[0][:200]
        REFUSED[key] = f"{type(inner).__name__}: {first}"
        print(f"torch.compile cannot compile {key[0]} for {key[1]} ({REFUSED[key]}): that runs "
              f"eagerly, the rest compiled as before (--compile_decode false skips every "
              f"attempt)", flush=True)


class GraphedStep:
    """A CUDA graph of `step(tokens) -> logits` for one layout: warm up on a side stream, capture,
    replay. Replaying a step that already ran is harmless: it rewrites the same K/V."""

    def __init__(self, step: Callable[[Tensor], Tensor], tokens: Tensor):
        self.tokens = tokens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(self.tokens)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(self.tokens)

    def __call__(self, tokens: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
