"""LoRA against full fine-tuning: time and memory of one training step, and the sampler's decode.

    python tests/bench_lora.py                   # CPU, a 8-layer model of width 576 (SmolLM2's)
    python tests/bench_lora.py --layers 30 --vocab 49152   # SmolLM2-135M's whole shape
    python tests/bench_lora.py --device cuda
    python tests/bench_lora.py --plans          # --plan of the 0.5B and 8B shapes, full vs LoRA
    python tests/bench_lora.py --decode         # the sampler's decode tables alone
    python tests/bench_lora.py --gap DIR        # a bf16 checkpoint's sampler-forward gap, merged
                                                # into the prepacked copy vs the update beside

1. Train: one step = forward and backward of a next-token loss over a batch, then AdamW, for
   - full:      every weight trains (float32; under --dtype bfloat16 the fp32 master under bf16
                autocast, as train.py);
   - lora q,v:  the base frozen (bf16 stays bf16), float32 adapters on q_proj and v_proj (TRL's
                and PEFT's default), r 16, alpha 32;
   - lora all:  the same on every linear but lm_head (all-linear).
   Resident: what the run keeps between steps: weights, AdamW state, and for full under bf16 the
   sampler's bf16 copy (LoRA samples the trainer itself). Step peak: the allocator's highest live
   bytes above the level before the step (tests/memtrace.py; CUDA: max_memory_allocated), which
   holds the gradients. Time: interleaved rounds after a warm-up, each variant's best.
2. Decode (on a CPU, float32 and, where the CPU has it natively, bf16): rollout.generate on the
   all-linear adapted model, the adapter merged into the prepacked copy rollout.py makes of each
   weight (its route) against the update applied beside the prepacked base and beside F.linear
   on the weights as they are (--prepacked_linears false), and the base model as the floor.
3. --plans: `train.py --plan --dtype bfloat16` (a GPU's view: shapes only, no weight read) for
   config.json files shaped like Qwen2.5-0.5B and Llama-3.1-8B, full fine-tuning against LoRA
   (q_proj,v_proj and all-linear), per tag at its largest phase.
"""

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lora  # noqa: E402
from bench_bf16 import SHAPES  # noqa: E402
from engine.hf import config_to_hf  # noqa: E402
import rollout  # noqa: E402
from memtrace import allocator_peak  # noqa: E402
from model import Llama, ModelConfig  # noqa: E402


class Variant:
    def __init__(self, kind: str, cfg: ModelConfig, dtype: str, device: str, build=None):
        """`build(cfg)`: the float32 model (default: init_weights on the CPU; the GPU check draws
        a published shape's weights on the GPU instead, bench_limits.build)."""
        self.kind, self.dtype = kind, dtype
        model = build(cfg) if build else Llama(cfg).init_weights(0)
        self.bf16 = dtype == "bfloat16"
        self.sampler_bytes = 0
        if kind == "full":
            if self.bf16:  # train.py's sampler: a bf16 copy of the fp32 master
                self.sampler_bytes = sum(p.numel() * 2 for p in model.parameters())
        else:
            model.to(getattr(torch, dtype))  # a frozen base stays in the compute dtype
            targets = "" if kind == "lora q,v" else "all-linear"
            lora.add_adapters(model, lora.LoRAConfig(use_peft=True, lora_target_modules=targets,
                                                     lora_dropout=0.0))
        self.model = model.to(device)
        self.opt = torch.optim.AdamW(lora.trainable(self.model), lr=1e-6, fused=True)

    def step(self, tokens: torch.Tensor) -> None:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(tokens[:, :-1])  # (B, T-1, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # as train.py: no gradient outlives the step

    def resident(self) -> int:
        tensors = list(self.model.parameters())
        tensors += [t for s in self.opt.state.values() for t in s.values() if t.dim()]
        return sum(t.numel() * t.element_size() for t in tensors) + self.sampler_bytes


def train_rows(cfg: ModelConfig, dtype: str, device: str, rounds: int, batch: int, length: int,
               build=None, kinds=("full", "lora q,v", "lora all")):
    """One training step (forward, backward, AdamW) of each variant on one batch: its trainable
    parameters, the best of `rounds` seconds, the bytes it keeps (resident) and the step's peak
    above them. Yields a row per variant, full fine-tuning's first, each measured alone."""
    tokens = torch.randint(0, cfg.vocab_size, (batch, length + 1), device=device)
    for kind in kinds:
        v = Variant(kind, cfg, dtype, device, build)
        v.step(tokens)  # warm-up: AdamW state allocated, kernels chosen
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            v.step(tokens)
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = allocator_peak(lambda: v.step(tokens))
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            v.step(tokens)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        yield dict(variant=kind, trainable_m=sum(p.numel() for p in lora.trainable(v.model)) / 1e6,
                   seconds=best, resident_mb=v.resident() / 2**20, peak_mb=peak / 2**20)
        del v
        if device == "cuda":
            torch.cuda.empty_cache()


