"""
Benchmark of rollout.generate against a naive KV-cached sampler and transformers' generate().

Tiny Llama (dim 256, 4 layers, 8/4 heads, ffn 704, vocab 2048), 16 prompts x 8 samples, 64 new tokens,
no early stop, fp32 on the CPU (bf16 on a GPU when one is present). Everything is measured side by side
in one run (best of 5 interleaved rounds); only the ratios mean much on a shared machine.

The naive sampler is the obvious design: every sample is its own cache row, so the prompt is prefilled
G times and its KV stored G times (what nanochat-style engines and transformers' generate do).
It uses the same `draw` function, so the difference is the KV/prefill design alone.

    python tests/bench_rollout.py             # full tables (+ a bf16 1B-sized config when CUDA is present)
    python tests/bench_rollout.py --quick     # P = 64 only, no transformers
    python tests/bench_rollout.py --breakdown # where a CPU decode step's wall clock goes, P = 64 and 512
    python tests/bench_rollout.py --fused     # the CPU's fused prompt attention vs the generic path
    python tests/bench_rollout.py --compiled  # the bf16 decode step compiled vs eager (CPU: sanity)
    python tests/bench_rollout.py --tools     # a tool turn (engine/episodes.py) against re-prefilling the row
    python tests/bench_rollout.py --kernels   # kernels of a decode step per layer, on each route
                                              # (CUDA: a graph replay, --shape Qwen2.5-0.5B)
    python tests/bench_rollout.py --model DIR --rounds 1  # a Hugging Face checkpoint instead (e.g.
                                              # SmolLM2-135M-Instruct), loaded by engine/hf.py and by transformers
--rounds R sets the interleaved rounds (5); --P 64,512 the prompt lengths (64 alone with --model,
which also skips the scaling table: a real checkpoint makes them minutes each).
"""

import collections
import dataclasses
import math
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import hf  # noqa: E402
from engine import decode  # noqa: E402
from engine import compiling  # noqa: E402
import rollout  # noqa: E402
from engine.episodes import Episodes  # noqa: E402
from model import Llama, ModelConfig, fused_projections  # noqa: E402
from engine import sampling  # noqa: E402
from engine.sampling import draw  # noqa: E402
from rollout import RolloutConfig, generate  # noqa: E402

CFG = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
NUM_PROMPTS, G, NEW = 16, 8, 64


class NaiveCache:
    """One KV row per sample: (B, Hkv, P + new, D) per layer, written at `pos`, read with plain SDPA."""

    def __init__(self, cfg: ModelConfig, B: int, length: int, device: torch.device, dtype: torch.dtype):
        shape = (B, cfg.num_key_value_heads, length, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.pos = 0

    def __call__(self, layer: int, q, k, v):
        T, end = k.shape[2], self.pos + k.shape[2]
        self.k[layer][:, :, self.pos:end], self.v[layer][:, :, self.pos:end] = k, v
        return F.scaled_dot_product_attention(q, self.k[layer][:, :, :end], self.v[layer][:, :, :end],
                                              is_causal=T > 1, enable_gqa=True)


@torch.inference_mode()
def naive_generate(model: Llama, prompts: list[list[int]], num_samples: int, new: int, seed: int) -> dict:
    """Equal-length prompts only (the benchmark's), so no padding is needed."""
    started = time.perf_counter()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor(prompts, device=device).repeat_interleave(num_samples, dim=0)  # (Bp*G, P)
    cfg = model.config
    cache = NaiveCache(cfg, tokens.shape[0], tokens.shape[1] + new, device, next(model.parameters()).dtype)
    logits = model(tokens, attention=cache)[:, -1]  # the prompt prefilled once per sample
    sync(device)
    prefill_seconds = time.perf_counter() - started
    out = []
    for t in range(new):
        next_tokens, _ = draw(logits, 1.0, 0, 1.0, generator)
        out.append(next_tokens)
        if t + 1 < new:
            cache.pos += tokens.shape[1] if t == 0 else 1
            positions = torch.full((tokens.shape[0], 1), cache.pos, device=device)
            logits = model(next_tokens[:, None], positions, cache)[:, -1]
    torch.stack(out).tolist()
    kv_prompt = 2 * cfg.num_hidden_layers * tokens.numel() * cfg.num_key_value_heads * cfg.head_dim * 4
    return dict(seconds=time.perf_counter() - started, prefill_seconds=prefill_seconds, prompt_kv_bytes=kv_prompt)


def hf_generate(hf_model, prompts: list[list[int]], num_samples: int, new: int, seed: int) -> dict:
    torch.manual_seed(seed)
    started = time.perf_counter()
    ids = torch.tensor(prompts, device=hf_model.device)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, num_return_sequences=num_samples,
                            max_new_tokens=new, min_new_tokens=new, top_k=0, top_p=1.0, temperature=1.0,
                            pad_token_id=0)
    assert out.shape == (len(prompts) * num_samples, ids.shape[1] + new)
    return dict(seconds=time.perf_counter() - started)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine(model: Llama, prompts: list[list[int]], num_samples: int, seed: int) -> dict:
    out = generate(model, prompts, RolloutConfig(num_samples=num_samples, max_new_tokens=NEW), seed=seed)
    assert out.stats["new_tokens"] == len(prompts) * num_samples * NEW
    return out.stats


