"""bf16 mixed precision, two ways, against float32: time and memory of one training step.

    python tests/bench_bf16.py                 # CPU
    python tests/bench_bf16.py --device cuda
    python tests/bench_bf16.py --plans         # --plan in bf16 of three published shapes, TP 1 and 2
    python tests/bench_bf16.py --matmuls       # a CPU's bf16 matmuls against float32, 1 thread
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python tests/bench_bf16.py --matmuls  # AVX2's

One step = forward and backward of a next-token loss over a batch, then AdamW (fp32 state):
- fp32:     float32 weights, no autocast (the baseline);
- autocast: float32 master weights, forward and backward under torch.autocast(bf16) (what
            train.py does): gradients land in float32 on the master;
- copy:     a bf16 working copy runs forward and backward; its bf16 gradients are cast into the
            fp32 master's .grad, AdamW steps the master, the copy is refreshed from it.
Resident: the bytes of weights, master and AdamW state after the step (train.py's autocast run
adds a bf16 sampler copy of the same size as copy's working weights). Step peak: the
allocator's highest live bytes above the level before the step (tests/memtrace.py; CUDA:
max_memory_allocated). Time: interleaved rounds after a warm-up, each variant's best.

--plans writes config.json files shaped like Qwen2.5-0.5B, Qwen2.5-1.5B and Llama-3.2-1B (shapes
only: --plan reads no weight) and tabulates `train.py --plan --dtype bfloat16` at TP 1 and 2.

--matmuls times, in bf16 and in float32, the three products of SmolLM2-135M's MLP linear (576 ->
1536) over 512 tokens (the forward, and the backward's input and weight gradients), and
precision.bf16_cost (the line a run prints where it finds no native bf16): a CPU without AVX512_BF16
or AMX takes torch's fallback kernels, emulated on one that has them by holding oneDNN and ATen to
AVX2 (the second command).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.hf import config_to_hf  # noqa: E402
from memtrace import allocator_peak  # noqa: E402
from model import Llama, ModelConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = dict(vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=True, architecture="Qwen2ForCausalLM", attention_bias=True)
SHAPES = {  # the published config.json files' shapes
    "Qwen2.5-0.5B": ModelConfig(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, **QWEN),
    "Qwen2.5-1.5B": ModelConfig(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, **QWEN),
    "Llama-3.2-1B": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
PLAN_FLAGS = ["--dtype", "bfloat16", "--prompts_per_step", "8", "--num_samples", "8",
              "--max_prompt_len", "256", "--max_new_tokens", "512", "--micro_batch_groups", "1",
              "--activation_checkpoint", "true"]


def plans() -> None:
    """One row per shape and TP size: the plan's MB per tag (its largest phase) and its peak."""
    print(f"train.py --plan {' '.join(PLAN_FLAGS)} --tp T (WORLD_SIZE=T)\n")
    print("| shape | tp | trainer (fp32 master) MB | sampler (bf16) MB | grads MB | AdamW MB | "
          "peak GB |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in SHAPES.items():
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config_to_hf(cfg, torch.bfloat16), f)
            for tp in (1, 2):
                out = subprocess.run(
                    [sys.executable, "train.py", "--plan", "--model", tmp, *PLAN_FLAGS, "--tp",
                     str(tp)], cwd=ROOT, capture_output=True, text=True, check=True,
                    env={**os.environ, "WORLD_SIZE": str(tp)}).stdout
                rows = [line.split() for line in out.splitlines()]
                header = next(r for r in rows if r[:1] == ["phase"])
                mb = {tag: max(float(r[header.index(tag)].replace(",", "")) for r in rows
                               if len(r) == len(header) and r[0] != "phase")
                      for tag in ("trainer", "sampler", "grads", "optimizer")}
                peak = next(r for r in rows if r[:1] == ["peak"])[1]
                print(f"| {name} | {tp} | {mb['trainer']:,.0f} | {mb['weights']:,.0f} | "
                      f"{mb['grads']:,.0f} | {mb['optimizer']:,.0f} | {peak} |")


