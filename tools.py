"""
A task's tool: what the model calls in the middle of its completion, and what it answers.

A `Tool` is a function `fn(text, reference) -> str | None` and the token that ends a call. When a
row samples that token, episodes.py asks for an answer: `fn` gets the row's text so far (a
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
tool_errors, the turns) only once its whole answer entered the row: one cut by the completion
budget ends the row uncounted.

Leaves out: tool schemas in the system prompt (the task's prompt says how to call), parallel
calls within one turn, tools running on a GPU.
Tested by tests/test_episodes.py.
"""

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
    the model ended it with a stop token (False: the budget, or a call past --max_turns)."""
    parts: tuple[tuple[str, bool], ...]
    stopped: bool

    def __new__(cls, text: str, parts=None, stopped: bool = True):
        self = super().__new__(cls, text)
        self.parts = ((str(text), True),) if parts is None else tuple(parts)
        self.stopped = stopped
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


def call_tools(task, fn: Callable, calls: list[tuple[str, str]], timeout: float
               ) -> list[tuple[str | None, bool]]:
    """fn(text, reference) for each call, in order, each within `timeout` seconds: (observation or
    None, whether it was a ToolError) each. One daemon thread runs them all (a thread per call cost
    0.8 ms on the CPU, more than the calls), and one that hangs cannot hold the process at exit."""
    results: queue.Queue = queue.Queue()

    def run():
        for text, reference in calls:
            try:
                results.put(("ok", fn(text, reference)))
            except ToolError as e:
                results.put(("model", f"error: {e}"))
            except Exception as e:  # the tool's own failure: reported with its input
                results.put(("raised", e))
                return
    threading.Thread(target=run, daemon=True).start()
    name = getattr(fn, "__name__", repr(fn))
    where = f"task {task.name}: tool {name}"
    answers = []
    for text, reference in calls:
        try:
            kind, value = results.get(timeout=timeout)
        except queue.Empty:
            raise ToolFailure(f"{where} did not answer within --tool_timeout {timeout:g} s on "
                              f"text {text!r} (reference {reference!r}); make it faster or raise "
                              "the timeout") from None
        if kind == "raised":
            raise ToolFailure(f"{where} raised {type(value).__name__}: {value} on text {text!r} "
                              f"(reference {reference!r}); a call the model got wrong should "
                              "raise tools.ToolError")
        if value is not None and not isinstance(value, str):
            raise ToolFailure(f"{where} returned {type(value).__name__} {str(value)[:60]!r} on "
                              f"text {text!r}; a tool returns the observation's text, or None to "
                              "end the episode")
        answers.append((value, kind == "model"))
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
    tool's observation ids. Keeps where each row's answers went and which were ToolErrors."""

    def __init__(self, task, tokenizer, examples: list[tuple], num_samples: int,
                 cfg: ToolConfig, prompt_cfg=None):
        self.task, self.tokenizer, self.examples = task, tokenizer, examples
        self.G, self.cfg = num_samples, cfg
        self.system_prompt = prompt_cfg.system_prompt if prompt_cfg else ""  # a conversation
        self.variables = prompt_cfg.template_variables() if prompt_cfg else {}  # the prompt's
        self.answers: dict[int, list[tuple[int, int, bool]]] = {}  # row -> (start, end, error)

    def __call__(self, calls: list[tuple[int, list[int]]]) -> list[list[int] | None]:
        texts = [self.completion(row, tokens) for row, tokens in calls]
        examples = [self.examples[row // self.G] for row, _ in calls]
        answered = call_tools(self.task, self.task.tool.fn,
                              [(text, reference) for text, (_, reference) in zip(texts, examples)],
                              self.cfg.tool_timeout)
        answers = []
        for (observation, error), (row, tokens), text, (prompt, _) in zip(answered, calls, texts,
                                                                         examples):
            ids = None if observation is None else self.encode(prompt, observation, tokens[-1],
                                                               text)
            if ids is not None:  # the row's tokens from len(tokens) on are the tool's
                self.answers.setdefault(row, []).append((len(tokens), len(tokens) + len(ids),
                                                         error))
            answers.append(ids)
        return answers

    def completion(self, row: int, tokens: list[int]) -> Completion:
        """The row's episode so far: its earlier answers are the tool's parts."""
        own = [True] * len(tokens)
        for start, end, _ in self.answers.get(row, []):
            own[start:end] = [False] * (end - start)
        decode = self.tokenizer.decode
        return Completion(decode(tokens), split_parts(decode, tokens, own), stopped=False)

    def errors(self, calls: list[int]) -> int:
        """The ToolErrors among the calls that counted, calls[row] of each row (episodes.py): a
        row's first answers, since an answer the budget cut ends its row."""
        return sum(error for row, answers in self.answers.items()
                   for _, _, error in answers[:calls[row]])

    def encode(self, prompt, observation: str, end: int, text: str) -> list[int]:
        """The observation's ids as the prompt's format writes it (the module docstring)."""
        try:
            if isinstance(prompt, str) and not self.system_prompt:
                return self.tokenizer.encode_text(observation, add_special_tokens=False)
            if isinstance(prompt, str):  # --system_prompt made it a conversation
                prompt = [{"role": "system", "content": self.system_prompt},
                          {"role": "user", "content": prompt}]
            # the end token the row wrote is the template's: not written twice
            return self.tokenizer.encode_observation(prompt, observation,
                                                     self.tokenizer.decode([end]), self.variables)
        except ValueError as e:
            raise ToolFailure(f"task {self.task.name}: the tool's answer {observation!r} to text "
                              f"{text!r} cannot go into the row: {e} (a fresh model's "
                              "tokenizer holds the task's alphabet only)") from None
