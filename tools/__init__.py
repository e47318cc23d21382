"""
A task's tool: what the model calls in the middle of its completion, and what it answers.

A `Tool` is a function `fn(text, reference) -> str | None` and the token that ends a call. When a
row samples that token, engine/episodes.py asks for an answer: `fn` gets the row's text so far (a
`Completion`: every token of the episode, earlier answers included, decoded as the rewards see
text, with the model's turns and the tool's answers told apart) and the prompt's reference (where a
task keeps what its tool knows), and returns the observation's text, or None: the episode ends
there. The observation goes into the row as the prompt's format writes it:
- a plain-text prompt: the text itself, encoded without special tokens;
- a conversation: the chat template's tool message (tokenizer.tool_turn: what the checkpoint's
  template writes after the assistant's content and a tool message, through the next assistant
  turn's generation prompt), so the row reads as transformers' apply_chat_template writes it.
A call token of "" means the end of the model's turn (the checkpoint's stop ids): the tool reads
the turn and answers a call in it, or returns None when the turn holds none (Qwen2.5's and Llama
3.1's chat formats end a tool-calling turn this way).

What the model wrote and what a tool wrote: a `Completion` is the episode's text (a str, as it
reads in the row) with its parts, (text, written by the model?) in order, so that a reward pays
for the model's own text only (`completion.model_text`, or `completion.answer`: what the model
wrote after the tool's last answer) and a tool reads the model's turn that called it
(`text.answer`). A reward that reads the whole text pays for the tool's answers too, and GRPO finds
that: a policy that calls once more rather than write the answer itself.

Failures, as reward functions' are: a tool that raises, answers something other than a string or
None, or does not answer within --tool_timeout seconds stops the run in one line naming the task
and the input (train.py checkpoints the last finished step first). A call the MODEL got wrong (a
malformed expression) is not a failure: the tool raises ToolError(message) and the row gets
"error: message" as its observation, counted in the step's tool_errors. A call counts (calls,
tool_errors, the turns) only once its whole answer entered the row: an answer that does not fit
in the completion budget is rolled back (engine/episodes.py, as TRL's tool loop): the row ends at its
call, uncounted. A fresh model's tokenizer holds the task's alphabet alone: an
error message's characters outside it are dropped from the row, and the run says which once
(`Responder.dropped`); a tool's own answer that the tokenizer cannot write stops the run.

Function tools (TRL's `tools=` and `environment_factory`: schemas in the chat template, native
calls parsed and dispatched, one tool message per call) are tools/functions.py's; the Responder writes
their answers as it writes a Tool's, and builds every Completion's `messages` (TRL's completion).
Leaves out: tools running on a GPU.
Tested by tests/test_episodes.py.
"""

import asyncio
import inspect
import queue
import threading
from dataclasses import dataclass
from typing import Callable


@dataclass
class ToolConfig:
    tools: bool = True        # false: the task's tool is never called (its call token is text)
    max_turns: int = 4        # tool calls per row; a call beyond them ends the row
    tool_timeout: float = 10.0  # seconds one call may take before the run stops

    def __post_init__(self):
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {self.max_turns!r}")
        if not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout must be > 0 seconds, got {self.tool_timeout!r}")


@dataclass
class Tool:
    fn: Callable[[str, str], "str | None"]  # (text so far, reference) -> observation or None
    call: str = ""  # the token that ends a call; "" = the end of the model's turn (stop ids)


class Completion(str):
    """A completion as reward functions and tools see it: its text (a str: every token of the row,
    a tool's answers included, the stop token left out) and `parts`, the same text cut where the
    writer changes: (text, True) for what the model sampled, (text, False) for a tool's answer.
    A completion with no tool turn is one part. The parts are decoded one by one: they join to
    the text unless a character's bytes straddle a boundary (a byte-level tokenizer). `stopped`:
    the model ended it with a stop token (False: the budget, or a call past --max_turns).
    `messages`: the episode as TRL's completion (Responder.completions; the model's turns as
    assistant messages, each answer as its tool messages), and `environment`: the row's
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
        """Everything the model wrote, the tool's answers left out."""
        return "".join(text for text, own in self.parts if own)

    @property
    def answer(self) -> str:
        """What the model wrote after the tool's last answer (all of it when no tool answered):
        for a reward, the model's final answer; for a tool, the turn that called it."""
        last = max((i for i, (_, own) in enumerate(self.parts) if not own), default=-1)
        return "".join(text for text, own in self.parts[last + 1:])

    @property
    def observations(self) -> list[str]:
        """The tool's answers, in order."""
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
class ToolMessages:
    """A turn's function calls answered (tools/functions.py): the tool messages, one per call in order,
    and how many of them tell the model its mistake."""
    messages: list[dict]
    errors: int


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


