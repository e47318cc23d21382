"""
Tasks: where prompts come from and how completions are scored.

A task is a `Task`: a function that draws one (prompt, reference) pair from a random.Random (or
(prompt, reference, columns): the fields of its row, an `Example`'s), and one or more reward
functions, each with a weight: `reward(completion, reference) -> float | None` per row, or in
TRL's form, `reward(prompts, completions, **kwargs) -> list` for all the rows at once (trl_form;
completions as message lists for a conversation, the examples' columns and reference as keyword
lists, `environments` with an environment: a TRL user's reward file, unchanged; TRL's
completion_ids, trainer_state, log_extra and log_metric are not passed). Either may be async.
The reward of a completion is the weighted sum over the functions; None (or NaN) means "could not
score": that function is left out, and a completion no function could score is left out of its
group's statistics (grpo.group_advantages) and counted in the log. For a task with a tool the
completion is a tools.Completion: the episode's text, whose parts tell the model's text from the
tool's observations (a reward scores completion.answer or .model_text, never the tool's text).

train.py loads a task by import path (load_task), `--task package.module:attr`, where attr is a
Task or a function `attr(data: str) -> Task` that receives `--task_data`, and scores completions
with score() (one column per reward function; grpo.combine_rewards sums them as TRL does); a reward
that is not a finite number or None stops the run, naming the function and the completion.
Built in:
- `tasks:reverse` (default): reverse a short digit string. The answer depends on the prompt's
  content, the credit is per digit (dense), and a fresh tiny Llama learns it on a CPU in minutes.
- five more of other kinds, for the same fresh model (each a char alphabet, a budget of the answer
  plus its stop token, dense credit and a fully-correct predicate): `tasks:double` (twice a 3-digit
  number: carries), `tasks:sort` (4 digits in ascending order), `tasks:count` (how many a's in 8
  letters: an aggregate, credit by distance), `tasks:increment` (each of 4 digits + 1 mod 10), and
  `tasks:add` (two 2-digit numbers), which the default model does not learn (README: the recipe).
- `tasks:jsonl_math` with `--task_data FILE`: one {"prompt": ..., "answer": ...} per line
  (GSM8K's "question" for "prompt" and answers such as "... #### 42" are accepted); a prompt is a
  string or a conversation (a list of {"role", "content"} messages, rendered with the checkpoint's
  chat template); the last number in the completion is compared. Every field of a line is a
  column of its example (an environment's reset and a TRL-form reward get them by name).
- `tasks:chat_add`: "What is 47 + 85?" as a chat message, for a pretrained chat checkpoint
  (--model); generated here, no data file. Correct when the last number of the completion is the
  sum; the reward is 1 for correct, else 0, so eval_reward is the share correct.
- the stop set (answers of varying length, then the stop) and `tasks:ragged_copy`, below.
- with a call-token tool (tools/call_token.py; a Task's `call_tool`): `tasks:lookup`, a value only
  the tool knows (a fresh model), the answer-reading tasks built on it (`lookup_copy`,
  `lookup_reverse`, `lookup_inorder`, `lookup_pair`, `lookup_sum`: the model writes its own answer
  from the tool's observation, scored on what
  it wrote: tools.Completion), and `tasks:chat_calc`, a product with a calculator (a chat
  checkpoint).
- with a function tool in TRL's shape (tools/functions.py; a Task's `tools`, `environment_factory`):
  `tasks:chat_multiply`, the product by a typed Python function the chat model calls natively
  (Hermes JSON), scored on its messages as a TRL reward reads its completion.

The evaluation's prompts (eval_split): a finite dataset's own test split (`--eval_data FILE`, read
by the same task factory), else distinct prompts held out of the training stream, at most half of a
finite dataset, with a line that says how many were held out and how many remain.
"""

import ast
import importlib
import inspect
import json
import math
import numbers
import operator
import os
import random
import re
import sys
from collections import Counter
from dataclasses import InitVar, dataclass, field
from typing import Callable

import numpy
import torch

from grpo import combine_rewards
from tools import functions
from tools.call_token import CallTool
from tools.runtime import Completion, ToolError, run_async

Reward = Callable[[str, str], "float | None"]


@dataclass
class Task:
    name: str
    sample: Callable[[random.Random], tuple]  # rng -> (prompt: text or conversation, reference)
    # [, columns: a dict of the example's other fields, for reset() and TRL-form rewards]
    rewards: list[tuple[Reward, float]] = field(default_factory=list)  # (reward fn, weight)
    alphabet: str = ""         # the characters a fresh character-level tokenizer needs
    max_new_tokens: int = 0    # the task's completion budget (0: train.py's setting decides)
    correct: Callable[[str, str], bool] | None = None  # a fully correct answer (the eval's share)
    examples: list[tuple] | None = None  # a finite dataset's (prompt, reference) pairs, else None
    # A function the model calls by writing one token mid-completion (tools/call_token.py)
    call_tool: CallTool | None = None
    # Function tools as TRL's GRPOTrainer takes them (tools/functions.py): typed, documented
    # functions the chat template announces; a class whose instance (one per row) adds its methods
    # as tools
    tools: list[Callable] = field(default_factory=list)
    environment_factory: Callable | None = None
    tool_format: str = ""      # the calls' format: hermes, llama3_json; "" = the template's
    tool: InitVar[CallTool | None] = None  # call_tool's former name, still accepted

    def __post_init__(self, tool):
        if tool is not None:
            self.call_tool = tool
        if self.call_tool is not None and (self.tools or self.environment_factory is not None):
            raise ValueError(f"task {self.name}: a call-token tool (call_tool) or function tools "
                             "and an environment (tools, environment_factory), not both")


