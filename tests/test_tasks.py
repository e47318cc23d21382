"""tasks.py: the built-in tasks' sampling and rewards, the JSONL loader's errors, and score()."""

import json
import math
import random
import re

import numpy as np
import pytest
import torch

import tasks


def test_reverse_prompts_depend_on_content_and_rewards_give_partial_credit():
    rng = random.Random(0)
    pairs = [tasks.reverse.sample(rng) for _ in range(50)]
    assert len({p for p, _ in pairs}) > 30  # many different prompts, not one fixed answer
    for prompt, ref in pairs:
        assert prompt.endswith("=") and ref == prompt[:-1][::-1]
    assert tasks.digits_correct("321", "321") == 1.0
    assert tasks.digits_correct("391", "321") == pytest.approx(2 / 3)
    assert tasks.digits_correct("", "321") == 0.0
    assert tasks.exact_length("321", "321") == 1.0 and tasks.exact_length("3210", "321") == 0.0


# -----------------------------------------------------------------------------
# The five other small tasks: references from an independent computation, content-dependent
# prompts, partial credit, and a budget and alphabet that fit every answer


def reference_of(name: str, prompt: str) -> str:
    """Each task's answer computed another way than tasks.py does (ints, not string slicing)."""
    body = prompt[:-1]
    if name == "add":
        a, b = body.split("+")
        return str(int(a) + int(b)).zfill(3)
    if name == "double":  # digit by digit from the right, with the carry, as on paper
        out = ""
        carry = 0
        for c in reversed(body):
            carry, digit = divmod(2 * int(c) + carry, 10)
            out = str(digit) + out
        return str(carry) + out
    if name == "sort":
        return "".join(str(d) for d in sorted(int(c) for c in body))
    if name == "increment":
        return "".join(str(int(c) + 1)[-1] for c in body)
    return str(sum(c == "a" for c in body))  # count


def total(task, texts, refs):
    """Each completion's reward: the task's functions weighted and summed (as train.py does)."""
    weights = torch.tensor([w for _, w in task.rewards], dtype=torch.float64)
    return tasks.score(task, texts, refs) @ weights  # (N,)


NEW_TASKS = [tasks.add, tasks.double, tasks.sort, tasks.increment, tasks.count]


@pytest.mark.parametrize("task", NEW_TASKS, ids=lambda t: t.name)
def test_new_tasks_references_are_right_and_prompts_depend_on_content(task):
    rng = random.Random(0)
    pairs = [task.sample(rng) for _ in range(200)]
    assert len({p for p, _ in pairs}) > 100  # many prompts, not a handful to memorise
    assert len({r for _, r in pairs}) >= 5   # and the answer changes with them
    for prompt, ref in pairs:
        assert prompt.endswith("=") and ref == reference_of(task.name, prompt), prompt
        assert set(prompt + ref) <= set(task.alphabet)  # a fresh tokenizer encodes both
        assert task.max_new_tokens == len(ref) + 1  # the answer and its stop token
    # Fully correct is exactly the reference; the rewards then sum to their weights' total.
    prompt, ref = pairs[0]
    assert task.correct(ref, ref) and not task.correct(ref + "0", ref)
    assert total(task, [ref], [ref]).item() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("task,ref,partial", [
    (tasks.add, "132", ["1x2", "13", "1320", "192"]),
    (tasks.double, "0744", ["0745", "074", "07440", "1744"]),
    (tasks.sort, "1134", ["1135", "11", "0134", "11345"]),
    (tasks.increment, "4800", ["4801", "480", "9800", "48000"]),
    (tasks.count, "4", ["3", "5", "40", "4<pad>"]),
], ids=["add", "double", "sort", "increment", "count"])
def test_new_tasks_rewards_give_partial_credit_below_the_right_answer(task, ref, partial):
    full = total(task, [ref], [ref]).item()
    got = total(task, partial, [ref] * len(partial)).tolist()
    assert all(0 < g < full for g in got), got  # dense: neither nothing nor everything
    assert total(task, ["", "<pad>"], [ref] * 2).tolist() == [0.0, 0.0]


def test_count_credit_falls_with_the_distance_and_no_constant_answer_earns_much():
    values = [tasks.count_close(str(n), "4") for n in range(9)]
    assert values == [0.0, 0.0, 0.0, 0.5, 1.0, 0.5, 0.0, 0.0, 0.0]
    assert tasks.count_close("a", "4") == 0.0 and tasks.count_close("", "4") == 0.0
    rng = random.Random(0)
    refs = [tasks.count.sample(rng)[1] for _ in range(9000)]
    assert all(900 < refs.count(str(n)) < 1100 for n in range(9))  # uniform counts: 1000 +- 3.4 sd
    best_constant = max(sum(tasks.count_close(str(n), r) for r in refs) / len(refs)
                        for n in range(9))
    assert best_constant < 0.25  # 2/9 when uniform: the credit needs the prompt read


