"""engine/episodes.py and tools/: multi-turn rows against their slow twins. A tool's observation goes
into the row's KV cache without recomputing the row: greedy episodes equal a full recompute (and
transformers' generate) run turn by turn; the continued cache equals a fresh prefill of the whole
row; the sampler's logprobs of the policy's tokens equal the trainer's; observation tokens carry
no loss; a rollout with no call equals today's; tools that fail stop in one line."""

import json
import math
import os
import time

import pytest
import torch

import grpo
import rollout
import tasks
from engine import tokenizer as tk
import tolerance
import tools
from engine.episodes import Episodes
from model import Llama, ModelConfig
from rollout import RolloutConfig
from test_grpo import hf_checkpoint  # noqa: F401 (a fixture)
from test_train import records, run, write_module

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96)
PROMPTS = [[3, 17, 5, 99, 42, 8, 1], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7]]
CALLS = tuple(range(0, 128, 4))  # many call ids: a random model calls often
STOPS = (1, 2)


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CFG).init_weights(seed=0, std=0.2).eval()


def tool(row: int, tokens: list[int]) -> list[int] | None:
    """A deterministic tool of the row and its tokens: 1-4 observation tokens, or None (the
    episode ends) on every fifth length."""
    n = len(tokens)
    if n % 5 == 4:
        return None
    return [(row * 7 + n + i) % 128 for i in range(1 + (row + n) % 4)]


def episodes(max_turns: int) -> Episodes:
    return Episodes(lambda calls: [tool(r, t) for r, t in calls], CALLS, max_turns)


def recomputed_episode(model: Llama, prompt: list[int], row: int, budget: int,
                       max_turns: int) -> tuple[list[int], list[bool], bool, int]:
    """The slow twin: greedy, every token from a full forward of the whole row so far, the
    observation appended to the row as text would be."""
    seq, tokens, policy, calls = list(prompt), [], [], 0
    while len(tokens) < budget:
        with torch.no_grad():
            token = int(model(torch.tensor([seq]))[0, -1].argmax())
        seq.append(token)
        tokens.append(token)
        policy.append(True)
        if token in CALLS and calls < max_turns:
            observation = tool(row, tokens)
            if observation is None:
                return tokens, policy, True, calls
            if len(observation) > budget - len(tokens):  # rolled back, as TRL's tool loop does:
                return tokens, policy, token in STOPS, calls  # the row ends at its call
            calls += 1
            seq += observation
            tokens += observation
            policy += [False] * len(observation)
        elif token in CALLS or token in STOPS:
            return tokens, policy, token in STOPS, calls
    return tokens, policy, False, calls


