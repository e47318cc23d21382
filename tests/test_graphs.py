"""
Tests of engine/compiling.py on the CPU: the compiled decode step (CUDA's bf16 kernel route, SDPA's fused CPU
kernel standing in for CUDA's memory-efficient kernel, as tests/test_rollout.py runs it) against
the same step run eagerly and against the float64 forward of the same bf16 weights, and its
compiles.

Tolerances: the compiled step computes what the eager one computes, rounded elsewhere: inductor
keeps a fused kernel's intermediates in float32 where eager bf16 rounds every op's output (the
norms' casts, RoPE's products, the merge). Each bf16 route is a few bf16 ulps (2^-7 of the power
of two below a value) from the float64 forward: every op's output rounded, some twenty a layer;
4 ulps of the largest logit at most, measured here on either route, so ULPS = 8. Greedy picks may
then differ only at near ties (the float64 forward's top two within two routes' errors).
The compiles are torch's, seconds to a minute each here: the first test compiles the step once for
each of its four structures, and the tests after it reuse those compiles.
"""

import copy
import math

import pytest
import torch

from engine import decode
from engine import compiling
from engine import precision
import tolerance
import rollout
from engine import sampling
import tp
from model import Block, Llama, fused_projections
from rollout import RolloutConfig
import train
from train import TrainConfig
from test_rollout import CFG, PROMPTS, trainer_logprobs

ULPS = 8  # bf16 ulps of the largest logit (module docstring); 4 at most measured here
LOGPROB_TOL = ULPS * 2.0 ** -5  # logprobs move as the logits do: this model's stay in (4, 8)
COMPILED_HERE: set[str] = set()  # what this process's earlier tests compiled
# The tests of the compiled step itself; below compiling.MIN_TORCH it runs eagerly (the gate's test).
needs_compile = pytest.mark.skipif(bool(compiling.unsupported()), reason=compiling.unsupported())


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CFG).init_weights(seed=0, std=0.2).to(torch.bfloat16).eval()


@pytest.fixture
def kernel_route(monkeypatch):
    """CUDA's bf16 kernel route on the CPU: SDPA's fused CPU kernel in the CUDA kernel's place."""
    monkeypatch.setattr(decode, "kernel_for", lambda device, dtype, head_dim: decode.cpu_flash)


def bf16_tol(logits: torch.Tensor) -> float:
    """ULPS bf16 ulps at the largest |logit| (an ulp is 2^-7 of the power of two below it)."""
    return ULPS * 2.0 ** (math.floor(math.log2(logits.abs().max().item())) - 7)


@pytest.fixture(scope="module")
def wide(model):
    """The slow twin: the same bf16 weights in float64, whole sequences recomputed."""
    twin = Llama(CFG).double().eval()
    twin.load_state_dict(model.state_dict())
    return twin


def near_tie(wide: Llama, seq: list[int], a: int, b: int, tol: float) -> bool:
    """Tokens a and b are within tol of each other after seq in the float64 forward of the bf16
    weights: either is a right greedy pick in bf16."""
    with torch.no_grad():
        logits = wide(torch.tensor([seq]))[0, -1]
    return abs(logits[a] - logits[b]).item() < tol


def decoders(model: Llama, G: int, new: int) -> tuple[decode.Decoder, decode.Decoder, torch.Tensor]:
    """A compiled and an eager decoder over the same prefilled prompts (longest first, as generate
    sorts them), and the first token of each row (the prompt's greedy pick)."""
    prompts = sorted(PROMPTS, key=len, reverse=True)
    lens = [len(p) for p in prompts]
    pair = []
    with torch.inference_mode():
        for compiled in (True, False):
            views = rollout._carve(model, None, len(prompts), G, max(lens), new)
            logits = rollout._prefill(model, prompts, views[0], views[1], 2048, "cpu")
            pair.append(decode.Decoder(model, views, lens, graphed=False, compiled=compiled))
        first = logits.argmax(-1).repeat_interleave(G)  # an inference tensor, as generate's
    return *pair, first