class RewardError(ValueError):
    """A reward function raised, or returned something that is not a reward."""


class Example(tuple):
    """A (prompt, reference) pair and `columns`: the fields of the row it came from (a dataset's
    JSON line, or a dict a task's sample returns third), which an environment's reset() and a
    reward in TRL's form get by name, as TRL passes a dataset's columns."""
    columns: dict

    def __new__(cls, prompt, reference, columns: dict | None = None):
        self = super().__new__(cls, (prompt, reference))
        self.columns = dict(columns or {})
        return self

    def with_prompt(self, prompt) -> "Example":
        return Example(prompt, self[1], self.columns)


def as_example(task: Task, drawn) -> Example:
    """What a task's sample returned, (prompt, reference) or (prompt, reference, columns), as an
    Example; one line for anything else."""
    if isinstance(drawn, Example):
        return drawn
    if not (isinstance(drawn, (tuple, list)) and len(drawn) in (2, 3)
            and (len(drawn) == 2 or isinstance(drawn[2], dict))):
        raise ValueError(f"task {task.name}: its sample returned {short(drawn)}; it returns "
                         "(prompt, reference), or (prompt, reference, columns: a dict)")
    return Example(*drawn)


def load_task(spec: str, data: str, data_flag: str = "--task_data") -> Task:
    """`package.module:attr`: a Task, or a function (data: str) -> Task called with `data` (the
    file of --task_data, or --eval_data: data_flag names which, for the errors)."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # a task module in the current directory, as `python -m` finds
        sys.path.append(os.getcwd())  # after the engine's own modules: they keep their names
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name + ".").startswith(e.name + "."):  # the task's module itself
            raise ValueError(f"--task {spec}: cannot load it: no module {module_name!r} in the "
                             f"current directory ({os.getcwd()}) or on PYTHONPATH; run from the "
                             f"folder that holds it, or add that folder to PYTHONPATH") from None
        raise ValueError(f"--task {spec}: cannot load it: importing {module_name} failed: "
                         f"{e}") from None
    except Exception as e:  # the module's own code raised (a syntax error, a failed import)
        raise ValueError(f"--task {spec}: cannot load it: importing {module_name} raised "
                         f"{type(e).__name__}: {e}") from None
    if not hasattr(module, attr or "task"):
        raise ValueError(f"--task {spec}: cannot load it: module {module_name} "
                         f"({getattr(module, '__file__', '?')}) has no {attr or 'task'!r}; "
                         "expected package.module:attr")
    obj = getattr(module, attr or "task")
    if isinstance(obj, Task) and data:
        raise ValueError(f"{data_flag} {data}: task {obj.name} ({spec}) reads no data (it is a "
                         "Task, not a function (task_data: str) -> Task); drop the flag")
    task = obj if isinstance(obj, Task) or not callable(obj) else obj(data)
    if not isinstance(task, Task):
        raise ValueError(f"--task {spec}: is a {type(task).__name__}, not a tasks.Task (or a "
                         "function (task_data: str) -> Task)")
    return task


def short(value, limit: int = 60) -> str:
    """repr, cut: a reward of 10**400 would print 401 digits."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_reward(value, fn: Reward, text: str, ref: str, task: Task) -> float:
    """A reward function's output as a float: None (or NaN) means "cannot score". A bool is a
    number, Python's or numpy's alike."""
    if value is None:
        return math.nan
    number = (isinstance(value, (numbers.Real, numpy.bool_))
              or (torch.is_tensor(value) and value.numel() == 1))
    try:
        if number and not math.isinf(float(value)):
            return float(value)
    except OverflowError:  # an int beyond float64 (10**400)
        pass
    name = getattr(fn, "__name__", repr(fn))
    raise RewardError(f"task {task.name}: reward function {name} returned {short(value)} on "
                      f"completion {text!r} (reference {ref!r}); a reward is a finite number, or "
                      "None when the completion cannot be scored")


def check_statistics(task: Task, rewards: torch.Tensor) -> None:
    """Finite rewards whose sum or squares overflow float64 (1e300) would make the group std inf
    and every advantage 0: the run would train nothing, silently. rewards (N,), NaN: missing."""
    scored = rewards[~rewards.isnan()]
    if torch.isfinite(scored.sum()) and torch.isfinite((scored * scored).sum()):
        return
    big = scored[scored.abs().argmax()].item()
    raise RewardError(f"task {task.name}: the rewards' mean or spread overflows (a reward of "
                      f"{big:.3g}); keep rewards within about +-1e150, e.g. 0 to 1")


def call(task: Task, fn: Callable, text: str, ref: str):
    """fn(text, ref), a user's function (awaited when it is async): what it raises is reported
    with the input that broke it."""
    try:
        value = fn(text, ref)
        return run_async(value) if inspect.isawaitable(value) else value
    except Exception as e:
        name = getattr(fn, "__name__", repr(fn))
        raise RewardError(f"task {task.name}: reward function {name} raised {type(e).__name__}: "
                          f"{e} on completion {text!r} (reference {ref!r})") from None