@pytest.mark.parametrize("sync_every", [1, 3, 8])
@pytest.mark.parametrize("max_turns", [1, 3])
def test_greedy_episodes_equal_a_full_recompute_turn_by_turn(model, sync_every, max_turns):
    """Calls at every check phase (a row decodes past its call until the check, then is cut
    back), observations cut by the budget (the call not counted), a tool that ends the episode,
    turns used up."""
    out = rollout.generate(model, PROMPTS, RolloutConfig(num_samples=2, max_new_tokens=20,
                                                         temperature=0, sync_every=sync_every),
                           stop_ids=STOPS, episodes=episodes(max_turns))
    assert sum(out.stats["calls"]) >= len(PROMPTS)  # the case under test happens
    for r, got in enumerate(out.completions()):
        tokens, policy, stopped, calls = recomputed_episode(model, PROMPTS[r // 2], r, 20,
                                                           max_turns)
        assert got == tokens, r
        assert out.sampled[r, :len(got)].tolist() == policy
        assert bool(out.stopped[r]) == stopped and out.stats["calls"][r] == calls


def test_the_continued_cache_equals_a_fresh_prefill_of_the_whole_row(model, monkeypatch):
    """Each row's own K/V after its episodes (observations prefilled at their positions, tokens
    decoded past a call overwritten) equals what one forward of prompt + episode writes."""
    decoders = []
    real = rollout._decode

    def keep(decoder, *args):
        decoders.append(decoder)
        return real(decoder, *args)
    monkeypatch.setattr(rollout, "_decode", keep)
    out = rollout.generate(model, PROMPTS, RolloutConfig(num_samples=2, max_new_tokens=20,
                                                         temperature=0, sync_every=3),
                           episodes=episodes(3))  # no stop ids: rows end at their budget
    d = decoders[0]
    order = sorted(range(len(PROMPTS)), key=lambda i: -len(PROMPTS[i]))  # generate's sort
    checked = 0
    slots = torch.arange(len(d.ids)) if d.grid.scatter is None else d.grid.scatter  # (B,)
    for row, slot in zip(d.ids.tolist(), slots.tolist()):  # the rows active at the last sync
        caller = order[row // 2] * 2 + row % 2
        prompt, episode = PROMPTS[order[row // 2]], out.completions()[caller]
        keys = {}

        def capture(layer, q, k, v):
            keys[layer] = (k[0], v[0])  # (Hkv, T, D)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=True)
        with torch.no_grad():
            model.hidden(torch.tensor([prompt + episode]), None, capture)
        n = len(episode) - 1  # the last token is never fed
        # float32, other summation orders: at most the whole stack's chain, at the K/V's magnitude
        depth = tolerance.model_depth(CFG, len(prompt) + n, "hidden")
        for layer, (k, v) in keys.items():
            own_k = d.views[2][layer][slot, :, :n]
            own_v = d.views[3][layer][slot, :, :n]
            for got, want in ((own_k, k), (own_v, v)):
                want = want[:, len(prompt):len(prompt) + n]
                torch.testing.assert_close(got, want,
                                           **tolerance.reordered(depth, want.abs().max()))
        checked += 1
    assert checked and sum(out.stats["calls"]) > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sampled_logprobs_of_the_policys_tokens_equal_the_trainers(dtype):
    """The trainer's forward (grpo.completion_logprobs: observations as context, the loss mask on
    the policy's tokens) scores each sampled token as the sampler did; observation tokens carry
    logprob 0. float64: equal up to the float32 the sampler stores its logprobs in (half an ulp of
    a logprob of -8 is 4.8e-7). float32: two summation orders of the forward's chain of sums, at
    the logits' magnitude over the temperature (tests/tolerance.py; the logits reach ~6 here)."""
    model = Llama(CFG).init_weights(seed=0, std=0.2).eval().to(dtype)
    out = rollout.generate(model, PROMPTS, RolloutConfig(num_samples=4, max_new_tokens=24,
                                                         temperature=0.9, sync_every=4),
                           stop_ids=STOPS, seed=3, episodes=episodes(3))
    assert sum(out.stats["calls"]) > 0 and not out.sampled[out.mask].all()
    assert (out.logprobs[~out.sampled] == 0).all()
    batch = grpo.GRPOBatch.from_rollout(PROMPTS, out, 24, torch.zeros(len(out.tokens)))
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(model, batch)
    d = (logp - out.logprobs.to(dtype))[batch.loss_mask(grpo.GRPOConfig())].abs()
    if dtype == torch.float64:
        assert d.mean() <= 2e-7 and d.max() <= 1e-6, (d.mean(), d.max())
        return
    with torch.no_grad():
        logits = model(batch.prompt_ids)  # (B, P, V): the magnitude a log-softmax's error has
    tol = tolerance.reordered(tolerance.model_depth(CFG, CFG.max_position_embeddings),
                              logits.abs().max() / 0.9)
    assert d.max() <= tol["atol"], (d.max(), tol)


def test_a_rollout_without_a_call_equals_todays_bit_for_bit(model):
    """A task with a tool whose rows never call: the same tokens, logprobs and stops as the
    rollout without episodes (the same steps, drops and draws)."""
    cfg = RolloutConfig(num_samples=4, max_new_tokens=16, temperature=1.0, sync_every=3)
    plain = rollout.generate(model, PROMPTS, cfg, stop_ids=STOPS, seed=5)
    never = Episodes(lambda calls: [[9] for _ in calls], (127,), 2)  # an id nobody samples
    with_tool = rollout.generate(model, PROMPTS, cfg, stop_ids=STOPS, seed=5, episodes=never)
    assert sum(with_tool.stats["calls"]) == 0 and plain.stats["compactions"] > 0
    assert torch.equal(plain.tokens, with_tool.tokens) and torch.equal(plain.mask, with_tool.mask)
    assert torch.equal(plain.logprobs, with_tool.logprobs)
    assert torch.equal(plain.stopped, with_tool.stopped)
    assert torch.equal(with_tool.sampled, plain.mask)


class FakeGraph:
    """decode.GraphedStep's stand-in on a CPU: the step runs eagerly at every replay, on copies of
    the inputs as a graph's; `captured` counts the graphs a rollout would capture, by bucket."""
    captured: list[int] = []

    def __init__(self, step, *inputs):
        FakeGraph.captured.append(len(inputs[0]))
        self.step, self.inputs = step, [x.clone() for x in inputs]

    def __call__(self, *inputs):
        for mine, x in zip(self.inputs, inputs):
            mine.copy_(x)
        return self.step(*self.inputs)


def graphed_rollouts(model: Llama, monkeypatch, cfg: RolloutConfig, episodes) -> tuple:
    """The rollout on a decoder that captures graphs (FakeGraph; the plain attention, as a
    graph's: all Tc own keys under each row's mask), its captures, and the row counts it met."""
    from engine import decode
    monkeypatch.setattr(decode, "GraphedStep", FakeGraph)
    counts = []

    def graphed(model, views, lens, _, compiled=False):
        d = decode.Decoder(model, views, lens, True, compiled)
        real = d.decode

        def counted(tokens):
            counts.append(len(tokens))
            return real(tokens)
        d.decode = counted
        return d
    monkeypatch.setattr(rollout, "Decoder", graphed)
    FakeGraph.captured = []
    out = rollout.generate(model, PROMPTS, cfg, stop_ids=STOPS, seed=5, episodes=episodes)
    monkeypatch.undo()
    return out, FakeGraph.captured, counts


def test_graphs_are_captured_once_a_bucket_and_equal_the_eager_decode(model, monkeypatch):
    """CUDA graphs per bucket of rows (1, 2, 4, 8, then every 16), the rows padded up to it: the CPU
    stands in for CUDA (FakeGraph). Rows drop at every sync as on the eager route, each bucket met
    is captured once and never again, and in float64 the graphed rollout (the whole grid, padded
    rows, all own keys masked) draws the eager one's tokens with its logprobs (the slow twin: the
    compacted grid, the written keys alone); with a tool, the same, episodes and all."""
    from engine import decode
    assert [decode.bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 8, 8, 16, 16,
                                                                        32, 48]
    wide = Llama(CFG).init_weights(seed=0, std=0.2).double().eval()
    cfg = RolloutConfig(num_samples=4, max_new_tokens=16, temperature=1.0, sync_every=3)
    for tool in (None, episodes(3)):
        monkeypatch.setattr(decode, "_CPU_FLASH", None)  # the eager twin: the plain route too
        eager = rollout.generate(wide, PROMPTS, cfg, stop_ids=STOPS, seed=5, episodes=tool)
        out, captured, counts = graphed_rollouts(wide, monkeypatch, cfg, tool)
        assert out.stats["compactions"] == eager.stats["compactions"] > 0
        assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.mask, eager.mask)
        torch.testing.assert_close(out.logprobs, eager.logprobs, rtol=0, atol=1e-9)
        assert len(captured) == len(set(captured)), "a bucket captured twice"
        assert set(captured) <= {decode.bucket(n) for n in counts} and len(set(counts)) > 1
        assert captured[0] == decode.bucket(len(PROMPTS) * 4)
        if tool is None:  # every step in lockstep: a graph for each bucket met
            assert set(captured) == {decode.bucket(n) for n in counts}


def test_on_a_graphed_decoder_a_rollout_without_a_call_equals_the_tool_less_one(model, monkeypatch):
    """Issue 43, item 5: the episode loop's rows, and then its draws, differed from the tool-less
    loop's on CUDA. On a decoder that captures graphs (FakeGraph), a rollout with no call equals
    the tool-less one bit for bit, graphs and all."""
    cfg = RolloutConfig(num_samples=4, max_new_tokens=16, temperature=1.0, sync_every=3)
    never = Episodes(lambda calls: [[9] for _ in calls], (127,), 2)  # an id nobody samples
    plain, captured, _ = graphed_rollouts(model, monkeypatch, cfg, None)
    with_tool, captured_too, _ = graphed_rollouts(model, monkeypatch, cfg, never)
    assert sum(with_tool.stats["calls"]) == 0 and plain.stats["compactions"] > 0
    assert captured == captured_too
    for key in ("tokens", "mask", "logprobs", "stopped"):
        assert torch.equal(getattr(plain, key), getattr(with_tool, key)), key


def test_greedy_episodes_equal_transformers_generate_turn_by_turn(tmp_path):
    """transformers' generate until a call or a stop, the observation appended, generate again."""
    from hf_reference import save_random_hf_model
    from engine import hf
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  eos_token_id=1, bos_token_id=3)
    theirs = save_random_hf_model(tmp_path, "LlamaConfig", config)
    ours = hf.load_model(str(tmp_path))
    out = rollout.generate(ours, PROMPTS, RolloutConfig(num_samples=1, max_new_tokens=20,
                                                        temperature=0, sync_every=4),
                           stop_ids=(1,), episodes=episodes(2))
    assert sum(out.stats["calls"]) > 0
    for r, prompt in enumerate(PROMPTS):
        seq, calls = list(prompt), 0
        while len(seq) - len(prompt) < 20:
            x = torch.tensor([seq])
            with torch.no_grad():
                more = theirs.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=20 - (len(seq) - len(prompt)),
                                       eos_token_id=[1, *CALLS], pad_token_id=0)[0, len(seq):]
            seq += more.tolist()
            if seq[-1] not in CALLS or calls == 2:
                break
            calls += 1
            observation = tool(r, seq[len(prompt):])
            if observation is None or len(seq) - len(prompt) + len(observation) > 20:
                break  # the episode's end, or an answer past the budget: rolled back
            seq += observation
        assert out.completions()[r] == seq[len(prompt):], r

# -----------------------------------------------------------------------------
# Training on episodes: observation tokens are context, not policy


def twin_loss(model: Llama, prompts, completions, policy, advantages, old_logp,
              cfg: grpo.GRPOConfig) -> torch.Tensor:
    """float64, by hand: each row's full forward; the sums run over the policy's tokens only."""
    total, n_policy = 0.0, sum(sum(p) for p in policy)
    for r, (completion, keep) in enumerate(zip(completions, policy)):
        prompt = prompts[r // (len(completions) // len(prompts))]
        logits = model(torch.tensor([prompt + completion]))[0, len(prompt) - 1:-1]  # (T, V)
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        row = 0.0
        for t in (t for t, k in enumerate(keep) if k):
            ratio = torch.exp(logp[t] - old_logp[r, t])
            a = advantages[r]
            clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
            row = row - torch.min(ratio * a, clipped * a) - cfg.entropy_coef * entropy[t]
        if cfg.loss_type == "grpo":
            total = total + row / max(sum(keep), 1) / len(completions)
        else:  # dapo: the token mean over the batch's policy tokens
            total = total + row / n_policy
    return total


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_loss_and_gradients_with_observations_masked_equal_a_twin_that_drops_them(loss_type):
    """grpo.accumulate on a batch whose rows interleave policy and observation tokens (a row all
    observation but its first token, a row with none) against twin_loss, in float64; the
    observation tokens are in the forward (context) but in no sum, count or metric. Without the
    mask the gradients are 10-100% off."""
    model = Llama(CFG).init_weights(seed=1, std=0.1).double()
    prompts = [[5, 6, 7], [9], [20, 21, 22, 23, 24]]
    gen = torch.Generator().manual_seed(0)
    completions, policy = [], []
    for r in range(6):
        n = [7, 1, 5, 9, 3, 6][r]
        completions.append(torch.randint(3, 128, (n,), generator=gen).tolist())
        policy.append([True] if r == 2 else [t % 3 != 1 for t in range(n)] if r % 2 else [True] * n)
    policy[2] += [False] * (len(completions[2]) - 1)
    advantages = torch.randn(6, generator=gen, dtype=torch.float64)
    batch = grpo.GRPOBatch.from_lists(prompts, completions, advantages=advantages)
    batch.sampled = torch.zeros(batch.mask.shape, dtype=torch.bool)
    for r, keep in enumerate(policy):
        batch.sampled[r, :len(keep)] = torch.tensor(keep)
    cfg = grpo.GRPOConfig(loss_type=loss_type, entropy_coef=0.1, micro_batch_groups=2)
    with torch.no_grad():
        batch.old_logp = grpo.batch_logprobs(model, batch, cfg) + 0.3 * torch.randn(
            batch.mask.shape, generator=gen, dtype=torch.float64)  # ratios off 1: clipping
    metrics = grpo.accumulate(model, batch, cfg)
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = twin_loss(model, prompts, completions, policy, advantages, batch.old_logp, cfg)
    want.backward()
    assert metrics["tokens"] == sum(map(sum, policy)) < int(batch.mask.sum())
    assert math.isclose(metrics["loss"], want.item(), rel_tol=1e-7)  # metrics leave as float32
    for name, p in model.named_parameters():  # float64: summation order only
        assert (ours[name] - p.grad).abs().max() <= 1e-12 * p.grad.abs().max(), name

# -----------------------------------------------------------------------------
# Tools: answers, failures, chat checkpoints


def test_a_tools_failure_is_one_line_naming_the_task_and_the_input():
    def broken(text, ref):
        raise KeyError("boom")

    def slow(text, ref):
        time.sleep(30)

    def wrong_type(text, ref):
        return 42

    def strict(text, ref):
        raise tools.ToolError("no such key")
    cases = [(broken, "tool broken raised KeyError: 'boom' on text '?ab'"),
             (slow, "tool slow did not answer within --tool_timeout 0.2 s on text '?ab'"),
             (wrong_type, "tool wrong_type returned int '42' on text '?ab'")]
    for fn, message in cases:
        started = time.perf_counter()
        with pytest.raises(tools.ToolFailure) as e:
            tools.call_tools(tasks.lookup, fn, [("?ab", "47")], timeout=0.2)
        assert f"task lookup: {message}" in str(e.value) and "\n" not in str(e.value)
        assert time.perf_counter() - started < 5  # the hung thread is left behind, not awaited
    assert tools.call_tools(tasks.lookup, strict, [("?ab", "47")], 1.0) == [("error: no such key", True)]
    assert tools.call_tools(tasks.lookup, tasks.look_up, [("?", "47")], 1.0) == [("47", False)]


def write_tool_task(tmp_path, body: str, budget: int = 7) -> str:
    """mytool:task, the lookup task with the tool `tool` defined by body (and letters enough
    for its error messages)."""
    return write_module(tmp_path, "mytool", "import string, tools\n" + body + "\ntask = tasks.Task("
                        "'mytool', tasks.sample_lookup, tasks.lookup.rewards, alphabet="
                        "tasks.lookup.alphabet + string.ascii_lowercase + ': ', max_new_tokens="
                        f"{budget}, call_tool=tools.CallTool(tool, call='?'))\n")


def test_a_tool_that_raises_mid_run_stops_after_a_checkpoint_of_the_last_step(tmp_path, capsys):
    spec = write_tool_task(tmp_path, "calls = []\ndef tool(text, ref):\n    calls.append(1)\n"
                                     "    if len(calls) > 20:\n        raise RuntimeError('gone')\n"
                                     "    return ref + '='\n")
    code, out = run(tmp_path, "--task", spec, "--steps", "50", "--eval_every", "0")
    err = capsys.readouterr().err
    assert code == 2 and "task mytool: tool tool raised RuntimeError: gone on text '" in err
    done = len(records(out))
    assert done >= 1 and f"the last finished step is saved at {out}/step-{done:06d}" in err


def test_a_run_with_a_tool_logs_its_calls_and_errors_and_false_turns_it_off(tmp_path, capsys):
    spec = write_tool_task(tmp_path, "import tools\ndef tool(text, ref):\n"
                                     "    if len(text) > 1:\n"
                                     "        raise tools.ToolError('call first')\n"
                                     "    return ref + '='\n",
                           budget=24)  # "error: call first" fits
    code, out = run(tmp_path, "--task", spec, "--steps", "3", "--eval_every", "0",
                    "--max_turns", "3")
    recs = records(out)
    assert code == 0 and all(r["tool_calls"] > 0 for r in recs)
    assert sum(r["tool_errors"] for r in recs) > 0  # a random model calls anywhere
    code, out = run(tmp_path, "--task", spec, "--steps", "1", "--eval_every", "0",
                    "--use_tools", "false", out="off")
    assert code == 0 and "tool_calls" not in records(out)[0]


def test_a_run_with_a_tool_resumes_exactly(tmp_path):
    """Stopped at step 2 and resumed: the same episodes (rewards, calls) and losses."""
    args = ["--task", "tasks:lookup", "--steps", "4", "--save_every", "2", "--eval_every", "2",
            "--eval_prompts", "8"]
    code, full = run(tmp_path, *args, out="full")
    assert code == 0
    code, resumed = run(tmp_path, *args, "--resume", os.path.join(full, "step-000002"),
                        out="resumed")
    a, b = records(full)[2:], records(resumed)
    assert code == 0 and [r["step"] for r in b] == [3, 4] and a[0]["tool_calls"] > 0
    keys = ("reward", "loss", "entropy", "tool_calls", "eval_reward")
    assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]


def test_an_answer_the_tokenizer_cannot_write_stops_the_run_in_one_line(tmp_path, capsys):
    spec = write_tool_task(tmp_path, "def tool(text, ref):\n    return 'ÿ'\n")
    code, _ = run(tmp_path, "--task", spec, "--steps", "2", "--eval_every", "0")
    err = capsys.readouterr().err
    assert code == 2 and "task mytool: the tool's observation 'ÿ' to text '" in err
    assert "cannot go into the row" in err and err.count("\n") == 1


def test_an_error_message_the_tokenizer_cannot_write_is_cut_to_what_it_can_and_said_once(
        tmp_path, capsys):
    """Regression: a ToolError's "error: ..." (the model's mistake, free text) stopped a fresh
    model's run as a tool failure when a character of it was outside the task's alphabet. Now the
    row gets the characters the tokenizer writes, and one line says which were dropped."""
    spec = write_module(tmp_path, "badcall", "import tools\ndef tool(text, ref):\n"
                        "    raise tools.ToolError('Bad call!')\n"
                        "task = tasks.Task('badcall', tasks.sample_lookup, tasks.lookup.rewards, "
                        "alphabet=tasks.lookup.alphabet + 'lo', max_new_tokens=24, "
                        "call_tool=tools.CallTool(tool, call='?'))\n")
    code, out = run(tmp_path, "--task", spec, "--steps", "2", "--eval_every", "0")
    said = capsys.readouterr().out
    assert code == 0 and sum(r["tool_errors"] for r in records(out)) > 0
    lines = [line for line in said.splitlines() if "dropped from the rows" in line]
    assert len(lines) == 1 and "' !:Ber'" in lines[0], lines  # "error: Bad call!" less "abcdlo"



def test_a_task_file_written_against_the_former_names_runs_unchanged(tmp_path, capsys):
    """A task file as the README wrote it before the call-token tool was named CallTool
    (`tasks.Task(..., tool=tools.Tool(fn, call))`, `tools.ToolError`, `tasks.calculator`) runs
    unchanged, its tool called; the former flag `--tools false` stops in one line naming
    --use_tools."""
    spec = write_module(tmp_path, "oldtool", "import tools\ndef tool(text, ref):\n"
                        "    if len(text) > 1:\n        raise tools.ToolError('no')\n"
                        "    return ref\n"
                        "assert tasks.calculator(tools.Completion('<calc>2*3</calc>'), '') "
                        "== 'result: 6'\n"
                        "task = tasks.Task('oldtool', tasks.sample_lookup, tasks.lookup.rewards, "
                        "alphabet=tasks.lookup.alphabet + 'enor: ', max_new_tokens=12, "
                        "tool=tools.Tool(tool, call='?'))\n")
    code, out = run(tmp_path, "--task", spec, "--steps", "2", "--eval_every", "0",
                    "--max_turns", "2")
    recs = records(out)
    assert code == 0 and sum(r["tool_calls"] for r in recs) > 0
    assert sum(r["tool_errors"] for r in recs) > 0  # ToolError told to the model, counted
    assert tools.Tool is tools.CallTool
    assert tasks.load_task(spec, "").call_tool.fn.__name__ == "tool"
    capsys.readouterr()
    code, _ = run(tmp_path, "--task", spec, "--steps", "1", "--tools", "false", out="off")
    err = capsys.readouterr().err
    assert code == 2 and err == ("error: unknown option --tools (renamed): did you mean "
                                 "--use_tools?\n")

def test_a_call_token_that_is_not_one_token_is_refused_in_one_line(tmp_path, capsys):
    spec = write_module(tmp_path, "longcall", "import tools\ntask = tasks.Task('longcall', "
                        "tasks.sample_lookup, tasks.lookup.rewards, alphabet=tasks.lookup.alphabet,"
                        " max_new_tokens=7, call_tool=tools.CallTool(tasks.look_up, call='??'))\n")
    code, _ = run(tmp_path, "--task", spec, "--steps", "1")
    err = capsys.readouterr().err
    assert code == 2 and "task longcall: the tool's call token '??' is 2 tokens" in err


def test_a_chat_checkpoints_observation_is_the_templates_tool_message(tmp_path):
    """chat_calc on a ChatML (Qwen2.5-shaped) checkpoint: the turn that ends with a call gets
    the tool message as the template writes it after the assistant's content; a turn with no call
    ends the episode; a malformed expression is the model's error, told to it."""
    from test_tokenizer import write_checkpoint
    path = write_checkpoint(tmp_path / "qwen", "qwen")
    tokenizer = tk.load_tokenizer(path)
    prompt, reference = tasks.chat_calc.sample(__import__("random").Random(0))
    task_tools = tools.TaskTools(tasks.chat_calc, tasks.chat_calc.call_tool, tokenizer, (),
                                 tools.ToolConfig())
    responder = task_tools.start([(prompt, reference)] * 3, 1)
    end = tokenizer.tok.token_to_id("<|im_end|>")
    call = tokenizer.encode_text("Let me see. <calc>12 * 3</calc>", add_special_tokens=False)
    plain = tokenizer.encode_text("It is 36.", add_special_tokens=False)
    bad = tokenizer.encode_text("<calc>12 * x</calc>", add_special_tokens=False)
    answers = responder([(0, call + [end]), (1, plain + [end]), (2, bad + [end])])
    turn = "\n<tool_response>\nresult: 36\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(answers[0]) == "\n<|im_start|>user" + turn
    assert answers[1] is None
    assert "error: '12 * x' is not arithmetic" in tokenizer.decode(answers[2])
    # the error counts once its answer is in the row (engine/episodes.py's calls), not before
    assert responder.errors([1, 0, 1]) == 1 and responder.errors([1, 0, 0]) == 0
    # row 0 goes on: its next call reads its own turn, the tool's observation a part of its own
    more = tokenizer.encode_text("So <calc>36 + 1</calc>", add_special_tokens=False)
    episode = responder.completion(0, call + [end] + answers[0] + more + [end])
    assert episode.observations == [tokenizer.decode(answers[0])]
    assert episode.answer == "So <calc>36 + 1</calc><|im_end|>"
    # TRL's view of the same row: the model's turns, the tool's message as the tool wrote it
    assert responder.conversation(0, call + [end] + answers[0] + more) == [
        {"role": "assistant", "content": "Let me see. <calc>12 * 3</calc><|im_end|>"},
        {"role": "tool", "content": "result: 36"},
        {"role": "assistant", "content": "So <calc>36 + 1</calc>"}]
    assert tokenizer.decode(responder([(0, call + [end] + answers[0] + more + [end])])[0]) == (
        "\n<|im_start|>user" + turn.replace("36", "37"))


RESULT = "\n<|im_start|>tool\nresult: 304468<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("parts,right", [
    ([("<calc>412*739</calc>", True), (RESULT, False), ("So 304468.", True)], 1.0),
    ([("<calc>412*739</calc>", True), (RESULT, False), ("I am done.", True)], 0.0),
    ([("I know: result: 304468", True), (RESULT, False), ("I am done.", True)], 0.0),
    ([("304468", True)], 1.0), ([("", True)], 0.0)])
