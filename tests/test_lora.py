"""lora.py: each clever path against its slow twin, PEFT's files against peft itself, and LoRA
through train.py (frozen base, checkpoints, resume, --adapter, --merged, bad input).

Tolerances: float64 twins to 1e-12 (the same math in another order); float32 paths by
tests/tolerance.py (the chain of sums behind a value, at its magnitude).
"""

import copy
import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import tolerance
from test_rollout import PROMPTS, generate, logprob_tol, trainer_logprobs
from test_train import FAST, assert_plan_holds, records, run

from engine import hf
import grpo
import lora
import rollout
import tasks
from engine import tokenizer as tk
import train
from model import Llama, ModelConfig

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96)


def adapted(cfg: ModelConfig = CFG, targets: str = "all-linear", dtype=torch.float32,
            b_std: float = 0.2, **kw) -> Llama:
    """A std-0.2 model with adapters whose B is random (a zero B would hide a wrong A or scale)."""
    model = Llama(cfg).init_weights(0, std=0.2).to(dtype)
    c = lora.LoRAConfig(use_peft=True, lora_target_modules=targets, lora_r=4, lora_alpha=8,
                        lora_dropout=0.0, **kw)
    lora.add_adapters(model, c, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in lora.adapted(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * b_std)
    return model

# -----------------------------------------------------------------------------
# The adapted linear against its formula


def one_linear(in_: int, out: int, r: int, scaling: float, dropout: float = 0.0):
    """A module holding one adapted linear `proj`, A and B random."""
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(in_, out)
    holder.requires_grad_(False)
    gen = torch.Generator().manual_seed(2)
    lora.attach(holder, "proj", torch.randn(r, in_, generator=gen),
                torch.randn(out, r, generator=gen), scaling, dropout)
    return holder.proj


@pytest.mark.parametrize("rslora", [False, True])
def test_adapted_linear_equals_its_formula_in_values_and_gradients(rslora):
    """LoRALinear(x) = W x + b + s B A x, s = alpha / r (alpha / sqrt(r) with rsLoRA), against the
    formula written out in float64, with the gradients of A, B and x; W and b get none. Float32
    against float64: the sums of 12 and 3 terms, at the values' magnitude."""
    c = lora.LoRAConfig(use_peft=True, lora_r=3, lora_alpha=5, lora_dropout=0.0,
                        use_rslora=rslora)
    assert c.scaling == 5 / (math.sqrt(3) if rslora else 3)
    m = one_linear(12, 10, 3, c.scaling)
    assert isinstance(m, lora.LoRALinear) and m.lora_A.dtype == torch.float32
    W, b = m.weight.double(), m.bias.double()
    A = m.lora_A.detach().double().requires_grad_()
    B = m.lora_B.detach().double().requires_grad_()
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3), requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    want = x64 @ W.T + b + c.scaling * (x64 @ A.T) @ B.T
    got = m(x)
    g = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (got * g.float()).sum().backward()
    (want * g).sum().backward()
    for a, w in ((got, want), (m.lora_A.grad, A.grad), (m.lora_B.grad, B.grad),
                 (x.grad, x64.grad)):
        torch.testing.assert_close(a.double(), w, **tolerance.reordered(12 + 3 + 10, w.abs().max()))
    assert m.weight.grad is None and m.bias.grad is None


def test_dropout_acts_on_the_adapters_input_in_the_loss_forward_only():
    """With dropout the base part is untouched (W x + b exactly) and the update sees dropout(x);
    without gradients (the sampler, old logprobs) or in eval mode there is none."""
    m = one_linear(16, 8, 2, 2.0, dropout=0.5)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
    exact = F.linear(x, m.weight, m.bias) + 2.0 * F.linear(F.linear(x, m.lora_A), m.lora_B)
    with torch.no_grad():
        assert torch.equal(m(x), exact)
    m.eval()
    assert torch.equal(m(x), exact)
    m.train()
    torch.manual_seed(0)
    y = m(x)
    torch.manual_seed(0)
    dropped = F.dropout(x, 0.5)
    want = F.linear(x, m.weight, m.bias) + 2.0 * F.linear(F.linear(dropped, m.lora_A), m.lora_B)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert not torch.equal(y, exact)


