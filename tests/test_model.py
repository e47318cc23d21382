"""model.py against plain float64 loops; engine/hf.py against Hugging Face's layouts, and its refusals."""

import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import tolerance
from hf_reference import save_random_hf_model, store_tied_copy
from memtrace import allocator_peak

from engine import hf
import model as M


def tiny(**kw) -> M.ModelConfig:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    return M.ModelConfig(**base)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, cfg: M.ModelConfig):
    """Two float32 forwards of one model (ours and transformers', fused kernels or not): the same
    sums in other orders, over the (B, T, V) logits' T keys, at their magnitude."""
    depth = tolerance.model_depth(cfg, want.shape[1], "logits")
    torch.testing.assert_close(got, want, **tolerance.reordered(depth, want.abs().max()))


def make(seed: int = 0, std: float = 0.2, **kw) -> M.Llama:
    # std 0.2 (not HF's 0.02) so attention patterns and logits are far from uniform: bugs show.
    # Biases (zero after init_weights, as in HF) get the same std: a missing or misplaced one shows;
    # so do Qwen3's q/k norm weights around their 1 (q's and k's swapped, or one left out, show).
    m = M.Llama(tiny(**kw)).init_weights(seed, std=std)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * std)
    return m

# -----------------------------------------------------------------------------
# The forward against a plain float64 loop


