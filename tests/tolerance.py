"""A test helper: float32 tolerances from the arithmetic, not from one machine's rounding.

Two code paths that compute the same values in exact arithmetic (a cached decode step and a full
forward, a chunked head and a whole one, a fused kernel and plain ops) differ in float32 by their
rounding only, and by how much depends on the order of each sum: a CPU's vector width (AVX-512,
AVX2, none), oneDNN's blocking and the torch version pick that order. So a tolerance read off one
machine's output fails on another's. Here it comes from two numbers instead:

- depth: the terms summed along the longest chain of sums behind one value (model_depth counts
  them for a forward: each layer's matmul inner sizes plus the keys its attention sums, the head's
  width, and the vocabulary for a log-softmax);
- scale: the magnitude of what that chain sums at its end (the logits' for a logprob: a log-softmax
  subtracts two numbers of the logits' size, so its error is theirs whatever its own value).

The rounding errors of a chain's partial sums add like a random walk, whatever order it runs in:
about sqrt(depth) * eps * scale (eps = 2^-23), where depth * eps * scale is the worst case no real
run reaches. Two orders differ by up to twice one's error; FACTOR = 4 allows that with room, and
the same bound relative on top for values larger than scale.
"""

import math

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2^-23, one float32 ulp at 1
FACTOR = 4  # two paths' errors, each ~sqrt(depth)*eps*scale, with room


def model_depth(cfg, keys: int, out: str = "logprobs") -> int:
    """The float32 sums behind one value of a model with ModelConfig cfg attending to up to
    `keys` keys: per layer q/k/v (C terms), attention (keys), o_proj (H*D), gate/up (C), down
    (the SwiGLU width); then, for out "logits", the head (C), and for "logprobs" the log-softmax
    over the vocabulary (V). out "hidden": the residual stream before the final norm."""
    assert out in ("hidden", "logits", "logprobs"), out
    C, I = cfg.hidden_size, cfg.intermediate_size
    per_layer = C + keys + cfg.num_attention_heads * cfg.head_dim + C + I
    depth = cfg.num_hidden_layers * per_layer
    if out != "hidden":
        depth += C
    if out == "logprobs":
        depth += cfg.vocab_size
    return depth


def reordered(depth: int, scale: float = 1.0) -> dict:
    """torch.testing.assert_close's rtol and atol for float32 values computed in two summation
    orders (the module docstring): FACTOR * sqrt(depth) * eps, times scale as the absolute part."""
    rel = FACTOR * math.sqrt(depth) * EPS32
    if isinstance(scale, torch.Tensor):  # a reference's maximum, perhaps still in a graph
        scale = scale.detach()
    return dict(rtol=rel, atol=rel * float(scale))


def twins(depth: int, want) -> dict:
    """A float64 twin to 1e-12 (the same math, summation order only), a float32 one by
    reordered(depth) at want's magnitude."""
    if want.dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    return reordered(depth, want.abs().max())


def reordered_rel(depth: int) -> float:
    """The same bound as one relative number, for errors measured against a norm or a maximum
    (|a - b| / |b| of a whole gradient)."""
    return FACTOR * math.sqrt(depth) * EPS32


def grad_depth(cfg, keys: int, tokens: int) -> int:
    """The sums behind one gradient entry: the forward's chain to the loss, the backward's chain
    back (as long), and the sum over the `tokens` that feed a weight."""
    return 2 * model_depth(cfg, keys) + tokens
