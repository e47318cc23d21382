"""
The sampler that stands in for vLLM: a preallocated KV cache, each prompt prefilled once, G samples
per prompt decoded on top of that one shared prompt KV, finished rows dropped as the batch runs.

1. Prefill: the Bp ragged prompts, longest first, right-padded, in chunks of `prefill_tokens`
   padded tokens (like lengths together: little padding; causal attention is exact for the valid
   positions, the pads come after them). Each layer's K/V is stored once per prompt, (Bp, Hkv, P,
   D).
2. Fan-out: each prompt's last-position logits are repeated G times and every row draws its own
   first token (nanochat once broadcast one first token to all G rows).
3. Decode (decode.py): the attention hook writes each row's key/value into its own completion KV
   and runs shared-prompt attention (attention.py): the G rows of a group are folded into the
   query dimension against the one prompt KV (Hydragen) and merged with the row's own keys by
   log-sum-exp. Prompt KV memory and reads / G. On the CPU the groups run in buckets of like
   prompt lengths (length_buckets), each reading its own prompts' keys: a short prompt's padding
   is not read.
4. Every `check_every` steps (the only host sync in the loop) rows that sampled a stop id are
   dropped: the linears run on the N active rows only; attention sees them in a Bp' x G' grid.
5. Sampling (sampling.py) without host sync; each returned logprob is under the distribution
   actually sampled from, after temperature, top-k, top-p (trl#4159, trl#6789: otherwise the GRPO
   ratio is not 1).
6. The result stays on the device as tensors: tokens, mask and logprobs (R, Tc). GRPO trains on
   them as they are; only the text for the rewards is decoded on the host (train.py).
With a tool (generate(episodes=...)), rows are multi-turn episodes: episodes.py runs the decode
loop, and a tool's answer is prefilled into the row's own KV cache (Decoder.extend).

Leaves out: paged KV and continuous batching (a GRPO rollout is one static batch), speculative
decoding, stop strings (stop ids only), prefix sharing across different prompts.
CPU: the prompt part goes through SDPA's fused kernel, whose log-sum-exp then enters the own
part's softmax as one more score: the same merge in fewer kernels
(decode.shared_prompt_attention_decode_cpu); float32 linears run on weights prepacked once per call
for oneDNN (_prepacked_linears).
CUDA: the decode step is a CUDA graph per layout of active rows (`cuda_graphs`); in bf16 / fp16 it
is compiled first, and the draw beside it (`compile_decode`: torch.compile, once for every layout,
its seconds in the stats' compile_seconds; graphs.py); the private KV cache is bf16.

Shapes: Bp prompts, G samples per prompt, R = Bp*G rows, N active rows, S = Bp'*G' slots of the
grid, P longest prompt, Tc completion length, C width, H/Hkv heads, D head dim, V vocab (V/tp when
the lm_head is split by tensor parallelism), L layers.
Tested by tests/test_rollout.py; benchmarked by tests/bench_rollout.py.
"""

import contextlib
import copy
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from decode import Decoder, KVCache  # noqa: F401 (rollout.KVCache: train.py, plan.py, memory's)
from episodes import Episodes, decode_episodes
from graphs import CompiledStep
from model import ModelConfig, causal_attention
from sampling import filter_logits, inverse_cdf, race_clocks, sample, sample_raced  # noqa: F401

# -----------------------------------------------------------------------------
# Config and result


@dataclass
class RolloutConfig:
    """The sampling knobs: the one home of each (GRPO scores under this same temperature)."""
    num_samples: int = 16           # G completions per prompt (the GRPO group)
    max_new_tokens: int = 0         # completion budget; 0 in train.py: the task's own (or 256)
    temperature: float = 1.0        # 0 = greedy (evaluation only: GRPO needs distinct samples)
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off; keeps the smallest set of tokens whose mass reaches p
    check_every: int = 8            # decode steps between the host syncs that drop finished rows
    prefill_tokens: int = 2048      # padded prompt tokens per prefill forward (bounds activations)
    cuda_graphs: bool = True        # capture the decode step on CUDA (ignored on the CPU)
    compile_decode: bool = True     # torch.compile the bf16/fp16 decode step and draw (CUDA, no TP)
    prepacked_linears: bool = True  # CPU, float32: linears via oneDNN, weights prepacked per call

    def __post_init__(self):
        checks = dict(num_samples=1, max_new_tokens=0, top_k=0, check_every=1, prefill_tokens=1)
        for name, low in checks.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):  # `not >=`: NaN too
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")


