"""
The runtime every tool goes through, whichever kind it is (a call-token tool, tools/call_token.py;
function tools in TRL's shape, tools/functions.py): calling it with a timeout, telling the model's
mistakes from the tool's failures, writing its observations into the rows, and the Completion the
rewards read.

A run's tools are one TaskTools (built once by tools.setup), and each rollout gets a Responder from
it (TaskTools.start): engine/episodes.py calls the Responder with the rows that wrote a call, and it
answers each with its observation's ids, or None (the episode ends there). Both kinds of tool
answer through one interface (ToolKind): start a rollout (each row's environment), respond to a
call, read a turn of the model as a message, the schemas the chat template announces.

The observation goes into the row as the prompt's format writes it:
- a plain-text prompt: the text itself, encoded without special tokens;
- a conversation: the chat template's tool message (tokenizer.tool_turn: what the checkpoint's
  template writes after the assistant's content and a tool message, through the next assistant
  turn's generation prompt), so the row reads as transformers' apply_chat_template writes it.

What the model wrote and what a tool wrote: a `Completion` is the episode's text (a str, as it
reads in the row) with its parts, (text, written by the model?) in order, so that a reward pays
for the model's own text only (`completion.model_text`, or `completion.answer`: what the model
wrote after the tool's last observation) and a tool reads the model's turn that called it
(`text.answer`). A reward that reads the whole text pays for the observations too, and GRPO finds
that: a policy that calls once more rather than write the answer itself.

Failures, as reward functions' are: a tool that raises, answers something other than a string or
None, or does not answer within --tool_timeout seconds stops the run in one line naming the task
and the input (train.py checkpoints the last finished step first). A call the MODEL got wrong (a
malformed expression) is not a failure: the tool raises ToolError(message) and the row gets
"error: message" as its observation, counted in the step's tool_errors. A call counts (calls,
tool_errors, the turns) only once its whole observation entered the row: one that does not fit
in the completion budget is rolled back (engine/episodes.py, as TRL's tool loop): the row ends at
its call, uncounted. A fresh model's tokenizer holds the task's alphabet alone: an error message's
characters outside it are dropped from the row, and the run says which once
(TaskTools.dropped_note); a tool's own observation that the tokenizer cannot write stops the run.

Under tensor parallelism the tp ranks hold the same rows: the first rank calls the tool and
broadcasts its observations (on_first_rank), and every rank writes them into its rows.
Leaves out: tools running on a GPU.
Tested by tests/test_episodes.py and tests/test_functions.py.
"""

import asyncio
import inspect
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from engine.episodes import Episodes


@dataclass
class ToolConfig:
    use_tools: bool = True      # false: the task's tools are never called (a call is text)
    max_turns: int = 4          # tool calls per row; a call beyond them ends the row
    tool_timeout: float = 10.0  # seconds one call may take before the run stops

    def __post_init__(self):
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {self.max_turns!r}")
        if not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout must be > 0 seconds, got {self.tool_timeout!r}")

# -----------------------------------------------------------------------------
# What a reward and a tool read, and what a tool answers


class Completion(str):
    """A completion as reward functions and tools see it: its text (a str: every token of the row,
    the observations included, the stop token left out) and `parts`, the same text cut where the
    writer changes: (text, True) for what the model sampled, (text, False) for an observation.
    A completion with no tool turn is one part. The parts are decoded one by one: they join to
    the text unless a character's bytes straddle a boundary (a byte-level tokenizer). `stopped`:
    the model ended it with a stop token (False: the budget, or a call past --max_turns).
    `messages`: the episode as TRL's completion (Responder.completions; the model's turns as
    assistant messages, each observation as its tool messages), and `environment`: the row's
    environment instance (tools/functions.py) or None."""
    parts: tuple[tuple[str, bool], ...]
    stopped: bool
    messages: list[dict]
    environment: object

    def __new__(cls, text: str, parts=None, stopped: bool = True, messages=None,
                environment=None):
        self = super().__new__(cls, text)
        self.parts = ((str(text), True),) if parts is None else tuple(parts)
        self.stopped = stopped
        self.messages = [{"role": "assistant", "content": str(text)}] if messages is None \
            else messages
        self.environment = environment
        return self

    @property
    def model_text(self) -> str:
        """Everything the model wrote, the observations left out."""
        return "".join(text for text, own in self.parts if own)

    @property
    def answer(self) -> str:
        """What the model wrote after the tool's last observation (all of it when no tool
        answered): for a reward, the model's final answer; for a tool, the turn that called it."""
        last = max((i for i, (_, own) in enumerate(self.parts) if not own), default=-1)
        return "".join(text for text, own in self.parts[last + 1:])

    @property
    def observations(self) -> list[str]:
        """The tool's observations, in order."""
        return [text for text, own in self.parts if not own]


