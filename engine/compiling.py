"""
Compiling, in one home: whether a model's forward compiles (`decide`), the training forward's
regional compile, and the decode step compiled and captured in CUDA graphs.

Part 1, the decode step as few launches (rollout.py, engine/decode.py): compiled by torch.compile
into fused kernels, then captured in a CUDA graph that replays all of them in one call.

- CompiledStep: torch.compile of a step, fullgraph (one graph or an error, never a silent split)
  and inductor's fusion: norms, RoPE, the cache writes, residual adds, SwiGLU's product and the
  attention merge become a few kernels around the matmuls and the attention kernels. Its
  batch-like dims (active rows, the grid's groups and slots, the prompt and completion lengths)
  are marked dynamic (`dynamic`), every other dim is the number it is (heads, head dim, width,
  vocabulary: inductor specialises on them), so one compile serves every grid of active rows
  and every batch a process meets: a grid is a new CUDA graph, not a new compile (a static
  compile per grid would compile again at every compaction and at every new longest prompt,
  and a compile takes seconds, several on a CPU with a warm cache, where a decode step takes
  milliseconds). What may compile again is a different structure:
  rows scattered into a grid with empty slots (Grid.scatter), the longest prompt gone (its K/V
  views no longer whole), prompts with and without padding, a dim of size 1 (torch specializes
  0 and 1): tests/test_graphs.py meets four structures in one rollout. What a rollout compiled
  is dynamo's count (graphs_compiled, compile_seconds); torch's caches (FX graph, AOT) make a
  later process's compile cheaper.
  Where torch cannot compile (an unsupported platform, a torch older than MIN_TORCH:
  `unsupported`), the step runs eagerly and one line says so, once a process; where it refuses
  one structure of one compiled function (no C++ compiler or Triton, a lowering it lacks), that
  structure runs eagerly, one line each (REFUSED), and the rest compiles as before.
- GraphedStep: a CUDA graph of step(inputs) -> logits for one bucket of rows: warm up (the
  compile, if any, happens there) on a side stream, capture, replay.
rollout.py compiles the draw beside a compiled step (sampling.draw_raced: the logits' float32
copy, softmax, the race's reductions fused), outside the graph: the race's clocks come from the
rollout's torch.Generator, which a traced graph cannot hold, so they are wound eagerly before it.

Part 2, the training forward (train.py, engine/packing.py): regional compilation of the blocks, torch's
compile caches kept across runs, and the seconds a step spent compiling.

- compile_blocks: each block's training forward runs two compiled regions around its attention
  hook: the norm, q/k/v and RoPE (model.Attention.qkv) before it; o_proj, the residuals, the norm
  and SwiGLU (Block.residual_mlp) after it. One compiled function per region serves every layer:
  dynamo inlines the modules (torch >= 2.5), so a block's parameters are graph inputs, not
  constants, and layer 7 runs the graph layer 0 compiled (regional compilation: the compile costs
  one block, not L). The hook stays eager: it is engine/packing.py's (the varlen kernels or FlexAttention,
  with their own bookkeeping of lengths), which a trace would specialise on.
- Dynamic length, not static buckets: a packed row's length changes with every micro-batch, and
  static shapes compile once per length (once per bucket of 128 tokens is still dozens of lengths
  in a ragged run, past dynamo's 8 recompiles, each paying its padding). The token dimension is
  marked dynamic instead (maybe_mark_dynamic): one graph a region for every length, which costs
  these regions nothing that matters (their matmuls are library calls sized at run time; the fused
  norm, RoPE and SwiGLU kernels are memory-bound, the row count an argument).
- Only a forward under grad runs compiled: a no-grad one (rollout, evaluation, the old and
  reference logprobs) and a prefill's final block (`last`) stay eager: a decode step captured in a
  CUDA graph must never meet a compile, and an inference graph would be a second compile.
- use_cache: torch's own caches (inductor's FX graph cache, AOTAutograd's, Triton's kernels) in one
  directory that outlives the run: the next run on the same torch and device loads what this one
  compiled (dynamo still traces the regions: a warm start is seconds, not none).
- compile_seconds: this process's compile time so far as dynamo measures it (each frame's trace
  and backend compile, each backward graph's at its first backward); train.py reports each step's.

Leaves out: what the decode step computes (engine/decode.py), when the grid changes (rollout.py);
compiling the embedding, the head and the chunked logprobs, or the optimizer; tensor
parallelism's blocks (their collectives sit inside the regions); CUDA graphs of the training step.
Shapes: B rows, T tokens, C width, H/Hkv heads, D head dim.
Tested by tests/test_graphs.py (the decode step compiled on the CPU, the CPU's fused attention kernel in
CUDA's place), tests/test_graphs_cuda.py, tests/test_compiling.py (the training forward); kernels
counted by tests/bench_rollout.py --kernels; benchmarked by tests/bench_compiling.py.
"""

import contextlib
import functools
import os
import sys
from typing import Callable

import torch
from torch import Tensor

from memory import Checkpointed
from model import Block


