"""The engine on a CUDA GPU against the machine's own limits, measured in the same run, bf16.

    python tests/bench_limits.py                         # Qwen2.5-0.5B and Llama-3.2-1B shapes
    python tests/bench_limits.py --shapes Qwen2.5-0.5B --parts rollout,train,sleep
    python tests/bench_limits.py --shapes Qwen2.5-0.5B --parts rollout --prompts 64 --prompt_len 512

Limits (measured first, in the same process): device-to-device copy bandwidth (bytes read plus
bytes written over the time), the bf16 matmul rate (8192 x 8192 x 8192), pinned host <-> device
copy bandwidth. Random weights of the published shapes (tests/bench_bf16.py's SHAPES).
1. rollout: 16 prompts x 8 samples, 64 prompt tokens (--prompts, --prompt_len), 256 new tokens,
   no stop id. Decode tokens/s compiled and captured (the default), captured alone
   (--compile_decode false) and eager, and transformers' generate on the same weights (do_sample, 8 return
   sequences, min_new_tokens = max_new_tokens) when it is importable. Bytes per decode step: the
   weights the step reads (the embedding rows aside: a tied lm_head reads the matrix once) + the
   prompt KV (once per group) + the completion KV actually needed (t keys per row, the mean over
   the steps); over the copy bandwidth.
2. train: one GRPO forward + backward (grpo.accumulate, GRPOConfig with train.py's logprob chunk
   on a GPU, plan.GPU_CHUNK_BYTES), fp32 master weights under bf16 autocast (train.py's bf16), the
   blocks compiled (train.py's --compile_blocks on CUDA; this bench's --compile false: eager), by
   forward: padded (prompts padded to P, rows to NEW), packed (the engine's: valid tokens only) and naive (each
   prompt repeated per row); at uniform lengths 16 x 8 x (64 + 256), and at lengths with a mean
   of 1/3 of those (bench_ragged.lengths), in micro-batches of whole groups up to the uniform
   batch's tokens (train.py's token budget on a GPU: one micro-batch each), and at the mean of
   1/3 in micro-batches of 4 groups too (a fixed count: four launch-bound steps). Model FLOPs = 3 x the
   forward's matmul FLOPs of the work that must be done (the prompt once per group, the lm_head
   on completion tokens, causal attention): the same count for every forward, so the padding and
   the repeated prompt show as lower utilisation. Goals: packed <= 1.0x padded at uniform
   lengths, <= 1.2x the valid tokens' share of it at a mean of 1/3.
3. sleep: train.py's memory phases (plan.memory_phases) over the fp32 master, the bf16 sampler,
   grads, AdamW and the KV cache: seconds and GB/s of each move against the pinned copy, the
   device's free bytes (torch.cuda.mem_get_info) and the allocator's reserved bytes before and
   after, and the weights after a sleep/wake cycle against a copy kept aside.
4. plan: `train.py --plan` and 3 steps of the same run on a checkpoint of the shape (random bf16
   weights, tests/test_tokenizer.py's BPE and ChatML), each phase's max_memory_allocated.
On a CPU, `--parts rollout,train --shapes tiny` runs those two parts on the tests' tiny model (a
dry run: tests/gpu_check.py's); the others need a CUDA GPU. --json FILE writes the rows.
"""

import argparse
import dataclasses
import functools
import json
import os
import random
import sys
import tempfile
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import compiling  # noqa: E402
import grpo  # noqa: E402
from engine import hf  # noqa: E402
from engine import packing  # noqa: E402
from run import plan  # noqa: E402
from bench_bf16 import SHAPES  # noqa: E402
from bench_ragged import tiny_model  # noqa: E402
from memory import MemoryConfig  # noqa: E402
from model import Llama  # noqa: E402
from engine.decode import KVCache  # noqa: E402
from rollout import RolloutConfig, generate, sync_weights  # noqa: E402

