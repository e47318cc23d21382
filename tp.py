"""
Tensor parallelism (Megatron-LM style, by hand) for model.py's Llama, the tp x dp process groups,
the gradient-norm clip over both, and data parallelism's few collectives (at the end). (The tp
ranks hold the same rows: a task's tool is called on the first alone, tools/runtime.py's
on_first_rank.)

TP splits each block over the tp ranks: q/k/v and gate/up are column-parallel (H/tp heads, I/tp of
the SwiGLU width per rank, their biases split alike; Qwen3's per-head q/k norms replicated, their
grads summed over the ranks' heads), o/down row-parallel (each rank computes a
partial sum of the output; a bias is added once, after the sum), the embedding and lm_head are
split by vocab and the logits stay split. Two collectives per block half, as in Megatron-LM
(arXiv:1909.08053): f = CopyToTP (identity forward, all-reduce backward) before the column-parallel
linears, g = ReduceFromTP (all-reduce forward, identity backward) after the row-parallel ones.
Sequence parallelism (arXiv:2205.05198) also splits the tokens of the replicated part (norms,
residual adds): g becomes a reduce-scatter and f an all-gather fused with the linears after it,
which saves only the local shard and re-gathers into a MemoryBuffer in backward (nanotron PR #203).

The parallel forward is a class you can open: shard_model turns the model into a TPLlama and its
modules into the TP classes below (same objects, HF parameter names, only forward() changes).
TPLlama.hidden decides once per forward whether it runs sequence parallel (the model's switch,
ParallelConfig.sequence_parallel or `with sequence_parallel(model):`) and passes `sp` explicitly
to every block and layer. SP splits the B*T tokens evenly over the tp ranks: when tp does not divide
them, each row's end is padded until it does and the pads are dropped after; a decode step (one
token a row, whose hook takes no more) then runs plain TP, the same numbers, on the same model. It
always returns the full (B, T, C) on every rank. A block recomputed in
backward (memory.checkpoint_blocks) is called with the same `sp` and takes the same path again.

Leaves out: pipeline parallelism, ZeRO/FSDP, overlap of communication with compute, uneven splits.
Shapes: B sequences, T tokens, N = B*T tokens, n tokens of a logits chunk, C width, H/Hkv heads,
D head dim, I SwiGLU width, V vocab; `/tp` means this rank's shard.
Tested by tests/test_tp.py (gloo, 2 and 4 CPU processes; dp's gradient sum) and tests/test_train.py (dp's
collectives, 2 gloo processes); tests/bench_tp.py counts saved bytes.
"""

import contextlib
import math
import os
import time
from dataclasses import dataclass
from math import prod
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor
from torch.autograd import Function

from engine.hf import (EMBEDDING, allocate, check_checkpoint, expected_shapes, load_config, load_model,
                tied_copy_differs, tied_copy_message)
from lora import LoRALinear
from model import (MLP, Attention, Block, Llama, RMSNorm, at_last, causal_attention, rms_norm,
                   rope_inv_freq)

# torch 2.13 renamed these two (same signatures); older versions only have the *_tensor names.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass
class ParallelConfig:
    tp: int = 1                      # tensor-parallel size; world size = tp * dp (torchrun)
    sequence_parallel: bool = False  # split the norms' and residuals' tokens (training forward)

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp!r}")

# -----------------------------------------------------------------------------
# Process groups


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's RANK / WORLD_SIZE / LOCAL_RANK: NCCL on
    cuda:LOCAL_RANK when CUDA is available, else gloo on the CPU; no group at world size 1."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count():  # every rank
            raise ValueError(f"more processes on this node than its {torch.cuda.device_count()} "
                             "CUDA devices: lower --nproc_per_node, or CUDA_VISIBLE_DEVICES= (CPU)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if world == 1:
        return 0, 1, device
    if "RANK" not in os.environ:
        raise ValueError(f"WORLD_SIZE={world} but RANK is not set; launch with torchrun")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=world)
    return dist.get_rank(), world, device


@dataclass
class ParallelGroups:
    tp_group: dist.ProcessGroup | None  # None at tp_size 1: TP collectives are then skipped
    dp_group: dist.ProcessGroup | None  # None at dp_size 1
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1


def destroy_groups(barrier: bool = True) -> None:
    """Tear down every process group. The barrier first lets each group's worker threads finish
    freeing their last collectives: the main thread waits in it without the GIL, which those threads
    may need to free a tensor Python has already dropped (one may still be at it after the barrier:
    hence the sleep). Under torch 2.5, destroying a gloo group while one of them held its lock
    waiting for the GIL deadlocked the process. barrier=False: a rank failing alone."""
    if barrier:
        dist.barrier()
    time.sleep(0.05)  # the GIL dropped a moment: a worker thread still freeing a tensor gets it
    dist.destroy_process_group()


