"""
The draw: a (rows, V) logits tensor to one token per row and its logprob under the distribution it
was drawn from: the logits divided by the temperature, then top-k, then top-p (vLLM's order). That
logprob is what a trainer must reproduce for its ratio to be 1 on-policy (trl#4159: temperature;
trl#6789: top-p's truncated mass). No host sync, and two levels (a block of 256 ids drawn by its
float32 mass, then a token of it), so tokens far below float32's ulp near 1 are still drawn:
- CPU: inverse CDF, one float64 uniform per row (a short float64 scan of the block sums);
- CUDA: an exponential race, argmax of p / E with E ~ Exp(1) in float64: no scan and no search,
  only reductions (the float64 scan held 5% of an H100's decode step: docs/measurements.md; on
  the CPU the race is 2x slower, 2.6 against 1.2 ms at 128 x 49,152).
Both draw the same distribution (tests/test_rollout.py's goodness-of-fit test); the draws differ.
Logits holding NaN or +inf (or all -inf) give their row NaN probabilities: every route then draws
an id in range with a NaN logprob, which the rollout's check turns into one error naming the step
(rollout.NonFiniteLogits), never a silent token 0.
The race's clocks are drawn first (race_clocks) and the rest is a function of the logits and the
clocks alone (draw_raced), which torch.compile can trace (rollout.py compiles it beside a compiled
decode step); the CPU's default route draws by the inverse CDF, eagerly.

Leaves out: beam search, repetition penalties, min-p.
Shapes: rows, V vocab (V/tp after a vocab-parallel head: rollout gathers it first).
Tested by tests/test_rollout.py (and compiled, tests/test_graphs.py).
"""

import math

import torch
from torch import Tensor, nn