def reference_forward(m: M.Llama, tokens: list[int]) -> torch.Tensor:
    """One sequence, one token and one head at a time, float64, rope by explicit pair rotation.
    Every linear adds its bias when the state dict has one (transformers' Llama, Qwen2, Qwen3), and
    q and k are normed head by head when it has q/k norms (Qwen3)."""
    cfg, sd = m.config, {k: v.double() for k, v in m.state_dict().items()}

    def linear(name, x):
        return sd[name + ".weight"] @ x + sd.get(name + ".bias", 0.0)
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq = [cfg.rope_theta ** (-2 * i / D) for i in range(D // 2)]

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean() + cfg.rms_norm_eps)

    def rope(vec, pos):  # HF rotate-half: dimension i pairs with i + D/2
        out = vec.clone()
        for i in range(D // 2):
            c, s = math.cos(pos * inv_freq[i]), math.sin(pos * inv_freq[i])
            out[i] = vec[i] * c - vec[i + D // 2] * s
            out[i + D // 2] = vec[i + D // 2] * c + vec[i] * s
        return out

    def head_norm(vec, name, heads):  # Qwen3: each head's D entries normed alone, one weight
        if name not in sd:
            return vec
        return torch.cat([rms(vec[h * D:(h + 1) * D], sd[name]) for h in range(heads)])

    xs = [sd["model.embed_tokens.weight"][t] for t in tokens]
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        hs = [rms(x, sd[p + "input_layernorm.weight"]) for x in xs]
        qs = [head_norm(linear(p + "self_attn.q_proj", h), p + "self_attn.q_norm.weight", H)
              for h in hs]
        ks = [head_norm(linear(p + "self_attn.k_proj", h), p + "self_attn.k_norm.weight", Hkv)
              for h in hs]
        vs = [linear(p + "self_attn.v_proj", h) for h in hs]
        new = []
        for t in range(len(xs)):
            heads = []
            for h in range(H):
                g = h // (H // Hkv)  # GQA: query head h reads kv head h // (H/Hkv)
                q = rope(qs[t][h * D:(h + 1) * D], t)
                scores = [q @ rope(ks[s][g * D:(g + 1) * D], s) / math.sqrt(D) for s in range(t + 1)]
                w = torch.softmax(torch.stack(scores), 0)
                heads.append(sum(w[s] * vs[s][g * D:(g + 1) * D] for s in range(t + 1)))
            x = xs[t] + linear(p + "self_attn.o_proj", torch.cat(heads))
            h2 = rms(x, sd[p + "post_attention_layernorm.weight"])
            a = F.silu(linear(p + "mlp.gate_proj", h2)) * linear(p + "mlp.up_proj", h2)
            new.append(x + linear(p + "mlp.down_proj", a))
        xs = new
    head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return torch.stack([head @ rms(x, sd["model.norm.weight"]) for x in xs])


@pytest.mark.parametrize("kw", [
    dict(num_key_value_heads=4), dict(num_key_value_heads=2), dict(num_key_value_heads=1),
    dict(attention_bias=True, mlp_bias=True),  # Llama: q/k/v/o and gate/up/down biases
    dict(architecture="Qwen2ForCausalLM"),  # q/k/v biases only
    dict(head_dim=32, rms_norm_eps=1e-2),  # D != C/H; an eps large enough to matter
    # Qwen3: per-head q/k norms, H*D != C, no bias; then with q/k/v/o biases and GQA 6/2 (rep 3)
    dict(architecture="Qwen3ForCausalLM", head_dim=24, rms_norm_eps=1e-2),
    dict(architecture="Qwen3ForCausalLM", attention_bias=True, num_attention_heads=6),
])
def test_forward_matches_float64_loop(kw):
    m = make(**kw).double()
    tokens = [5, 17, 3, 88, 41, 0, 9, 63, 12, 70]
    got = m(torch.tensor([tokens]))[0]
    want = reference_forward(m, tokens)
    # 1e-5, not 1e-12: the model computes inv_freq in float32 exactly as HF does (a relative error of ~6e-8
    # per frequency, times the position), the loop in float64. A wrong rotary pairing is off by ~1e-1.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_causal_changing_a_token_changes_no_earlier_logit():
    m = make()
    x = torch.randint(0, 96, (2, 12))
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 96
    a, b = m(x), m(y)
    assert torch.equal(a[:, :7], b[:, :7])  # exact: earlier positions never see token 7
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-3


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = make(num_key_value_heads=2)
    mha = M.Llama(tiny(num_key_value_heads=4))
    sd = gqa.state_dict()
    D = gqa.config.head_dim
    for k in list(sd):
        if "k_proj" in k or "v_proj" in k:  # (Hkv*D, C) -> (H*D, C): each kv head serves 2 query heads
            sd[k] = sd[k].view(2, D, -1).repeat_interleave(2, dim=0).reshape(4 * D, -1)
    mha.load_state_dict(sd)
    x = torch.randint(0, 96, (3, 9))
    want = mha(x)
    depth = tolerance.model_depth(mha.config, 9, "logits")  # fp32 reordering only
    torch.testing.assert_close(gqa(x), want, **tolerance.reordered(depth, want.abs().max()))


def test_explicit_positions_equal_default_and_shift_changes_output():
    m = make()
    x = torch.randint(0, 96, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    assert torch.equal(m(x), m(x, positions=pos))
    assert not torch.allclose(m(x), m(x, positions=pos + 3))


def test_hidden_at_last_positions_equals_full_forward_and_hook_sees_every_position():
    m = make().double()  # float64: the twins differ only by rounding, values and grads
    x, last = torch.randint(0, 96, (3, 7)), torch.tensor([6, 2, 4])  # ragged: right-padded prompts
    seen = []

    def hook(layer, q, k, v, last=None):
        seen.append((q.shape[2], k.shape[2], last is not None))
        return M.causal_attention(layer, q, k, v, last)
    got = m.hidden(x, None, hook, last)  # (3, 1, C)
    # The final layer's K/V still cover all 7 positions; its queries are the 3 last positions alone.
    assert got.shape == (3, 1, 64) and seen == [(7, 7, False), (1, 7, True)]
    want = m.hidden(x)[torch.arange(3), last]  # (3, C)
    torch.testing.assert_close(got[:, 0], want, atol=1e-12, rtol=1e-12)
    # Gradients through the shortened final layer equal the full forward's.
    params = list(m.model.layers.parameters()) + [m.model.embed_tokens.weight]
    g_got = torch.autograd.grad(got.square().sum(), params)
    g_want = torch.autograd.grad(m.hidden(x)[torch.arange(3), last].square().sum(), params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)

@pytest.mark.parametrize("kw", [dict(attention_bias=True, mlp_bias=True),
                                dict(architecture="Qwen2ForCausalLM"),
                                dict(architecture="Qwen3ForCausalLM", head_dim=24)])
def test_fused_projections_equal_the_separate_linears_and_leave_the_model_as_it_was(kw):
    """q/k/v as one matmul and gate/up as one (float64: the twins differ only by rounding): the
    same logits, the last-position prefill's final layer on its separate q; a projection that is
    not a plain nn.Linear (a tensor-parallel shard) is left alone; the stacked weights are gone
    after the block, an exception's too."""
    m = make(**kw).double()
    x, last = torch.randint(0, 96, (3, 7)), torch.tensor([6, 2, 4])
    with torch.no_grad():
        want, want_last = m(x), m.hidden(x, None, None, last)
        with M.fused_projections(m):
            blocks = m.model.layers
            assert all(b.self_attn.fused is not None and b.mlp.fused is not None for b in blocks)
            got, got_last = m(x), m.hidden(x, None, None, last)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_last, want_last, atol=1e-12, rtol=1e-12)
    assert all(b.self_attn.fused is None and b.mlp.fused is None for b in m.model.layers)

    class Shard(torch.nn.Linear):  # tp.py's layers are nn.Linear subclasses or other modules
        pass
    first = m.model.layers[0]
    first.mlp.up_proj.__class__ = Shard
    with pytest.raises(RuntimeError, match="inside"), M.fused_projections(m):
        assert first.mlp.fused is None and first.self_attn.fused is not None
        raise RuntimeError("inside")
    assert first.self_attn.fused is None


def test_stacking_projections_where_some_have_a_bias_and_some_not_is_refused():
    """Regression: stack_linears took the first projection's bias as every one's: a q without a
    bias beside a k and v with one dropped theirs without a word (the stacked matmul then ran
    with no bias), and the other way round failed on the missing one. Now one line refuses both;
    all or none stack as before."""
    q, k, v = (torch.nn.Linear(8, n, bias=b) for n, b in ((8, False), (4, True), (4, True)))
    for parts in ((q, k, v), (k, q, v)):
        with pytest.raises(ValueError, match="some of these projections have a bias and some not"):
            M.stack_linears(parts)
    weight, bias, outs = M.stack_linears((k, v))
    assert weight.shape == (8, 8) and torch.equal(bias, torch.cat([k.bias, v.bias]))
    assert outs == [4, 4] and M.stack_linears((q, q))[1] is None


def test_rms_norm_keeps_float64_values_and_grads():
    """Regression: rms_norm cast with x.float(), which rounds a float64 model's norms and every
    gradient through them to float32, so the shared-prompt forwards' gradients were 1e-7 off the
    naive twin's (tests/test_grpo.py). float64: rounding only, 1e-12."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, generator=gen, dtype=torch.float64, requires_grad=True)
    got = M.rms_norm(x, w, 1e-5)
    want = w * x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5)  # (5, 64)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    cotangent = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad((got * cotangent).sum(), [x, w])
    want_grads = torch.autograd.grad((want * cotangent).sum(), [x, w])
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


# -----------------------------------------------------------------------------
# Hugging Face checkpoints: round trips and refusals


@pytest.mark.parametrize("tied,shard", [(False, None), (True, None), (False, 20_000), (True, 20_000)])
def test_save_load_round_trip_bit_exact(tmp_path, tied, shard):
    m = make(tie_word_embeddings=tied)
    hf.save_model(m, str(tmp_path), max_shard_bytes=shard)
    names = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in names) == (shard is not None)
    m2 = hf.load_model(str(tmp_path))
    assert m2.config == m.config
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert (m2.lm_head.weight is m2.model.embed_tokens.weight) == tied
    x = torch.randint(0, 96, (2, 8))
    assert torch.equal(m(x), m2(x))


def test_allocate_gives_each_parameter_its_dtype_at_once():
    """Regression: from_pretrained did to_empty(device).to(dtype): the whole model in float32 on
    the device, then converted; a bf16 load peaked at twice the model."""
    with torch.device("meta"):
        m = M.Llama(tiny(tie_word_embeddings=True))
    n = sum(p.numel() for p in m.parameters()) + m.lm_head.weight.numel()  # untied: re-tie after
    peak = allocator_peak(lambda: hf.allocate(m, "cpu", torch.bfloat16))
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in m.parameters()} == {"cpu"}
    assert all(p.requires_grad for p in m.parameters())
    assert peak == 2 * n


def test_bfloat16_keeps_rope_frequencies_in_float32(tmp_path):
    """Regression: as a buffer, inv_freq was rounded to bf16 by model.to(bfloat16) (HF keeps float32)."""
    hf.save_model(make(), str(tmp_path))
    for m in (hf.load_model(str(tmp_path), dtype=torch.bfloat16), make().to(torch.bfloat16)):
        assert m.lm_head.weight.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32
        assert torch.equal(m.inv_freq, M.rope_inv_freq(m.config))
        assert m(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


def test_llama3_rope_scaling_matches_scalar_formula():
    s = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=64)
    cfg = tiny(rope_scaling=s, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    got = M.rope_inv_freq(cfg)
    base = M.rope_inv_freq(tiny(hidden_size=128, num_attention_heads=2, num_key_value_heads=1))
    for f, b in zip(got.tolist(), base.tolist()):
        wavelen = 2 * math.pi / b
        if wavelen < 64 / 4:  # high frequency: unchanged
            want = b
        elif wavelen > 64 / 1:  # low frequency: slowed by factor
            want = b / 8
        else:  # in between: linear blend in 1/wavelen
            smooth = (64 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * b / 8 + smooth * b
        assert math.isclose(f, want, rel_tol=1e-6)

# -----------------------------------------------------------------------------
# config.json: both layouts in, refusals pinned (no transformers needed)

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
# name -> (transformers 4's rope_theta and rope_scaling, 5's rope_parameters, ModelConfig's scaling)
ROPES = {
    "default": ((500000.0, None), {"rope_type": "default", "rope_theta": 500000.0}, None),
    "linear": ((10000.0, {"type": "linear", "factor": 4}),  # "type", an int: early v4 files
               {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
               {"rope_type": "linear", "factor": 4.0}),
    "llama3": ((500000.0, LLAMA3), dict(LLAMA3, rope_theta=500000.0), LLAMA3),
}
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def written_config(m: M.Llama, path) -> dict:
    """Save m and return its config.json as a dict, for the test to rewrite."""
    hf.save_model(m, str(path))
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("rope", list(ROPES))
def test_v4_and_v5_config_layouts_give_the_same_model(tmp_path, rope):
    (theta, scaling), parameters, want = ROPES[rope]
    m = make()  # theta 10000, no scaling: the fallback a misread file would silently get
    ours = written_config(m, tmp_path)
    base = {k: v for k, v in ours.items() if k not in ROPE_KEYS}
    layouts = {"v4": dict(base, rope_theta=theta, rope_scaling=scaling),
               "v5": dict(base, rope_parameters=parameters)}
    configs = {name: hf.config_from_hf(d) for name, d in layouts.items()}
    assert configs["v4"] == configs["v5"]
    assert configs["v4"].rope_theta == theta and configs["v4"].rope_scaling == want
    layouts["ours"] = hf.config_to_hf(configs["v4"], torch.float32)  # both layouts in one file
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (2, 100), generator=gen)  # past llama3's 32 original positions
    logits = {}
    for name, d in layouts.items():
        (tmp_path / "config.json").write_text(json.dumps(d))
        logits[name] = hf.load_model(str(tmp_path))(x)
    assert torch.equal(logits["v4"], logits["v5"]) and torch.equal(logits["v4"], logits["ours"])
    assert (logits["v4"] - m(x)).abs().max() > 1e-2  # the rope read does change the output


DELETE = object()  # an override that removes the field
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3")  # over a Llama's config.json
LLAMA3_NO_LEN = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}


@pytest.mark.parametrize("override, message", [
    (dict(hidden_size="64"), "field 'hidden_size' is \"64\", expected a positive integer"),
    (dict(num_hidden_layers=True),
     "field 'num_hidden_layers' is true, expected a positive integer"),
    (dict(tie_word_embeddings="yes"),
     "field 'tie_word_embeddings' is \"yes\", expected true or false"),
    (dict(eos_token_id=[1, "2"]),
     "field 'eos_token_id' is [1, \"2\"], expected a token id or a list of token ids"),
    (dict(rope_parameters=[1.0]), "field 'rope_parameters' is [1.0], expected a JSON object"),
    (dict(hidden_size=DELETE), "field 'hidden_size' is missing"),
    (dict(num_key_value_heads=3),
     "field 'num_key_value_heads' is 3, which does not divide num_attention_heads=4"),
    (dict(hidden_size=66, head_dim=None),
     "field 'hidden_size' is 66, not a multiple of num_attention_heads=4 (no head_dim)"),
    (dict(head_dim=15), "field 'head_dim' is 15; rotary embeddings need an even head_dim"),
    (dict(architectures=["MixtralForCausalLM"]), "field 'architectures' is ['MixtralForCausalLM'], "
     "expected one of ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM')"),
    (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"),
     "field 'architectures' is ['Qwen3MoeForCausalLM'], expected one of ('LlamaForCausalLM', "
     "'Qwen2ForCausalLM', 'Qwen3ForCausalLM')"),
    (dict(QWEN3, num_experts=128, moe_intermediate_size=768),
     "field 'num_experts' declares a mixture of experts; this engine runs dense models only"),
    (dict(QWEN3, head_dim=DELETE), "field 'head_dim' is missing"),
    (dict(QWEN3, use_sliding_window=True, sliding_window=4096, max_window_layers=1),
     "field 'use_sliding_window' is true with sliding_window 4096 and max_window_layers 1: "
     "layers 1-1 of 2 would slide their window, which is not supported"),
    (dict(QWEN3, use_sliding_window=True, sliding_window=4096, num_hidden_layers=40),  # past
     "field 'use_sliding_window' is true with sliding_window 4096 and max_window_layers 28: "
     "layers 28-39 of 40 would slide their window, which is not supported"),  # the default 28
    (dict(QWEN3, max_window_layers=-1), "field 'max_window_layers' is -1, expected an integer >= 0"),
    (dict(QWEN3, layer_types=["full_attention", "sliding_attention"]),
     "field 'layer_types' has 'sliding_attention'; only 'full_attention' layers are supported"),
    (dict(model_type="qwen2"),
     "field 'model_type' is 'qwen2' but architectures is ['LlamaForCausalLM']"),
    (dict(architectures=DELETE, model_type="mistral"), "field 'model_type' is 'mistral' and there "
     "is no 'architectures' field; expected one of ('llama', 'qwen2', 'qwen3')"),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_key_value_heads=DELETE),
     "field 'num_key_value_heads' is missing"),
    (dict(num_local_experts=8),
     "field 'num_local_experts' declares a mixture of experts; this engine runs dense models only"),
    (dict(use_sliding_window=True),
     "field 'use_sliding_window' asks for sliding-window attention, which is not supported"),
    (dict(sliding_window=4096),
     "field 'sliding_window' asks for sliding-window attention, which is not supported"),
    (dict(layer_types=["full_attention", "sliding_attention"]),
     "field 'layer_types' has 'sliding_attention'; only 'full_attention' layers are supported"),
    (dict(hidden_act="gelu"), "field 'hidden_act' is 'gelu', only 'silu' (SwiGLU) is supported"),
    (dict(pretraining_tp=2), "field 'pretraining_tp' is not 1"),
    (dict(attention_dropout=0.1), "field 'attention_dropout' is not 0; this model has no dropout"),
    (dict(quantization_config={"quant_method": "gptq"}),
     "field 'quantization_config' is set; only unquantized checkpoints are loaded"),
    (dict(partial_rotary_factor=0.5),
     "field 'partial_rotary_factor' is not 1; rotary embeddings here cover the whole head"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}, rope_scaling=DELETE),
     "field 'rope_parameters' has rope_type 'yarn'; supported: default, linear, llama3"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}, rope_parameters=DELETE),
     "field 'rope_scaling' has rope_type 'dynamic'; supported: default, linear, llama3"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "beta_fast": 32.0}),
     "field 'rope_parameters' has 'beta_fast', which rope_type 'linear' does not use"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "field 'rope_parameters' has partial_rotary_factor != 1; rotary embeddings here cover the "
     "whole head"),
    (dict(rope_parameters=LLAMA3_NO_LEN), "field 'rope_parameters' has "
     "original_max_position_embeddings None, expected a positive integer > 0"),
    (dict(rope_parameters=dict(LLAMA3, factor="8"), rope_scaling=DELETE),
     "field 'rope_parameters' has factor '8', expected a number > 0"),
    (dict(rope_theta=-1.0, rope_parameters=DELETE),
     "field 'rope_theta' has rope_theta -1.0, expected a positive number"),
    (dict(rope_theta=500000.0),  # next to rope_parameters' 10000
     "field 'rope_theta' says 500000.0 but rope_parameters says 10000.0; the two config layouts "
     "disagree"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "field 'rope_scaling' says "
     "{'rope_type': 'linear', 'factor': 2.0} but rope_parameters says None; the two config "
     "layouts disagree"),
])
def test_unsupported_configs_are_refused_in_one_line_naming_file_and_field(tmp_path, override,
                                                                            message):
    d = written_config(make(), tmp_path)
    for key, value in override.items():
        if value is DELETE:
            del d[key]
        else:
            d[key] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as error:
        hf.load_model(str(tmp_path))
    assert str(error.value) == f"{tmp_path / 'config.json'}: {message}"


@pytest.mark.parametrize("arch", M.ARCHITECTURES)
def test_config_without_architectures_falls_back_on_model_type(arch):
    """Regression: LlamaConfig.save_pretrained alone writes no "architectures"; it was refused."""
    d = hf.config_to_hf(tiny(architecture=arch), torch.float32)
    del d["architectures"]
    assert hf.config_from_hf(d) == tiny(architecture=arch)


@pytest.mark.parametrize("kw, want", [
    (dict(), set()),
    (dict(attention_bias=True), {"q_proj", "k_proj", "v_proj", "o_proj"}),
    (dict(mlp_bias=True), {"gate_proj", "up_proj", "down_proj"}),
    (dict(architecture="Qwen2ForCausalLM"), {"q_proj", "k_proj", "v_proj"}),
    (dict(architecture="Qwen3ForCausalLM"), set()),
    (dict(architecture="Qwen3ForCausalLM", attention_bias=True),
     {"q_proj", "k_proj", "v_proj", "o_proj"}),
])
def test_biases_are_where_transformers_puts_them(kw, want):
    """transformers' Llama: attention_bias on q/k/v/o, mlp_bias on gate/up/down; Qwen2: q/k/v;
    Qwen3: attention_bias on q/k/v/o."""
    params = M.Llama(tiny(**kw)).named_parameters()
    assert {name.split(".")[-2] for name, _ in params if name.endswith(".bias")} == want

# -----------------------------------------------------------------------------
# Tensors: missing, unused, misshaped; generation_config.json and stop ids


def test_missing_and_misshaped_tensors_are_refused(tmp_path):
    hf.save_model(make(), str(tmp_path))
    f = str(tmp_path / "model.safetensors")
    sd = {k: t.clone() for k, t in load_file(f).items()}  # off the mmap: f is rewritten below
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, f)
    with pytest.raises(ValueError, match="missing 1 tensors, e.g. 'model.layers.1.mlp.up_proj.weight'"):
        hf.load_model(str(tmp_path))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, f)
    message = ("model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has shape (3, 3), "
               "config.json implies (96, 64)")
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        hf.load_model(str(tmp_path))


@pytest.mark.parametrize("written, config, tensor, why", [
    # Regression: an o_proj bias (a Llama with attention_bias) under a Qwen2 config was dropped.
    (dict(attention_bias=True), dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
     "model.layers.0.self_attn.o_proj.bias (2 such tensors)", "config.json declares no such bias"),
    (dict(mlp_bias=True), dict(mlp_bias=False),
     "model.layers.0.mlp.down_proj.bias (6 such tensors)", "config.json declares no such bias"),
    # A Qwen3 checkpoint under a Llama config.json: the same tensors but its q/k norms
    (dict(architecture="Qwen3ForCausalLM"),
     dict(architectures=["LlamaForCausalLM"], model_type="llama"),
     "model.layers.0.self_attn.k_norm.weight (4 such tensors)",
     "config.json's architecture has no per-head q/k norms (Qwen3ForCausalLM has)"),
])
def test_unused_tensors_are_refused_never_dropped(tmp_path, written, config, tensor, why):
    d = written_config(make(**written), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(d, **config)))
    name, count = tensor.split(" ", 1)
    message = f"model.safetensors: tensor '{name}' is not used {count}: {why}"
    with pytest.raises(ValueError, match=re.escape(message)):
        hf.load_model(str(tmp_path))


@pytest.mark.parametrize("shard", [None, 20_000])
def test_a_tied_checkpoint_with_its_stored_copy_loads_as_without_it(tmp_path, shard):
    """The Hub's Qwen3-0.6B and 1.7B: tie_word_embeddings true and lm_head.weight stored too (one
    file, or beside the embedding in a shard). Regression: refused as an unused tensor. Loaded,
    the head is the embedding itself, as without the copy; a NaN in both loads too (bit-equal)."""
    m = make(architecture="Qwen3ForCausalLM", tie_word_embeddings=True)
    with torch.no_grad():
        m.model.embed_tokens.weight[5, 3] = float("nan")
    hf.save_model(m, str(tmp_path), max_shard_bytes=shard)
    store_tied_copy(tmp_path)
    assert "lm_head.weight" in hf.checkpoint_tensors(str(tmp_path))
    loaded = hf.load_model(str(tmp_path))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, a), b in zip(loaded.state_dict().items(), m.state_dict().values()):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name


@pytest.mark.parametrize("change, message", [
    (slice(95, 96), "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', which "
     "config.json ties it to (tie_word_embeddings true): transformers 4 would drop the copy, "
     "transformers 5 untie the two. Set tie_word_embeddings false to load both, or delete the "
     "copy to tie the head to the embedding"),
    ("shape", "tensor 'lm_head.weight' has shape (95, 64), not the shape (96, 64) of the "
     "embedding config.json ties it to (tie_word_embeddings)"),
])
def test_a_tied_checkpoint_whose_stored_copy_differs_is_refused(tmp_path, change, message,
                                                                  monkeypatch):
    """A copy that is not the embedding means two models (transformers 5 unties them): one line.
    Its last row differs, in the last chunk compared (hf.COMPARE_BYTES shrunk to 10 rows)."""
    monkeypatch.setattr(hf, "COMPARE_BYTES", 10 * 64 * 8)
    hf.save_model(make(tie_word_embeddings=True), str(tmp_path))
    if change == "shape":
        f = str(tmp_path / "model.safetensors")
        sd = {k: t.clone() for k, t in load_file(f).items()}
        save_file(dict(sd, **{"lm_head.weight": sd["model.embed_tokens.weight"][:95].clone()}), f)
    else:
        store_tied_copy(tmp_path, change)
    with pytest.raises(ValueError) as error:
        hf.load_model(str(tmp_path))
    assert str(error.value) == f"{tmp_path / 'model.safetensors'}: {message}"


@pytest.mark.parametrize("differs", [False, True])
def test_transformers_ties_an_equal_stored_copy_and_unties_a_different_one(tmp_path, differs):
    """The reference for the two tests above: transformers 5 loads the Hub's layout tied and
    computes the logits this engine does; a copy that differs it unties (a different model),
    which this engine refuses."""
    transformers = pytest.importorskip("transformers")
    hf_checkpoint(tmp_path, "Qwen3Config", head_dim=24, tie_word_embeddings=True)
    store_tied_copy(tmp_path, slice(0, 1) if differs else None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == (not differs)
    if differs:
        with pytest.raises(ValueError, match="tensor 'lm_head.weight' differs from"):
            hf.load_model(str(tmp_path))
        return
    ours = hf.load_model(str(tmp_path))
    x = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_close(ours(x), theirs(x).logits, ours.config)


def test_a_tensor_no_module_has_is_refused_and_shards_must_match_their_index(tmp_path):
    hf.save_model(make(), str(tmp_path), max_shard_bytes=20_000)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    sd = {k: t.clone() for k, t in load_file(str(tmp_path / first)).items()}  # off the mmap
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}  # old HF files have it
    save_file(dict(sd, **extra), str(tmp_path / first))
    with pytest.raises(ValueError, match=re.escape(
            f"{first}: tensor 'model.layers.0.self_attn.rotary_emb.inv_freq' is not used (1 such "
            "tensors): no module of the model config.json describes uses it")):
        hf.load_model(str(tmp_path))
    save_file(sd, str(tmp_path / first))
    name = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][name] = second
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=re.escape(
            f"model.safetensors.index.json: lists tensor '{name}' in {second}, which does not "
            "hold it")):
        hf.load_model(str(tmp_path))


def test_bad_directories_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        hf.load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        hf.load_model(str(tmp_path))
    hf.save_model(make(), str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        hf.load_model(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="never pickled"):
        hf.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        hf.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: is a JSON list, expected an object$"):
        hf.load_model(str(tmp_path))


def test_generation_config_round_trip_and_stop_token_ids(tmp_path):
    m = make(eos_token_id=2, pad_token_id=0)
    generation = {"eos_token_id": [7, 2], "temperature": 0.6}
    hf.save_model(m, str(tmp_path), generation_config=generation)
    assert hf.load_generation_config(str(tmp_path)) == generation
    cfg = hf.load_config(str(tmp_path))
    assert cfg == m.config and cfg.pad_token_id == 0
    assert hf.stop_token_ids(cfg, generation) == (2, 7)  # config.json's first, 2 once
    assert hf.stop_token_ids(cfg, None) == (2,)
    assert hf.stop_token_ids(tiny(eos_token_id=[5, 6]), {"eos_token_id": 9}) == (5, 6, 9)
    assert hf.stop_token_ids(tiny(), {"temperature": 1.0}) == ()
    hf.save_model(make(), str(tmp_path / "plain"))
    assert hf.load_generation_config(str(tmp_path / "plain")) is None
    with pytest.raises(TypeError, match="generation_config must be a dict, got a list"):
        hf.save_model(m, str(tmp_path / "bad"), generation_config=[2])
    file = tmp_path / "generation_config.json"
    file.write_text('{"eos_token_id": "2"}')
    with pytest.raises(ValueError, match=re.escape(
            "generation_config.json: field 'eos_token_id' is \"2\", expected a token id or a list "
            "of token ids")):
        hf.load_generation_config(str(tmp_path))
    file.write_text("[2]")
    with pytest.raises(ValueError, match="generation_config.json: is a JSON list, expected an "
                                         "object$"):
        hf.load_generation_config(str(tmp_path))

# -----------------------------------------------------------------------------
# Parity with transformers itself (skipped when it is not importable)

HF_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
HF_CASES = {  # name -> transformers config class, its arguments beyond HF_BASE
    "theta_500000": ("LlamaConfig", dict(rope_theta=500000.0)),
    "llama3_scaling": ("LlamaConfig", dict(rope_parameters=dict(LLAMA3, rope_theta=500000.0))),
    "linear_scaling": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", factor=4.0,
                                                                rope_theta=10000.0))),
    "qwen2_bias": ("Qwen2Config", dict(rope_theta=1000000.0)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "attention_bias": ("LlamaConfig", dict(attention_bias=True)),
    "mlp_bias": ("LlamaConfig", dict(mlp_bias=True)),
    "head_dim_32": ("LlamaConfig", dict(head_dim=32)),  # C/H is 16
    "tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "eps_1e-2": ("LlamaConfig", dict(rms_norm_eps=1e-2)),
    # Qwen3: q/k norms, H*D = 96 != C = 64; tied with q/k/v/o biases and GQA 6/2 (rep 3 != Hkv 2)
    "qwen3": ("Qwen3Config", dict(head_dim=24, rope_theta=1000000.0)),
    "qwen3_tied_bias": ("Qwen3Config", dict(head_dim=16, num_attention_heads=6,
                                            tie_word_embeddings=True, attention_bias=True,
                                            rms_norm_eps=1e-2)),
}


def hf_checkpoint(path, config_class: str, **kw):
    """A transformers model of that config with random weights, saved by transformers' writer."""
    return save_random_hf_model(path, config_class, {**HF_BASE, **kw})


@pytest.mark.parametrize("case", list(HF_CASES))
def test_checkpoints_written_by_transformers_load_exactly(tmp_path, case):
    """Regression: config.json as transformers 5 writes it (rope_parameters) was read with theta
    10000, and a checkpoint's o_proj bias was dropped; the old parity test read only our files."""
    config_class, kw = HF_CASES[case]
    theirs = hf_checkpoint(tmp_path, config_class, **kw)
    m = hf.load_model(str(tmp_path))
    assert m.config.rope_theta == theirs.config.rope_parameters["rope_theta"]
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in theirs.parameters())
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 96, (2, 100), generator=gen)  # past llama3's 32 original positions
    with torch.no_grad():
        # fp32: the two differ only by summation order (tests/tolerance.py, at the logits'
        # magnitude, 1-10); a misread field (theta, scaling, eps, a bias) moves them by 1e-2 or more.
        assert_logits_close(m(x), theirs(x).logits, m.config)
    assert hf.stop_token_ids(m.config, hf.load_generation_config(str(tmp_path))) == (
        () if theirs.config.eos_token_id is None else (theirs.config.eos_token_id,))


# The published Qwen3-0.6B's config.json, its 28 layers cut to 2: C = 1024, 16 heads of 128 (H*D =
# 2048 != C), 8 kv heads (rep 2 != Hkv 8), the 151,936-id vocabulary, tied.
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)


