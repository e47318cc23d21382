"""Ragged batches: the padding-free training step and rollout against their padded twins.

Training (grpo.accumulate, one micro-batch of the whole generation batch, fp32, no activation
checkpointing): the packed forward (engine/packing.py, valid tokens only) against the padded one
(completion_logprobs(forward="padded"): every prompt padded to P, every row to T), on batches whose
prompts and completions have a mean of 1/2 or 1/3 of their longest (the longest present in each).
Time: the best of interleaved rounds (a shared machine's load hits both alike). Memory: the
allocator's peak live bytes during one step above what the step starts with (grads exist: the
second step), i.e. activations and transients (tests/memtrace.py).
Goal: packed time within 1.2x of (valid tokens / padded tokens) x the padded time; memory alike.

Launches (--parts launches): the aten ops of one packed training step (grpo.accumulate, forward
and backward; less views and bare allocations: a kernel each on CUDA, bench_rollout.OpCount, as
the decode step's are counted), at uniform lengths in one micro-batch against a mean of 1/3 in
micro-batches of a quarter of the groups by count (what the count made of a ragged batch), by
the token budget of that count at full length (the CPU's default now: plan.bound_micro_batch)
and by the uniform step's tokens (a GPU's default where the uniform batch fits one micro-batch:
plan.fit), with their wall time: a ragged step's launches are its cost on a GPU, where short rows leave the
kernels launch-bound.

Rollout (rollout.generate, greedy, no stop id): prompts of the same means, sorted into prefill
chunks and decode buckets of like lengths (the engine), against every chunk and bucket at the
batch's longest prompt (rollout.prefill_chunks and length_buckets replaced by their padded rules).

Models: the tests' tiny config (dim 256, 4 layers, 8/4 heads, ffn 704, vocab 2048), and with
--model DIR a real checkpoint (e.g. SmolLM2-135M-Instruct from ../shared/real-model). Also
--task_batch: a batch of tasks:ragged_copy (prompts and answers of 1-20 letters, mean ~1/3).

Run: python tests/bench_ragged.py [--model DIR] [--P 64 --T 64] [--prompts 16 --G 8] [--rounds 3]
     [--parts train,rollout,launches] [--threads 1]
"""

import argparse
import functools
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo  # noqa: E402
from engine import hf  # noqa: E402
import model as M  # noqa: E402
from engine import decode  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from memtrace import allocator_peak  # noqa: E402


def tiny_model() -> M.Llama:
    cfg = M.ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=2048)
    return M.Llama(cfg).init_weights(0)


def lengths(count: int, longest: int, ratio: float, rng: random.Random) -> list[int]:
    """count lengths in 1..longest whose mean is about ratio x longest (1/2: uniform; 1/3: the
    longest times u^2), the first one the longest (the padded shape is then fixed)."""
    power = 1 / ratio - 1  # E[u^p] = 1 / (p + 1)
    out = [max(1, round(longest * rng.random() ** power)) for _ in range(count)]
    out[0] = longest
    return out


def ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def training_batch(model, Bp: int, G: int, P: int, T: int, ratio: float, seed: int = 0):
    rng = random.Random(seed)
    V = model.config.vocab_size
    prompts = [ids(n, V, rng) for n in lengths(Bp, P, ratio, rng)]
    completions = [ids(n, V, rng) for n in lengths(Bp * G, T, ratio, rng)]
    return batch_of(prompts, completions, rng)


def task_batch(model, tokenizer, Bp: int, G: int):
    """tasks:ragged_copy's prompts and their answers (plus the stop) as completions."""
    rng = random.Random(0)
    examples = [tasks.ragged_copy.sample(rng) for _ in range(Bp * G)]
    prompts = [tokenizer.encode_text(p, add_special_tokens=False) for p, _ in examples[::G]]
    completions = [tokenizer.encode_text(r, add_special_tokens=False) + [2] for _, r in examples]
    return batch_of(prompts, completions, rng)


