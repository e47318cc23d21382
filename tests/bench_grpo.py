"""Peak memory and time of one GRPO forward+backward: naive vs shared prompt vs chunked logprobs vs both.

    python tests/bench_grpo.py                 # CPU, fp32
    python tests/bench_grpo.py --device cuda   # GPU, bf16
    python tests/bench_grpo.py --part chunk    # logprob chunk sizes at V = 16, 49,152, 151,936
    python tests/bench_grpo.py --part cast     # bf16 autocast: lm_head cast once vs per chunk

Setup: dim 256, 4 layers, 8/4 heads, ffn 704, vocab 32000; 4 prompts x P=512 tokens, G=8
completions x C=64 tokens; the loss is grpo_loss (dapo, mu = 1) and one backward. Then logprobs
alone: 16,384 hidden states through final norm + lm_head + softmax, full vs chunked.

Memory: each variant runs once in a fresh subprocess, so its peak is its own.
- CPU: the child runs with MALLOC_MMAP_THRESHOLD_=65536, so glibc serves every tensor-sized block
  with mmap and unmaps it on free: the resident set follows the live tensors (no heap high-water
  left over from an earlier phase). After building the model and inputs, the child resets the
  kernel's peak-RSS counter (writes 5 to /proc/self/clear_refs), runs the step, and reports
  VmHWM - RSS before the step: the extra memory the step needed, parameter grads included.
- CUDA: torch.cuda.max_memory_allocated() - memory_allocated() before, after reset_peak_memory_stats.
Time: one more subprocess, with glibc's default allocator (fresh mmaps would add page faults),
runs all variants of a table in interleaved rounds after one warm-up round and keeps each
variant's best: on a shared, noisy machine the load drifts over minutes, and interleaving makes
the drift hit every variant alike.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
from engine import logprobs  # noqa: E402
import model as M  # noqa: E402

STEP_VARIANTS = {  # name: (shared_prompt, chunked); "seed" is TRL before PR #2669, written out below
    "seed": None, "naive": (False, False), "shared": (True, False), "chunked": (False, True), "both": (True, True),
}
LOGPROB_VARIANTS = ["full_grad", "chunked_grad", "chunked_ckpt_grad", "full_nograd", "chunked_nograd"]


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def seed_logprobs(model: M.Llama, prompts, completions, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's GRPO before PR #2669: every prompt repeated G times, logits for all N*(P+C) positions."""
    P = len(prompts[0])
    ids = torch.tensor([prompts[i // G] + c for i, c in enumerate(completions)], device=model.inv_freq.device)
    logits = model(ids)[:, P - 1:-1]  # (N, C, V), sliced out of (N, P+C, V)
    logp = logits.float().log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)  # (N, C)
    return logp, torch.ones_like(logp, dtype=torch.bool)


def make_step(device: str, chunk_size: int):
    """Build the model and inputs once; return step(variant) -> checksum of the logprobs."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = M.ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    model = M.Llama(cfg).init_weights(0).to(device=device, dtype=dtype)
    model.inv_freq = model.inv_freq.float()  # rope tables stay float32, as from_pretrained keeps them
    Bp, P, G, C = 4, 512, 8, 64
    prompts = torch.randint(0, 32000, (Bp, P)).tolist()
    completions = torch.randint(0, 32000, (Bp * G, C)).tolist()
    adv = torch.randn(Bp * G, device=device)
    h = torch.randn(16384, 256, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 32000, (16384,), device=device)
    loss_cfg = grpo.GRPOConfig()
    batch = grpo.GRPOBatch.from_lists(prompts, completions, max_new_tokens=C, device=device)

    def step(variant: str) -> float:
        model.zero_grad(set_to_none=True)
        h.grad = None
        if variant == "seed":
            logp, mask = seed_logprobs(model, prompts, completions, G)
        elif variant in STEP_VARIANTS:
            shared, chunked = STEP_VARIANTS[variant]
            logp, _ = grpo.completion_logprobs(model, batch, chunk_size=chunk_size if chunked else 0,
                                               forward="packed" if shared else "naive")
            mask = batch.mask
        if variant in STEP_VARIANTS:
            loss, _ = grpo.grpo_loss(logp, None, None, adv, mask, loss_cfg, num_seqs=Bp * G, num_tokens=Bp * G * C,
                                     max_completion_len=C)
            loss.backward()
            return logp.detach().double().sum().item()
        fn = logprobs.logprobs_from_logits if variant.startswith("chunked_ckpt") else None  # tp.py's route
        with torch.set_grad_enabled(variant.endswith("_grad")):
            logp, _ = logprobs.chunked_logprobs(model, h, targets, logprob_fn=fn,
                                            chunk_size=chunk_size if variant.startswith("chunked") else 0)
            if logp.requires_grad:
                logp.sum().backward()
        return logp.detach().double().sum().item()

    def timed(variant: str) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(variant)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return step, timed


def child_memory(variant: str, device: str, chunk_size: int) -> dict:
    step, _ = make_step(device, chunk_size)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        checksum = step(variant)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = rss_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
        checksum = step(variant)
        peak = (rss_kib("VmHWM") - base) * 1024
    return {"peak_mib": peak / 2**20, "checksum": checksum}


def child_time(variants: list[str], device: str, chunk_size: int, rounds: int) -> dict:
    _, timed = make_step(device, chunk_size)
    for v in variants:  # warm-up: first-touch page faults, oneDNN/cuBLAS setup
        timed(v)
    best = {v: float("inf") for v in variants}
    for _ in range(rounds):
        for v in variants:
            best[v] = min(best[v], timed(v))
    return best


def spawn(args, *child_args: str) -> dict:
    # The mmap threshold only for memory runs: a fresh mmap per tensor costs page faults that would swamp the timings.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if child_args[0] == "--memory" else None
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--chunk", str(args.chunk),
           "--rounds", str(args.rounds), *child_args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(title: str, args, variants: list[str], baseline: str) -> dict:
    memory = {v: spawn(args, "--memory", v) for v in variants}
    seconds = spawn(args, "--time", ",".join(variants))
    base_mem, base_s = memory[baseline]["peak_mib"], seconds[baseline]
    print(f"\n{title}\n{'variant':<18}{'peak MiB':>10}{'mem / base':>12}{'seconds':>10}{'time / base':>13}")
    for v in variants:
        print(f"{v:<18}{memory[v]['peak_mib']:>10.0f}{memory[v]['peak_mib'] / base_mem:>12.3f}"
              f"{seconds[v]:>10.3f}{seconds[v] / base_s:>13.3f}")
    return memory


class Head(torch.nn.Module):
    """A final norm and lm_head alone: what chunked_logprobs runs per chunk."""

    def __init__(self, C: int, V: int):
        super().__init__()
        self.norm, self.lm_head = M.RMSNorm(C, 1e-5), torch.nn.Linear(C, V, bias=False)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def chunk_sweep(n: int, rounds: int, vocabs: list[int], mibs: list[int]) -> None:
    """Chunked logprobs fwd+bwd of n tokens of width 576 (SmolLM2's) at V = 16, 49,152, 151,936:
    chunks of a fixed 1,024 tokens (the base) next to chunks of 16..256 MiB of float32 logits
    (GRPOConfig.chunk_bytes). Peak: allocator bytes above the start (tests/memtrace.py), the
    lm_head grad (V x 576 floats) included; time: the best of `rounds` after a warm-up."""
    from memtrace import allocator_peak
    print(f"\nlogprob chunks: {n} tokens, C = 576, float32, fwd+bwd; base = 1,024 tokens a chunk")
    print(f"{'V':>8} {'chunk':>12}{'rows':>7}{'peak MiB':>10}{'mem/base':>10}{'s':>8}{'time/base':>11}")
    for V in vocabs:
        head = Head(576, V)
        h = torch.randn(n, 576, requires_grad=True)
        targets = torch.randint(0, V, (n,))

        def run(rows: int) -> None:
            logp, entropy = logprobs.chunked_logprobs(head, h, targets, chunk_size=rows)
            (logp.sum() + entropy.sum()).backward()
            h.grad = head.lm_head.weight.grad = head.norm.weight.grad = None

        base = None
        for name, mib in [("1,024 tokens", None), *[(f"{m} MiB", m) for m in mibs]]:
            rows = 1024 if mib is None else logprobs.chunk_rows(mib * 2**20, V, torch.float32)
            peak = allocator_peak(lambda: run(rows)) / 2**20  # also the warm-up
            best, spent, done = float("inf"), 0.0, 0
            while done < rounds or spent < 1.0:  # milliseconds at V = 16: repeat for a second
                t0 = time.perf_counter()
                run(rows)
                seconds = time.perf_counter() - t0
                best, spent, done = min(best, seconds), spent + seconds, done + 1
            base = base or (peak, best)
            print(f"{V:>8} {name:>12}{min(rows, n):>7}{peak:>10.0f}{peak / base[0]:>10.2f}"
                  f"{best:>8.2f}{best / base[1]:>11.2f}", flush=True)


def cast_sweep(n: int, rounds: int, vocabs: list[int], mibs: list[int], device: str) -> None:
    """Chunked logprobs fwd+bwd of n tokens of width 576 under bf16 autocast over float32
    weights (train.py's --dtype bfloat16): lm_head's weight cast once per call
    (logprobs.head_copy, the engine) against autocast's own casts (the weight again in every
    chunk's forward and rebuild, every chunk's gradient cast back). Both in interleaved rounds,
    the best of each; their gradients agree bit for bit (tests/test_grpo.py)."""
    print(f"\nlm_head cast once vs per chunk: {n} tokens, C = 576, bf16 autocast, fwd+bwd, {device}")
    print(f"{'V':>8} {'chunk':>8}{'rows':>7}{'once s':>9}{'per chunk s':>13}{'once/per':>10}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    own = logprobs.head_copy
    for V in vocabs:
        head = Head(576, V).to(device)
        h = torch.randn(n, 576, device=device, requires_grad=True)
        targets = torch.randint(0, V, (n,), device=device)
        for mib in mibs:
            rows = logprobs.chunk_rows(mib * 2**20, V, torch.float32)

            def run(once: bool) -> float:
                logprobs.head_copy = own if once else (lambda model, device_type: None)
                sync()
                t0 = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16):
                    logp, entropy = logprobs.chunked_logprobs(head, h, targets, chunk_size=rows)
                    (logp.sum() + entropy.sum()).backward()
                sync()
                h.grad = head.lm_head.weight.grad = head.norm.weight.grad = None
                return time.perf_counter() - t0
            run(True), run(False)  # warm-up
            best = {True: float("inf"), False: float("inf")}
            for _ in range(rounds):
                for once in (True, False):
                    best[once] = min(best[once], run(once))
            logprobs.head_copy = own
            print(f"{V:>8} {mib:>5} MiB{min(rows, n):>7}{best[True]:>9.3f}{best[False]:>13.3f}"
                  f"{best[True] / best[False]:>10.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per logprob chunk")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up round")
    parser.add_argument("--part", default="all", choices=["all", "step", "logprobs", "chunk", "cast"])
    parser.add_argument("--tokens", type=int, default=1536, help="--part chunk/cast: tokens scored")
    parser.add_argument("--vocabs", default="16,49152,151936", help="--part chunk/cast: vocabularies")
    parser.add_argument("--chunk_mib", default="16,64,256", help="--part chunk/cast: chunk sizes, MiB")
    parser.add_argument("--memory", default=None, help=argparse.SUPPRESS)  # child: one variant's peak
    parser.add_argument("--time", default=None, help=argparse.SUPPRESS)  # child: comma-separated variants
    args = parser.parse_args()
    if args.memory:
        print(json.dumps(child_memory(args.memory, args.device, args.chunk)))
        return
    if args.time:
        print(json.dumps(child_time(args.time.split(","), args.device, args.chunk, args.rounds)))
        return
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, chunk {args.chunk}")
    if args.part == "cast":
        return cast_sweep(args.tokens, args.rounds, [int(v) for v in args.vocabs.split(",")],
                          [int(m) for m in args.chunk_mib.split(",")], args.device)
    if args.part == "chunk":
        return chunk_sweep(args.tokens, args.rounds, [int(v) for v in args.vocabs.split(",")],
                           [int(m) for m in args.chunk_mib.split(",")])
    if args.part in ("all", "step"):
        steps = list(STEP_VARIANTS)
        memory = table("One GRPO fwd+bwd, 4 prompts x 512 + 8 x 64 completions, V=32000\n"
                       "base = seed: prompt repeated G times, logits at all positions; naive: logits at "
                       "completion positions only", args, steps, "seed")
        sums = [memory[v]["checksum"] for v in steps]  # every variant must compute the same logprobs
        assert max(sums) - min(sums) < 1e-4 * abs(sums[0]) + 1e-2, f"variants disagree: {sums}"
    if args.part in ("all", "logprobs"):
        table("Logprobs alone, 16384 tokens, V=32000, fwd+bwd; base = full log_softmax + gather;\n"
              "chunked_ckpt = checkpoint around a logprob_fn (tp.py's route)", args, LOGPROB_VARIANTS[:3], "full_grad")
        table("Logprobs alone, no grad (old/ref logprobs)", args, LOGPROB_VARIANTS[3:], "full_nograd")


if __name__ == "__main__":  # a script, not a library file
    main()
