"""
GRPO: group advantages, completion logprobs with the prompt computed once per group, and the loss.

A generation batch is Bp prompts x G completions, prompt-major (prompt i owns rows i*G .. i*G+G-1).
Rewards become advantages within each group. The trainer then scores the completions with the
current policy and minimises the clipped policy-gradient loss, micro-batch by micro-batch of whole
groups, mu times per generation batch (generate once per effective batch, TRL PR #3283).

Two memory tricks, each tested against its obvious slow twin in tests/test_grpo.py:
1. Shared prompt (TRL PR #2669, done exactly): each prompt is forwarded once, WITH grad, and its
   per-layer keys/values are recorded; the G completions then attend to them through
   model.prefix_attention (G rows folded into the query dimension, no G copies). Tokens forwarded:
   Bp*(P + G*Tr) instead of Bp*G*(P + Tr). The prompt stays in the graph, so the gradients of all G
   completions sum into it; a no-grad prompt (what #2669 first did) gives a truncated gradient.
2. Chunked logprobs: final norm + lm_head + softmax + gather run chunk_size tokens at a time and
   each chunk's logits are rebuilt in backward, so the (tokens x V) logits never exist at once,
   forward or backward (Liger's fused loss makes the same trade). The default path is a custom
   autograd Function that keeps one log-sum-exp per token; a caller's logprob_fn (tp.py's
   vocab-parallel one) is wrapped in activation checkpointing instead.

Leaves out: sampling (rollout.py), rewards (train.py), the optimizer step, value models, packing.

Shapes: Bp prompts, G samples per prompt, N = Bp*G rows, P prompt length, Tr completion length,
n selected (valid) completion tokens, C width, V vocab (V/tp under tensor parallelism).
Papers: GRPO arXiv:2402.03300, DAPO arXiv:2503.14476, Dr. GRPO arXiv:2503.20783, Hydragen
arXiv:2402.05099, k3 KL estimator: http://joschu.net/blog/kl-approx.html.
Tested by tests/test_grpo.py; benchmarked by tests/bench_grpo.py.
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model import causal_attention, prefix_attention

# -----------------------------------------------------------------------------
# Config

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALES = ("group", "batch", "none")


@dataclass
class GRPOConfig:
    num_samples: int = 8              # G completions per prompt
    loss_type: str = "dapo"           # "dapo": token mean over the generation batch, micro-batch invariant
    scale: str = "group"              # advantage std: "group" (GRPO), "batch", "none" (Dr. GRPO)
    eps_low: float = 0.2              # ratio clipped below at 1 - eps_low
    eps_high: float = 0.28            # clip-higher (DAPO): more room for unlikely tokens to grow
    beta: float = 0.0                 # k3 KL weight; 0 means no reference model is needed
    temperature: float = 1.0          # must equal the sampler's, or ratio != 1 at mu = 1 (trl#4159)
    chunk_size: int = 512             # completion tokens per logprob chunk (0 = unchunked twin)
    micro_batch_groups: int = 1       # whole groups per forward/backward
    mu: int = 1                       # optimizer steps per generation batch
    max_completion_len: int = 256     # Dr. GRPO's constant normaliser (per sequence)
    std_eps: float = 1e-4             # advantage = (r - mean) / (std + std_eps)
    entropy_coef: float = 0.0         # entropy bonus: loss -= coef * entropy per sampled position

    def __post_init__(self):
        checks = [("loss_type", self.loss_type in LOSS_TYPES, f"must be one of {LOSS_TYPES}"),
                  ("scale", self.scale in SCALES, f"must be one of {SCALES}"),
                  ("eps_low", 0 <= self.eps_low < 1, "must be in [0, 1): the lower clip 1 - eps_low stays > 0"),
                  ("temperature", self.temperature > 0, "must be > 0")]
        checks += [(f, getattr(self, f) >= 1, "must be >= 1") for f in ("num_samples", "micro_batch_groups", "mu",
                                                                         "max_completion_len")]
        checks += [(f, getattr(self, f) >= 0, "must be >= 0")
                   for f in ("eps_high", "beta", "chunk_size", "std_eps", "entropy_coef")]
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"GRPOConfig.{field} = {getattr(self, field)!r}: {why}")

# -----------------------------------------------------------------------------
# Advantages


def group_advantages(rewards: Tensor, num_samples: int, scale: str = "group", std_eps: float = 1e-4) -> Tensor:
    """(N,) rewards, NaN for missing, prompt-major -> (N,) advantages r - mean(group), divided by the
    group std ("group"), the batch std ("batch") or nothing ("none"). Stds are population stds over
    valid rewards. A NaN reward is left out of every statistic and gets 0; an all-equal group gets 0."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if num_samples < 1 or rewards.shape[0] % num_samples:
        raise ValueError(f"num_samples = {num_samples} must divide the number of rewards {rewards.shape[0]}")
    if scale not in SCALES:
        raise ValueError(f"scale = {scale!r} must be one of {SCALES}")
    r = rewards.double().view(-1, num_samples)  # (Bp, G)
    valid = ~torch.isnan(r)
    count = valid.sum(1, keepdim=True)  # (Bp, 1)
    mean = torch.where(valid, r, 0.0).sum(1, keepdim=True) / count.clamp_min(1)
    centred = torch.where(valid, r - mean, 0.0)
    std = (centred.pow(2).sum(1, keepdim=True) / count.clamp_min(1)).sqrt()
    # All-equal groups: r - mean may be 1e-17, not 0, after rounding; force an exact 0 (never NaN).
    r_max, r_min = torch.where(valid, r, -torch.inf).amax(1), torch.where(valid, r, torch.inf).amin(1)
    centred = torch.where((r_max > r_min)[:, None], centred, 0.0)
    if scale != "none":  # "batch": the std of the raw rewards over the whole batch (TRL's scale_rewards="batch")
        batch_std = r[valid].std(correction=0) if valid.any() else r.new_zeros(())
        centred = centred / ((std if scale == "group" else batch_std) + std_eps)
    return centred.view(-1).to(rewards.dtype)