def split_parts(decode: Callable[[list[int]], str], ids: list[int], own: list[bool]
                ) -> list[tuple[str, bool]]:
    """ids cut into runs of one writer (own: True where the model sampled the token), each run
    decoded: Completion.parts."""
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or own[i] != own[start]:
            parts.append((decode(ids[start:i]), own[start]))
            start = i
    return parts


class ToolError(Exception):
    """Raised by a tool for a call the model got wrong: the row is told "error: <message>"."""


class ToolFailure(ValueError):
    """The tool itself failed (raised, hung, answered a non-string): the run stops."""


@dataclass
class Observation:
    """A turn's function calls answered (tools/functions.py): the tool messages, one per call in
    order, and how many of them tell the model its mistake. (A call-token tool's observation is
    its text.)"""
    messages: list[dict]
    errors: int

# -----------------------------------------------------------------------------
# Calling a tool: on one event loop for async tools, within a timeout, on the first tp rank


LOOP: list = []  # the event loop async tools and rewards run on, started on first use
LOOP_LOCK = threading.Lock()


def run_async(awaitable):
    """An async tool's, reward's or get_reward's result, awaited on one event loop that a daemon
    thread keeps for the whole run (TRL's way: what a tool keeps across calls, a client session,
    stays on one loop), from whichever thread asks."""
    with LOOP_LOCK:
        if not LOOP:
            LOOP.append(asyncio.new_event_loop())
            threading.Thread(target=LOOP[0].run_forever, daemon=True).start()

    async def wait():
        return await awaitable
    return asyncio.run_coroutine_threadsafe(wait(), LOOP[0]).result()


def call_tools(task, fn: Callable, calls: list[tuple], timeout: float, name: str = ""
               ) -> list[tuple[str | Observation | None, int]]:
    """fn(*call) for each call, in order, each within `timeout` seconds (a call's first two
    arguments are the text and the reference its failures name; `name` the tool's, fn's own by
    default): (observation or None, the model's mistakes in it) each. One daemon thread runs them
    all (a thread per call cost 0.8 ms on the CPU, more than the calls), and one that hangs cannot
    hold the process at exit."""
    results: queue.Queue = queue.Queue()

    def run():
        for call in calls:
            try:
                value = fn(*call)  # an async tool's coroutine is awaited
                results.put(("ok", run_async(value) if inspect.isawaitable(value) else value))
            except ToolError as e:
                results.put(("model", f"error: {e}"))
            except Exception as e:  # the tool's own failure: reported with its input
                results.put(("raised", e))
                return
    threading.Thread(target=run, daemon=True).start()
    where = f"task {task.name}: tool {name or getattr(fn, '__name__', repr(fn))}"
    observations = []
    for text, reference, *_ in calls:
        try:
            kind, value = results.get(timeout=timeout)
        except queue.Empty:
            raise ToolFailure(f"{where} did not answer within --tool_timeout {timeout:g} s on "
                              f"text {text!r} (reference {reference!r}); make it faster or raise "
                              "the timeout") from None
        if kind == "raised" and isinstance(value, ToolFailure):  # said in full where it happened
            raise value
        if kind == "raised":
            raise ToolFailure(f"{where} raised {type(value).__name__}: {value} on text {text!r} "
                              f"(reference {reference!r}); a call the model got wrong should "
                              "raise tools.ToolError")
        if value is not None and not isinstance(value, (str, Observation)):
            raise ToolFailure(f"{where} returned {type(value).__name__} {str(value)[:60]!r} on "
                              f"text {text!r}; a tool returns the observation's text, or None to "
                              "end the episode")
        if isinstance(value, Observation):
            observations.append((value, value.errors))
        else:
            observations.append((value, int(kind == "model")))
    return observations


def on_first_rank(fn: Callable, ranks, failure: type[Exception], *args):
    """fn(*args) on the tp group's first rank alone (ranks: tp.ParallelGroups), its result
    broadcast to the others: the tp ranks hold the same rows, so they must get one observation (a
    task's tool need not be deterministic). A `failure` it raises is raised on every rank, its
    message on the first alone (said once)."""
    result = [None]
    if ranks.tp_rank == 0:
        try:
            result = [(True, fn(*args))]
        except failure as e:
            result = [(False, str(e))]
    first = dist.get_global_rank(ranks.tp_group, 0)
    dist.broadcast_object_list(result, src=first, group=ranks.tp_group)  # TP: the first's result
    done, value = result[0]
    if not done:
        raise failure(value if ranks.tp_rank == 0 else "")
    return value

# -----------------------------------------------------------------------------
# The two kinds of tool behind one interface, and a rollout's rows' tools