@pytest.mark.parametrize("text,number", [("so 12 apples", 12.0), ("1,234.5 then 7", 7.0), ("-3", -3.0),
                                         ("x = 1,234", 1234.0), ("none", None)])
def test_parse_number_takes_the_last_number(text, number):
    assert tasks.parse_number(text) == number


def test_jsonl_math_loads_gsm8k_style_answers_and_scores(tmp_path):
    f = tmp_path / "math.jsonl"
    f.write_text(json.dumps({"prompt": "2+2=", "answer": "two plus two #### 4"}) + "\n\n"
                 + json.dumps({"prompt": "3*3=", "answer": 9}) + "\n")
    task = tasks.jsonl_math(str(f))
    seen = {task.sample(random.Random(i)) for i in range(20)}
    assert seen == {("2+2=", "4.0"), ("3*3=", "9.0")}
    (correct, _), (fmt, _) = task.rewards
    assert correct("the answer is 4", "4.0") == 1.0 and correct("5", "4.0") == 0.0 and fmt("no", "4.0") == 0.0


def test_a_malformed_line_is_named_by_its_file_line_alone(tmp_path):
    """Regression: json's own "line 1 column 13" (of the one line it was given) followed the
    file's line number and contradicted it."""
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b" "answer": 2}\n')
    with pytest.raises(ValueError) as e:
        tasks.jsonl_math(str(f))
    assert str(e.value).startswith(f"{f}:3: not JSON (Expecting ',' delimiter at column 16)")
    assert "line 1" not in str(e.value)


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a"}\n', "expected a JSON object with 'prompt' and 'answer'"),
    ("not json\n", "expected one object with 'prompt' and 'answer' per line"),
    ('{"prompt": "a", "answer": "none"}\n', "holds no number"),
    ("", "no examples"),
    ('{"prompt": "a", "answer": [1, 2]}\n', "'answer' a string or a number, got str and list"),
    ('{"prompt": "a", "answer": true}\n', "'answer' a string or a number, got str and bool"),
    ('{"prompt": 7, "answer": "7"}\n', "'prompt' must be a string"),
])
def test_jsonl_math_errors_name_the_line(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=message):
        tasks.jsonl_math(str(f))
    with pytest.raises(ValueError, match="file not found"):
        tasks.jsonl_math(str(tmp_path / "missing.jsonl"))


# -----------------------------------------------------------------------------
# Scoring: TRL's sum over reward functions, and a clear error for anything that is not a reward


def test_score_gives_one_column_per_function_and_nan_for_none():
    """NaN (None) per function; grpo.combine_rewards then sums them as TRL does."""
    def first(c, r):
        return None if c[:1] in "12" else 1.0

    def half(c, r):
        return None if c[:1] == "1" else 0.5
    task = tasks.Task("t", tasks.sample_reverse, [(first, 1.0), (half, 2.0)])
    got = tasks.score(task, ["1x", "2x", "3x"], ["", "", ""])
    assert got.shape == (3, 2) and got.dtype == torch.float64
    assert got[0].isnan().all() and got[1, 0].isnan() and got[1:, 1].tolist() == [0.5, 0.5]
    # Anything float() reads as a number is a reward: bools, numpy and 0-d torch scalars.
    numbers = tasks.Task("n", tasks.sample_reverse, [(lambda c, r: True, 1.0),
                                                      (lambda c, r: np.float32(0.5), 1.0),
                                                      (lambda c, r: torch.tensor(0.25), 1.0)])
    assert tasks.score(numbers, ["a"], [""]).tolist() == [[1.0, 0.5, 0.25]]


@pytest.mark.parametrize("value,shown", [("good", "'good'"), (float("inf"), "inf"),
                                         ([1.0], r"\[1.0\]")])
def test_a_reward_that_is_not_a_finite_number_names_the_function(value, shown):
    def judge(c, r):
        return value
    task = tasks.Task("t", tasks.sample_reverse, [(judge, 1.0)])
    with pytest.raises(tasks.RewardError, match=f"task t: reward function judge returned {shown} "
                                                "on completion 'abc'"):
        tasks.score(task, ["abc"], ["ref"])


def test_a_reward_function_that_raises_is_named_with_its_input():
    def judge(c, r):
        return {}[c]
    task = tasks.Task("t", tasks.sample_reverse, [(judge, 1.0)])
    with pytest.raises(tasks.RewardError, match="reward function judge raised KeyError: 'abc' on "
                                                "completion 'abc' \\(reference 'ref'\\)"):
        tasks.score(task, ["abc"], ["ref"])


