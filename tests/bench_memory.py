"""Benchmark of memory.py. Run: python tests/bench_memory.py  (about a minute on a 2-core CPU)

1. The plan: bytes per tag in each phase, and all resident at once (no phases), for the tiny config
   and for a 1B Llama (Llama-3.2-1B shapes, built on the meta device: what it would be on a GPU).
2. Measured on this machine: memory.report() after two GRPO-like steps of the tiny config.
3. On a GPU: offload and reload of the AdamW state (PhaseManager sleep/wake) next to a plain copy of
   the same bytes, measured side by side, median of several cycles (on a CPU nothing is copied).
4. The released-tensor guard: sleep and wake of the bf16 sampler copy (class swap + free,
   re-allocate + NaN fill) next to the sync_weights that follows each wake, and the forward of a
   sampler that went through sleep/wake next to one that never did (an awake model pays nothing).
5. One training forward+backward: plain, activation offload, per-block checkpointing. Peak = the
   highest running sum of allocator bytes above the level at the start, from torch.profiler's
   memory events (every CPU allocation and free, in order); "held" = that sum at the end of the
   forward (what autograd keeps for backward). On a CPU host and device are the same memory, so
   offloading cannot lower these.
6. `--adamw [--model DIR]`: AdamW's step on the CPU as torch runs it, foreach (torch's default
   there), a per-parameter loop (foreach=False) and fused=True (the engine's choice), each in a
   fresh process on fp32 weights of the given checkpoint's shapes (SmolLM2-135M's by default; random
   values: no weights read) with random grads: seconds per step (median of steps 2..N) and the peak
   RSS over the process before its first step (= the two state tensors + the step's temporaries;
   weights and grads are already resident), and the largest parameter difference from foreach.
On a CUDA GPU it also prints offload/reload GB/s next to a plain pinned copy and the peak of one
step with phases vs without (torch.cuda.max_memory_allocated).
"""

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from engine import hf  # noqa: E402
import model as M  # noqa: E402
from memory import PHASE_TAGS, PhaseManager, checkpoint_blocks, offload_activations  # noqa: E402
from engine.decode import KVCache  # noqa: E402
from rollout import RolloutConfig, generate, sync_weights  # noqa: E402

TINY = M.ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4)
ONE_B = M.ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      tie_word_embeddings=True)
MID = M.ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=8)


def build(cfg: M.ModelConfig, device: str, prompts: int, samples: int, prompt_len: int,
          new_tokens: int):
    """fp32 trainer + AdamW, bf16 sampler and reference copies, a bf16 KV cache sized like
    rollout.py's."""
    if device == "meta":
        with torch.device("meta"):
            trainer = M.Llama(cfg)
    else:
        trainer = M.Llama(cfg).init_weights(0).to(device)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    reference = copy.deepcopy(trainer).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    if device == "meta":  # AdamW's state as its first step would create it
        for p in trainer.parameters():
            optimizer.state[p] = dict(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                      exp_avg_sq=torch.zeros_like(p))
    cache = KVCache.for_batch(cfg, prompts, samples, prompt_len, new_tokens, torch.bfloat16, device)
    mgr = PhaseManager(device)
    mgr.add_weights(trainer, sampler)
    mgr.add_kv_cache(cache.buffer)
    mgr.add_grads(trainer)
    mgr.add_optimizer(optimizer)
    mgr.add_reference(reference)
    return mgr, trainer, sampler, reference, optimizer, cache


def print_plan(name: str, mgr: PhaseManager, unit: float, unit_name: str) -> None:
    plan = mgr.plan()
    everything = {g.tag: g.full_bytes() for g in mgr.holders}
    print(f"\n{name}: {unit_name} resident per tag (activations not included)")
    print(f"{'tag':<10}" + "".join(f"{p:>11}" for p in PHASE_TAGS) + f"{'no phases':>11}")
    for tag in everything:
        cells = "".join(f"{plan[p][tag] / unit:>11.2f}" for p in PHASE_TAGS)
        print(f"{tag:<10}{cells}{everything[tag] / unit:>11.2f}")
    totals = [sum(plan[p].values()) for p in PHASE_TAGS]
    whole = sum(everything.values())
    cells = "".join(f"{t / unit:>11.2f}" for t in totals)
    print(f"{'total':<10}{cells}{whole / unit:>11.2f}")
    print(f"largest phase / no phases = {max(totals) / whole:.2f}")


