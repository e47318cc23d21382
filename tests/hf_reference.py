"""A test helper: a transformers model with random weights, saved by transformers' own writer.

The tests that compare with transformers load what IT wrote (config.json in its own layout,
model.safetensors, generation_config.json), never a file our writer made. Skips the calling test when
transformers is not installed (it is not a requirement of the engine).
"""

import pytest
import torch


def save_random_hf_model(path, config_class: str, config: dict, std: float = 0.2):
    """transformers.<config_class>(**config), weights ~ N(0, std) everywhere (biases too; norm
    weights near 1, so activations stay O(1)), saved to path. Returns the model (eval mode). A
    published width (C = 1024) wants HF's own 0.02: 0.2 would blow its activations up."""
    transformers = pytest.importorskip("transformers")
    hf_config = getattr(transformers, config_class)(**config)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std + name.endswith("norm.weight"))
    hf.save_pretrained(str(path))  # config.json, generation_config.json, model.safetensors
    return hf