def trl_form(fn: Callable) -> bool:
    """Whether a reward function is written in TRL's form, fn(prompts, completions, **kwargs) ->
    a list (it names `prompts` or `completions`, or takes keywords alone), not this project's
    per-row fn(completion, reference)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: per row
        return False
    names = {p.name for p in params}
    keywords_only = all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params)
    return bool(names & {"prompts", "completions"}) or (bool(names) and keywords_only)


def call_trl(task: Task, fn: Callable, texts: list, examples: list) -> list:
    """fn as TRL's GRPOTrainer calls a reward: prompts=, completions= (a conversation's as message
    lists: a Completion's messages, TRL's completion), every column of the examples as a keyword
    list, and `environments` for a task with one; awaited when async. One value a completion."""
    prompts = [prompt for prompt, _ in examples]
    chat = task.tools or task.environment_factory is not None
    completions = [getattr(t, "messages", [{"role": "assistant", "content": str(t)}])
                   if chat or isinstance(p, list) else str(t) for t, p in zip(texts, prompts)]
    keys = dict.fromkeys(k for e in examples for k in getattr(e, "columns", {}))
    kwargs = {k: [getattr(e, "columns", {}).get(k) for e in examples] for k in keys
              if k not in ("prompt", "completion", "completion_ids")}
    kwargs["reference"] = [reference for _, reference in examples]
    if task.environment_factory is not None:
        kwargs["environments"] = [getattr(t, "environment", None) for t in texts]
    name = getattr(fn, "__name__", repr(fn))
    try:
        values = fn(prompts=prompts, completions=completions, **kwargs)
        values = run_async(values) if inspect.isawaitable(values) else values
    except Exception as e:
        raise RewardError(f"task {task.name}: reward function {name} raised {type(e).__name__}: "
                          f"{e} on {len(texts)} completions (the first "
                          f"{str(texts[0]) if texts else ''!r})") from None
    if isinstance(values, (numpy.ndarray, torch.Tensor)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != len(texts):
        raise RewardError(f"task {task.name}: reward function {name} (TRL's form: it names "
                          f"prompts or completions) returned {short(values)}; it returns a list "
                          f"of {len(texts)} rewards, one a completion")
    return list(values)


def score(task: Task, texts: list[str], references: list[str],
          examples: list | None = None) -> torch.Tensor:
    """(N, F) rewards of N completions by the task's F reward functions, NaN where a function
    returned None (grpo.combine_rewards sums them, weighted, as TRL does). examples: each
    completion's (prompt, reference) as the model saw it (tasks.Example: with its columns), for
    the functions in TRL's form."""
    if examples is None:
        examples = [(None, ref) for ref in references]
    columns = []  # Python floats, one tensor at the end: a write per element would be an op each
    for fn, _ in task.rewards:
        values = call_trl(task, fn, texts, examples) if trl_form(fn) else \
            [call(task, fn, text, ref) for text, ref in zip(texts, references)]
        columns.append([check_reward(value, fn, text, ref, task)
                        for value, text, ref in zip(values, texts, references)])
    per_function = torch.tensor(columns, dtype=torch.float64)
    return per_function.reshape(len(task.rewards), len(texts)).T.contiguous()  # (N, F)


def total_rewards(task: Task, texts: list[str], references: list[str],
                  examples: list | None = None) -> torch.Tensor:
    """(N,) float64: each completion's rewards summed as TRL sums them (grpo.combine_rewards),
    NaN where no function scored it; statistics that overflow stop the run."""
    total = combine_rewards(score(task, texts, references, examples),
                            [w for _, w in task.rewards])
    check_statistics(task, total)
    return total


def correct_flags(task: Task, texts: list[str], references: list[str]) -> list[bool] | None:
    """Whether task.correct calls each completion fully correct; None without a predicate."""
    if task.correct is None:
        return None
    return [bool(call(task, task.correct, t, r)) for t, r in zip(texts, references)]


def count_correct(task: Task, texts: list[str], references: list[str]) -> int:
    """How many completions task.correct calls fully correct (0 without a predicate)."""
    return sum(correct_flags(task, texts, references) or [])


REVERSE_LEN = 3


def digit_string(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(length))


def sample_reverse(rng: random.Random) -> tuple[str, str]:
    digits = digit_string(rng, REVERSE_LEN)
    return digits + "=", digits[::-1]


def digits_correct(completion: str, reference: str) -> float:
    """Partial credit: the fraction of answer positions that hold the right digit."""
    return sum(a == b for a, b in zip(completion, reference)) / len(reference)


def exact_length(completion: str, reference: str) -> float:
    """1 when the completion stops right after the answer (train.py strips the stop token)."""
    return float(len(completion) == len(reference))


def exact(completion: str, reference: str) -> bool:
    return completion == reference


reverse = Task("reverse", sample_reverse, [(digits_correct, 0.8), (exact_length, 0.2)],
               alphabet="0123456789=", max_new_tokens=REVERSE_LEN + 1, correct=exact)

# -----------------------------------------------------------------------------
# Five more small tasks, each of another kind, for the same fresh model. Every answer has a fixed
# length, so the credit is reverse's: per position (0.8) plus stopping right after it (0.2).