class ToolKind:
    """What the runtime asks of a kind of tool (tools/call_token.py's CallTool, tools/functions.py's
    Toolbox): its name in a failure's line, the schemas the chat template announces (None: none),
    whether a turn of the model is read with its end token (function tools parse it), and the
    three methods below."""
    name: str = "tool"
    schemas: list[dict] | None = None
    reads_end: bool = False

    def start(self, examples: list[tuple], G: int) -> "RolloutTools":
        """One rollout's tools: the examples as the prompts read them, each row's environment."""
        return RolloutTools(self, list(examples), [None] * (len(examples) * G))

    def respond(self, text: Completion, reference, environment) -> "str | Observation | None":
        """The observation for the row's call (its episode so far, `text`), or None: the episode
        ends."""
        raise NotImplementedError

    def assistant(self, text: str) -> dict:
        """A turn of the model as TRL's completion message."""
        return {"role": "assistant", "content": text}


@dataclass
class RolloutTools:
    """One rollout's tools: the kind, the examples as its start left them (an environment's reset
    may add to a prompt), and each row's environment (None for a call-token tool)."""
    kind: ToolKind
    examples: list[tuple]
    environments: list

    def respond(self, text: Completion, reference, row: int) -> "str | Observation | None":
        return self.kind.respond(text, reference, self.environments[row])


@dataclass
class TaskTools:
    """A task's tools as this run calls them (tools.setup builds it): the kind, the ids that end
    a call (() with --use_tools false: nothing is called, but a rollout still gets its
    environments and the rewards their messages), the tokenizer and prompt format observations are
    written in, and the process groups (`ranks`) whose first tp rank calls the tool."""
    task: object
    kind: ToolKind
    tokenizer: object
    call_ids: tuple[int, ...]
    cfg: ToolConfig
    prompt_cfg: object = None  # engine/tokenizer.PromptConfig: --system_prompt, template variables
    ranks: object = None       # tp.ParallelGroups; None: one process
    dropped: set[str] = field(default_factory=set)  # error characters the tokenizer cannot write
    said: set[str] = field(default_factory=set)     # those the run has said

    @property
    def schemas(self) -> list[dict] | None:
        return self.kind.schemas

    def start(self, examples: list[tuple], G: int) -> "Responder":
        """The tools of one rollout of `examples`, G rows each (environments reset)."""
        return Responder(self, examples, G)

    def dropped_note(self) -> str:
        """A line naming the error characters dropped from rows since the last note, or ""."""
        if not self.dropped - self.said:
            return ""
        self.said |= self.dropped
        return (f"note: task {self.task.name}: tool error messages hold characters the "
                f"tokenizer cannot write, dropped from the rows: {''.join(sorted(self.said))!r}; "
                "add them to the task's alphabet to keep them")

# -----------------------------------------------------------------------------
# Observations into the rows