BP, G, P, NEW = 16, 8, 64, 256
GB = 1e9


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Seconds per call: one warm-up, then the mean of `repeats` between two synchronisations."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def fastest(fn, repeats: int) -> float:
    """Seconds of fn's fastest call of `repeats` (after a warm-up): a rate measured on a machine
    that runs other work too is the machine's when it had the cores (a mean would be lower than
    the rate a later step reaches, and a share of it over 100%)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def limits() -> dict:
    if not torch.cuda.is_available():  # the CPU's fp32 matmul and copy (a dry run of the parts)
        x = torch.randn(1024, 1024)
        mm = 2 * 1024**3 / fastest(lambda: x @ x, 20) / 1e12
        a = torch.empty(2**26, dtype=torch.uint8)
        b = torch.empty_like(a)
        copy = 2 * a.numel() / fastest(lambda: b.copy_(a), 20) / GB
        print(f"limits: CPU fp32 matmul {mm * 1e3:,.0f} GFLOP/s, copy {copy:,.1f} GB/s")
        return dict(matmul=mm, copy=copy)
    n = 2**30  # 1 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy = 2 * n / timed(lambda: b.copy_(a), 20) / GB  # read + written
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn_like(x)
    mm = 2 * 8192**3 / timed(lambda: x @ y, 10) / 1e12
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2h = n / timed(lambda: host.copy_(a, non_blocking=True), 10) / GB
    h2d = n / timed(lambda: a.copy_(host, non_blocking=True), 10) / GB
    del a, b, x, y, host
    torch.cuda.empty_cache()
    print(f"limits: device copy {copy:,.0f} GB/s (read + write), bf16 matmul {mm:,.0f} TFLOP/s, "
          f"pinned copy device->host {d2h:.1f} GB/s, host->device {h2d:.1f} GB/s")
    return dict(copy=copy, matmul=mm, d2h=d2h, h2d=h2d)


def build(name: str, dtype: torch.dtype, device: str = "cuda") -> Llama:
    """Random weights of a published shape (or "tiny", the tests' model, for a run on the CPU),
    made on the device (init_weights draws on the CPU: minutes for 1B parameters); norms 1, biases
    0, as init_weights."""
    with torch.device(device):
        model = Llama(SHAPES[name] if name != "tiny" else tiny_model().config).to(dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif pname.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0, 0.02, generator=torch.Generator(device).manual_seed(len(pname)))
    return model.eval()


def decode_bytes(model: Llama) -> tuple[float, float]:
    """Bytes one decode step must read: the weights (the embedding matrix once, as the tied
    lm_head; its lookup of 128 rows is noise) and the KV, mean over the steps."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not c.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.numel() * 2  # the lookup reads 128 rows
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16
    kv = per_token * (BP * P + BP * G * (NEW - 1) / 2)  # prompt once per group, mean own keys
    return weights, kv


HF_CACHES = {"dynamic": "transformers generate, dynamic cache",
             "static": "transformers generate, static cache + compile"}


def hf_generate_seconds(model: Llama, prompts: list[list[int]],
                        caches: tuple[str, ...] = tuple(HF_CACHES)) -> dict[str, float]:
    """Seconds of transformers' generate on the same weights, by cache (HF_CACHES): its dynamic
    cache, eager, and its static cache, which generate compiles on CUDA (torch.compile with CUDA
    graphs: its fastest route; on the CPU it runs eagerly). Each after a warm-up call (the compile's)."""
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: its rows are skipped")
        return {}
    device = next(model.parameters()).device
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_model(model, tmp)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
    theirs = theirs.to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, num_return_sequences=G,
              max_new_tokens=NEW, min_new_tokens=NEW, top_k=0, top_p=1.0, temperature=1.0,
              pad_token_id=0, eos_token_id=None)
    seconds = {}
    for cache in caches:
        extra = dict(cache_implementation="static") if cache == "static" else {}
        out = theirs.generate(ids, **kw, **extra)  # warm-up (the static cache's compile)
        assert out.shape == (BP * G, P + NEW), out.shape
        sync()
        start = time.perf_counter()
        theirs.generate(ids, **kw, **extra)
        sync()
        seconds[cache] = time.perf_counter() - start
        print(f"{HF_CACHES[cache]}: {seconds[cache]:.2f} s", flush=True)
    del theirs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


ROLLOUT_ROUTES = {"engine, compiled + graphs": (True, "true"), "engine, graphs": (True, "false"),
                  "engine, eager": (False, "false")}  # (cuda_graphs, compile_decode)


