"""
Data parallelism, what the dp ranks share each step: each rank of a dp group samples and trains on
its own slice of the generation batch, and these few collectives put together what the whole batch
needs: every rank's rewards (the group statistics), sums of metrics and token counts (the loss
normalisers), the evaluation's completions in their order, and stop decisions taken by all ranks at
once (a rank that stopped alone would leave the others waiting in a collective), and the gradient
sum.

Every function is a no-op at dp size 1 (no process group). `groups` is tp.ParallelGroups.
Leaves out: overlapping communication with compute, sharded optimizer state (ZeRO).
Tested by tests/test_train.py (2 gloo processes) and tests/test_tp.py (the gradient sum).
"""

import torch
import torch.distributed as dist


def all_reduce(values: list[float], groups, device: torch.device, op=None) -> list[float]:
    """The elementwise sum (or `op`) of a list of floats over the dp ranks (through `device`: NCCL
    reduces device tensors)."""
    if groups.dp_group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=groups.dp_group)  # over dp ranks
    return t.tolist()


def reduce_metrics(m: dict, tokens: float, groups, device: torch.device) -> dict:
    """One optimizer iteration's metrics (grpo.accumulate's) over the dp ranks: the loss summed
    (each rank's is normalised by global counts), the min of *_min and the max of *_max, the rest
    means weighted by each rank's `tokens`; grad_norm, updated and finite are already global."""
    extremes = {k: -1 if k.endswith("_min") else 1 for k in sorted(m) if k[-4:] in ("_min", "_max")}
    keys = sorted(k for k in m if k not in ("loss", "tokens", "grad_norm", "updated", "finite",
                                            *extremes))
    sums = all_reduce([m["loss"], tokens] + [m[k] * tokens for k in keys], groups, device)
    peaks = all_reduce([s * m[k] for k, s in extremes.items()], groups, device, dist.ReduceOp.MAX)
    return dict(loss=sums[0], grad_norm=m["grad_norm"], updated=m["updated"], finite=m["finite"],
                **{k: s / max(sums[1], 1.0) for k, s in zip(keys, sums[2:])},
                **{k: s * p for (k, s), p in zip(extremes.items(), peaks)})


def gather(t: torch.Tensor, groups) -> torch.Tensor:
    """Every dp rank's tensor, concatenated in dp-rank order (the same on every rank)."""
    if groups.dp_group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(groups.dp_size)]
    dist.all_gather(parts, t.contiguous(), group=groups.dp_group)  # DP: every rank's rows
    return torch.cat(parts)


def interleave(items: list, groups) -> list:
    """Every dp rank's share of a list split as items[dp_rank::dp_size], back in its order."""
    if groups.dp_group is None:
        return items
    shares = [None] * groups.dp_size
    dist.all_gather_object(shares, items, group=groups.dp_group)  # DP: every rank's share
    return [share[i] for i in range(len(shares[0])) for share in shares if i < len(share)]


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether any rank (dp and tp) raised the flag: a stop or continue decided together."""
    t = torch.tensor([float(flag)], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # over every rank of the world
    return bool(t.item())


def sum_grads(model: torch.nn.Module, groups) -> None:
    """Sums the trainable parameters' .grad over the dp group through one flat buffer: copy in, one
    all-reduce, copy out. SUM, not mean: train.py divides each loss by global counts (over the
    whole batch on all dp ranks), so the sum is the one-big-batch gradient. The buffer is one more
    copy of the grads while it lives (Megatron makes the grads views into it instead), so it lives
    only in this call: kept, it would sit through the rollout phase, where memory.py has released
    the grads. Trainable params must share one dtype."""
    if groups.dp_group is None:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # a missing grad sends zeros: every rank has the same layout
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in params])  # (all trainable numel,)
    dist.all_reduce(flat, group=groups.dp_group)  # DP: sum over dp ranks of each replica's grad
    for p, part in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(part.view_as(p))