def linear_roofline(model: Llama, rows: int, repeats: int = 20, prepacked: bool = False) -> tuple[float, float]:
    """Measured GFLOP/s of the decode linears (all layers + lm_head) at `rows` rows, and the tokens/s
    ceiling that rate allows if everything else were free. prepacked: the same linears as generate runs
    them on the CPU (rollout._prepacked_linears: oneDNN, weights prepacked), else F.linear."""
    device = next(model.parameters()).device
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1], device=device) for m in linears}
    with torch.inference_mode(), rollout._prepacked_linears(torch.nn.ModuleList(linears), rows, prepacked):
        for _ in range(2):
            [m(x[m.weight.shape[1]]) for m in linears]
        sync(device)
        started = time.perf_counter()
        for _ in range(repeats):
            [m(x[m.weight.shape[1]]) for m in linears]
        sync(device)
    seconds = (time.perf_counter() - started) / repeats
    flops = 2 * rows * sum(m.weight.numel() for m in linears)
    return flops / seconds / 1e9, rows / seconds


def gpu_bandwidth() -> None:
    """Decode tokens/s and memory-bandwidth utilisation of a bf16 TinyLlama-1.1B-shaped model at 256 rows
    (32 prompts x 8 samples, P = 256, 128 new tokens): bytes read per step = all weights + the prompt KV
    (once per group) + every row's completion KV (all Tc slots: the CUDA graph attends to them, masked)."""
    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    with torch.device("cuda"):
        model = Llama(cfg)
    model = model.init_weights(seed=0).to(torch.bfloat16).eval()
    prompts = torch.randint(cfg.vocab_size, (32, 256), generator=torch.Generator().manual_seed(0)).tolist()
    generate(model, prompts, RolloutConfig(num_samples=8, max_new_tokens=128), seed=0)  # warm-up (allocator, cuBLAS)
    stats = generate(model, prompts, RolloutConfig(num_samples=8, max_new_tokens=128), seed=1).stats
    step_seconds = (stats["seconds"] - stats["prefill_seconds"]) / stats["decode_steps"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = stats["prompt_kv_bytes"] + stats["completion_kv_bytes"]  # bf16 cache, all of it read every step
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bandwidth = 2 * x.numel() * 10 / (time.perf_counter() - started)  # read + write
    print(f"\nGPU, bf16 1.1B-shaped, 256 rows: {256 / step_seconds:,.0f} decode tokens/s, {step_seconds * 1e3:.2f} ms "
          f"per step, {(weights + kv) / 2**30:.2f} GiB read per step -> {(weights + kv) / step_seconds / 1e9:.0f} GB/s "
          f"= {(weights + kv) / step_seconds / bandwidth:.0%} of the measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")


def breakdown(model: Llama, P: int, rounds: int = 3) -> None:
    """Where a decode step's wall clock goes, from module hooks (CPU: no sync needed; the hooks cost ~0.1 ms a
    step). A generate of 1 new token (prefill + first sample) is subtracted from one of NEW tokens."""
    def part(name: str) -> str | None:
        last = name.rsplit(".", 1)[-1]
        if last.endswith("_proj"):
            return "attention linears" if ".self_attn." in name else "MLP linears"
        if last.endswith("norm"):
            return "norms"
        return {"self_attn": "attention", "mlp": "MLP", "lm_head": "lm_head"}.get(last)
    spent, started, handles = {}, {}, []

    def pre(module, args):
        started[module] = time.perf_counter()

    def post(module, args, out):
        spent[module.bench_part] = spent.get(module.bench_part, 0.0) + time.perf_counter() - started[module]

    def timed_sample(*args):
        begun = time.perf_counter()
        out = draw(*args)
        spent["sampling"] = spent.get("sampling", 0.0) + time.perf_counter() - begun
        return out
    sampling.draw = timed_sample  # generate's Draw looks it up in engine/sampling.py at each step
    for name, module in model.named_modules():
        if part(name):
            module.bench_part = part(name)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    V = model.config.vocab_size
    prompts = torch.randint(V, (NUM_PROMPTS, P), generator=torch.Generator().manual_seed(0)).tolist()
    best = {}
    for new in [NEW, 1] * rounds:
        spent.clear()
        seconds = generate(model, prompts, RolloutConfig(num_samples=G, max_new_tokens=new), seed=1).stats["seconds"]
        if new not in best or seconds < best[new][0]:
            best[new] = (seconds, dict(spent))
    for handle in handles:
        handle.remove()
    sampling.draw = draw
    (full, parts), (first, first_parts) = best[NEW], best[1]
    ms = {k: (v - first_parts.get(k, 0.0)) / (NEW - 1) * 1e3 for k, v in parts.items()}  # per decode step
    step = (full - first) / (NEW - 1) * 1e3
    rows = {"q/k/v/o linears": ms["attention linears"], "MLP linears": ms["MLP linears"], "lm_head": ms["lm_head"],
            "attention: rope, KV write, attention": ms["attention"] - ms["attention linears"],
            "MLP: silu, mul": ms["MLP"] - ms["MLP linears"], "norms": ms["norms"],
            "sampling: softmax, cdf, draw": ms["sampling"],
            "rest: embedding, rope tables, residuals, loop": step - ms["attention"] - ms["MLP"]
            - ms["norms"] - ms["lm_head"] - ms["sampling"]}
    print(f"\nP = {P}: one decode step, {step:.2f} ms (best of {rounds})")
    for name, value in rows.items():
        print(f"  {name:55s} {value:6.2f} ms  {value / step:4.0%}")


def fused_vs_generic(model: Llama, P: int, rounds: int) -> None:
    """Decode tokens/s of the CPU's fused prompt attention (decode.shared_prompt_attention_decode_cpu) next to
    the generic path (attention.shared_prompt_attention with a mask, what CUDA runs), interleaved rounds."""
    prompts = torch.randint(model.config.vocab_size, (NUM_PROMPTS, P), generator=torch.Generator().manual_seed(0)).tolist()
    fused = decode._CPU_FLASH
    best = {"fused": float("inf"), "generic": float("inf")}
    for _ in range(rounds):
        for name in best:
            decode._CPU_FLASH = fused if name == "fused" else None
            stats = engine(model, prompts, G, 1)
            best[name] = min(best[name], stats["seconds"] - stats["prefill_seconds"])
    decode._CPU_FLASH = fused
    tokens = NUM_PROMPTS * G * (NEW - 1)
    print(f"P = {P}, decode alone: fused {tokens / best['fused']:,.0f} tokens/s, generic "
          f"{tokens / best['generic']:,.0f} tokens/s: fused / generic = {best['generic'] / best['fused']:.2f}x "
          f"(best of {rounds})")


def compiled_vs_eager(model: Llama, P: int, rounds: int) -> None:
    """Decode tokens/s of the bf16 kernel route compiled (compiling.CompiledStep) and eager, side by
    side in interleaved rounds, on the CPU (SDPA's fused CPU kernel in the CUDA kernel's place;
    the CPU's own bf16 route, the fused path, beside them), after a warm-up that compiles: a
    sanity figure, not the goal (the compiled route is CUDA's)."""
    model = model.to(torch.bfloat16)
    prompts = torch.randint(model.config.vocab_size, (NUM_PROMPTS, P),
                            generator=torch.Generator().manual_seed(0)).tolist()
    kernel = decode.kernel_for
    routes = {"kernel, compiled": (True, "true"), "kernel, eager": (True, "false"),
              "cpu fused (bf16)": (False, "false")}
    best = {name: float("inf") for name in routes}
    compile_seconds = 0.0
    try:
        for attempt in range(rounds + 1):  # 0: the warm-up and the compile
            for name, (on_kernel, compiled) in routes.items():
                decode.kernel_for = (lambda device, dtype, head_dim: decode.cpu_flash) if (
                    on_kernel) else kernel
                cfg = RolloutConfig(num_samples=G, max_new_tokens=NEW, compile_decode=compiled)
                stats = generate(model, prompts, cfg, seed=1).stats
                compile_seconds += stats["compile_seconds"]
                if attempt:
                    best[name] = min(best[name], stats["seconds"] - stats["prefill_seconds"])
    finally:
        decode.kernel_for = kernel
    tokens = NUM_PROMPTS * G * (NEW - 1)
    print(f"P = {P}, bf16, decode alone (best of {rounds}; the warm-up compiled for "
          f"{compile_seconds:.1f} s): " + ", ".join(
              f"{name} {tokens / seconds:,.0f} tokens/s" for name, seconds in best.items())
          + f"; compiled / eager = {best['kernel, eager'] / best['kernel, compiled']:.2f}x")


def tool_turns(model: Llama, P: int, rounds: int) -> None:
    """Greedy episodes of 128 prompts (G = 1), 64 new tokens, a call whenever a row writes one of
    1/16 of the vocabulary, answered by 12 observation tokens, up to 3 turns: the engine (each
    answered row fed in place, Decoder.feed) against the same episodes run turn by turn,
    each turn a new generate() call on the whole row so far, prefilled again. Per sync, the feed's
    time against one decode step plus the observations' prefill alone (a causal forward of the
    fed rows' new tokens, no cache), measured in the same rounds."""
    V, new, m = model.config.vocab_size, 64, 12
    calls = tuple(range(0, V, 16))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(V, (NUM_PROMPTS * G, P), generator=gen).tolist()
    cfg = RolloutConfig(num_samples=1, max_new_tokens=new, temperature=0.0)

    def observation(row: int, tokens: list[int]) -> list[int]:
        return [(row * 31 + len(tokens) * 7 + i) % V for i in range(m)]
    fed: list[tuple[float, int]] = []
    real = decode.Decoder.feed

    def timed(self, picks, feeds, starts):
        t0 = time.perf_counter()
        logits = real(self, picks, feeds, starts)
        fed.append((time.perf_counter() - t0, len(picks)))
        return logits
    decode.Decoder.feed = timed
    best: dict[str, float] = {}
    for _ in range(rounds):
        fed.clear()
        t0 = time.perf_counter()
        out = generate(model, prompts, cfg, episodes=Episodes(
            lambda c: [observation(r, t) for r, t in c], calls, 3))
        seconds = time.perf_counter() - t0
        episodes = out.completions()
        steps = out.stats["decode_steps"]
        # the twin: each turn a fresh generate of prompt + episode so far (calls end a turn)
        t0 = time.perf_counter()
        rows, turns = list(range(len(prompts))), [0] * len(prompts)
        done = [[] for _ in prompts]
        while rows:
            part = generate(model, [prompts[r] + done[r] for r in rows],
                            RolloutConfig(num_samples=1, temperature=0.0,
                                          max_new_tokens=new - min(len(done[r]) for r in rows)),
                            stop_ids=calls)
            going = []
            for r, more in zip(rows, part.completions()):
                more = more[:new - len(done[r])]
                done[r] += more
                if more and more[-1] in calls and turns[r] < 3 and len(done[r]) < new:
                    turns[r] += 1
                    done[r] += observation(r, done[r])[:new - len(done[r])]
                    going += [r] if len(done[r]) < new else []
            rows = going
        restart = time.perf_counter() - t0
        assert done == episodes, "the twin's episodes differ from the engine's"
        # one decode step, and the observations' prefill alone, at a typical check's size
        k = max(n for _, n in fed)
        obs_prefill = math.inf
        for _ in range(3):  # the first call of a shape is slow on the CPU
            t0 = time.perf_counter()
            with torch.no_grad():
                model.hidden(torch.randint(V, (k, m + 1), generator=gen))
            obs_prefill = min(obs_prefill, time.perf_counter() - t0)
        step = (seconds - out.stats["prefill_seconds"] - sum(t for t, _ in fed)) / steps
        feed = max(t for t, n in fed if n == k)
        for key, value in dict(engine=seconds, restart=restart, feed=feed, decode=step,
                               obs_prefill=obs_prefill).items():
            best[key] = min(best.get(key, value), value)
    decode.Decoder.feed = real
    turns_done = sum(out.stats["calls"])
    print(f"P = {P}, {len(prompts)} rows, {turns_done} tool turns in {len(fed)} syncs, "
          f"{m} observation tokens each; best of {rounds}")
    print(f"rollout: engine {best['engine']:.3f}s, re-prefilling each turn {best['restart']:.3f}s "
          f"({best['restart'] / best['engine']:.2f}x)")
    print(f"one sync's feed of {k} rows: {best['feed'] * 1e3:.1f} ms; one decode step "
          f"{best['decode'] * 1e3:.1f} ms + their observations' prefill alone "
          f"{best['obs_prefill'] * 1e3:.1f} ms = {(best['decode'] + best['obs_prefill']) * 1e3:.1f} ms "
          f"(feed / that = {best['feed'] / (best['decode'] + best['obs_prefill']):.2f})")


# Ops that launch no kernel: views, and allocations without a fill.
NO_KERNEL = {"view", "_unsafe_view", "transpose", "t", "select", "slice", "expand", "unsqueeze",
             "squeeze", "as_strided", "detach", "alias", "permute", "split", "unbind", "empty",
             "empty_strided", "new_empty", "lift_fresh", "promote_types"}


class OpCount(TorchDispatchMode):
    """Counts the aten ops run inside it that launch a kernel on CUDA (less NO_KERNEL), under
    key(op name): the op itself by default, bench_train.py's phase there."""

    def __init__(self, key=lambda name: name):
        super().__init__()
        self.ops, self.key = collections.Counter(), key

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.ops[self.key(name)] += 1
        return func(*args, **(kwargs or {}))


def step_decoder(route: str, cfg: ModelConfig, Bp: int, G: int, P: int, Tc: int,
                 device: torch.device) -> tuple[decode.Decoder, torch.Tensor]:
    """A decoder at a graph-style step (every completion slot attended under the step's mask; the
    CPU's eager route: the written keys alone), Bp prompts x G rows, the last two prompts padded,
    random weights. route: "float32" (shared_prompt_attention's plain ops), "bf16 kernel" (CUDA's
    shared_prompt_attention_decode_cuda; on a CPU, kernels_per_layer puts SDPA's fused CPU kernel
    in the CUDA kernel's place, through the same code), "bf16 kernel, compiled" (the same through
    torch.compile) or "cpu flash" (the CPU's eager path, float32)."""
    dtype = torch.bfloat16 if route.startswith("bf16") else torch.float32
    with torch.device(device):
        model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    model = model.to(dtype).eval()
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    views = decode.KVCache.for_batch(cfg, Bp, G, P, Tc + 1, dtype, device).carve(
        L, Hkv, D, Bp, G, P, Tc + 1)
    lens = [P] * (Bp - 2) + [P - 5, P - 9]
    decoder = decode.Decoder(model, views, lens, graphed=False, compiled=route.endswith("compiled"))
    if route == "float32":
        decoder.route = "plain"  # not the CPU's flash route
    decoder.index.fill_(3)  # every row at completion index 3 (lockstep)
    return decoder, torch.randint(0, cfg.vocab_size, (Bp * G, 1), device=device)


def launches(decoder: decode.Decoder, tokens: torch.Tensor) -> collections.Counter:
    """What one decode step launches, by name: on CUDA the kernels of one replay of the step's CUDA
    graph (torch.profiler's device events); on the CPU the aten ops less views and bare
    allocations (OpCount: a kernel each on CUDA) of an eager step, and of a compiled one the
    calls its graph makes (inductor's generated kernels, profiled, and the aten ops it calls:
    matmuls, attention)."""
    # generate's routes: the CPU's eager one attends to the keys written so far; a graph or a
    # compile to all Tc slots under each row's mask (Decoder._lockstep, keys None)
    def run(tokens):
        if decoder.compiled is None and not tokens.is_cuda:
            keys = int(decoder.index.max()) + 1 if decoder.route == "flash" else None
            return decoder.forward(tokens, decoder.index[:, None], decoder.first(decoder.ids),
                                   keys)
        return decoder._lockstep(tokens, decoder.index[:, None], decoder.ids)
    with fused_projections(decoder.model, decoder.compiled is not None):  # as generate's
        return _launches(run, decoder, tokens)


def _launches(run, decoder: decode.Decoder, tokens: torch.Tensor) -> collections.Counter:
    if not tokens.is_cuda and decoder.compiled is None:
        with torch.no_grad(), OpCount() as count:  # inference mode would show composite ops
            run(tokens)
        return count.ops
    with torch.inference_mode():  # generate's mode: the same compiled graph
        if tokens.is_cuda:
            # Twice before the capture, so that any compile (or recompile) is over by then: on an
            # H200 a compile inside GraphedStep's capture failed ("operation not permitted when
            # stream is capturing") and the step fell back to eager.
            run(tokens)
            run(tokens)
            graph = compiling.GraphedStep(run, tokens)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                graph(tokens)
                torch.cuda.synchronize()
            return collections.Counter(event.name for event in prof.events()
                                       if event.device_type == torch.autograd.DeviceType.CUDA)
        from torch._inductor import config
        with config.patch({"cpp.enable_kernel_profile": True}):  # an event for each kernel
            run(tokens)  # the compile
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run(tokens)
    return collections.Counter(
        "inductor kernel" if "cpp_fused" in event.name else event.name.removeprefix("aten::")
        for event in prof.events() if event.cpu_parent is not None
        and event.cpu_parent.name.startswith("## Call CompiledFxGraph"))


def kernel_kind(name: str) -> str:
    """A CUDA kernel's name by what it does, for the table's last column."""
    for kind, marks in (("inductor", ("triton_",)), ("attention", ("fmha", "attention")),
                        ("matmul", ("gemm", "gemv", "sm90", "sm80", "cutlass", "splitK")),
                        ("copy/fill", ("elementwise", "copy", "fill", "Memset", "Memcpy"))):
        if any(mark in name for mark in marks):
            return kind
    return name[:40]


def kernels_per_layer(route: str, device: torch.device, shape: str = "") -> tuple[
        int, int, collections.Counter]:
    """What one decode step launches per layer (a 2-block model's total less a 1-block model's)
    and for the rest of the step (embedding, rope tables, final norm, head), on `route`
    (step_decoder), and the per-layer launches by kind (on CUDA) or name, the 2-block model's
    less the 1-block model's where that is positive: an indication only, since inductor names and
    splits the kernels of two graphs differently (the totals are the figure). On CUDA a shape of
    tests/bench_bf16.py (its blocks cut to 1 and 2) at 16 prompts x 8 rows, P = 64, 255
    completion slots; on the CPU a Qwen2-shaped tiny model, 4 prompts x 8 rows, P = 16, 32
    slots."""
    if shape:
        from bench_bf16 import SHAPES
        base, batch = SHAPES[shape], (16, 8, 64, 255)
    else:
        base = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2,
                           architecture="Qwen2ForCausalLM")
        batch = (4, 8, 16, 32)
    kernel = decode.kernel_for
    if route.startswith("bf16") and device.type == "cpu":  # Decoder.attention asks at each call
        decode.kernel_for = lambda device, dtype, head_dim: decode.cpu_flash
    try:
        counts = [launches(*step_decoder(route, dataclasses.replace(
            base, num_hidden_layers=layers), *batch, device)) for layers in (1, 2)]
    finally:
        decode.kernel_for = kernel
    if device.type == "cuda":  # by what the kernels do
        counts = [collections.Counter(kernel_kind(k) for k in c.elements()) for c in counts]
    one, two = (sum(c.values()) for c in counts)
    return two - one, one - (two - one), counts[1] - counts[0]


