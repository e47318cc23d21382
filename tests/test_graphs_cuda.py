"""engine/compiling.py on a CUDA GPU: the compiled and captured bf16 decode step against the captured eager one
(the tolerances of tests/test_graphs.py), and the kernels it launches."""

import pytest
import torch

import rollout
from model import Llama
from rollout import RolloutConfig
from test_graphs import (LOGPROB_TOL, assert_a_nan_embedding_row_stops_the_compiled_rollout,
                         near_tie)
from test_rollout import CFG, PROMPTS, qwen3_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request) -> tuple[Llama, Llama]:
    """The bf16 model on the GPU, and its float64 twin on the CPU (the same bf16 weights): a Llama,
    and a Qwen3 (its q/k norms inside the compiled step, 8/4 heads of 16)."""
    if request.param == "llama":
        cpu = Llama(CFG).init_weights(seed=0, std=0.2)
    else:
        cpu = qwen3_model()
    cpu = cpu.to(torch.bfloat16).eval()
    wide = Llama(cpu.config).double().eval()
    wide.load_state_dict(cpu.state_dict())
    return cpu.cuda(), wide


def test_compiled_graphed_bf16_decode_equals_the_eager_graphed_decode(models):
    """Greedy, rows dropped at stop ids (graphs captured again): the compiled route's rows are the
    eager route's up to a near tie of the float64 forward, logprobs within LOGPROB_TOL while they
    agree; it compiled (compile_seconds counted), and a second call compiles nothing."""
    gpu, wide = models
    knobs = dict(num_samples=4, max_new_tokens=24, temperature=0.0, sync_every=2)
    stops = (5, 9, 17, 23, 31)
    first, again, eager = (rollout.generate(gpu, PROMPTS, RolloutConfig(compile_decode=on, **knobs),
                                            stop_ids=stops, seed=0)
                          for on in ("true", "true", "false"))
    assert first.stats["compiles"] >= 1 and first.stats["compile_seconds"] > 0
    assert again.stats["compiles"] == 0 and eager.stats["compiles"] == 0
    assert first.stats["compactions"] >= 1 and torch.equal(first.tokens, again.tokens)
    for row, (a, b) in enumerate(zip(first.completions(), eager.completions())):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            assert same < min(len(a), len(b)), "one row ends at a stop where the other goes on"
            assert near_tie(wide, PROMPTS[row // 4] + a[:same], a[same], b[same],
                            2 * LOGPROB_TOL), f"row {row} parts at token {same} without a near tie"
        torch.testing.assert_close(first.logprobs[row, :same], eager.logprobs[row, :same],
                                   rtol=0, atol=LOGPROB_TOL)


def test_nan_logits_on_the_compiled_cuda_route_stop_the_rollout_naming_the_step(models):
    """The compiled, captured bf16 step and the compiled draw: a NaN embedding row for a token the
    greedy rollout first draws at completion index j makes the logits of each row fed it NaN
    from step j + 1: the rollout stops at its next check naming step j + 1 (tests/test_graphs.py's
    test on the CPU)."""
    assert_a_nan_embedding_row_stops_the_compiled_rollout(models[0])


def test_the_compiled_step_launches_fewer_kernels_a_layer():
    """One replay of the captured step, counted by the profiler (tests/bench_rollout.py): the
    compiled step's kernels a layer under half the eager step's (on the CPU: 15 against 45)."""
    from bench_rollout import kernels_per_layer
    cuda = torch.device("cuda")
    eager = kernels_per_layer("bf16 kernel", cuda)[0]
    compiled = kernels_per_layer("bf16 kernel, compiled", cuda)[0]
    assert 0 < compiled < eager / 2, (compiled, eager)
