"""
Chunked logprobs: per-token logprobs and entropies of targets under softmax(lm_head(h) / T), with
the (tokens x V) logits never alive at once, forward or backward (Liger's fused loss makes the same
trade). Final norm + lm_head + softmax + gather run chunk_size tokens at a time and each chunk's
logits but the last are rebuilt in backward. The default path is a custom autograd Function that
keeps one log-sum-exp and one entropy per token and adds the head's weight gradients straight into
.grad; a caller's logprob_fn (tp.py's vocab-parallel one) is wrapped in activation checkpointing
instead.

One contract for the three logprob routes (the plain logprobs_from_logits, the chunked
ChunkedSoftmaxLogprobs, tp.vocab_parallel_logprobs): each returns logp and the entropy
H = -sum p log p per token, BOTH differentiable (dH/dz = -p (log p + H)), so an entropy term in a
loss trains the same at any tensor-parallel size. The chunked Function does no entropy work in
backward when no loss uses it.

Leaves out: the hidden states (grpo.completion_logprobs computes them), the loss.
Shapes: n tokens, C width, V vocab (V/tp under tensor parallelism).
Tested by tests/test_grpo.py (chunked == unchunked, gradients in float64); benchmarked by
tests/bench_grpo.py.
"""

import contextlib
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def head_logits(model, h: Tensor, temperature: float, weight: Tensor | None = None) -> Tensor:
    """Final norm + lm_head, (n, C) -> (n, V) in float32 (or float64), divided by the temperature
    the way the sampler does, logits.float() / temperature: a mismatch gives ratio != 1 at mu = 1
    (trl#4159). weight: lm_head computes with it in place of its own (head_copy's cast)."""
    with lm_head_weight(model, weight):
        logits = model.head(h).to(torch.promote_types(h.dtype, torch.float32))
    return logits if temperature == 1.0 else logits / temperature


@contextlib.contextmanager
def lm_head_weight(model, weight: Tensor | None):
    """Inside the block, model.lm_head computes with `weight` in place of its own parameter (None:
    its own): the swap torch.func.functional_call makes around forward, here around model.head."""
    if weight is None:
        yield
        return
    params = model.lm_head._parameters
    own, params["weight"] = params["weight"], weight
    try:
        yield
    finally:
        params["weight"] = own