def loss_fn(model: M.Llama, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def fake_steps(mgr, trainer, sampler, reference, optimizer, steps: int, device: str) -> None:
    tokens = torch.randint(0, trainer.config.vocab_size, (4, 64), device=device)
    for _ in range(steps):
        with mgr.phase("rollout"), torch.no_grad():
            sync_weights(sampler, trainer)
            sampler(tokens)
        with mgr.phase("reference"), torch.no_grad():
            reference(tokens)
        with mgr.phase("train"):
            loss_fn(trainer, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()


def offload_vs_copy(device: str, cycles: int = 7) -> None:
    """Offload (sleep) and reload (wake) of the AdamW state next to one flat copy of the same
    bytes."""
    cfg = MID
    mgr, trainer, sampler, reference, optimizer, cache = build(cfg, device, 4, 2, 32, 32)
    fake_steps(mgr, trainer, sampler, reference, optimizer, 1, device)  # AdamW state exists now
    group = next(g for g in mgr.holders if g.tag == "optimizer")
    moved = [t for t in mgr.transitions if t.tag == "optimizer"]
    nbytes = moved[-1].nbytes  # leaving train offloaded the state: these bytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    names = ["offload (sleep)", "reload (wake)", "plain copy to host", "plain copy to device",
             "fresh alloc + copy to device"]
    rows = {name: [] for name in names}
    copies = {"plain copy to host": lambda: host.copy_(src, non_blocking=True),
              "plain copy to device": lambda: src.copy_(host, non_blocking=True),
              "fresh alloc + copy to device":
                  lambda: torch.empty_like(src).copy_(host, non_blocking=True)}
    for _ in range(cycles):
        mgr.enter("train")  # the optimizer state comes back, and goes to the host again at exit
        mgr.exit()
        done = {t.action: t for t in mgr.transitions if t.tag == "optimizer"}  # the last of each
        rows["offload (sleep)"].append(done["sleep"].seconds)
        rows["reload (wake)"].append(done["wake"].seconds)
        for name, fn in copies.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            rows[name].append(time.perf_counter() - start)
    base = {"to host": statistics.median(rows["plain copy to host"]),
            "to device": statistics.median(rows["plain copy to device"])}
    print(f"\nAdamW state offload on {device}: {nbytes / 1e6:.1f} MB in {len(group.tensors())} "
          f"tensors, median of {cycles} cycles; 'vs plain copy' = plain copy time / this time")
    print(f"{'':<30}{'ms':>9}{'GB/s':>9}{'vs plain copy':>15}")
    for name, times in rows.items():
        t = statistics.median(times)
        ref = base["to host"] if "host" in name or "sleep" in name else base["to device"]
        print(f"{name:<30}{t * 1e3:>9.2f}{nbytes / t / 1e9:>9.2f}{ref / t:>15.2f}")


def profiled_peak(model: M.Llama, tokens: torch.Tensor, context) -> tuple[int, int]:
    """(peak, held after the forward) bytes of CPU allocations above the starting level."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench_forward"), context():
            loss = loss_fn(model, tokens)
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    forward_end = max(e["ts"] + e["dur"] for e in events if e.get("name") == "bench_forward")
    memory = sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]")
    running, peak, held = 0, 0, 0
    for ts, nbytes in memory:
        running += nbytes
        peak = max(peak, running)
        held = running if ts <= forward_end else held
    return peak, held


def released_guard(cycles: int = 7) -> None:
    """The sampler copy's sleep (class swap, free) and wake (re-allocate, NaN fill) next to the
    sync_weights that refills it, and an awake forward after sleep/wake cycles vs never released."""
    mgr, trainer, sampler, reference, optimizer, cache = build(TINY, "cpu", 4, 2, 32, 32)
    never = copy.deepcopy(sampler)
    tokens = torch.randint(0, TINY.vocab_size, (8, 64))
    group = next(g for g in mgr.holders if g.tag == "sampler")
    rows = {"sleep (release)": [], "wake (re-allocate)": [], "sync_weights": []}
    with mgr.phase("rollout"):
        pass  # registered awake: released at this exit, so that every cycle below wakes it
    for _ in range(cycles):
        mgr.enter("rollout")
        start = time.perf_counter()
        sync_weights(sampler, trainer)
        rows["sync_weights"].append(time.perf_counter() - start)
        mgr.exit()
        done = {t.action: t for t in mgr.transitions if t.tag == "sampler"}  # the last of each
        rows["sleep (release)"].append(done["sleep"].seconds)
        rows["wake (re-allocate)"].append(done["wake"].seconds)
    print(f"\nthe bf16 sampler copy on the CPU: {group.full_bytes() / 1e6:.1f} MB in "
          f"{len(group.held)} parameters, median of {cycles} cycles")
    print(f"{'':<30}{'ms':>9}")
    for name, times in rows.items():
        print(f"{name:<30}{statistics.median(times) * 1e3:>9.2f}")
    mgr.enter("rollout")
    sync_weights(sampler, trainer)
    sync_weights(never, trainer)
    times = {"never released": [], "after sleep/wake": []}
    with torch.no_grad():
        for _ in range(cycles):  # interleaved: the machine's noise hits both alike
            for name, model in (("never released", never), ("after sleep/wake", sampler)):
                start = time.perf_counter()
                model(tokens)
                times[name].append(time.perf_counter() - start)
    mgr.exit()
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["after sleep/wake"] / medians["never released"]
    print(f"awake forward (8 x 64 tokens): after sleep/wake / never released = {ratio:.3f}")


def activation_memory(batch: int = 8, seq: int = 256) -> None:
    model = M.Llama(TINY).init_weights(0)
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq))
    variants = {"plain": nullcontext, "activation offload": lambda: offload_activations(model),
                "checkpoint blocks": nullcontext}
    print(f"\none training forward+backward, tiny config, {batch} x {seq} tokens, "
          f"CPU allocator (profiler)")
    print(f"{'':<20}{'peak MB':>9}{'held MB':>9}{'peak vs plain':>15}{'time vs plain':>15}")
    plain = None
    for name, context in variants.items():
        checkpoint_blocks(model.model.layers, enabled=name == "checkpoint blocks")
        times = []
        for _ in range(3):
            start = time.perf_counter()
            with context():
                loss = loss_fn(model, tokens)
            loss.backward()
            model.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        peak, held = profiled_peak(model, tokens, context)
        plain = plain or (peak, statistics.median(times))
        print(f"{name:<20}{peak / 1e6:>9.1f}{held / 1e6:>9.1f}{peak / plain[0]:>15.2f}"
              f"{statistics.median(times) / plain[1]:>15.2f}")
    checkpoint_blocks(model.model.layers, enabled=False)


def cuda_step_peak() -> None:
    """Peak of one GRPO-like step (rollout with a KV cache, then a training step) with and
    without phases."""
    print("\none step on CUDA (mid config, 16 prompts x 8 samples, 64 + 64 tokens): max allocated")
    peaks = {}
    for phases in (False, True):
        mgr, trainer, sampler, reference, optimizer, cache = build(MID, "cuda", 16, 8, 64, 64)
        if not phases:
            mgr = None
        prompts = [torch.randint(0, MID.vocab_size, (64,)).tolist() for _ in range(16)]
        for step in range(2):  # the second step is the steady state: AdamW's state exists
            torch.cuda.reset_peak_memory_stats()
            if mgr is not None:
                mgr.phase_peak.clear()
            with mgr.phase("rollout") if mgr else nullcontext():
                sync_weights(sampler, trainer)
                out = generate(sampler, prompts, RolloutConfig(num_samples=8, max_new_tokens=64),
                               cache=cache, seed=step)
            padded = [prompts[i // 8] + c + [0] * (64 - len(c))
                      for i, c in enumerate(out.completions())]
            tokens = torch.tensor(padded, device="cuda")
            with mgr.phase("train") if mgr else nullcontext():
                for chunk in tokens.split(16):  # micro-batches of 16 sequences
                    loss_fn(trainer, chunk).backward()
                optimizer.step()
                optimizer.zero_grad()
        peaks[phases] = max(mgr.phase_peak.values()) if mgr else torch.cuda.max_memory_allocated()
        if mgr:
            print(mgr.report())
        del mgr, trainer, sampler, reference, optimizer, cache
        torch.cuda.empty_cache()
    print(f"no phases {peaks[False] / 1e9:.2f} GB, phases {peaks[True] / 1e9:.2f} GB, "
          f"ratio {peaks[True] / peaks[False]:.2f}")


SMOLLM2 = M.ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        tie_word_embeddings=True)
ADAMW = {"foreach": dict(foreach=True), "loop": dict(foreach=False), "fused": dict(fused=True)}


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def adamw_child(variant: str, model_dir: str, steps: int, threads: int) -> None:
    """One variant's steps, in this fresh process; prints one JSON line."""
    import resource
    torch.set_num_threads(threads)
    cfg = hf.load_config(model_dir) if model_dir else SMOLLM2
    torch.manual_seed(0)
    params = [p.detach().requires_grad_() for p in M.Llama(cfg).init_weights(0).parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), **ADAMW[variant])
    before = _rss_kib()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    state = sum(p.numel() * p.element_size() for p in params) * 2
    checksum = torch.cat([p.detach().flatten()[:: 997] for p in params])  # a sample of the weights
    torch.save(checksum, os.path.join(tempfile.gettempdir(), f"bench_adamw_{variant}.pt"))
    print(json.dumps(dict(variant=variant, s=statistics.median(times[1:]), first=times[0],
                          over_kib=peak - before, state=state)))