# -----------------------------------------------------------------------------
# Chunked logprobs


def head_logits(model, h: Tensor, temperature: float) -> Tensor:
    """Final norm + lm_head, (n, C) -> (n, V) in float32 (or float64), divided by the temperature the
    way the sampler does, logits.float() / temperature: a mismatch gives ratio != 1 at mu = 1 (trl#4159)."""
    logits = model.head(h).to(torch.promote_types(h.dtype, torch.float32))
    return logits if temperature == 1.0 else logits / temperature


def logprobs_from_logits(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The plain twin: log_softmax + gather; entropy -sum(p log p), both differentiable.
    (n, V), (n,) -> (n,), (n,). tp.py's vocab-parallel function has the same signature, with logits
    (n, V/tp)."""
    logp_all = logits.log_softmax(-1)  # (n, V)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (n,)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


class ChunkedSoftmaxLogprobs(torch.autograd.Function):
    """The default chunked path: h (n, C), targets (n,) -> logp (n,), entropy (n,).
    Forward keeps one log-sum-exp per token; backward rebuilds each chunk's logits and applies
    d logp / d logits = onehot - softmax by hand: one lm_head matmul more than an unchunked pass,
    but fewer (n, V) passes than log_softmax + gather, and no rerun of the softmax as checkpoint
    would do. The entropy's gradient (an entropy bonus) is d H / d logits = -softmax * (log softmax
    + H); when nothing uses the entropy, backward gets None for it and skips that term."""

    @staticmethod
    def forward(ctx, h: Tensor, targets: Tensor, model, temperature: float, chunk_size: int, *params: Tensor):
        dtype = torch.promote_types(h.dtype, torch.float32)
        logp, entropy, lse = (torch.empty(h.shape[0], device=h.device, dtype=dtype) for _ in range(3))
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = head_logits(model, h[rows], temperature)  # (n_chunk, V), no graph inside forward
            row_max = z.amax(-1, keepdim=True)  # (n_chunk, 1)
            e = torch.sub(z, row_max).exp_()  # (n_chunk, V) unnormalised softmax, exp in place
            total = e.sum(-1)  # (n_chunk,)
            lse[rows] = row_max.squeeze(-1) + total.log()
            entropy[rows] = lse[rows] - (e[:, None] @ z[:, :, None]).view(-1) / total  # H = lse - E_p[z]
            logp[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
        ctx.model, ctx.temperature, ctx.chunk_size = model, temperature, chunk_size
        ctx.save_for_backward(h, targets, lse, entropy, *params)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        h, targets, lse, entropy, *params = ctx.saved_tensors
        grad_h, grad_params = torch.empty_like(h), [None] * len(params)
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        for start in range(0, h.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            with torch.enable_grad():
                h_chunk = h[rows].detach().requires_grad_()
                z = head_logits(ctx.model, h_chunk, ctx.temperature)  # (n_chunk, V) rebuilt
            g = grad_logp[rows, None].to(z.dtype)  # (n_chunk, 1)
            logp_all = torch.sub(z.detach(), lse[rows, None])  # (n_chunk, V)
            if grad_entropy is None:
                grad_z = logp_all.exp().mul_(-g)  # -g * softmax
            else:  # -softmax * (g + g_H * (log softmax + H))
                g_entropy = grad_entropy[rows, None].to(z.dtype)  # (n_chunk, 1)
                weight = (logp_all + entropy[rows, None]).mul_(g_entropy).add_(g)
                grad_z = logp_all.exp().mul_(weight).neg_()
            grad_z.scatter_add_(1, targets[rows, None], g)  # + g * onehot
            grads = torch.autograd.grad(z, [h_chunk, *params], grad_z, allow_unused=True)
            grad_h[rows] = grads[0]
            grad_params = [new if acc is None else acc if new is None else acc.add_(new)  # None: not in the head
                           for acc, new in zip(grad_params, grads[1:])]
        return grad_h, None, None, None, None, *grad_params


def chunked_logprobs(model, h: Tensor, targets: Tensor, *, temperature: float = 1.0, chunk_size: int = 512,
                     logprob_fn: Callable | None = None) -> tuple[Tensor, Tensor]:
    """logp and entropy (n,) of targets (n,) under softmax(model.head(h) / temperature), h (n, C), chunk_size
    rows at a time: at most one chunk of (chunk_size, V) logits is alive, forward or backward.
    chunk_size = 0 is the unchunked twin. logprob_fn (e.g. tp.py's) is checkpointed chunk by chunk."""
    if chunk_size == 0 or h.shape[0] == 0:
        return (logprob_fn or logprobs_from_logits)(head_logits(model, h, temperature), targets)
    if logprob_fn is None:
        params = [p for p in model.parameters() if p.requires_grad]  # those the head uses get grads
        return ChunkedSoftmaxLogprobs.apply(h, targets, model, temperature, chunk_size, *params)

    def one_chunk(h_chunk: Tensor, t_chunk: Tensor) -> tuple[Tensor, Tensor]:
        return logprob_fn(head_logits(model, h_chunk, temperature), t_chunk)

    # NOTE: chunks depend only on n, the same on all tensor-parallel ranks (same batch): a vocab-parallel
    # logprob_fn runs collectives, so all ranks must run the same chunks in the same order, backward too.
    parts = [checkpoint(one_chunk, h[s:s + chunk_size], targets[s:s + chunk_size], use_reentrant=False)
             if torch.is_grad_enabled() else one_chunk(h[s:s + chunk_size], targets[s:s + chunk_size])
             for s in range(0, h.shape[0], chunk_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (n,), (n,)

# -----------------------------------------------------------------------------
# Completion logprobs: shared prompt (exact) and its naive twin


def pad_right(seqs: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged token lists -> ids (B, T) right-padded with 0, lengths (B,)."""
    lens = [len(s) for s in seqs]
    T = max(lens, default=0)
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs], dtype=torch.long).reshape(len(seqs), T)
    return ids.to(device), torch.tensor(lens, dtype=torch.long, device=device)


def shared_prompt_hidden(model, prompt_ids: Tensor, prompt_lens: Tensor, inputs: Tensor, G: int) -> Tensor:
    """Hidden states that predict each completion token: (N, T+1, C) for inputs (N, T) = completions
    without their last token. Row i's first state is its prompt's last valid position; the rest come
    from the completion forward on top of the prompt's keys/values, which stay in the graph."""
    Bp, P = prompt_ids.shape
    kv: dict[int, tuple[Tensor, Tensor]] = {}

    def record_kv(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv[layer] = (k, v)  # (Bp, Hkv, P, D), with grad: all G completions backpropagate into the prompt
        return causal_attention(layer, q, k, v)  # right padding comes after the valid tokens: exact

    h_prompt = model.hidden(prompt_ids, None, record_kv)  # (Bp, P, C)
    last = h_prompt[torch.arange(Bp, device=prompt_ids.device), prompt_lens - 1]  # (Bp, C)
    first = last.repeat_interleave(G, 0)[:, None]  # (N, 1, C): N*C floats, not G prompt copies
    T = inputs.shape[1]
    if T == 0:
        return first
    arange = torch.arange(T, device=inputs.device)
    positions = prompt_lens.repeat_interleave(G)[:, None] + arange  # (N, T), continues each prompt
    prefix_valid = torch.arange(P, device=inputs.device) < prompt_lens[:, None]  # (Bp, P)
    own_allowed = arange[None, :, None] >= arange[None, None, :]  # (1, T, T) causal over own tokens

    def attend_to_prompt(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        prompt_k, prompt_v = kv[layer]
        return prefix_attention(q, k, v, own_allowed, prompt_k, prompt_v, prefix_valid)  # (N, H, T, D)

    h_completion = model.hidden(inputs, positions, attend_to_prompt)  # (N, T, C)
    return torch.cat([first, h_completion], 1)  # (N, T+1, C)


def naive_hidden(model, prompts: list[list[int]], completions: list[list[int]], G: int, Tr: int) -> Tensor:
    """The slow twin: each prompt repeated G times in one causal forward. Returns (N, Tr, C), the
    states at positions len(prompt)-1+t, which predict completion token t."""
    device = next(model.parameters()).device
    ids, _ = pad_right([prompts[i // G] + c[:-1] for i, c in enumerate(completions)], device)
    h = model.hidden(ids)  # (N, L, C)
    prompt_lens = torch.tensor([len(prompts[i // G]) for i in range(len(completions))], device=device)
    idx = (prompt_lens[:, None] - 1 + torch.arange(Tr, device=device)).clamp(max=h.shape[1] - 1)  # (N, Tr)
    return h.gather(1, idx[..., None].expand(-1, -1, h.shape[2]))  # (N, Tr, C)


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]], *, num_samples: int,
                        temperature: float = 1.0, chunk_size: int = 512, logprob_fn: Callable | None = None,
                        shared_prompt: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token logprobs of the completions under the model: logp (N, Tr) float32, entropy (N, Tr)
    (differentiable: an entropy bonus), mask (N, Tr) bool; zeros where mask is False. Works with
    grad and under no_grad.
    prompts has N/G entries, completions N (prompt-major, ragged)."""
    G = num_samples
    if G < 1 or len(completions) != len(prompts) * G:
        raise ValueError(f"completions has {len(completions)} entries; expected len(prompts) * num_samples "
                         f"= {len(prompts)} * {num_samples} (prompt-major rows)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: the first completion token needs a prompt position")
    if temperature <= 0 or chunk_size < 0:
        raise ValueError(f"temperature = {temperature} must be > 0 and chunk_size = {chunk_size} >= 0")
    device = next(model.parameters()).device
    comp_ids, comp_lens = pad_right(completions, device)  # (N, Tr), (N,)
    N, Tr = comp_ids.shape
    if shared_prompt:
        prompt_ids, prompt_lens = pad_right(prompts, device)  # (Bp, P), (Bp,)
        h = shared_prompt_hidden(model, prompt_ids, prompt_lens, comp_ids[:, :max(Tr - 1, 0)], G)  # (N, Tr|1, C)
        h = h[:, :Tr]  # (N, Tr, C); Tr = 0 when every completion is empty
    else:
        h = naive_hidden(model, prompts, completions, G, Tr)  # (N, Tr, C)
    mask = torch.arange(Tr, device=device) < comp_lens[:, None]  # (N, Tr)
    # Only valid tokens reach the head: the padding never costs a vocab-sized row.
    logp, entropy = chunked_logprobs(model, h[mask], comp_ids[mask], temperature=temperature,
                                     chunk_size=chunk_size, logprob_fn=logprob_fn)  # (n,), (n,)
    zeros = torch.zeros(N, Tr, dtype=logp.dtype, device=device)
    entropy = zeros.index_put((mask,), entropy.to(logp.dtype))  # (N, Tr)
    return zeros.index_put((mask,), logp), entropy, mask

# -----------------------------------------------------------------------------
# The loss


def grpo_loss(logp: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None, advantages: Tensor, mask: Tensor,
              cfg: GRPOConfig, *, num_seqs: int, num_tokens: int,
              entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of a micro-batch, logp/old_logp/ref_logp/mask (N, Tr), advantages (N,).
    num_seqs and num_tokens count the WHOLE generation batch (all micro-batches, all data-parallel
    ranks), so the micro-batch losses sum to the big-batch loss. Pure: never modifies its inputs.

    Algorithmic choices:
    1. Per-token ratio exp(logp - old_logp); old_logp None means logp.detach() (mu = 1).
    2. PPO clip with clip-higher: -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A).
    3. KL to the reference (beta > 0) with the k3 estimator exp(ref - logp) - (ref - logp) - 1,
       per token, added to the loss (not folded into the reward). An entropy bonus (entropy_coef
       > 0): - entropy_coef * entropy (N, Tr) of the policy at each sampled position, likewise.
    4. Aggregation: "grpo" mean over each sequence's tokens, then sum / num_seqs; "dapo" sum over
       tokens / num_tokens; "dr_grpo" sum over tokens / (num_seqs * max_completion_len).
    5. Metrics over the micro-batch's valid tokens: clip_low (ratio < 1 - eps_low, A < 0) and clip_high
       (ratio > 1 + eps_high, A > 0), whose gradient the clip zeroes; ratio_mean/min/max; kl if ref_logp
       is given. accumulate reports completion_logprobs' entropy.
    """
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({logp.shape[0]},)")
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError(f"ref_logp is None but beta = {cfg.beta} > 0 needs reference logprobs")
    if cfg.entropy_coef > 0 and (entropy is None or entropy.shape != logp.shape):
        raise ValueError(f"entropy_coef = {cfg.entropy_coef} > 0 needs the entropy, shaped like "
                         f"logp {tuple(logp.shape)}")
    if num_seqs < 1 or num_tokens < 1:
        raise ValueError(f"num_seqs = {num_seqs} and num_tokens = {num_tokens} must be >= 1")
    # With mu = 1 and old_logp = logp.detach() the ratio is exactly 1, so the loss VALUE is ~0 (-mean A),
    # which is expected; its GRADIENT is still the policy gradient: d exp(logp - logp.detach()) = d logp.
    old_logp = logp.detach() if old_logp is None else old_logp
    zero = torch.zeros_like(logp)
    # Zero the padding BEFORE exp: garbage there would give inf, and inf * 0 = NaN in backward.
    ratio = torch.exp(torch.where(mask, logp - old_logp, zero))  # (N, Tr)
    adv = advantages[:, None].to(logp.dtype)  # (N, 1)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)  # (N, Tr)
    delta = None if ref_logp is None else torch.where(mask, ref_logp - logp, zero)
    kl = None if delta is None else torch.exp(delta) - delta - 1  # k3: unbiased for KL(pi || ref), >= 0 per token
    if cfg.beta > 0:  # ref_logp is not None: checked above
        per_token = per_token + cfg.beta * kl
    if cfg.entropy_coef > 0:  # a bonus: higher entropy, lower loss
        per_token = per_token - cfg.entropy_coef * entropy
    per_token = torch.where(mask, per_token, zero)
    if cfg.loss_type == "grpo":  # each sequence's token mean first: long completions weigh less per token
        per_token = per_token / mask.sum(1, keepdim=True).clamp_min(1)
    normaliser = {"grpo": num_seqs, "dapo": num_tokens, "dr_grpo": num_seqs * cfg.max_completion_len}
    loss = per_token.sum() / normaliser[cfg.loss_type]
    with torch.no_grad():
        n = mask.sum().clamp_min(1)
        stats = {"loss": loss, "clip_low": ((ratio < 1 - cfg.eps_low) & (adv < 0) & mask).sum() / n,
                 "clip_high": ((ratio > 1 + cfg.eps_high) & (adv > 0) & mask).sum() / n,
                 "ratio_mean": torch.where(mask, ratio, zero).sum() / n,
                 "ratio_min": torch.where(mask, ratio, torch.inf).amin(),
                 "ratio_max": torch.where(mask, ratio, -torch.inf).amax()}
        if kl is not None:
            stats["kl"] = torch.where(mask, kl, zero).sum() / n
        values = torch.stack([v.float() for v in stats.values()]).tolist()  # one host sync for all metrics
    return loss, dict(zip(stats, values))

# -----------------------------------------------------------------------------
# One pass over a generation batch, micro-batch by micro-batch


@dataclass
class GRPOBatch:
    prompts: list[list[int]]          # Bp prompts
    completions: list[list[int]]      # N = Bp*G, prompt-major, ragged
    advantages: Tensor                # (N,)
    old_logp: Tensor | None = None    # (N, Tr) from batch_logprobs when mu > 1; None = current, detached
    ref_logp: Tensor | None = None    # (N, Tr) from the reference model when beta > 0


def micro_batches(num_prompts: int, cfg: GRPOConfig) -> list[tuple[slice, slice]]:
    """(prompt slice, row slice) of each micro-batch of cfg.micro_batch_groups whole groups."""
    step, G = cfg.micro_batch_groups, cfg.num_samples
    return [(slice(s, s + step), slice(s * G, (s + step) * G)) for s in range(0, num_prompts, step)]


@torch.no_grad()
def batch_logprobs(model, prompts: list[list[int]], completions: list[list[int]], cfg: GRPOConfig, *,
                   logprob_fn: Callable | None = None) -> Tensor:
    """Old or reference logprobs (N, Tr) without grad, one micro-batch at a time (the same slices
    accumulate uses), padded with zeros to the batch's longest completion."""
    Tr, device = max((len(c) for c in completions), default=0), next(model.parameters()).device
    out = torch.zeros(len(completions), Tr, device=device)
    for prompt_rows, rows in micro_batches(len(prompts), cfg):
        logp, _, _ = completion_logprobs(model, prompts[prompt_rows], completions[rows], num_samples=cfg.num_samples,
                                         temperature=cfg.temperature, chunk_size=cfg.chunk_size, logprob_fn=logprob_fn)
        out[rows, :logp.shape[1]] = logp
    return out


def accumulate(model, batch: GRPOBatch, cfg: GRPOConfig, *, logprob_fn: Callable | None = None,
               num_seqs: int | None = None, num_tokens: int | None = None) -> dict[str, float]:
    """Forward, loss and backward over the generation batch in micro-batches of whole groups; grads
    accumulate into .grad (no zero_grad, no step). num_seqs/num_tokens default to this batch's counts;
    pass global counts under data parallelism. Returns "loss" (the summed, i.e. big-batch, loss),
    token-weighted means of the other metrics, the min/max of ratio_min/ratio_max, and "entropy"."""
    N = len(batch.completions)
    if N != len(batch.prompts) * cfg.num_samples:
        raise ValueError(f"batch.completions has {N} entries, expected len(batch.prompts) * num_samples "
                         f"= {len(batch.prompts)} * {cfg.num_samples}")
    if batch.advantages.shape != (N,):
        raise ValueError(f"batch.advantages has shape {tuple(batch.advantages.shape)}, expected ({N},)")
    Tr = max((len(c) for c in batch.completions), default=0)
    for name, t in (("old_logp", batch.old_logp), ("ref_logp", batch.ref_logp)):
        if t is not None and t.shape != (N, Tr):
            raise ValueError(f"batch.{name} has shape {tuple(t.shape)}, expected ({N}, {Tr})")
    num_seqs = N if num_seqs is None else num_seqs
    num_tokens = sum(len(c) for c in batch.completions) if num_tokens is None else num_tokens
    totals: dict[str, float] = {}
    tokens_seen = 0.0  # valid completion tokens of the micro-batches so far: the metrics' weights
    for prompt_rows, rows in micro_batches(len(batch.prompts), cfg):
        logp, entropy, mask = completion_logprobs(
            model, batch.prompts[prompt_rows], batch.completions[rows], num_samples=cfg.num_samples,
            temperature=cfg.temperature, chunk_size=cfg.chunk_size, logprob_fn=logprob_fn)  # (n_rows, Tr_micro)
        T = logp.shape[1]  # the micro-batch's longest completion; the batch tensors are padded further
        old = None if batch.old_logp is None else batch.old_logp[rows, :T]
        ref = None if batch.ref_logp is None else batch.ref_logp[rows, :T]
        loss, metrics = grpo_loss(logp, old, ref, batch.advantages[rows], mask, cfg,
                                  num_seqs=num_seqs, num_tokens=max(num_tokens, 1),
                                  entropy=entropy if cfg.entropy_coef > 0 else None)
        loss.backward()
        tokens = float(mask.sum())
        metrics["entropy"] = float((entropy.detach() * mask).sum()) / max(tokens, 1.0)
        for key, value in metrics.items():
            prev = totals.get(key)
            if key in ("ratio_min", "ratio_max"):
                totals[key] = value if prev is None else (min if key == "ratio_min" else max)(prev, value)
            else:  # loss: a plain sum (already normalised by the batch counts); others: token-weighted sums
                totals[key] = (prev or 0.0) + (value if key == "loss" else value * tokens)
        tokens_seen += tokens
    return {k: v if k in ("loss", "ratio_min", "ratio_max") else v / max(tokens_seen, 1.0) for k, v in totals.items()}
