"""
Activation bytes saved for backward per transformer layer, per rank: one process, TP = 2, and TP = 2 with
sequence parallelism (SP, whose fused all-gather linears re-gather in backward instead of saving), next
to Korthikanti et al. 2022 (arXiv:2205.05198, section 4): per layer, 16-bit activations,
    no parallelism    sbh(34 + 5as/h)
    TP                sbh(10 + 24/t + 5as/(ht))
    TP + SP           sbh(34/t + 5as/(ht))
The 5as/(ht) term is the softmax input/output and dropout mask, a*s*s per sequence; SDPA's flash kernels
(CPU and GPU) never materialise it, so the "no s^2" column (= their selective recompute) is the one
to compare against. Counted with torch.autograd.graph.saved_tensors_hooks: unique storages, weights
and the rope tables (shared by all layers) excluded.

Where the measured 44 sbh of one bf16 layer go (s=512, h=256, I=704, GQA 8/4 heads), and why they are
not the paper's 34: each RMSNorm keeps its float32 upcast (4), its normalised bf16 (2) and its output,
the next linears' input (2): 8, x2 norms = 16 (the paper's fused LayerNorm keeps 2 + the linear input
2); SDPA keeps q, k, v, out and the log-sum-exp: 2 + 1 + 1 + 2 = 6 (GQA halves k, v; no s^2 term);
SwiGLU keeps gate, up, silu(gate) and their product: 4 x 2 x I/h = 22 (GELU's 4h MLP: 19). Under TP=2
the 28 of attention and MLP are split and the 16 of the norms are replicated: 30 (paper 10 + 24/t).
SP splits the norms' tokens too and the fused linears keep only the local shard: 44/2 = 22. Keeping
the gathered input instead (#203 without recompute) would add 2 x 2 = 4 (the q/k/v and gate/up inputs).
float32 doubles everything except the norms' upcast, already float32.

Run: python tests/bench_tp.py   (spawns 2 gloo processes on the CPU; on a CUDA machine it also times a
tp = 1 training step of the same model on one GPU)
"""

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd.graph import saved_tensors_hooks

import model as M
import tp

B, T = 2, 512  # b, s
CFG = M.ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=1,
                    num_attention_heads=8, num_key_value_heads=4)  # the benches' tiny config, one layer


def saved_bytes(m: M.Llama, dtype: torch.dtype, sp: bool) -> int:
    """Bytes autograd keeps for backward during one block's forward, on this rank."""
    block, tp_size = m.model.layers[0], m.tp_state.ranks.tp_size if hasattr(m, "tp_state") else 1
    cos, sin = M.rope_cos_sin(m.inv_freq, torch.arange(T).expand(B, T), dtype)
    skip = {t.untyped_storage().data_ptr() for t in [*m.parameters(), cos, sin]}
    shape = (B * T // tp_size, CFG.hidden_size) if sp else (B, T, CFG.hidden_size)  # the residual stream
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        if tp_size > 1:  # a TPBlock: sequence parallelism is passed explicitly
            y = block(x, cos, sin, M.causal_attention, None, sp)  # SP: x is (N/tp, C)
        else:
            y = block(x, cos, sin, M.causal_attention)
    y.float().square().sum().backward()  # runs the backward collectives too, as in training
    return sum(seen.values())


def measure(rank: int, tmp: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    groups, rows = tp.make_groups(2), {}
    for dtype in (torch.bfloat16, torch.float32):
        full = M.Llama(CFG).init_weights(0).to(dtype)
        full.inv_freq = M.rope_inv_freq(CFG)  # float32, as from_pretrained keeps it
        rows["one process", dtype] = saved_bytes(full, dtype, sp=False)
        sharded = tp.shard_model(full, groups)
        rows["TP=2", dtype] = saved_bytes(sharded, dtype, sp=False)
        rows["TP=2 + SP", dtype] = saved_bytes(sharded, dtype, sp=True)
    if rank == 0:
        out.update(rows)
    tp.destroy_groups()


def korthikanti(t: int, sp: bool, attention_matrix: bool) -> float:
    """Bytes per layer / (s*b*h), 16-bit activations."""
    s, a, h = T, CFG.num_attention_heads, CFG.hidden_size
    quadratic = 5 * a * s / (h * t) if attention_matrix else 0.0
    if t == 1:
        return 34 + quadratic
    return (34 / t if sp else 10 + 24 / t) + quadratic


def cuda_step() -> None:
    """tokens/s and peak memory of a bf16 forward + backward at tp = 1 on one GPU (the same model code)."""
    cfg = M.ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4)
    m = M.Llama(cfg).init_weights(0).to(device="cuda", dtype=torch.bfloat16)
    m.inv_freq = M.rope_inv_freq(cfg).cuda()
    tokens = torch.randint(0, cfg.vocab_size, (16, 512), device="cuda")
    for i in range(6):  # 1 warm-up, 5 timed
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        m(tokens).float().logsumexp(-1).mean().backward()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 5
    print(f"\nCUDA tp=1 ({torch.cuda.get_device_name()}): {tokens.numel() / seconds:,.0f} tokens/s forward+backward, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(measure, args=(tmp, out), nprocs=2)
        rows = dict(out)
    sbh = T * B * CFG.hidden_size
    print(f"s={T} b={B} h={CFG.hidden_size} a={CFG.num_attention_heads} (kv heads {CFG.num_key_value_heads}) "
          f"I={CFG.intermediate_size}; bytes saved per layer per rank, in units of s*b*h bytes")
    print(f"{'':12} {'bf16 MB':>8} {'bf16/sbh':>9} {'fp32/sbh':>9} {'paper/sbh':>10} {'paper, no s^2':>14} "
          f"{'bf16 vs 1 proc':>15}")
    for name, t, sp in (("one process", 1, False), ("TP=2", 2, False), ("TP=2 + SP", 2, True)):
        bf16, fp32 = rows[name, torch.bfloat16], rows[name, torch.float32]
        print(f"{name:12} {bf16 / 1e6:8.2f} {bf16 / sbh:9.2f} {fp32 / sbh:9.2f} {korthikanti(t, sp, True):10.2f} "
              f"{korthikanti(t, sp, False):14.2f} {bf16 / rows['one process', torch.bfloat16]:15.2f}")
    if torch.cuda.is_available():
        cuda_step()