def rollout_rows(name: str, lim: dict, device: str = "cuda",
                 routes: tuple[str, ...] = tuple(ROLLOUT_ROUTES),
                 transformers: tuple[str, ...] = tuple(HF_CACHES)):
    """Decode tokens/s of each route and transformers' generate with each of `transformers`'
    caches (HF_CACHES) on the same weights and prompts (the same in every call: the weights are
    drawn from fixed seeds), and the share of the copy-bandwidth floor (lim["copy"]) a decode step
    reaches. Yields each row as it is measured (a caller with a time limit keeps the rows so far);
    the engine's rows get x generate, against the fastest cache measured here, once those ran."""
    model = build(name, torch.bfloat16, device)
    V = model.config.vocab_size
    prompts = torch.randint(V, (BP, P), generator=torch.Generator().manual_seed(0)).tolist()
    weights, kv = decode_bytes(model)
    rows = []
    for label in routes:
        graphs, compiled = ROLLOUT_ROUTES[label]
        cfg = RolloutConfig(num_samples=G, max_new_tokens=NEW, cuda_graphs=graphs,
                            compile_decode=compiled)
        warm = generate(model, prompts, cfg, seed=0).stats  # allocator, cuBLAS, compile, capture
        stats = generate(model, prompts, cfg, seed=1).stats
        step = (stats["seconds"] - stats["prefill_seconds"]) / stats["decode_steps"]
        rows.append(dict(shape=name, P=P, route=label, seconds=stats["seconds"],
                         tokens_s=BP * G * NEW / stats["seconds"], decode_tokens_s=BP * G / step,
                         step_ms=step * 1e3, floor_share=(weights + kv) / lim["copy"] / GB / step,
                         compiles=warm["compiles"], compile_seconds=warm["compile_seconds"],
                         timed_compiles=stats["compiles"]))  # 0 unless a layout compiled again
        yield rows[-1]
    engine = list(rows)
    hf_seconds = {}
    for cache in transformers:  # one cache at a time: the dynamic one's figure before the static
        hf_seconds.update(hf_generate_seconds(model, prompts, (cache,)))  # one's compile
        if cache in hf_seconds:
            rows.append(dict(shape=name, P=P, route=HF_CACHES[cache], cache=cache,
                             seconds=hf_seconds[cache], tokens_s=BP * G * NEW / hf_seconds[cache]))
            yield rows[-1]
    for row in engine:  # against transformers at its best
        if hf_seconds:
            row["over_generate"] = min(hf_seconds.values()) / row["seconds"]
        for cache, seconds in hf_seconds.items():
            row[f"over_generate_{cache}"] = seconds / row["seconds"]
    print(f"\n{name} rollout, bf16, {BP} prompts x {G} samples, P = {P}, {NEW} new tokens; bytes per"
          f" decode step {weights / GB:.3f} GB weights + {kv / GB:.3f} GB KV (mean); device copy "
          f"{lim['copy']:,.0f} GB/s")
    print("| | s | tokens/s (whole rollout) | decode tokens/s | of the copy floor | x generate |"
          "\n|---|---|---|---|---|---|")
    for r in rows:
        extra = "- | -" if "step_ms" not in r else f"{r['decode_tokens_s']:,.0f} | " \
            f"{r['floor_share']:.0%}"
        label = r["route"] + (f" (its warm-up compiled {r['compiles']}, "
                              f"{r['compile_seconds']:.1f} s)" if r.get("compiles") else "")
        print(f"| {label} | {r['seconds']:.2f} | {r['tokens_s']:,.0f} | {extra} | "
              f"{r.get('over_generate', 1):.1f}x |")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def rollout_part(*args, **kwargs) -> list[dict]:
    """rollout_rows' rows, all of them."""
    return list(rollout_rows(*args, **kwargs))