def make_groups(tp_size: int) -> ParallelGroups:
    """world = tp x dp with tp ranks contiguous (ranks 0..tp-1 hold one model): the per-layer TP
    traffic stays inside a node, the once-per-step DP traffic crosses nodes."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"tp_size={tp_size} must be >= 1 and divide the world size {world}")
    dp_size = world // tp_size
    tp_lists = []
    if tp_size > 1:
        tp_lists = [range(d * tp_size, (d + 1) * tp_size) for d in range(dp_size)]
    dp_lists = [range(t, world, tp_size) for t in range(tp_size)] if dp_size > 1 else []
    # new_group is itself collective: every rank creates every group, in the same order, and keeps
    # its own.
    made = [(rank in ranks, dist.new_group(list(ranks))) for ranks in tp_lists + dp_lists]
    tp_group = next((g for mine, g in made[:len(tp_lists)] if mine), None)
    dp_group = next((g for mine, g in made[len(tp_lists):] if mine), None)
    return ParallelGroups(tp_group, dp_group, rank % tp_size, tp_size, rank // tp_size, dp_size)

# -----------------------------------------------------------------------------
# MemoryBuffer and the autograd collectives


def collective_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An empty tensor for a collective to write into, never an inference tensor.
    NOTE torch < 2.6's gloo writes a gather's output on its own thread, where the sampler's
    inference_mode is off, and an inference tensor refuses that write ("Inplace update to inference
    tensor outside InferenceMode"). A normal tensor may be written inside inference_mode and out."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device=device)


class MemoryBuffer:
    """One reusable tensor per (name, dtype) for activations that are gathered and consumed at once
    (nanotron #203; Megatron's GlobalMemoryBuffer, but owned by one model, not global).
    NOTE the rule: nothing autograd saves may live in the buffer. The next get() of the same name
    overwrites it, so a saved tensor would hold another layer's data by the time backward reads it:
    the wrong gradients of #203's first version (tests/test_tp.py reproduces them)."""
    def __init__(self):
        self.tensors: dict[tuple[str, torch.dtype], Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> Tensor:
        key = (name, dtype)
        numel = prod(shape)
        t = self.tensors.get(key)
        # Grow (the old one dies with its last view). Made outside inference_mode
        # (collective_output), the same tensor serves the sampler's forward and autograd's writes.
        if t is None or t.numel() < numel or t.device != device:
            t = self.tensors[key] = collective_output((numel,), dtype, device)
        return t[:numel].view(shape)


class CopyToTP(Function):
    """f: identity forward; backward sums the column shards' partial input grads over tp ranks."""
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # NOTE never all-reduce autograd's grad in place: a residual add hands the same tensor to
        # both branches.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)  # f backward: sum of the shards' partial input grads
        return grad, None


class ReduceFromTP(Function):
    """g: sums the row shards' partial outputs over the tp ranks (in place, on a fresh, unsaved
    input)."""
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        dist.all_reduce(x, group=group)  # g: sum over tp ranks of the row-parallel partial outputs
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class ReduceScatterToSP(Function):
    """g under SP: (N, C) partial sums -> (N/tp, C) full sums of this rank's tokens; backward
    all-gathers."""
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        n = x.shape[0] // dist.get_world_size(group)
        out = collective_output((n, *x.shape[1:]), x.dtype, x.device)  # (N/tp, C)
        # g (SP): sum the partials over tp ranks, keep my N/tp tokens
        _reduce_scatter(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        N = grad.shape[0] * dist.get_world_size(ctx.group)
        full = grad.new_empty(N, *grad.shape[1:])  # (N, C)
        _all_gather(full, grad.contiguous(), group=ctx.group)  # g (SP) backward: all N tokens
        return full, None


class GatherFromSP(Function):
    """Leaves SP after the last block: (N/tp, C) -> (N, C). Backward keeps my tokens, no sum: all
    after hidden() (final norm, lm_head behind f) runs alike on every tp rank, so h's grad is
    already full."""
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        N = x.shape[0] * dist.get_world_size(group)
        full = collective_output((N, *x.shape[1:]), x.dtype, x.device)  # (N, C)
        _all_gather(full, x.contiguous(), group=group)  # every rank's N/tp tokens, in rank order
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        return grad[dist.get_rank(ctx.group) * n:][:n], None  # (N/tp, C)


class GatherLinears(Function):
    """SP's f fused with the column-parallel linears that read it (q/k/v, or gate/up): x (N/tp, C)
    -> x_full @ W_i^T (+ b_i) each. x_full (N, C) lives in the buffer and is never saved: backward
    re-gathers it (nanotron's tp_recompute_allgather), then reduce-scatters the input grad."""
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, buffer: MemoryBuffer,
                *weights_then_biases: Tensor):
        k = len(weights_then_biases) // 2
        weights = weights_then_biases[:k]
        biases = weights_then_biases[k:]
        N = x.shape[0] * dist.get_world_size(group)
        full = buffer.get("gather", (N, x.shape[1]), x.dtype, x.device)  # (N, C)
        _all_gather(full, x.contiguous(), group=group)  # f (SP): all N tokens, into the buffer
        ctx.save_for_backward(x, *weights)  # the local shard only
        ctx.group = group
        ctx.buffer = buffer
        ctx.has_bias = [b is not None for b in biases]
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))  # (N, out_i/tp) each

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, *weights = ctx.saved_tensors
        N = x.shape[0] * dist.get_world_size(ctx.group)
        full = ctx.buffer.get("gather", (N, x.shape[1]), x.dtype, x.device)  # (N, C)
        _all_gather(full, x.contiguous(), group=ctx.group)  # re-gathered instead of saved
        grad_full = ctx.buffer.get("reduce", full.shape, x.dtype, x.device)  # (N, C)
        torch.mm(grads[0], weights[0], out=grad_full)
        for g, w in zip(grads[1:], weights[1:]):
            grad_full.addmm_(g, w)
        grad_x = torch.empty_like(x)
        # f backward (SP): sum over tp ranks, keep my tokens
        _reduce_scatter(grad_x, grad_full, group=ctx.group)
        grad_b = [g.sum(0) if has else None for g, has in zip(grads, ctx.has_bias)]
        return grad_x, None, None, *[g.t() @ full for g in grads], *grad_b

