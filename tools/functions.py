"""
Function tools as a chat checkpoint calls them, in TRL's shape (GRPOTrainer's `tools=` and
`environment_factory`): Python functions announced by the chat template, the model's native calls
parsed and dispatched, and environments that keep a row's state.

1. Schemas. A function with type hints and a Google-style docstring becomes the JSON schema that
   transformers' get_json_schema builds (name, description, parameters: types, descriptions,
   `(choices: [...])` enums, required), which the checkpoint's chat template renders as
   `apply_chat_template(messages, tools=schemas)` does (engine/tokenizer.py): Qwen's `# Tools`
   system block, Llama 3.1's JSON in the first user message. A template that renders no tools (SmolLM2's)
   leaves the announcing to the task's own prompt, and the first step says so.
2. Calls. The model's turn ends (its stop token), and it is parsed as TRL parses it with tools
   (transformers' parse_response with TRL's response template for the family, given the prompt
   and the tools): "hermes" (Qwen, Hermes: `<tool_call>{"name": ...,
   "arguments": {...}}</tool_call>`, several in a turn; a Qwen3 `<think>...</think>` becomes
   reasoning_content) or "llama3_json" (Llama 3.1: one JSON object with "name" and "parameters"
   ending the turn), chosen from the template's text unless the task names it. String arguments
   are typed by the tool's schema ("5" -> 5 for an integer). A turn whose call does not parse
   (malformed or unclosed JSON, no name) is plain text, as in TRL: no call. Each call is
   dispatched by name; the answers are the template's tool messages, one per call, plain
   functions' first and then the async ones' (TRL gathers those): the call's observation, which
   tools/runtime.py's Responder writes into the row. A turn with no call ends the episode.
3. Mistakes and failures. An unknown tool, missing, unexpected or ill-typed arguments (checked
   against the schema) and a tool's own tools.ToolError are the model's mistakes: its tool
   message says "error: ...", and the step line counts them. A tool that raises anything else
   is a bug in the tool: the run stops in one line (TRL tells the model any exception; a broken
   tool would then be trained on in silence); the checks keep the model's mistakes from raising.
4. Environments. `environment_factory()` makes the environments of a pool (TRL's: made once,
   reset before every episode); their public methods (not reset, not get_reward, no leading "_")
   are that row's tools beside the task's functions. `reset(**columns)` gets the example's
   columns (tasks.Example), prompt and reference (the keywords it accepts), and a string it
   returns is appended to the last message of the prompt (TRL's rule). The G rows of a group
   share one prompt (prefilled once), so their resets must return the same text. A
   `get_reward()` method (awaited when async) is a reward function of weight 1 (named after the
   class) that scores each row from its own instance's state after the episode.
5. What a reward sees: runtime.Completion, and its `messages` (TRL's completion): the assistant
   turns (content, reasoning_content, and tool_calls in TRL's {"type": "function", "function":
   {...}} shape), the tool messages ({"role": "tool", "name", "content"}), and `environment`,
   the row's instance. A reward in TRL's form gets these as TRL passes them (tasks.py).

Leaves out: several environments in one task, tools under tensor parallelism with an environment
(its state lives on one rank: refused), multimodal tool answers.
Tested by tests/test_functions.py.
"""

import asyncio
import enum
import inspect
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from tools.runtime import (Observation, RolloutTools, ToolError, ToolFailure, ToolKind,
                           run_async)

FORMATS = ("hermes", "llama3_json")

# -----------------------------------------------------------------------------
# Schemas: a function's type hints and docstring, as transformers' get_json_schema builds them

SIMPLE_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
                type(None): "null", list: "array", tuple: "array", dict: "object"}
SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def enum_schema(values: list) -> dict:
    """{"type", "enum"}: the values' JSON types, each once, in the order they first appear."""
    if not values or any(type(v) not in SCALARS for v in values):
        raise ValueError(f"an enum's values must be int, float, str, bool or None, got {values!r}")
    kinds = list(dict.fromkeys(SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def type_schema(hint) -> dict:
    """A type hint as a JSON schema: basic types, Enum and Literal, list/tuple/dict of those, unions
    (a type list where every member is a plain type, else anyOf; None makes it nullable)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        return enum_schema([member.value for member in hint])
    if origin is None:
        if hint is Any:
            return {}
        if hint not in SIMPLE_TYPES:
            raise ValueError(f"type hint {hint!r} has no JSON schema (use int, float, str, bool, "
                             "Enum, Literal, or list, tuple, dict and unions of those)")
        return {"type": SIMPLE_TYPES[hint]}
    if origin is typing.Union or origin is types.UnionType:
        members = [type_schema(t) for t in args if t is not type(None)]
        if len(members) == 1:
            schema = members[0]
        elif all(m.keys() == {"type"} and isinstance(m["type"], str) for m in members):
            names = sorted({m["type"] for m in members})
            schema = {"type": names[0] if len(names) == 1 else names}
        else:
            schema = {"anyOf": members}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    if origin is typing.Literal:
        return enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1 or ... in args:
            raise ValueError(f"type hint {hint!r}: a tuple of one element or of any length has "
                             "no fixed JSON schema; use list[...]")
        return {"type": "array", "prefixItems": [type_schema(t) for t in args]}
    if origin is dict:
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = type_schema(args[1])
        return schema
    raise ValueError(f"type hint {hint!r} has no JSON schema")


SECTION = re.compile(r"(Args:|Returns:|Raises:|\Z)")
ARG_LINE = re.compile(r"^([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*)$")


def parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """A Google-style docstring: the description (before Args:/Returns:/Raises:), each argument's
    description (its continuation lines joined by spaces, a "(type)" after the name skipped) and
    the Returns: text."""
    description = doc[:SECTION.search(doc).start()].strip()
    args: dict[str, str] = {}
    block = re.search(r"\n\s*Args:\n(.*?)[\n\s]*(?:Returns:|Raises:|\Z)", doc, re.S)
    if block:
        lines = [line for line in block.group(1).split("\n") if line.strip()]
        indent, name = None, None
        for line in lines:
            found = ARG_LINE.match(line)
            if found and (indent is None or len(found.group(1)) <= len(indent)):
                indent, name = found.group(1), found.group(2)
                args[name] = found.group(3)
            elif name is not None:  # a continuation line of the argument above
                args[name] += "\n" + line
        args = {k: re.sub(r"\s*\n+\s*", " ", v.strip()) for k, v in args.items()}
    returns = re.search(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(?:Raises:|\Z)", doc, re.S)
    return description, args, returns.group(1).strip() if returns else None


def json_schema(fn: Callable) -> dict:
    """{"type": "function", "function": {name, description, parameters[, return]}}, key for key as
    transformers.utils.get_json_schema(fn) (tests/test_functions.py), or one ValueError."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name} has no docstring: a tool's schema is its type hints and "
                         "a Google-style docstring (a description, then Args: with one line each)")
    description, described, returns = parse_docstring(doc.strip())
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is params[0].empty:
        params = params[1:]  # a function defined in a class, not bound
    required = []
    for p in params:
        if p.name not in hints:
            raise ValueError(f"tool {name}: argument {p.name!r} has no type hint")
        if p.default is p.empty:
            required.append(p.name)
    properties, returned = {}, None
    for arg, hint in hints.items():
        if arg == "return":
            try:  # the model never writes the return value: a hint with no schema is left out
                returned = type_schema(hint)
            except ValueError:
                pass
            continue
        if arg not in {p.name for p in params}:
            continue
        try:
            properties[arg] = type_schema(hint)
        except ValueError as e:
            raise ValueError(f"tool {name}: argument {arg!r}: {e}") from None
        if arg not in described:
            raise ValueError(f"tool {name}: the docstring's Args: does not describe {arg!r}")
        text = described[arg]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.I)
        if choices:
            values = json.loads(choices.group(1))
            properties[arg]["enum"] = [c.strip() if isinstance(c, str) else c for c in values]
            text = text[:choices.start()].strip()
        properties[arg]["description"] = text
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function = {"name": name, "description": description, "parameters": parameters}
    if returned is not None:
        if returns is not None:
            returned["description"] = returns
        function["return"] = returned
    return {"type": "function", "function": function}

# -----------------------------------------------------------------------------
# Calls: the model's turn parsed in its family's format


def call_format(named: str, template: str | None) -> str:
    """The task's format if it names one, else the one the chat template writes: hermes where it
    shows <tool_call>, llama3_json where it asks for "parameters" (Llama 3.1). "" when neither."""
    if named:
        if named not in FORMATS:
            raise ValueError(f"tool_format {named!r} is not one of {', '.join(FORMATS)}")
        return named
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template or "'parameters'" in template:
        return "llama3_json"
    return ""