def test_chat_calc_scores_what_the_model_wrote_after_the_last_result(parts, right):
    """The calculator's result is the tool's text, not the model's answer: only what the model
    wrote after the tool's last answer is scored (its own "result: N" before the call too)."""
    completion = tools.Completion("".join(t for t, _ in parts), parts)
    assert tasks.calc_correct(completion, "304468") == right


def test_a_completion_tells_the_models_text_from_the_tools():
    parts = [("?", True), ("47", False), ("?", True), ("47", False), ("74", True)]
    c = tools.Completion("?47?4774", parts)
    assert c == "?47?4774" and c.model_text == "??74" and c.answer == "74"
    assert c.observations == ["47", "47"] and tools.Completion("31").answer == "31"
    decode = "".join  # a character tokenizer: ids are characters
    assert tools.split_parts(decode, list("?47?4774"), [True, False, False, True, False, False,
                                                         True, True]) == parts


def episode(*parts: str, stopped: bool = True) -> tools.Completion:
    """A character-level episode: parts alternate the model's text and the tool's observations."""
    return tools.Completion("".join(parts), [(p, i % 2 == 0) for i, p in enumerate(parts)],
                            stopped)


@pytest.mark.parametrize("task,calls,reference,right,traps", [
    (tasks.lookup_copy, 1, "47", ("?", "47", "47"),
     [episode("?", "47", "?", "47"), episode("47?", "47"), episode("31", stopped=False)]),
    (tasks.lookup_reverse, 1, "47", ("?", "47", "74"),
     [episode("?", "47", "?", "47"), episode("74?", "47"), episode("31", stopped=False)]),
    (tasks.lookup_inorder, 2, "4+7", ("?", "4", "?", "7", "47"),
     [episode("?", "4", "?", "7", "?"), episode("47?", "4", "?", "7"),
      episode("?", "4", "47", stopped=False)]),
    (tasks.lookup_pair, 2, "4+7", ("?", "4", "?", "7", "74"),
     [episode("?", "4", "?", "7", "?"), episode("74?", "4", "?", "7"),
      episode("?", "4", "74", stopped=False)]),
    (tasks.lookup_sum, 2, "4+3", ("?", "4", "?", "3", "07"),
     [episode("?", "4", "?", "3", "?"), episode("07?", "4", "?", "3"),
      episode("?", "4", "07", stopped=False)])])