@dataclass
class Rollout:
    """Completions on the device, prompt-major: prompt i owns rows i*G .. i*G+G-1."""
    tokens: Tensor       # (R, Tc) long; each row's tokens, the stop token included, then 0
    mask: Tensor         # (R, Tc) bool; True on each row's tokens
    logprobs: Tensor     # (R, Tc) float32; under the distribution sampled from, 0 off the mask
    stopped: Tensor      # (R,) bool; the row ends with a stop id (else it hit max_new_tokens)
    temperature: float   # the distribution the trainer scores them under (trl#4159)
    stats: dict = field(default_factory=dict)
    policy: Tensor | None = None  # (R, Tc) bool; True on sampled tokens, False on a tool's
                                  # observations (episodes.py); None: every token was sampled

    def completions(self) -> list[list[int]]:
        """Each row's tokens as a Python list (one host copy): for decoding text and for tests."""
        lengths = self.mask.sum(1).tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), lengths)]

    def logprob_lists(self) -> list[list[float]]:
        lengths = self.mask.sum(1).tolist()
        return [row[:n] for row, n in zip(self.logprobs.tolist(), lengths)]

# -----------------------------------------------------------------------------
# generate


_PREPACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_PREPACK = _PREPACK if torch.backends.mkldnn.is_available() else None


@contextlib.contextmanager
def _prepacked_linears(model: torch.nn.Module, rows: int, enabled: bool):
    """Meanwhile each float32 nn.Linear of a CPU model runs through oneDNN on its weight reordered
    once (for `rows` rows) into the kernel's blocked layout (prepacked); F.linear (MKL) reorders
    it on every call, a large share of the matmul at decode's 128 rows. The cost: a second copy of
    the linear weights while it runs. Outputs equal F.linear's up to summation order (tests/test_rollout.py)."""
    linears = [m for m in model.modules()
               if enabled and _PREPACK is not None and type(m) is nn.Linear
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    try:
        for m in linears:  # an instance attribute shadows the class's forward
            m.forward = functools.partial(torch.ops.mkldnn._linear_pointwise, B=m.bias, attr="none",
                                          W=_PREPACK(m.weight.detach(), rows), scalars=[],
                                          algorithm="")  # (..., in) -> (..., out)
        yield
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)


def check_prompts(prompts: list[list[int]], stop_ids: tuple[int, ...], max_new_tokens: int,
                  model_config: ModelConfig) -> None:
    """One clear error for a prompt or stop id the model cannot take."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    vocab = model_config.vocab_size
    named = [(f"prompts[{i}]", p) for i, p in enumerate(prompts)] + [("stop_ids", stop_ids)]
    for name, ids in named:
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]!r} outside the vocabulary [0, {vocab})")
        if name == "stop_ids":
            continue
        if len(ids) == 0:
            raise ValueError(f"{name} is empty: every prompt needs at least one token")
        if len(ids) + max_new_tokens > model_config.max_position_embeddings:
            raise ValueError(f"{name} has {len(ids)} tokens + max_new_tokens={max_new_tokens} > "
                             f"the model's max_position_embeddings="
                             f"{model_config.max_position_embeddings}")


def prefill_chunks(lens: list[int], prefill_tokens: int) -> list[tuple[int, int]]:
    """(first, stop) runs of the prompts (longest first: generate sorts them), each up to
    prefill_tokens padded tokens at its first prompt's length, none under half of it (as
    length_buckets): a chunk holds like lengths and pads little."""
    chunks = []
    first = 0
    while first < len(lens):
        stop = first + 1
        while (stop < len(lens) and (stop - first + 1) * lens[first] <= prefill_tokens
               and 2 * lens[stop] >= lens[first]):
            stop += 1
        chunks.append((first, stop))
        first = stop
    return chunks


def _prefill(model: torch.nn.Module, prompts: list[list[int]], prompt_k: list[Tensor],
             prompt_v: list[Tensor], prefill_tokens: int, device: torch.device) -> Tensor:
    """Run the prompts a chunk at a time (prefill_chunks), right-padded to the chunk's longest (the
    views beyond stay zero, masked), storing each layer's K/V into the shared prompt views. Returns
    the logits (Bp, V) at each prompt's last position."""
    last_logits = []
    for first, stop in prefill_chunks([len(p) for p in prompts], prefill_tokens):
        part = prompts[first:stop]
        width = max(map(len, part))
        rows = slice(first, first + len(part))

        def store_kv(layer: int, q: Tensor, k: Tensor, v: Tensor, last: Tensor | None = None):
            # k, v (b, Hkv, width or more, D): sequence parallelism may pad the rows' ends
            prompt_k[layer][rows, :, :width] = k[:, :, :width]
            prompt_v[layer][rows, :, :width] = v[:, :, :width]
            return causal_attention(layer, q, k, v, last)
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in part], device=device)  # (b, P)
        last = torch.tensor([len(p) - 1 for p in part], device=device)  # final layer's queries
        h = model.hidden(tokens, None, store_kv, last)[:, 0]  # (b, C)
        last_logits.append(model.head(h))  # (b, V)
    return torch.cat(last_logits)  # (Bp, V)


