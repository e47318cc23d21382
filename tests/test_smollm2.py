"""The engine on a real trained checkpoint, SmolLM2-135M-Instruct (30 layers, dim 576, 9/3 heads,
vocabulary 49,152, tied embeddings, ChatML), against transformers on the same directory: the
logits of chat prompts, and greedy completions against transformers' generate.

The checkpoint is not in the repository: SMOLLM2_DIR names its directory (default: models/smollm2
in the repository root), the Hub's HuggingFaceTB/SmolLM2-135M-Instruct as any download tool writes
it (`hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir models/smollm2`); every test here
is skipped when it is absent, or when transformers is not installed (not a requirement of the
engine).
"""

import os

import pytest
import torch

from engine import hf
import tolerance
from rollout import RolloutConfig, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.environ.get("SMOLLM2_DIR", os.path.join(ROOT, "models", "smollm2"))
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DIR, "config.json")),
                                reason=f"no SmolLM2 checkpoint at {DIR} (set SMOLLM2_DIR)")
QUESTIONS = ["What is 17 + 25?", "Name a colour of the sky.", "Write one word that rhymes with "
             "cat.", "Translate 'bonjour' into English."]


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CPU: spinning OpenMP threads cost more than they give
    ref = transformers.AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(DIR)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, return_dict=True)
                    ["input_ids"]) for q in QUESTIONS]
    yield hf.load_model(DIR).eval(), ref, prompts
    torch.set_num_threads(threads)


@torch.no_grad()
def test_logits_of_chat_prompts_equal_transformers(models):
    """fp32 on both sides, the same weights: the same math in a possibly different summation order
    (SDPA vs eager attention, fused RMSNorm): tests/tolerance.py's bound for 30 layers of sums
    (~2e-4 relative) at the logits' magnitude (~20)."""
    ours, ref, prompts = models
    for ids in prompts:
        x = torch.tensor([ids])
        want = ref(x).logits
        depth = tolerance.model_depth(ours.config, len(ids), "logits")
        torch.testing.assert_close(ours(x), want, **tolerance.reordered(depth, want.abs().max()))


@torch.no_grad()
def test_greedy_rows_equal_transformers_generate(models):
    """Greedy decoding with the checkpoint's own stop ids (config.json and generation_config.json):
    every row equals transformers' generate (do_sample=False), token for token, its eos included."""
    ours, ref, prompts = models
    new = 24
    config = hf.load_generation_config(DIR)
    stop_ids = hf.stop_token_ids(ours.config, config)
    out = generate(ours, prompts, RolloutConfig(num_samples=1, max_new_tokens=new, temperature=0.0),
                   stop_ids=stop_ids)
    for ids, row in zip(prompts, out.completions()):
        x = torch.tensor([ids])
        want = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=new, pad_token_id=stop_ids[0])[0, len(ids):].tolist()
        # transformers pads after its eos; the engine's row ends there
        cut = next((i + 1 for i, t in enumerate(want) if t in stop_ids), len(want))
        assert row == want[:cut]


@torch.no_grad()
def test_chat_calc_episodes_equal_transformers_turn_by_turn(models):
    """tasks:chat_calc greedy with its calculator: each row equals transformers' generate run turn
    by turn, where a turn that calls gets the tool message as transformers' apply_chat_template
    renders it (the tokens the full conversation adds after the assistant's end of turn, as TRL's
    tool loop cuts them) and generation goes on from the concatenated ids."""
    import random
    import tasks
    from engine import tokenizer as tk
    import tools
    from engine.episodes import Episodes
    from transformers import AutoTokenizer
    ours, ref, _ = models
    theirs = AutoTokenizer.from_pretrained(DIR)
    tok = tk.load_tokenizer(DIR, ours.config.vocab_size)
    stop_ids = hf.stop_token_ids(ours.config, hf.load_generation_config(DIR))
    rng = random.Random(0)
    examples = [tasks.chat_calc.sample(rng) for _ in range(6)]
    prompts = [tok.encode(p, tk.PromptConfig()) for p, _ in examples]
    responder = tools.TaskTools(tasks.chat_calc, tasks.chat_calc.call_tool, tok, (),
                                tools.ToolConfig()).start(examples, 1)
    new = tasks.chat_calc.max_new_tokens
    out = generate(ours, prompts, RolloutConfig(num_samples=1, max_new_tokens=new,
                                                temperature=0.0),
                   stop_ids=stop_ids, episodes=Episodes(responder, stop_ids, 2))
    assert sum(out.stats["calls"]) >= 1  # SmolLM2 calls on some of these prompts

    def tool_message(messages: list[dict], turn: str, result: str) -> list[int]:
        before = messages + [{"role": "assistant", "content": turn}]
        prefix = list(theirs.apply_chat_template(before, tokenize=True, return_dict=True)
                      ["input_ids"])
        full = list(theirs.apply_chat_template(before + [{"role": "tool", "content": result}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
        end = max(i for i, t in enumerate(prefix) if t in stop_ids) + 1  # the turn's end token
        assert full[:end] == prefix[:end]
        return full[end:]

    for (messages, reference), ids, row in zip(examples, prompts, out.completions()):
        seq, turns = list(ids), 0
        while len(seq) - len(ids) < new:
            x = torch.tensor([seq])
            more = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=new - (len(seq) - len(ids)),
                                pad_token_id=stop_ids[0])[0, len(seq):].tolist()
            cut = next((i + 1 for i, t in enumerate(more) if t in stop_ids), len(more))
            start = len(seq)
            seq += more[:cut]
            text = theirs.decode(seq[start:-1])
            result = tasks.calculator(tools.Completion(text), reference)
            if cut == len(more) and more[-1] not in stop_ids or result is None or turns == 2:
                break
            turns += 1
            message = tool_message(messages, text, result)
            if len(seq) - len(ids) + len(message) > new:  # past the budget: rolled back (TRL's)
                break
            seq += message
        assert row == seq[len(ids):len(ids) + new]