def test_answer_reading_rewards_pay_the_models_answer_never_the_tools_text(task, calls, reference,
                                                                           right, traps):
    """Full credit for the calls and the model's own answer, and the budget holds exactly that
    episode; a call that brings the value in after the answer and an answer written before the
    call earn the calls' credit alone, a wrong guess the credit of the calls answered (after one
    call of two, nothing for its answer, right or not). The right digits in each other's places
    earn 0.2 beside the calls'."""
    n = len(traps)
    score = tasks.total_rewards(task, [episode(*right), *traps], [reference] * (1 + n)).tolist()
    assert score[0] == pytest.approx(1.0)
    assert tasks.correct_flags(task, [episode(*right)], [reference])[0]
    assert task.max_new_tokens == len("".join(right))
    assert score[1:3] == [pytest.approx(0.2)] * 2, score
    assert score[3] == pytest.approx(0.2 * (calls - 1) / calls), score
    assert not any(tasks.correct_flags(task, traps, [reference] * n))
    swapped = episode(*right[:-1], right[-1][::-1])
    assert tasks.total_rewards(task, [swapped], [reference]).item() == pytest.approx(0.4)
    assert tasks.look_up_next(episode("?", "4", "?", "7", "?"), "4+7") is None  # no third value


@pytest.mark.parametrize("expression", [
    "1" + "0" * 400 + " / 3",     # OverflowError: an int division too large for a float
    "1" + "0" * 400 + " * 1.5",   # OverflowError: an int too large to convert to float
    "9" * 2000 + " * " + "9" * 2500,  # ValueError: an int of over 4300 digits to print
    "-" * 5000 + "1",             # RecursionError in the parser
    "-" * 200000 + "1",           # MemoryError in the parser
    "(" * 300 + "1" + ")" * 300,  # SyntaxError: too many nested parentheses
    "1e999", "1e999 - 1e999", "1e308 * 10",  # inf and nan: not a number to answer
    "1\x00", "1 / 0", "__import__('os')", "2 ** 8", "1 +"])
