"""
The sampler that stands in for vLLM: a preallocated KV cache, each prompt prefilled once, G samples
per prompt decoded on top of that one shared prompt KV, finished rows dropped as the batch runs.

1. Prefill: the Bp ragged prompts, longest first, right-padded, in chunks of `prefill_tokens`
   padded tokens (like lengths together: little padding; causal attention is exact for the valid
   positions, the pads come after them). Each layer's K/V is stored once per prompt, (Bp, Hkv, P,
   D).
2. Fan-out: each prompt's last-position logits are repeated G times and every row draws its own
   first token (nanochat once broadcast one first token to all G rows).
3. Decode (engine/decode.py's Decoder: one state per active row, its completion index always per
   row), one loop (_decode) for plain and multi-turn rows: each step feeds every active row its
   last token; the attention writes each row's key/value into its own completion KV and runs
   shared-prompt attention (engine/attention.py): the G rows of a group are folded into the query
   dimension against the one prompt KV (Hydragen) and merged with the row's own keys by
   log-sum-exp. Prompt KV memory and reads / G. The draw (engine/sampling.py) has no host sync;
   each returned logprob is under the distribution actually sampled from, after temperature,
   top-k, top-p (trl#4159, trl#6789: otherwise the GRPO ratio is not 1).
4. The sync, every `sync_every` steps (the loop's only host sync; on the CPU, where it costs
   nothing, also as soon as a row samples a tool's call): a NaN logprob since the last sync (NaN
   or inf logits: engine/sampling.py) stops the rollout with one line naming its step
   (NonFiniteLogits); each row that sampled a stop id or a call is cut just after it
   (episodes.Rows.sync), and finished rows are dropped: the linears run on the B active rows
   only; attention sees them in a Bp' x G' grid (under CUDA graphs the whole grid, every row in its
   carved slot: the step's rows padded up to a graph's bucket, no graph captured again).
5. A tool's turn (generate(episodes=...)): each row that called gets the tool's observation
   (episodes.Rows.observe), fed into the row's own KV cache at its place by the decode forward,
   several tokens a row (Decoder.feed); from the first turn on, each row decodes at its own index.
   A plain row is an episode with no call: a rollout with no call is the tool-less rollout, bit
   for bit.
6. The result stays on the device as tensors: tokens, mask and logprobs (R, Tc), each row cut at
   its length. GRPO trains on them as they are; only the text for the rewards is decoded on the
   host (train.py).

Leaves out: paged KV and continuous batching (a GRPO rollout is one static batch), speculative
decoding, stop strings (stop ids only), prefix sharing across different prompts.
CPU: in lockstep the prompt part goes through SDPA's flash kernel, whose log-sum-exp then enters
the own part's softmax as one more score: the same merge in fewer kernels
(decode.shared_prompt_attention_decode_cpu); float32 linears (and bf16's where the CPU has it) run on
weights prepacked once per call for oneDNN (_prepacked_linears).
CUDA: the decode step is a CUDA graph per bucket of active rows (`cuda_graphs`: 1, 2, 4, 8, then
every 16, the rows padded up); in bf16 / fp16 it is compiled first, and the draw beside it
(`compile_decode`: torch.compile, once for every grid and bucket,
its seconds in the stats' compile_seconds; engine/compiling.py), on q/k/v's and gate/up's weights
stacked for the rollout (model.fused_projections: one matmul each); the private KV cache is bf16.

Shapes: Bp prompts, G rows per prompt (a group), R = Bp*G rows, B active rows, S = Bp'*G' slots of
the grid, P longest prompt, Tc completion length, C width, H/Hkv heads, D head dim, V vocab (V/tp
when the lm_head is split by tensor parallelism), L layers.
Tested by tests/test_rollout.py and tests/test_episodes.py (multi-turn rows); benchmarked by
tests/bench_rollout.py.
"""