def call_tools(task, fn: Callable, calls: list[tuple], timeout: float
               ) -> list[tuple[str | ToolMessages | None, int]]:
    """fn(*call) for each call, in order, each within `timeout` seconds (a call's first two
    arguments are the text and the reference its failures name): (observation or None, the model's
    mistakes in it) each. One daemon thread runs them all (a thread per call cost 0.8 ms on the
    CPU, more than the calls), and one that hangs cannot hold the process at exit."""
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
    name = getattr(fn, "__name__", repr(fn))
    where = f"task {task.name}: tool {name}"
    answers = []
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
        if value is not None and not isinstance(value, (str, ToolMessages)):
            raise ToolFailure(f"{where} returned {type(value).__name__} {str(value)[:60]!r} on "
                              f"text {text!r}; a tool returns the observation's text, or None to "
                              "end the episode")
        if isinstance(value, ToolMessages):
            answers.append((value, value.errors))
        else:
            answers.append((value, int(kind == "model")))
    return answers


def call_ids(tool: Tool, tokenizer, stop_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids that end a call: the tool's call token, or the stop ids ("": the turn's
    end). One line when the call text is not one token of this tokenizer."""
    if not tool.call:
        return tuple(stop_ids)
    ids = tokenizer.encode_text(tool.call, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tool's call token {tool.call!r} is {len(ids)} tokens for this "
                         "tokenizer; a call ends with one token (a special token of the "
                         "checkpoint, or \"\" for the end of the model's turn)")
    return tuple(ids)


class Responder:
    """Episodes.respond for one rollout: each waiting row's episode so far (a Completion) to its
    tool's observation ids. Keeps where each row's answers went, what they said and how many
    mistakes they told; with function tools (`toolbox`, tools/functions.py) it holds the rollout's
    tools (functions.RolloutTools): each row's environment, and the examples as reset() left
    their prompts."""

    def __init__(self, task, tokenizer, examples: list[tuple], num_samples: int,
                 cfg: ToolConfig, prompt_cfg=None, toolbox=None):
        self.task, self.tokenizer, self.toolbox = task, tokenizer, toolbox
        self.G, self.cfg = num_samples, cfg
        self.rollout_tools = toolbox.start(examples, num_samples) if toolbox else None
        self.examples = self.rollout_tools.examples if self.rollout_tools else examples
        self.system_prompt = prompt_cfg.system_prompt if prompt_cfg else ""  # a conversation
        self.variables = prompt_cfg.template_variables() if prompt_cfg else {}  # the prompt's
        # row -> (start, end, mistakes told, the answer's messages), one per answered turn
        self.answers: dict[int, list[tuple[int, int, int, list[dict]]]] = {}
        self.dropped: set[str] = set()  # characters of error messages the tokenizer cannot write

    def __call__(self, calls: list[tuple[int, list[int]]]) -> list[list[int] | None]:
        return self.apply(calls, self.answer(calls))

    def answer(self, calls: list[tuple[int, list[int]]]) -> list[tuple]:
        """The tool's answers to the waiting rows, (observation, mistakes) each: the task's Tool,
        or the calls of the rollout's function tools (under tensor parallelism, on the first rank
        alone)."""
        texts = [self.completion(row, tokens) for row, tokens in calls]
        references = [self.examples[row // self.G][1] for row, _ in calls]
        if self.rollout_tools is not None:
            return call_tools(self.task, self.rollout_tools.respond,
                              [(t, ref, row) for t, ref, (row, _) in zip(texts, references, calls)],
                              self.cfg.tool_timeout)
        return call_tools(self.task, self.task.tool.fn, list(zip(texts, references)),
                          self.cfg.tool_timeout)

    def apply(self, calls: list[tuple[int, list[int]]], answered: list[tuple]
              ) -> list[list[int] | None]:
        """Each answer as the row's observation ids (None: the episode ends), recorded."""
        answers = []
        for (observation, errors), (row, tokens) in zip(answered, calls):
            prompt = self.examples[row // self.G][0]
            ids = None
            if observation is not None:
                messages = observation.messages if isinstance(observation, ToolMessages) \
                    else [{"role": "tool", "content": observation}]
                ids = self.encode(prompt, messages, tokens, errors)
                # the row's tokens from len(tokens) on are the tool's
                self.answers.setdefault(row, []).append((len(tokens), len(tokens) + len(ids),
                                                         errors, messages))
            answers.append(ids)
        return answers

    def completion(self, row: int, tokens: list[int]) -> Completion:
        """The row's episode so far: its earlier answers are the tool's parts."""
        own = [True] * len(tokens)
        for start, end, _, _ in self.answers.get(row, []):
            own[start:end] = [False] * (end - start)
        decode = self.tokenizer.decode
        return Completion(decode(tokens), split_parts(decode, tokens, own), stopped=False)

    def errors(self, calls: list[int]) -> int:
        """The mistakes told in the calls that counted, calls[row] of each row (engine/episodes.py): a
        row's first answers, since an answer the budget could not hold ends its row."""
        return sum(errors for row, answers in self.answers.items()
                   for _, _, errors, _ in answers[:calls[row]])

    def completions(self, texts: list[str], ids: list[list[int]], stopped: list[bool],
                    policy: list[list[bool]]) -> list[Completion]:
        """What the reward functions see: each row's text (the stop token left out), its parts,
        its messages (TRL's completion) and its environment."""
        decode, rows = self.tokenizer.decode, []
        for row, (text, x, stop, own) in enumerate(zip(texts, ids, stopped, policy)):
            kept = x[:len(x) - stop]
            env = self.rollout_tools.environments[row] if self.rollout_tools else None
            rows.append(Completion(text, split_parts(decode, kept, own[:len(kept)]), stop,
                                   self.conversation(row, x if self.toolbox else kept), env))
        return rows

    def conversation(self, row: int, ids: list[int]) -> list[dict]:
        """The row as messages: the model's turns as assistant messages (for function tools as
        TRL parses them, from each turn's ids with its end token: content, reasoning_content,
        tool_calls), each answer's tool messages after the turn that called. An answer the budget
        could not hold was rolled back (engine/episodes.py): the row's last message is the call."""
        def assistant(tokens: list[int]) -> dict:
            text = self.tokenizer.decode(tokens)
            return self.toolbox.assistant(text) if self.toolbox else {"role": "assistant",
                                                                      "content": text}
        messages, at = [], 0
        for start, end, _, answer in self.answers.get(row, []):
            if end > len(ids):  # rolled back (the budget): the row ends at the call
                return messages + [assistant(ids[at:start])]
            messages += [assistant(ids[at:start]), *answer]
            at = end
        if at < len(ids) or not messages:  # else the row ends with a whole answer (TRL's too)
            messages.append(assistant(ids[at:]))
        return messages

    def encode(self, prompt, messages: list[dict], tokens: list[int], errors: int) -> list[int]:
        """The answer's ids as the prompt's format writes it (the module docstring): a plain-text
        prompt's the text itself, a conversation's the template's tool messages."""
        schemas = self.toolbox.schemas if self.toolbox else None
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
            raise ToolFailure(f"task {self.task.name}: the tool's answer {text!r} to text "
                              f"{said!r} cannot go into the row: {e} (a fresh model's "
                              "tokenizer holds the task's alphabet only)") from None

    def encode_text(self, text: str, errors: int) -> list[int]:
        """A plain-text answer's ids. An error message (the model's mistake, free text) keeps the
        characters the tokenizer can write and drops the others (`dropped`: the run says which);
        the tool's own answer must be written whole."""
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
                self.dropped.add(char)
        return ids