def _cut_at_stop(tokens: Tensor, logprobs: Tensor, stop_ids: tuple[int, ...]) -> tuple[Tensor, ...]:
    """Each row ends at its first stop id (rows decode on until the next check): tokens, logprobs
    (R, T) -> tokens (R, Tc) with 0 after the end, mask, logprobs with 0 after the end, and
    stopped (R,); Tc is the longest row. One host sync (Tc)."""
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=tokens.device)
    is_stop = torch.isin(tokens, stop_t)  # (R, T)
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0  # strictly after the first stop
    mask = ~after_stop & (tokens >= 0)  # -1: never sampled (the row was dropped or all had stopped)
    Tc = int(mask.sum(1).max())
    mask = mask[:, :Tc]
    tokens = tokens[:, :Tc].masked_fill(~mask, 0)
    logprobs = logprobs[:, :Tc].masked_fill(~mask, 0.0)
    return tokens, mask, logprobs, (is_stop & ~after_stop).any(1)


def _carve(model: torch.nn.Module, cache: KVCache | None, num_prompts: int, G: int, P: int,
           new: int) -> tuple[list[Tensor], ...]:
    """The KV views of this call (a private cache when none is given: bf16 on the GPU, the model's
    dtype on the CPU). The kv heads are read off the weights: a tensor-parallel shard has Hkv/tp."""
    attn0 = model.model.layers[0].self_attn
    weight = attn0.k_proj.weight
    kv_heads = weight.shape[0] // attn0.head_dim
    shape = (model.config.num_hidden_layers, kv_heads, attn0.head_dim, num_prompts, G, P)
    if cache is None:
        kv_dtype = torch.bfloat16 if weight.is_cuda else weight.dtype
        cache = KVCache(KVCache.numel_for(*shape, new), kv_dtype, weight.device)
    return cache.carve(*shape, new)


