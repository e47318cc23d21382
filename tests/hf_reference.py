"""Test helpers for the references (transformers, trl, peft: not requirements of the engine).

import_reference(name) imports one, or skips the calling test saying it is not installed; with
REFERENCES_REQUIRED=1 (CI's step that installs them, .ci/run) a missing one fails the test instead,
so that a comparison never skips unseen there. The same variable turns the skips for the published
files the comparisons read (tokenizer directories, a real checkpoint) into failures.

The tests that compare with transformers load what IT wrote (config.json in its own layout,
model.safetensors, generation_config.json), never a file our writer made: save_random_hf_model.
chat_text is transformers' rendering of a conversation under a chat template, shared by the
template tests and tests/fixtures/make_fixtures.py, which saves it for the runs without transformers.
"""

import importlib
import os

import pytest
import torch

REQUIRED = os.environ.get("REFERENCES_REQUIRED") == "1"


def import_reference(name: str):
    """The module `name` (e.g. "transformers", "trl.chat_template_utils"); a skip without it, or
    an ImportError under REFERENCES_REQUIRED=1."""
    if REQUIRED:
        return importlib.import_module(name)
    return pytest.importorskip(name)


def skip_without(path: str, what: str, variable: str) -> None:
    """Skips the calling test when `path` (a published file a comparison reads) is absent, saying
    which variable names its directory; under REFERENCES_REQUIRED=1 fails it instead."""
    if not os.path.exists(path):
        message = f"no {what} at {path} (set {variable})"
        if REQUIRED:
            pytest.fail(f"{message}; REFERENCES_REQUIRED=1 runs every comparison")
        pytest.skip(message)


def save_random_hf_model(path, config_class: str, config: dict, std: float = 0.2):
    """transformers.<config_class>(**config), weights ~ N(0, std) everywhere (biases too; norm
    weights near 1, so activations stay O(1)), saved to path. Returns the model (eval mode). A
    published width (C = 1024) wants HF's own 0.02: 0.2 would blow its activations up."""
    transformers = import_reference("transformers")
    hf_config = getattr(transformers, config_class)(**config)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std + name.endswith("norm.weight"))
    hf.save_pretrained(str(path))  # config.json, generation_config.json, model.safetensors
    return hf


def chat_text(template: str, special_tokens: dict, messages: list[dict],
              tools: list[dict] | None = None, variables: dict | None = None) -> str:
    """transformers' apply_chat_template(messages, tools=tools, tokenize=False,
    add_generation_prompt=True, **variables) under `template`, with a tokenizer whose special
    tokens are `special_tokens` (e.g. {"eos_token": "<|im_end|>"}; the template reads them, and
    no other entry of the vocabulary)."""
    transformers = import_reference("transformers")
    from tokenizers import Tokenizer, models
    vocab = {token: i for i, token in enumerate(["<unk>", *special_tokens.values()])}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), **special_tokens)
    tok.chat_template = template
    return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=True, **(variables or {}))
