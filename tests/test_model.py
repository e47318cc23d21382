"""model.py against plain float64 loops, Hugging Face's layout, and its own refusals."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import model as M


def tiny(**kw) -> M.ModelConfig:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    return M.ModelConfig(**base)


def make(seed: int = 0, std: float = 0.2, **kw) -> M.Llama:
    # std 0.2 (not HF's 0.02) so attention patterns and logits are far from uniform: bugs show.
    return M.Llama(tiny(**kw)).init_weights(seed, std=std)

# -----------------------------------------------------------------------------
# The forward against a plain float64 loop


def reference_forward(m: M.Llama, tokens: list[int]) -> torch.Tensor:
    """One sequence, one token and one head at a time, float64, rope by explicit pair rotation."""
    cfg, sd = m.config, {k: v.double() for k, v in m.state_dict().items()}
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

    xs = [sd["model.embed_tokens.weight"][t] for t in tokens]
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        hs = [rms(x, sd[p + "input_layernorm.weight"]) for x in xs]
        qs = [sd[p + "self_attn.q_proj.weight"] @ h for h in hs]
        ks = [sd[p + "self_attn.k_proj.weight"] @ h for h in hs]
        vs = [sd[p + "self_attn.v_proj.weight"] @ h for h in hs]
        new = []
        for t in range(len(xs)):
            heads = []
            for h in range(H):
                g = h // (H // Hkv)  # GQA: query head h reads kv head h // (H/Hkv)
                q = rope(qs[t][h * D:(h + 1) * D], t)
                scores = [q @ rope(ks[s][g * D:(g + 1) * D], s) / math.sqrt(D) for s in range(t + 1)]
                w = torch.softmax(torch.stack(scores), 0)
                heads.append(sum(w[s] * vs[s][g * D:(g + 1) * D] for s in range(t + 1)))
            x = xs[t] + sd[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
            h2 = rms(x, sd[p + "post_attention_layernorm.weight"])
            a = F.silu(sd[p + "mlp.gate_proj.weight"] @ h2) * (sd[p + "mlp.up_proj.weight"] @ h2)
            new.append(x + sd[p + "mlp.down_proj.weight"] @ a)
        xs = new
    head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return torch.stack([head @ rms(x, sd["model.norm.weight"]) for x in xs])


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_forward_matches_float64_loop(kv_heads):
    m = make(num_key_value_heads=kv_heads).double()
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
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)  # fp32 reordering only


def test_explicit_positions_equal_default_and_shift_changes_output():
    m = make()
    x = torch.randint(0, 96, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    assert torch.equal(m(x), m(x, positions=pos))
    assert not torch.allclose(m(x), m(x, positions=pos + 3))


def test_hidden_at_last_positions_equals_full_forward_and_hook_sees_every_position():
    m = make()
    x, last = torch.randint(0, 96, (3, 7)), torch.tensor([6, 2, 4])  # ragged: right-padded prompts
    seen = []

    def hook(layer, q, k, v):
        seen.append(k.shape[2])
        return M.causal_attention(layer, q, k, v)
    got = m.hidden(x, None, hook, last)  # (3, 1, C)
    assert got.shape == (3, 1, 64) and seen == [7, 7]  # the final layer's K/V still cover all 7 positions
    # The final MLP runs on 3 rows instead of 21: the matmul may block differently, hence not bit-exact.
    torch.testing.assert_close(got[:, 0], m.hidden(x)[torch.arange(3), last], atol=1e-5, rtol=1e-5)

# -----------------------------------------------------------------------------
# Shared-prefix attention (used by rollout.py and grpo.py) against plain concatenation


def test_prefix_attention_equals_concatenated_keys_values_and_grads():
    torch.manual_seed(0)
    Bp, G, H, Hkv, P, T, D = 2, 3, 4, 2, 5, 4, 8
    q = torch.randn(Bp * G, H, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(Bp * G, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(Bp * G, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    pk = torch.randn(Bp, Hkv, P, D, dtype=torch.float64, requires_grad=True)
    pv = torch.randn(Bp, Hkv, P, D, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(Bp, P, dtype=torch.bool)
    valid[1, 3:] = False  # right padding of the second prompt
    own = torch.ones(T, T, dtype=torch.bool).tril()[None]
    out = M.prefix_attention(q, k, v, own, pk, pv, valid)
    # Slow twin: copy the prefix G times, concatenate, one masked softmax.
    K = torch.cat([pk.repeat_interleave(G, 0), k], 2)
    V = torch.cat([pv.repeat_interleave(G, 0), v], 2)
    mask = torch.cat([valid.repeat_interleave(G, 0)[:, None, :].expand(-1, T, -1), own.expand(Bp * G, -1, -1)], 2)
    ref = F.scaled_dot_product_attention(q, K, V, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)  # float64: only summation order differs
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out * w).sum(), [q, k, v, pk, pv])
    grads_ref = torch.autograd.grad((ref * w).sum(), [q, k, v, pk, pv])
    for g, gr in zip(grads, grads_ref):
        torch.testing.assert_close(g, gr, atol=1e-12, rtol=1e-12)

# -----------------------------------------------------------------------------
# Hugging Face checkpoints: round trips and refusals


@pytest.mark.parametrize("tied,shard", [(False, None), (True, None), (False, 20_000), (True, 20_000)])
def test_save_load_round_trip_bit_exact(tmp_path, tied, shard):
    m = make(tie_word_embeddings=tied)
    m.save_pretrained(str(tmp_path), max_shard_bytes=shard)
    names = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in names) == (shard is not None)
    m2 = M.Llama.from_pretrained(str(tmp_path))
    assert m2.config == m.config
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert (m2.lm_head.weight is m2.model.embed_tokens.weight) == tied
    x = torch.randint(0, 96, (2, 8))
    assert torch.equal(m(x), m2(x))


def test_bfloat16_keeps_rope_frequencies_in_float32(tmp_path):
    """Regression: as a buffer, inv_freq was rounded to bf16 by model.to(bfloat16) (HF keeps float32)."""
    make().save_pretrained(str(tmp_path))
    for m in (M.Llama.from_pretrained(str(tmp_path), dtype=torch.bfloat16), make().to(torch.bfloat16)):
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


def write_checkpoint(path, m: M.Llama, **config_overrides):
    m.save_pretrained(str(path))
    cfg_file = path / "config.json"
    d = json.loads(cfg_file.read_text())
    d.update(config_overrides)
    cfg_file.write_text(json.dumps(d))


@pytest.mark.parametrize("override,message", [
    (dict(architectures=["MixtralForCausalLM"]), "architectures"),
    (dict(num_local_experts=8), "num_local_experts"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_size=None), "hidden_size"),
])
def test_unsupported_configs_are_refused_naming_file_and_field(tmp_path, override, message):
    override = {k: v for k, v in override.items() if v is not None}
    write_checkpoint(tmp_path, make(), **override)
    if "hidden_size" == message:
        d = json.loads((tmp_path / "config.json").read_text())
        del d["hidden_size"]
        (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"config.json: field '{message}'"):
        M.Llama.from_pretrained(str(tmp_path))


def test_missing_and_misshaped_tensors_are_refused(tmp_path):
    make().save_pretrained(str(tmp_path))
    f = str(tmp_path / "model.safetensors")
    sd = load_file(f)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, f)
    with pytest.raises(ValueError, match="missing 1 tensors, e.g. 'model.layers.1.mlp.up_proj.weight'"):
        M.Llama.from_pretrained(str(tmp_path))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, f)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has shape \(3, 3\)"):
        M.Llama.from_pretrained(str(tmp_path))


def test_bad_directories_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        M.Llama.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        M.Llama.from_pretrained(str(tmp_path))
    make().save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        M.Llama.from_pretrained(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="never pickled"):
        M.Llama.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        M.Llama.from_pretrained(str(tmp_path))

# -----------------------------------------------------------------------------
# Tokenizer and parity with transformers


def test_char_tokenizer_round_trips_through_tokenizer_json(tmp_path):
    tok = M.build_char_tokenizer("0123456789+= abc")
    tok.save(str(tmp_path / "tokenizer.json"))
    tok2 = M.load_tokenizer(str(tmp_path))
    text = "12+ab= 3"
    ids = tok2.encode(text).ids
    assert len(ids) == len(text) and tok2.decode(ids) == text
    assert tok2.token_to_id("<eos>") == 2 and tok2.encode("<bos>1").ids == [1, tok2.token_to_id("1")]


@pytest.mark.parametrize("arch,tied", [("LlamaForCausalLM", False), ("LlamaForCausalLM", True), ("Qwen2ForCausalLM", True)])
def test_logits_match_transformers(tmp_path, arch, tied):
    """Only a comparison with the real library catches a wrong rotary convention (the model still trains)."""
    transformers = pytest.importorskip("transformers")
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32) if tied else None
    m = make(architecture=arch, tie_word_embeddings=tied, attention_bias=arch.startswith("Qwen"), rope_scaling=scaling)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(".bias"):
                p.normal_()
    m.save_pretrained(str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager")
    x = torch.randint(0, 96, (2, 100))
    with torch.no_grad():
        torch.testing.assert_close(m(x), hf(x).logits, atol=1e-4, rtol=0)  # the bar: 1e-4 in fp32