def logprobs_from_logits(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The plain twin: log_softmax + gather, and the entropy -sum(p log p), both differentiable.
    (n, V), (n,) -> (n,), (n,). tp.py's vocab-parallel function has the same signature, with
    logits (n, V/tp)."""
    logp_all = logits.log_softmax(-1)  # (n, V)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (n,)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def softmax_grads(z: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor,
                  grad_logp: Tensor | None, grad_entropy: Tensor | None) -> Tensor:
    """d(loss)/dz (n, V) for logits z (n, V) from the grads of logp and entropy (n,) (None: no
    loss uses it): g (onehot - p) - gH p (log p + H). Two (n, V) buffers without an entropy grad,
    three with one."""
    g = z.new_zeros(z.shape[0], 1) if grad_logp is None else grad_logp[:, None].to(z.dtype)
    log_p = torch.sub(z, lse[:, None])  # (n, V)
    if grad_entropy is None:
        grad_z = log_p.exp_().mul_(-g)  # -g p, in place
    else:
        p = log_p.exp()  # (n, V)
        g_entropy = grad_entropy[:, None].to(z.dtype)  # (n, 1)
        # -p (g + gH (log p + H)), in place on log p
        grad_z = log_p.add_(entropy[:, None]).mul_(g_entropy).add_(g).mul_(p).neg_()
    return grad_z.scatter_add_(1, targets[:, None], g)  # + g onehot


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The caller's autocast dtype on device_type, None where autocast is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def uncached_autocast(device_type: str, dtype: torch.dtype | None):
    """Autocast to dtype (None: off), without its cast-weight cache: forward's state, also in a
    backward called outside the autocast block (torch's advice for backward), where the rebuilt
    chunk must compute as forward did. NOTE a footgun: forward runs with grad off, so a cached
    bf16 copy of lm_head's weight made there has no graph, and torch 2.5 hands that copy to the
    backward's rebuild: the weight then gets no gradient at all."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def head_copy(model, device_type: str) -> Tensor | None:
    """lm_head's weight cast once to the autocast dtype, a leaf of its own, or None (no autocast,
    or a head that is not a plain bias-free nn.Linear: tensor parallelism's, whose forward runs a
    collective). Autocast would cast the (V, C) weight again for every chunk, forward and backward
    rebuild, and cast each chunk's (V, C) gradient back: 18 bytes a weight each chunk, against
    the 8 its bf16 matmuls read and write. ChunkedSoftmaxLogprobs computes every chunk with this
    one copy and adds each chunk's gradient of it into the weight's float32 .grad
    (add_copy_grad)."""
    lm_head = model.lm_head
    if (not torch.is_autocast_enabled(device_type) or type(lm_head) is not torch.nn.Linear
            or lm_head.bias is not None):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if lm_head.weight.dtype == dtype or not lm_head.weight.is_floating_point():
        return None
    return lm_head.weight.detach().to(dtype).requires_grad_(lm_head.weight.requires_grad)


def add_copy_grad(weight: Tensor, copy: Tensor) -> None:
    """copy.grad (one chunk's, in the copy's dtype) into weight.grad in weight's dtype, as
    autograd's cast and accumulation would: the same bits, in one pass."""
    if copy.grad is None:
        return
    if weight.grad is None:
        weight.grad = copy.grad.to(weight.dtype)
    else:
        weight.grad.add_(copy.grad)
    copy.grad = None


class ChunkedSoftmaxLogprobs(torch.autograd.Function):
    """The default chunked path: h (n, C), targets (n,) -> logp (n,), entropy (n,). Forward keeps
    one log-sum-exp and one entropy per token; backward rebuilds each chunk's logits and applies
    d logp / dz = onehot - p and dH / dz = -p (log p + H) by hand: fewer (n, V) passes than
    log_softmax + gather, and no rerun of the softmax as checkpoint would do. The last chunk's
    logits and graph are kept from forward (under grad) for backward, which they meet before
    anything else: no lm_head matmul more than an unchunked pass when one chunk holds all n."""

    @staticmethod
    def forward(ctx, h: Tensor, targets: Tensor, model, temperature: float, chunk_size: int,
                keep_last: bool, *params: Tensor):
        dtype = torch.promote_types(h.dtype, torch.float32)
        logp = torch.empty(h.shape[0], device=h.device, dtype=dtype)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        ctx.kept = None
        ctx.weight = head_copy(model, h.device.type)  # (V, C) bf16 under autocast, else None
        ctx.autocast = autocast_dtype(h.device.type)  # backward rebuilds chunks as forward ran
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            keep = keep_last and start + chunk_size >= h.shape[0]
            with torch.set_grad_enabled(keep), uncached_autocast(h.device.type, ctx.autocast):
                h_chunk = h[rows].detach().requires_grad_(keep)
                # (n_chunk, V), a graph if kept
                z = head_logits(model, h_chunk, temperature, ctx.weight)
            if keep:
                ctx.kept = start, h_chunk, z
                z = z.detach()
            row_max = z.amax(-1, keepdim=True)  # (n_chunk, 1)
            e = torch.sub(z, row_max).exp_()  # (n_chunk, V) unnormalised softmax, exp in place
            total = e.sum(-1)  # (n_chunk,)
            lse[rows] = row_max.squeeze(-1) + total.log()
            # H = lse - E_p[z]
            entropy[rows] = lse[rows] - (e[:, None] @ z[:, :, None]).view(-1) / total
            logp[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
        ctx.model = model
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(h, targets, lse, entropy, *params)
        # An output no loss uses gets None in backward, not zeros: no entropy work then.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        h, targets, lse, entropy, *params = ctx.saved_tensors
        grad_h = torch.empty_like(h)
        kept, ctx.kept = ctx.kept, None  # a second backward (retain_graph) rebuilds it too
        copy = ctx.weight  # forward's cast of lm_head's weight (its graph's, for a kept chunk)
        inputs = params if copy is None else [copy, *params]
        for start in range(0, h.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            if kept is not None and kept[0] == start:
                _, h_chunk, z = kept  # from forward
            else:
                with torch.enable_grad(), uncached_autocast(h.device.type, ctx.autocast):
                    h_chunk = h[rows].detach().requires_grad_()
                    z = head_logits(ctx.model, h_chunk, ctx.temperature, copy)  # (n_chunk, V)
            grad_z = softmax_grads(z.detach(), targets[rows], lse[rows], entropy[rows],
                                   None if grad_logp is None else grad_logp[rows],
                                   None if grad_entropy is None else grad_entropy[rows])
            # The head's weight grads go straight into .grad, chunk by chunk: returned, a (V, C)
            # lm_head grad would wait in autograd through the whole backward (a tied one for the
            # embedding's, the last node), one more V x C on top of every saved activation.
            torch.autograd.backward(z, grad_z, inputs=[h_chunk, *inputs])
            if copy is not None:
                add_copy_grad(ctx.model.lm_head.weight, copy)
            grad_h[rows] = h_chunk.grad
        return grad_h, None, None, None, None, None, *[None] * len(params)


def chunk_rows(chunk_bytes: int, vocab_size: int, dtype: torch.dtype) -> int:
    """Tokens per logprob chunk: as many rows of logits (V of them, in float32, or float64 for a
    float64 model: head_logits) as chunk_bytes holds, at least one; 0 stays 0 (unchunked). V is
    the full vocabulary: the same chunks on every tensor-parallel rank (chunked_logprobs' NOTE)."""
    row = vocab_size * torch.promote_types(dtype, torch.float32).itemsize
    return max(1, chunk_bytes // row) if chunk_bytes else 0


def chunked_logprobs(model, h: Tensor, targets: Tensor, *, temperature: float = 1.0,
                     chunk_size: int = 512,
                     logprob_fn: Callable | None = None) -> tuple[Tensor, Tensor]:
    """logp and entropy (n,) of targets (n,) under softmax(model.head(h) / temperature), h (n, C),
    chunk_size rows at a time: at most one chunk of (chunk_size, V) logits is alive, forward or
    backward. chunk_size = 0 is the unchunked twin. logprob_fn (e.g. tp.py's) is checkpointed
    chunk by chunk."""
    if chunk_size == 0 or h.shape[0] == 0:
        return (logprob_fn or logprobs_from_logits)(head_logits(model, h, temperature), targets)
    if logprob_fn is None:
        # those the head uses get grads
        params = [p for p in model.parameters() if p.requires_grad]
        return ChunkedSoftmaxLogprobs.apply(h, targets, model, temperature, chunk_size,
                                            torch.is_grad_enabled(), *params)

    def one_chunk(h_chunk: Tensor, t_chunk: Tensor) -> tuple[Tensor, Tensor]:
        return logprob_fn(head_logits(model, h_chunk, temperature), t_chunk)

    # NOTE: chunks depend only on n, the same on all tensor-parallel ranks (same batch): a
    # vocab-parallel logprob_fn runs collectives, so all ranks must run the same chunks in the same
    # order, backward too.
    parts = []
    for s in range(0, h.shape[0], chunk_size):
        h_chunk = h[s:s + chunk_size]
        t_chunk = targets[s:s + chunk_size]
        if torch.is_grad_enabled():
            parts.append(checkpoint(one_chunk, h_chunk, t_chunk, use_reentrant=False))
        else:
            parts.append(one_chunk(h_chunk, t_chunk))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (n,), (n,)