# -----------------------------------------------------------------------------
# Parallel modules: shard_model turns model.py's modules into these in place. Each forward takes
# `sp` (sequence parallel or not) explicitly, from TPLlama.hidden.


@dataclass
class TPState:  # per model, a plain attribute (not in the state dict)
    ranks: ParallelGroups
    sequence_parallel: bool                   # the SP switch, read once per forward by TPLlama
    buffer: MemoryBuffer
    sharded: dict[str, tuple[int, int, int]]  # param name -> (dim, start, stop) of its slice

    def __deepcopy__(self, memo: dict) -> "TPState":  # a copied model (a reference) shares its process groups
        return TPState(self.ranks, self.sequence_parallel, MemoryBuffer(), dict(self.sharded))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + V/tp); other ids look up zeros, so g gives every id its
    row. Enters SP by reduce-scattering instead of all-reducing."""
    def forward(self, tokens: Tensor, sp: bool = False) -> Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        x = x.masked_fill(outside[..., None], 0.0)
        group = self.state.ranks.tp_group
        if sp:
            return ReduceScatterToSP.apply(x.flatten(0, 1), group)  # (N/tp, C)
        return ReduceFromTP.apply(x, group)  # (B, T, C)


class VocabParallelLMHead(nn.Linear):
    """Logits of this rank's V/tp vocab rows; they stay split (gather_vocab, vocab-parallel
    logprobs)."""
    def forward(self, h: Tensor) -> Tensor:
        return F.linear(CopyToTP.apply(h, self.state.ranks.tp_group), self.weight)  # (..., V/tp)


class TPRMSNorm(RMSNorm):
    def forward(self, x: Tensor, sp: bool = False) -> Tensor:
        if not sp:
            return super().forward(x)
        # Under SP a rank normalises only its N/tp tokens, so its weight grad is partial: f on the
        # weight sums it over tp ranks inside backward, and the grad stays replicated as in plain
        # TP (so SP and non-SP forwards can mix in one accumulation). The rest is model.RMSNorm's
        # math, in HF's order.
        weight = CopyToTP.apply(self.weight, self.state.ranks.tp_group)
        return rms_norm(x, weight, self.eps)


class TPHeadRMSNorm(RMSNorm):
    """Qwen3's q_norm / k_norm on this rank's H/tp (or Hkv/tp) heads. The (D,) weight is
    replicated, but a rank's grad sums over its own heads only: f on the weight sums it over the tp
    ranks inside backward (with or without SP), so the grad is the full one on every rank."""
    def forward(self, x: Tensor) -> Tensor:
        weight = CopyToTP.apply(self.weight, self.state.ranks.tp_group)
        return rms_norm(x, weight, self.eps)


class RowParallelLinear(nn.Linear):
    """o_proj / down_proj: this rank's input columns give a partial sum of the output; g sums it
    over the tp ranks (an all-reduce, or under SP a reduce-scatter to this rank's N/tp tokens), and
    only then is the bias added: once, not once per rank. Its grad: the same full sum on every rank
    without SP; under SP each rank sees only its tokens, so f on the bias sums the grads."""
    def forward(self, x: Tensor, sp: bool = False) -> Tensor:
        group = self.state.ranks.tp_group
        partial = self.partial(x)  # (B, T, C), or (N, C) under SP: this rank's share
        bias = self.bias
        if sp:
            out = ReduceScatterToSP.apply(partial, group)  # (N/tp, C)
            bias = None if bias is None else CopyToTP.apply(bias, group)
        else:
            out = ReduceFromTP.apply(partial, group)  # (B, T, C)
        return out if bias is None else out + bias


    def partial(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLoRALinear(LoRALinear):
    """q/k/v/gate/up with a LoRA adapter (lora.py): A (r, C) whole, B this rank's out/tp rows.
    Every rank's update reads all of A, so its gradient on a rank is a partial sum: f on A sums it
    over the tp ranks in backward (the grad then whole on each, as a replicated weight's)."""
    def adapter_weights(self) -> tuple[Tensor, Tensor]:
        return CopyToTP.apply(self.lora_A, self.state.ranks.tp_group), self.lora_B


class RowParallelLoRALinear(RowParallelLinear, LoRALinear):
    """o/down with a LoRA adapter: A this rank's in/tp columns, B (out, r) whole. B A_r x_r is
    this rank's partial sum of the update: added to the base's partial, it is summed by the same
    g. B's gradient is a partial sum likewise: f on B sums it over the tp ranks in backward."""
    def adapter_weights(self) -> tuple[Tensor, Tensor]:
        return self.lora_A, CopyToTP.apply(self.lora_B, self.state.ranks.tp_group)

    def partial(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight) + self.update(x)  # (..., C) this rank's share


def adapt(model: Llama) -> Llama:
    """A sharded model whose linears lora.py gave adapters: their tensor-parallel classes (the same
    objects, only forward() changes). Untouched without tensor parallelism."""
    state = getattr(model, "tp_state", None)
    if state is None:
        return model
    for module in model.modules():
        if type(module) is LoRALinear:
            module.__class__ = ColumnParallelLoRALinear
        elif type(module) is RowParallelLinear and hasattr(module, "lora_A"):
            module.__class__ = RowParallelLoRALinear
        else:
            continue
        module.state = state
    return model


class TPAttention(Attention):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable,
                last: Tensor | None = None, sp: bool = False) -> Tensor:
        group = self.state.ranks.tp_group
        if not sp:  # f, model.Attention on this rank's H/tp heads, g in o_proj
            return super().forward(CopyToTP.apply(x, group), cos, sin, attention,
                                   last)  # (B, T|1, C)
        assert last is None, "under SP TPLlama picks the last positions after the gather"
        # x (N/tp, C): f is the all-gather fused into the q/k/v linears
        T = cos.shape[1]
        B = x.shape[0] * self.state.ranks.tp_size // T
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = GatherLinears.apply(x, group, self.state.buffer, *[m.weight for m in qkv],
                                      *[m.bias for m in qkv])  # (N, H/tp*D), (N, Hkv/tp*D) x2
        # model.Attention.heads: q (B, H/tp, T, D), k, v (B, Hkv/tp, T, D), normed (Qwen3), rotated
        q, k, v = self.heads(q.view(B, T, -1), k.view(B, T, -1), v.view(B, T, -1), (cos, sin),
                             (cos, sin))
        y = attention(self.layer, q, k, v).transpose(1, 2).reshape(B * T, -1)  # (N, H/tp*D)
        return self.o_proj(y, sp)  # g: reduce-scattered to (N/tp, C)


class TPMLP(MLP):
    def forward(self, x: Tensor, sp: bool = False) -> Tensor:
        group = self.state.ranks.tp_group
        if not sp:  # f, SwiGLU on this rank's I/tp columns, g in down_proj
            return super().forward(CopyToTP.apply(x, group))  # (B, T, C)
        # x (N/tp, C): f is the all-gather fused into the gate/up linears
        gate_up = (self.gate_proj, self.up_proj)
        weights_then_biases = [m.weight for m in gate_up] + [m.bias for m in gate_up]
        gate, up = GatherLinears.apply(x, group, self.state.buffer, *weights_then_biases)
        return self.down_proj(F.silu(gate) * up, sp)  # (N, I/tp) -> g: (N/tp, C)


class TPBlock(Block):
    """model.Block with `sp` passed to every layer that communicates. `last` (a prefill's final
    positions) is TPLlama's to apply under SP, where a rank holds only some of the tokens."""
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Callable,
                last: Tensor | None = None, sp: bool = False) -> Tensor:
        y = self.self_attn(self.input_layernorm(x, sp), cos, sin, attention, last, sp)
        x = (x if last is None else at_last(x, last)) + y  # (B, T|1, C), or (N/tp, C) under SP
        return x + self.mlp(self.post_attention_layernorm(x, sp), sp)