def train_flops(model: Llama, prompt_lens: list[int], completion_lens: list[int]) -> float:
    """3 x the forward's matmul FLOPs of the work that must be done: every prompt token once per
    group, every completion token but the last of its row (n - 1 of a row's n are fed: the last
    is only scored), the lm_head where a completion token is scored (n positions: the prompt's
    last and the n - 1 fed), causal attention (a fed token on its prompt and on its row's tokens
    up to itself). The same count for every route."""
    c = model.config
    group = len(completion_lens) // len(prompt_lens)
    body = sum(p.numel() for n, p in model.named_parameters()
               if "layers." in n and n.endswith("proj.weight"))
    fed = [max(n - 1, 0) for n in completion_lens]
    tokens = sum(prompt_lens) + sum(fed)
    head = 2 * c.vocab_size * c.hidden_size * sum(completion_lens)
    width = c.num_attention_heads * c.head_dim
    # QK^T and PV: 4 * width flops per (query, key) pair; causal pairs of the prompt and of each row
    pairs = sum(p * (p + 1) / 2 for p in prompt_lens) + sum(
        f * prompt_lens[i // group] + f * (f + 1) / 2 for i, f in enumerate(fed))
    attention = 4 * width * pairs * c.num_hidden_layers
    return 3 * (2 * body * tokens + head + attention)


def grpo_batch(V: int, device: str, mean: float = 1.0) -> grpo.GRPOBatch:
    """BP prompts of P tokens and BP x G completions of NEW (mean 1), or of lengths whose mean is
    about `mean` of those (bench_ragged.lengths: the longest present in each, so the padded shape
    is the uniform one's)."""
    from bench_ragged import lengths
    rng = random.Random(1)
    prompt_lens = [P] * BP if mean == 1 else lengths(BP, P, mean, rng)
    completion_lens = [NEW] * (BP * G) if mean == 1 else lengths(BP * G, NEW, mean, rng)
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in prompt_lens]
    completions = [[rng.randrange(3, V) for _ in range(n)] for n in completion_lens]
    batch = grpo.GRPOBatch.from_lists(prompts, completions, device=device)
    batch.advantages = torch.tensor([rng.gauss(0, 1) for _ in completions], device=device)
    return batch


ROUTES = {"padded": "prompts padded to P, rows to NEW, each prompt once per group",
          "packed": "the engine's: valid tokens only, each prompt once per group",
          "naive": "each prompt repeated for its G rows, padded"}


# The train part's rows in the order a caller with a time limit wants them: the goals' figures
# first (packed against padded at uniform lengths, then at a mean of 1/3), then the repeated
# prompt, then micro-batches by a fixed count of 4 groups at a mean of 1/3 (the launch-bound step
# a count gives). Micro-batches otherwise as train.py picks them on a GPU (plan.fit: whole groups
# up to a token budget, here the uniform batch's tokens, which fit an H100 at these shapes).
TRAIN_ROWS = (("uniform", "padded"), ("uniform", "packed"), ("mean 1/3", "padded"),
              ("mean 1/3", "packed"), ("uniform", "naive"), ("mean 1/3", "naive"),
              ("mean 1/3, 4 groups a micro-batch", "padded"),
              ("mean 1/3, 4 groups a micro-batch", "packed"))
TRAIN_CASES = {"uniform": (1.0, 0), "mean 1/3": (1 / 3, 0),
               "mean 1/3, 4 groups a micro-batch": (1 / 3, 4)}  # (mean length, groups)


def train_rows(name: str, lim: dict, device: str = "cuda", compile: bool = True,
               repeats: int = 3):
    """GRPO forward + backward (grpo.accumulate) by route (ROUTES) and lengths (TRAIN_ROWS' order),
    bf16 autocast over the fp32 master on CUDA (fp32 on the CPU), the blocks compiled or not
    (train.py's --compile_blocks): seconds, MFU against the measured matmul rate, and packed
    against padded beside the valid tokens' share. Yields each row as it is measured."""
    model = build(name, torch.float32, device).train()
    if compile:
        compiling.compile_blocks(model.model.layers)
    original = grpo.completion_logprobs
    cuda = device == "cuda"
    route = packing.cuda_route(torch.bfloat16, model.config.head_dim) if cuda else ("cpu", "")
    precision = "fp32 master under bf16 autocast" if cuda else "fp32"
    print(f"\n{name} GRPO forward + backward, {precision}, {BP} x {G} x ({P} + {NEW}) longest; "
          f"attention route {route[0]} {route[1]}; blocks {'compiled' if compile else 'eager'}; "
          f"matmul {lim['matmul']:,.0f} TFLOP/s\n"
          "| lengths | forward | micro-batches | s | valid / padded tokens | packed / padded | "
          "TFLOP/s | MFU | peak GB |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    cases, seconds = {}, {}
    for label, forward in TRAIN_ROWS:
        if label not in cases:
            mean, groups = TRAIN_CASES[label]
            batch = grpo_batch(model.config.vocab_size, device, mean)
            prompt_lens = batch.prompt_lens.tolist()
            completion_lens = batch.mask.sum(1).tolist()
            valid = sum(prompt_lens) + sum(max(n - 1, 0) for n in completion_lens)
            cfg = grpo.GRPOConfig(chunk_bytes=plan.GPU_CHUNK_BYTES if cuda else
                                  grpo.GRPOConfig.chunk_bytes, micro_batch_groups=groups or 1,
                                  micro_batch_tokens=0 if groups else BP * (P + G * NEW))
            cases[label] = (batch, cfg, train_flops(model, prompt_lens, completion_lens),
                            valid / (BP * P + BP * G * (NEW - 1)),
                            len(grpo.micro_batches(batch, cfg)))
        batch, cfg, flops, share, micro = cases[label]
        grpo.completion_logprobs = functools.partial(original, forward=forward)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext():
                grpo.accumulate(model, batch, cfg)
            model.zero_grad(set_to_none=False)
        try:
            step()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            compiled_before = compiling.compile_seconds()
            seconds[label, forward] = timed(step, repeats)
            recompiled = compiling.compile_seconds() - compiled_before  # 0: none timed
        finally:
            grpo.completion_logprobs = original
        peak = torch.cuda.max_memory_allocated() / GB if cuda else None  # strict JSON
        rate = flops / seconds[label, forward] / 1e12
        ratio = seconds[label, forward] / seconds[label, "padded"]  # padded runs first
        row = dict(shape=name, lengths=label, forward=forward, micro_batches=micro,
                   seconds=seconds[label, forward], tflops=rate, mfu=rate / lim["matmul"],
                   valid_share=share, over_padded=ratio, peak_gb=peak, compiled=compile,
                   route=route[0], timed_compile_s=recompiled)
        over = f"{ratio:.2f} ({ratio / share:.2f}x the share)"
        print(f"| {label} | {forward} | {micro} | {row['seconds']:.3f} | {share:.2f} | "
              f"{over} | {rate:,.1f} | {row['mfu']:.0%} | "
              f"{'-' if peak is None else f'{peak:.1f}'} |", flush=True)
        yield row
    del model
    if cuda:
        torch.cuda.empty_cache()


def train_part(name: str, lim: dict, device: str = "cuda", compile: bool = True,
               repeats: int = 3) -> list[dict]:
    """train_rows' rows, all of them, with the goals' two ratios and the optimizer's step."""
    rows = list(train_rows(name, lim, device, compile, repeats))
    uniform, ragged = (next(r for r in rows if r["forward"] == "packed" and r["lengths"] == label)
                       for label in ("uniform", "mean 1/3"))  # the token budget's
    print(f"packed / padded: {uniform['over_padded']:.2f} at uniform lengths (goal <= 1.0), "
          f"{ragged['over_padded'] / ragged['valid_share']:.2f}x the token share "
          f"{ragged['valid_share']:.2f} at a mean of 1/3 (goal <= 1.2)")
    model = build(name, torch.float32, device)
    model.zero_grad(set_to_none=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    opt = timed(optimizer.step, repeats)
    print(f"AdamW step (fp32, {sum(p.numel() for p in model.parameters()) / 1e6:,.0f} M params): "
          f"{opt * 1e3:.1f} ms")
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def profiled(fn, top: int = 12) -> dict:
    """Where fn's time goes (after a warm-up call): its wall clock, the kernels' time on the GPU
    (on the CPU: the aten ops' own time) and their share of the wall (1 - the launch gaps), the
    kernels launched, and the `top` kernels by time: [name, ms, calls]."""
    from collections import Counter
    cuda = torch.cuda.is_available()
    fn()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - start
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and (
        cuda or (e.cpu_parent is None and e.name.startswith("aten::")))]
    ms, calls = Counter(), Counter()
    for e in events:
        ms[e.name[:90]] += e.time_range.elapsed_us() / 1e3
        calls[e.name[:90]] += 1
    busy = sum(ms.values()) / 1e3
    return dict(wall_s=wall, kernel_s=busy, busy_share=busy / wall, kernels=len(events),
                top=[[name, round(t, 3), calls[name]] for name, t in ms.most_common(top)])


def profile_part(name: str, device: str = "cuda") -> dict:
    """profiled() over the goals' measurements: one compiled + captured rollout (P, NEW as set),
    and one packed GRPO forward + backward (blocks compiled, bf16 autocast on CUDA) at uniform
    lengths and at a mean of 1/3."""
    cuda = device == "cuda"
    out = {}
    model = build(name, torch.bfloat16, device)
    V = model.config.vocab_size
    prompts = torch.randint(V, (BP, P), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = RolloutConfig(num_samples=G, max_new_tokens=NEW, cuda_graphs=True, compile_decode="true")
    out["rollout"] = profiled(lambda: generate(model, prompts, cfg, seed=0))
    del model
    model = build(name, torch.float32, device).train()
    compiling.compile_blocks(model.model.layers)
    for mean, label in ((1.0, "uniform"), (1 / 3, "mean 1/3")):
        batch = grpo_batch(V, device, mean)
        gcfg = grpo.GRPOConfig(chunk_bytes=plan.GPU_CHUNK_BYTES if cuda else
                               grpo.GRPOConfig.chunk_bytes,
                               micro_batch_tokens=BP * (P + G * NEW))  # train_part's

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext():
                grpo.accumulate(model, batch, gcfg)
            model.zero_grad(set_to_none=False)
        out[f"train {label}"] = profiled(step)
    for key, p in out.items():
        print(f"\n{name} {key}: wall {p['wall_s'] * 1e3:.1f} ms, kernels {p['kernel_s'] * 1e3:.1f} ms"
              f" ({p['busy_share']:.0%} busy), {p['kernels']} kernels; top by time:")
        for kname, t, n in p["top"]:
            print(f"  {t:9.3f} ms {n:6d}x  {kname}")
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out


def device_bytes() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()


def sleep_part(name: str, lim: dict) -> None:
    model = build(name, torch.float32)
    sampler = build(name, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # AdamW state exists
    sync_weights(sampler, model)
    cache = KVCache.for_batch(model.config, BP, G, P, NEW, torch.bfloat16, "cuda")
    mem = plan.memory_phases("cuda", MemoryConfig(), model, sampler, cache, optimizer, None)
    kept = {k: v.detach().cpu().clone() for k, v in optimizer.state_dict()["state"][0].items()}
    sampler_kept = sampler.model.layers[0].mlp.up_proj.weight.detach().cpu().clone()
    print(f"\n{name} memory phases (fp32 master, bf16 sampler, AdamW, grads, KV cache "
          f"{cache.nbytes / GB:.2f} GB); pinned copy {lim['d2h']:.1f} / {lim['h2d']:.1f} GB/s "
          "(device->host / host->device)")
    returned = []
    for phase in ("train", "rollout"):  # what each phase's exit puts to sleep, and the device's view
        mem.enter(phase)
        free, reserved = device_bytes()
        first = len(mem.transitions)
        mem.exit()
        free_after, reserved_after = device_bytes()
        slept = sum(t.nbytes for t in mem.transitions[first:] if t.action == "sleep")
        returned.append(f"leaving {phase}: {slept / GB:.2f} GB tagged asleep, device free "
                        f"+{(free_after - free) / GB:.2f} GB ({(free_after - free) / slept:.0%}), "
                        f"reserved -{(reserved - reserved_after) / GB:.2f} GB")
    for _ in range(2):  # timed cycles: the table keeps the last move of each tag
        with mem.phase("train"):
            pass
        with mem.phase("rollout"):
            pass
    with mem.phase("train"):
        state = optimizer.state_dict()["state"][0]
        exact = {k: torch.equal(state[k].cpu(), v) for k, v in kept.items()}
    with mem.phase("rollout"):
        sync_weights(sampler, model)
        exact["sampler"] = torch.equal(sampler.model.layers[0].mlp.up_proj.weight.cpu(),
                                       sampler_kept)
    print("| phase | tag | action | GB | s | GB/s | of pinned copy |\n|---|---|---|---|---|---|---|")
    last = {}
    for t in mem.transitions:
        last[(t.tag, t.action)] = t
    for (tag, action), t in sorted(last.items()):
        rate = t.nbytes / t.seconds / GB
        pinned = lim["d2h"] if action == "sleep" else lim["h2d"]
        moved = tag in ("optimizer",)  # copied to the host and back; the rest is freed/re-made
        share = f"{rate / pinned:.0%}" if moved else "freed" if action == "sleep" else "allocated"
        print(f"| {t.phase} | {tag} | {action} | {t.nbytes / GB:.2f} | {t.seconds:.3f} | "
              f"{rate:,.1f} | {share} |")
    print("; ".join(returned) + f"; after the cycles, bit-exact: {exact}")
    del mem, model, sampler, optimizer, cache
    torch.cuda.empty_cache()


def write_checkpoint(name: str, path: str) -> None:
    """A checkpoint train.py can run: build()'s bf16 weights, tests/test_tokenizer.py's byte-level
    BPE (Qwen2.5's specials, no BOS) and its ChatML template."""
    from test_tokenizer import CHATML_TEMPLATE, QWEN_SPECIALS, byte_level_bpe
    tok = byte_level_bpe(QWEN_SPECIALS, None)
    model = build(name, torch.bfloat16)
    model.config = dataclasses.replace(model.config, bos_token_id=None,
                                       eos_token_id=tok.token_to_id("<|im_end|>"))
    hf.save_model(model, path)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "chat_template": CHATML_TEMPLATE}, f)


def plan_part(name: str, lim: dict) -> None:
    """train.py --plan against 3 steps of the same run (the default task's prompts, tokenized by
    the BPE), each phase's max_memory_allocated from the run's own memory table."""
    import train
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(name, os.path.join(tmp, "model"))
        argv = ["--model", os.path.join(tmp, "model"), "--dtype", "bfloat16", "--prompts_per_step",
                str(BP), "--num_samples", str(G), "--max_new_tokens", str(NEW), "--max_prompt_len",
                str(P), "--eval_every", "0", "--save_every", "0", "--out", os.path.join(tmp, "out")]
        print(f"\n{name}: train.py {' '.join(argv[2:-2])}")
        train.main(argv + ["--plan"])
        run = train.setup(train.parse_args(argv))
        for step in range(3):
            train.step(run, step)
        train.checkpoint.release_out_dir()
        print("measured over 3 steps (max_memory_allocated per phase):")
        print(run.mem.report())
        del run
    torch.cuda.empty_cache()


def main() -> None:
    global BP, P, NEW  # every part's batch: BP prompts x G samples x (P + NEW) tokens
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="Qwen2.5-0.5B,Llama-3.2-1B")
    parser.add_argument("--parts", default="rollout,train,sleep,plan")
    parser.add_argument("--prompts", type=int, default=BP, help="prompts a step (G = 8 each)")
    parser.add_argument("--prompt_len", type=int, default=P, help="tokens a prompt")
    parser.add_argument("--new", type=int, default=NEW, help="tokens a completion")
    parser.add_argument("--compile", default="true", help="train: the blocks compiled (true/false)")
    parser.add_argument("--json", default="", help="write the rollout and train parts' rows here")
    args = parser.parse_args()
    BP, P, NEW = args.prompts, args.prompt_len, args.new
    cuda = torch.cuda.is_available()
    if not cuda and not set(args.parts.split(",")) <= {"rollout", "train"}:
        print("bench_limits needs a CUDA GPU; none is visible (on a CPU: --parts rollout,train "
              "--shapes tiny, a dry run of those parts)")
        return
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}")
    lim = limits()
    parts = dict(rollout=functools.partial(rollout_part, device="cuda" if cuda else "cpu"),
                 sleep=sleep_part, plan=plan_part,
                 train=functools.partial(train_part, device="cuda" if cuda else "cpu",
                                         compile=args.compile == "true"))
    rows = []
    for name in args.shapes.split(","):
        for part in args.parts.split(","):
            try:
                rows += parts[part](name, lim) or []
            except Exception as e:  # one part's failure must not hide the others' figures
                import traceback
                traceback.print_exc()
                print(f"{name} {part}: FAILED {type(e).__name__}: {e}")
                if cuda:
                    torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(limits=lim, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
