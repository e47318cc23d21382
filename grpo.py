"""
GRPO: group advantages, completion logprobs with the prompt computed once per group, and the loss.

A generation batch (GRPOBatch) is Bp prompts x G completions, prompt-major (prompt i owns rows
i*G .. i*G+G-1), held as the sampler returned them: device tensors of tokens and a mask, the
sampler's logprobs and the temperature it sampled at, which the trainer scores under (trl#4159: a
trainer at another temperature has ratio != 1 on-policy; here it cannot be set apart). Rewards
become advantages within each group. The trainer then scores the completions with the current
policy and minimises the clipped policy-gradient loss, micro-batch by micro-batch of whole groups,
mu times per generation batch (generate once per effective batch, TRL PR #3283).

Three memory tricks, each tested against its obvious slow twin in tests/test_grpo.py:
1. Shared prompt (TRL PR #2669, done exactly): each prompt is forwarded once, WITH grad, and each
   completion attends to [its prompt's keys; its own keys], the prompt's K/V never copied per row.
   Tokens forwarded: Bp*P + R*Tc instead of R*(P + Tc). The prompt stays in the graph, so the
   gradients of all G completions sum into it; a no-grad prompt (what #2669 first did) gives a
   truncated gradient.
2. No padding (engine/packing.py): prompts and completions run packed in one row of valid tokens
   only, so each weight is used once and nothing (tokens x C)-sized is spent on padding; attention alone
   tells the segments apart. Micro-batches are whole groups, by count or up to a number of valid
   tokens (balanced_bins), and the normalisers are the whole generation batch's, so the split
   changes no loss and no gradient.
3. Chunked logprobs (engine/logprobs.py): the (tokens x V) logits never exist at once, forward or
   backward; logp and the entropy come back differentiable. A chunk is sized in bytes of logits
   (chunk_rows): a token count fit for V = 16 is 200 MB at V = 49,152.

By default the math is TRL 1.16's GRPOTrainer (tests/test_grpo.py runs TRL's own code against
it): rewards summed over reward functions skipping None, (r - group mean) / (n-1 std + 1e-4),
k3 KL weighted by the ratio, TRL's loss normalisers (Dr. GRPO's constant is the sampler's
budget). One default differs on purpose: eps_high 0.28 (DAPO's clip-higher; TRL 0.2). The loss
reads the GRPO term first (clipped_term: PPO's clipped ratio times the advantage), then each
variant of the family as a change to it, a GRPOConfig field each with TRL's name and semantics
(grpo_loss's numbered choices): GSPO's ratio per sequence, CISPO's term, two-sided clipping,
off-policy masking, high-entropy tokens, the sampler-mismatch correction, overlong filtering, the
KL and the aggregations (DAPO's, Dr. GRPO's); and, beyond TRL, dynamic sampling
(keep_informative, with train.py's extra rounds).

Leaves out: sampling (rollout.py), calling the reward functions (train.py), the optimizer step,
value models, the packed forward itself (engine/packing.py).

Shapes: Bp prompts, G rows per prompt (its group), R = Bp*G rows, P prompt length, Tc completion length,
n selected (valid) completion tokens, C width, V vocab (V/tp under tensor parallelism).
Papers: GRPO arXiv:2402.03300, DAPO arXiv:2503.14476, Dr. GRPO arXiv:2503.20783, GSPO
arXiv:2507.18071, CISPO (MiniMax-M1) arXiv:2506.13585, INTELLECT-2 arXiv:2505.07291,
DeepSeek-V3.2 arXiv:2512.02556, 80/20 entropy arXiv:2506.01939, Hydragen arXiv:2402.05099,
k3 KL estimator: http://joschu.net/blog/kl-approx.html.
Tested by tests/test_grpo.py; benchmarked by tests/bench_grpo.py.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.logprobs import chunk_rows, chunked_logprobs
from engine.packing import naive_hidden, packed_hidden, padded_hidden

# -----------------------------------------------------------------------------
# Config

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "cispo")
SCALES = ("group", "batch", "none")
LEVELS = ("token", "sequence")
CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class GRPOConfig:
    """The loss and its optimisation knobs; the group size, temperature and budget are the
    rollout's (RolloutConfig), carried by the batch. TRL's None (off) is inf here (delta,
    off_policy_mask_threshold, sampler_correction_max) or 0 (sampler_correction_min)."""
    loss_type: str = "dapo"           # token mean over the generation batch; cispo: MiniMax-M1
    scale: str = "group"              # advantage std: "group" (GRPO), "batch", "none" (Dr. GRPO)
    eps_low: float = 0.2              # ratio clipped below at 1 - eps_low
    eps_high: float = 0.28            # clip-higher (DAPO); cispo: the weight's cap (ScaleRL: 5)
    delta: float = math.inf           # two-sided clip (INTELLECT-2): ratio capped at delta; inf off
    importance_sampling_level: str = "token"  # "sequence": GSPO's one ratio per completion
    beta: float = 0.0                 # k3 KL weight; 0 means no reference model is needed
    use_bias_correction_kl: bool = True  # k3 KL times the ratio pi/pi_old, as TRL's default
    entropy_coef: float = 0.0         # entropy bonus -coef*H per token (verl's); fresh model: 0.2
    top_entropy_quantile: float = 1.0  # 80/20 rule (arXiv:2506.01939): top-q entropy tokens train
    mask_truncated_completions: bool = False  # DAPO overlong filtering: no loss without a stop id
    off_policy_mask_threshold: float = math.inf  # DeepSeek-V3.2 off-policy masking: KL bound
    sampler_correction: bool = True   # TRL's vLLM IS correction: weigh by trainer/sampler prob
    sampler_correction_mode: str = "sequence_mask"  # {token,sequence}_{truncate,mask} (TRL's)
    sampler_correction_max: float = 3.0  # correction ratio upper bound C_max (TRL's)
    sampler_correction_min: float = 0.0  # correction ratio lower bound C_min; 0 = none (TRL's)
    dynamic_sampling: int = 0         # DAPO: up to this many extra rollouts for all-equal groups
    std_eps: float = 1e-4             # advantage = (r - mean) / (std + std_eps), TRL's 1e-4
    std_correction: int = 1           # 1: the n-1 (Bessel) std of TRL and verl; 0: population std
    mu: int = 1                       # optimizer steps per generation batch
    micro_batch_groups: int = 4       # whole groups per forward+backward (16's speed, 0.4x peak)
    micro_batch_tokens: int = 0       # >0: whole groups up to this many valid tokens, balanced
    chunk_bytes: int = 64 * 2**20     # logits bytes per logprob chunk; 0 = unchunked; GPU: 1 GiB

    def __post_init__(self):
        choices = dict(loss_type=LOSS_TYPES, scale=SCALES, importance_sampling_level=LEVELS,
                       sampler_correction_mode=CORRECTION_MODES)
        checks = [(name, getattr(self, name) in allowed, f"must be one of {allowed}")
                  for name, allowed in choices.items()]
        checks += [
            ("eps_low", 0 <= self.eps_low < 1, "must be in [0, 1): the lower clip 1 - eps_low > 0"),
            ("eps_high", self.loss_type != "cispo" or self.eps_high >= 1,
             "caps cispo's importance weight (TRL's epsilon_high): below 1 it caps every "
             "on-policy weight; MiniMax-M1 and ScaleRL use 5 (pass --eps_high 5)"),
            ("std_correction", self.std_correction in (0, 1), "must be 0 or 1"),
            ("top_entropy_quantile", 0 <= self.top_entropy_quantile <= 1, "must be in [0, 1]"),
            ("sampler_correction_max", self.sampler_correction_max > self.sampler_correction_min,
             f"must be > sampler_correction_min = {self.sampler_correction_min}"),
        ]
        for field in ("micro_batch_groups", "mu"):
            checks.append((field, getattr(self, field) >= 1, "must be >= 1"))
        for field in ("eps_high", "beta", "chunk_bytes", "std_eps", "entropy_coef", "delta",
                      "sampler_correction_min", "dynamic_sampling", "micro_batch_tokens"):
            checks.append((field, getattr(self, field) >= 0, "must be >= 0"))
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"GRPOConfig.{field} = {getattr(self, field)!r}: {why}")

# -----------------------------------------------------------------------------
# Rewards and advantages


def combine_rewards(per_function: Tensor, weights: list[float]) -> Tensor:
    """(R, F) rewards of F reward functions, NaN where one returned None -> (R,) weighted sums
    that skip the NaNs, as TRL sums them (nansum of weight * reward): a row is missing (NaN, left
    out of the advantage statistics) only when every function returned NaN."""
    shape = tuple(per_function.shape)
    if len(shape) != 2 or shape[1] == 0 or not per_function.is_floating_point():
        raise ValueError(f"per_function must be a float tensor (R, F) of R completions x F >= 1 "
                         f"reward functions, got {per_function.dtype} {shape}")
    if len(weights) != per_function.shape[1]:
        raise ValueError(f"weights has {len(weights)} entries for {per_function.shape[1]} reward "
                         f"functions (columns of per_function)")
    w = torch.tensor(weights, dtype=per_function.dtype, device=per_function.device)  # (F,)
    total = (per_function * w).nansum(1)  # (R,); nansum: a NaN reward adds nothing
    missing = per_function.isnan().all(1)  # (R,)
    return torch.where(missing, torch.nan, total)


def group_advantages(rewards: Tensor, num_samples: int, scale: str = "group",
                     std_eps: float = 1e-4, std_correction: int = 1) -> Tensor:
    """(R,) rewards, NaN for missing, prompt-major -> (R,) advantages r - mean(group), divided by
    the group std ("group"), the std of the whole batch's rewards ("batch") or nothing ("none"),
    plus std_eps. Stds are over valid rewards, sum((r - mean)^2) / (count - std_correction):
    1 is TRL's and verl's n-1 std, 0 the population std. A NaN reward is left out of every
    statistic and gets 0; an all-equal group, or one with a single valid reward, gets 0."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (R,), got shape {tuple(rewards.shape)}")
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