def matmuls(rounds: int) -> None:
    """bf16 against float32 on this CPU, one thread (train.py's default --threads 1)."""
    from engine import precision
    torch.set_num_threads(1)
    N, C, I = 512, 576, 1536
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        x, w, g = (torch.randn(*shape, generator=gen).to(dtype) for shape in
                   ((N, C), (I, C), (N, I)))
        products = {"forward x @ w.T (512x576 @ 576x1536)": lambda: x @ w.t(),
                    "input grad g @ w (512x1536 @ 1536x576)": lambda: g @ w,
                    "weight grad g.T @ x (1536x512 @ 512x576)": lambda: g.t() @ x}
        for name, fn in products.items():
            fn()
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            rows.setdefault(name, {})[dtype] = best
    bf16, fp32 = precision.bf16_cost(C, I)
    rows["precision.bf16_cost: autocast linear fwd+bwd, 64 tokens"] = {torch.bfloat16: bf16,
                                                                    torch.float32: fp32}
    print(f"ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, precision.native_bf16() "
          f"{precision.native_bf16()}; 1 thread, best of {rounds}\n")
    print("| product | float32 ms | bf16 ms | bf16 / float32 |\n|---|---|---|---|")
    for name, t in rows.items():
        a, b = t[torch.float32] * 1e3, t[torch.bfloat16] * 1e3
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.1f}x |")


class Variant:
    def __init__(self, kind: str, cfg: ModelConfig, device: str):
        self.kind = kind
        self.model = Llama(cfg).init_weights(0).to(device)
        self.master = list(self.model.parameters())
        if kind == "copy":  # the module becomes the bf16 copy; the master is fp32 beside it
            self.master = [p.detach().clone().requires_grad_(True) for p in self.model.parameters()]
            self.model.to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.master, lr=1e-6)

    def step(self, tokens: torch.Tensor) -> None:
        autocast = torch.autocast(tokens.device.type, dtype=torch.bfloat16,
                                  enabled=self.kind == "autocast")
        with autocast:
            logits = self.model(tokens[:, :-1])  # (B, T-1, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if self.kind == "copy":
            for master, p in zip(self.master, self.model.parameters()):
                master.grad = p.grad.float()
                p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # as train.py: no gradient outlives the step
        if self.kind == "copy":
            with torch.no_grad():
                for master, p in zip(self.master, self.model.parameters()):
                    p.copy_(master)

    def resident(self) -> int:
        tensors = list(self.model.parameters())
        if self.kind == "copy":
            tensors += self.master
        tensors += [t for s in self.opt.state.values() for t in s.values() if t.dim()]
        return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plans", action="store_true", help="the --plan table instead")
    ap.add_argument("--matmuls", action="store_true", help="a CPU's bf16 matmuls instead")
    args = ap.parse_args()
    if args.plans:
        return plans()
    if args.matmuls:
        return matmuls(args.rounds)
    torch.set_num_threads(2)
    cfg = ModelConfig(vocab_size=8000, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    tokens = torch.randint(0, cfg.vocab_size, (8, 257), device=args.device)
    variants = {k: Variant(k, cfg, args.device) for k in ("fp32", "autocast", "copy")}
    peaks = {}
    for name, v in variants.items():
        v.step(tokens)  # warm-up: AdamW state allocated, kernels chosen
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            v.step(tokens)
            peaks[name] = torch.cuda.max_memory_allocated() - before
        else:
            peaks[name] = allocator_peak(lambda: v.step(tokens))
    best = {name: float("inf") for name in variants}
    for _ in range(args.rounds):
        for name, v in variants.items():
            t0 = time.perf_counter()
            v.step(tokens)
            if args.device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"device {args.device}, {torch.get_num_threads()} threads, dim 256 x 4 layers, vocab "
          f"8000, batch 8 x 256 tokens; best of {args.rounds} interleaved rounds")
    print(f"{'variant':<10}{'s/step':>9}{'x fp32':>8}{'resident MB':>13}{'step peak MB':>14}")
    for name, v in variants.items():
        print(f"{name:<10}{best[name]:>9.3f}{best[name] / best['fp32']:>8.2f}"
              f"{v.resident() / 2**20:>13.1f}{peaks[name] / 2**20:>14.1f}")


if __name__ == "__main__":
    main()
