"""
Compiling the training forward: regional compilation of the blocks, torch's compile caches kept
across runs, and the seconds a step spent compiling.

- compile_blocks: each block's training forward runs two compiled regions around its attention
  hook: the norm, q/k/v and RoPE (model.Attention.qkv) before it; o_proj, the residuals, the norm
  and SwiGLU (Block.residual_mlp) after it. One compiled function per region serves every layer:
  dynamo inlines the modules (torch >= 2.5), so a block's parameters are graph inputs, not
  constants, and layer 7 runs the graph layer 0 compiled (regional compilation: the compile costs
  one block, not L). The hook stays eager: it is packing.py's (the varlen kernels or FlexAttention,
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

Leaves out: compiling the embedding, the head and the chunked logprobs, or the optimizer; tensor
parallelism's blocks (their collectives sit inside the regions); CUDA graphs of the training step.
Shapes: B rows, T tokens, C width, H/Hkv heads, D head dim.
Tested by tests/test_compiling.py; benchmarked by tests/bench_compiling.py.
"""

import functools
import os
import sys
from typing import Callable

import torch
from torch import Tensor

from memory import Checkpointed
from model import Block

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