def informative_groups(rewards: Tensor, num_samples: int) -> Tensor:
    """(R,) rewards, NaN where unscored -> (Bp,) bool: the groups whose scored rewards differ, the
    only ones with a gradient (DAPO's dynamic sampling keeps these)."""
    groups = rewards.view(-1, num_samples)  # (Bp, G)
    high = torch.where(groups.isnan(), -torch.inf, groups).amax(1)
    return high > torch.where(groups.isnan(), torch.inf, groups).amin(1)

# -----------------------------------------------------------------------------
# The generation batch, as the sampler returned it


def group_rows(groups: Tensor, G: int) -> Tensor:
    """(k,) group (prompt) indices -> (k*G,) their rows, prompt-major."""
    return (groups[:, None] * G + torch.arange(G, device=groups.device)).flatten()


def pad_right(seqs: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged token lists -> ids (B, T) right-padded with 0, lengths (B,)."""
    lens = [len(s) for s in seqs]
    T = max(lens, default=0)
    padded = [s + [0] * (T - len(s)) for s in seqs]
    ids = torch.tensor(padded, dtype=torch.long).reshape(len(seqs), T)  # (B, T)
    return ids.to(device), torch.tensor(lens, dtype=torch.long, device=device)


@dataclass
class GRPOBatch:
    """Bp prompts and their R = Bp*G completions, prompt-major, on the device: the sampler's tensors
    as they are (rollout.Rollout), plus what the step computed for them."""
    prompt_ids: Tensor                # (Bp, P) right-padded with 0
    prompt_lens: Tensor               # (Bp,)
    tokens: Tensor                    # (R, Tc) completion tokens, 0 after each row's end
    mask: Tensor                      # (R, Tc) bool: each row's tokens (a prefix of the row)
    temperature: float                # the sampler's: the trainer scores the same distribution
    max_new_tokens: int               # the completion budget: Dr. GRPO's constant normaliser
    advantages: Tensor | None = None  # (R,)
    sampler_logp: Tensor | None = None  # (R, Tc) the sampler's logprobs, of what it sampled from
    stopped: Tensor | None = None     # (R,) bool: the row ended with a stop id (else truncated)
    sampled: Tensor | None = None     # (R, Tc) bool: the sampled tokens, not a tool's (None: all)
    old_logp: Tensor | None = None    # (R, Tc) when mu > 1; None: the current policy's
    ref_logp: Tensor | None = None    # (R, Tc) from the reference model when beta > 0

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
        mask = torch.arange(tokens.shape[1], device=tokens.device) < lens[:, None]  # (R, Tc)
        budget = max_new_tokens or max((len(c) for c in completions), default=1)
        return cls(prompt_ids, prompt_lens, tokens, mask, temperature, budget, **tensors)

    @classmethod
    def from_rollout(cls, prompts: list[list[int]], out, max_new_tokens: int,
                     advantages: Tensor) -> "GRPOBatch":
        """rollout.Rollout's tensors as they are: tokens, mask, the sampler's logprobs, the stop
        flags and the temperature they were sampled at (the trainer scores the same)."""
        prompt_ids, prompt_lens = pad_right(prompts, out.tokens.device)
        return cls(prompt_ids, prompt_lens, out.tokens, out.mask, out.temperature, max_new_tokens,
                   advantages, sampler_logp=out.logprobs, stopped=out.stopped,
                   sampled=out.sampled)

    def lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """The prompts and completions as ragged Python lists (one host copy)."""
        prompts = [p[:n] for p, n in zip(self.prompt_ids.tolist(), self.prompt_lens.tolist())]
        lengths = self.mask.sum(1).tolist()
        return prompts, [c[:n] for c, n in zip(self.tokens.tolist(), lengths)]

    def groups(self, picked: Tensor) -> "GRPOBatch":
        """The groups `picked` ((k,) prompt indices, in that order) and their completions, cut to
        their own longest prompt and completion."""
        G = self.num_samples
        rows = group_rows(picked, G)  # (k*G,)
        Tc = int(self.mask[rows].sum(1).max()) if len(rows) else 0
        Tp = int(self.prompt_lens[picked].max())

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows, :Tc] if t.dim() == 2 else t[rows]
        return dataclasses.replace(
            self, prompt_ids=self.prompt_ids[picked, :Tp], prompt_lens=self.prompt_lens[picked],
            **{name: cut(getattr(self, name)) for name in ROW_TENSORS})

    def group_tokens(self) -> list[int]:
        """Each group's valid tokens: its prompt's and its G completions' (one host copy)."""
        completions = self.mask.sum(1).view(-1, self.num_samples).sum(1)  # (Bp,)
        return (self.prompt_lens + completions).tolist()

    def loss_mask(self, cfg: "GRPOConfig") -> Tensor:
        """(R, Tc) the tokens the loss counts: the sampled ones (a tool's observations are context
        only: no loss, entropy, ratio statistics or sampler correction, and not in the token
        normalisers), and with cfg.mask_truncated_completions (DAPO's overlong filtering) not those
        of rows that ended without a stop id."""
        if cfg.mask_truncated_completions and self.stopped is None:
            raise ValueError("mask_truncated_completions needs batch.stopped, each row's stop flag "
                             "(rollout.Rollout.stopped)")
        mask = self.mask if self.sampled is None else self.mask & self.sampled
        return mask & self.stopped[:, None] if cfg.mask_truncated_completions else mask

    def check(self) -> None:
        """One clear error for a batch whose rows, advantages or logprobs do not line up."""
        Bp, P = self.prompt_ids.shape
        R, Tc = self.tokens.shape
        if Bp == 0 or R % Bp:
            raise ValueError(f"batch.tokens has {R} rows for {Bp} prompts: expected G rows per "
                             f"prompt, prompt-major")
        if self.prompt_lens.shape != (Bp,) or not (self.prompt_lens >= 1).all():
            raise ValueError(f"batch.prompt_lens must be ({Bp},) lengths >= 1 (the first "
                             f"completion token needs a prompt position), got {self.prompt_lens}")
        if self.mask.shape != (R, Tc) or self.mask.dtype != torch.bool:
            raise ValueError(f"batch.mask must be a bool ({R}, {Tc}) tensor, got "
                             f"{self.mask.dtype} {tuple(self.mask.shape)}")
        if not self.temperature > 0:
            raise ValueError(f"batch.temperature = {self.temperature}: logprobs need a sampling "
                             f"temperature > 0")
        for name in ROW_TENSORS[2:]:
            t = getattr(self, name)
            shape = (R, Tc) if name.endswith("logp") or name == "sampled" else (R,)
            if t is not None and t.shape != shape:
                raise ValueError(f"batch.{name} has shape {tuple(t.shape)}, expected {shape}")


# The batch's per-row tensors, (R, ...): what groups() and cat_groups() cut and join.
ROW_TENSORS = ("tokens", "mask", "advantages", "sampler_logp", "stopped", "old_logp", "ref_logp",
               "sampled")


def cat_groups(parts: list[tuple[GRPOBatch, Tensor]]) -> GRPOBatch:
    """The groups picked from each batch ((k,) long group indices each), in order, as one batch,
    padded with zeros to the longest prompt and completion (dynamic sampling's join)."""
    G = parts[0][0].num_samples
    joined = {}
    for name in ("prompt_ids", "prompt_lens", *ROW_TENSORS):
        if getattr(parts[0][0], name) is None:
            continue  # None in the join too
        picked = [getattr(batch, name)[groups if name.startswith("prompt") else
                                       group_rows(groups, G)]
                  for batch, groups in parts]  # (k,) or (k*G,) rows each
        width = max(t.shape[-1] for t in picked)
        joined[name] = torch.cat([F.pad(t, (0, width - t.shape[1])) if t.dim() == 2 else t
                                  for t in picked])
    return dataclasses.replace(parts[0][0], **joined)


def keep_informative(rounds: list[tuple[GRPOBatch, Tensor]], target: int, first: int
                     ) -> GRPOBatch:
    """DAPO's dynamic sampling: the first `target` informative groups of the rounds, in order;
    each round is this rank's batch and every rank's flags (informative_groups), this rank's from
    `first` on. A rank left with none keeps one group (advantages 0: no gradient) to train."""
    parts = []
    for batch, flags in rounds:
        flags = flags & (torch.cumsum(flags, 0) <= target)  # (dp * Bp,)
        target -= int(flags.sum())
        parts.append((batch, flags[first:first + batch.prompt_ids.shape[0]].nonzero()[:, 0]))
    if not sum(len(groups) for _, groups in parts):
        parts = [(rounds[0][0], torch.zeros(1, dtype=torch.long, device=rounds[0][1].device))]
    return cat_groups(parts)

# -----------------------------------------------------------------------------
# Completion logprobs: the packed forward (engine/packing.py) or one of its twins

FORWARDS = ("packed", "padded", "naive")


def completion_logprobs(model, batch: "GRPOBatch", *, chunk_size: int = 1024,
                        logprob_fn: Callable | None = None,
                        forward: str = "packed") -> tuple[Tensor, Tensor]:
    """Per-token logprobs of the batch's completions under the model, at the temperature they were
    sampled with: logp (R, Tc) float32 (float64 for a float64 model) and the entropy (R, Tc)
    (differentiable too), zeros where batch.mask is False. Works with grad and under no_grad.
    `forward`: "packed" (valid tokens only, each prompt once per group: the engine's), or its
    twins "padded" (the same with prompts and rows padded) and "naive" (each prompt repeated)."""
    if chunk_size < 0:
        raise ValueError(f"chunk_size = {chunk_size} must be >= 0 (0: unchunked)")
    if forward not in FORWARDS:
        raise ValueError(f"forward = {forward!r} must be one of {FORWARDS}")
    R, Tc = batch.tokens.shape
    mask = batch.mask
    G = batch.num_samples
    if forward == "packed":
        h = packed_hidden(model, batch.prompt_ids, batch.prompt_lens, batch.tokens, mask,
                          G)  # (n, C): the valid tokens' states alone
    else:
        if forward == "padded":
            inputs = batch.tokens[:, :max(Tc - 1, 0)]  # (R, Tc-1): the last predicts nothing
            h = padded_hidden(model, batch.prompt_ids, batch.prompt_lens, inputs,
                              G)[:, :Tc]  # (R, Tc, C); Tc = 0 when every completion is empty
        else:
            h = naive_hidden(model, *batch.lists(), G, mask.device)  # (R, Tc, C)
        h = h[mask]  # (n, C): only valid tokens reach the head, never a vocab-sized padding row
    logp, entropy = chunked_logprobs(model, h, batch.tokens[mask],
                                     temperature=batch.temperature, chunk_size=chunk_size,
                                     logprob_fn=logprob_fn)  # (n,), (n,)
    zeros = torch.zeros(R, Tc, dtype=logp.dtype, device=mask.device)
    entropy = zeros.index_put((mask,), entropy.to(logp.dtype))  # (R, Tc)
    return zeros.index_put((mask,), logp), entropy

# -----------------------------------------------------------------------------
# The loss: the GRPO term first, then each variant as a change to it


def check_loss_inputs(logp: Tensor, advantages: Tensor, cfg: GRPOConfig, counts: dict[str, int],
                      **tensors: Tensor | None) -> None:
    """One clear error for inputs grpo_loss cannot use."""
    for name, t in tensors.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected "
                         f"({logp.shape[0]},)")
    needs = dict(ref_logp=("beta", cfg.beta > 0), entropy=("entropy_coef", cfg.entropy_coef > 0))
    if cfg.top_entropy_quantile < 1:
        needs["entropy"] = ("top_entropy_quantile", True)
    for name, (knob, needed) in needs.items():
        if needed and tensors[name] is None:
            raise ValueError(f"{name} is None but {knob} = {getattr(cfg, knob)} needs it")
    if min(counts.values()) < 1:
        raise ValueError(", ".join(f"{k} = {v}" for k, v in counts.items()) + " must be >= 1")


