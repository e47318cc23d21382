"""lora.py on a CUDA GPU: the adapted model sampled in CUDA graphs against the trainer's forward, and
a bf16 base with float32 adapters as --use_peft --dtype bfloat16 trains it."""

import pytest
import torch

import lora
from engine.decode import KVCache
from test_lora import CFG, adapted
from test_rollout import PROMPTS, generate, logprob_tol, trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_graphed_sampler_logprobs_equal_the_trainers_forward_on_the_adapted_model():
    """float32, the decode step captured in CUDA graphs (one a bucket of rows) with each adapter
    beside its linear: the sampler's logprobs equal one full forward's within logprob_tol (the
    same bound as the CPU's, tests/test_lora.py; TF32 is off for float32 matmuls), and the
    graphed rollout draws the eager one's tokens (no stop id: no row drops, one random stream)."""
    cpu = adapted().eval()
    model = adapted().eval().to("cuda")
    G, T = 3, 20
    cache = KVCache.for_batch(CFG, len(PROMPTS), G, 11, T, torch.float32, "cuda")
    knobs = dict(num_samples=G, max_new_tokens=T, temperature=1.0, seed=5, cache=cache)
    graphed = generate(model, PROMPTS, cuda_graphs=True, **knobs)
    eager = generate(model, PROMPTS, cuda_graphs=False, **knobs)
    assert torch.equal(graphed.tokens, eager.tokens)
    for row, completion in enumerate(graphed.completions()):
        want = trainer_logprobs(model, PROMPTS[row // G], completion, 1.0, 0, 1.0)
        torch.testing.assert_close(torch.tensor(graphed.logprob_lists()[row]), want.cpu(),
                                   **logprob_tol(cpu))


def test_a_bf16_base_trains_its_float32_adapters_alone_under_autocast():
    """--use_peft --dtype bfloat16 on a GPU: the base stays bf16 and frozen, the adapters float32.
    A forward and backward under bf16 autocast gives the adapters finite gradients and the base
    none, and each adapted linear's output is W x + b + s B A x computed in float32 from the same
    bf16 weight, within bf16's rounding of the matmuls' inputs and outputs (2^-8 relative, a few
    roundings deep: 2%)."""
    model = adapted(dtype=torch.bfloat16).to("cuda").train()
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad
               for n, p in model.named_parameters() if not lora.is_adapter(n))
    assert all(p.dtype == torch.float32 and p.requires_grad for p in lora.trainable(model))
    tokens = torch.randint(0, CFG.vocab_size, (2, 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)  # (2, 24, V)
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if lora.is_adapter(name):
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None, name
    name, m = lora.adapted(model)[0]
    x = torch.randn(16, m.in_features, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = m(x).float()
    w = m.weight.float()
    want = x @ w.T + (0 if m.bias is None else m.bias.float()) + m.scaling * (x @ m.lora_A.T) @ m.lora_B.T
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