def filter_logits(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The logits of the distribution actually sampled from, (rows, V) float32: divided by the
    temperature (1 when greedy), then -inf outside the top-k, then outside the smallest set whose
    mass reaches top_p (taken after top-k, as vLLM does). log_softmax of this is what a trainer must
    use for ratio = 1."""
    x = logits.float()  # a float32 copy of bf16 logits; float32 logits themselves
    if temperature not in (0.0, 1.0):  # 0 is greedy: the logits as they are
        # In place on our own copy (one (rows, V) float32 less); never on the caller's logits.
        x = x.div_(temperature) if x is not logits else x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]  # (rows, 1); ties with the k-th are kept
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = x.softmax(dim=-1).sort(dim=-1, descending=True)
        # The mass before each token; 0 for the top one, which is always kept.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))  # back to vocabulary order
    return x


def draw(logits: Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """logits (rows, V) -> tokens (rows,), logprobs (rows,), no host sync: inverse-CDF sampling on
    the CPU, an exponential race on CUDA (module docstring). Greedy (temperature 0) returns the
    argmax's logprob under temperature 1 and the same masks: a point mass (logprob 0) is what no
    trainer forward reproduces."""
    if temperature == 0 or logits.is_cuda:
        return draw_raced(logits, temperature, top_k, top_p,
                            race_clocks(logits, temperature, generator))
    # The filtered copy (if any) is freed once softmaxed.
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)  # (rows, V)
    tokens = inverse_cdf(probs, torch.rand((probs.shape[0], 1), generator=generator,
                                           dtype=torch.float64, device=probs.device))
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()


def draw_raced(logits: Tensor, temperature: float, top_k: int, top_p: float,
                 clocks: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """draw() by the exponential race on clocks drawn beforehand (race_clocks; none when
    greedy): no generator inside, so torch.compile can trace it (rollout.py compiles it beside the
    decode step). logits (rows, V) -> tokens, logprobs (rows,)."""
    if temperature == 0:
        x = filter_logits(logits, temperature, top_k, top_p)
        tokens = x.argmax(dim=-1)
        return tokens, x.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)  # (rows, V)
    tokens = exponential_race(probs, *clocks)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()


def inverse_cdf(probs: Tensor, u: Tensor, block: int = 256) -> Tensor:
    """The first token whose cdf exceeds u * total: probs (rows, V), u (rows, 1) in [0, 1) float64
    -> tokens (rows,); never a masked token (0). In float64 (in float32, tokens below the cdf's ulp
    near 1 were never drawn), two levels: the cdf of block sums (rows, V/block), then of the block u
    falls in. The whole (rows, V) cdf (tests/test_rollout.py's slow twin) is a fresh 50 MB a step at
    128 x 49,152 (page faults) and a serial scan. Float32 block sums move u by ~1e-7 of a block."""
    rows, V = probs.shape
    B = math.gcd(V, block)  # a block size dividing V: no padded copy
    blocks = probs.view(rows, V // B, B)  # (rows, V/B, B)
    sums = blocks.sum(-1, dtype=torch.float32).double()  # (rows, V/B)
    cdf = nn.functional.pad(sums, (1, 0)).cumsum_(dim=-1)  # (rows, V/B + 1), from 0
    total = cdf[:, -1:]  # (rows, 1), 1 up to rounding
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # u < total
    # (rows, 1): the block holding u (cdf[0] = 0). The clamps change no valid row (u < total);
    # a row of NaN probabilities (NaN or inf logits) draws an id in range, its logprob NaN, which
    # the rollout's check reports, where a search past the end would index out of bounds.
    b = (torch.searchsorted(cdf, u, right=True) - 1).clamp_(0, V // B - 1)
    start, end = cdf.gather(-1, b), cdf.gather(-1, b + 1)  # start <= u < end
    inner = blocks.gather(1, b[:, :, None].expand(rows, 1, B))[:, 0].double().cumsum_(dim=-1)
    inner_total = inner[:, -1:]  # (rows, 1): the block's float64 mass, u's scale within it
    v = torch.minimum((u - start) / (end - start) * inner_total,
                      torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    return (b * B + torch.searchsorted(inner, v, right=True).clamp_(max=B - 1))[:, 0]


def race_clocks(logits: Tensor, temperature: float, generator: torch.Generator | None,
                block: int = 256) -> tuple[Tensor, ...]:
    """The exponential race's clocks for logits (rows, V), E ~ Exp(1) float64: one a block
    (rows, V/B), then one an id of the block drawn (rows, B); none when greedy."""
    if temperature == 0:
        return ()
    rows, V = logits.shape
    B = math.gcd(V, block)
    clocks = [torch.empty(shape, dtype=torch.float64, device=logits.device)
              for shape in ((rows, V // B), (rows, B))]
    return tuple(c.exponential_(generator=generator) for c in clocks)


def exponential_race(probs: Tensor, block_clocks: Tensor, clocks: Tensor) -> Tensor:
    """A token per row with probability probs / rowsum: probs (rows, V) -> tokens (rows,), never a
    masked token (0). Independent exponential clocks of rates p_i ring first at token i with
    probability p_i / sum(p): argmax p_i / E_i, E_i ~ Exp(1). In inverse_cdf's two levels (the race
    of the float32 block sums on block_clocks (rows, V/B), then of the block drawn on clocks
    (rows, B): race_clocks): V/B + B clocks a row, not V.
    Clocks in float64, as inverse_cdf's uniforms: at V/B + B per row they cost nothing.
    Tested against the distribution (goodness of fit) with inverse_cdf in tests/test_rollout.py."""
    rows, V = probs.shape
    B = clocks.shape[1]  # a block size dividing V: no padded copy
    blocks = probs.view(rows, V // B, B)  # (rows, V/B, B)
    b = race(blocks.sum(-1, dtype=torch.float32), block_clocks)  # (rows,): the block
    inner = blocks.gather(1, b[:, None, None].expand(rows, 1, B))[:, 0]  # (rows, B)
    return b * B + race(inner, clocks)


def race(weights: Tensor, clocks: Tensor) -> Tensor:
    """argmax of weights / clocks over the last dim, clocks E ~ Exp(1) float64 of weights' shape:
    (rows, n) -> (rows,). A zero weight never wins (E may be 0 on some builds: 0 / 0 would be NaN,
    which argmax picks)."""
    return torch.where(weights > 0, weights / clocks, -1.0).argmax(dim=-1)