class TPLlama(Llama):
    """shard_model's model: the TP forward. Decides sequence parallelism once per forward and
    passes it down; always returns the full (B, T, C) on every rank (forward() and the callers'
    hooks see the same shapes as on one process)."""
    def hidden(self, tokens: Tensor, positions: Tensor | None = None,
               attention: Callable | None = None, last: Tensor | None = None) -> Tensor:
        state = self.tp_state
        tp = state.ranks.tp_size
        B, T = tokens.shape
        # SP splits the B*T tokens evenly. When tp does not divide them, each row's end is padded
        # until it does; a decode step (T = 1: its hook takes one token a row) runs plain TP.
        sp = state.sequence_parallel and (B * T % tp == 0 or T > 1)
        if sp and B * T % tp:
            pad = next(p for p in range(1, tp + 1) if B * (T + p) % tp == 0)
            if positions is None:
                positions = torch.arange(T, device=tokens.device).expand(B, T)
            # The pads come after every real token: causal attention never shows them to one, and
            # a hook that knows its own T (grpo's packed forwards) leaves what follows it alone.
            tokens = torch.cat([tokens, tokens.new_zeros(B, pad)], 1)  # (B, T+pad)
            positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(
                pad, device=tokens.device)], 1)
        x = self.model.embed_tokens(tokens, sp)  # (N/tp, C) under SP, else (B, T, C)
        cos, sin = self.rope(tokens, positions, x.dtype)  # (B, T, D)
        final = len(self.model.layers) - 1
        for i, block in enumerate(self.model.layers):
            block_last = last if i == final and not sp else None
            x = block(x, cos, sin, attention or causal_attention, block_last, sp)
        if sp:  # out of SP: every rank gets every token
            x = GatherFromSP.apply(x, state.ranks.tp_group).view(*tokens.shape, -1)  # (B, T', C)
            x = x[:, :T]  # (B, T, C): the pads dropped
            if last is not None:
                x = at_last(x, last)  # (B, 1, C)
        return x