def batch_of(prompts, completions, rng):
    advantages = torch.tensor([rng.gauss(0, 1) for _ in completions])
    batch = grpo.GRPOBatch.from_lists(prompts, completions, advantages=advantages)
    valid = sum(map(len, prompts)) + sum(max(len(c) - 1, 0) for c in completions)
    padded = len(prompts) * max(map(len, prompts)) + len(completions) * (batch.tokens.shape[1] - 1)
    return batch, valid, padded


def train_row(model, batch, valid: int, padded: int, rounds: int, label: str) -> None:
    cfg = grpo.GRPOConfig(micro_batch_groups=batch.prompt_ids.shape[0])
    original = grpo.completion_logprobs

    def step(forward: str):
        grpo.completion_logprobs = functools.partial(original, forward=forward)
        try:
            grpo.accumulate(model, batch, cfg)
        finally:
            grpo.completion_logprobs = original
    seconds = {"padded": float("inf"), "packed": float("inf")}
    for _ in range(rounds):
        for forward in seconds:
            t0 = time.perf_counter()
            step(forward)
            seconds[forward] = min(seconds[forward], time.perf_counter() - t0)
    peaks = {forward: allocator_peak(functools.partial(step, forward)) for forward in seconds}
    share = valid / padded
    time_ratio = seconds["packed"] / seconds["padded"]
    mem_ratio = peaks["packed"] / peaks["padded"]
    print(f"| {label} | {valid:,} / {padded:,} = {share:.2f} | {seconds['padded']:.3f} | "
          f"{seconds['packed']:.3f} | {time_ratio:.2f} ({time_ratio / share:.2f}x the share) | "
          f"{peaks['padded'] / 1e6:,.0f} | {peaks['packed'] / 1e6:,.0f} | {mem_ratio:.2f} "
          f"({mem_ratio / share:.2f}x) |", flush=True)