def train(cfg: ModelConfig, dtype: str, device: str, rounds: int, batch: int, length: int):
    rows = list(train_rows(cfg, dtype, device, rounds, batch, length))
    full = rows[0]
    print(f"\ntrain, --dtype {dtype}: batch {batch} x {length} tokens; best of {rounds} rounds")
    print(f"{'variant':<10}{'trainable M':>12}{'s/step':>9}{'x full':>8}{'resident MB':>13}"
          f"{'x full':>8}{'step peak MB':>14}{'x full':>8}")
    for r in rows:
        print(f"{r['variant']:<10}{r['trainable_m']:>12.2f}{r['seconds']:>9.3f}"
              f"{r['seconds'] / full['seconds']:>8.2f}{r['resident_mb']:>13.1f}"
              f"{r['resident_mb'] / full['resident_mb']:>8.2f}{r['peak_mb']:>14.1f}"
              f"{r['peak_mb'] / full['peak_mb']:>8.2f}")


PREPACKED = rollout._prepacked_linears  # rollout.py's route: an adapter merged into the copy


@contextlib.contextmanager
def beside_prepacked(model: torch.nn.Module, rows: int, enabled: bool):
    """The other route: each base weight prepacked as it is, the update applied beside it."""
    with PREPACKED(model, rows, enabled):
        for _, m in lora.adapted(model):
            packed = functools.partial(torch.ops.mkldnn._linear_pointwise, B=m.bias, attr="none",
                                       W=rollout._PREPACK(m.weight.detach(), rows), scalars=[],
                                       algorithm="")
            m.forward = lambda x, m=m, packed=packed: packed(x) + m.update(x)
        yield


def unpacked(model: torch.nn.Module, rows: int, enabled: bool):
    """F.linear on every weight as it is (--prepacked_linears false), the update beside it."""
    return PREPACKED(model, rows, False)


def decode(cfg: ModelConfig, rounds: int, prompts: int, new: int,
           dtype: torch.dtype = torch.float32) -> None:
    if rollout._PREPACK is None or not rollout.prepacks(dtype):
        print(f"\ndecode, {dtype}: not prepacked here (no oneDNN, or bf16 without native bf16)")
        return
    base = Llama(cfg).init_weights(0).eval().to(dtype)
    model = Llama(cfg).init_weights(0).eval().to(dtype)
    lora.add_adapters(model, lora.LoRAConfig(use_peft=True, lora_target_modules="all-linear",
                                             lora_dropout=0.0))
    with torch.no_grad():
        for _, m in lora.adapted(model):
            m.lora_B.normal_(0, 0.02)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, cfg.vocab_size, (48,), generator=gen).tolist()
             for _ in range(prompts)]
    rc = rollout.RolloutConfig(num_samples=8, max_new_tokens=new)
    routes = {"merged": (model, PREPACKED), "beside": (model, beside_prepacked),
              "unpacked": (model, unpacked), "base alone": (base, PREPACKED),
              "base unpacked": (base, unpacked)}
    best = {name: float("inf") for name in routes}
    for _ in range(rounds + 1):  # the first round warms up
        for name, (m, route) in routes.items():
            rollout._prepacked_linears = route
            t0 = time.perf_counter()
            rollout.generate(m, batch, rc, seed=0)
            best[name] = min(best[name], time.perf_counter() - t0)
    rollout._prepacked_linears = PREPACKED
    print(f"\ndecode, {dtype} CPU: {prompts} prompts x 8 samples x {new} new tokens, all-linear "
          f"r 16; best of {rounds}")
    print(f"{'route':<14}{'s/generate':>12}{'x merged':>10}")
    for name in routes:
        print(f"{name:<14}{best[name]:>12.3f}{best[name] / best['merged']:>10.2f}")