@contextlib.contextmanager
def sequence_parallel(model: Llama, enabled: bool = True):
    """Switch SP on (or off) for the forwards in the scope; a no-op on an unsharded model."""
    state = getattr(model, "tp_state", None)
    if state is None:
        yield model
        return
    previous = state.sequence_parallel
    state.sequence_parallel = enabled
    try:
        yield model
    finally:
        state.sequence_parallel = previous

# -----------------------------------------------------------------------------
# Sharding, loading, gathering


def shard_model(model: Llama, ranks: ParallelGroups, sequence_parallel: bool = False) -> Llama:
    """In place: slice the full weights and turn the model and its modules into their TP classes;
    returns the model (untouched at tp_size 1, or if already sharded). Every tp rank must start
    from the same full weights."""
    cfg = model.config
    tp = ranks.tp_size
    rank = ranks.tp_rank
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"tp_size={tp} must divide {name}={getattr(cfg, name)}")
    if hasattr(model, "tp_state") or tp == 1:
        return model
    state = TPState(ranks, sequence_parallel, MemoryBuffer(), {})

    def take(module: nn.Module, prefix: str, dim: int) -> None:
        """Keep this rank's slice of the weight, and of a column-parallel bias (dim 0). A
        row-parallel bias (dim 1) stays whole: RowParallelLinear adds it once, after g."""
        for pname in ("weight", "bias") if dim == 0 else ("weight",):
            p = getattr(module, pname, None)
            if p is None:
                continue
            size = p.shape[dim] // tp
            state.sharded[f"{prefix}.{pname}"] = (dim, rank * size, (rank + 1) * size)
            # clone: the slice must not keep the full tensor's storage alive
            piece = p.detach().narrow(dim, rank * size, size).clone()
            setattr(module, pname, nn.Parameter(piece, p.requires_grad))
        if isinstance(module, nn.Linear):  # keep repr() honest
            module.out_features, module.in_features = module.weight.shape

    body = model.model
    take(body.embed_tokens, "model.embed_tokens", 0)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = body.embed_tokens.weight  # the same V/tp rows, the same Parameter
    else:
        take(model.lm_head, "lm_head", 0)
    modules = [(body.embed_tokens, VocabParallelEmbedding), (model.lm_head, VocabParallelLMHead)]
    column = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
              "mlp.up_proj")
    for i, block in enumerate(body.layers):
        for name in column:  # column-parallel: split the output rows
            take(block.get_submodule(name), f"model.layers.{i}.{name}", 0)
        for name in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: split input columns
            take(block.get_submodule(name), f"model.layers.{i}.{name}", 1)
            modules.append((block.get_submodule(name), RowParallelLinear))
        modules += [(block, TPBlock), (block.self_attn, TPAttention), (block.mlp, TPMLP),
                    (block.input_layernorm, TPRMSNorm),
                    (block.post_attention_layernorm, TPRMSNorm)]
        # Qwen3's per-head norms: replicated, on this rank's heads (Identity elsewhere: as is)
        modules += [(norm, TPHeadRMSNorm) for norm in (block.self_attn.q_norm,
                                                       block.self_attn.k_norm)
                    if isinstance(norm, RMSNorm)]
    # Same instances with their sliced parameters, so the names stay HF's; only forward() changes.
    for module, cls in modules:
        module.__class__ = cls
        module.state = state
    body.embed_tokens.vocab_start = rank * body.embed_tokens.weight.shape[0]
    model.tp_state = state
    model.__class__ = TPLlama  # as the modules above: the same object, the TP hidden()
    return model