def test_a_is_drawn_as_peft_draws_it_and_b_is_zero():
    """PEFT's reset_lora_parameters: kaiming_uniform_(A, a=sqrt(5)), B zero, i.e. A uniform in
    +-1/sqrt(in). Ours and PEFT's own draw on the same shape: every value inside the bound, the
    extremes within 0.1% of it, the standard deviation bound/sqrt(3) within 3% (8 x 4096 draws:
    its sampling error is ~0.6%). A fresh adapted model is its base exactly."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora.layer import Linear as PeftLinear
    twin = PeftLinear(torch.nn.Linear(4096, 16), "default", peft.LoraConfig(r=8, lora_alpha=16),
                      r=8, lora_alpha=16)
    assert twin.lora_B["default"].weight.abs().max() == 0
    wide = dataclasses.replace(CFG, hidden_size=4096, num_attention_heads=32,
                               num_key_value_heads=32, intermediate_size=64, num_hidden_layers=1,
                               vocab_size=8)
    model = Llama(wide)
    c = lora.LoRAConfig(use_peft=True, lora_r=8)
    lora.add_adapters(model, c, targets=["model.layers.0.self_attn.q_proj"])
    q = model.model.layers[0].self_attn.q_proj
    bound = 1 / math.sqrt(4096)
    for A in (q.lora_A.detach(), twin.lora_A["default"].weight.detach()):
        assert A.shape == (8, 4096)
        assert A.abs().max() <= bound and A.abs().max() > 0.999 * bound
        assert abs(A.std().item() / (bound / math.sqrt(3)) - 1) < 0.03
    assert q.lora_B.abs().max() == 0
    model = Llama(CFG).init_weights(0)
    base = copy.deepcopy(model)
    lora.add_adapters(model, c)
    tokens = torch.tensor([PROMPTS[0]])
    assert torch.equal(model(tokens), base(tokens))


def test_adapters_are_reproducible_by_seed_and_differ_between_modules():
    a, b = Llama(CFG), Llama(CFG)
    c = lora.LoRAConfig(use_peft=True, lora_target_modules="all-linear")
    lora.add_adapters(a, c, seed=3)
    lora.add_adapters(b, c, seed=3)
    As = [m.lora_A for _, m in lora.adapted(a)]
    assert all(torch.equal(x, m.lora_A) for x, (_, m) in zip(As, lora.adapted(b)))
    assert not torch.equal(As[0], As[2][:, :64])  # q_proj and v_proj of layer 0: other draws

# -----------------------------------------------------------------------------
# Targets, the frozen base, the flags


def test_targets_default_to_peft_mapping_all_linear_and_names():
    """No target: PEFT's mapping for the architecture (q_proj, v_proj for Llama, Qwen2, Qwen3,
    read from peft itself); all-linear: every linear but lm_head; names match a module's last
    parts."""
    constants = pytest.importorskip("peft.utils.constants")
    mapping = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    for arch, key in (("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2"),
                      ("Qwen3ForCausalLM", "qwen3")):
        assert lora.DEFAULT_TARGETS[arch] == tuple(mapping[key])
    model = Llama(CFG)
    assert lora.target_modules(model, "") == [f"model.layers.{i}.self_attn.{p}"
                                             for i in range(2) for p in ("q_proj", "v_proj")]
    every = lora.target_modules(model, "all-linear")
    assert len(every) == 2 * 7 and "lm_head" not in every
    assert lora.target_modules(model, "down_proj, o_proj") == [
        f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")]


def test_a_target_that_matches_nothing_names_the_models_linears():
    with pytest.raises(ValueError) as e:
        lora.target_modules(Llama(CFG), "q_proj,query_key_value")
    assert str(e.value) == ("--lora_target_modules 'query_key_value' matches no linear of the "
                            "model; its linears: down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,"
                            "v_proj (or all-linear)")


def test_the_base_is_frozen_and_the_optimizer_holds_the_adapters_alone():
    """After add_adapters only A and B train (float32 on a bf16 base, which stays bf16); an AdamW
    step over lora.trainable changes them and no bit of the base."""
    model = adapted(dtype=torch.bfloat16)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not lora.is_adapter(n)}
    params = dict(model.named_parameters())
    trainable = [n for n, p in params.items() if p.requires_grad]
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    assert all(params[n].dtype == torch.float32 for n in trainable)
    assert all(t.dtype == torch.bfloat16 for t in base.values())
    opt = torch.optim.AdamW(lora.trainable(model), lr=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.tensor([PROMPTS[0]])).float().logsumexp(-1).sum().backward()
    opt.step()
    assert len(opt.state) == len(trainable)
    for n, p in model.named_parameters():
        if lora.is_adapter(n):
            continue
        assert p.grad is None and torch.equal(p, base[n]), n


def test_a_bf16_base_where_bf16_has_no_kernels_holds_its_values_in_float32(tmp_path, monkeypatch,
                                                                          capsys):
    """A CPU without AVX512_BF16 or AMX multiplies bf16 5-40x slower than float32 (a LoRA step of
    SmolLM2-135M took 21x native bf16's there, docs/measurements.md). There LoRA's frozen base
    holds bf16's values in float32 (the same values as native bf16's base, bit for bit), the
    trainer runs without autocast and samples itself, and the run says so in one line. With native
    bf16 the base stays bf16 under autocast, and nothing is said."""
    args = [*FAST, "--dtype", "bfloat16", "--use_peft", "--lora_target_modules", "all-linear",
            "--steps", "1", "--eval_every", "0", "--cpu_bf16", "auto"]
    runs = {}
    for native in (True, False):
        monkeypatch.setattr(train.precision, "native_bf16", lambda: native)
        runs[native] = train.setup(train.parse_args(args + ["--out", str(tmp_path / str(native))]))
        note = [line for line in capsys.readouterr().out.splitlines() if "float32 here" in line]
        assert len(note) == (not native)
        kernels = train.precision.autocast(runs[native].cfgs.train, runs[native].device)
        assert isinstance(kernels, torch.autocast) == native
    assert "the frozen base holds bf16's values in float32, the trainer runs without autocast" in \
        note[0], note[0]
    bases = [{n: p.detach() for n, p in runs[native].model.named_parameters()
              if not lora.is_adapter(n)} for native in (True, False)]
    assert {p.dtype for p in bases[0].values()} == {torch.bfloat16}
    assert {p.dtype for p in bases[1].values()} == {torch.float32}
    for name, p in bases[0].items():
        assert torch.equal(p.float(), bases[1][name]), name
    slow = runs[False]
    assert slow.sampler is slow.model
    train.step(slow, 0)  # the adapters train on the float32-held base, which stays as it was
    for name, p in slow.model.named_parameters():
        assert lora.is_adapter(name) or torch.equal(p, bases[1][name]), name
    assert any(p.abs().sum() > 0 for n, p in slow.model.named_parameters() if n.endswith("lora_B"))


def test_the_flags_are_trls_model_config_names_with_its_defaults():
    """--use_peft, --lora_r, --lora_alpha, --lora_dropout, --lora_target_modules and --use_rslora
    are trl.ModelConfig's fields with its defaults (no target: None there, "" here, both PEFT's
    mapping); TRL's switches may stand alone, as TRL's parser takes them."""
    trl = pytest.importorskip("trl")
    theirs = {f.name: f.default for f in dataclasses.fields(trl.ModelConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(lora.LoRAConfig)}
    for name in ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "use_rslora"):
        assert ours[name] == theirs[name], name
    assert theirs["lora_target_modules"] is None and ours["lora_target_modules"] == ""
    values = train.parse_args(["--use_peft", "--use_rslora", "--lora_r", "8"])
    assert values == dict(use_peft=True, use_rslora=True, lora_r=8)
    assert train.parse_args(["--use_peft", "false"]) == dict(use_peft=False)


@pytest.mark.parametrize("args,message", [
    (["--use_peft", "--lora_r", "0"], "--lora_r must be >= 1 (the adapters' rank), got 0"),
    (["--use_peft", "--lora_target_modules", "qkv"],
     "--lora_target_modules 'qkv' matches no linear of the model; its linears: "
     "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj (or all-linear)"),
    (["--use_peft", "--sequence_parallel", "true"], "--use_peft with --sequence_parallel: the "
                                                     "fused all-gather linears take no adapter"),
])
def test_bad_lora_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    code, out = run(tmp_path, *args)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not os.path.exists(out) or os.listdir(out) in ([], [".lock"])

# -----------------------------------------------------------------------------
# The sampler: the adapted model, without a copy


@pytest.mark.parametrize("prepacked", [True, False])
def test_sampler_logprobs_equal_the_trainers_forward_on_the_adapted_model(prepacked):
    """The sampler decodes on the adapted model itself (the update applied in each linear, or
    merged into the prepacked copy rollout.py makes of each float32 weight anyway); its logprobs
    equal a full forward's within logprob_tol, as the plain model's do (tests/test_rollout.py).
    And the adapters matter: the base samples other tokens."""
    model = adapted().eval()
    G, T = 3, 20
    out = generate(model, PROMPTS, num_samples=G, max_new_tokens=T, temperature=1.0, seed=5,
                   stop_ids=(5, 9), prepacked_linears=prepacked)
    for row, completion in enumerate(out.completions()):
        want = trainer_logprobs(model, PROMPTS[row // G], completion, 1.0, 0, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprob_lists()[row]), want,
                                   **logprob_tol(model))
    assert all("forward" not in vars(m) for m in model.modules())  # prepacking undone
    plain = Llama(CFG).init_weights(0, std=0.2).eval()
    other = generate(plain, PROMPTS, num_samples=G, max_new_tokens=T, temperature=1.0, seed=5,
                     stop_ids=(5, 9), prepacked_linears=prepacked)
    assert not torch.equal(other.tokens, out.tokens)


@pytest.mark.skipif(rollout._PREPACK is None, reason="no oneDNN in this torch build")
def test_the_prepacked_copy_of_an_adapted_linear_holds_the_adapter_merged():
    """Inside rollout._prepacked_linears an adapted float32 linear runs one matmul on its merged
    weight, prepacked: its output equals W x + b + s B A x (float32, 64 + r terms in another
    order); afterwards it is the adapted linear again."""
    m = one_linear(64, 96, 4, 2.0)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = m(x)
        with rollout._prepacked_linears(m, 12, enabled=True):
            assert "forward" in vars(m)
            got = m(x)
    torch.testing.assert_close(got, want, **tolerance.reordered(64 + 4, want.abs().max()))
    assert "forward" not in vars(m)


@pytest.mark.skipif(rollout._PREPACK is None or not rollout.native_bf16(),
                    reason="bf16 is prepacked only on a CPU with native bf16 (rollout.prepacks)")
def test_a_bf16_sampler_merges_each_adapter_into_its_prepacked_copy():
    """On a CPU with native bf16 the sampler's bf16 linears are prepacked (rollout.prepacks) and
    each adapter merged into its copy, W + s B A summed in float32 and rounded once: one matmul a
    linear where the update beside it made SmolLM2-135M's rollout 1.23x the base's
    (docs/measurements.md). The update beside the base repeats the trainer's bf16 roundings: its
    logprobs are within the bf16 sampler's tolerance of the trainer's forward (test_rollout's
    test_bf16_model_on_the_cpu: 0.1 at logits of size ~5). The merged weight is one more
    rounding of each weight (2^-9 relative), which the trainer does not share: twice that
    tolerance (0.12 seen here, with adapters of std 0.2; on SmolLM2-135M it moved the mean
    |sampler - trainer| by 9-20% and not its max, docs/measurements.md)."""
    model = adapted(dtype=torch.bfloat16).eval()
    m = lora.adapted(model)[0][1]
    with torch.no_grad(), rollout._prepacked_linears(model, 12, enabled=True):
        assert "forward" in vars(m)
        x = torch.randn(12, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        merged = m(x)
    with torch.no_grad():  # the update beside the base, both bf16
        torch.testing.assert_close(merged.float(), m(x).float(), rtol=2 ** -6, atol=2 ** -6)
    G, T = 2, 12
    for prepacked in (True, False):
        out = generate(model, PROMPTS, num_samples=G, max_new_tokens=T, temperature=1.0, seed=5,
                       stop_ids=(5, 9), prepacked_linears=prepacked)
        for row, completion in enumerate(out.completions()):
            want = trainer_logprobs(model, PROMPTS[row // G], completion, 1.0, 0, 1.0).float()
            torch.testing.assert_close(torch.tensor(out.logprob_lists()[row]), want, rtol=0,
                                       atol=0.2 if prepacked else 0.1)


@pytest.mark.skipif(rollout._PREPACK is None, reason="no oneDNN in this torch build")
def test_after_a_tool_turn_an_adapted_sampler_runs_on_its_merged_weights(monkeypatch):
    """The first tool turn unpacks the prepacked linears (rollout._prepacked_linears: rows at their
    own lengths would make oneDNN keep a primitive per shape); from there an adapted linear runs
    F.linear on its merged weight, still one matmul, a plain one on its weight. The episodes'
    sampled logprobs equal the trainer's forward on the adapted model within float32's
    tolerance (test_episodes' twin: two summation orders at the logits' magnitude)."""
    from test_episodes import PROMPTS as EPISODE_PROMPTS, STOPS, episodes
    model = adapted().eval()
    at_feeds = []
    feed = rollout._feed

    def spy(*args):
        at_feeds.append({m: vars(m).get("forward") for m in model.modules()
                         if isinstance(m, torch.nn.Linear)})
        return feed(*args)
    monkeypatch.setattr(rollout, "_feed", spy)
    out = rollout.generate(model, EPISODE_PROMPTS, rollout.RolloutConfig(
        num_samples=4, max_new_tokens=24, temperature=0.9, sync_every=4), stop_ids=STOPS, seed=3,
        episodes=episodes(3))
    assert at_feeds and sum(out.stats["calls"]) > 0
    for m, forward in at_feeds[0].items():
        if type(m) is lora.LoRALinear:
            assert forward.func is F.linear and torch.equal(forward.keywords["weight"],
                                                            m.merged_weight())
        else:
            assert forward is None  # lm_head: its own weight
    assert all("forward" not in vars(m) for m in model.modules())  # undone after the call
    batch = grpo.GRPOBatch.from_rollout(EPISODE_PROMPTS, out, 24, torch.zeros(len(out.tokens)))
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(model, batch)
        logits = model(batch.prompt_ids)  # (B, P, V): the magnitude a log-softmax's error has
    d = (logp - out.logprobs)[batch.loss_mask(grpo.GRPOConfig())].abs()
    tol = tolerance.reordered(tolerance.model_depth(CFG, CFG.max_position_embeddings),
                              logits.abs().max() / 0.9)
    assert d.max() <= tol["atol"], (d.max(), tol)


def test_adapters_off_is_the_base_exactly_and_a_beta_run_scores_the_base(tmp_path):
    """lora.adapters_off: the adapted model's logits are the base's bit for bit, and the adapters
    are back after it. A LoRA run with beta > 0 takes the trainer with its adapters off as the
    reference: its KL is 0 at the first step (B = 0: the policy is the base), above 0 once the
    adapters moved."""
    model = adapted()
    base = Llama(CFG).init_weights(0, std=0.2)
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(tokens)
        with lora.adapters_off(model):
            assert torch.equal(model(tokens), base(tokens))
        assert torch.equal(model(tokens), before)
    code, out = run(tmp_path, "--model", base_checkpoint(tmp_path), "--use_peft", "--beta", "0.1",
                    "--lr", "1e-2", "--steps", "3", "--lora_dropout", "0")
    assert code == 0
    kl = [r["kl"] for r in records(out)]
    assert kl[0] == 0 and kl[-1] > 0, kl


def test_merge_equals_the_adapted_model():
    """lora.merge folds s B A into W: the logits of the merged model (plain nn.Linear) equal the
    adapted model's in float64 to 1e-12."""
    model = adapted().double()
    for _, m in lora.adapted(model):
        m.lora_A.data, m.lora_B.data = m.lora_A.data.double(), m.lora_B.data.double()
    tokens = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want = model(tokens)
        lora.merge(model)
        got = model(tokens)
    assert not lora.adapted(model) and all(type(m) is not lora.LoRALinear
                                           for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

# -----------------------------------------------------------------------------
# PEFT's files, train.py's checkpoints, --adapter, --merged


def base_checkpoint(tmp_path, name: str = "base", **kw) -> str:
    """A random Llama as a Hugging Face directory with a char tokenizer for tasks:reverse."""
    tok = tk.build_char_tokenizer(tasks.load_task("tasks:reverse", "").alphabet)
    shape = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2), **kw}
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<bos>"),
                      eos_token_id=tok.token_to_id("<eos>"), **shape)
    path = str(tmp_path / name)
    hf.save_model(Llama(cfg).init_weights(0, std=0.2), path)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def engine_logits(base: str, adapter: str, tokens: torch.Tensor) -> torch.Tensor:
    model = hf.load_model(base)
    lora.load_adapter(model, adapter)
    with torch.no_grad():
        return model(tokens)