@torch.inference_mode()
def generate(model: torch.nn.Module, prompts: list[list[int]], cfg: RolloutConfig | None = None,
             *, stop_ids: tuple[int, ...] = (), seed: int | None = None,
             cache: KVCache | None = None,
             logits_fn: Callable[[Tensor], Tensor] | None = None,
             episodes: Episodes | None = None) -> Rollout:
    """Sample cfg.num_samples completions of each prompt (the module docstring's steps 1-6).
    `cache` None allocates one for this call; seed None draws a fresh one (the global RNG is left
    alone). `logits_fn` maps every (rows, V') logits tensor before sampling (under tensor
    parallelism the all-gather of the vocab shards: every rank sees the same logits and, with the
    same seed, samples the same tokens). `episodes`: rows are multi-turn episodes with a tool
    (episodes.py); its respond() gets the caller's row ids."""
    started = time.perf_counter()
    cfg = cfg or RolloutConfig()
    stop_ids = tuple(stop_ids)
    check_prompts(prompts, stop_ids, cfg.max_new_tokens, model.config)
    # A logits_fn is tensor parallelism's vocab gather: tp.py's layers run their collectives in
    # autograd Functions (mark_dirty), which torch.compile does not trace: the step stays eager.
    compiled = cfg.compile_decode and logits_fn is None
    logits_fn = logits_fn or (lambda x: x)
    G = cfg.num_samples
    new = cfg.max_new_tokens
    # Longest prompt first (a stable sort: equal lengths keep their order): prefill chunks and
    # decode's attention buckets then hold like lengths. Rows go back to the caller's order at 6.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    prompts = [prompts[i] for i in order]
    lens = [len(p) for p in prompts]
    device = next(model.parameters()).device
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    out_tokens = torch.full((new, len(prompts) * G), -1, dtype=torch.long, device=device)  # (Tc, R)
    out_logprobs = torch.zeros(out_tokens.shape, dtype=torch.float32, device=device)
    policy = torch.ones(out_tokens.shape, dtype=torch.bool, device=device)  # False: observations
    stats = dict(prefill_tokens=sum(lens), prefill_seconds=0.0, decode_steps=0, row_steps=0,
                 compactions=0, prompt_kv_bytes=0, completion_kv_bytes=0, compiles=0,
                 compile_seconds=0.0)
    if new > 0:
        with _prepacked_linears(model, len(prompts) * G, cfg.prepacked_linears):
            views = _carve(model, cache, len(prompts), G, max(lens), new)
            # 1. Prefill each prompt once.
            logits = _prefill(model, prompts, views[0], views[1], cfg.prefill_tokens, device)
            if device.type == "cuda":
                torch.cuda.synchronize()  # one sync so that prefill_seconds means something
            stats["prefill_seconds"] = time.perf_counter() - started
            # 2. Fan out: each of the G rows of a prompt draws its own first token (logits_fn once
            # per prompt, then repeated).
            first = logits_fn(logits).repeat_interleave(G, dim=0)  # (R, V')
            out_tokens[0], out_logprobs[0] = sample(first, cfg.temperature, cfg.top_k, cfg.top_p,
                                                    generator)
            # 3-4. Decode, dropping finished rows.
            decoder = Decoder(model, views, lens, G, device.type == "cuda" and cfg.cuda_graphs,
                              compiled)
            # Beside a compiled step the draw is compiled too (its elementwise work fused): the
            # race's clocks are wound here, eagerly, as a traced graph holds no torch.Generator.
            sampler = None if decoder.compiled is None else CompiledStep(sample_raced)

            def draw(logits: Tensor) -> tuple[Tensor, Tensor]:  # (rows, V') -> tokens, logprobs
                logits = logits_fn(logits)
                if sampler is None:
                    return sample(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator)
                clocks = race_clocks(logits, cfg.temperature, generator)
                return sampler(logits, cfg.temperature, cfg.top_k, cfg.top_p, clocks)
            if episodes is None:
                stats.update(_decode(decoder, out_tokens, out_logprobs, draw, stop_ids,
                                     cfg.check_every))
            else:  # multi-turn rows: each at its own length (episodes.py)
                def respond(calls):  # the decoder's (sorted) row ids -> the caller's
                    return episodes.respond([(order[r // G] * G + r % G, t) for r, t in calls])
                stats.update(decode_episodes(decoder, out_tokens, out_logprobs, policy, draw,
                                             stop_ids, cfg.check_every,
                                             dataclasses.replace(episodes, respond=respond),
                                             model.config.vocab_size))
        if sampler is not None:  # graphs compiled in this call, and their seconds
            stats.update(compiles=decoder.compiled.compiles + sampler.compiles,
                         compile_seconds=decoder.compiled.seconds + sampler.seconds)
        nbytes = [sum(x.numel() * x.element_size() for x in kind) for kind in views]
        stats.update(prompt_kv_bytes=sum(nbytes[:2]), completion_kv_bytes=sum(nbytes[2:]))
    # 6. Cut each row at its stop id, rows in the caller's prompt order; it stays on the device.
    rank = sorted(range(len(order)), key=order.__getitem__)  # each prompt's place in the sort
    where = [rank[i // G] * G + i % G for i in range(len(order) * G)]  # each row's sorted row
    rows = torch.tensor(where, device=device)
    if episodes is None:
        tokens, mask, logprobs, stopped = _cut_at_stop(out_tokens.T[rows], out_logprobs.T[rows],
                                                       stop_ids)
        sampled = None
    else:  # each row's length and end as the episode loop left them (nothing when new = 0)
        ends = {key: stats.pop(key, [0] * len(where)) for key in ("lengths", "stopped", "calls")}
        lengths = torch.tensor([ends["lengths"][r] for r in where], device=device)  # (R,)
        Tc = int(lengths.max())
        mask = torch.arange(Tc, device=device) < lengths[:, None]  # (R, Tc)
        tokens = out_tokens.T[rows, :Tc].masked_fill(~mask, 0)
        sampled = policy.T[rows, :Tc] & mask
        logprobs = out_logprobs.T[rows, :Tc].masked_fill(~sampled, 0.0)
        stopped = torch.tensor([bool(ends["stopped"][r]) for r in where], device=device)
        stats["calls"] = [ends["calls"][r] for r in where]
    stats.update(new_tokens=int(mask.sum()), seconds=time.perf_counter() - started)
    with torch.inference_mode(False):  # normal tensors: training may index with them (autograd)
        tokens, mask, logprobs, stopped = (t.clone() for t in (tokens, mask, logprobs, stopped))
        sampled = None if sampled is None else sampled.clone()
    return Rollout(tokens, mask, logprobs, stopped, cfg.temperature, stats, sampled)


def _decode(decoder: Decoder, out_tokens: Tensor, out_logprobs: Tensor,
            draw: Callable[[Tensor], tuple[Tensor, Tensor]], stop_ids: tuple[int, ...],
            check_every: int) -> dict:
    """Feed completion token t and sample token t + 1 for every active row until every row has
    stopped or the budget is spent; out_tokens/out_logprobs (Tc, R) are filled in place."""
    new = out_tokens.shape[0]
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=out_tokens.device)
    tokens = out_tokens[0]  # (N,)
    finished = torch.isin(tokens, stop_t)  # (N,)
    decode_steps = row_steps = compactions = 0
    for t in range(new - 1):
        logits = decoder.step(tokens, t)  # (N, V)
        tokens, logprobs = draw(logits)  # (N,)
        out_tokens[t + 1].index_copy_(0, decoder.rows, tokens)
        out_logprobs[t + 1].index_copy_(0, decoder.rows, logprobs)
        decode_steps += 1
        row_steps += len(decoder.layout.rows)
        if not stop_ids:
            continue
        finished |= torch.isin(tokens, stop_t)
        if (t + 2) % check_every or t + 2 == new:
            continue
        # The occasional host sync: drop finished rows. A graph re-capture costs about a step, so
        # on the GPU rows are dropped only once at least 1/8 of them are finished.
        keep = (~finished).nonzero()[:, 0].tolist()
        if not keep:
            break
        active = len(decoder.layout.rows)
        if len(keep) == active or (decoder.graphed and len(keep) > active * 7 // 8):
            continue
        decoder.drop(keep, filled=t + 1)
        compactions += 1
        keep_t = torch.tensor(keep, device=tokens.device)
        tokens = tokens[keep_t]
        finished = finished[keep_t]
    return dict(decode_steps=decode_steps, row_steps=row_steps, compactions=compactions)


# -----------------------------------------------------------------------------
# Weight sync: the sampler receives the trainer's weights


def sampler_for(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The trainer itself when it is in the sampler's dtype, else a frozen copy in that dtype (a
    bf16 sampler of an fp32 master: --dtype bfloat16, or --sampler_dtype), synced before each
    rollout."""
    if dtype == next(model.parameters()).dtype:
        return model
    return copy.deepcopy(model).to(dtype).requires_grad_(False)


@torch.no_grad()
def sync_weights(sampler: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy every parameter of the trainer `model` into the sampler's same-named parameter, in place
    and cast to the sampler's dtype (vLLM's and SGLang's update_weights): the sampler keeps its
    objects and addresses. Nothing to do when they are the same module. Call it before each rollout,
    with or without memory.py: a sampler that is not synced samples from stale weights."""
    if sampler is model:
        return
    targets, sources = dict(sampler.named_parameters()), dict(model.named_parameters())
    for name in sorted(targets.keys() | sources.keys()):  # check all before writing any
        if name not in targets or name not in sources:
            where = "sampler" if name in targets else "trainer"
            raise ValueError(f"sync_weights: parameter '{name}' exists in the {where} only: "
                             f"the sampler must be a copy of the trainer (deepcopy, .to(dtype))")
        if targets[name].shape != sources[name].shape:
            raise ValueError(f"sync_weights: parameter '{name}' has shape "
                             f"{tuple(targets[name].shape)} in the sampler, "
                             f"{tuple(sources[name].shape)} in the trainer")
    names = list(targets)
    # One multi-tensor copy (a few kernels on CUDA, not one a parameter), cast as copy_ casts.
    torch._foreach_copy_([targets[n] for n in names], [sources[n] for n in names])