def step_against_float64(model: Llama, wide: Llama, compiled: decode.Decoder,
                         eager: decode.Decoder, tokens: torch.Tensor,
                         seqs: list[list[int]]) -> torch.Tensor:
    """One step of both decoders on `tokens` (each active row's, appended to its sequence in
    `seqs`): the compiled step's logits (on q/k/v and gate/up stacked anew, as generate's compiled
    route) and the eager step's each within ULPS of the float64 forward of each row's whole
    sequence, the compiled greedy picks the float64 forward's (near ties aside). The compiled
    step's logits (N, V), float64."""
    for i, r in enumerate(compiled.ids.tolist()):
        seqs[r].append(int(tokens[i]))
    with fused_projections(model):
        got = compiled.decode(tokens).double()
    want = eager.decode(tokens).double()
    exact = torch.stack([wide(torch.tensor([seqs[r]]))[0, -1]
                         for r in compiled.ids.tolist()])  # (N, V)
    for logits in (got, want):
        torch.testing.assert_close(logits, exact, rtol=0, atol=bf16_tol(exact))
    top2 = exact.topk(2, dim=-1).values
    near = top2[:, 0] - top2[:, 1] < 2 * bf16_tol(exact)  # either pick is right in bf16
    assert ((got.argmax(-1) == exact.argmax(-1)) | near).all()
    return got


@needs_compile
def test_compiled_bf16_step_equals_the_eager_step_and_compiles_once_a_structure(model, wide,
                                                                               kernel_route):
    """Step by step through six layouts: four structures (every row in its slot or rows scattered
    into a grid with empty slots; the longest prompt still there or gone), each of two a second
    time with fewer rows and groups: the compiled step's logits and the eager bf16 step's each
    within ULPS of the float64 forward of each row's whole sequence (the slow twin), the compiled
    step's greedy picks the float64 forward's (near ties aside), and the K/V it wrote into the
    cache, in place, the eager step's. The compiled step runs on q/k/v's and gate/up's weights
    stacked (model.fused_projections), stacked anew for each step: new tensors of the same shapes
    compile nothing. It compiles once a structure, on its first layout's first step: never on a
    later step, nor for a structure's second layout."""
    G, new = 4, 13  # rows 0-3 hold prompt 0 (the longest, 11 tokens), 4-7 prompt 1, ...
    compiled, eager, tokens = decoders(model, G, new)
    assert compiled.compiled is not None and eager.compiled is None
    seqs = [list(p) for p in sorted(PROMPTS, key=len, reverse=True) for _ in range(G)]
    survivors = {2: [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14],  # as at first, a row a prompt less
                 4: [0, 1, 4, 5, 6, 8, 9, 10, 12, 13, 14],     # a slot of prompt 0 empty
                 6: [4, 5, 8, 9, 10, 12, 13, 14],              # prompt 0 gone, a slot empty
                 8: [4, 5, 8, 9, 12, 13],                      # two rows a prompt: slots full
                 10: [8, 9, 12, 13]}                           # the same, with two prompts
    counts = []
    before = compiling.graphs_compiled(), compiling.compile_seconds()  # the eager twin: none
    with torch.inference_mode():
        for t in range(new - 1):
            if t in survivors:
                keep = [i for i, r in enumerate(compiled.ids.tolist()) if r in survivors[t]]
                for d in (compiled, eager):
                    d.drop(keep, filled=t)
                tokens = tokens[torch.tensor(keep)]
            assert (compiled.index == t).all() and (eager.index == t).all()  # lockstep: index t
            got = step_against_float64(model, wide, compiled, eager, tokens, seqs)
            tokens = got.argmax(-1)
            counts.append(compiling.graphs_compiled() - before[0])
    assert compiled.grid.scatter is None and compiled.grid.prompt_valid.shape == (2, 2)
    assert counts[0] == 1 and compiling.compile_seconds() > before[1]
    COMPILED_HERE.add("structures")
    for t in range(1, new - 1):
        assert counts[t] - counts[t - 1] <= (1 if t in (4, 6, 8) else 0), counts
    for mine, theirs in zip(compiled.views[2] + compiled.views[3],
                            eager.views[2] + eager.views[3]):
        written = theirs[:, :, :new - 1].float()  # every slot's keys so far (dropped rows' too)
        torch.testing.assert_close(mine[:, :, :new - 1].float(), written, rtol=0,
                                   atol=bf16_tol(written))