def launch_rows(model, Bp: int, G: int, P: int, T: int, rounds: int) -> None:
    """One packed step's launches and seconds: uniform lengths, then a mean of 1/3 by count and by
    token budget (module docstring), each against the uniform step."""
    from bench_rollout import OpCount
    uniform = grpo.GRPOBatch.from_lists(
        *[[ids(n, model.config.vocab_size, random.Random(i)) for i in range(k)]
          for n, k in ((P, Bp), (T, Bp * G))],
        advantages=torch.randn(Bp * G, generator=torch.Generator().manual_seed(0)))
    ragged, valid, padded = training_batch(model, Bp, G, P, T, 1 / 3)
    quarter = max(1, Bp // 4)
    cases = [("uniform, 1 micro-batch", uniform, grpo.GRPOConfig(micro_batch_groups=Bp)),
             (f"mean 1/3, {quarter} groups a micro-batch", ragged,
              grpo.GRPOConfig(micro_batch_groups=quarter)),
             (f"mean 1/3, up to {quarter} groups' tokens at full length", ragged,
              grpo.GRPOConfig(micro_batch_tokens=quarter * (P + G * T))),
             (f"mean 1/3, up to the uniform step's tokens", ragged,
              grpo.GRPOConfig(micro_batch_tokens=Bp * (P + G * T)))]
    print(f"\n| packed step, {valid / padded:.2f} of the padded tokens at a mean of 1/3 | "
          f"micro-batches | launches | / uniform | s | / uniform |\n|---|---|---|---|---|---|")
    base = None
    for label, batch, cfg in cases:
        with OpCount() as count:
            grpo.accumulate(model, batch, cfg)
        model.zero_grad(set_to_none=True)
        seconds = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            grpo.accumulate(model, batch, cfg)
            seconds = min(seconds, time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        launches = sum(count.ops.values())
        base = base or (launches, seconds)
        print(f"| {label} | {len(grpo.micro_batches(batch, cfg))} | {launches:,} | "
              f"{launches / base[0]:.2f} | {seconds:.3f} | {seconds / base[1]:.2f} |", flush=True)


def padded_chunks(lens: list[int], prefill_tokens: int) -> list[tuple[int, int]]:
    """The padded rule: chunks of prefill_tokens // longest prompts, each at the longest."""
    step = max(1, prefill_tokens // max(lens))
    return [(first, min(first + step, len(lens))) for first in range(0, len(lens), step)]


def rollout_row(model, Bp: int, G: int, P: int, new: int, ratio: float, rounds: int,
                label: str) -> None:
    rng = random.Random(1)
    prompts = [ids(n, model.config.vocab_size, rng) for n in lengths(Bp, P, ratio, rng)]
    cfg = rollout.RolloutConfig(num_samples=G, max_new_tokens=new, temperature=0.0)
    originals = rollout.prefill_chunks, decode.length_buckets
    padded_rules = (lambda lens, n: padded_chunks(sorted(lens, reverse=True), n),
                    lambda lens: [(0, len(lens), max(lens))])
    seconds, outs = {}, {}
    for _ in range(rounds):
        for name, rules in (("padded", padded_rules), ("ragged", originals)):
            rollout.prefill_chunks, decode.length_buckets = rules
            try:
                t0 = time.perf_counter()
                outs[name] = rollout.generate(model, prompts, cfg)
                seconds[name] = min(seconds.get(name, float("inf")), time.perf_counter() - t0)
            finally:
                rollout.prefill_chunks, decode.length_buckets = originals
    same = torch.equal(outs["padded"].tokens, outs["ragged"].tokens)
    valid = sum(map(len, prompts))
    print(f"| {label} | {valid:,} / {Bp * P:,} = {valid / (Bp * P):.2f} | "
          f"{seconds['padded']:.3f} | {seconds['ragged']:.3f} | "
          f"{seconds['ragged'] / seconds['padded']:.2f} | {'yes' if same else 'NO'} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--P", type=int, default=64)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--new", type=int, default=32, help="rollout: new tokens per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", default="train,rollout,launches")
    parser.add_argument("--task_batch", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = hf.load_model(args.model) if args.model else tiny_model()
    name = os.path.basename(args.model.rstrip("/")) if args.model else "tiny"
    print(f"{name}: {args.prompts} prompts x G {args.G}, longest prompt {args.P}, longest "
          f"completion {args.T}, float32, {args.threads} thread(s); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if "train" in args.parts:
        print("\n| training step, mean / longest | valid / padded tokens | padded s | packed s | "
              "packed / padded | padded peak MB | packed peak MB | packed / padded |")
        print("|---|---|---|---|---|---|---|---|")
        for ratio in (0.5, 1 / 3):
            batch, valid, padded = training_batch(model, args.prompts, args.G, args.P, args.T,
                                                  ratio)
            train_row(model, batch, valid, padded, args.rounds, f"1/{round(1 / ratio)}")
        if args.task_batch and not args.model:
            from engine import tokenizer as tk
            tok = tk.PromptTokenizer(tk.build_char_tokenizer("abcdefgh="))
            small = M.Llama(M.ModelConfig(vocab_size=tok.num_ids, hidden_size=64,
                                          intermediate_size=176, num_hidden_layers=2,
                                          num_attention_heads=4,
                                          num_key_value_heads=2)).init_weights(0)
            batch, valid, padded = task_batch(small, tok, args.prompts, args.G)
            train_row(small, batch, valid, padded, args.rounds, "ragged_copy (default model)")
    if "launches" in args.parts:
        launch_rows(model, args.prompts, args.G, args.P, args.T, args.rounds)
    if "rollout" in args.parts:
        print(f"\n| rollout, mean / longest prompt | valid / padded prompt tokens | padded s | "
              f"ragged s | ragged / padded | same tokens |\n|---|---|---|---|---|---|")
        for ratio in (0.5, 1 / 3):
            rollout_row(model, args.prompts, args.G, args.P, args.new, ratio, args.rounds,
                        f"1/{round(1 / ratio)}")


if __name__ == "__main__":
    main()
