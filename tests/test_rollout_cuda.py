"""rollout.py on a CUDA GPU: the graph-captured decode step against eager decode and the trainer."""

import pytest
import torch

from model import Llama
from rollout import KVCache, generate
from test_rollout import CFG, PROMPTS, trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CFG).init_weights(seed=0, std=0.2).eval()


def test_cuda_graph_decode_equals_eager_decode(model):
    gpu = Llama(CFG).to("cuda")
    gpu.load_state_dict(model.state_dict())
    cache = KVCache.for_batch(CFG, len(PROMPTS), 4, 11, 30, torch.float32, "cuda")  # fp32 KV: exact comparison
    kwargs = dict(num_samples=4, max_new_tokens=30, temperature=0.9, stop_ids=(5, 9, 17, 23, 31), seed=1,
                  check_every=2, cache=cache)
    graphed = generate(gpu, PROMPTS, cuda_graphs=True, **kwargs)
    eager = generate(gpu, PROMPTS, cuda_graphs=False, **kwargs)
    assert graphed.completions == eager.completions
    torch.testing.assert_close(torch.tensor(sum(graphed.logprobs, [])), torch.tensor(sum(eager.logprobs, [])),
                               rtol=0, atol=1e-4)  # TF32/kernel choice may differ between the two paths
    for row, completion in enumerate(graphed.completions):  # and both equal the trainer's forward
        expected = trainer_logprobs(gpu, PROMPTS[row // 4], completion, 0.9, 0, 1.0).cpu()
        torch.testing.assert_close(torch.tensor(graphed.logprobs[row]), expected, rtol=0, atol=1e-4)
    bf16 = generate(gpu, PROMPTS, num_samples=4, max_new_tokens=30, seed=1)  # private cache: bf16 on CUDA
    assert all(len(c) == 30 for c in bf16.completions)
