"""
Where bf16 is multiplied, and the trainer's dtypes under mixed precision.

- master_dtype, autocast: --dtype bfloat16 is mixed precision (FSDP's and Megatron's): the trainer's
  weights and AdamW state in float32, forward and backward under bf16 autocast, a bf16 sampler.
- bf16_kernels, cpu_precision: where bf16 matmuls run. A CPU without native bf16 (no AVX512_BF16
  or AMX) falls back to kernels 5-40x slower than float32 (docs/measurements.md): there (--cpu_bf16
  auto) --dtype bfloat16 keeps bf16's values and multiplies in float32: the trainer's fp32 master
  without autocast, the sampler a float32 copy holding the weights rounded to bf16 (the rounding
  is what a bf16 run's sampler sees: float32's own weights learn the README's SmolLM2 tasks far
  slower); LoRA's frozen base likewise holds bf16's values in float32 (run/models.py's
  multiplied); cpu_precision's line says so at start, with the cost it measured.

`cfg` is train.py's TrainConfig (dtype, sampler_dtype, cpu_bf16, dim), handed in.
Leaves out: fp16 loss scaling, fp8.
Tested by tests/test_train.py (bf16's master weights, the CPU's fallback); measured by
tests/bench_bf16.py.
"""

import contextlib
import functools
import time

import torch

from model import ModelConfig


def master_dtype(cfg) -> torch.dtype:
    """The trainer's weights and AdamW state: float32 under bf16 (an AdamW step of 1e-6 on a weight
    of 0.02 is below bf16's resolution: bf16 weights would round most updates away)."""
    return torch.float32 if cfg.dtype == "bfloat16" else getattr(torch, cfg.dtype)


def autocast(cfg, device: torch.device):
    """bf16 forward and backward from the fp32 master (FSDP's and Megatron's mixed precision).
    Autocast, not a bf16 working copy refreshed after each step: tests/bench_bf16.py measures both
    (docs/measurements.md); autocast keeps the gradients fp32 across micro-batches and ranks.
    Where bf16 has no kernels of its own (bf16_kernels), float32 matmuls: no autocast."""
    if cfg.dtype != "bfloat16" or not bf16_kernels(cfg, device):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@functools.cache  # autocast() asks at every micro-batch


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AVX512_BF16 or AMX, and oneDNN allowed to use
    bf16 (ONEDNN_MAX_CPU_ISA caps it: AVX2 runs an AVX-512 CPU as an AVX2 one)."""
    cpu = torch.cpu  # the flags' functions are private (torch >= 2.3): absent means unknown, no
    flags = [getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                               "_is_amx_tile_supported")]
    return (any(flags) and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_kernels(cfg, device: torch.device) -> bool:
    """Whether bf16 tensors are multiplied as bf16 on `device`: on a GPU (and the meta device of
    --plan), on a CPU with native bf16, or anywhere with --cpu_bf16 true."""
    return device.type != "cpu" or cfg.cpu_bf16 == "true" or native_bf16()


def bf16_cost(C: int, I: int, tokens: int = 64) -> tuple[float, float]:
    """Seconds of one linear's forward and backward (C -> I, the model's MLP, over `tokens` rows)
    under bf16 autocast, and in float32: the best of two each, after one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, C, generator=gen, requires_grad=True)  # both gradients, as a block's
    w = torch.randn(I, C, generator=gen, requires_grad=True)

    def seconds(dtype: torch.dtype) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                torch.nn.functional.linear(x, w).float().sum().backward()
            best = min(best, time.perf_counter() - t0)
        return best
    return seconds(torch.bfloat16), seconds(torch.float32)


def cpu_precision(cfg, device: torch.device, config: ModelConfig | None,
                  frozen: bool = False) -> str:
    """The line a run prints at start when it asks for bf16 (--dtype or --sampler_dtype) where
    bf16 has no kernels (bf16_kernels): what it does instead and the cost of one of the model's
    linears measured here (config: the checkpoint's, None: the fresh model's; frozen: LoRA's
    base, which samples itself); else ""."""
    if "bfloat16" not in (cfg.dtype, cfg.sampler_dtype) or bf16_kernels(cfg, device):
        return ""
    C = config.hidden_size if config else cfg.dim
    I = config.intermediate_size if config else cfg.dim * 11 // 4  # build_model's
    bf16, fp32 = bf16_cost(C, I)
    isa = torch.backends.cpu.get_cpu_capability()
    return (f"note: bf16 multiplies in float32 here: this CPU ({isa}) has no native bf16 "
            f"(AVX512_BF16 or AMX), and a bf16 linear of this model's MLP ({C} -> {I}, 64 tokens, "
            f"forward and backward) took {bf16 * 1e3:.1f} ms against {fp32 * 1e3:.1f} ms in "
            f"float32 ({bf16 / fp32:.0f}x); the {'frozen base' if frozen else 'sampler'} holds "
            "bf16's values in float32, the trainer runs without autocast (--cpu_bf16 true: bf16 "
            "kernels anyway)")