def test_jsonl_math_reads_conversations_and_gsm8k_questions(tmp_path):
    f = tmp_path / "chat.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    f.write_text(json.dumps({"prompt": chat, "answer": "4"}) + "\n"
                 + json.dumps({"question": "3*3?", "answer": "... #### 9"}) + "\n")
    task = tasks.jsonl_math(str(f))
    assert task.examples == [(chat, "4.0"), ("3*3?", "9.0")]
    split = tasks.eval_split(task, None, 64, 0)  # 2 distinct prompts: 1 held out, 1 trains
    assert len(split.examples) == 1 and "1 remain for training" in split.note
    f.write_text(json.dumps({"prompt": [{"content": "x"}], "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match="a prompt is a string or a conversation"):
        tasks.jsonl_math(str(f))


def test_a_finite_dataset_holds_out_at_most_half_and_training_never_draws_it():
    examples = [(f"{i}=", str(i)) for i in range(65)] + [("0=", "0")]  # a duplicate counts once
    task = tasks.Task("t", lambda rng: rng.choice(examples), examples=examples)
    split = tasks.eval_split(task, None, 64, seed=3)
    assert len(split.examples) == 32 and len(split.held_out) == 32
    assert "32 of the 65 distinct prompts" in split.note and "33 remain" in split.note
    rng = random.Random(0)
    drawn = {tasks.draw_training_example(task, split, rng)[0] for _ in range(2000)}
    assert len(drawn) == 33 and not drawn & split.held_out
    assert tasks.eval_split(task, None, 64, seed=3).examples == split.examples  # seeded


def test_task_data_that_is_no_jsonl_text_is_one_clear_line(tmp_path):
    """Regression: a folder was an IsADirectoryError traceback, a binary file a
    UnicodeDecodeError one."""
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)))
    for path in (tmp_path, binary):
        with pytest.raises(ValueError, match=f"{path}: cannot read it as a JSONL text"):
            tasks.jsonl_math(str(path))


def test_nan_counts_as_missing_and_numpy_bools_as_numbers():
    """A NaN reward is "cannot score", like None; numpy's bool was refused while Python's was a
    number."""
    task = tasks.Task("t", tasks.sample_reverse, [(lambda c, r: math.nan if c == "x" else
                                                   np.bool_(c == "y"), 1.0)])
    got = tasks.score(task, ["x", "y", "z"], ["", "", ""])
    assert got[0, 0].isnan() and got[1:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("reward", [1e300, -1e200])
def test_rewards_whose_statistics_overflow_are_refused(reward):
    """Finite rewards whose squares overflow would make the group std inf: every advantage 0."""
    task = tasks.Task("big", tasks.sample_reverse, [(lambda c, r: reward if c == "a" else 0.0,
                                                     1.0)])
    with pytest.raises(tasks.RewardError, match="task big: the rewards' mean or spread overflows"):
        tasks.total_rewards(task, ["a", "b"], ["", ""])
    assert tasks.total_rewards(task, ["b", "b"], ["", ""]).tolist() == [0.0, 0.0]


# -----------------------------------------------------------------------------
# chat_add: a chat question for a pretrained checkpoint, generated here


def test_chat_add_is_a_function_of_the_rng_and_its_references_are_sums():
    draws = [tasks.chat_add.sample(random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1]  # the same seed, the same question
    rng = random.Random(0)
    pairs = [tasks.chat_add.sample(rng) for _ in range(300)]
    assert len({tasks.prompt_key(p) for p, _ in pairs}) > 250  # 8,100 questions, few repeats
    for prompt, ref in pairs:
        (message,) = prompt  # one user message: the checkpoint's chat template renders it
        assert message["role"] == "user"
        a, b = re.fullmatch(r"What is (\d\d) \+ (\d\d)\?", message["content"]).groups()
        assert ref == str(int(a) + int(b))


@pytest.mark.parametrize("completion,right", [
    ("132", True), ("47 + 85 = 132", True), (" 132.", True), ("The sum is 132", True),
    ("131", False), ("47 + 85 = 1", False), ("132 + 1 = 133", False), ("1320", False),
    ("", False), ("To add 47 and 85, we need to", False), ("one hundred thirty-two", False),
])
def test_chat_add_counts_the_last_number_and_nothing_else(completion, right):
    """Right when the completion's last number is the sum; a completion cut off before it, a
    wrong sum, words, and no text at all are wrong, with reward 0, not "cannot score"."""
    got = total(tasks.chat_add, [completion], ["132"]).item()
    assert got == float(right) and tasks.chat_add.correct(completion, "132") is right


def test_chat_add_held_out_questions_are_never_trained_on():
    split = tasks.eval_split(tasks.chat_add, None, 64, seed=1)
    assert len(split.examples) == 64 and len(split.held_out) == 64
    assert split.examples == tasks.eval_split(tasks.chat_add, None, 64, seed=1).examples
    rng = random.Random(1)
    trained = {tasks.prompt_key(tasks.draw_training_example(tasks.chat_add, split, rng)[0])
               for _ in range(5000)}
    assert not trained & split.held_out and len(trained) > 3000
