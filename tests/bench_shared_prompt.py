"""The completions' attention over their group's shared prompt, forward + backward, three ways:

- repeated: attention.shared_prompt_attention_repeated, the prompt's K/V repeated for each of the G rows of
  its group and one fused SDPA call under an (N, 1, T, P + T) mask (the baseline, the slow twin);
- lse merge: attention.shared_prompt_attention, the G rows folded into the query length against the one
  prompt K/V, two plain softmaxes merged by log-sum-exp (autograd through matmuls);
- flash: attention.SharedPromptAttentionPadded, the same folding in two fused CPU flash kernels, merged by
  log-sum-exp, backward through the flash backward (what grpo.shared_prompt_hidden runs).
An expanded stride-0 view of the prompt is no fourth way: SDPA takes one key tensor, and
[prompt; own] keys in one tensor is a concatenation, a copy whatever the prompt's strides (and
SDPA returns no log-sum-exp to merge two calls with).

Shapes are tests/bench_trl.py's: 16 prompts x G = 8 completions of T = 31 fed tokens, 8 query /
4 kv heads of 32, P = 64 and 512, float32, 1 thread. Time: the best of interleaved rounds (the
load of a shared machine hits every variant alike). Peak: the allocator's live bytes above the
inputs during one forward + backward (tests/memtrace.py), q/k/v and prompt K/V gradients included.

Run: python tests/bench_shared_prompt.py [--P 64,512] [--rounds 5]
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import attention  # noqa: E402
import model as M  # noqa: E402
from memtrace import allocator_peak  # noqa: E402

Bp, G, H, Hkv, D, T = 16, 8, 8, 4, 32, 31


def variants(P: int) -> dict:
    """name -> attention(q, k, v, prompt_k, prompt_v) of full-length prompts."""
    valid = torch.ones(Bp, P, dtype=torch.bool)
    own = torch.ones(T, T, dtype=torch.bool).tril()
    prompt_bias = torch.zeros(Bp, 1, 1, P)
    own_bias = torch.zeros(T, T).masked_fill(~own, -math.inf).repeat(H // Hkv, 1)[None, None]
    return {
        "repeated": lambda q, k, v, pk, pv: attention.shared_prompt_attention_repeated(q, k, v, pk, pv, valid),
        "lse merge": lambda q, k, v, pk, pv: attention.shared_prompt_attention(q, k, v, own[None], pk, pv, valid),
        "flash": lambda q, k, v, pk, pv: attention.SharedPromptAttentionPadded.apply(q, k, v, pk, pv,
                                                                      prompt_bias, own_bias),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--P", default="64,512")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{Bp} prompts x G {G}, T {T}, heads {H}/{Hkv} x {D}, float32, 1 thread; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'P':>5} {'variant':>10} | {'ms fwd+bwd':>10} {'vs repeated':>11} | "
          f"{'peak MiB':>8} {'vs repeated':>11}")
    for P in map(int, args.P.split(",")):
        gen = torch.Generator().manual_seed(0)

        def leaf(*shape):
            return torch.randn(*shape, generator=gen).requires_grad_()
        inputs = (leaf(Bp * G, H, T, D), leaf(Bp * G, Hkv, T, D), leaf(Bp * G, Hkv, T, D),
                  leaf(Bp, Hkv, P, D), leaf(Bp, Hkv, P, D))
        weight = torch.randn(Bp * G, H, T, D, generator=gen)
        fns = variants(P)

        def step(name: str) -> None:
            for x in inputs:
                x.grad = None
            (fns[name](*inputs) * weight).sum().backward()
        best = dict.fromkeys(fns, math.inf)
        for _ in range(args.rounds + 1):  # the first round warms up
            for name in fns:
                start = time.perf_counter()
                step(name)
                best[name] = min(best[name], time.perf_counter() - start)
        peaks = {name: allocator_peak(lambda: step(name)) for name in fns}
        for name in fns:
            print(f"{P:>5} {name:>10} | {best[name] * 1e3:>10.1f} "
                  f"{best['repeated'] / best[name]:>10.2f}x | {peaks[name] / 2**20:>8.1f} "
                  f"{peaks['repeated'] / peaks[name]:>10.2f}x")
    print(f"load average at end {os.getloadavg()[0]:.1f}; 'vs repeated' > 1: faster / smaller")


if __name__ == "__main__":
    main()