def ratio_stats(name: str, ratio: Tensor, units: Tensor, **flags: Tensor) -> dict[str, Tensor]:
    """{name}_mean/_min/_max of ratio and the share of each flag over units (bool, broadcast)."""
    n = units.sum().clamp_min(1)
    stats = {f"{name}_mean": torch.where(units, ratio, 0.0).sum() / n,
             f"{name}_min": torch.where(units, ratio, torch.inf).amin(),
             f"{name}_max": torch.where(units, ratio, -torch.inf).amax()}
    return stats | {key: (flag & units).sum() / n for key, flag in flags.items()}


def log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log(pi / pi_old) per token (R, Tc), 0 on the padding: zeroed BEFORE exp, since garbage
    there would give inf, and inf * 0 = NaN in backward."""
    return torch.where(mask, logp - old_logp, 0.0)


def clipped_term(ratio: Tensor, adv: Tensor, cfg: GRPOConfig, units: Tensor
                 ) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO term, PPO's clipped surrogate: -min(r A, clamp(r, 1 - eps_low, 1 + eps_high) A)
    per token (R, Tc), ratio r (R, Tc), adv A (R, 1). eps_high above eps_low is DAPO's
    clip-higher; delta < inf is INTELLECT-2's two-sided clip, the unclipped r capped at delta
    (for A < 0 the term stops growing). Its metrics: the ratio's mean/min/max and the shares the
    clip holds (TRL's clip_ratio low/high, after delta's cap) over the units (valid tokens)."""
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    capped = ratio.clamp(max=cfg.delta)  # two-sided: inf leaves r as it is
    stats = ratio_stats("ratio", ratio, units, clip_low=(capped < 1 - cfg.eps_low) & (adv < 0),
                        clip_high=(capped > 1 + cfg.eps_high) & (adv > 0))
    return -torch.min(capped * adv, clipped * adv), stats


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's change to the ratio (importance_sampling_level "sequence"): one per completion,
    (R, 1), the exp of its tokens' mean log-ratio; the gradient flows through the mean."""
    return log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1)