class Responder:
    """Episodes.respond for one rollout: each waiting row's episode so far (a Completion) to its
    tool's observation ids. Keeps where each row's observations went, what they said and how many
    mistakes they told; holds the rollout's tools (RolloutTools): each row's environment, and the
    examples as its start left their prompts."""

    def __init__(self, tools: TaskTools, examples: list[tuple], G: int):
        self.tools, self.kind, self.tokenizer, self.G = tools, tools.kind, tools.tokenizer, G
        self.rollout_tools = self.kind.start(examples, G)
        self.examples = self.rollout_tools.examples
        prompt_cfg = tools.prompt_cfg
        self.system_prompt = prompt_cfg.system_prompt if prompt_cfg else ""  # a conversation
        self.variables = prompt_cfg.template_variables() if prompt_cfg else {}  # the prompt's
        # row -> (start, end, mistakes told, the observation's messages), one per answered turn
        self.observed: dict[int, list[tuple[int, int, int, list[dict]]]] = {}

    @property
    def episodes(self) -> Episodes | None:
        """What rollout.generate needs to run the rows as episodes; None: no tool is called."""
        if not self.tools.call_ids:
            return None
        return Episodes(self, self.tools.call_ids, self.tools.cfg.max_turns)

    def __call__(self, calls: list[tuple[int, list[int]]]) -> list[list[int] | None]:
        ranks = self.tools.ranks
        if ranks is not None and ranks.tp_size > 1:  # the first tp rank calls the tool
            return self.write(calls, on_first_rank(self.observations, ranks, ToolFailure, calls))
        return self.write(calls, self.observations(calls))

    def observations(self, calls: list[tuple[int, list[int]]]) -> list[tuple]:
        """The tool's observations for the waiting rows, (observation, mistakes) each."""
        texts = [self.completion(row, tokens) for row, tokens in calls]
        references = [self.examples[row // self.G][1] for row, _ in calls]
        return call_tools(self.tools.task, self.rollout_tools.respond,
                          [(t, ref, row) for t, ref, (row, _) in zip(texts, references, calls)],
                          self.tools.cfg.tool_timeout, self.kind.name)

    def write(self, calls: list[tuple[int, list[int]]], observations: list[tuple]
              ) -> list[list[int] | None]:
        """Each observation as the row's ids (None: the episode ends), recorded."""
        rows = []
        for (observation, errors), (row, tokens) in zip(observations, calls):
            prompt = self.examples[row // self.G][0]
            ids = None
            if observation is not None:
                messages = observation.messages if isinstance(observation, Observation) \
                    else [{"role": "tool", "content": observation}]
                ids = self.encode(prompt, messages, tokens, errors)
                # the row's tokens from len(tokens) on are the tool's
                self.observed.setdefault(row, []).append((len(tokens), len(tokens) + len(ids),
                                                          errors, messages))
            rows.append(ids)
        return rows

    def completion(self, row: int, tokens: list[int]) -> Completion:
        """The row's episode so far: its earlier observations are the tool's parts."""
        own = [True] * len(tokens)
        for start, end, _, _ in self.observed.get(row, []):
            own[start:end] = [False] * (end - start)
        decode = self.tokenizer.decode
        return Completion(decode(tokens), split_parts(decode, tokens, own), stopped=False)

    def errors(self, calls: list[int]) -> int:
        """The mistakes told in the calls that counted, calls[row] of each row
        (engine/episodes.py): a row's first observations, since one the budget could not hold
        ends its row."""
        return sum(errors for row, observed in self.observed.items()
                   for _, _, errors, _ in observed[:calls[row]])

    def completions(self, texts: list[str], ids: list[list[int]], stopped: list[bool],
                    sampled: list[list[bool]]) -> list[Completion]:
        """What the reward functions see: each row's text (the stop token left out), its parts,
        its messages (TRL's completion) and its environment."""
        decode, rows = self.tokenizer.decode, []
        for row, (text, x, stop, own) in enumerate(zip(texts, ids, stopped, sampled)):
            kept = x[:len(x) - stop]
            rows.append(Completion(text, split_parts(decode, kept, own[:len(kept)]), stop,
                                   self.conversation(row, x if self.kind.reads_end else kept),
                                   self.rollout_tools.environments[row]))
        return rows

    def conversation(self, row: int, ids: list[int]) -> list[dict]:
        """The row as messages: the model's turns as assistant messages (for function tools as
        TRL parses them, from each turn's ids with its end token: content, reasoning_content,
        tool_calls), each observation's tool messages after the turn that called. An observation
        the budget could not hold was rolled back (engine/episodes.py): the row's last message is
        the call."""
        def assistant(tokens: list[int]) -> dict:
            return self.kind.assistant(self.tokenizer.decode(tokens))
        messages, at = [], 0
        for start, end, _, observation in self.observed.get(row, []):
            if end > len(ids):  # rolled back (the budget): the row ends at the call
                return messages + [assistant(ids[at:start])]
            messages += [assistant(ids[at:start]), *observation]
            at = end
        if at < len(ids) or not messages:  # else the row ends with a whole observation (TRL's too)
            messages.append(assistant(ids[at:]))
        return messages

    def encode(self, prompt, messages: list[dict], tokens: list[int], errors: int) -> list[int]:
        """The observation's ids as the prompt's format writes it (the module docstring): a
        plain-text prompt's the text itself, a conversation's the template's tool messages."""
        schemas = self.kind.schemas
        text = messages[0]["content"]
        try:
            if isinstance(prompt, str) and not self.system_prompt and schemas is None:
                return self.encode_text(text, errors)
            if isinstance(prompt, str):  # --system_prompt (or the tools) made it a conversation
                prompt = [{"role": "system", "content": self.system_prompt}] * bool(
                    self.system_prompt) + [{"role": "user", "content": prompt}]
            # the end token the row wrote is the template's: not written twice
            return self.tokenizer.encode_observation(prompt, messages,
                                                     self.tokenizer.decode(tokens[-1:]), schemas,
                                                     self.variables)
        except ValueError as e:
            said = self.tokenizer.decode(tokens)
            raise ToolFailure(f"task {self.tools.task.name}: the tool's observation {text!r} to "
                              f"text {said!r} cannot go into the row: {e} (a fresh model's "
                              "tokenizer holds the task's alphabet only)") from None

    def encode_text(self, text: str, errors: int) -> list[int]:
        """A plain-text observation's ids. An error message (the model's mistake, free text) keeps
        the characters the tokenizer can write and drops the others (TaskTools.dropped: the run
        says which); the tool's own observation must be written whole."""
        try:
            return self.tokenizer.encode_text(text, add_special_tokens=False)
        except ValueError:
            if not errors:
                raise
        ids = []
        for char in text:
            try:
                ids += self.tokenizer.encode_text(char, add_special_tokens=False)
            except ValueError:
                self.tools.dropped.add(char)
        return ids
