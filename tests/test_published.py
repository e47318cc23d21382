"""The published files' shapes against transformers, with or without it installed: a Qwen3
checkpoint in the Hub's layout gives transformers' logits, and the published Qwen3 and Llama 3.1
chat templates render prompts and tool turns as transformers renders them.

transformers is not a requirement of the engine, so its answers are committed beside the inputs
(tests/fixtures/, written by tests/make_fixtures.py from transformers 5.24): without it
these tests compare with the saved answers; with it they also compare with transformers live, and
the saved answers with its (a stale fixture fails). Provenance of the templates:
tests/fixtures/chat_templates/README.md.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import hf
from engine import tokenizer as tk
import tolerance
from make_fixtures import CHECKPOINT, LOGITS, TEMPLATES, chat_text

REQUIRED = os.environ.get("REFERENCES_REQUIRED") == "1"  # CI's step with the references
SAVED = load_file(LOGITS)  # input_ids (B, T), transformers' logits (B, T, V) of CHECKPOINT
with open(os.path.join(TEMPLATES, "renders.json")) as f:
    RENDERS = json.load(f)


def transformers_or_none():
    """transformers where installed, else None (the saved answers stand alone); under
    REFERENCES_REQUIRED=1 its absence is an ImportError."""
    try:
        import transformers
    except ImportError:
        if REQUIRED:
            raise
        return None
    return transformers


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, cfg) -> None:
    """Two float32 forwards of one model: the same sums in other orders (tests/tolerance.py)."""
    depth = tolerance.model_depth(cfg, want.shape[1], "logits")
    torch.testing.assert_close(got, want, **tolerance.reordered(depth, want.abs().max()))

# -----------------------------------------------------------------------------
# A Qwen3 checkpoint as the Hub stores Qwen3-0.6B and 1.7B


def test_the_fixture_is_laid_out_as_the_hub_stores_qwen3_0_6b():
    """What the logits tests below rely on: config.json ties lm_head to the embedding, and the
    safetensors file stores lm_head.weight all the same, equal to the embedding, in bfloat16."""
    with open(os.path.join(CHECKPOINT, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] is True and config["model_type"] == "qwen3"
    assert config["torch_dtype"] == "bfloat16" and "rope_theta" in config  # transformers 4.51's
    stored = load_file(os.path.join(CHECKPOINT, "model.safetensors"))
    assert torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert SAVED["logits"].shape == (*SAVED["input_ids"].shape, config["vocab_size"])


def check_logits(path: str) -> None:
    """The engine's float32 logits of the checkpoint at `path` against transformers' saved ones,
    and against transformers' live ones where it is installed (the saved ones too)."""
    ours = hf.load_model(path).eval()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied, as transformers ties it
    with torch.no_grad():
        got = ours(SAVED["input_ids"])
    assert (got - SAVED["logits"]).abs().max() <= 1e-4
    assert_logits_close(got, SAVED["logits"], ours.config)
    transformers = transformers_or_none()
    if transformers is None:
        return
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(SAVED["input_ids"]).logits
    assert_logits_close(got, want, ours.config)
    assert_logits_close(SAVED["logits"], want, ours.config)  # the fixture is transformers' still


def test_a_qwen3_checkpoint_in_the_hubs_layout_gives_transformers_logits():
    """Tied with the stored copy of the embedding (Qwen3-0.6B's and 1.7B's layout): loaded, tied,
    and its logits are transformers'."""
    check_logits(CHECKPOINT)


def test_a_qwen3_checkpoint_without_the_stored_copy_gives_the_same_logits(tmp_path):
    """Tied with no lm_head.weight in the file (Qwen3-4B's layout, and transformers 5's writer):
    the same model, the same logits."""
    stored = load_file(os.path.join(CHECKPOINT, "model.safetensors"))
    del stored["lm_head.weight"]
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(CHECKPOINT, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    check_logits(str(tmp_path))

# -----------------------------------------------------------------------------
# The published chat templates: prompts, tools, tool calls and their answers


CASES = [(name, case) for name in RENDERS for case in RENDERS[name]["cases"]]


@pytest.mark.parametrize("name, case", CASES, ids=[f"{n}: {c['case']}" for n, c in CASES])
def test_a_published_template_renders_as_transformers(name, case):
    """The engine's rendering (engine/tokenizer.py: the template, the special tokens of
    tokenizer_config.json, the tools' schemas, --chat_template_kwargs' variables, the generation
    prompt) equals transformers' apply_chat_template text; a row that ends with tool messages
    is the prompt before the call, the model's turn, then the tool turn the engine writes after
    it (tokenizer.tool_turn)."""
    with open(os.path.join(TEMPLATES, name)) as f:
        template = f.read()
    special_tokens = RENDERS[name]["special_tokens"]
    ours = tk.PromptTokenizer(None, {"tokenizer_config.json": json.dumps(special_tokens),
                                     "chat_template.jinja": template})  # rendering reads no vocab
    messages, tools, variables = case["messages"], case["tools"], case["variables"]
    text = ours.render(messages, tools, variables)
    assert text == case["text"]
    if messages[-1]["role"] == "tool":
        call = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        before, answers = messages[:call], messages[call + 1:]
        assert text.startswith(ours.render(before, tools, variables))
        assert text.endswith(ours.tool_turn(before, answers, "", tools, variables))
    if transformers_or_none() is not None:
        assert chat_text(template, special_tokens, messages, tools, variables) == case["text"]
