"""
Tokenizers and chat templates: a task's prompt to exactly the ids transformers and TRL would feed.

A checkpoint's tokenizer is its tokenizer.json (the `tokenizers` library) with tokenizer_config.json
(special tokens, the chat template) and chat_template.jinja (where transformers 5 writes the
template; it wins over tokenizer_config.json's, as in transformers). A prompt is plain text or a
conversation (a list of {"role", "content"} messages, TRL's conversational format):
- plain text is encoded with the tokenizer's own post-processor (`add_special_tokens=True`, as
  transformers' `tokenizer(text)`): whether a BOS comes first is the tokenizer's decision (Llama 3's
  adds one, Qwen's none), never config.json's bos_token_id;
- a conversation is rendered with the checkpoint's own template as transformers renders it (jinja2
  sandboxed, trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now, the special
  tokens as variables, add_generation_prompt=True, and `--chat_template_kwargs`, TRL's name: a JSON
  object of extra variables, e.g. Qwen3's {"enable_thinking": false}) and the text encoded without
  special tokens (the template writes them), as TRL does.
Prompts are left-truncated to a length (the question sits at the end). A checkpoint the engine
writes carries these files verbatim (save_pretrained), so transformers reads it as the source.
A tool turn (multi-turn tool use) is the text the template writes between an assistant message's
content and the next generation prompt when tool messages follow, cut out of one rendering. A task's
function tools (tools/functions.py) reach the template as `tools`, their JSON schemas, as transformers'
`apply_chat_template(..., tools=...)` passes them (None without: some templates test for it).

Leaves out: documents in templates, multimodal content, assistant masks,
tokenizers other than tokenizer.json (sentencepiece .model files).
Tested by tests/test_tokenizer.py.
"""

import json
import os
from dataclasses import dataclass
from datetime import datetime

# Files a checkpoint directory may hold besides tokenizer.json, carried verbatim into checkpoints.
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# Stands in for an assistant message's content, so the tool turn after it can be cut out of one
# rendering. Mixed case and digits: a template that upper- or lower-cases content changes it.
TOOL_TURN_MARK = "ToolTurnMark-7f3a9c1e5d2b"
# The special tokens transformers passes to a template as variables (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


# Variables the engine itself gives the template: --chat_template_kwargs may not set them.
RENDER_ARGUMENTS = ("messages", "add_generation_prompt")


@dataclass
class PromptConfig:
    prompt_template: str = ""  # plain-text prompts: text around "{prompt}"; "" = the prompt itself
    system_prompt: str = ""    # a system message first; a string prompt becomes the user's message
    chat_template_kwargs: str = ""  # JSON template variables (TRL's): '{"enable_thinking": false}'

    def __post_init__(self):
        if self.prompt_template and "{prompt}" not in self.prompt_template:
            raise ValueError(f"--prompt_template {self.prompt_template!r} has no {{prompt}} to "
                             "replace")
        self.template_variables()  # a bad one is refused before anything is built

    def template_variables(self) -> dict:
        """--chat_template_kwargs as a dict ({} when not given), or one ValueError saying why."""
        if not self.chat_template_kwargs:
            return {}
        flag = f"--chat_template_kwargs {self.chat_template_kwargs!r}"
        try:
            variables = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON ({e}); give an object, e.g. "
                             "'{\"enable_thinking\": false}'") from None
        if not isinstance(variables, dict):
            raise ValueError(f"{flag} is a JSON {type(variables).__name__}; give an object of "
                             "template variables, e.g. '{\"enable_thinking\": false}'")
        if taken := [k for k in RENDER_ARGUMENTS if k in variables]:
            raise ValueError(f"{flag} sets {taken[0]!r}, which the engine gives the template "
                             "itself")
        return variables

# -----------------------------------------------------------------------------
# Loading and saving


