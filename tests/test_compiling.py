"""engine/compiling.py: the blocks' compiled training forward against the eager one (values and gradients),
one graph per region for every length, and train.py's --compile_blocks: the step that compiled says so,
the caches land in --compile_cache."""

import copy
import json
import os

import pytest
import torch
from torch._dynamo.utils import counters

from engine import compiling
import grpo
import memory
import train
from grpo import GRPOBatch
from model import Llama, ModelConfig
from test_grpo import (GRAD_REL, V, grads, logp_tol, ragged_batch, ragged_groups, tiny_model,
                       weighted_sum)
from test_train import FAST, in_a_cpu_process

pytestmark = pytest.mark.skipif(bool(compiling.unsupported()), reason=compiling.unsupported())


def logprobs_and_grads(m, batch) -> tuple[torch.Tensor, dict]:
    logp, entropy = grpo.completion_logprobs(m, batch, chunk_size=7)
    (weighted_sum(logp, batch.mask) + weighted_sum(entropy, batch.mask, seed=2)).backward()
    out = logp.detach(), grads(m)
    m.zero_grad()
    return out


@pytest.mark.parametrize("layout", ["4/2", "qwen3_16/8"])  # test_grpo.LAYOUTS: Qwen3's q/k norms
@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_blocks_equal_the_eager_ones_with_one_graph_for_every_length(checkpointed, layout,
                                                                             monkeypatch):
    """The blocks' training forward through the compiled regions (aot_eager: dynamo's graphs and
    AOTAutograd's forward and backward, no generated code) against the same model eager, on three
    micro-batches of different packed lengths (31, 47, 34 tokens): logprobs and every gradient
    within test_grpo's logp_tol and GRAD_REL (float32: AOTAutograd's decompositions round a few
    ops in another order), and two
    graphs in all, one a region, made at the first micro-batch and reused by every layer and
    length. Under activation checkpointing the recompute runs them too. A no-grad forward (the
    rollout's, the old logprobs') runs eager: no graph."""
    monkeypatch.setattr(compiling, "BACKEND", "aot_eager")
    eager = tiny_model(layout=layout)
    m = copy.deepcopy(eager)
    assert compiling.compile_blocks(m.model.layers) == 2
    memory.checkpoint_blocks(m.model.layers, checkpointed)
    batches = [GRPOBatch.from_lists(*ragged_groups(), temperature=0.8),
               GRPOBatch.from_lists(*ragged_batch(3)),
               GRPOBatch.from_lists(*ragged_groups(seed=5))]
    torch._dynamo.reset()
    counters.clear()
    for i, batch in enumerate(batches):
        got, want = logprobs_and_grads(m, batch), logprobs_and_grads(eager, batch)
        torch.testing.assert_close(got[0], want[0], **logp_tol(0.8))
        for name, g in want[1].items():
            assert (got[1][name] - g).norm() <= GRAD_REL * g.norm(), (i, name)
        assert counters["stats"]["unique_graphs"] == 2, i
    with torch.no_grad():
        grpo.completion_logprobs(m, batches[0])
    assert counters["stats"]["unique_graphs"] == 2
    memory.checkpoint_blocks(m.model.layers, False)
    compiling.compile_blocks(m.model.layers, False)
    assert type(m.model.layers[0]) is type(eager.model.layers[0])


def test_compile_blocks_refuses_what_it_cannot_compile():
    m = tiny_model()
    memory.checkpoint_blocks(m.model.layers)
    with pytest.raises(TypeError, match="before memory.checkpoint_blocks"):
        compiling.compile_blocks(m.model.layers)


def test_a_compiled_run_says_which_step_compiled_and_fills_the_cache(tmp_path, capsys,
                                                                     monkeypatch, request):
    """train.py --compile_blocks true on the CPU (inductor, the real compile) against the same run eager:
    its first step compiles (t_compile > 0, `compile` on its step line), its later steps (other
    packed lengths) do not, torch's caches are written under --compile_cache, and the metrics
    equal the eager run's: loss and entropy within 1e-5 (float32, fused kernels round in another
    order), grad_norm within 1e-4 (the loss's sum over ~400 tokens and every parameter); a model
    of its shapes, compiled, gives every gradient within 1e-5 of the eager one's. On a CUDA
    machine it runs in a CPU child (a GPU's FlexAttention compiles in the eager run too)."""
    if in_a_cpu_process(request):
        return
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "not_here"))  # train.py sets it
    runs = {}
    for mode in ("false", "true"):
        out = str(tmp_path / mode)
        assert train.main(FAST + ["--steps", "3", "--out", out, "--compile_blocks", mode,
                                  "--compile_cache", str(cache)]) == 0
        with open(os.path.join(out, "metrics.jsonl")) as f:
            runs[mode] = [json.loads(line) for line in f]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [" compile " in line for line in lines] == [False] * 3 + [True, False, False]
    assert [r["t_compile"] > 0 for r in runs["true"]] == [True, False, False]
    assert all(r["t_compile"] == 0 for r in runs["false"])
    assert any(files for _, _, files in os.walk(cache))
    assert not (tmp_path / "not_here").exists()
    for got, want in zip(runs["true"], runs["false"]):
        for key, rel in (("loss", 1e-5), ("entropy", 1e-5), ("grad_norm", 1e-4)):
            assert abs(got[key] - want[key]) <= rel * abs(want[key]), (got["step"], key)
    # Every gradient: a model of the run's block shapes reuses its compiled graphs (inductor's).
    eager = Llama(ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=88,
                              num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2)).init_weights(0, std=0.2)
    m = copy.deepcopy(eager)
    compiling.compile_blocks(m.model.layers)
    batch = GRPOBatch.from_lists(*ragged_groups(), temperature=0.8)
    got, want = logprobs_and_grads(m, batch), logprobs_and_grads(eager, batch)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for name, g in want[1].items():  # float32 sums of ~40 tokens in another order
        assert (got[1][name] - g).norm() <= 1e-5 * g.norm(), name
