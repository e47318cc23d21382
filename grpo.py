"""
GRPO: group advantages, completion logprobs with the prompt computed once per group, and the loss.

A generation batch (GRPOBatch) is Bp prompts x G completions, prompt-major (prompt i owns rows
i*G .. i*G+G-1), held as the sampler returned them: device tensors of tokens and a mask, the
sampler's logprobs and the temperature it sampled at, which the trainer scores under (trl#4159: a
trainer at another temperature has ratio != 1 on-policy; here it cannot be set apart). Rewards
become advantages within each group. The trainer then scores the completions with the current
policy and minimises the clipped policy-gradient loss, micro-batch by micro-batch of whole groups,
mu times per generation batch (generate once per effective batch, TRL PR #3283).

Two memory tricks, each tested against its obvious slow twin in tests/test_grpo.py:
1. Shared prompt (TRL PR #2669, done exactly): each prompt is forwarded once, WITH grad, and its
   per-layer keys/values are recorded; each completion then attends to [its prompt's keys; its own
   keys] (model.SharedPrefixAttention: the G completions of a group folded into the query length
   against the one prompt K/V, never copied, no mask). Tokens forwarded: Bp*(P + G*Tr) instead of
   Bp*G*(P + Tr). The prompt stays in the graph, so the gradients of all G completions sum into
   it; a no-grad prompt (what #2669 first did) gives a truncated gradient. The two forwards
   alternate block by block (model.hidden_steps), so backward does too and a weight's prompt and
   completion gradients meet one block apart (the whole prompt first held a second copy of every
   block's weight gradients at the peak).
2. Chunked logprobs: final norm + lm_head + softmax + gather run a chunk of tokens at a time and
   each chunk's logits are rebuilt in backward, so the (tokens x V) logits never exist at once,
   forward or backward (Liger's fused loss makes the same trade). The default path is a custom
   autograd Function that keeps one log-sum-exp per token; a caller's logprob_fn (tp.py's
   vocab-parallel one) is wrapped in activation checkpointing instead. A chunk is sized in bytes
   of logits (chunk_rows): a token count fit for V = 16 is 200 MB at V = 49,152.

One contract for the three logprob routes (the plain logprobs_from_logits, the chunked
ChunkedSoftmaxLogprobs, tp.vocab_parallel_logprobs): each returns logp and the entropy
H = -sum p log p per token, BOTH differentiable (dH/dz = -p (log p + H)), so an entropy term in a
loss trains the same at any tensor-parallel size. The chunked Function does no entropy work in
backward when no loss uses it. completion_logprobs returns the entropy in the graph; accumulate
logs it and, with entropy_coef > 0, passes it to the loss as a bonus.

By default the math is TRL 1.16's GRPOTrainer (tests/test_grpo.py runs TRL's own code against
it): rewards summed over reward functions skipping None, (r - group mean) / (n-1 std + 1e-4),
k3 KL weighted by the ratio, TRL's loss normalisers (Dr. GRPO's constant is the sampler's
budget). One default differs on purpose: eps_high 0.28 (DAPO's clip-higher; TRL 0.2).

Leaves out: sampling (rollout.py), calling the reward functions (train.py), the optimizer step,
value models, packing.

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

from model import (CPU_FLASH, ModelConfig, SharedPrefixAttention, causal_attention,
                   repeated_prefix_attention)

# -----------------------------------------------------------------------------
# Config

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALES = ("group", "batch", "none")


@dataclass
class GRPOConfig:
    """The loss and its optimisation knobs. The group size, the sampling temperature and the
    completion budget are not here: they are the rollout's (RolloutConfig), and the batch carries
    what the sampler did (GRPOBatch), so the trainer cannot score another distribution."""
    loss_type: str = "dapo"           # token mean over the generation batch: micro-batch invariant
    scale: str = "group"              # advantage std: "group" (GRPO), "batch", "none" (Dr. GRPO)
    eps_low: float = 0.2              # ratio clipped below at 1 - eps_low
    eps_high: float = 0.28            # clip-higher (DAPO): more room for unlikely tokens to grow
    beta: float = 0.0                 # k3 KL weight; 0 means no reference model is needed
    use_bias_correction_kl: bool = True  # k3 KL times the ratio pi/pi_old, as TRL's default
    entropy_coef: float = 0.0         # entropy bonus: -coef * H per completion token (verl's)
    std_eps: float = 1e-4             # advantage = (r - mean) / (std + std_eps), TRL's 1e-4
    std_correction: int = 1           # 1: the n-1 (Bessel) std of TRL and verl; 0: population std
    mu: int = 1                       # optimizer steps per generation batch
    micro_batch_groups: int = 4       # whole groups per forward+backward (16's speed, 0.4x peak)
    chunk_bytes: int = 64 * 2**20     # logits bytes per logprob chunk (chunk_rows); 0 = unchunked

    def __post_init__(self):
        checks = [
            ("loss_type", self.loss_type in LOSS_TYPES, f"must be one of {LOSS_TYPES}"),
            ("scale", self.scale in SCALES, f"must be one of {SCALES}"),
            ("eps_low", 0 <= self.eps_low < 1, "must be in [0, 1): the lower clip 1 - eps_low > 0"),
            ("std_correction", self.std_correction in (0, 1), "must be 0 or 1"),
        ]
        for field in ("micro_batch_groups", "mu"):
            checks.append((field, getattr(self, field) >= 1, "must be >= 1"))
        for field in ("eps_high", "beta", "chunk_bytes", "std_eps", "entropy_coef"):
            checks.append((field, getattr(self, field) >= 0, "must be >= 0"))
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"GRPOConfig.{field} = {getattr(self, field)!r}: {why}")

# -----------------------------------------------------------------------------
# Rewards and advantages


def combine_rewards(per_function: Tensor, weights: list[float]) -> Tensor:
    """(N, F) rewards of F reward functions, NaN where one returned None -> (N,) weighted sums
    that skip the NaNs, as TRL sums them (nansum of weight * reward): a row is missing (NaN, left
    out of the advantage statistics) only when every function returned NaN."""
    shape = tuple(per_function.shape)
    if len(shape) != 2 or shape[1] == 0 or not per_function.is_floating_point():
        raise ValueError(f"per_function must be a float tensor (N, F) of N completions x F >= 1 "
                         f"reward functions, got {per_function.dtype} {shape}")
    if len(weights) != per_function.shape[1]:
        raise ValueError(f"weights has {len(weights)} entries for {per_function.shape[1]} reward "
                         f"functions (columns of per_function)")
    w = torch.tensor(weights, dtype=per_function.dtype, device=per_function.device)  # (F,)
    total = (per_function * w).nansum(1)  # (N,); nansum: a NaN reward adds nothing
    missing = per_function.isnan().all(1)  # (N,)
    return torch.where(missing, torch.nan, total)


def group_advantages(rewards: Tensor, num_samples: int, scale: str = "group",
                     std_eps: float = 1e-4, std_correction: int = 1) -> Tensor:
    """(N,) rewards, NaN for missing, prompt-major -> (N,) advantages r - mean(group), divided by
    the group std ("group"), the std of the whole batch's rewards ("batch") or nothing ("none"),
    plus std_eps. Stds are over valid rewards, sum((r - mean)^2) / (count - std_correction):
    1 is TRL's and verl's n-1 std, 0 the population std. A NaN reward is left out of every
    statistic and gets 0; an all-equal group, or one with a single valid reward, gets 0."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if num_samples < 1 or rewards.shape[0] % num_samples:
        raise ValueError(f"num_samples = {num_samples} must divide the number of rewards "
                         f"{rewards.shape[0]}")
    if scale not in SCALES:
        raise ValueError(f"scale = {scale!r} must be one of {SCALES}")
    if std_correction not in (0, 1):
        raise ValueError(f"std_correction = {std_correction!r} must be 0 (population std) or 1 "
                         f"(n-1)")
    r = rewards.double().view(-1, num_samples)  # (Bp, G)
    valid = ~torch.isnan(r)
    count = valid.sum(1, keepdim=True)  # (Bp, 1)
    mean = torch.where(valid, r, 0.0).sum(1, keepdim=True) / count.clamp_min(1)
    centred = torch.where(valid, r - mean, 0.0)
    # A single valid reward has r - mean = 0, so its std (NaN for n-1; TRL then zeroes the
    # advantage) can be anything finite: clamp_min(1) makes it 0.
    dof = (count - std_correction).clamp_min(1)  # (Bp, 1)
    std = (centred.pow(2).sum(1, keepdim=True) / dof).sqrt()
    # All-equal groups: r - mean may be 1e-17, not 0, after rounding; force an exact 0 (never NaN).
    r_max = torch.where(valid, r, -torch.inf).amax(1)  # (Bp,)
    r_min = torch.where(valid, r, torch.inf).amin(1)  # (Bp,)
    centred = torch.where((r_max > r_min)[:, None], centred, 0.0)
    if scale == "batch":  # centred by the group mean, scaled by the std of all valid rewards
        all_valid = r[valid]  # (n_valid,); empty when every reward is missing: std 0, not NaN
        n_valid = all_valid.numel()
        batch_mean = all_valid.sum() / max(n_valid, 1)
        std = ((all_valid - batch_mean).pow(2).sum() / max(n_valid - std_correction, 1)).sqrt()
    if scale != "none":
        centred = centred / (std + std_eps)
    return centred.view(-1).to(rewards.dtype)