def peft_logits(base: str, adapter: str, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(hf_model, adapter).eval()(tokens).logits


def logits_tol(path: str, want: torch.Tensor) -> dict:
    cfg = hf.load_config(path)
    return tolerance.reordered(tolerance.model_depth(cfg, 16, "logits"), want.abs().max())


def test_a_checkpoint_is_a_peft_adapter_peft_loads_to_the_engines_logits(tmp_path):
    """OUT/step-N holds adapter_config.json and adapter_model.safetensors (PEFT's key names) beside
    the optimizer state and no model weights; peft.PeftModel.from_pretrained(base, OUT/step-N)
    gives the engine's logits (float32, summation order)."""
    base = base_checkpoint(tmp_path)
    code, out = run(tmp_path, "--model", base, "--use_peft", "--lora_target_modules",
                    "all-linear", "--lora_dropout", "0", "--lr", "1e-2", "--steps", "2")
    assert code == 0
    step = os.path.join(out, "step-000002")
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer-tp0.safetensors",
            "trainer_state.json"} <= set(os.listdir(step))
    assert "model.safetensors" not in os.listdir(step)
    config = json.load(open(os.path.join(step, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (16, 32, base)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                        "up_proj", "v_proj"]
    saved = load_file(os.path.join(step, "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in saved
    assert len(saved) == 2 * 7 * 2
    assert any(k.endswith("lora_B.weight") and t.abs().max() > 0 for k, t in saved.items())
    tokens = torch.tensor([[1, 5, 7, 9, 11, 3, 4, 8]])
    want = engine_logits(base, step, tokens)
    torch.testing.assert_close(peft_logits(base, step, tokens), want, **logits_tol(base, want))
    with torch.no_grad():
        plain = hf.load_model(base)(tokens)
    assert (plain - want).abs().max() > 1e-3  # the adapter moved the logits


def test_resume_continues_a_lora_run_exactly(tmp_path):
    """Stopped at step 2 and resumed from its adapter and optimizer state, a LoRA run logs what an
    uninterrupted one logs, and ends at the same adapter bit for bit."""
    base = base_checkpoint(tmp_path)
    args = ["--model", base, "--use_peft", "--lr", "1e-2"]
    code, full = run(tmp_path, *args, "--steps", "4", "--save_every", "2", out="full")
    assert code == 0
    code, resumed = run(tmp_path, "--resume", os.path.join(full, "step-000002"), out="resumed")
    assert code == 0
    a, b = records(full)[2:], records(resumed)
    assert [r["step"] for r in b] == [3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward", "loss", "entropy"):
            assert ra[key] == rb[key], key
    x = load_file(os.path.join(full, "step-000004", "adapter_model.safetensors"))
    y = load_file(os.path.join(resumed, "step-000004", "adapter_model.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_lora_runs_dropout_is_a_function_of_its_seed(tmp_path):
    """Two runs of one seed train alike whatever drew from torch's global generator before them:
    the adapters' dropout masks come from the seed (they once came from whatever the imports
    had left in the generator, so a change elsewhere in the code changed a run)."""
    base = base_checkpoint(tmp_path)
    args = ["--model", base, "--use_peft", "--lora_dropout", "0.5", "--lr", "1e-2", "--steps", "3"]
    code, first = run(tmp_path, *args, out="first")
    torch.rand(1000)
    code2, second = run(tmp_path, *args, out="second")
    assert code == code2 == 0
    for a, b in zip(records(first), records(second)):
        for key in ("reward", "loss", "entropy"):
            assert a[key] == b[key], key


def test_adapter_starts_a_run_and_merged_writes_the_adapted_model(tmp_path, capsys):
    """--model BASE --adapter DIR starts from a PEFT adapter (its r, alpha and targets); --merged
    OUT writes base + adapter as a Hugging Face directory whose logits are the adapted model's
    (transformers reads it too)."""
    base = base_checkpoint(tmp_path)
    code, first = run(tmp_path, "--model", base, "--use_peft", "--lora_r", "4",
                      "--lora_alpha", "16", "--lr", "1e-2", "--steps", "2", out="first")
    assert code == 0
    adapter = os.path.join(first, "step-000002")
    code, second = run(tmp_path, "--model", base, "--adapter", adapter, "--steps", "1",
                       "--lr", "1e-9", out="second")
    assert code == 0 and "LoRA: r 4, alpha 16, scale 4," in capsys.readouterr().out
    merged = str(tmp_path / "merged")
    assert train.main(["--model", base, "--adapter", adapter, "--merged", merged]) == 0
    assert f"wrote {merged}" in capsys.readouterr().out
    tokens = torch.tensor([[1, 5, 7, 9, 11, 3, 4, 8]])
    want = engine_logits(base, adapter, tokens)
    with torch.no_grad():
        got = hf.load_model(merged)(tokens)
    torch.testing.assert_close(got, want, **logits_tol(base, want))
    transformers = pytest.importorskip("transformers")
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(merged)(tokens).logits
    torch.testing.assert_close(theirs, want, **logits_tol(base, want))


def test_an_adapter_that_does_not_fit_the_base_is_one_line_and_writes_nothing(tmp_path, capsys):
    """An adapter of another model's shapes, or one whose config names a base directory whose
    config.json is not --model's, is refused in one line; --out stays empty."""
    base = base_checkpoint(tmp_path)
    wide = base_checkpoint(tmp_path, "wide", intermediate_size=96)
    model = hf.load_model(wide)
    c = lora.LoRAConfig(use_peft=True, lora_target_modules="all-linear")
    lora.add_adapters(model, c)
    adapter = str(tmp_path / "adapter")
    os.makedirs(adapter)
    lora.save_adapter(adapter, dict(model.named_parameters()), c, "some/hub-name")
    code, out = run(tmp_path, "--model", base, "--adapter", adapter)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "model.layers.0.mlp.down_proj holds A, B of shapes (16, 96), (32, 16); this " \
           "model's needs (16, 64), (32, 16) (r 16): is --model its base?" in err
    assert not os.path.exists(out) or os.listdir(out) in ([], [".lock"])
    lora.save_adapter(adapter, dict(model.named_parameters()), c, wide)  # names its base
    code, out = run(tmp_path, "--model", base, "--adapter", adapter, out="again")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--adapter {adapter} was trained on {wide}, whose config.json differs" in err

# -----------------------------------------------------------------------------
# Tensor parallelism: adapters sharded with their linears


def check_tp_equals_one_process(cfg: ModelConfig, ranks) -> None:
    """A sharded adapted model (column-parallel: A whole, B by rows; row-parallel: A by columns,
    B whole) against the adapted full model: add_adapters draws the same A and slices it; the
    logits, the GRPO loss and every adapter's gradient (gathered) equal one process's, no base
    weight gets one; the gathered adapters are the full ones; greedy sampling takes the same
    tokens. Tolerance: test_tp's (a gradient's chain of sums, regrouped over the shards)."""
    import test_tp
    import tp
    full = test_tp.full_model(cfg)
    c = lora.LoRAConfig(use_peft=True, lora_target_modules="all-linear", lora_r=4, lora_alpha=8,
                        lora_dropout=0.0)
    ref = copy.deepcopy(full)
    targets = lora.add_adapters(ref, c, seed=0)
    m = tp.shard_model(copy.deepcopy(full), ranks)
    lora.add_adapters(m, c, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in targets:
            ours, theirs = m.get_submodule(name), ref.get_submodule(name)
            dim = m.tp_state.sharded[name + ".weight"][0]
            A = ours.lora_A
            if dim == 1:  # row-parallel: this rank's columns of the same draw
                parts = [torch.empty_like(A) for _ in range(ranks.tp_size)]
                torch.distributed.all_gather(parts, A.contiguous(), group=ranks.tp_group)
                A = torch.cat(parts, 1)
            assert torch.equal(A, theirs.lora_A), name
            theirs.lora_B.copy_(torch.randn(theirs.lora_B.shape, generator=gen) * 0.2)
            lora.attach(m, name, theirs.lora_A.detach(), theirs.lora_B.detach(), c.scaling, 0.0)
    tp.adapt(m)
    prompts, completions, advantages = test_tp.grpo_batch(cfg)
    tokens = torch.randint(0, test_tp.V, (3, 6), generator=gen)
    with torch.no_grad():
        test_tp.assert_close(tp.gather_vocab(m(tokens), ranks), ref(tokens))
    want = test_tp.grpo_step(ref, prompts, completions, advantages)
    logprob_fn = lambda logits, targets: tp.vocab_parallel_logprobs(logits, targets, ranks)
    got = test_tp.grpo_step(m, prompts, completions, advantages, logprob_fn)
    for key in ("loss", "entropy"):
        assert abs(got[key] - want[key]) <= test_tp.REL * max(1.0, abs(want[key])), key
    sharded = m.tp_state.sharded
    theirs = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        if not lora.is_adapter(name):
            assert p.grad is None, name
            continue
        grad = p.grad
        if name in sharded:
            parts = [torch.empty_like(grad) for _ in range(ranks.tp_size)]
            torch.distributed.all_gather(parts, grad.contiguous(), group=ranks.tp_group)
            grad = torch.cat(parts, sharded[name][0])
        test_tp.assert_close(grad, theirs[name].grad, msg=name)
    gathered = tp.full_state_dict(m, ranks)
    assert all(torch.equal(gathered[n], theirs[n]) for n in gathered if lora.is_adapter(n))
    greedy = rollout.RolloutConfig(num_samples=2, max_new_tokens=6, temperature=0.0)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    want_tokens = rollout.generate(ref, prompts, greedy).tokens
    gather = lambda logits: tp.gather_vocab(logits, ranks)
    assert torch.equal(rollout.generate(m, prompts, greedy, logits_fn=gather).tokens, want_tokens)


def _tp_worker(rank: int, tmp: str) -> None:
    import test_tp
    import tp
    ranks = tp.make_groups(torch.distributed.get_world_size())
    configs = (["llama", "llama_bias", "qwen_tied"] if ranks.tp_size == 2 else ["qwen3"])
    for name in configs:
        check_tp_equals_one_process(test_tp.CONFIGS[name], ranks)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_adapters_equal_one_process_values_and_gradients(tmp_path, tp_size):
    """TP = 2 on the Llama layouts (with biases; Qwen2's tied), TP = 4 on Qwen3's, over gloo."""
    import test_tp
    test_tp.spawn(_tp_worker, tp_size, tmp_path)

# -----------------------------------------------------------------------------
# The memory plan


@pytest.mark.parametrize("flags", [[], ["--dtype", "bfloat16", "--activation_checkpoint", "false",
                                        "--micro_batch_groups", "8", "--max_new_tokens", "32"]],
                         ids=["fp32", "bf16"])
def test_lora_plan_is_within_15_percent_of_the_measured_allocator_peak(tmp_path, capsys, flags,
                                                                       request):
    """test_train's check of --plan against torch.profiler's allocator peak over two steps, with
    LoRA on every linear: grads and AdamW state of the adapters alone (float32), the base frozen
    (in bf16 a bf16 base, no sampler copy, nothing for autocast to cast), and the adapters' own
    activations (dropout's copies of their inputs). 15%: the plan leaves out small transients."""
    from test_train import in_a_cpu_process, plan_args, plan_checkpoint
    if in_a_cpu_process(request):
        return
    model = str(tmp_path / "model")
    plan_checkpoint(model)
    argv = plan_args(tmp_path, model) + flags + ["--use_peft", "--lora_target_modules",
                                                 "all-linear"]
    assert train.main(argv + ["--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, row = lines[1].split(), next(line.split() for line in lines if line.startswith("train"))
    planned = max(float(line.split()[-1].replace(",", "")) for line in lines[2:-1]) * 1e6
    shape = Llama(hf.load_config(model))
    lora.add_adapters(shape, lora.LoRAConfig(use_peft=True, lora_target_modules="all-linear"))
    adapters = sum(p.numel() for p in lora.trainable(shape))  # r 16 on every linear
    for tag, nbytes in (("grads", 4 * adapters), ("optimizer", 8 * adapters)):  # float32
        assert float(row[header.index(tag)]) == pytest.approx(nbytes / 1e6, abs=0.05), tag
    assert_plan_holds(argv, planned)


def test_a_tp2_lora_run_matches_tp1_writes_the_same_adapter_and_resumes(tmp_path):
    """torchrun --nproc_per_node 2 train.py --tp 2 --use_peft against one process on the same
    base: each rank loads its slice of the base and of the adapter's draw; the same rewards,
    losses and gathered adapter; it resumes from its own checkpoint. Tolerance: test_train's TP
    one (fp32 sums regrouped over the shards)."""
    import subprocess
    import sys
    from test_train import GLOO, ROOT
    base = base_checkpoint(tmp_path)
    args = [*FAST, "--steps", "2", "--model", base, "--use_peft", "--lora_target_modules",
            "all-linear", "--lora_dropout", "0", "--lr", "1e-2"]
    one = subprocess.run([sys.executable, "train.py", *args, "--out", str(tmp_path / "tp1")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=GLOO)
    assert one.returncode == 0, one.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py"]
    done = subprocess.run([*cmd, *args, "--tp", "2", "--out", str(tmp_path / "tp2")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=GLOO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for a, b in zip(records(tmp_path / "tp1"), records(tmp_path / "tp2")):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    one, two = (load_file(str(tmp_path / name / "step-000002" / "adapter_model.safetensors"))
                for name in ("tp1", "tp2"))
    assert sorted(one) == sorted(two) and len(one) == 2 * 7 * 2
    for name in one:  # AdamW divides each gradient by its own size: an entry whose gradient
        # is near its eps (1e-8) and rounds apart moves by a share of the lr (1e-3 and 2e-3 in
        # warmup); 1e-5 is 1% of that, 8x the largest gap seen (1.3e-6, 1 entry of 1,024)
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-5)
    resume = [*args, "--tp", "2", "--resume", "latest", "--steps", "3",
              "--out", str(tmp_path / "tp2")]
    done = subprocess.run([*cmd, *resume], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=GLOO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path / "tp2")] == [1, 2, 3]


def test_an_adapter_peft_wrote_loads_to_pefts_logits(tmp_path):
    """An adapter written by peft itself (get_peft_model on transformers' model, rsLoRA, B made
    nonzero, save_pretrained) gives the engine peft's logits: the keys, the scale and the layout
    read as PEFT means them."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = base_checkpoint(tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["o_proj", "up_proj", "k_proj"],
                             use_rslora=True, lora_dropout=0.0)
    wrapped = peft.get_peft_model(hf_model, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    adapter = str(tmp_path / "peft_adapter")
    wrapped.save_pretrained(adapter)
    tokens = torch.tensor([[1, 5, 7, 9, 11, 3, 4, 8]])
    with torch.no_grad():
        want = wrapped.eval()(tokens).logits
    got = engine_logits(base, adapter, tokens)
    torch.testing.assert_close(got, want, **logits_tol(base, want))
    model = hf.load_model(base)
    cfg, targets = lora.load_adapter(model, adapter)
    assert (cfg.lora_r, cfg.lora_alpha, cfg.use_rslora) == (4, 12, True)
    assert sorted({t.rsplit(".", 1)[-1] for t in targets}) == ["k_proj", "o_proj", "up_proj"]