@needs_compile
def test_the_compiled_step_takes_the_cuda_kernels_strided_outputs(model, wide, monkeypatch):
    """CUDA's memory-efficient kernel returns its (B, H, M, D) output laid out as (B, M, H, D) in
    memory: the step's merge of its two parts compiles over those strides (torch.compile cannot
    trace the eager merge's out= into a view of y there: it fell back to eager on an H200) and
    stays within ULPS of the float64 forward, padded prompts, rep 2 x Hkv 2."""
    def strided(q, k, v, bias):  # the fused CPU kernel, its output laid out as CUDA's
        out, lse = decode.cpu_flash(q, k, v, bias)
        return out.transpose(1, 2).contiguous().transpose(1, 2), lse
    monkeypatch.setattr(decode, "kernel_for", lambda device, dtype, head_dim: strided)
    monkeypatch.setattr(compiling, "REFUSED", {})
    G, new = 2, 5
    compiled, eager, tokens = decoders(model, G, new)
    seqs = [list(p) for p in sorted(PROMPTS, key=len, reverse=True) for _ in range(G)]
    before = compiling.graphs_compiled()
    with torch.inference_mode():
        for t in range(new - 1):
            tokens = step_against_float64(model, wide, compiled, eager, tokens, seqs).argmax(-1)
    assert compiling.graphs_compiled() > before and not compiling.REFUSED  # compiled, not eager


@needs_compile
def test_the_compiled_draw_equals_the_eager_race_on_the_same_clocks():
    """sampling.draw_raced compiled (rollout.py runs it so beside a compiled step) against itself
    eager on the same clocks, bf16 logits (the compiled step's) with masked ids: greedy,
    temperature, and temperature with top-k and top-p (a sort and a scatter traced). The same
    tokens; logprobs within float32 rounding (both work on the logits' float32 copy; the softmax's
    sum over V = 1000 taken in another order: tests/tolerance.py at the logits' magnitude)."""
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits.to(torch.bfloat16).index_fill_(1, torch.arange(0, 1000, 7), float("-inf"))
    for knobs in [(0.0, 0, 1.0), (0.8, 0, 1.0), (0.8, 50, 0.9)]:
        clocks = sampling.race_clocks(logits, knobs[0], torch.Generator().manual_seed(1))
        step = compiling.CompiledStep(sampling.draw_raced)
        before = compiling.graphs_compiled()
        tokens, logprobs = step(logits, *knobs, clocks)
        want = sampling.draw_raced(logits, *knobs, clocks)
        assert compiling.graphs_compiled() > before and torch.equal(tokens, want[0])
        scale = logits.float().nan_to_num(neginf=0).abs().max() / (knobs[0] or 1.0)
        torch.testing.assert_close(logprobs, want[1], **tolerance.reordered(1000, scale))
    COMPILED_HERE.add("draw")