def sample_add(rng: random.Random) -> tuple[str, str]:
    """"47+85=" -> "132": the sum, zero-padded to 3 digits (the hundreds digit is the carry)."""
    a = rng.randrange(100)
    b = rng.randrange(100)
    return f"{a:02d}+{b:02d}=", f"{a + b:03d}"


def sample_double(rng: random.Random) -> tuple[str, str]:
    """"372=" -> "0744": twice a 3-digit number, zero-padded to 4 digits. Each answer digit is its
    prompt digit doubled plus the carry from the digit to its right (1 when that one is >= 5):
    arithmetic with carries that the default fresh model learns (add's two-digit tables it does
    not, see the README)."""
    n = rng.randrange(1000)
    return f"{n:03d}=", f"{2 * n:04d}"


def sample_sort(rng: random.Random) -> tuple[str, str]:
    """"3141=" -> "1134": every answer digit depends on all prompt digits, not on one position."""
    digits = digit_string(rng, 4)
    return digits + "=", "".join(sorted(digits))


def sample_increment(rng: random.Random) -> tuple[str, str]:
    """"3799=" -> "4800": each digit + 1 mod 10, a copy with a rule (no carries)."""
    digits = digit_string(rng, 4)
    return digits + "=", "".join(str((int(d) + 1) % 10) for d in digits)


def sample_count(rng: random.Random) -> tuple[str, str]:
    """"abbabaab=" -> "4": how many a's, one digit that no single prompt position holds. The count
    is uniform over 0..8 (8 fair coin flips would make it 3, 4 or 5 in 71% of prompts, and a
    constant "4" a good answer)."""
    count = rng.randrange(9)
    letters = ["a"] * count + ["b"] * (8 - count)
    rng.shuffle(letters)
    return "".join(letters) + "=", str(count)


def count_close(completion: str, reference: str) -> float:
    """Partial credit by distance: 1 for the right count, 0.5 for one off, else 0 (and for no
    digit). A constant answer earns at most 2/9 of it."""
    if not completion[:1].isdigit():
        return 0.0
    return max(0.0, 1.0 - abs(int(completion[0]) - int(reference)) / 2)


def digit_task(name: str, sample: Callable, answer_len: int, alphabet: str = "0123456789=") -> Task:
    """A task whose answers are answer_len digits, with reverse's rewards and budget."""
    return Task(name, sample, [(digits_correct, 0.8), (exact_length, 0.2)], alphabet=alphabet,
                max_new_tokens=answer_len + 1, correct=exact)


add = digit_task("add", sample_add, 3, alphabet="0123456789+=")
double = digit_task("double", sample_double, 4)
sort = digit_task("sort", sample_sort, 4)
increment = digit_task("increment", sample_increment, 4)
count = Task("count", sample_count, [(count_close, 0.8), (exact_length, 0.2)],
             alphabet="ab0123456789=", max_new_tokens=2, correct=exact)

# -----------------------------------------------------------------------------
# Answers of varying length, then the stop: the stop set. The model must learn where its answer
# ends, which depends on the prompt; the credit is per position (0.8, digits_correct: extra tokens
# cost nothing there) plus stopping right after the answer (0.2); the budget is the longest
# answer plus its stop. docs/measurements.md holds the default recipe to all eight.


def word(rng: random.Random, letters: str, shortest: int, longest: int) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(shortest, longest)))


def sample_reverse_word(rng: random.Random) -> tuple[str, str]:
    """"abcd=" -> "dcba": 4 letters of 4 (a user's first task; the budget holds one more)."""
    letters = word(rng, "abcd", 4, 4)
    return letters + "=", letters[::-1]


def sample_reverse_varied(rng: random.Random) -> tuple[str, str]:
    """"cab=" -> "bac": reversal of 2 to 5 letters: the end moves with the prompt."""
    letters = word(rng, "abcd", 2, 5)
    return letters + "=", letters[::-1]


def sample_upper(rng: random.Random) -> tuple[str, str]:
    """"abca=" -> "ABCA": the README's example."""
    letters = word(rng, "abc", 4, 4)
    return letters + "=", letters.upper()


def sample_stars(rng: random.Random) -> tuple[str, str]:
    """"dab=" -> "***": as many stars as the prompt has letters (1 to 6): only the stop varies."""
    letters = word(rng, "abcd", 1, 6)
    return letters + "=", "*" * len(letters)


def sample_copy(rng: random.Random) -> tuple[str, str]:
    """"4071=" -> "4071": 1 to 5 digits."""
    digits = word(rng, "0123456789", 1, 5)
    return digits + "=", digits


def sample_dedup(rng: random.Random) -> tuple[str, str]:
    """"aabccb=" -> "abcb": each run of a letter once (6 letters of 3: 1 to 6 in the answer)."""
    letters = word(rng, "abc", 6, 6)
    return letters + "=", "".join(c for i, c in enumerate(letters) if letters[i - 1:i] != c)


def sample_strip_zeros(rng: random.Random) -> tuple[str, str]:
    """"00372=" -> "372": 5 digits with 0 to 3 leading zeros, the zeros dropped."""
    zeros = rng.randint(0, 3)
    digits = "0" * zeros + word(rng, "123456789", 5 - zeros, 5 - zeros)
    return digits + "=", digits[zeros:]