def test_every_exception_a_malformed_call_can_cause_is_the_models_tool_error(expression):
    """What the model writes is the model's mistake: the calculator raises ToolError (told to
    the row), never the exception that stops the run."""
    with pytest.raises(tools.ToolError):
        tasks.calculator(tools.Completion(f"<calc>{expression}</calc>"), "")


def test_the_calculator_answers_the_turn_that_called_and_computes_only_arithmetic():
    def calc(text):
        return tasks.calculator(tools.Completion(text), "")
    assert calc("<calc>(2 + 3) * 4</calc>") == "result: 20"
    assert calc("<calc>7 / 2</calc>") == "result: 3.5"
    assert calc("<calc>2.5e20</calc>") == "result: 250000000000000000000"
    assert calc("<calc>1 + 1</calc> then <calc>2 * 3</calc>") == "result: 6"  # the turn's last
    assert calc("no call here") is None
    answered = tools.Completion("<calc>1+1</calc>result: 2so 2", [("<calc>1+1</calc>", True),
                                                              ("result: 2", False), ("so 2", True)])
    assert tasks.calculator(answered, "") is None  # answered already: this turn holds no call


def scripted_chat_checkpoint(path, script: str, added: tuple[str, ...] = ("<calc>", "</calc>")
                             ) -> str:
    """A ChatML checkpoint (test_tokenizer's, with `added` as tokens, <calc> and </calc>) whose
    model writes `script` and ends its turn after every generation prompt, sampled or greedy: its
    layers add nothing to the residual (o_proj and down_proj 0), so the next token is a function
    of the current one alone, a table written into the embeddings (one-hot rows) and the head."""
    from tokenizers import Tokenizer
    import random
    from engine import hf
    from test_tokenizer import write_checkpoint
    path = write_checkpoint(path, "qwen")
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.add_tokens(list(added))
    tok.save(os.path.join(path, "tokenizer.json"))
    tokenizer = tk.load_tokenizer(path)
    prompt = tokenizer.encode(tasks.chat_calc.sample(random.Random(0))[0], tk.PromptConfig())
    chain = [prompt[-1], *tokenizer.encode_text(script, add_special_tokens=False),
             tokenizer.tok.token_to_id("<|im_end|>")]
    assert len(set(chain[:-1])) == len(chain) - 1  # one successor a token
    model = hf.load_model(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (token, after) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, i] = 1.0
            model.lm_head.weight[after, i] = 10.0  # a logit of ~57 after the norm: certain
    hf.save_model(model, path)
    return path