@needs_compile
def test_greedy_generate_compiled_equals_eager_and_compiles_nothing_again(model, wide,
                                                                          kernel_route):
    """generate() on the compiled route, rows dropped at stop ids, against the eager bf16 route: the
    same rows, each up to a near tie of the float64 forward where the two bf16 routes may part; a
    row's logprobs within LOGPROB_TOL while they agree. At most one compile where the tests above
    ran in this process (they compiled each structure and the draw; a layout they did not meet may
    be new), at most five where they did not, and a second call of the same shapes compiles
    nothing (compiles 0, compile_seconds 0)."""
    knobs = dict(num_samples=3, max_new_tokens=16, temperature=0.0, sync_every=2)
    stops = (5, 9, 17, 23, 31)
    runs = [rollout.generate(model, PROMPTS, RolloutConfig(compile_decode=on, **knobs),
                             stop_ids=stops, seed=0) for on in ("true", "true", "false")]
    first, again, eager = runs
    assert eager.stats["compiles"] == 0 and first.stats["compactions"] >= 1
    # After the two tests above in this process (not so under pytest -n, which may run them
    # elsewhere), a layout they did not meet may be new; else each of four structures and the draw.
    assert first.stats["compiles"] <= (1 if COMPILED_HERE == {"structures", "draw"} else 5)
    assert again.stats["compiles"] == 0
    assert again.stats["compile_seconds"] == 0.0
    assert torch.equal(first.tokens, again.tokens)
    parted = 0
    for row, (a, b) in enumerate(zip(first.completions(), eager.completions())):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            parted += 1
            prompt = PROMPTS[row // 3]
            assert same < min(len(a), len(b)), "one row ends at a stop where the other goes on"
            assert near_tie(wide, prompt + a[:same], a[same], b[same], 2 * LOGPROB_TOL), \
                f"row {row} parts at token {same} without a near tie"
        torch.testing.assert_close(first.logprobs[row, :same], eager.logprobs[row, :same],
                                   rtol=0, atol=LOGPROB_TOL)
    assert parted <= len(PROMPTS), "most rows agree token for token"


@needs_compile
def test_the_compiled_step_serves_every_bucket_of_graphed_rows(model, kernel_route, monkeypatch):
    """Graphs per bucket of rows (tests/test_episodes.py's FakeGraph stands in for CUDA's): the
    compiled step on the whole grid, rows padded up to each bucket, compiles no graph a bucket (the
    rows a dynamic dim): one rollout compiles at most the step and the draw, a second nothing; it
    captures each bucket once and draws the greedy tokens of the compacted, uncaptured route."""
    from test_episodes import FakeGraph
    monkeypatch.setattr(decode, "GraphedStep", FakeGraph)
    monkeypatch.setattr(rollout, "Decoder", lambda model, views, lens, _, compiled=False:
                        decode.Decoder(model, views, lens, True, compiled))
    knobs = dict(num_samples=3, max_new_tokens=16, temperature=0.0, sync_every=2,
                 compile_decode="true")
    stops = (5, 9, 17, 23, 31)
    captures = []
    for _ in range(2):
        FakeGraph.captured = []
        out = rollout.generate(model, PROMPTS, RolloutConfig(**knobs), stop_ids=stops, seed=0)
        captures.append((out.stats["compiles"], FakeGraph.captured))
    (first, buckets), (again, buckets_again) = captures
    assert first <= 2 and again == 0 and out.stats["compactions"] >= 1
    assert buckets == buckets_again and len(buckets) == len(set(buckets)) >= 2
    monkeypatch.undo()
    monkeypatch.setattr(decode, "kernel_for", lambda device, dtype, head_dim: decode.cpu_flash)
    plain = rollout.generate(model, PROMPTS, RolloutConfig(**knobs), stop_ids=stops, seed=0)
    assert torch.equal(out.tokens, plain.tokens)  # greedy, no near tie on this seed


@needs_compile
def test_sampled_tokens_on_the_compiled_route_score_as_the_trainer(model, kernel_route):
    """Sampling after the compiled step: each token's logprob is the bf16 trainer forward's within
    bf16's rounding of logits of size ~5 (tests/test_rollout.py's bf16 test: 0.1). Temperature
    alone: a top-k or top-p boundary may fall between two roundings of the same logits. Compiles
    as the test above bounds them."""
    cfg = RolloutConfig(num_samples=3, max_new_tokens=12, temperature=0.8, sync_every=2)
    out = rollout.generate(model, PROMPTS, cfg, stop_ids=(5, 9, 17), seed=3)
    assert out.stats["compiles"] <= (1 if COMPILED_HERE == {"structures", "draw"} else 5)
    for row, completion in enumerate(out.completions()):
        expected = trainer_logprobs(model, PROMPTS[row // 3], completion, 0.8, 0, 1.0).float()
        torch.testing.assert_close(torch.tensor(out.logprob_lists()[row]), expected, rtol=0,
                                   atol=0.1)


@needs_compile
def test_the_compiled_route_samples_from_the_weights_of_its_own_rollout(model, kernel_route):
    """The weights changed in place between two rollouts (as rollout.sync_weights writes them):
    the second compiled rollout's logprobs are the eager route's on the new weights, within
    LOGPROB_TOL where their greedy rows agree, and far from the first rollout's (what stale
    weights, a compiled graph's constants or the first rollout's stacked projections, would give).
    It compiles nothing: the stacked weights are new tensors of the same shapes."""
    changed = copy.deepcopy(model)
    knobs = dict(num_samples=2, max_new_tokens=6, temperature=0.0, compile_decode="true")
    before = rollout.generate(changed, PROMPTS, RolloutConfig(**knobs), seed=0)
    with torch.no_grad():
        for block in changed.model.layers:
            block.mlp.up_proj.weight.neg_()
            block.self_attn.v_proj.weight.mul_(2)
    after = rollout.generate(changed, PROMPTS, RolloutConfig(**knobs), seed=0)
    eager_cfg = RolloutConfig(**{**knobs, "compile_decode": "false"})
    eager = rollout.generate(changed, PROMPTS, eager_cfg, seed=0)
    assert after.stats["compiles"] == 0
    agree = (after.tokens[:, :2] == eager.tokens[:, :2]).all(-1)  # the first decoded token
    assert agree.float().mean() >= 0.5, "most rows pick the same token"
    step = after.logprobs[agree, 1].float()
    torch.testing.assert_close(step, eager.logprobs[agree, 1].float(), rtol=0, atol=LOGPROB_TOL)
    assert (step - before.logprobs[agree, 1].float()).abs().max() > 2 * LOGPROB_TOL


@needs_compile
def test_the_compiled_qwen3_step_runs_its_q_k_norms_inside_on_stacked_projections(kernel_route):
    """Qwen3's per-head q/k norms inside the compiled step, on q/k/v stacked (fused_projections):
    step by step, all rows in their slots (one structure: one compile), the compiled step's logits
    and the eager bf16 step's each within ULPS of the float64 forward of each row's sequence, the
    greedy picks the float64 forward's up to near ties, the cache's K/V the eager step's."""
    from test_rollout import qwen3_model
    model = qwen3_model().to(torch.bfloat16)
    wide = qwen3_model().double()
    wide.load_state_dict(model.state_dict())  # the same bf16 weights, in float64
    G, new = 2, 7
    compiled, eager, tokens = decoders(model, G, new)
    seqs = [list(p) for p in sorted(PROMPTS, key=len, reverse=True) for _ in range(G)]
    before = compiling.graphs_compiled()
    with torch.inference_mode():
        for t in range(new - 1):
            got = step_against_float64(model, wide, compiled, eager, tokens, seqs)
            tokens = got.argmax(-1)
    assert compiling.graphs_compiled() > before
    for mine, theirs in zip(compiled.views[2], eager.views[2]):
        written = theirs[:, :, :new - 1].float()
        torch.testing.assert_close(mine[:, :, :new - 1].float(), written, rtol=0,
                                   atol=bf16_tol(written))


@needs_compile
def test_the_compiled_step_and_draw_keep_the_model_dims_static_one_graph_for_every_batch(
        model, kernel_route, monkeypatch):
    """Regression: torch.compile(dynamic=True) made every dim of every input a symbol, the draw's
    vocabulary among them (its logits (rows, V)): inductor could not specialise its kernels on the
    model's sizes. Only the dims that vary with the layout and the batch are marked (compiling.dynamic):
    traced by dynamo alone (a backend that records each graph's inputs and runs it eagerly), no
    input dim of the vocabulary's, the width's or the SwiGLU's size is a symbol, the rows are;
    and rollouts of other group sizes, budgets and prompts compile no new graph for a structure
    met before."""
    inputs = []
    compile = torch.compile

    def recording(gm, example_inputs):
        inputs.append([node.meta["example_value"] for node in gm.graph.nodes
                       if node.op == "placeholder"
                       and isinstance(node.meta.get("example_value"), torch.Tensor)])
        return gm.forward
    monkeypatch.setattr(compiling.torch, "compile",
                        lambda fn, **options: compile(fn, backend=recording, **options))
    torch._dynamo.reset()  # this test's own graphs, whatever ran before it in this process
    knobs = dict(temperature=0.0, sync_every=2, compile_decode="true")
    stops = (5, 9, 17, 23, 31)
    out = rollout.generate(model, PROMPTS, RolloutConfig(num_samples=3, max_new_tokens=16,
                                                         **knobs), stop_ids=stops, seed=0)
    traced = len(inputs)
    assert out.stats["compactions"] >= 1 and traced >= 2  # the step and the draw
    for G, new, prompts in ((2, 9, PROMPTS), (4, 12, PROMPTS[:3]), (3, 16, PROMPTS[1:])):
        rollout.generate(model, prompts, RolloutConfig(num_samples=G, max_new_tokens=new, **knobs),
                         stop_ids=stops, seed=0)
    # At most one structure the first rollout did not meet (prompts without padding: the groups
    # left of one length); a dim left unmarked would compile again for each batch
    assert len(inputs) <= traced + 1, "another batch compiled again"
    model_sizes = {CFG.vocab_size, CFG.hidden_size, CFG.intermediate_size}  # no layout's
    symbolic = [(tuple(x.shape), i) for graph in inputs for x in graph
                for i, n in enumerate(x.shape) if isinstance(n, torch.SymInt)]
    assert symbolic, "the rows are dynamic"
    assert all(int(x.shape[i].node.hint) not in model_sizes for graph in inputs for x in graph
               for i in range(x.dim()) if isinstance(x.shape[i], torch.SymInt)), symbolic
    logits = [x for graph in inputs for x in graph if x.dim() == 2 and x.is_floating_point()
              and x.shape[-1] == CFG.vocab_size]
    assert logits and all(isinstance(x.shape[0], torch.SymInt) for x in logits)


def first_fed_token(out: rollout.Rollout, prompts: list[list[int]]) -> tuple[int, int]:
    """A token id no prompt holds that the rollout first drew at completion index j >= 1 (its
    earliest in any row) with a step after it: (id, j)."""
    in_prompts = {t for p in prompts for t in p}
    first: dict[int, int] = {}
    for row in out.completions():
        for j, t in enumerate(row[:-1]):
            first[t] = min(first.get(t, j), j)
    return min(((t, j) for t, j in first.items() if j >= 1 and t not in in_prompts),
               key=lambda pair: pair[1])


@needs_compile
def test_nan_logits_on_the_compiled_route_stop_the_rollout_naming_the_step(model, kernel_route):
    """The compiled step and draw (the CUDA route's; a logits_fn would keep them eager): a NaN
    embedding row for a token the greedy rollout first draws at completion index j makes the
    logits of each row fed it NaN from step j + 1 on: the rollout stops at its next check with
    one line naming step j + 1, where the compiled race drew token 0 from them in silence."""
    assert_a_nan_embedding_row_stops_the_compiled_rollout(model)


def assert_a_nan_embedding_row_stops_the_compiled_rollout(model: Llama) -> None:
    """A NaN embedding row for a token the greedy compiled rollout first draws at completion
    index j (a copy of model poisoned): the rollout stops naming decode step j + 1."""
    knobs = dict(num_samples=2, max_new_tokens=10, temperature=0.0, sync_every=3,
                 compile_decode="true")
    poisoned = copy.deepcopy(model)
    clean = rollout.generate(poisoned, PROMPTS, RolloutConfig(**knobs), seed=0)
    token, j = first_fed_token(clean, PROMPTS)
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[token] = float("nan")
    with pytest.raises(rollout.NonFiniteLogits, match=f"at decode step {j + 1} "):
        rollout.generate(poisoned, PROMPTS, RolloutConfig(**knobs), seed=0)


def test_a_torch_that_cannot_compile_runs_the_step_eagerly_a_line_a_structure(model, kernel_route,
                                                                            monkeypatch, capsys):
    """torch.compile failing (here a stand-in that raises as a missing C++ compiler does, through
    dynamo) leaves the step and the draw eager, bit for bit the compile_decode=False route: each
    structure it met tried once, with one line each naming it; a later rollout tries none again."""
    tries = []

    def failing_compile(fn, **options):
        def compiled(*args):
            tries.append(1)
            raise torch._dynamo.exc.TorchDynamoException("no working C++ compiler found")
        return compiled
    monkeypatch.setattr(compiling, "REFUSED", {})
    monkeypatch.setattr(compiling, "unsupported", lambda: "")  # a torch new enough, this one or not
    monkeypatch.setattr(compiling.torch, "compile", failing_compile)
    knobs = dict(num_samples=2, max_new_tokens=6, temperature=0.0)
    outs = []
    for _ in range(2):
        outs.append(rollout.generate(model, PROMPTS, RolloutConfig(compile_decode="true", **knobs),
                                     seed=0))
        lines = capsys.readouterr().out.strip().splitlines()
        if len(outs) == 1:
            first_tries = len(tries)
            assert len(lines) == first_tries == len(compiling.REFUSED) >= 2  # the step and the draw
            assert all("no working C++ compiler found" in line for line in lines)
            assert any("the decode step with" in line for line in lines)
            assert any("the draw at temperature 0.0" in line for line in lines)
    assert lines == [] and len(tries) == first_tries  # nothing tried again
    eager = rollout.generate(model, PROMPTS, RolloutConfig(compile_decode="false", **knobs), seed=0)
    for out in outs:
        assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.logprobs, eager.logprobs)
        assert out.stats["compiles"] == 0


def test_a_refused_compile_turns_off_that_structure_of_that_step_alone(monkeypatch, capsys):
    """Regression: one refused compile (CompiledStep.refused, a class attribute) ran every compiled
    step of the process eagerly: the draw after a refused decode step, every structure after one
    torch could not lower, every later rollout. Now what torch refused is (the function, the
    structure): that runs eagerly, said in one line, never tried again (a new CompiledStep of the
    same function, the next rollout's, included); its other structures and other functions still
    run compiled."""
    calls = []

    def stand_in_compile(fn, **options):  # refuses the "odd" structure of `step` alone
        def compiled(*args):
            calls.append((fn.__name__, len(args[0])))
            if fn.__name__ == "step" and len(args[0]) % 2:
                raise torch._dynamo.exc.TorchDynamoException("a lowering it lacks")
            return fn(*args) + 100  # what ran compiled
        return compiled
    monkeypatch.setattr(compiling, "REFUSED", {})
    monkeypatch.setattr(compiling, "unsupported", lambda: "")
    monkeypatch.setattr(compiling.torch, "compile", stand_in_compile)

    def step(x):
        return x * 2

    def draw(x):
        return x + 1

    def parity(x):
        return "odd rows" if len(x) % 2 else "even rows"
    odd, even = torch.ones(3), torch.ones(2)
    first = compiling.CompiledStep(step, parity)
    assert torch.equal(first(odd), odd * 2)  # refused: eager
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "step for odd rows" in lines[0] and "a lowering it lacks" in lines[0]
    assert torch.equal(first(even), even * 2 + 100)  # the other structure compiled
    assert torch.equal(first(odd), odd * 2)  # eager, not tried again
    again = compiling.CompiledStep(step, parity)  # the next rollout's
    assert torch.equal(again(odd), odd * 2) and torch.equal(again(even), even * 2 + 100)
    other = compiling.CompiledStep(draw, parity)  # another function, the refused structure
    assert torch.equal(other(odd), odd + 1 + 100)
    assert calls == [("step", 3), ("step", 2), ("step", 2), ("draw", 3)]
    assert capsys.readouterr().out == ""


def test_a_torch_older_than_the_compiled_paths_need_runs_them_eagerly_and_says_so(
        model, kernel_route, monkeypatch, capsys, tmp_path):
    """Below compiling.MIN_TORCH (torch 2.5 compiled the step again for every layout) the step is
    not compiled: one line names the torch needed, the rollout is bit for bit the eager one, and
    the training blocks stay eager with the same reason (models.compile_model's line)."""
    monkeypatch.setattr(compiling, "_SAID", set())
    monkeypatch.setattr(compiling.torch, "__version__", "2.5.1+cpu")
    assert compiling.unsupported().startswith("the compiled paths need torch 2.7 or newer")
    knobs = dict(num_samples=2, max_new_tokens=6, temperature=0.9)
    old = rollout.generate(model, PROMPTS, RolloutConfig(compile_decode="true", **knobs), seed=0)
    eager = rollout.generate(model, PROMPTS, RolloutConfig(compile_decode="false", **knobs), seed=0)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "need torch 2.7 or newer, this is 2.5.1+cpu" in lines[0]
    assert torch.equal(old.tokens, eager.tokens) and torch.equal(old.logprobs, eager.logprobs)
    assert old.stats["compiles"] == 0
    trainer = Llama(CFG)
    cfg = TrainConfig(compile_blocks="true", compile_cache=str(tmp_path))
    notes = train.models.compile_model(cfg, trainer, torch.device("cpu"), tp.ParallelGroups(None, None))
    assert notes == [f"--compile_blocks: the blocks run eager: {compiling.unsupported()}"]
    assert all(type(block) is Block for block in trainer.model.layers)


def test_a_logits_fn_keeps_the_step_eager(model, kernel_route, capsys):
    """A logits_fn (tensor parallelism's vocab gather) keeps the step and the draw eager, bit for
    bit the compile_decode=False route and without a line: tp.py's layers run their collectives in
    autograd Functions torch.compile does not trace (it refuses them)."""
    knobs = dict(num_samples=2, max_new_tokens=6, temperature=0.9)
    gathered = rollout.generate(model, PROMPTS, RolloutConfig(compile_decode="true", **knobs),
                                seed=0, logits_fn=lambda x: x)
    eager = rollout.generate(model, PROMPTS, RolloutConfig(compile_decode="false", **knobs), seed=0)
    assert torch.equal(gathered.tokens, eager.tokens)
    assert torch.equal(gathered.logprobs, eager.logprobs) and capsys.readouterr().out == ""


def test_compile_applies_to_the_kernel_route_alone_and_auto_to_models_worth_compiling():
    """compile_decode applies to the kernel route alone: a float32 model (the exact path) and the
    CPU's own fused route (no kernel) never compile, even at "true". Its default, "auto", compiles
    a CUDA model of compiling.MIN_COMPILE_PARAMS or more in its blocks: Qwen2.5-0.5B's shape (on the
    meta device: no weight is made) is, the tests' tiny model and the default run's are not (its
    24 s compile on an H200 against a 50 ms step). A setting other than the three is refused."""
    from bench_bf16 import SHAPES
    assert RolloutConfig().compile_decode == "auto"
    with torch.device("meta"):
        assert compiling.worth_compiling(Llama(SHAPES["Qwen2.5-0.5B"]))
    assert not compiling.worth_compiling(Llama(CFG))
    assert not compiling.decide("auto", Llama(CFG)) and compiling.decide("true", Llama(CFG))
    with pytest.raises(ValueError, match="compile_decode must be auto"):
        RolloutConfig(compile_decode="yes")
    for dtype in (torch.float32, torch.bfloat16):
        m = Llama(CFG).init_weights(seed=0, std=0.2).to(dtype).eval()
        cfg = RolloutConfig(num_samples=2, max_new_tokens=4, compile_decode="true")
        out = rollout.generate(m, PROMPTS, cfg, seed=0)
        assert out.stats["compiles"] == 0 and out.stats["compile_seconds"] == 0.0