def load_tokenizer(path: str, vocab_size: int | None = None) -> "PromptTokenizer":
    """The tokenizer of a checkpoint directory, or one ValueError naming the file. With the model's
    vocab_size, a tokenizer with more ids is refused (they would index past the embedding); fewer is
    normal (Qwen pads its embedding beyond the tokenizer)."""
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found; the checkpoint directory needs a "
                                "tokenizer.json")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the tokenizers library raises plain Exceptions
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{file}: not a readable tokenizer.json ({why})") from None
    files = {}
    for name in SIDE_FILES:
        if os.path.isfile(os.path.join(path, name)):
            with open(os.path.join(path, name), encoding="utf-8") as f:
                files[name] = f.read()
    tokenizer = PromptTokenizer(tok, files, path)
    if vocab_size is not None and tokenizer.num_ids > vocab_size:
        raise ValueError(f"{file}: the tokenizer has {tokenizer.num_ids} ids but config.json's "
                         f"vocab_size is {vocab_size}: ids >= {vocab_size} have no embedding; "
                         "the tokenizer does not belong to this model")
    return tokenizer


def build_char_tokenizer(chars: str, specials: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")):
    """A character-level tokenizer (one id per character, specials first) for synthetic tasks and
    tests, saved and loaded as a standard tokenizer.json. With a "<bos>" among the specials, its
    post-processor puts it first in every encoded text, as Llama 3's does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    chars = "".join(dict.fromkeys(chars))  # unique, order kept
    vocab = {tok: i for i, tok in enumerate(list(specials) + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # every character is a token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join tokens without spaces
    tok.add_special_tokens(list(specials))
    if "<bos>" in vocab:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])])
    return tok

# -----------------------------------------------------------------------------
# Chat templates


def compile_template(source: str):
    """A template compiled as transformers compiles chat templates: sandboxed (a template from a
    checkpoint is untrusted), trim_blocks and lstrip_blocks, {% break %}/{% continue %}, and the
    helpers templates call."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    return value.get("content") if isinstance(value, dict) else value


class PromptTokenizer:
    """tokenizer.json plus the checkpoint's side files: prompts (text or conversations) to ids."""

    def __init__(self, tok, files: dict[str, str] | None = None, source: str = ""):
        self.tok = tok  # a tokenizers.Tokenizer
        self.files = dict(files or {})
        self.source = source
        self.config = {}
        if "tokenizer_config.json" in self.files:
            where = os.path.join(source, "tokenizer_config.json")
            try:
                self.config = json.loads(self.files["tokenizer_config.json"])
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(self.config, dict):
                raise ValueError(f"{where}: is a JSON {type(self.config).__name__}, expected an "
                                 "object")
        self._template = None

    @property
    def num_ids(self) -> int:
        """1 + the largest id (ids may have gaps; the embedding must cover the largest)."""
        return 1 + max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1)

    def template_source(self) -> str | None:
        """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of
        named templates: the one named "default")."""
        if "chat_template.jinja" in self.files:
            return self.files["chat_template.jinja"]
        template = self.config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None:
                raise ValueError(f"{self.source}/tokenizer_config.json: chat_template lists "
                                 f"{sorted(map(str, named))} and none is named 'default'")
        return template if isinstance(template, str) else None

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               variables: dict | None = None) -> str:
        """The conversation as the checkpoint's template writes it, ending with the generation
        prompt (transformers' apply_chat_template(messages, tools=tools, tokenize=False,
        add_generation_prompt=True, **variables)); tools: the functions' JSON schemas;
        variables: --chat_template_kwargs'."""
        where = self.source or "the tokenizer"
        if self._template is None:
            source = self.template_source()
            if source is None:
                raise ValueError(f"{where}: no chat template (tokenizer_config.json's "
                                 "chat_template or chat_template.jinja) for a conversation "
                                 "prompt; give plain-text prompts instead")
            try:
                self._template = compile_template(source)
            except Exception as e:  # jinja2's TemplateSyntaxError, with the line
                raise ValueError(f"{where}: the chat template does not compile ({e})") from None
        # special_tokens_map.json is transformers 4's older home for the same names
        legacy = json.loads(self.files.get("special_tokens_map.json", "{}"))
        specials = {k: token_text(self.config.get(k) or legacy.get(k)) for k in SPECIAL_TOKENS
                    if (self.config.get(k) or legacy.get(k)) is not None}
        # transformers drops the keys of a message whose value is None
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            # the variables after the special tokens, as transformers passes them: they win
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=True,
                                         **{**specials, **(variables or {})})
        except Exception as e:  # a checkpoint's template is code: any failure is one line
            raise ValueError(f"the chat template refused the conversation: {e}") from None

    def tool_turn(self, messages: list[dict], result: str | list[dict], end: str = "",
                  tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """The text the chat template writes after an assistant message's content when tool
        messages follow it (`result`: their list, or one's content), through the next assistant
        turn's generation prompt. `end`: the text of the token that ended the model's call (already
        in the row, e.g. "<|im_end|>"), dropped from the front when the template writes it there.
        tools, variables: the prompt's (render)."""
        results = [{"role": "tool", "content": result}] if isinstance(result, str) else result
        turn = [{"role": "assistant", "content": TOOL_TURN_MARK}, *results]
        text = self.render(messages + turn, tools, variables)
        if text.count(TOOL_TURN_MARK) != 1:
            raise ValueError("the chat template does not write an assistant message's content once "
                             "and verbatim, so the tool turn cannot be cut out of its rendering")
        return text.split(TOOL_TURN_MARK)[1].removeprefix(end)

    # -------------------------------------------------------------------------
    # Prompts to ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception:  # the tokenizers library raises plain Exceptions (e.g. no [UNK] token)
            unknown = [c for c in text if self.tok.token_to_id(c) is None]
            what = f"the character {unknown[0]!r}" if unknown else "a character"
            raise ValueError(f"prompt {text!r} has {what} that the tokenizer cannot "
                             "encode") from None

    def encode(self, prompt: str | list[dict], cfg: PromptConfig,
               tools: list[dict] | None = None) -> list[int]:
        """One prompt's ids: plain text through the post-processor, a conversation through the
        chat template (with the tools' schemas). --system_prompt, or tools, make a string the
        user's message of a conversation."""
        if isinstance(prompt, str):
            if cfg.prompt_template:
                prompt = cfg.prompt_template.replace("{prompt}", prompt)
            if not cfg.system_prompt and tools is None:
                return self.encode_text(prompt)
            prompt = [{"role": "user", "content": prompt}]
        check_conversation(prompt)
        if cfg.system_prompt and prompt[0].get("role") != "system":
            prompt = [{"role": "system", "content": cfg.system_prompt}, *prompt]
        return self.encode_text(self.render(prompt, tools, cfg.template_variables()),
                                add_special_tokens=False)

    def encode_observation(self, messages: list[dict], result: str | list[dict], end: str = "",
                           tools: list[dict] | None = None,
                           variables: dict | None = None) -> list[int]:
        """tool_turn's text as ids, encoded without special tokens added (the template writes
        them)."""
        # NOTE encoded apart from the row: exact when the turn starts at a token boundary (a special
        # token, as published templates write; the reference tests check ChatML and Llama 3.1)
        return self.encode_text(self.tool_turn(messages, result, end, tools, variables),
                                add_special_tokens=False)

    def encode_prompts(self, prompts: list, cfg: PromptConfig, max_len: int,
                       tools: list[dict] | None = None) -> tuple[list[list[int]], int]:
        """Each prompt's ids, left-truncated to max_len; and how many were truncated."""
        ids = [self.encode(prompt, cfg, tools) for prompt in prompts]
        truncated = sum(len(x) > max_len for x in ids)
        return [x[-max_len:] for x in ids], truncated  # keep the end: the question sits there

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_completions(self, completions: list[list[int]], stopped: list[bool]) -> list[str]:
        """What a reward function sees: every token the model wrote, special ones included (a
        <pad> inside an answer is the policy's doing), except the stop token that ended the row;
        a thinking model's `<think>...</think>` is part of it, as in TRL. An id beyond the
        tokenizer's (a padded embedding) decodes to ""."""
        return [self.decode(ids[:-1] if stop else ids) for ids, stop in zip(completions, stopped)]

    def save_pretrained(self, path: str) -> None:
        """tokenizer.json and the source's side files, verbatim, into a checkpoint directory."""
        self.tok.save(os.path.join(path, "tokenizer.json"))
        for name, text in self.files.items():
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                f.write(text)


def check_conversation(messages) -> None:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    if not ok:
        raise ValueError(f"prompt {str(messages)[:80]!r} is neither a string nor a conversation "
                         "(a non-empty list of {'role', 'content'} messages)")