# -----------------------------------------------------------------------------
# The generation batch, as the sampler returned it


def pad_right(seqs: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged token lists -> ids (B, T) right-padded with 0, lengths (B,)."""
    lens = [len(s) for s in seqs]
    T = max(lens, default=0)
    padded = [s + [0] * (T - len(s)) for s in seqs]
    ids = torch.tensor(padded, dtype=torch.long).reshape(len(seqs), T)  # (B, T)
    return ids.to(device), torch.tensor(lens, dtype=torch.long, device=device)


@dataclass
class GRPOBatch:
    """Bp prompts and their N = Bp*G completions, prompt-major, on the device: the sampler's tensors
    as they are (rollout.Rollout), plus what the step computed for them."""
    prompt_ids: Tensor                # (Bp, P) right-padded with 0
    prompt_lens: Tensor               # (Bp,)
    tokens: Tensor                    # (N, Tr) completion tokens, 0 after each row's end
    mask: Tensor                      # (N, Tr) bool: each row's tokens (a prefix of the row)
    temperature: float                # the sampler's: the trainer scores the same distribution
    max_new_tokens: int               # the completion budget: Dr. GRPO's constant normaliser
    advantages: Tensor | None = None  # (N,)
    sampler_logp: Tensor | None = None  # (N, Tr) the sampler's logprobs: the mismatch metric
    old_logp: Tensor | None = None    # (N, Tr) when mu > 1 (or another sampler); None: current
    ref_logp: Tensor | None = None    # (N, Tr) from the reference model when beta > 0

    @property
    def num_samples(self) -> int:  # G
        return self.tokens.shape[0] // max(self.prompt_ids.shape[0], 1)

    @classmethod
    def from_lists(cls, prompts: list[list[int]], completions: list[list[int]], *,
                   temperature: float = 1.0, max_new_tokens: int | None = None,
                   device: str | torch.device = "cpu", **tensors: Tensor) -> "GRPOBatch":
        """From ragged token lists (tests, benchmarks, a researcher's own data)."""
        prompt_ids, prompt_lens = pad_right(prompts, torch.device(device))
        tokens, lens = pad_right(completions, torch.device(device))
        mask = torch.arange(tokens.shape[1], device=tokens.device) < lens[:, None]  # (N, Tr)
        budget = max_new_tokens or max((len(c) for c in completions), default=1)
        return cls(prompt_ids, prompt_lens, tokens, mask, temperature, budget, **tensors)

    def lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """The prompts and completions as ragged Python lists (one host copy)."""
        prompts = [p[:n] for p, n in zip(self.prompt_ids.tolist(), self.prompt_lens.tolist())]
        lengths = self.mask.sum(1).tolist()
        return prompts, [c[:n] for c, n in zip(self.tokens.tolist(), lengths)]

    def groups(self, first: int, stop: int) -> "GRPOBatch":
        """Prompts first..stop-1 and their completions, cut to their own longest completion."""
        G = self.num_samples
        rows = slice(first * G, stop * G)
        Tr = int(self.mask[rows].sum(1).max()) if self.mask[rows].numel() else 0
        Tp = int(self.prompt_lens[first:stop].max())

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows, :Tr]
        return GRPOBatch(self.prompt_ids[first:stop, :Tp], self.prompt_lens[first:stop],
                         cut(self.tokens), cut(self.mask), self.temperature, self.max_new_tokens,
                         None if self.advantages is None else self.advantages[rows],
                         cut(self.sampler_logp), cut(self.old_logp), cut(self.ref_logp))

    def check(self) -> None:
        """One clear error for a batch whose rows, advantages or logprobs do not line up."""
        Bp, P = self.prompt_ids.shape
        N, Tr = self.tokens.shape
        if Bp == 0 or N % Bp:
            raise ValueError(f"batch.tokens has {N} rows for {Bp} prompts: expected G rows per "
                             f"prompt, prompt-major")
        if self.prompt_lens.shape != (Bp,) or not (self.prompt_lens >= 1).all():
            raise ValueError(f"batch.prompt_lens must be ({Bp},) lengths >= 1 (the first "
                             f"completion token needs a prompt position), got {self.prompt_lens}")
        if self.mask.shape != (N, Tr) or self.mask.dtype != torch.bool:
            raise ValueError(f"batch.mask must be a bool ({N}, {Tr}) tensor, got "
                             f"{self.mask.dtype} {tuple(self.mask.shape)}")
        if not self.temperature > 0:
            raise ValueError(f"batch.temperature = {self.temperature}: logprobs need a sampling "
                             f"temperature > 0")
        if self.advantages is not None and self.advantages.shape != (N,):
            raise ValueError(f"batch.advantages has shape {tuple(self.advantages.shape)}, "
                             f"expected ({N},)")
        for name in ("sampler_logp", "old_logp", "ref_logp"):
            t = getattr(self, name)
            if t is not None and t.shape != (N, Tr):
                raise ValueError(f"batch.{name} has shape {tuple(t.shape)}, expected ({N}, {Tr})")

# -----------------------------------------------------------------------------
# Chunked logprobs


def head_logits(model, h: Tensor, temperature: float) -> Tensor:
    """Final norm + lm_head, (n, C) -> (n, V) in float32 (or float64), divided by the temperature
    the way the sampler does, logits.float() / temperature: a mismatch gives ratio != 1 at mu = 1
    (trl#4159)."""
    logits = model.head(h).to(torch.promote_types(h.dtype, torch.float32))
    return logits if temperature == 1.0 else logits / temperature


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


class ChunkedSoftmaxLogprobs(torch.autograd.Function):
    """The default chunked path: h (n, C), targets (n,) -> logp (n,), entropy (n,). Forward keeps
    one log-sum-exp and one entropy per token; backward rebuilds each chunk's logits and applies
    d logp / dz = onehot - p and dH / dz = -p (log p + H) by hand: one lm_head matmul more than
    an unchunked pass, but fewer (n, V) passes than log_softmax + gather, and no rerun of the
    softmax as checkpoint would do."""

    @staticmethod
    def forward(ctx, h: Tensor, targets: Tensor, model, temperature: float, chunk_size: int,
                *params: Tensor):
        dtype = torch.promote_types(h.dtype, torch.float32)
        logp = torch.empty(h.shape[0], device=h.device, dtype=dtype)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = head_logits(model, h[rows], temperature)  # (n_chunk, V), no graph inside forward
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
        grad_params = [None] * len(params)
        for start in range(0, h.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            with torch.enable_grad():
                h_chunk = h[rows].detach().requires_grad_()
                z = head_logits(ctx.model, h_chunk, ctx.temperature)  # (n_chunk, V) rebuilt
            grad_z = softmax_grads(z.detach(), targets[rows], lse[rows], entropy[rows],
                                   None if grad_logp is None else grad_logp[rows],
                                   None if grad_entropy is None else grad_entropy[rows])
            grads = torch.autograd.grad(z, [h_chunk, *params], grad_z, allow_unused=True)
            grad_h[rows] = grads[0]
            # None: a parameter the head does not use
            grad_params = [new if acc is None else acc if new is None else acc.add_(new)
                           for acc, new in zip(grad_params, grads[1:])]
        return grad_h, None, None, None, None, *grad_params


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
        return ChunkedSoftmaxLogprobs.apply(h, targets, model, temperature, chunk_size, *params)

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

# -----------------------------------------------------------------------------
# Completion logprobs: shared prompt (exact) and its naive twin


def shared_prompt_attention(prompt_lens: Tensor, P: int, T: int, rep: int):
    """attention(q, k, v, prompt_k, prompt_v) -> (N, H, T, D) of the completions on their group's
    prompt K/V: model.SharedPrefixAttention on the CPU, its repeated-prompt twin elsewhere (a GPU
    route reading the prompt once per group is not written yet). Its masks are built once for all
    layers (in v's dtype: bf16 under autocast over fp32 weights): rep*T*T and Bp*P entries."""
    device = prompt_lens.device
    prompt_valid = torch.arange(P, device=device) < prompt_lens[:, None]  # (Bp, P)
    if device.type != "cpu" or not CPU_FLASH:
        return lambda q, k, v, pk, pv: repeated_prefix_attention(q, k, v, pk, pv, prompt_valid)
    arange = torch.arange(T, device=device)
    future = arange[:, None] < arange[None, :]  # (T, T)
    biases: dict[torch.dtype, tuple[Tensor, Tensor]] = {}

    def attend(q: Tensor, k: Tensor, v: Tensor, pk: Tensor, pv: Tensor) -> Tensor:
        # Under autocast v is the linears' bf16 while rope left q, k in the weights' fp32: the
        # flash kernel takes one dtype, v's (what autocast gives SDPA)
        q, k, pk, pv = (x.to(v.dtype) for x in (q, k, pk, pv))
        if q.dtype not in biases:
            prompt_bias = torch.zeros(prompt_valid.shape, dtype=q.dtype, device=device)
            prompt_bias = prompt_bias.masked_fill(~prompt_valid, -torch.inf)  # (Bp, P)
            own_bias = torch.zeros(T, T, dtype=q.dtype, device=device)
            own_bias = own_bias.masked_fill(future, -torch.inf).repeat(rep, 1)  # each head causal
            biases[q.dtype] = prompt_bias[:, None, None], own_bias[None, None]
        return SharedPrefixAttention.apply(q, k, v, pk, pv, *biases[q.dtype])
    return attend


def shared_prompt_hidden(model, prompt_ids: Tensor, prompt_lens: Tensor, inputs: Tensor,
                         G: int) -> Tensor:
    """Hidden states that predict each completion token: (N, T+1, C) for inputs (N, T) =
    completions without their last token. Row i's first state is its prompt's last valid position;
    the rest come from the completion forward on top of the prompt's keys/values, which stay in the
    graph. The two forwards alternate block by block (model.hidden_steps), so backward does too:
    each weight's completion gradient waits for its prompt gradient one block, not the whole
    completion backward (which held a second copy of the blocks' weight gradients)."""
    Bp, P = prompt_ids.shape
    kv: dict[int, tuple[Tensor, Tensor]] = {}

    def record_kv(layer: int, q: Tensor, k: Tensor, v: Tensor, last: Tensor | None = None):
        # (Bp, Hkv, P, D), with grad: all G completions backpropagate into the prompt
        kv[layer] = (k, v)
        return causal_attention(layer, q, k, v, last)  # right padding comes after valid tokens

    # Only the last valid position's state is read: the final block's queries and MLP run there
    # alone (its keys/values, and every earlier layer, still cover the whole prompt).
    prompt_steps = model.hidden_steps(prompt_ids, None, record_kv, last=prompt_lens - 1)
    T = inputs.shape[1]
    if T == 0:
        *_, last = prompt_steps
        return last[:, 0].repeat_interleave(G, 0)[:, None]  # (N, 1, C)
    positions = prompt_lens.repeat_interleave(G)[:, None] + torch.arange(T, device=inputs.device)
    config = model.config
    rep = config.num_attention_heads // config.num_key_value_heads
    attend = shared_prompt_attention(prompt_lens, P, T, rep)

    def attend_to_prompt(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q, k, v, *kv[layer])  # (N, H, T, D)

    completion_steps = model.hidden_steps(inputs, positions, attend_to_prompt)
    # zip steps the prompt's block i before the completions' block i (which reads its K/V)
    for last, h_completion in zip(prompt_steps, completion_steps):
        pass
    first = last[:, 0].repeat_interleave(G, 0)[:, None]  # (N, 1, C): N*C floats, not G copies
    return torch.cat([first, h_completion], 1)  # (N, T+1, C)


def naive_hidden(model, batch: "GRPOBatch") -> Tensor:
    """The slow twin: each prompt repeated G times in one causal forward. Returns (N, Tr, C), the
    states at positions len(prompt)-1+t, which predict completion token t."""
    prompts, completions = batch.lists()
    G = batch.num_samples
    Tr = batch.tokens.shape[1]
    device = batch.tokens.device
    ids, _ = pad_right([prompts[i // G] + c[:-1] for i, c in enumerate(completions)], device)
    h = model.hidden(ids)  # (N, L, C)
    prompt_lens = batch.prompt_lens.repeat_interleave(G)  # (N,)
    idx = prompt_lens[:, None] - 1 + torch.arange(Tr, device=device)  # (N, Tr)
    idx = idx.clamp(max=h.shape[1] - 1)
    return h.gather(1, idx[..., None].expand(-1, -1, h.shape[2]))  # (N, Tr, C)


def completion_logprobs(model, batch: "GRPOBatch", *, chunk_size: int = 1024,
                        logprob_fn: Callable | None = None,
                        shared_prompt: bool = True) -> tuple[Tensor, Tensor]:
    """Per-token logprobs of the batch's completions under the model, at the temperature they were
    sampled with: logp (N, Tr) float32 (float64 for a float64 model) and the entropy (N, Tr)
    (differentiable too), zeros where batch.mask is False. Works with grad and under no_grad."""
    if chunk_size < 0:
        raise ValueError(f"chunk_size = {chunk_size} must be >= 0 (0: unchunked)")
    N, Tr = batch.tokens.shape
    if shared_prompt:
        inputs = batch.tokens[:, :max(Tr - 1, 0)]  # (N, Tr-1): the last token predicts nothing
        h = shared_prompt_hidden(model, batch.prompt_ids, batch.prompt_lens, inputs,
                                 batch.num_samples)  # (N, Tr|1, C)
        h = h[:, :Tr]  # (N, Tr, C); Tr = 0 when every completion is empty
    else:
        h = naive_hidden(model, batch)  # (N, Tr, C)
    mask = batch.mask
    # Only valid tokens reach the head: the padding never costs a vocab-sized row.
    logp, entropy = chunked_logprobs(model, h[mask], batch.tokens[mask],
                                     temperature=batch.temperature, chunk_size=chunk_size,
                                     logprob_fn=logprob_fn)  # (n,), (n,)
    zeros = torch.zeros(N, Tr, dtype=logp.dtype, device=mask.device)
    entropy = zeros.index_put((mask,), entropy.to(logp.dtype))  # (N, Tr)
    return zeros.index_put((mask,), logp), entropy

# -----------------------------------------------------------------------------
# The loss


def grpo_loss(logp: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None, advantages: Tensor,
              mask: Tensor, cfg: GRPOConfig, *, num_seqs: int, num_tokens: int,
              max_completion_len: int, entropy: Tensor | None = None
              ) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of a micro-batch, logp/old_logp/ref_logp/mask (N, Tr),
    advantages (N,). num_seqs and num_tokens count the WHOLE generation batch (all micro-batches,
    all data-parallel ranks), so the micro-batch losses sum to the big-batch loss;
    max_completion_len is the sampler's budget (Dr. GRPO's constant). Pure: never modifies its
    inputs.

    Algorithmic choices:
    1. Per-token ratio exp(logp - old_logp); old_logp None means logp.detach() (mu = 1).
    2. PPO clip with clip-higher: -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A).
    3. KL to the reference (beta > 0) with the k3 estimator exp(ref - logp) - (ref - logp) - 1,
       per token, added to the loss (not folded into the reward). With use_bias_correction_kl
       (TRL's default, DeepSeek-V3.2) k3 is multiplied by the ratio, gradient included: the tokens
       were sampled from pi_old, and ratio * k3 estimates KL(pi || ref) under pi. It differs even
       at mu = 1, where the ratio's value is 1 but its gradient adds k3 * d logp.
    4. Aggregation: "grpo" mean over each sequence's tokens, then sum / num_seqs; "dapo" sum over
       tokens / num_tokens; "dr_grpo" sum over tokens / (num_seqs * max_completion_len). TRL's
       normalisers for grpo and dr_grpo are per micro-batch (its rows, divided again by the
       gradient accumulation steps): equal to these when micro-batches have the same number of
       rows. Where they do not (an uneven last micro-batch, uneven data-parallel ranks) ours stay
       the big batch's, by design; TRL's would weigh the rows of a smaller micro-batch more. dapo
       divides by the generation batch's tokens in both.
    5. Metrics over the micro-batch's valid tokens: clip_low (ratio < 1 - eps_low, A < 0) and
       clip_high (ratio > 1 + eps_high, A > 0), whose gradient the clip zeroes;
       ratio_mean/min/max; kl (the per-token term the loss adds, as TRL logs it) if ref_logp is
       given.
    6. Entropy bonus (entropy_coef > 0; verl's entropy_coeff, not in TRL): -coef * H per token,
       H (N, Tr) the policy's differentiable entropy (completion_logprobs), aggregated as the rest.
       It pays the policy to keep spreading its mass, against a collapse onto one answer before
       the reward has told the answers apart.
    """
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected "
                         f"({logp.shape[0]},)")
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError(f"ref_logp is None but beta = {cfg.beta} > 0 needs reference logprobs")
    if cfg.entropy_coef > 0 and (entropy is None or entropy.shape != logp.shape):
        got = None if entropy is None else tuple(entropy.shape)
        raise ValueError(f"entropy_coef = {cfg.entropy_coef} > 0 needs the entropy (N, Tr) of "
                         f"the policy, shape {tuple(logp.shape)}; got {got}")
    if num_seqs < 1 or num_tokens < 1 or max_completion_len < 1:
        raise ValueError(f"num_seqs = {num_seqs}, num_tokens = {num_tokens} and "
                         f"max_completion_len = {max_completion_len} must be >= 1")
    # With mu = 1 and old_logp = logp.detach() the ratio is exactly 1, so the loss VALUE is ~0
    # (-mean A), which is expected; its GRADIENT is still the policy gradient:
    # d exp(logp - logp.detach()) = d logp.
    old_logp = logp.detach() if old_logp is None else old_logp
    zero = torch.zeros_like(logp)
    # Zero the padding BEFORE exp: garbage there would give inf, and inf * 0 = NaN in backward.
    ratio = torch.exp(torch.where(mask, logp - old_logp, zero))  # (N, Tr)
    adv = advantages[:, None].to(logp.dtype)  # (N, 1)
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (N, Tr)
    kl = None
    if ref_logp is not None:
        delta = torch.where(mask, ref_logp - logp, zero)
        # k3 (N, Tr) >= 0: unbiased for KL(pi || ref) on tokens sampled from pi
        kl = torch.exp(delta) - delta - 1
        if cfg.use_bias_correction_kl:  # the tokens are pi_old's: reweight them to pi, with grad
            kl = kl * ratio
    if cfg.beta > 0:  # ref_logp is not None: checked above
        per_token = per_token + cfg.beta * kl
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    per_token = torch.where(mask, per_token, zero)
    if cfg.loss_type == "grpo":  # each sequence's token mean first: long completions weigh less
        per_token = per_token / mask.sum(1, keepdim=True).clamp_min(1)
    normaliser = {"grpo": num_seqs, "dapo": num_tokens,
                  "dr_grpo": num_seqs * max_completion_len}[cfg.loss_type]
    loss = per_token.sum() / normaliser
    with torch.no_grad():
        n = mask.sum().clamp_min(1)
        stats = {"loss": loss,
                 "clip_low": ((ratio < 1 - cfg.eps_low) & (adv < 0) & mask).sum() / n,
                 "clip_high": ((ratio > 1 + cfg.eps_high) & (adv > 0) & mask).sum() / n,
                 "ratio_mean": torch.where(mask, ratio, zero).sum() / n,
                 "ratio_min": torch.where(mask, ratio, torch.inf).amin(),
                 "ratio_max": torch.where(mask, ratio, -torch.inf).amax()}
        if kl is not None:
            stats["kl"] = torch.where(mask, kl, zero).sum() / n
        # one host sync for all metrics
        values = torch.stack([v.float() for v in stats.values()]).tolist()
    return loss, dict(zip(stats, values))

# -----------------------------------------------------------------------------
# One pass over a generation batch, micro-batch by micro-batch


def micro_batches(batch: GRPOBatch, cfg: GRPOConfig) -> list[tuple[slice, GRPOBatch]]:
    """(rows, sub-batch) of each micro-batch of cfg.micro_batch_groups whole groups."""
    Bp = batch.prompt_ids.shape[0]
    G = batch.num_samples
    step = cfg.micro_batch_groups
    return [(slice(s * G, min(s + step, Bp) * G), batch.groups(s, min(s + step, Bp)))
            for s in range(0, Bp, step)]


@torch.no_grad()
def batch_logprobs(model, batch: GRPOBatch, cfg: GRPOConfig, *,
                   logprob_fn: Callable | None = None) -> Tensor:
    """Old or reference logprobs (N, Tr) without grad, one micro-batch at a time (the same slices
    accumulate uses), zeros off the mask. float32, or float64 for a float64 model (as
    completion_logprobs)."""
    batch.check()
    param = next(model.parameters())
    dtype = torch.promote_types(param.dtype, torch.float32)
    out = torch.zeros(batch.tokens.shape, device=batch.tokens.device, dtype=dtype)  # (N, Tr)
    chunk = chunk_rows(cfg.chunk_bytes, model.config.vocab_size, param.dtype)
    for rows, micro in micro_batches(batch, cfg):
        logp, _ = completion_logprobs(model, micro, chunk_size=chunk, logprob_fn=logprob_fn)
        out[rows, :logp.shape[1]] = logp
    return out


def accumulate(model, batch: GRPOBatch, cfg: GRPOConfig, *, logprob_fn: Callable | None = None,
               num_seqs: int | None = None, num_tokens: int | None = None) -> dict[str, float]:
    """Forward, loss and backward over the generation batch in micro-batches of whole groups;
    grads accumulate into .grad (no zero_grad, no step). num_seqs/num_tokens default to this
    batch's counts; pass global counts under data parallelism. Returns "loss" (the summed, i.e.
    big-batch, loss), token-weighted means of the other metrics (with "entropy", and
    "sampler_logp_diff" = mean |logp - sampler_logp| when the batch has the sampler's logprobs),
    the min/max of ratio_min/ratio_max, and "tokens" (this batch's valid tokens)."""
    batch.check()
    if batch.advantages is None:
        raise ValueError("batch.advantages is None: accumulate needs one advantage per row")
    num_seqs = batch.tokens.shape[0] if num_seqs is None else num_seqs
    num_tokens = int(batch.mask.sum()) if num_tokens is None else num_tokens
    totals: dict[str, float] = {}
    tokens_seen = 0.0  # valid completion tokens of the micro-batches so far: the metrics' weights
    chunk = chunk_rows(cfg.chunk_bytes, model.config.vocab_size, next(model.parameters()).dtype)
    for _, micro in micro_batches(batch, cfg):
        logp, entropy = completion_logprobs(model, micro, chunk_size=chunk,
                                            logprob_fn=logprob_fn)  # (n_rows, Tr_micro)
        mask = micro.mask
        loss, metrics = grpo_loss(logp, micro.old_logp, micro.ref_logp, micro.advantages, mask,
                                  cfg, num_seqs=num_seqs, num_tokens=max(num_tokens, 1),
                                  max_completion_len=batch.max_new_tokens, entropy=entropy)
        loss.backward()
        tokens = float(mask.sum())
        with torch.no_grad():
            metrics["entropy"] = float((entropy * mask).sum()) / max(tokens, 1.0)
            if micro.sampler_logp is not None:  # the health check of the whole engine
                diff = (logp - micro.sampler_logp).abs() * mask
                metrics["sampler_logp_diff"] = float(diff.sum()) / max(tokens, 1.0)
        for key, value in metrics.items():
            prev = totals.get(key)
            if key == "ratio_min":
                totals[key] = value if prev is None else min(prev, value)
            elif key == "ratio_max":
                totals[key] = value if prev is None else max(prev, value)
            elif key == "loss":  # a plain sum: already normalised by the batch counts
                totals[key] = (prev or 0.0) + value
            else:  # token-weighted sums
                totals[key] = (prev or 0.0) + value * tokens
        tokens_seen += tokens
    out = {k: v if k in ("loss", "ratio_min", "ratio_max") else v / max(tokens_seen, 1.0)
           for k, v in totals.items()}
    out["tokens"] = tokens_seen
    return out