import contextlib
import copy
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.decode import Decoder, KVCache
from engine.episodes import Episodes, Rows
from engine.compiling import CompiledStep, compile_seconds, decide, dynamic, graphs_compiled
from lora import LoRALinear
from model import ModelConfig, causal_attention, fused_projections
from engine import sampling
from engine.precision import native_bf16

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
    sync_every: int = 8             # decode steps between the host syncs that drop finished rows
    prefill_tokens: int = 2048      # padded prompt tokens per prefill forward (bounds activations)
    cuda_graphs: bool = True        # capture the decode step on CUDA (ignored on the CPU)
    compile_decode: str = "auto"    # bf16/fp16 step + draw compiled: auto (CUDA, big), true, false
    prepacked_linears: bool = True  # CPU, float32 / native bf16: linears on prepacked weights

    def __post_init__(self):
        checks = dict(num_samples=1, max_new_tokens=0, top_k=0, sync_every=1, prefill_tokens=1)
        for name, low in checks.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):  # `not >=`: NaN too
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.compile_decode not in ("auto", "true", "false"):
            raise ValueError(f"compile_decode must be auto (CUDA, a model worth compiling: "
                             f"compiling.worth_compiling), true or false, got {self.compile_decode!r}")


@dataclass
class Rollout:
    """Completions on the device, prompt-major: prompt i owns rows i*G .. i*G+G-1."""
    tokens: Tensor       # (R, Tc) long; each row's tokens, the stop token included, then 0
    mask: Tensor         # (R, Tc) bool; True on each row's tokens
    logprobs: Tensor     # (R, Tc) float32; under the distribution sampled from, 0 off the mask
    stopped: Tensor      # (R,) bool; the row ends with a stop id (else it hit max_new_tokens)
    temperature: float   # the distribution the trainer scores them under (trl#4159)
    stats: dict = field(default_factory=dict)
    sampled: Tensor | None = None  # (R, Tc) bool; True on sampled tokens, False on a tool's
                                   # observations (engine/episodes.py); None: all sampled

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