# Qwen3-0.6B's config.json as published (transformers 4.51's layout: top-level rope_theta).
QWEN3_0_6B_V4 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_the_published_qwen3_config_reads_alike_in_both_layouts():
    """Qwen3-0.6B's published config.json (transformers 4's layout) and its transformers 5 form
    (rope_parameters, layer_types) give the same model: 16/8 heads of 128 at width 1024, theta
    1e6, tied; and what the engine writes back reads as the same."""
    v5 = {k: v for k, v in QWEN3_0_6B_V4.items() if k not in ("rope_theta", "rope_scaling")}
    v5.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
              layer_types=["full_attention"] * 28, dtype="bfloat16")
    cfg = hf.config_from_hf(QWEN3_0_6B_V4)
    assert cfg == hf.config_from_hf(v5) == hf.config_from_hf(hf.config_to_hf(cfg, torch.bfloat16))
    assert (cfg.architecture, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.rope_theta, cfg.tie_word_embeddings, cfg.attention_bias, cfg.qk_norm) == (
        "Qwen3ForCausalLM", 128, 16, 8, 1e6, True, False, True)
    with torch.device("meta"):
        n = sum(p.numel() for p in M.Llama(cfg).parameters())
    assert n == 596_049_920  # Qwen3-0.6B: 0.6B parameters, 0.44B without the embedding


