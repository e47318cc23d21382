"""rollout.py on a CUDA GPU: the graph-captured decode step against eager decode and the trainer."""

import pytest
import torch

from model import Llama
from rollout import KVCache, RolloutConfig, generate
from test_rollout import CFG, PROMPTS, trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CFG).init_weights(seed=0, std=0.2).eval()


def test_cuda_graph_decode_equals_eager_decode(model):
    gpu = Llama(CFG).to("cuda")
    gpu.load_state_dict(model.state_dict())
    cache = KVCache.for_batch(CFG, len(PROMPTS), 4, 11, 30, torch.float32, "cuda")  # fp32 KV: exact comparison
    knobs = dict(num_samples=4, max_new_tokens=30, temperature=0.9, check_every=2)
    kwargs = dict(stop_ids=(5, 9, 17, 23, 31), seed=1, cache=cache)
    graphed = generate(gpu, PROMPTS, RolloutConfig(cuda_graphs=True, **knobs), **kwargs)
    eager = generate(gpu, PROMPTS, RolloutConfig(cuda_graphs=False, **knobs), **kwargs)
    assert torch.equal(graphed.tokens, eager.tokens)
    # TF32/kernel choice may differ between the two paths
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, rtol=0, atol=1e-4)
    logprobs = graphed.logprob_lists()
    for row, completion in enumerate(graphed.completions()):  # both equal the trainer's forward
        expected = trainer_logprobs(gpu, PROMPTS[row // 4], completion, 0.9, 0, 1.0).cpu()
        torch.testing.assert_close(torch.tensor(logprobs[row]), expected, rtol=0, atol=1e-4)
    # A private cache: bf16 on CUDA.
    bf16 = generate(gpu, PROMPTS, RolloutConfig(num_samples=4, max_new_tokens=30), seed=1)
    assert bf16.mask.all() and bf16.tokens.shape == (len(PROMPTS) * 4, 30)