@pytest.mark.parametrize("script,errors", [("<calc>4*9</calc>", 0), ("<calc>4*x</calc>", 1)])
@pytest.mark.parametrize("max_turns", [1, 2])
def test_chat_calc_answers_a_chat_checkpoints_calls_end_to_end(tmp_path, script, errors,
                                                                 max_turns):
    """train.py --model (a ChatML checkpoint that calls the calculator after every generation
    prompt, the tool's message's included) --task tasks:chat_calc: every call is answered within
    the turns (one call a turn; the call past --max_turns ends the row), a malformed one is the
    model's error, counted; the tool's message is in the row and the reward reads the model's
    text after it."""
    path = scripted_chat_checkpoint(tmp_path / "qwen", script)
    code, out = run(tmp_path, "--model", path, "--task", "tasks:chat_calc", "--steps", "1",
                    "--eval_every", "1", "--eval_prompts", "2", "--max_new_tokens", "256",
                    "--max_turns", str(max_turns))
    record = records(out)[0]
    assert code == 0 and record["tool_calls"] == max_turns
    assert record["tool_errors"] == errors * max_turns * 4 * 4  # every sampled row's calls
    with open(os.path.join(out, "samples.jsonl")) as f:
        sample = json.loads(f.readline())
    answer = "result: 36" if not errors else "error: '4*x' is not arithmetic"
    assert sample["completion"].count(script) == max_turns + 1
    assert sample["completion"].count(answer) == max_turns and sample["stopped"]
    assert sample["reward"] == 0.0  # "4*9" after the last answer: 9 is not the product