def rms_norm_in_its_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward with its cast to float32 made a cast to at least float32:
    a float64 model's norms stay float64 (model.rms_norm's rule)."""
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(dtype)


@pytest.mark.parametrize("shape", ["tiny", "qwen3_0.6b"])
def test_qwen3_logits_equal_transformers_in_float32_and_float64(tmp_path, monkeypatch, shape):
    """A Qwen3 checkpoint transformers wrote (random weights; the tiny config, and Qwen3-0.6B's
    shapes at HF's init scale) gives transformers' logits: float32 within 1e-4 (and the summation-
    order bound), float64 to 1e-12. transformers' own RMSNorm rounds a float64 model's norms to
    float32 (1e-6 off here), so its float64 twin runs with that cast lifted (rms_norm_in_its_dtype);
    everything else, q/k norms, RoPE and GQA included, is transformers' code."""
    modeling_qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    if shape == "tiny":
        config, std = {**HF_BASE, **HF_CASES["qwen3"][1]}, 0.2
    else:
        config, std = QWEN3_0_6B, 0.02  # 0.2 at C = 1024 would blow the activations up
    theirs = save_random_hf_model(tmp_path, "Qwen3Config", config, std)
    ours = hf.load_model(str(tmp_path))
    assert ours.config.architecture == "Qwen3ForCausalLM" and ours.config.head_dim == \
        config["head_dim"]
    x = torch.randint(0, config["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(x), theirs(x).logits
        assert (got - want).abs().max() <= 1e-4
        assert_logits_close(got, want, ours.config)
        monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_its_dtype)
        got, want = ours.double()(x), theirs.double()(x).logits
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_qwen3_configs_that_ask_for_sliding_windows_on_no_layer_load():
    """use_sliding_window true beside max_window_layers >= the layer count (or no sliding_window)
    makes every layer full attention in transformers' Qwen2/Qwen3 configs. Regression: refused."""
    base = hf.config_from_hf(QWEN3_0_6B_V4)
    for window in (dict(sliding_window=4096, max_window_layers=28),
                   dict(sliding_window=4096, max_window_layers=36), dict(sliding_window=None)):
        assert hf.config_from_hf(dict(QWEN3_0_6B_V4, use_sliding_window=True, **window)) == base
    with pytest.raises(ValueError, match="layers 27-27 of 28 would slide their window"):
        hf.config_from_hf(dict(QWEN3_0_6B_V4, use_sliding_window=True, sliding_window=4096,
                               max_window_layers=27))


@pytest.mark.parametrize("window", [
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),  # = L: none slides
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=5),
    dict(use_sliding_window=True, sliding_window=8),  # transformers' default 28 > L = 2
    dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),  # no window
    dict(use_sliding_window=False, sliding_window=8, max_window_layers=0),  # off
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # layer 1 slides
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),  # both slide
])
@pytest.mark.parametrize("config_class", ["Qwen2Config", "Qwen3Config"])
def test_sliding_window_fields_are_read_as_transformers_reads_them(tmp_path, window, config_class):
    """config.json without layer_types (transformers 4's files): transformers derives them from
    use_sliding_window, sliding_window and max_window_layers. Where it makes every layer full
    attention this engine loads the checkpoint and gives its logits over 30 tokens (a window of 8
    would change them); where a layer slides, it is refused, naming those layers."""
    transformers = pytest.importorskip("transformers")
    kw = dict(head_dim=24) if config_class == "Qwen3Config" else {}
    hf_checkpoint(tmp_path, config_class, **kw, **window)
    file = tmp_path / "config.json"
    d = {k: v for k, v in json.loads(file.read_text()).items() if k != "layer_types"}
    file.write_text(json.dumps(dict(d, **window)))  # as given (transformers 5 writes null windows)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                               attn_implementation="eager")
    sliding = [i for i, t in enumerate(theirs.config.layer_types) if t == "sliding_attention"]
    if sliding:
        with pytest.raises(ValueError, match=f"layers {sliding[0]}-{sliding[-1]} of 2 would slide"):
            hf.load_model(str(tmp_path))
        return
    ours = hf.load_model(str(tmp_path))
    x = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_close(ours(x), theirs(x).logits, ours.config)