def gap(model_dir: str, stds=(0.0, 0.004, 0.02)) -> None:
    """--gap DIR: a bf16 checkpoint with all-linear adapters (B drawn with each std), 4 random
    prompts x 4 samples x 24 tokens: |the sampler's logprob - a full bf16 forward's| over the
    sampled tokens, the adapter merged into the prepacked copy against the update beside the base."""
    from engine.hf import load_model
    print(f"\nthe sampler's logprobs against the forward's, bf16 {model_dir}: mean / max")
    for std in stds:
        model = load_model(model_dir, dtype=torch.bfloat16).eval()
        lora.add_adapters(model, lora.LoRAConfig(use_peft=True, lora_target_modules="all-linear",
                                                 lora_dropout=0.0), seed=0)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, m in lora.adapted(model):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * std)
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
                   for n in (60, 50, 55, 40)]
        cells = []
        for prepacked in (True, False):
            rc = rollout.RolloutConfig(num_samples=4, max_new_tokens=24,
                                       prepacked_linears=prepacked)
            out = rollout.generate(model, prompts, rc, seed=1)
            diffs = []
            with torch.no_grad():
                for row, completion in enumerate(out.completions()):
                    prompt = prompts[row // 4]
                    logits = model(torch.tensor([prompt + completion]))[0].float()  # (T, V)
                    want = logits[len(prompt) - 1:-1].log_softmax(-1)
                    want = want.gather(-1, torch.tensor(completion)[:, None])[:, 0]
                    diffs.append((torch.tensor(out.logprob_lists()[row]) - want).abs())
            d = torch.cat(diffs)
            cells.append(f"{'merged' if prepacked else 'beside'} {d.mean():.2e} / {d.max():.3f}")
        print(f"B std {std:<6}  " + "   ".join(cells))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_8B = ModelConfig(  # Llama-3.1-8B's published config.json
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
PLAN_FLAGS = ["--dtype", "bfloat16", "--prompts_per_step", "8", "--num_samples", "8",
              "--max_prompt_len", "256", "--max_new_tokens", "512", "--micro_batch_groups", "1",
              "--activation_checkpoint", "true"]
PLAN_VARIANTS = {"full": [], "lora q,v": ["--use_peft"],
                 "lora all": ["--use_peft", "--lora_target_modules", "all-linear"]}


def plans() -> None:
    """One row per shape and variant: the plan's MB per tag at its largest phase, and its peak."""
    print(f"train.py --plan {' '.join(PLAN_FLAGS)}\n")
    tags = ("trainer", "sampler", "grads", "optimizer", "transient")
    print("| shape | variant | " + " | ".join(f"{t} MB" for t in tags) + " | peak GB | x full |")
    print("|---" * (len(tags) + 4) + "|")
    shapes = {"Qwen2.5-0.5B": SHAPES["Qwen2.5-0.5B"], "Llama-3.1-8B": LLAMA_8B}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in shapes.items():
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config_to_hf(cfg, torch.bfloat16), f)
            full = None
            for variant, flags in PLAN_VARIANTS.items():
                out = subprocess.run(
                    [sys.executable, "train.py", "--plan", "--model", tmp, *PLAN_FLAGS, *flags],
                    cwd=ROOT, capture_output=True, text=True, check=True).stdout
                rows = [line.split() for line in out.splitlines()]
                header = next(r for r in rows if r[:1] == ["phase"])
                mb = {tag: max(float(r[header.index(tag)].replace(",", "")) for r in rows
                               if len(r) == len(header) and r[0] != "phase") for tag in tags}
                peak = float(next(r for r in rows if r[:1] == ["peak"])[1])
                full = full or peak
                print(f"| {name} | {variant} | " + " | ".join(f"{mb[t]:,.0f}" for t in tags)
                      + f" | {peak:.2f} | {peak / full:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plans", action="store_true", help="the --plan table instead")
    ap.add_argument("--decode", action="store_true", help="the decode tables alone")
    ap.add_argument("--gap", default="", help="a bf16 checkpoint: the merged sampler's logprob gap")
    args = ap.parse_args()
    if args.plans:
        return plans()
    if args.gap:
        return gap(args.gap)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3,
                      tie_word_embeddings=True)  # SmolLM2-135M's block
    print(f"device {args.device}, {torch.get_num_threads()} threads, SmolLM2-135M's block x "
          f"{args.layers} layers, vocab {args.vocab}")
    for dtype in ("float32", "bfloat16") if not args.decode else ():
        train(cfg, dtype, args.device, args.rounds, batch=8, length=128)
    if args.device == "cpu":
        for dtype in (torch.float32, torch.bfloat16):
            decode(cfg, args.rounds, prompts=4, new=24, dtype=dtype)


if __name__ == "__main__":
    main()