def cispo_term(ratio: Tensor, adv: Tensor, logp: Tensor, cfg: GRPOConfig, units: Tensor
               ) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO's change to the term (MiniMax-M1, loss_type "cispo"): -sg(min(r, eps_high)) A logp,
    a clipped constant weight whose gradient -w A d logp is never zeroed (the clip zeroes a
    token's gradient in the GRPO term). clip_high: the share of A > 0 units over the cap."""
    stats = ratio_stats("ratio", ratio, units, clip_low=torch.zeros_like(units),
                        clip_high=(ratio > cfg.eps_high) & (adv > 0))
    return -ratio.clamp(max=cfg.eps_high).detach() * adv * logp, stats


def off_policy_keep(logp: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy masking: (R, 1), False for the rows with A < 0 whose mean
    log(pi_behaviour / pi) is over threshold (the sampler's logprobs, else old_logp's)."""
    kl = torch.where(mask, behaviour - logp.detach(), 0.0).nan_to_num(0.0)  # (R, Tc)
    mean_kl = kl.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1)  # (R, 1)
    return (adv >= 0) | (mean_kl <= threshold)


def high_entropy(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """The 80/20 rule (arXiv:2506.01939): (R, Tc), the valid tokens in this call's top quantile
    of entropy (in float32, as TRL), the only ones that train."""
    values = entropy.detach()[mask].float()  # (n,)
    threshold = torch.quantile(values, 1 - quantile) if len(values) else 0
    return (entropy.detach() * mask >= threshold) & mask


def sampler_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cfg: GRPOConfig
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """The sampler correction's weight pi_old / pi_sampler (TRL's vllm_importance_sampling_*),
    (R, Tc) or (R, 1), a constant; and the ratio's stats BEFORE its clamp or mask, with the share
    outside [min, max]."""
    # NaN (a token the sampler could not score) and the padding: log-ratio 0, weight 1 (TRL's).
    diff = torch.where(mask, old_logp.detach() - sampler_logp, 0.0).nan_to_num(0.0)  # (R, Tc)
    units = mask
    if cfg.sampler_correction_mode.startswith("sequence"):  # the product of its token ratios
        diff = diff.sum(1, keepdim=True)  # (R, 1)
        units = torch.ones_like(diff, dtype=torch.bool)  # every row, as TRL averages them
    ratio = diff.exp()
    low, high = cfg.sampler_correction_min, cfg.sampler_correction_max
    outside = (ratio < low) | (ratio > high)
    truncate = cfg.sampler_correction_mode.endswith("truncate")
    weights = ratio.clamp(low, high) if truncate else ratio.masked_fill(outside, 0.0)
    return weights, ratio_stats("sampler_ratio", ratio, units, sampler_corrected=outside)


def k3_kl(logp: Tensor, ref_logp: Tensor, ratio: Tensor, mask: Tensor, cfg: GRPOConfig) -> Tensor:
    """KL to the reference per token (R, Tc): k3 = exp(ref - logp) - (ref - logp) - 1 >= 0,
    unbiased for KL(pi || ref) under pi; times r with use_bias_correction_kl (TRL's default,
    DeepSeek-V3.2), gradient included: the tokens are pi_old's, and r k3 estimates it under pi."""
    delta = torch.where(mask, ref_logp - logp, torch.zeros_like(logp))
    kl = torch.exp(delta) - delta - 1
    return kl * ratio if cfg.use_bias_correction_kl else kl


def grpo_loss(logp: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None, advantages: Tensor,
              mask: Tensor, cfg: GRPOConfig, *, num_seqs: int, num_tokens: int,
              max_completion_len: int, entropy: Tensor | None = None,
              sampler_logp: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The loss of a micro-batch: logp, old_logp, ref_logp, mask, entropy, sampler_logp (R, Tc),
    advantages (R,). num_seqs and num_tokens count the WHOLE generation batch (all micro-batches
    and dp ranks), so micro-batch losses sum to the big-batch loss; max_completion_len is the
    sampler's budget. Pure. Each choice is TRL 1.16's (tests/test_grpo.py runs TRL's code):
    1. The GRPO term (clipped_term): the ratio r = exp(logp - old_logp) per token, clipped;
       old_logp None means logp.detach() (mu = 1): value 1, gradient d logp. GSPO changes the
       ratio to one per sequence (sequence_log_ratio), CISPO the term (cispo_term).
    2. Masks times the term, in TRL's order: off-policy rows (off_policy_keep; old_logp without
       sampler_logp), tokens below the top_entropy_quantile (high_entropy), and the sampler
       correction's weights (sampler_weights). Truncated completions (mask_truncated_completions,
       DAPO) are off the mask the caller passes.
    3. KL to the reference (beta > 0): + beta * k3_kl per token.
    4. Entropy bonus (entropy_coef > 0; verl's): -coef * H per token of the entropy mask.
    5. Aggregation: "grpo" each sequence's token mean, summed / num_seqs; "dapo" and "cispo" sum
       / num_tokens; "dr_grpo" (Dr. GRPO) sum / (num_seqs * max_completion_len). TRL's grpo and
       dr_grpo normalisers are per micro-batch: the same for equal micro-batches (ours weigh the
       rows of an uneven one like the others).
    6. Metrics: the term's ratio stats, sampler_weights' (before its clamp), off_policy_masked,
       kl."""
    counts = dict(num_seqs=num_seqs, num_tokens=num_tokens, max_completion_len=max_completion_len)
    check_loss_inputs(logp, advantages, cfg, counts, old_logp=old_logp, ref_logp=ref_logp,
                      mask=mask, entropy=entropy, sampler_logp=sampler_logp)
    old_logp = logp.detach() if old_logp is None else old_logp
    adv = advantages[:, None].to(logp.dtype)  # (R, 1)
    # 1. The GRPO term per token; GSPO's ratio per sequence, CISPO's term
    ratio_log, units = log_ratio(logp, old_logp, mask), mask  # (R, Tc)
    if cfg.importance_sampling_level == "sequence":
        ratio_log = sequence_log_ratio(ratio_log, mask)  # (R, 1)
        units = torch.ones_like(ratio_log, dtype=torch.bool)  # every row
    ratio = torch.exp(ratio_log)  # (R, Tc) or (R, 1)
    if cfg.loss_type == "cispo":
        per_token, stats = cispo_term(ratio, adv, logp, cfg, units)
    else:
        per_token, stats = clipped_term(ratio, adv, cfg, units)
    # 2. The masks
    if math.isfinite(cfg.off_policy_mask_threshold):
        behaviour = old_logp if sampler_logp is None else sampler_logp
        keep = off_policy_keep(logp, behaviour, adv, mask, cfg.off_policy_mask_threshold)
        per_token = per_token * keep
        stats["off_policy_masked"] = 1 - keep.double().mean()
    high = None
    if cfg.top_entropy_quantile < 1:
        high = high_entropy(entropy, mask, cfg.top_entropy_quantile)  # (R, Tc)
        per_token = per_token * high
    if sampler_logp is not None:  # the mismatch's stats are logged with the correction off too
        weights, correction = sampler_weights(old_logp, sampler_logp, mask, cfg)
        per_token = per_token * weights if cfg.sampler_correction else per_token
        stats.update(correction)
    # 3. KL, 4. entropy bonus
    zero = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp, ratio, mask, cfg)  # (R, Tc)
        stats["kl"] = torch.where(mask, kl, zero).sum() / mask.sum().clamp_min(1)
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * (entropy if high is None else entropy * high)
    # 5. Aggregation
    per_token = torch.where(mask, per_token, zero)  # (R, Tc): a sequence's term on its tokens
    if cfg.loss_type == "grpo":  # each sequence's token mean first: long completions weigh less
        per_token = per_token / mask.sum(1, keepdim=True).clamp_min(1)
    normaliser = {"grpo": num_seqs, "dapo": num_tokens, "cispo": num_tokens,
                  "dr_grpo": num_seqs * max_completion_len}[cfg.loss_type]
    loss = per_token.sum() / normaliser
    with torch.no_grad():
        stats = {"loss": loss, **stats}
        values = torch.stack([v.detach().float() for v in stats.values()]).tolist()  # one sync
    return loss, dict(zip(stats, values))

# -----------------------------------------------------------------------------
# One pass over a generation batch, micro-batch by micro-batch


def balanced_bins(sizes: list[int], cap: int) -> list[list[int]]:
    """Whole items (a group's valid tokens each) into bins of at most `cap` that carry about the
    same load: k bins (from ceil(sum / cap), one more while a bin of two or more items is over the
    cap), filled longest first, each item into the lightest bin (LPT scheduling: no bin exceeds
    the mean by more than the largest item that is not alone in it). Returns the bins, heaviest
    first."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    for k in range(max(1, -(-sum(sizes) // cap)), len(sizes) + 1):
        bins: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for i in order:
            lightest = loads.index(min(loads))
            bins[lightest].append(i)
            loads[lightest] += sizes[i]
        if all(len(b) == 1 or load <= cap for b, load in zip(bins, loads)):
            return [b for _, b in sorted(zip(loads, bins), key=lambda x: -x[0]) if b]
    return [[i] for i in order]


def micro_batches(batch: GRPOBatch, cfg: GRPOConfig) -> list[tuple[Tensor, GRPOBatch]]:
    """(rows, sub-batch) of each micro-batch: cfg.micro_batch_groups whole groups in order, or with
    cfg.micro_batch_tokens whole groups up to that many valid tokens (balanced_bins; a group
    larger than that alone). rows: (k*G,) indices of the sub-batch's rows in the batch."""
    Bp = batch.prompt_ids.shape[0]
    G = batch.num_samples
    device = batch.tokens.device
    if cfg.micro_batch_tokens:
        bins = balanced_bins(batch.group_tokens(), cfg.micro_batch_tokens)
    else:
        step = cfg.micro_batch_groups
        bins = [list(range(s, min(s + step, Bp))) for s in range(0, Bp, step)]
    out = []
    for groups in bins:
        picked = torch.tensor(sorted(groups), device=device)  # prompt-major within a micro-batch
        out.append((group_rows(picked, G), batch.groups(picked)))
    return out


@torch.no_grad()
def batch_logprobs(model, batch: GRPOBatch, cfg: GRPOConfig, *,
                   logprob_fn: Callable | None = None) -> Tensor:
    """Old or reference logprobs (R, Tc) without grad, one micro-batch at a time (the same slices
    accumulate uses), zeros off the mask. float32, or float64 for a float64 model (as
    completion_logprobs)."""
    batch.check()
    param = next(model.parameters())
    dtype = torch.promote_types(param.dtype, torch.float32)
    out = torch.zeros(batch.tokens.shape, device=batch.tokens.device, dtype=dtype)  # (R, Tc)
    chunk = chunk_rows(cfg.chunk_bytes, model.config.vocab_size, param.dtype)
    for rows, micro in micro_batches(batch, cfg):
        logp, _ = completion_logprobs(model, micro, chunk_size=chunk, logprob_fn=logprob_fn)
        out[rows, :logp.shape[1]] = logp
    return out


def accumulate(model, batch: GRPOBatch, cfg: GRPOConfig, *, logprob_fn: Callable | None = None,
               num_seqs: int | None = None, num_tokens: int | None = None,
               before_backward: Callable[[], None] | None = None) -> dict[str, float]:
    """Forward, loss and backward over the generation batch in micro-batches of whole groups;
    grads accumulate into .grad (no zero_grad, no step). num_seqs/num_tokens default to this
    batch's rows and loss tokens; pass global counts under data parallelism. Returns "loss" (the
    big-batch loss), the other metrics weighted by the micro-batches' tokens (rows for those
    grpo_loss takes per sequence), "entropy", "sampler_logp_diff" = mean |logp - sampler_logp|,
    the min of *_min and max of *_max, and "tokens" (this batch's loss tokens). before_backward()
    runs between each micro-batch's forward and its backward (train.py: memory's heap trim)."""
    batch.check()
    if batch.advantages is None:
        raise ValueError("batch.advantages is None: accumulate needs one advantage per row")
    num_seqs = batch.tokens.shape[0] if num_seqs is None else num_seqs
    num_tokens = int(batch.loss_mask(cfg).sum()) if num_tokens is None else num_tokens
    per_row = {"off_policy_masked"}  # TRL's sequence-level metrics average over rows
    if cfg.importance_sampling_level == "sequence":
        per_row |= {"clip_low", "clip_high", "ratio_mean"}
    if cfg.sampler_correction_mode.startswith("sequence"):
        per_row |= {"sampler_ratio_mean", "sampler_corrected"}
    totals: dict[str, float] = {}
    seen = {"tokens": 0.0, "rows": 0.0}  # of the micro-batches so far: the metrics' weights
    chunk = chunk_rows(cfg.chunk_bytes, model.config.vocab_size, next(model.parameters()).dtype)
    for _, micro in micro_batches(batch, cfg):
        logp, entropy = completion_logprobs(model, micro, chunk_size=chunk,
                                            logprob_fn=logprob_fn)  # (n_rows, Tr_micro)
        mask = micro.loss_mask(cfg)
        loss, metrics = grpo_loss(logp, micro.old_logp, micro.ref_logp, micro.advantages, mask,
                                  cfg, num_seqs=num_seqs, num_tokens=max(num_tokens, 1),
                                  max_completion_len=batch.max_new_tokens, entropy=entropy,
                                  sampler_logp=micro.sampler_logp)
        if before_backward is not None:
            before_backward()
        loss.backward()
        weight = {"tokens": float(mask.sum()), "rows": float(mask.shape[0])}
        with torch.no_grad():
            metrics["entropy"] = float((entropy * mask).sum()) / max(weight["tokens"], 1.0)
            if micro.sampler_logp is not None:  # the health check of the whole engine
                diff = (logp - micro.sampler_logp).abs() * mask
                metrics["sampler_logp_diff"] = float(diff.sum()) / max(weight["tokens"], 1.0)
        for key, value in metrics.items():
            if key.endswith(("_min", "_max")):  # extremes over the micro-batches
                totals[key] = (min if key.endswith("_min") else max)(totals.get(key, value), value)
            else:  # the loss: a plain sum (normalised by the batch counts); the rest weighted
                w = 1.0 if key == "loss" else weight["rows" if key in per_row else "tokens"]
                totals[key] = totals.get(key, 0.0) + value * w
        seen = {unit: seen[unit] + weight[unit] for unit in seen}
    out = {k: v if k == "loss" or k.endswith(("_min", "_max")) else
           v / max(seen["rows" if k in per_row else "tokens"], 1.0) for k, v in totals.items()}
    out["tokens"] = seen["tokens"]
    return out