@pytest.mark.parametrize("config_class, arch", [("LlamaConfig", "LlamaForCausalLM"),
                                                ("Qwen2Config", "Qwen2ForCausalLM"),
                                                ("Qwen3Config", "Qwen3ForCausalLM")])
def test_config_written_by_transformers_config_alone_is_read(tmp_path, config_class, arch):
    """Regression: LlamaConfig(rope_theta=500000).save_pretrained(d) gave
    rope_theta 10000; the file has no "architectures" either, only model_type."""
    transformers = pytest.importorskip("transformers")
    # head_dim: Qwen3's config.json always has one (transformers' Qwen3Config writes its 128)
    getattr(transformers, config_class)(**HF_BASE, rope_theta=500000).save_pretrained(str(tmp_path))
    assert "architectures" not in json.loads((tmp_path / "config.json").read_text())
    cfg = hf.load_config(str(tmp_path))
    assert cfg.rope_theta == 500000.0 and cfg.architecture == arch


def test_unused_tensor_of_a_transformers_checkpoint_is_refused(tmp_path):
    hf_checkpoint(tmp_path, "LlamaConfig", attention_bias=True)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(d, attention_bias=False)))
    message = "model.safetensors: tensor 'model.layers.0.self_attn.k_proj.bias' is not used"
    with pytest.raises(ValueError, match=re.escape(message)):
        hf.load_model(str(tmp_path))


