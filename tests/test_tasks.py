"""tasks.py: the built-in tasks' sampling and rewards, and the JSONL loader's errors."""

import json
import random

import pytest

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


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a"}\n', "expected a JSON object with 'prompt' and 'answer'"),
    ("not json\n", "expected a JSON object"),
    ('{"prompt": "a", "answer": "none"}\n', "holds no number"),
    ("", "no examples"),
])
def test_jsonl_math_errors_name_the_line(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=message):
        tasks.jsonl_math(str(f))
    with pytest.raises(ValueError, match="file not found"):
        tasks.jsonl_math(str(tmp_path / "missing.jsonl"))