def load_sharded(path: str, ranks: ParallelGroups, device: str | torch.device,
                 dtype: torch.dtype, sequence_parallel: bool = False) -> Llama:
    """The sharded model, each rank reading only its slices (safe_open(...).get_slice): no rank
    ever holds the full checkpoint, nor one full tensor of a sharded parameter. The checkpoint is
    first checked against the full model's tensors (hf.check_checkpoint, as in
    hf.load_model), so every rank refuses a bad one alike, before any slicing."""
    if ranks.tp_size == 1:
        return load_model(path, device, dtype)
    cfg = load_config(path)
    files = check_checkpoint(path, expected_shapes(cfg))  # name -> file; full names, shapes checked
    with torch.device("meta"):  # shapes only: slicing meta tensors allocates nothing
        model = shard_model(Llama(cfg), ranks, sequence_parallel)
    # A tied model's stored copy of the embedding (the Hub's Qwen3-0.6B): each rank compares its
    # own vocab rows, then all-reduce(MAX) over the tp group: every rank refuses alike, or none.
    _, start, stop = model.tp_state.sharded[EMBEDDING]
    differs = torch.tensor([float(tied_copy_differs(cfg, files, start, stop))], device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=ranks.tp_group)
    if differs.item():
        raise ValueError(tied_copy_message(files))
    allocate(model, device, dtype)  # NOTE: re-creates every parameter: unties lm_head
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # float32 always, like hf.load_model
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    with torch.no_grad():
        for file in sorted(set(files.values())):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in [n for n in params if files[n] == file]:
                    p = params[name]
                    # a replicated tensor (norms, row-parallel biases): all of it
                    dim, start, stop = model.tp_state.sharded.get(name, (0, 0, len(p)))
                    lazy = f.get_slice(name)
                    # reads only these bytes
                    p.copy_(lazy[:, start:stop] if dim == 1 else lazy[start:stop])
    return model


def full_state_dict(model: Llama, ranks: ParallelGroups) -> dict[str, Tensor]:
    """The full CPU tensors of a sharded model, named as a plain Llama's named_parameters() (a tied
    lm_head appears once, as the embedding: the same tensors a TP=1 checkpoint holds), on every
    rank. Collective: every tp rank must call it."""
    sharded = model.tp_state.sharded if hasattr(model, "tp_state") else {}
    out = {}
    for name, p in model.named_parameters():  # a tied lm_head appears once, as the embedding
        t = p.detach()
        if name in sharded:
            parts = [torch.empty_like(t) for _ in range(ranks.tp_size)]
            # every rank's slice, in rank order
            dist.all_gather(parts, t.contiguous(), group=ranks.tp_group)
            t = torch.cat(parts, dim=sharded[name][0])
        out[name] = t.to("cpu", copy=True)
    return out