def kernels() -> None:
    """Kernels a decode step launches per layer and for the rest of the step, on each route: on
    the CPU counted as launches (see launches()), on CUDA from the profiler."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = option("--shape", "Qwen2.5-0.5B") if device.type == "cuda" else ""
    routes = ("bf16 kernel", "bf16 kernel, compiled")
    if device.type == "cpu":
        routes = ("float32", *routes, "cpu flash")
        print("launches of one decode step (on the CPU: aten ops less views, a kernel each on "
              "CUDA; compiled: inductor's kernels and the aten ops its graph calls)")
    else:
        print(f"CUDA kernels of one replay of the decode step's graph, {shape} shape")
    print("| route | per layer | rest of the step | per layer, by op |")
    print("|---|---|---|---|")
    for route in routes:
        per_layer, rest, layer = kernels_per_layer(route, device, shape)
        top = ", ".join(f"{name} {n}" for name, n in layer.most_common(8))
        print(f"| {route} | {per_layer} | {rest} | {top} |", flush=True)


def option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    quick, rounds, model_dir = "--quick" in sys.argv, int(option("--rounds", "5")), option("--model", "")
    lengths = [int(P) for P in option("--P", "64" if model_dir or quick else "64,512").split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if model_dir:
        model = hf.load_model(model_dir, device, dtype).eval()
    else:
        model = Llama(CFG).init_weights(seed=0).to(device, dtype).eval()
    if "--kernels" in sys.argv:
        return kernels()
    if "--breakdown" in sys.argv:
        for P in lengths:
            breakdown(model, P, rounds=min(rounds, 3))
        return
    if "--tools" in sys.argv:
        for P in lengths:
            tool_turns(model, P, rounds)
        return
    if "--compiled" in sys.argv:
        for P in lengths:
            compiled_vs_eager(model, P, rounds)
        return
    if "--fused" in sys.argv:
        for P in lengths:
            fused_vs_generic(model, P, rounds)
        return
    print(f"device {device}, {torch.get_num_threads()} threads, {model_dir or 'random tiny Llama'}, {NUM_PROMPTS} "
          f"prompts x {G} samples, {NEW} new tokens, best of {rounds} interleaved rounds (the machine is shared: a "
          f"busy neighbour slows one run, not all); load average {os.getloadavg()[0]:.1f}")
    hf_model = None
    if not quick:
        try:
            from transformers import LlamaForCausalLM
            with tempfile.TemporaryDirectory() as tmp:
                if not model_dir:
                    hf.save_model(model, tmp)
                hf_model = LlamaForCausalLM.from_pretrained(model_dir or tmp, dtype=dtype).to(device).eval()
        except ImportError:
            print("transformers not installed: its column is skipped")

    gen = torch.Generator().manual_seed(0)
    new_tokens = NUM_PROMPTS * G * NEW
    table = []
    for P in lengths:
        prompts = torch.randint(model.config.vocab_size, (NUM_PROMPTS, P), generator=gen).tolist()
        engine(model, prompts, G, 0)  # warm-up: first calls of every shape are slow on the CPU
        runs: dict[str, list] = {"engine": [], "naive": [], "hf": [], "ceiling": [], "prepacked": []}
        for _ in range(rounds):
            runs["ceiling"].append(linear_roofline(model, NUM_PROMPTS * G))
            runs["prepacked"].append(linear_roofline(model, NUM_PROMPTS * G, prepacked=True))
            runs["engine"].append(engine(model, prompts, G, 1))
            runs["naive"].append(naive_generate(model, prompts, G, NEW, 1))
            if hf_model is not None:
                runs["hf"].append(hf_generate(hf_model, prompts, G, NEW, 1))
            print(f"P = {P}, round: " + ", ".join(f"{k} {new_tokens / v[-1]['seconds']:,.0f} tok/s" for k, v in runs.items()
                                                   if v and isinstance(v[-1], dict)) + f", load {os.getloadavg()[0]:.1f}",
                  flush=True)
        e, n = (min(runs[k], key=lambda r: r["seconds"]) for k in ("engine", "naive"))
        h = min(runs["hf"], key=lambda r: r["seconds"]) if runs["hf"] else None
        gflops, ceiling = max(runs["ceiling"])
        table.append((P, e, n, h, gflops, ceiling, max(runs["prepacked"])[0]))

    print("\n  P | engine tok/s | naive tok/s | HF tok/s | engine/naive | engine/HF | prompt KV engine | naive")
    for P, e, n, h, gflops, ceiling, _ in table:
        hf_cell = f"{new_tokens / h['seconds']:8,.0f} | " if h else "       - | "
        hf_ratio = f"{h['seconds'] / e['seconds']:8.1f}x" if h else "        -"
        print(f"{P:4d} | {new_tokens / e['seconds']:12,.0f} | {new_tokens / n['seconds']:11,.0f} | {hf_cell}"
              f"{n['seconds'] / e['seconds']:11.1f}x | {hf_ratio} | {e['prompt_kv_bytes'] / 2**20:13.2f} MiB | "
              f"{n['prompt_kv_bytes'] / 2**20:.2f} MiB")
    for P, e, n, h, gflops, ceiling, prepacked in table:
        decode = new_tokens * (NEW - 1) / NEW / (e["seconds"] - e["prefill_seconds"])
        print(f"P = {P}: engine prefill {e['prefill_seconds']:.3f}s of {e['seconds']:.3f}s; decode alone "
              f"{decode:,.0f} tokens/s, {decode / ceiling * gflops:.0f} GFLOP/s in its linears = {decode / ceiling:.0%}"
              f" of the same linears' matmuls alone (F.linear) at {NUM_PROMPTS * G} rows, measured in the same "
              f"rounds ({gflops:.0f} GFLOP/s -> {ceiling:,.0f} tokens/s); "
              f"{decode / ceiling * gflops / prepacked:.0%} of them prepacked as generate runs them ({prepacked:.0f} GFLOP/s)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if quick or model_dir:
        return

    print(f"\nscaling in P: prefill seconds of the engine at G = 1 and G = {G}, and of the naive sampler at G = {G}")
    print("     P | engine G=1 | engine G=8 | G=8/G=1 | naive G=8 | engine tok/s | naive tok/s")
    for P in (64, 256, 1024):
        prompts = torch.randint(model.config.vocab_size, (NUM_PROMPTS, P), generator=gen).tolist()
        one, eight, n = [], [], []
        for _ in range(rounds):
            one.append(engine(model, prompts, 1, 2))
            eight.append(engine(model, prompts, G, 2))
            n.append(naive_generate(model, prompts, G, NEW, 2))
        one, eight, n = (min(runs, key=lambda r: r["seconds"]) for runs in (one, eight, n))
        print(f"{P:6d} | {one['prefill_seconds']:10.3f} | {eight['prefill_seconds']:10.3f} | "
              f"{eight['prefill_seconds'] / one['prefill_seconds']:7.2f} | {n['prefill_seconds']:9.3f} | "
              f"{new_tokens / eight['seconds']:12,.0f} | {new_tokens / n['seconds']:11,.0f}")
    if device.type == "cuda":
        gpu_bandwidth()


if __name__ == "__main__":
    main()