def compile_settings() -> contextlib.ExitStack:
    """torch's settings while a step compiles (read when it traces): no equalities between sizes
    that happen to be equal then (torch's "duck shapes": the first grid's rows equal the cache's
    slots, its longest prompt the carved one: a later grid would fail those guards and compile
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


# The compiled paths (this decode step, engine/compiling.py's block regions) need this torch or newer:
# torch 2.5 compiles the step again for every grid of active rows (it guards the sizes of the
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
    """fn compiled once for all grids (module docstring), called like fn. structure(*args) -> a
    few words naming what a compile of these arguments specialises on besides the sizes marked
    dynamic (decode.Decoder.structure); a structure torch refuses runs eagerly, said in one line
    (REFUSED), and the others compile on. What its calls compiled is dynamo's count
    (graphs_compiled, compile_seconds: rollout.generate reports both for a rollout)."""

    def __init__(self, fn: Callable, structure: Callable[..., str] | None = None):
        self.fn = fn
        self.structure = structure or (lambda *args: "every call")
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
        key = (self.fn.__qualname__, self.structure(*args))
        if key in REFUSED:
            return self.fn(*args)
        try:
            with compile_settings():
                return self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as error:  # raised while compiling
            self._refuse(key, error)
            return self.fn(*args)

    def _refuse(self, key: tuple[str, str], error: Exception) -> None:
        inner = getattr(error, "inner_exception", error)  # the backend's own error
        first = (str(inner).strip().splitlines() or [""])[0][:200]
        REFUSED[key] = f"{type(inner).__name__}: {first}"
        print(f"torch.compile cannot compile {key[0]} for {key[1]} ({REFUSED[key]}): that runs "
              f"eagerly, the rest compiled as before (--compile_decode false skips every "
              f"attempt)", flush=True)


class GraphedStep:
    """A CUDA graph of `step(*inputs) -> logits` for inputs of one shape (a bucket of rows): warm
    up on a side stream, capture on copies of the inputs, replay with new values copied in.
    Replaying a step that already ran is harmless: it rewrites the same K/V."""

    def __init__(self, step: Callable[..., Tensor], *inputs: Tensor):
        self.inputs = [x.clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(*self.inputs)

    def __call__(self, *inputs: Tensor) -> Tensor:
        for mine, x in zip(self.inputs, inputs):
            mine.copy_(x)
        self.graph.replay()
        return self.logits


# Part 2: the training forward.

# -----------------------------------------------------------------------------
# Regional compilation of the blocks


def attention_inputs(block: Block, x: Tensor, cos: Tensor, sin: Tensor):
    """The region before the hook: (B, T, C) -> q (B, H, T, D), k and v (B, Hkv, T, D)."""
    return block.self_attn.qkv(block.input_layernorm(x), cos, sin)


def block_output(block: Block, x: Tensor, y: Tensor) -> Tensor:
    """The region after the hook: the residual stream x (B, T, C) and the attention's y
    (B, H, T, D) -> the block's output (B, T, C)."""
    return block.residual_mlp(x, block.self_attn.output(y))


BACKEND = "inductor"  # the tests' "aot_eager": the same graphs and autograd, no code generated


@functools.cache
def compiled_regions(backend: str):
    """The two regions compiled, once per process and backend: every compiled block of every model
    calls these (dynamo keeps one graph per set of guards, shared by all the layers)."""
    return torch.compile(attention_inputs, backend=backend), torch.compile(block_output,
                                                                           backend=backend)


class Compiled:
    """Put in front of model.Block by compile_blocks: its training forward runs the compiled
    regions with the attention hook eager between them."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable,
                last: Tensor | None = None) -> Tensor:
        if last is not None or not torch.is_grad_enabled():
            return super().forward(x, cos, sin, attention, last)
        inputs, output = compiled_regions(BACKEND)
        for t in (x, cos, sin):  # the token count: one graph for every length
            torch._dynamo.maybe_mark_dynamic(t, 1)
        q, k, v = inputs(self, x, cos, sin)
        y = attention(self.self_attn.layer, q, k, v)  # (B, H, T, D), eager
        torch._dynamo.maybe_mark_dynamic(y, 2)
        return output(self, x, y)


class CompiledBlock(Compiled, Block):
    pass


def compile_blocks(blocks, enabled: bool = True) -> int:
    """Make each model.Block's training forward run the compiled regions (its class becomes
    CompiledBlock: parameter names and state dict unchanged); enabled=False swaps back. Call it
    before memory.checkpoint_blocks, whose recompute then runs the compiled regions too. Returns
    how many blocks."""
    blocks = list(blocks)
    for block in blocks:
        if isinstance(block, Checkpointed):
            raise TypeError("compile_blocks before memory.checkpoint_blocks: the checkpoint wraps "
                            "the compiled forward, not the other way round")
        if type(block) not in (Block, CompiledBlock):
            raise TypeError(f"compile_blocks takes model.Block, got {type(block).__name__} "
                            "(tensor parallelism's blocks run eager)")
        block.__class__ = CompiledBlock if enabled else Block
    return len(blocks)

# -----------------------------------------------------------------------------
# Compile caches across runs, and the compile seconds


def use_cache(directory: str) -> str:
    """Point torch's compile caches at directory ("" leaves torch's choice: TORCHINDUCTOR_CACHE_DIR
    or /tmp/torchinductor_$USER). Inductor reads the variable at each compile (Triton's cache goes
    under it), so call it before the first one. Returns where the caches go, for the log."""
    if directory:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(directory)
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default, /tmp/torchinductor_$USER")


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: dynamo's frames (trace and backend) plus
    the backward graphs AOTAutograd compiles at their first backward. 0 while dynamo is not even
    loaded (a run that compiles nothing need not pay its import)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    from torch._dynamo.utils import calculate_time_spent
    spent = calculate_time_spent()
    return spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)