def test_a_call_whose_answer_the_budget_cuts_counts_as_no_call_and_no_error(tmp_path):
    """The call's answer (an error message) does not fit in what is left of the budget: as TRL's
    tool loop, the answer is rolled back, the row ends at its call (stopped: the call is the
    end of the model's turn), and neither the call nor its error counts."""
    path = scripted_chat_checkpoint(tmp_path / "qwen", "<calc>4*x</calc>")
    code, out = run(tmp_path, "--model", path, "--task", "tasks:chat_calc", "--steps", "1",
                    "--eval_every", "1", "--eval_prompts", "2", "--max_new_tokens", "40")
    record = records(out)[0]
    assert code == 0 and record["tool_calls"] == 0 and record["tool_errors"] == 0
    with open(os.path.join(out, "samples.jsonl")) as f:
        sample = json.loads(f.readline())
    assert sample["completion"] == "<calc>4*x</calc>" and sample["stopped"]

# -----------------------------------------------------------------------------
# Against TRL 1.16: its multi-turn path (rollout_func with env_mask, the mask its tool loop
# builds) on our episodes


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_trls_multi_turn_training_on_our_episodes_trains_the_same_tokens_loss_and_gradients(
        hf_checkpoint, tmp_path, loss_type):
    """Episodes sampled by our engine on TRL's own checkpoint (a tiny transformers Llama), given
    to a real trl.GRPOTrainer through rollout_func with env_mask (1 on the policy's tokens, 0 on
    the tool's: what TRL's own tool loop builds as tool_mask): the tokens its loss trains equal
    our loss mask, its logprobs of the episodes (observations as context) equal ours and the
    sampler's, and its loss, metrics and every gradient equal grpo.accumulate's (check_against_trl:
    mu = 2, off-policy old logprobs, so the clip acts)."""
    from test_grpo import (LOGP_TOL, TRL_MICRO_BATCHES, TRL_TEMPERATURE, check_against_trl,
                           our_advantages, trl_batch, trl_scored, trl_trainer)
    from engine import hf
    G, budget = 2, 16
    prompts, _ = trl_batch(G)  # equal lengths: TRL left-pads prompts (trl_batch says why)
    sampler = hf.load_model(hf_checkpoint[0], dtype=torch.float64).eval()
    out = rollout.generate(sampler, prompts, RolloutConfig(num_samples=G, max_new_tokens=budget,
                                                           temperature=TRL_TEMPERATURE),
                           stop_ids=(1,), seed=11, episodes=episodes(3))
    rows, policy = out.completions(), out.sampled.tolist()
    env_mask = [[int(p) for p in flags[:len(row)]] for row, flags in zip(rows, policy)]
    assert sum(out.stats["calls"]) >= 3 and any(0 in m for m in env_mask)  # the case under test
    trainer = trl_trainer(hf_checkpoint, tmp_path, prompts, rows, env_mask=env_mask,
                          loss_type=loss_type, num_iterations=2, epsilon=0.2, epsilon_high=0.28,
                          max_completion_length=budget)
    scored = trl_scored(trainer, len(rows))
    ours = hf.load_model(hf_checkpoint[0], dtype=torch.float64)
    cfg = grpo.GRPOConfig(loss_type=loss_type, eps_low=0.2, eps_high=0.28,
                          micro_batch_groups=len(prompts) // TRL_MICRO_BATCHES)
    batch = grpo.GRPOBatch.from_rollout(prompts, out, budget, our_advantages(G, "group"))
    trained = (scored["completion_mask"] * scored["tool_mask"]).bool()
    assert torch.equal(trained, batch.loss_mask(cfg))  # the same tokens trained
    current = grpo.batch_logprobs(ours, batch, cfg)  # (N, Tc)
    theirs = scored["old_per_token_logps"]  # TRL's softmax statistics are float32
    torch.testing.assert_close(theirs * trained, (current * trained).to(theirs.dtype), **LOGP_TOL)
    # the sampler's float64 logprobs, stored in float32: half an ulp of a logprob of -8 is 4.8e-7
    torch.testing.assert_close(out.logprobs.double() * trained, current * trained, rtol=0,
                               atol=1e-6)
    gen = torch.Generator().manual_seed(7)
    old = current + 0.3 * torch.randn(current.shape, generator=gen, dtype=current.dtype) * trained
    # TRL's sampler correction acts for vLLM's rollouts alone: here, no sampler logprobs
    batch.old_logp, batch.sampler_logp = old, None
    got = check_against_trl(trainer, scored, ours, batch, cfg)
    assert got["clip_low"] + got["clip_high"] > 0  # the clip acts