def gather_vocab(logits: Tensor, ranks: ParallelGroups) -> Tensor:
    """All-gather vocab-split logits (..., V/tp) -> (..., V), the same on every rank (sampling;
    no grad)."""
    if ranks.tp_size == 1:
        return logits
    # flat: gloo only gathers along dim 0
    parts = collective_output((ranks.tp_size * logits.numel(),), logits.dtype, logits.device)
    # every rank's vocab slice
    _all_gather(parts, logits.contiguous().view(-1), group=ranks.tp_group)
    parts = parts.view(ranks.tp_size, *logits.shape).movedim(0, -2)  # (..., tp, V/tp)
    return parts.reshape(*logits.shape[:-1], -1)  # (..., V)

# -----------------------------------------------------------------------------
# Vocab-parallel logprobs and entropy


class VocabParallelLogprobs(Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group: dist.ProcessGroup | None,
                vocab_start: int):
        z = logits.float()  # (n, V/tp); for float32 logits this is the caller's tensor: read only
        m = z.max(dim=-1).values  # (n,)
        if group is not None:
            # the max over every rank's vocab: a safe exp
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        zs = z - m[:, None]
        e = zs.exp()
        local = targets - vocab_start
        mine = (local >= 0) & (local < z.shape[1])
        picked = zs.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0]  # (n,)
        target = torch.where(mine, picked, 0.0)
        stats = torch.stack([e.sum(-1), (e * zs).sum(-1), target])  # (3, n)
        if group is not None:
            # sum over tp ranks: sum exp, sum exp*z, target z (one rank has it)
            dist.all_reduce(stats, group=group)
        log_sum = stats[0].log()
        logp = stats[2] - log_sum
        entropy = log_sum - stats[1] / stats[0]  # H = log S - sum(e z) / S
        # Per-token statistics only, so backward needs no communication: p = exp(z - lse) on the
        # local shard.
        ctx.save_for_backward(logits, targets, m + log_sum, entropy)
        ctx.vocab_start = vocab_start
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        logits, targets, lse, entropy = ctx.saved_tensors
        logp_all = logits.float() - lse[:, None]  # (n, V/tp)
        # d logp_t / dz = onehot(t) - p;  d H / dz = -p (log p + H)
        dh = grad_entropy[:, None] * (logp_all + entropy[:, None])  # (n, V/tp)
        grad = -logp_all.exp() * (grad_logp[:, None] + dh)
        local = targets - ctx.vocab_start
        mine = (local >= 0) & (local < grad.shape[1])
        index = local.clamp(0, grad.shape[1] - 1)[:, None]  # (n, 1)
        grad.scatter_add_(1, index, (grad_logp * mine)[:, None])
        return grad.to(logits.dtype), None, None, None


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor,
                            ranks: ParallelGroups) -> tuple[Tensor, Tensor]:
    """logits (n, V/tp) this rank's shard, already divided by the temperature; targets (n,) global
    ids -> logp (n,), entropy (n,) in float32, identical on every tp rank. Two all-reduces, none in
    backward. Deterministic, so grpo.py may recompute it under checkpoint; every rank must run the
    same chunks."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (n, V/tp), got shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1] or targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 of shape ({len(logits)},), got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    vocab = logits.shape[1] * ranks.tp_size
    # One host sync per chunk: a target no rank owns would give a wrong logp, not an error.
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"targets must be global ids in [0, {vocab}), got [{targets.min()}, "
                         f"{targets.max()}]")
    vocab_start = ranks.tp_rank * logits.shape[1]
    return VocabParallelLogprobs.apply(logits, targets, ranks.tp_group, vocab_start)

# -----------------------------------------------------------------------------
# Data parallelism and gradient clipping


def clip_grad_norm(model: nn.Module, max_norm: float, ranks: ParallelGroups) -> float:
    """Scale all grads so that their global L2 norm is at most max_norm (torch's clip_grad_norm_
    rule) and return the norm before clipping. Sharded params' squares are summed over tp ranks;
    replicated ones (norm weights) hold the same full grad on every tp rank and count once. Call
    after DP's all_reduce. A non-finite norm (NaN/inf somewhere) scales nothing: the caller skips
    the update (the same norm on every rank, so every rank skips)."""
    sharded = model.tp_state.sharded if hasattr(model, "tp_state") else {}
    kinds = ([], [])  # the grads of sharded params, of replicated ones
    for name, p in model.named_parameters():
        if p.grad is not None:
            kinds[name not in sharded].append(p.grad)
    grads = kinds[0] + kinds[1]
    if not grads:
        return 0.0
    # Multi-tensor ops (as torch's clip_grad_norm_): a few kernels for all the grads, not four a
    # grad, which in a tiny model's step cost more launches than its matmuls. At least float32.
    dt = torch.promote_types(grads[0].dtype, torch.float32)
    squares = torch.stack([torch.stack(torch._foreach_norm(g, 2, dtype=dt)).square().sum() if g
                           else grads[0].new_zeros((), dtype=dt) for g in kinds])  # (2,)
    if ranks.tp_group is not None:
        # the sum over tp ranks of their disjoint slices' squares
        dist.all_reduce(squares[0:1], group=ranks.tp_group)
    total = squares.sum().sqrt().item()  # one host sync
    if not math.isfinite(total):
        return total
    coef = min(max_norm / (total + 1e-6), 1.0)
    if coef < 1.0:  # a scale of 1 changes no bit
        torch._foreach_mul_(grads, coef)
    return total


# Data parallelism. What the dp ranks share each step: each rank of a dp group samples and trains on
# its own slice of the generation batch, and these few collectives put together what the whole batch
# needs: every rank's rewards (the group statistics), sums of metrics and token counts (the loss
# normalisers), the evaluation's completions in their order, and stop decisions taken by all ranks at
# once (a rank that stopped alone would leave the others waiting in a collective), and the gradient
# sum.
# Every function is a no-op at dp size 1 (no process group). Leaves out: overlapping communication
# with compute, sharded optimizer state (ZeRO).


def dp_all_reduce(values: list[float], ranks, device: torch.device, op=None) -> list[float]:
    """The elementwise sum (or `op`) of a list of floats over the dp ranks (through `device`: NCCL
    reduces device tensors)."""
    if ranks.dp_group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=ranks.dp_group)  # over dp ranks
    return t.tolist()


def dp_reduce_metrics(m: dict, tokens: float, ranks, device: torch.device) -> dict:
    """One optimizer iteration's metrics (grpo.accumulate's) over the dp ranks: the loss summed
    (each rank's is normalised by global counts), the min of *_min and the max of *_max, the rest
    means weighted by each rank's `tokens`; grad_norm, updated and finite are already global."""
    extremes = {k: -1 if k.endswith("_min") else 1 for k in sorted(m) if k[-4:] in ("_min", "_max")}
    keys = sorted(k for k in m if k not in ("loss", "tokens", "grad_norm", "updated", "finite",
                                            *extremes))
    sums = dp_all_reduce([m["loss"], tokens] + [m[k] * tokens for k in keys], ranks, device)
    peaks = dp_all_reduce([s * m[k] for k, s in extremes.items()], ranks, device, dist.ReduceOp.MAX)
    return dict(loss=sums[0], grad_norm=m["grad_norm"], updated=m["updated"], finite=m["finite"],
                **{k: s / max(sums[1], 1.0) for k, s in zip(keys, sums[2:])},
                **{k: s * p for (k, s), p in zip(extremes.items(), peaks)})


def dp_gather(t: torch.Tensor, ranks) -> torch.Tensor:
    """Every dp rank's tensor, concatenated in dp-rank order (the same on every rank)."""
    if ranks.dp_group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(ranks.dp_size)]
    dist.all_gather(parts, t.contiguous(), group=ranks.dp_group)  # DP: every rank's rows
    return torch.cat(parts)


