"""One GRPO step, engine vs naive, seconds per phase, side by side in one process.

engine: memory phases, rollout prefilling each prompt once (shared prompt KV), training forward with the
        prompt computed once per group and chunked logprobs (grpo.accumulate).
naive:  no phases, rollout with each prompt repeated G times (one cache row and one prefill per sample),
        training forward on the prompt repeated G times with full (N, T, V) logits.
Tiny config (dim 256, 4 layers, 8/4 heads, ffn 704, vocab 2048), 16 prompts x G = 8, C = 32 new tokens
(no early stop), P = 64 and 512. On CUDA the same runs in bf16 and peak memory is printed too.
Run: python tests/bench_train.py [--repeats 3] [--P 64,512]
     python tests/bench_train.py --ops [train.py flags]   # ops a default train.py step launches, by phase
"""

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import memory  # noqa: E402
import rollout  # noqa: E402
from engine import decode  # noqa: E402
from model import Llama, ModelConfig  # noqa: E402

PROMPTS, G, C = 16, 8, 32


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_step(model, optimizer, prompts, gcfg, mem, engine: bool, device) -> dict[str, float]:
    times = {}
    sync(device)
    t0 = time.perf_counter()
    if engine:
        with mem.phase("rollout"):
            out = rollout.generate(model, prompts, rollout.RolloutConfig(num_samples=G, max_new_tokens=C),
                                   seed=0, cache=mem.cache)
    else:
        repeated = [p for p in prompts for _ in range(G)]
        out = rollout.generate(model, repeated, rollout.RolloutConfig(num_samples=1, max_new_tokens=C), seed=0)
    sync(device)
    times["rollout"] = time.perf_counter() - t0
    rewards = torch.rand(out.tokens.shape[0], generator=torch.Generator().manual_seed(0))  # stands in for a task
    advantages = grpo.group_advantages(rewards, G).to(device)
    prompt_ids, prompt_lens = grpo.pad_right(prompts, device)
    batch = grpo.GRPOBatch(prompt_ids, prompt_lens, out.tokens, out.mask, out.temperature, C, advantages)
    t0 = time.perf_counter()
    if engine:
        with mem.phase("train"):
            optimizer.zero_grad(set_to_none=True)
            grpo.accumulate(model, batch, gcfg)
            optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        logp, _ = grpo.completion_logprobs(model, batch, chunk_size=0, forward="naive")
        mask = batch.mask
        loss, _ = grpo.grpo_loss(logp, None, None, advantages, mask, gcfg, num_seqs=mask.shape[0],
                                 num_tokens=int(mask.sum()), max_completion_len=C)
        loss.backward()
        optimizer.step()
    sync(device)
    times["train"] = time.perf_counter() - t0
    times["step"] = times["rollout"] + times["train"]
    return times


def main(repeats: int = 3, lengths: tuple[int, ...] = (64, 512)) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    print(f"device {device}, {dtype}, {PROMPTS} prompts x G={G}, C={C}, tiny config; median of {repeats}")
    print(f"{'P':>5} {'path':>7} {'rollout s':>10} {'train s':>9} {'step s':>8} {'peak GB':>8} {'step speedup':>13}")
    for P in lengths:
        gen = torch.Generator().manual_seed(P)
        prompts = [torch.randint(3, 2048, (P,), generator=gen).tolist() for _ in range(PROMPTS)]
        results = {}
        for engine in (False, True):
            model = Llama(cfg).init_weights(0).to(device=device, dtype=dtype)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            gcfg = grpo.GRPOConfig(micro_batch_groups=PROMPTS)
            mem = memory.PhaseManager(device)
            mem.cache = decode.KVCache.for_batch(cfg, PROMPTS, G, P, C, dtype, device)
            mem.add_weights(model, model)
            mem.add_kv_cache(mem.cache.buffer)
            mem.add_grads(model)
            mem.add_optimizer(optimizer)
            one_step(model, optimizer, prompts, gcfg, mem, engine, device)  # warm-up
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            runs = [one_step(model, optimizer, prompts, gcfg, mem, engine, device) for _ in range(repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            med["peak"] = (max(mem.peak_bytes(), torch.cuda.max_memory_allocated()) / 1e9
                           if device.type == "cuda" else float("nan"))
            results[engine] = med
        for engine in (False, True):
            r = results[engine]
            speedup = results[False]["step"] / r["step"]
            print(f"{P:>5} {'engine' if engine else 'naive':>7} {r['rollout']:>10.3f} {r['train']:>9.3f} "
                  f"{r['step']:>8.3f} {r['peak']:>8.2f} {speedup:>12.2f}x")


def step_ops(flags: list[str], steps: int = 2) -> None:
    """The aten ops (less views and bare allocations: a kernel each on CUDA) of whole train.py
    steps with these flags, by phase: where a tiny model's step time goes on a GPU, launches."""
    import train
    from bench_rollout import OpCount
    phase = ["rest"]
    count = OpCount(key=lambda name: phase[0])

    def in_phase(name, fn):
        def wrapped(*args, **kwargs):
            phase[0] = name
            try:
                return fn(*args, **kwargs)
            finally:
                phase[0] = "rest"
        return wrapped

    rollout.generate = in_phase("rollout", rollout.generate)
    train.train_phase = in_phase("train", train.train_phase)
    with tempfile.TemporaryDirectory() as out:
        run = train.setup(train.parse_args(["--eval_every", "0", "--save_every", "0",
                                            "--overwrite", "true", "--out", out] + flags))
        train.step(run, 1)  # warm: the first step builds what later ones reuse
        with count:
            for s in range(2, 2 + steps):
                train.step(run, s)
    total = sum(count.ops.values()) // steps
    print(f"ops a step, the mean of {steps} (train.py {' '.join(flags)}): {total:,}; "
          + ", ".join(f"{k} {n // steps:,}" for k, n in count.ops.most_common()))


if __name__ == "__main__":
    if "--ops" in sys.argv:
        sys.exit(step_ops(sys.argv[sys.argv.index("--ops") + 1:]))
    arg = lambda name, default: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default  # noqa: E731
    main(int(arg("--repeats", 3)), tuple(int(p) for p in arg("--P", "64,512").split(",")))