def prepacks(dtype: torch.dtype) -> bool:
    """Whether a CPU linear of this dtype runs on a prepacked weight: float32, and bf16 where the
    CPU multiplies it natively (engine/precision.py; elsewhere a run holds bf16's values in
    float32). A bf16 decode step's linears took 0.85-0.95 of F.linear's time prepacked, with the
    same bits (docs/measurements.md)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


@contextlib.contextmanager
def _prepacked_linears(model: torch.nn.Module, rows: int, enabled: bool):
    """Meanwhile each float32 (and native bf16: prepacks) nn.Linear of a CPU model runs through
    oneDNN on its weight reordered once (for `rows` rows) into the kernel's blocked layout
    (prepacked); F.linear reorders it on every call, a large share of the matmul at decode's 128
    rows. The cost: a second copy of the linear weights while it runs. Outputs equal F.linear's
    up to summation order (tests/test_rollout.py); a LoRA linear's, its adapted output's up to
    rounding (tests/test_lora.py).
    Yields `unpack`, called at the first tool turn: F.linear from there on, for the rest of the
    call (rows at their own lengths come in new counts and shapes at every sync, and oneDNN keeps
    a primitive for each: a tasks:lookup run grew by 0.5 GB in 100 steps); a LoRA linear on its
    merged weight, still one matmul."""
    linears = [m for m in model.modules()
               if enabled and _PREPACK is not None and type(m) in (nn.Linear, LoRALinear)
               and m.weight.device.type == "cpu" and prepacks(m.weight.dtype)]

    def unpack() -> None:
        for m in linears:  # the prepacked copy goes with the partial that held it
            if type(m) is LoRALinear:
                m.forward = functools.partial(F.linear, weight=m.merged_weight(), bias=m.bias)
            else:
                m.__dict__.pop("forward", None)
    try:
        for m in linears:  # an instance attribute shadows the class's forward
            # A LoRA adapter is merged into the prepacked copy (W + s B A): one matmul a linear,
            # where the update applied beside it costs two more (tests/bench_lora.py).
            weight = m.merged_weight() if type(m) is LoRALinear else m.weight.detach()
            m.forward = functools.partial(torch.ops.mkldnn._linear_pointwise, B=m.bias, attr="none",
                                          W=_PREPACK(weight, rows), scalars=[],
                                          algorithm="")  # (..., in) -> (..., out)
        yield unpack
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
    (engine/episodes.py); its respond() gets the caller's row ids."""
    started = time.perf_counter()
    cfg = cfg or RolloutConfig()
    stop_ids = tuple(stop_ids)
    check_prompts(prompts, stop_ids, cfg.max_new_tokens, model.config)
    G, new = cfg.num_samples, cfg.max_new_tokens
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
    if episodes is not None:  # the tool answers the caller's rows
        respond = functools.partial(_callers_rows, episodes.respond, order, G)
        episodes = dataclasses.replace(episodes, respond=respond)
    stats = dict(prefill_tokens=sum(lens), prefill_seconds=0.0, decode_steps=0, row_steps=0,
                 compactions=0, prompt_kv_bytes=0, completion_kv_bytes=0, compiles=0,
                 compile_seconds=0.0)
    if new > 0:
        # A compiled step runs its own linears (on stacked weights: fused_projections).
        compiling = decide(cfg.compile_decode, model) and logits_fn is None
        prepacked = cfg.prepacked_linears and not compiling
        with _prepacked_linears(model, len(prompts) * G, prepacked) as unpack:
            views = _carve(model, cache, len(prompts), G, max(lens), new)
            # 1. Prefill each prompt once.
            logits = _prefill(model, prompts, views[0], views[1], cfg.prefill_tokens, device)
            if device.type == "cuda":
                torch.cuda.synchronize()  # one sync so that prefill_seconds means something
            stats["prefill_seconds"] = time.perf_counter() - started
            # 2. Fan out: each of the G rows of a prompt draws its own first token (logits_fn once
            # per prompt, then repeated).
            first = (logits_fn or _same)(logits).repeat_interleave(G, dim=0)  # (R, V')
            rows = Rows.empty(len(prompts) * G, new, device)
            rows.tokens[:, 0], rows.logprobs[:, 0] = sampling.draw(
                first, cfg.temperature, cfg.top_k, cfg.top_p, generator)
            # 3-5. Decode, finished rows dropped, a tool's observations fed into their rows. A
            # logits_fn is tensor parallelism's vocab gather: tp.py's layers run their collectives
            # in autograd Functions (mark_dirty), which torch.compile does not trace: eager.
            decoder = Decoder(model, views, lens, device.type == "cuda" and cfg.cuda_graphs,
                              compiling)
            compiled = decoder.compiled is not None
            draw = drawer(cfg, generator, logits_fn or _same,
                          CompiledStep(sampling.draw_raced, draw_structure) if compiled else None)
            before = (graphs_compiled(), compile_seconds()) if compiled else (0, 0.0)
            with fused_projections(model, compiled):  # 4 matmuls a layer
                stats.update(_decode(decoder, rows, draw, stop_ids, cfg.sync_every, episodes,
                                     unpack))
            if compiled:  # what the decode step and the draw compiled, as dynamo counts it
                stats.update(compiles=graphs_compiled() - before[0],
                             compile_seconds=compile_seconds() - before[1])
        stats.update(_kv_bytes(views))
    else:  # nothing to sample: every row is empty
        rows = Rows.empty(len(prompts) * G, 0, device)
    # 6. Each row cut at its length, rows in the caller's prompt order; it stays on the device.
    rank = sorted(range(len(order)), key=order.__getitem__)  # each prompt's place in the sort
    where = [rank[i // G] * G + i % G for i in range(len(order) * G)]  # each row's sorted row
    tokens, mask, logprobs, stopped, sampled = rows.cut(where)
    if episodes is not None:
        stats["calls"] = [rows.calls[r] for r in where]
    stats.update(new_tokens=sum(rows.length), seconds=time.perf_counter() - started)
    return Rollout(tokens, mask, logprobs, stopped, cfg.temperature, stats,
                   sampled if episodes is not None else None)


def _same(logits: Tensor) -> Tensor:
    return logits


def _kv_bytes(views: tuple[list[Tensor], ...]) -> dict:
    """The KV cache's bytes this call carved."""
    nbytes = [sum(x.numel() * x.element_size() for x in kind) for kind in views]
    return dict(prompt_kv_bytes=sum(nbytes[:2]), completion_kv_bytes=sum(nbytes[2:]))


def _callers_rows(respond: Callable, order: list[int], G: int, calls: list) -> list:
    """episodes.respond on the caller's row ids: the decode loop's rows are the sorted prompts'."""
    return respond([(order[r // G] * G + r % G, tokens) for r, tokens in calls])


def draw_structure(logits: Tensor, temperature: float, top_k: int, top_p: float,
                   clocks: tuple[Tensor, ...]) -> str:
    """What a compile of the draw specialises on (compiling.CompiledStep): the knobs, one row."""
    rows = " of one row" if len(logits) == 1 else ""
    return f"the draw{rows} at temperature {temperature}, top-k {top_k}, top-p {top_p}"


def drawer(cfg: RolloutConfig, generator: torch.Generator, logits_fn: Callable[[Tensor], Tensor],
           compiled: CompiledStep | None) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """The draw: logits to tokens and their logprobs, (rows, V') -> (rows,), (rows,): logits_fn,
    then sampling.draw under the config's temperature, top-k and top-p. Beside a compiled decode
    step the draw is compiled too (`compiled`, of sampling.draw_raced: its elementwise work fused),
    its race's clocks wound eagerly before it: a traced graph holds no torch.Generator."""
    def draw(logits: Tensor) -> tuple[Tensor, Tensor]:
        logits = logits_fn(logits)
        if compiled is None:
            return sampling.draw(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator)
        clocks = tuple(dynamic(c, 0) for c in sampling.race_clocks(logits, cfg.temperature,
                                                                    generator))  # (B, .)
        return compiled(dynamic(logits, 0), cfg.temperature, cfg.top_k, cfg.top_p, clocks)
    return draw


def _decode(decoder: Decoder, rows: Rows, draw: Callable[[Tensor], tuple[Tensor, Tensor]],
            stop_ids: tuple[int, ...], sync_every: int, episodes: Episodes | None,
            unpack: Callable[[], None]) -> dict:
    """Steps 3-5 of the module docstring, one loop for plain and multi-turn rows, filling rows in
    place: feed each active row its last token and draw its next, until every row has ended. The
    sync comes every sync_every steps (on a CPU also as soon as a row draws a call: a sync
    costs nothing there, decoding past the call does); the first tool turn unpacks the linears
    (_prepacked_linears). Returns the stats."""
    device = rows.tokens.device
    calls = torch.tensor(episodes.call_ids if episodes else (), dtype=torch.long, device=device)
    ends = torch.cat([torch.tensor(stop_ids, dtype=torch.long, device=device), calls])
    every = sync_every if len(ends) else rows.tokens.shape[1]  # nothing to look for: no sync
    stop_at_calls = device.type == "cpu" and len(calls) > 0
    active = list(range(rows.tokens.shape[0]))  # the rows that go on, in the decoder's order
    tokens = rows.tokens[:, 0].clone()  # (B,) each active row's last token
    drew_end = torch.isin(tokens, ends)  # (B,) drew a call or a stop since the last sync
    stats = dict(decode_steps=0, row_steps=0, compactions=0)
    if episodes:
        stats["tool_turns"] = 0
    while True:
        # 1. Decode every active row up to the next sync, within every row's budget.
        steps = min(every - (stats["decode_steps"] + 1) % every, rows.budget(active))
        ran = 0
        for ran in range(1, steps + 1):
            tokens, logprobs = draw(decoder.decode(tokens))  # (B,)
            rows.write(decoder.ids, decoder.index, tokens, logprobs)
            drew_end |= torch.isin(tokens, ends)
            if stop_at_calls and torch.isin(tokens, calls).any():
                break  # a row called: on a CPU the sync costs nothing, decoding past it does
        rows.moved_on(active, ran)
        stats["decode_steps"] += ran
        stats["row_steps"] += ran * len(active)
        # 2. The sync (the only host sync): logits that held NaN or inf stop the rollout; each
        # row that drew a call or a stop is cut after it.
        bad = rows.first_nan(active, ran)
        if bad is not None:
            raise NonFiniteLogits(bad)
        going, waiting = rows.sync(active, ran, drew_end.nonzero()[:, 0].tolist(), stop_ids,
                                   episodes)
        # 3. The tool answers the rows that called; those it answers within the budget go on.
        feeds = rows.observe(waiting, episodes, decoder.model.config.vocab_size) if waiting else []
        going = set(going).union(r for r, _, _ in feeds)
        # 4. Ended rows leave (under CUDA graphs the step's rows are padded up to the graph's
        # bucket: no graph is captured again).
        keep = [i for i, r in enumerate(active) if r in going]
        if not keep:
            break
        if len(keep) < len(active):
            active = [active[i] for i in keep]
            decoder.drop(keep, filled=max(rows.length[r] for r in active) - 1)
            tokens = tokens[torch.tensor(keep, device=device)]
            stats["compactions"] += 1
        drew_end = torch.zeros_like(tokens, dtype=torch.bool)
        # 5. The answered rows are fed their observations and draw their next token.
        if feeds:
            if not stats["tool_turns"]:
                unpack()
            tokens, drew_end = _feed(decoder, rows, active, feeds, tokens, draw, ends)
            stats["tool_turns"] += len(feeds)
            stats["row_steps"] += len(feeds)
    return stats


class NonFiniteLogits(RuntimeError):
    """The model's logits at a decode step held NaN or inf: nothing can be sampled from them."""

    def __init__(self, step: int):
        super().__init__(
            f"the model's logits at decode step {step} (completion token {step}) hold NaN or inf: "
            f"its weights or activations overflowed or turned NaN (a learning rate too high, "
            f"float16, a corrupt checkpoint), and nothing can be sampled from them; lower --lr, "
            f"run in bfloat16 or float32, or resume from an earlier checkpoint")
        self.step = step


def _feed(decoder: Decoder, rows: Rows, active: list[int],
          feeds: list[tuple[int, list[int], int]], tokens: Tensor, draw: Callable,
          ends: Tensor) -> tuple[Tensor, Tensor]:
    """Step 5: each answered row's [call token; observation] fed into its own cache at its place
    (Decoder.feed: the decode forward, several tokens a row), and its next token drawn from the
    last one's logits. active: the active rows in the decoder's order; tokens (B,) each one's
    last token -> the same with the answered rows' drawn ones, and which drew a call or a
    stop."""
    device = tokens.device
    place = {r: i for i, r in enumerate(active)}
    answered = [r for r, _, _ in feeds]
    picks = [place[r] for r in answered]  # each answered row's place among the active
    logits = decoder.feed(picks, [f for _, f, _ in feeds], [j for _, _, j in feeds])
    drawn, logprobs = draw(logits)  # (k,)
    at = torch.tensor([rows.length[r] for r in answered], device=device)
    rows.write(torch.tensor(answered, device=device), at, drawn, logprobs)
    rows.moved_on(answered, 1)
    places = torch.tensor(picks, device=device)  # (k,)
    drew_end = torch.zeros_like(tokens, dtype=torch.bool).index_copy_(0, places,
                                                                      torch.isin(drawn, ends))
    return tokens.index_copy(0, places, drawn), drew_end


# -----------------------------------------------------------------------------
# Weight sync: the sampler receives the trainer's weights


def sampler_for(model: torch.nn.Module, dtype: torch.dtype,
                values: torch.dtype | None = None) -> torch.nn.Module:
    """The trainer itself when it is in the sampler's dtype, else a frozen copy in that dtype (a
    bf16 sampler of an fp32 master: --dtype bfloat16, or --sampler_dtype), synced before each
    rollout. values: the copy holds its weights rounded to that dtype (bf16's values in float32,
    on a CPU without native bf16: train.py), and every sync rounds them again."""
    if dtype == next(model.parameters()).dtype and values is None:
        return model
    sampler = copy.deepcopy(model).to(dtype).requires_grad_(False)
    if values is not None:
        sampler.weight_values = values
        sync_weights(sampler, model)
    return sampler


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
    if (values := getattr(sampler, "weight_values", None)) is not None:  # sampler_for's rounding
        for n in names:  # one tensor at a time: one rounded copy alive at once
            targets[n].copy_(sources[n].to(values))
        return
    # One multi-tensor copy (a few kernels on CUDA, not one a parameter), cast as copy_ casts.
    torch._foreach_copy_([targets[n] for n in names], [sources[n] for n in names])
