"""Test helpers: a transformers model with random weights, saved by transformers' own writer; and
a tied checkpoint turned into the Hub's layout of Qwen3-0.6B and 1.7B (a stored lm_head.weight).

The tests that compare with transformers load what IT wrote (config.json in its own layout,
model.safetensors, generation_config.json), never a file our writer made. save_random_hf_model
skips the calling test when transformers is not installed (it is not a requirement of the engine).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file


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


def store_tied_copy(path, change_rows: slice | None = None) -> None:
    """Write lm_head.weight beside a tied checkpoint's embedding, in its file (the index updated):
    the Hub's Qwen3-0.6B layout. change_rows: those rows of the copy differ from the embedding."""
    index = os.path.join(path, "model.safetensors.index.json")
    weight_map = json.load(open(index))["weight_map"] if os.path.exists(index) else None
    file = os.path.join(path, weight_map["model.embed_tokens.weight"] if weight_map
                        else "model.safetensors")
    tensors = {k: t.clone() for k, t in load_file(file).items()}  # off the mmap: file is rewritten
    copy = tensors["model.embed_tokens.weight"].clone()
    if change_rows is not None:
        copy[change_rows] += 1
    save_file({**tensors, "lm_head.weight": copy}, file, metadata={"format": "pt"})
    if weight_map:
        weight_map["lm_head.weight"] = os.path.basename(file)
        json.dump({"metadata": {}, "weight_map": weight_map}, open(index, "w"))