def dp_interleave(items: list, ranks) -> list:
    """Every dp rank's share of a list split as items[dp_rank::dp_size], back in its order."""
    if ranks.dp_group is None:
        return items
    shares = [None] * ranks.dp_size
    dist.all_gather_object(shares, items, group=ranks.dp_group)  # DP: every rank's share
    return [share[i] for i in range(len(shares[0])) for share in shares if i < len(share)]


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether any rank (dp and tp) raised the flag: a stop or continue decided together."""
    t = torch.tensor([float(flag)], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # over every rank of the world
    return bool(t.item())


def dp_sum_grads(model: torch.nn.Module, ranks) -> None:
    """Sums the trainable parameters' .grad over the dp group through one flat buffer: copy in, one
    all-reduce, copy out. SUM, not mean: train.py divides each loss by global counts (over the
    whole batch on all dp ranks), so the sum is the one-big-batch gradient. The buffer is one more
    copy of the grads while it lives (Megatron makes the grads views into it instead), so it lives
    only in this call: kept, it would sit through the rollout phase, where memory.py has released
    the grads. Trainable params must share one dtype."""
    if ranks.dp_group is None:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # a missing grad sends zeros: every rank has the same layout
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in params])  # (all trainable numel,)
    dist.all_reduce(flat, group=ranks.dp_group)  # DP: sum over dp ranks of each replica's grad
    for p, part in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(part.view_as(p))