@dataclass(frozen=True)
class Grammar:
    """An assistant turn's regions as TRL's response template for the family writes them (its
    qwen3_template, llama3_template): each region opens and closes with a pattern; text outside
    them is the content, which the end-of-turn token closes."""
    anchor: str          # the assistant header (the turn opens after the prompt's last one)
    opens: tuple         # (pattern that opens a region, its field)
    closes: dict         # field -> the pattern that closes it
    end: str             # the end-of-turn token: closes the content (TRL also cuts it from its end)


GRAMMARS = {
    "hermes": Grammar("<|im_start|>assistant\n",
                      ((re.compile(re.escape("<think>")), "reasoning_content"),
                       (re.compile(re.escape("<tool_call>")), "tool_calls")),
                      {"reasoning_content": re.compile(r"</think>\s*"),
                       "tool_calls": re.compile(r"</tool_call>\s*"),
                       "content": re.compile(r"<\|im_end\|>\s*")}, "<|im_end|>"),
    "llama3_json": Grammar("<|start_header_id|>assistant<|end_header_id|>\n\n",
                           ((re.compile(r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*'),
                             "tool_calls"),),
                           {"tool_calls": re.compile(r"\}<\|eot_id\|>\s*"),
                            "content": re.compile(r"<\|eot_id\|>\s*")}, "<|eot_id|>"),
}


def regions(text: str, grammar: Grammar) -> list[tuple[str, str, dict]]:
    """The turn's regions in order, (field, body, the open pattern's named groups) each, as
    transformers' ResponseParser cuts a whole response: in the content, the earliest open or
    content close wins (the longer on a tie, an open before a close); inside a region only its
    close counts; a region the text ends inside runs to the end."""
    found, pos, field, body, groups, opened = [], 0, "content", "", {}, False
    while True:
        if field != "content":
            m = grammar.closes[field].search(text, pos)
            body += text[pos:m.start() if m else len(text)]
            found.append((field, body, groups))
            if m is None:
                return found
            pos, field, body, groups = m.end(), "content", "", {}
            continue
        marks = [(m.start(), m.start() - m.end(), 0, name, m) for pattern, name in grammar.opens
                 if (m := pattern.search(text, pos))]
        if (m := grammar.closes["content"].search(text, pos)):
            marks.append((m.start(), m.start() - m.end(), 1, "content", m))
        start = min(marks, key=lambda x: x[:4])[0] if marks else len(text)
        if start > pos:
            body, opened = body + text[pos:start], True
        if opened:
            found.append(("content", body, {}))
        if not marks:
            return found
        _, _, kind, name, m = min(marks, key=lambda x: x[:4])
        pos, body, opened = m.end(), "", False
        if kind == 0:
            field, groups = name, m.groupdict()


def schema_types(schema: dict) -> list[str]:
    """The JSON types a schema allows (its type or types, its anyOf's; nullable adds "null")."""
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    for member in schema.get("anyOf", []):
        kinds += schema_types(member)
    return kinds + ["null"] * (bool(schema.get("nullable")) and "null" not in kinds)


def typed(raw: str, kinds: list[str]):
    """A string argument as the first of its schema's types it reads as ("5" -> 5 for an
    integer, "3.0" -> 3, "true"/"1" -> True, "null" -> None, JSON text for an array or object),
    else the string itself: transformers' casting in parse_response(..., tools=...)."""
    for kind in kinds:
        try:
            if kind == "integer":
                try:
                    return int(raw)
                except ValueError:
                    number = float(raw)
                    if number.is_integer():
                        return int(number)
            elif kind == "number":
                number = float(raw)
                if math.isfinite(number):
                    return int(number) if number.is_integer() and "." not in raw else number
            elif kind == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif kind == "null" and raw.strip() in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                value = json.loads(raw)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:
            continue
    return raw


def type_arguments(function: dict, schemas: dict[str, dict]) -> None:
    """The call's string arguments typed by its tool's schema, in place (`typed`)."""
    schema, arguments = schemas.get(function.get("name")), function.get("arguments")
    if schema is None or not isinstance(arguments, dict):
        return
    properties = schema["function"]["parameters"]["properties"]
    for key, value in arguments.items():
        kinds = schema_types(properties[key]) if key in properties else []
        if kinds and isinstance(value, str):
            arguments[key] = typed(value, kinds)
        elif kinds and isinstance(value, list) and "array" not in kinds:
            arguments[key] = [typed(v, kinds) if isinstance(v, str) else v for v in value]


def parse_turn(text: str, fmt: str, schemas: list[dict] = (), opening: str = "",
               ends: list[str] = ()) -> dict:
    """The model's turn (its end token included, as decoded) as the assistant message TRL's
    parse_response(tokenizer, ids, prefix=..., tools=...) makes of it: `reasoning_content` (a
    Qwen3 thought), `tool_calls` ({"type": "function", "function": {"name", "arguments"}}, the
    arguments typed by the schemas) and `content`. `opening`: what the generation prompt wrote
    after the assistant header (Qwen3 without thinking: an empty thought). A turn that does not
    parse (a call's JSON malformed, or unclosed: its body runs into the end token; a call with no
    name) is plain text, as in TRL: its content, the end tokens (`ends`) cut, and no call."""
    grammar = GRAMMARS[fmt]
    by_name = {s["function"]["name"]: s for s in schemas}
    message: dict = {"role": "assistant"}
    try:
        for field, body, groups in regions(opening + text, grammar):
            if field != "tool_calls":
                message[field] = body.strip()
                continue
            function = json.loads(body)
            if fmt == "llama3_json":  # the arguments are the body, the name the opening's
                function = {"name": groups["name"], "arguments": function}
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("a call is a JSON object with a name")
            if function.get("arguments") is None:
                function["arguments"] = {}
            type_arguments(function, by_name)
            message.setdefault("tool_calls", []).append({"type": "function",
                                                         "function": function})
    except ValueError:  # json's JSONDecodeError included
        for end in ends:
            text = text.replace(end, "") if end else text
        return {"role": "assistant", "content": text}
    message = {k: v for k, v in message.items() if v not in ("", [], None)}
    message["content"] = message.get("content", "").removesuffix(grammar.end)
    return message

# -----------------------------------------------------------------------------
# Arguments checked against the schema, as the model's mistakes


def type_error(value, schema: dict) -> str | None:
    """Why value does not fit schema (JSON's types: an integer is not a bool, a number is an
    integer or a float), or None."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        fits = any(type_error(value, s) is None for s in schema["anyOf"])
        return None if fits else f"{json.dumps(value)} fits none of its types"
    if "enum" in schema and value not in schema["enum"]:
        return f"{json.dumps(value)} is not one of {json.dumps(schema['enum'])}"
    kinds = schema.get("type")
    if kinds is None:
        return None
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "null": lambda v: v is None, "array": lambda v: isinstance(v, list),
              "object": lambda v: isinstance(v, dict)}
    names = [kinds] if isinstance(kinds, str) else kinds
    if not any(checks.get(k, lambda v: True)(value) for k in names):
        return f"{json.dumps(value)[:40]} is not {' or '.join(names)}"
    if isinstance(value, list) and "items" in schema:
        return next(filter(None, (type_error(v, schema["items"]) for v in value)), None)
    if isinstance(value, list) and "prefixItems" in schema:
        if len(value) != len(schema["prefixItems"]):
            return f"{json.dumps(value)[:40]} does not hold {len(schema['prefixItems'])} items"
        return next(filter(None, map(type_error, value, schema["prefixItems"])), None)
    if isinstance(value, dict) and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        return next(filter(None, (type_error(v, extra) for v in value.values())), None)
    return None


def check_arguments(schema: dict, arguments: dict) -> None:
    """A ToolError naming the first missing, unexpected or ill-typed argument."""
    function = schema["function"]
    properties = function["parameters"]["properties"]
    name = function["name"]
    for arg in function["parameters"].get("required", []):
        if arg not in arguments:
            raise ToolError(f"{name} is missing its argument {arg!r}")
    for arg, value in arguments.items():
        if arg not in properties:
            raise ToolError(f"{name} has no argument {arg!r} (its arguments: "
                            f"{', '.join(properties) or 'none'})")
        why = type_error(value, properties[arg])
        if why:
            raise ToolError(f"{name}'s argument {arg!r}: {why}")

# -----------------------------------------------------------------------------
# The task's tools: functions and an environment, checked once, answering each row's calls


def environment_methods(instance) -> list[Callable]:
    """An environment's tools: its class's public functions, bound to the instance, but reset and
    get_reward (listed on the class: a property is never evaluated)."""
    return [getattr(instance, name)
            for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


def reset_keywords(reset: Callable, **fields) -> dict:
    """The fields a reset() accepts by name (all of them where it takes **kwargs)."""
    params = inspect.signature(reset).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fields
    return {k: v for k, v in fields.items() if k in {p.name for p in params}}


class Toolbox(ToolKind):
    """A task's function tools and environment factory, checked at setup: their schemas, the call
    format, the environment's get_reward as a reward function. `ends`: the texts of the tokens
    that end a turn (the stop ids); `opening`: what the chat template's generation prompt writes
    after the assistant header (build() reads it), where the parse of a turn starts. The
    environments are a pool, as TRL keeps one: made once (the probe is the first), reset before
    each episode, more made only when a rollout has more rows than the pool (`made` counts). A
    kind of tool (runtime.ToolKind): it reads a turn with its end token (parse_turn)."""
    reads_end = True

    def __init__(self, task, template: str | None, ends: list[str]):
        self.task_name, self.factory, self.ends = task.name, task.environment_factory, ends
        self.opening, self.pool, self.made = "", [], 0
        methods, self.reward = [], None
        if self.factory is not None:
            probe = self.make()
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"task {task.name}: environment "
                                 f"{type(probe).__name__} has no reset() method")
            methods = environment_methods(probe)
            if callable(getattr(probe, "get_reward", None)):
                self.reward = environment_reward(type(probe).__name__)
        self.functions = list(task.tools)
        try:
            self.schemas = [json_schema(fn) for fn in self.functions + methods]
        except ValueError as e:
            raise ValueError(f"task {task.name}: {e}") from None
        names = [s["function"]["name"] for s in self.schemas]
        if len(set(names)) < len(names):
            raise ValueError(f"task {task.name}: two tools share a name ({', '.join(names)})")
        if not names:
            raise ValueError(f"task {task.name}: its environment has no public method to call")
        self.format = call_format(task.tool_format, template)
        if not self.format:
            raise ValueError(f"task {task.name}: the chat template shows no tool-call format; "
                             f"name it: tasks.Task(..., tool_format=\"hermes\" or "
                             "\"llama3_json\")")

    @property
    def name(self) -> str:  # for a failure's line
        return ", ".join(s["function"]["name"] for s in self.schemas)

    def make(self):
        """A new environment, into the pool."""
        self.pool.append(self.factory())
        self.made += 1
        return self.pool[-1]

    def start(self, examples: list[tuple], G: int) -> RolloutTools:
        """One rollout's tools: an environment per row (prompt-major, G rows a prompt) from the
        pool, reset, its text appended to the prompt's last message. reset gets the example's
        columns (tasks.Example: a dataset row's), prompt and reference."""
        rows = len(examples) * G if self.factory else 0
        while len(self.pool) < rows:
            self.make()
        environments = self.pool[:rows] if self.factory else [None] * (len(examples) * G)
        prompted = []
        for i, example in enumerate(examples):
            prompt, reference = example
            fields = {**getattr(example, "columns", {}), "prompt": prompt, "reference": reference}
            texts = [self.reset(env, fields) for env in environments[i * G:(i + 1) * G]]
            if len(set(texts)) > 1:
                raise ToolFailure(f"task {self.task_name}: reset() returned different texts for "
                                  f"the {G} rows of one prompt ({texts[0]!r}, {texts[1]!r}, "
                                  "...); the rows of a group share their prompt: make reset's "
                                  "text a function of its prompt and reference")
            if texts[0]:
                if isinstance(prompt, str):
                    prompt = prompt + texts[0]
                else:
                    prompt = [*prompt[:-1], {**prompt[-1],
                                             "content": prompt[-1]["content"] + texts[0]}]
            prompted.append(example.with_prompt(prompt) if hasattr(example, "with_prompt")
                            else (prompt, reference))
        return RolloutTools(self, prompted, environments)

    def reset(self, environment, fields: dict) -> str:
        if environment is None:
            return ""
        name = type(environment).__name__
        try:
            text = environment.reset(**reset_keywords(environment.reset, **fields))
        except Exception as e:
            raise ToolFailure(f"task {self.task_name}: environment {name}.reset raised "
                              f"{type(e).__name__}: {e} (reference "
                              f"{fields['reference']!r})") from None
        if text is not None and not isinstance(text, str):
            raise ToolFailure(f"task {self.task_name}: environment {name}.reset returned "
                              f"{type(text).__name__}; it returns a string to append to the "
                              "prompt, or None")
        return text or ""

    def assistant(self, text: str) -> dict:
        """A turn of the model (its end token included) as TRL's completion message
        (parse_turn): content, reasoning_content, its calls with their arguments typed."""
        return parse_turn(text, self.format, self.schemas, self.opening, self.ends)

    def respond(self, text, reference, environment) -> Observation | None:
        """The calls of the row's turn (text.answer: what the model wrote since the last tool
        message) answered, the row's environment's methods among the tools, or None: the turn
        holds no call, the episode ends. The order is TRL's: the answers of plain functions (and
        the mistakes) in the calls' order, then the async functions' (awaited together)."""
        calls = self.assistant(text.answer).get("tool_calls")
        if not calls:
            return None
        tools = {fn.__name__: fn for fn in self.functions}
        if environment is not None:
            tools.update({fn.__name__: fn for fn in environment_methods(environment)})
        schemas = {s["function"]["name"]: s for s in self.schemas}
        answered, waiting = [], []
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            try:
                if name not in tools:
                    raise ToolError(f"there is no tool {name!r} (the tools: "
                                    f"{', '.join(tools)})")
                if not isinstance(arguments, dict):
                    raise ToolError(f"{name}'s arguments must be a JSON object, got "
                                    f"{json.dumps(arguments)[:60]}")
                check_arguments(schemas[name], arguments)
                result = self.call(tools[name], arguments, reference)
            except ToolError as e:
                answered.append((name, e))
                continue
            if inspect.isawaitable(result):
                waiting.append((tools[name], arguments, result))
            else:
                answered.append((name, result))
        if waiting:
            async def gather():
                return await asyncio.gather(*(w[2] for w in waiting), return_exceptions=True)
            results = run_async(gather())
            for (fn, arguments, _), result in zip(waiting, results):
                if isinstance(result, Exception) and not isinstance(result, ToolError):
                    raise self.failure(fn, arguments, reference, result)
                answered.append((fn.__name__, result))
        messages = [{"role": "tool", "name": name,
                     "content": f"error: {result}" if isinstance(result, ToolError)
                     else result if isinstance(result, str) else str(result)}
                    for name, result in answered]
        return Observation(messages, sum(isinstance(r, ToolError) for _, r in answered))

    def call(self, fn: Callable, arguments: dict, reference):
        """fn(**arguments): its result (a coroutine for an async function, awaited by respond); a
        ToolError passes to the model, anything else stops the run."""
        try:
            return fn(**arguments)
        except ToolError:
            raise
        except Exception as e:
            raise self.failure(fn, arguments, reference, e) from None

    def failure(self, fn: Callable, arguments: dict, reference, e: Exception) -> ToolFailure:
        return ToolFailure(f"task {self.task_name}: tool {fn.__name__} raised "
                           f"{type(e).__name__}: {e} on arguments {json.dumps(arguments)} "
                           f"(reference {reference!r}); a call the model got wrong should "
                           "raise tools.ToolError")


def environment_reward(name: str) -> Callable:
    """get_reward() of the row's environment (awaited when it is async, as TRL awaits it), as a
    task's reward function named after its class."""
    def reward(completion, reference):
        value = completion.environment.get_reward()
        return run_async(value) if inspect.isawaitable(value) else value
    reward.__name__ = name
    return reward


def build(task, tokenizer, stop_ids: tuple[int, ...], tp_size: int,
          variables: dict | None = None) -> tuple[Toolbox, str]:
    """The task's function tools for a run on this tokenizer (tokenizer.PromptTokenizer), checked,
    and a note when the chat template does not render them (the task's prompt must announce them,
    as SmolLM2's must). variables: --chat_template_kwargs, for the generation prompt's opening
    (Qwen3 with enable_thinking false writes an empty thought there)."""
    template = tokenizer.template_source()
    if template is None:
        raise ValueError(f"task {task.name}: function tools need a chat checkpoint (--model DIR "
                         "whose tokenizer has a chat template)")
    if task.environment_factory is not None and tp_size > 1:
        raise ValueError(f"task {task.name}: an environment keeps its state on one rank; run it "
                         "with --tp 1")
    toolbox = Toolbox(task, template, [tokenizer.decode([i]) for i in stop_ids])
    name = toolbox.schemas[0]["function"]["name"]
    rendered = tokenizer.render([{"role": "user", "content": ""}], toolbox.schemas, variables)
    anchor = GRAMMARS[toolbox.format].anchor
    # as transformers' parser reads the prompt: from its last assistant header on
    toolbox.opening = rendered.rsplit(anchor, 1)[1] if anchor in rendered else ""
    return toolbox, "" if name in rendered else (
        f"task {task.name}: the chat template does not render tools; the task's own prompt must "
        f"announce {name} and the call format ({toolbox.format})")