@pytest.mark.parametrize("arch, kw", [
    ("LlamaForCausalLM", dict()),
    ("LlamaForCausalLM", dict(tie_word_embeddings=True, rope_scaling=LLAMA3)),
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 4.0},
                              rope_theta=500000.0)),
    ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, head_dim=32, rms_norm_eps=1e-2)),
    ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0, head_dim=24)),
    ("Qwen3ForCausalLM", dict(attention_bias=True, num_attention_heads=6, rms_norm_eps=1e-2)),
])
def test_transformers_reads_what_we_write(tmp_path, arch, kw):
    """Only a comparison with the real library catches a wrong rotary convention (the model still
    trains); our config.json carries both rope layouts, and transformers 5 must read it as we do."""
    transformers = pytest.importorskip("transformers")
    m = make(architecture=arch, eos_token_id=2, pad_token_id=0, **kw)
    hf.save_model(m, str(tmp_path), generation_config={"eos_token_id": [2, 5]})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                           attn_implementation="eager")
    assert theirs.config.rope_parameters["rope_theta"] == m.config.rope_theta
    assert theirs.config.pad_token_id == 0 and theirs.generation_config.eos_token_id == [2, 5]
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in theirs.parameters())
    x = torch.randint(0, 96, (2, 100))
    with torch.no_grad():
        assert_logits_close(m(x), theirs(x).logits, m.config)  # as above