def sample_drop_c(rng: random.Random) -> tuple[str, str]:
    """"acbcca=" -> "aba": 6 letters of 3 without their c's (at least one letter remains)."""
    while True:
        letters = word(rng, "abc", 6, 6)
        if letters.replace("c", ""):
            return letters + "=", letters.replace("c", "")


def stop_task(name: str, sample: Callable, alphabet: str, longest: int) -> Task:
    """A task of the stop set: per-position credit, the stop, a budget of longest + 1."""
    return Task(name, sample, [(digits_correct, 0.8), (exact_length, 0.2)], alphabet=alphabet,
                max_new_tokens=longest + 1, correct=exact)


reverse_word = stop_task("reverse_word", sample_reverse_word, "abcd=", 4)
reverse_varied = stop_task("reverse_varied", sample_reverse_varied, "abcd=", 5)
upper = stop_task("upper", sample_upper, "abcABC=", 4)
stars = stop_task("stars", sample_stars, "abcd*=", 6)
copy = stop_task("copy", sample_copy, "0123456789=", 5)
dedup = stop_task("dedup", sample_dedup, "abc=", 6)
strip_zeros = stop_task("strip_zeros", sample_strip_zeros, "0123456789=", 5)
drop_c = stop_task("drop_c", sample_drop_c, "abc=", 6)

# -----------------------------------------------------------------------------
# A ragged batch to measure on: prompts and answers of 1 to 20 tokens whose mean is about a third of
# the longest, as in real batches (GSM8K prompts run 40-300 tokens, completions 20 to the budget).


def sample_ragged_copy(rng: random.Random) -> tuple[str, str]:
    """"gabde=" -> "gabde": 1 to 20 letters, the length 1 + 20 u^2 for a uniform u (mean 7.2)."""
    length = 1 + int(20 * rng.random() ** 2)
    letters = "".join(rng.choice("abcdefgh") for _ in range(length))
    return letters + "=", letters


ragged_copy = stop_task("ragged_copy", sample_ragged_copy, "abcdefgh=", 20)

# -----------------------------------------------------------------------------
# Math word problems from a JSONL file (for real checkpoints, e.g. GSM8K-style files on disk)

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text: str) -> float | None:
    """The last number in the text ("1,234" -> 1234.0), or None when there is none."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def answer_correct(completion: str, reference: str) -> float:
    got = parse_number(completion)
    return float(got is not None and math.isclose(got, float(reference), rel_tol=0, abs_tol=1e-6))


def has_number(completion: str, reference: str) -> float:
    """A small format reward: the completion states some number at all."""
    return float(parse_number(completion) is not None)


def jsonl_prompt(row: dict, where: str):
    """A row's prompt: a string, or a conversation (a list of {"role", "content"} messages)."""
    prompt = row["prompt"] if "prompt" in row else row["question"]  # GSM8K names it question
    if type(row["answer"]) not in (str, int, float) or not isinstance(prompt, (str, list)):
        raise ValueError(f"{where}: 'prompt' must be a string (or a conversation) and 'answer' a "
                         f"string or a number, got {type(prompt).__name__} and "
                         f"{type(row['answer']).__name__}")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                 and isinstance(m.get("content"), str) for m in prompt):
            raise TypeError("a conversation is a non-empty list of {\"role\", \"content\"} "
                            "strings")
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    return str(prompt)