def adamw_variants(model_dir: str, steps: int = 4, threads: int = 2) -> None:
    """--adamw: each variant in a fresh process (its own peak RSS), the table side by side."""
    import subprocess
    rows = []
    for variant in ADAMW:
        out = subprocess.run([sys.executable, __file__, "--adamw-child", variant, model_dir,
                              str(steps), str(threads)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = torch.load(os.path.join(tempfile.gettempdir(), "bench_adamw_foreach.pt"))
    print(f"AdamW step on the CPU, {model_dir or 'SmolLM2-135M shapes'}, fp32, {threads} threads, "
          f"{steps} steps (median of 2..{steps}); state (exp_avg + exp_avg_sq) "
          f"{rows[0]['state'] / 2**20:,.0f} MiB; load average {os.getloadavg()[0]:.1f}")
    print("| variant | s/step | vs foreach | first step s | peak RSS over start MiB | over the "
          "state MiB | max abs diff vs foreach |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        diff = (torch.load(os.path.join(tempfile.gettempdir(), f"bench_adamw_{r['variant']}.pt"))
                - base).abs().max().item()
        print(f"| {r['variant']} | {r['s']:.3f} | {rows[0]['s'] / r['s']:.2f}x | {r['first']:.3f} | "
              f"{r['over_kib'] / 1024:,.0f} | {r['over_kib'] / 1024 - r['state'] / 2**20:,.0f} | "
              f"{diff:.1e} |")


if __name__ == "__main__" and len(sys.argv) > 1:
    if sys.argv[1] == "--adamw-child":
        adamw_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "--adamw":
        adamw_variants(sys.argv[3] if sys.argv[2:3] == ["--model"] else "")
    else:
        sys.exit("usage: python tests/bench_memory.py [--adamw [--model DIR]]")
elif __name__ == "__main__":
    torch.manual_seed(0)
    # One thread: these copies are memory-bound, and on a shared 2-core machine OpenMP's spinning
    # barriers made the same 32 MB copy take 10 to 190 ms from one cycle to the next (1 thread: 9
    # to 16 ms).
    torch.set_num_threads(1)
    plans = [("tiny config (16 prompts x 8 samples x 64 + 64 tokens)", TINY, (16, 8, 64, 64)),
             ("1B Llama (meta device; 16 prompts x 8 samples x 512 + 1024 tokens)", ONE_B,
              (16, 8, 512, 1024))]
    for name, cfg, args in plans:
        mgr = build(cfg, "meta", *args)[0]
        print_plan(name, mgr, 1e6 if cfg is TINY else 1e9, "MB" if cfg is TINY else "GB")
    engine = build(TINY, "cpu", 16, 8, 64, 64)
    fake_steps(*engine[:5], steps=2, device="cpu")
    print("\nmeasured on the CPU, tiny config, two fake steps:")
    print(engine[0].report())
    del engine
    print("\nAdamW state offload on cpu: none (it stays in place, guarded: the host is the device)")
    released_guard()
    activation_memory()
    if torch.cuda.is_available():
        offload_vs_copy("cuda")
        cuda_step_peak()
