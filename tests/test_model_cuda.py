"""model.py on a CUDA GPU: bf16 logits against fp32, and the HF round trip on the device."""

import pytest
import torch

from engine import hf
import model as M
from test_model import assert_logits_close, make

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kw", [dict(), dict(architecture="Qwen3ForCausalLM", num_attention_heads=8,
                                           num_key_value_heads=4, head_dim=16)])
def test_bf16_cuda_logits_track_fp32_cpu(tmp_path, kw):
    """A Llama, and a Qwen3 (per-head q/k norms, H*D != C, rep 2 != Hkv 4), loaded onto the GPU."""
    m = make(std=0.02, **kw)  # HF's init scale: logits of a realistic size
    hf.save_model(m, str(tmp_path))
    x = torch.randint(0, 96, (4, 64))
    want = m(x)
    fp32 = hf.load_model(str(tmp_path), device="cuda", dtype=torch.float32)
    bf16 = hf.load_model(str(tmp_path), device="cuda", dtype=torch.bfloat16)
    got32, got16 = fp32(x.cuda()).cpu(), bf16(x.cuda()).float().cpu()
    print(f"max |logit| {want.abs().max():.3f}; fp32 cuda vs cpu {(got32 - want).abs().max():.2e}; "
          f"bf16 cuda vs fp32 cpu {(got16 - want).abs().max():.2e}")
    assert_logits_close(got32, want, m.config)  # TF32 is off by default for matmuls
    torch.testing.assert_close(got16, want, atol=5e-2, rtol=5e-2)  # bf16: 8 mantissa bits per op, 2 layers
