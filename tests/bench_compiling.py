"""Compile paid once: the first training step's compile seconds with a cold cache and with a warm
one, and the compiled step against the eager one.

Each measurement runs in a fresh process (a child of this script): build the model, compile its
blocks (compiling.compile_blocks, train.py's --compile_blocks), run one GRPO forward + backward
(grpo.accumulate, one micro-batch) and read compiling.compile_seconds(), dynamo's own count; then
time the same step compiled and eager (best of --rounds, after the first). The cold child compiles
into an empty --compile_cache directory, the warm child reads what the cold one wrote: their ratio
is what the cache saves a run (dynamo still traces; inductor, AOTAutograd and Triton load).

    python tests/bench_compiling.py                         # the tests' tiny model on the CPU, fp32
    python tests/bench_compiling.py --shape Qwen2.5-0.5B    # CUDA: bf16 autocast, random weights

Batch: --prompts x --G rows, prompts of --P tokens, completions of --new (uniform lengths).
cold_and_warm() returns the figures as a dict (a GPU check script calls it).
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import compiling  # noqa: E402
import grpo  # noqa: E402
from run import plan  # noqa: E402


def build(shape: str, device: torch.device):
    """The tests' tiny model (fp32), or a published shape's random weights in fp32 (the master
    train.py's bf16 keeps) on the GPU."""
    if shape == "tiny":
        from bench_ragged import tiny_model
        return tiny_model().to(device)
    from bench_limits import build as build_shape
    return build_shape(shape, torch.float32).train()


def batch_for(vocab: int, prompts: int, G: int, P: int, new: int,
              device: torch.device) -> grpo.GRPOBatch:
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (prompts, P), generator=gen).tolist()
    completions = torch.randint(3, vocab, (prompts * G, new), generator=gen).tolist()
    batch = grpo.GRPOBatch.from_lists(prompt_ids, completions, device=device)
    batch.advantages = torch.randn(prompts * G, generator=gen).to(device)
    return batch


def child(args) -> None:
    """One fresh process: the first step's compile seconds, then compiled and eager step times.
    Prints one JSON line."""
    device = torch.device("cuda" if args.shape != "tiny" else "cpu")
    torch.set_num_threads(args.threads)
    compiling.BACKEND = args.backend
    compiling.use_cache(args.compile_cache)
    model = build(args.shape, device)
    batch = batch_for(model.config.vocab_size, args.prompts, args.G, args.P, args.new, device)
    chunk = plan.GPU_CHUNK_BYTES if device.type == "cuda" else grpo.GRPOConfig.chunk_bytes
    cfg = grpo.GRPOConfig(micro_batch_groups=args.prompts, chunk_bytes=chunk)  # train.py's
    bf16 = device.type == "cuda"  # train.py's --dtype bfloat16: autocast over the fp32 master

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext():
            grpo.accumulate(model, batch, cfg)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    compiling.compile_blocks(model.model.layers)
    before = compiling.compile_seconds()
    first = step()
    figures = dict(compile_s=compiling.compile_seconds() - before, first_step_s=first)
    if args.rounds:  # --rounds 0: the first step alone (its compile is the figure)
        figures["compiled_step_s"] = min(step() for _ in range(args.rounds))
        compiling.compile_blocks(model.model.layers, False)
        step()  # the eager route's own warm-up (allocator, kernels)
        figures["eager_step_s"] = min(step() for _ in range(args.rounds))
    print(json.dumps(figures), flush=True)


def cold_then_warm(shape: str = "tiny", prompts: int = 16, G: int = 8, P: int = 64, new: int = 64,
                   rounds: int = 3, threads: int = 1, backend: str = "inductor"):
    """Two fresh processes on one new cache directory: the first compiles cold, the second warm
    (rounds 0: each times its first step alone, not the compiled and eager steps after it).
    Yields the figures after each (a caller with a time limit keeps the cold one). backend
    "aot_eager" generates no code (a quick dry run of the measurement)."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "compile_cache")
        argv = [sys.executable, os.path.abspath(__file__), "--child", "--shape", shape,
                "--prompts", str(prompts), "--G", str(G), "--P", str(P), "--new", str(new),
                "--rounds", str(rounds), "--threads", str(threads), "--compile_cache", cache,
                "--backend", backend]
        out = dict(shape=shape)
        for name in ("cold", "warm"):
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
            out[name] = json.loads(done.stdout.strip().splitlines()[-1])
            yield out
    cold, warm = out["cold"], out["warm"]
    out["warm_over_cold"] = warm["compile_s"] / cold["compile_s"]
    if rounds:
        out["compiled_over_eager"] = warm["compiled_step_s"] / warm["eager_step_s"]
    yield out


def cold_and_warm(*args, **kwargs) -> dict:
    """cold_then_warm's figures once both processes ran, with the ratios."""
    return list(cold_then_warm(*args, **kwargs))[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny", help="tiny (CPU) or a bench_bf16 shape (CUDA)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--P", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile_cache", default="", help="a child's cache directory")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--child", action="store_true", help="one measurement (cold_and_warm's)")
    args = parser.parse_args()
    if args.child:
        return child(args)
    r = cold_and_warm(args.shape, args.prompts, args.G, args.P, args.new, args.rounds,
                      args.threads)
    device = (torch.cuda.get_device_name() if args.shape != "tiny"
              else f"CPU, {args.threads} thread(s)")
    print(f"{args.shape}, {device}, torch {torch.__version__}: one GRPO forward + backward of "
          f"{args.prompts} x {args.G} x ({args.P} + {args.new}); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| cache | compile s (first step) | first step s | compiled step s | eager step s |\n"
          "|---|---|---|---|---|")
    for name in ("cold", "warm"):
        c = r[name]
        print(f"| {name} | {c['compile_s']:.1f} | {c['first_step_s']:.1f} | "
              f"{c['compiled_step_s']:.3f} | {c['eager_step_s']:.3f} |")
    print(f"warm / cold compile: {r['warm_over_cold']:.2f}; compiled / eager step: "
          f"{r['compiled_over_eager']:.2f}")


if __name__ == "__main__":
    main()