def jsonl_math(data: str) -> Task:
    if not data:
        raise ValueError("task jsonl_math needs --task_data FILE (one {\"prompt\", \"answer\"} "
                         "object per line)")
    examples = []
    i = 0
    try:
        with open(data) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                prompt = jsonl_prompt(row, f"{data}:{i}")
                # GSM8K puts the number after ####
                answer = str(row["answer"]).split("####")[-1].strip()
                if parse_number(answer) is None:
                    raise ValueError(f"{data}:{i}: answer {row['answer']!r} holds no number")
                examples.append(Example(prompt, str(parse_number(answer)), row))
    except FileNotFoundError:
        raise ValueError(f"{data}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder, a binary file, no permission
        raise ValueError(f"{data}: cannot read it as a JSONL text file "
                         f"({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:  # its own "line 1 column 9" counts within the file's line
        raise ValueError(f"{data}:{i}: not JSON ({e.msg} at column {e.colno}); expected one "
                         "object with 'prompt' and 'answer' per line") from None
    except (KeyError, TypeError) as e:
        raise ValueError(f"{data}:{i}: expected a JSON object with 'prompt' and 'answer' (a prompt "
                         f"is a string or a conversation; {e!r})") from None
    if not examples:
        raise ValueError(f"{data}: no examples")
    rewards = [(answer_correct, 1.0), (has_number, 0.1)]
    return Task("jsonl_math", lambda rng: rng.choice(examples), rewards,
                correct=lambda c, r: answer_correct(c, r) == 1.0, examples=examples)

# -----------------------------------------------------------------------------
# A chat question for a pretrained chat checkpoint, generated here (no data file)


def sample_chat_add(rng: random.Random) -> tuple[list[dict], str]:
    """"What is 47 + 85?" as the user's message of a conversation (rendered with the checkpoint's
    chat template), the sum as the reference: 8,100 distinct questions."""
    a = rng.randrange(10, 100)
    b = rng.randrange(10, 100)
    return [{"role": "user", "content": f"What is {a} + {b}?"}], str(a + b)


# Correct (reward 1, else 0): the completion's last number is the sum, so "47 + 85 = 132" and
# "132" both are, and one cut off by the budget before the sum is not. 12 tokens hold "47 + 85 =
# 132" and the stop token in SmolLM2's tokenizer (one token per digit).
chat_add = Task("chat_add", sample_chat_add, [(answer_correct, 1.0)], max_new_tokens=12,
                correct=lambda c, r: answer_correct(c, r) == 1.0)

# -----------------------------------------------------------------------------
# Tasks with a call-token tool (tools/call_token.py): the answer is in the tool's hands, not the
# prompt's


def sample_lookup(rng: random.Random) -> tuple[str, str]:
    """"bdac=" -> "47": a 2-digit value drawn for this prompt alone and never shown: only the tool
    knows it, and without the tool any answer is a guess (mean reward 0.08)."""
    return word(rng, "abcd", 4, 4) + "=", digit_string(rng, 2)


def look_up(text: str, reference: str) -> str:
    """The tool: the prompt's value, whatever was asked."""
    return reference


def lookup_answer(completion: str) -> str:
    """The episode's last two digits: "?47" (a call, the tool's observation, the stop) and "?4747"
    (the answer repeated) -> "47"; a guess "31" -> "31"."""
    return "".join(re.findall(r"\d", completion)[-2:])


def lookup_digits(completion: str, reference: str) -> float:
    return digits_correct(lookup_answer(completion), reference)


def lookup_exact(completion: Completion, reference: str) -> bool:
    """The clean episode: the model's call, the tool's observation, the stop ("?" + "47")."""
    return completion.parts == (("?", True), (reference, False))


# The credit is per digit of the episode's last two, the tool's observation included on purpose
# (0.8): the skill is the call itself, what the model writes after it earns nothing more; plus the
# clean episode (0.2): the model must learn to call first, and to stop once the value is in.
lookup = Task("lookup", sample_lookup, [(lookup_digits, 0.8), (lookup_exact, 0.2)],
              alphabet="abcd0123456789=?", max_new_tokens=6,  # "?", "47", the stop, and room
              correct=lookup_exact, call_tool=CallTool(look_up, call="?"))

# Answer-reading tasks: the model calls, reads the tool's observations and writes its own answer
# from them. The credit reads what the model did, never the tool's text: its answer
# (completion.answer, what it wrote after the tool's last observation) and how many of its calls
# the tool answered (the call is the model's action; the observations' text earns nothing). The
# reference is what the tool knows; each task's `expected` turns it into the answer. Credit for the
# right digits in any position leads a policy to read the tool's observation before it knows each
# digit's place (the copy learned on 1 seed of 2 without it, on 4 of 4 with it), and the budget,
# not a stop, ends the episode (a stop
# credited for any answer of the right length kept a policy that calls, guesses and stops):
# docs/measurements.md, the answer-reading tasks.


def sample_lookup_pair(rng: random.Random) -> tuple[str, str]:
    """"bdac=" -> "4+7": two 1-digit values for this prompt alone, one per call."""
    return word(rng, "abcd", 4, 4) + "=", f"{rng.randrange(10)}+{rng.randrange(10)}"


def look_up_next(text: Completion, reference: str) -> str | None:
    """The k-th call gets the k-th value ("4+7": "4", then "7"); a third call ends the episode."""
    values = reference.split("+")
    calls = len(text.observations)
    return values[calls] if calls < len(values) else None


def answer_reading(name: str, sample: Callable, tool: Callable, expected: Callable[[str], str],
                   calls: int, tool_tokens: int, answer_tokens: int = 2) -> Task:
    """A task whose answer is expected(reference) (`answer_tokens` long), written by the model
    after `calls` calls whose observations take `tool_tokens` tokens in all. The budget ends the
    episode right after the answer (no stop to learn). Credit: per position of completion.answer
    (0.6), per digit of it found anywhere in the expected answer (0.2, as a multiset: "74" for
    "47" earns it), and the calls the tool answered, up to `calls` (0.2). With several calls the
    answer earns only once the tool answered every one: else one call and a guess at the rest is
    a resting point (the first value copied earns half the answer)."""
    def read_all(completion: Completion) -> bool:
        return calls == 1 or len(completion.observations) >= calls

    def answer_digits(completion: Completion, reference: str) -> float:
        if not read_all(completion):
            return 0.0
        return digits_correct(completion.answer, expected(reference))

    def answer_digits_anywhere(completion: Completion, reference: str) -> float:
        if not read_all(completion):
            return 0.0
        written = Counter(completion.answer[:answer_tokens])
        return sum((written & Counter(expected(reference))).values()) / answer_tokens

    def calls_answered(completion: Completion, reference: str) -> float:
        return min(len(completion.observations), calls) / calls

    def answer_right(completion: Completion, reference: str) -> bool:
        return read_all(completion) and completion.answer == expected(reference)
    budget = calls + tool_tokens + answer_tokens
    return Task(name, sample, [(answer_digits, 0.6), (answer_digits_anywhere, 0.2),
                               (calls_answered, 0.2)],
                alphabet="abcd0123456789=?", max_new_tokens=budget, correct=answer_right,
                call_tool=CallTool(tool, call="?"))


# "?" + "47" (the tool's) + "47" (the model's): the value written again.
lookup_copy = answer_reading("lookup_copy", sample_lookup, look_up, lambda ref: ref, 1, 2)
# "?" + "47" + "74": the tool's observation transformed (reversed).
lookup_reverse = answer_reading("lookup_reverse", sample_lookup, look_up,
                                lambda ref: ref[::-1], 1, 2)
# "?" + "4" + "?" + "7" + "47": two observations of two calls, combined in order.
lookup_inorder = answer_reading("lookup_inorder", sample_lookup_pair, look_up_next,
                                lambda ref: ref.replace("+", ""), 2, 2)
# "?" + "4" + "?" + "7" + "74": two observations of two calls, the last first.
lookup_pair = answer_reading("lookup_pair", sample_lookup_pair, look_up_next,
                             lambda ref: ref[::-1].replace("+", ""), 2, 2)
# "?" + "4" + "?" + "7" + "11": two observations of two calls, summed (two digits: "4+3" -> "07").
lookup_sum = answer_reading("lookup_sum", sample_lookup_pair, look_up_next,
                            lambda ref: f"{sum(map(int, ref.split('+'))):02d}", 2, 2)

CALC = re.compile(r"<calc>(.*?)</calc>", re.S)


def arithmetic(expression: str) -> int | float:
    """+ - * / and brackets on numbers, nothing else (no eval of the model's text). Whatever the
    expression makes Python raise (bad syntax, a division by 0, a result too large for a float,
    nesting too deep for the parser) is the model's mistake: a ToolError, as is a result that is
    not a finite number."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.operand))
        raise ToolError(f"{short(expression, 40)} is not arithmetic on numbers (+ - * / and "
                        "brackets)")
    try:
        result = value(ast.parse(expression.replace(",", "").strip(), mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError) as e:
        # MemoryError and RecursionError: the parser's and value()'s answer to deep nesting
        raise ToolError(f"{short(expression, 40)}: {str(e) or type(e).__name__}"[:120]) from None
    if isinstance(result, float) and not math.isfinite(result):
        raise ToolError(f"{short(expression, 40)} is not a finite number")
    return result


def number_text(result: int | float) -> str:
    """An exact integer as its digits (a float one too: 2.5e20 -> 250000000000000000000), any
    other float to 6 decimals."""
    if isinstance(result, float):
        return str(int(result)) if result.is_integer() else str(round(result, 6))
    try:
        return str(result)
    except ValueError as e:  # Python prints no int of over 4300 digits
        raise ToolError(str(e)[:120]) from None


def calculator(text: Completion, reference: str) -> str | None:
    """The last <calc>...</calc> of the model's turn that called (text.answer: what the model
    wrote since the tool's last answer), or None: the turn holds no call, the episode ends."""
    calls = CALC.findall(text.answer)
    return f"result: {number_text(arithmetic(calls[-1]))}" if calls else None


# A one-shot demonstration: the call, the tool's message as the chat template writes it, the
# answer. The system message alone does not make SmolLM2-135M-Instruct call (it computes, wrongly).
CALC_SYSTEM = ("You have a calculator. To use it, write <calc>expression</calc> and end your "
               "turn; the result comes back as a message. Then give the final answer as a number.")
CALC_EXAMPLE = [{"role": "user", "content": "What is 23 * 47?"},
                {"role": "assistant", "content": "<calc>23 * 47</calc>"},
                {"role": "tool", "content": "result: 1081"},
                {"role": "assistant", "content": "23 * 47 = 1081"}]


def sample_chat_calc(rng: random.Random) -> tuple[list[dict], str]:
    """"What is 412 * 739?" after the system message and the example: 810,000 questions."""
    a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
    return [{"role": "system", "content": CALC_SYSTEM}, *CALC_EXAMPLE,
            {"role": "user", "content": f"What is {a} * {b}?"}], str(a * b)


def calc_correct(completion: Completion, reference: str) -> float:
    """1 when the last number the model wrote after the calculator's last result is the product:
    the result itself, the tool's text, earns nothing."""
    return answer_correct(completion.answer, reference)


# The call ends the model's turn (call=""): the checkpoint's end-of-turn token, then the
# template's tool message. 48 tokens hold a call, its result message and the answer.
chat_calc = Task("chat_calc", sample_chat_calc, [(calc_correct, 1.0)], max_new_tokens=48,
                 correct=lambda c, r: calc_correct(c, r) == 1.0,
                 call_tool=CallTool(calculator, call=""))

# A function tool as TRL passes it (tools/functions.py): typed and documented, called natively.
# SmolLM2's chat template renders no tools, so the system message announces the function (its JSON
# schema) and the Hermes call format, and one example exchange shows a call, its tool message as
# SmolLM2's template writes one, and the answer after it. (A system message in Qwen2.5's `# Tools` wording
# made SmolLM2-135M call an "add" it was never shown: 0 of 16 held-out questions right.)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


MULTIPLY_SYSTEM = (
    "You can call a function: " + json.dumps(functions.json_schema(multiply)["function"])
    + '\nTo call it, write <tool_call>\n{"name": "multiply", "arguments": {"a": ..., "b": ...}}\n'
    "</tool_call> and end your turn; the result comes back as a message. Then give the final "
    "answer as a number.")
MULTIPLY_EXAMPLE = [
    {"role": "user", "content": "What is 23 * 47?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "multiply", "arguments": {"a": 23, '
                                     '"b": 47}}\n</tool_call>'},
    {"role": "tool", "name": "multiply", "content": "1081"},
    {"role": "assistant", "content": "23 * 47 = 1081"}]


def sample_chat_multiply(rng: random.Random) -> tuple[list[dict], str]:
    """"What is 412 * 739?" after the system message and the example (810,000 questions); the
    reference is the question's "412 * 739"."""
    a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
    return [{"role": "system", "content": MULTIPLY_SYSTEM}, *MULTIPLY_EXAMPLE,
            {"role": "user", "content": f"What is {a} * {b}?"}], f"{a} * {b}"


def product(reference: str) -> str:
    a, b = reference.split(" * ")
    return str(int(a) * int(b))


def final_answer_correct(completion: Completion, reference: str) -> float:
    """TRL's way to read an episode: its last message (`completions[i][-1]["content"]` there) is
    the model's final turn, and its last number is the product. A last message that is the tool's
    (the budget ended the row right after it) earns nothing: the tool's text is not the model's
    answer."""
    last = completion.messages[-1]
    return answer_correct(last["content"], product(reference)) if last["role"] == "assistant" \
        else 0.0


def calls_multiply(completion: Completion, reference: str) -> float:
    """The model's first turn calls multiply on the question's two numbers (its own text, parsed:
    the call is its action, whether a tool answers it or not)."""
    calls = completion.messages[0].get("tool_calls", [])
    a, b = (int(x) for x in reference.split(" * "))
    return float(any(c["function"] in ({"name": "multiply", "arguments": {"a": a, "b": b}},
                                       {"name": "multiply", "arguments": {"a": b, "b": a}})
                     for c in calls))


# Credit: the answer (1) and, as a first step a random sample rarely takes whole, the right call
# (0.2). The call ends the model's turn; 80 tokens hold SmolLM2's call (37 tokens), its end, the
# tool's message (16), an answer "412 * 739 = 304468" (16) and its end.
chat_multiply = Task("chat_multiply", sample_chat_multiply,
                     [(final_answer_correct, 1.0), (calls_multiply, 0.2)], max_new_tokens=80,
                     correct=lambda c, r: final_answer_correct(c, r) == 1.0, tools=[multiply],
                     tool_format="hermes")

# -----------------------------------------------------------------------------
# The evaluation's prompts, which training never draws


def prompt_key(prompt) -> str:
    """A prompt's identity (a conversation is a list: its JSON)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def distinct(examples) -> list[tuple]:
    """The examples with distinct prompts, first occurrence kept, in order."""
    return list({prompt_key(e[0]): e for e in reversed(list(examples))}.values())[::-1]


@dataclass
class EvalSplit:
    examples: list[tuple]                            # the evaluation's (prompt, reference) pairs
    held_out: set[str] = field(default_factory=set)  # prompt_key of what training never draws
    note: str = ""                                   # what was held out, said at the first step


def eval_split(task: Task, eval_task: Task | None, count: int, seed: int) -> EvalSplit:
    """Up to `count` distinct evaluation prompts: the first of eval_task's dataset (--eval_data: the
    training data stays whole), else held out of the task's own, from their own RNG stream. A
    finite dataset gives at most half of its distinct prompts, and says so."""
    if eval_task is not None:
        if eval_task.examples is None:
            raise ValueError(f"--eval_data: task {eval_task.name} has no finite dataset to "
                             "evaluate on (it is for jsonl tasks)")
        examples = distinct(eval_task.examples)[:count]
        return EvalSplit(examples, note=f"eval: {len(examples)} prompts of --eval_data; "
                                        "training keeps every prompt of its own data")
    rng = random.Random(f"eval:{seed}")
    if task.examples is not None:
        pool = distinct(task.examples)
        rng.shuffle(pool)
        examples = pool[:min(count, len(pool) // 2)]
        note = (f"eval: {len(examples)} of the {len(pool)} distinct prompts held out of training "
                f"(--eval_prompts {count}, at most half), {len(pool) - len(examples)} remain for "
                "training; --eval_data FILE evaluates on a test split instead")
        return EvalSplit(examples, {prompt_key(p) for p, _ in examples}, note)
    found: dict[str, tuple] = {}
    for _ in range(100 * count):
        if len(found) == count:
            break
        example = as_example(task, task.sample(rng))
        found.setdefault(prompt_key(example[0]), example)
    if len(found) < count:  # the stream ran dry: fewer distinct prompts; training keeps half
        found = dict(list(found.items())[:len(found) // 2])
    return EvalSplit(list(found.values()), set(found))


def draw_training_example(task: Task, split: EvalSplit, rng: random.Random) -> tuple:
    """A (prompt, reference) the evaluation does not hold out."""
    for _ in range(1000):
        example = as_example(task, task.sample(rng))
        if prompt_key(example[0]) not in split.held_out:
            return example
    raise ValueError(f"task {task.name}: 1000 draws in a row were held out for the evaluation; "
                     "lower --eval_prompts (or --eval_every 0)")
