"""
The Hugging Face format: checkpoint directories in and out (tokenizers: engine/tokenizer.py).

Checkpoints in: config.json in the transformers 4 layout (top-level rope_theta / rope_scaling) or
the 5 layout (rope_parameters), for LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM. Every
field that changes the math is read; anything model.py would not compute exactly as transformers
does (MoE such as Qwen3MoeForCausalLM, a layer that slides its window, other rope types, partial
rotary, a field of the wrong type, a tensor no module uses) is refused with one line naming the file
and the field or tensor. A tied checkpoint may store its lm_head.weight beside the embedding, as the
Hub's Qwen3-0.6B and 1.7B do: the copy is loaded when it equals the embedding, refused when not.
Weights are read with safetensors only (model.safetensors, or the shards its index lists), never
unpickled. Checkpoints out: a config.json both versions read alike, and
generation_config.json when given one. stop_token_ids: config.json's and generation_config.json's
eos ids together.

Leaves out: other architectures, quantized or pickled checkpoints.
Tested by tests/test_model.py.
"""

import json
import os
from typing import Callable

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from model import ARCHITECTURES, Llama, ModelConfig

# model_type -> architecture, for a config.json without "architectures" (a model's save_pretrained
# writes that field, LlamaConfig.save_pretrained alone does not).
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
# A tied model's head and embedding; the Hub's Qwen3-0.6B and 1.7B store the head too (a copy).
TIED_COPY, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"

# -----------------------------------------------------------------------------
# Checkpoint directories: the model in and out


def load_model(path: str, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Llama:
    """The model an HF checkpoint directory describes, or one ValueError saying why not."""
    cfg = load_config(path)
    files = check_checkpoint(path, expected_shapes(cfg))  # name -> file; names, shapes checked
    if tied_copy_differs(cfg, files):
        raise ValueError(tied_copy_message(files))
    with torch.device("meta"):
        model = Llama(cfg)
    allocate(model, device, dtype)  # NOTE: re-creates every parameter, which unties lm_head
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    with torch.no_grad():
        for file in sorted(set(files.values())):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in [n for n in params if files[n] == file]:
                    params[name].copy_(f.get_tensor(name))
    return model


def save_model(model: Llama, path: str, max_shard_bytes: int | None = None,
               generation_config: dict | None = None, tokenizer=None) -> None:
    """Write config.json and model.safetensors (or shards + model.safetensors.index.json),
    generation_config.json when given one (the source's, from load_generation_config), and the
    tokenizer's files when given one (tokenizer.PromptTokenizer: the source's, verbatim)."""
    # A tied lm_head appears once, as the embedding: not written, as HF does (and safetensors
    # refuses shared storage anyway).
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    write_pretrained(path, model.config, tensors, max_shard_bytes, generation_config)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def allocate(model: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """Uninitialised memory on `device` in `dtype` for every parameter of a model built on the meta
    device (the loaders then fill it). Not module.to_empty(device).to(dtype): that allocates the
    whole model in float32 first, so a bf16 load peaked at 4 bytes a parameter on the device
    instead of 2. Re-creates each parameter: a tied lm_head comes out untied (re-tie it)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=p.requires_grad))
    return model


def write_pretrained(path: str, config: ModelConfig, tensors: dict[str, Tensor],
                     max_shard_bytes: int | None = None,
                     generation_config: dict | None = None) -> None:
    """A Hugging Face checkpoint directory from a config and the full tensors named as
    Llama.named_parameters() names them (tp.py gathers a sharded model's into such a dict)."""
    if generation_config is not None and not isinstance(generation_config, dict):
        kind = type(generation_config).__name__
        raise TypeError(f"generation_config must be a dict, got a {kind}")
    expected = expected_shapes(config)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        wrong = sorted(set(got.items()) ^ set(expected.items()))
        raise ValueError(f"write_pretrained: tensors do not match the config, e.g. {wrong[0]}")
    os.makedirs(path, exist_ok=True)
    if generation_config is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config, f, indent=2)
    state = {n: t.cpu().contiguous() for n, t in tensors.items()}
    dtype = next(iter(state.values())).dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config, dtype), f, indent=2)
    shards = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

# -----------------------------------------------------------------------------
# config.json: transformers 4 and 5 layouts in, one layout both read out

# Every config.json field read below and the JSON value it must hold ("?": null allowed = absent).
FIELD_TYPES = {
    "architectures": "names?", "model_type": "name?", "hidden_act": "name",
    "vocab_size": "size", "hidden_size": "size", "intermediate_size": "size",
    "num_hidden_layers": "size", "num_attention_heads": "size", "num_key_value_heads": "size?",
    "head_dim": "size?", "max_position_embeddings": "size", "rms_norm_eps": "number",
    "rope_theta": "number?", "rope_scaling": "object?", "rope_parameters": "object?",
    "partial_rotary_factor": "number?", "tie_word_embeddings": "bool", "attention_bias": "bool",
    "mlp_bias": "bool", "use_sliding_window": "bool", "sliding_window": "size?",
    "max_window_layers": "count?", "layer_types": "names?",
    "pretraining_tp": "size?", "attention_dropout": "number",
    "bos_token_id": "id?", "pad_token_id": "id?", "eos_token_id": "ids?",
}
EXPECTED = {"names": "a list of strings", "name": "a string", "size": "a positive integer",
            "count": "an integer >= 0",
            "number": "a number", "object": "a JSON object", "bool": "true or false",
            "id": "a token id (an integer >= 0)", "ids": "a token id or a list of token ids"}

# The rope types computed here, with the fields each needs (transformers' names). A missing one is
# refused: transformers 5 would default original_max_position_embeddings to max_position_embeddings,
# transformers 4 would fail.
ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def json_value_is(value, kind: str) -> bool:
    """Whether a JSON value is of one of FIELD_TYPES' kinds (bool is never a number here)."""
    if value is None:
        return kind.endswith("?")
    kind = kind.rstrip("?")
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "ids":
        return json_value_is(value, "id") or (isinstance(value, list) and len(value) > 0
                                              and all(json_value_is(v, "id") for v in value))
    if kind == "names":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return {"name": isinstance(value, str),
            "size": is_int and value > 0,
            "count": is_int and value >= 0,
            "id": is_int and value >= 0,
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "object": isinstance(value, dict),
            "bool": isinstance(value, bool)}[kind]


def config_from_hf(d: dict, source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json (transformers 4 or 5 layout). Anything this model would not
    compute exactly as transformers does is refused by one ValueError naming the file and field."""
    def refuse(field: str, why: str):
        raise ValueError(f"{source}: field '{field}' {why}")
    if not isinstance(d, dict):
        raise ValueError(f"{source}: is a JSON {type(d).__name__}, expected an object")
    for field, kind in FIELD_TYPES.items():
        if field in d and not json_value_is(d[field], kind):
            refuse(field, f"is {json.dumps(d[field])[:60]}, expected {EXPECTED[kind.rstrip('?')]}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    for field in required:
        if d.get(field) is None:
            refuse(field, "is missing")
    arch = hf_architecture(d, refuse)
    refuse_unsupported(d, arch, refuse)
    theta, scaling = rope_from_hf(d, refuse)
    llama = arch == "LlamaForCausalLM"
    qwen2 = arch == "Qwen2ForCausalLM"
    qwen3 = arch == "Qwen3ForCausalLM"
    C, H = d["hidden_size"], d["num_attention_heads"]
    # transformers' Qwen2 and Qwen3 would take 32 kv heads, not H; Qwen3 a head_dim of 128, not C/H
    if (qwen2 or qwen3) and d.get("num_key_value_heads") is None:
        refuse("num_key_value_heads", "is missing")
    if qwen3 and d.get("head_dim") is None:
        refuse("head_dim", "is missing")
    Hkv = d.get("num_key_value_heads") or H  # Llama: a missing one means H (multi-head attention)
    if H % Hkv:
        refuse("num_key_value_heads", f"is {Hkv}, which does not divide num_attention_heads={H}")
    if d.get("head_dim") is None and C % H:
        refuse("hidden_size", f"is {C}, not a multiple of num_attention_heads={H} (no head_dim)")
    D = d.get("head_dim") or C // H
    if D % 2:
        refuse("head_dim", f"is {D}; rotary embeddings need an even head_dim")
    return ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=C, intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=H, num_key_value_heads=Hkv,
        head_dim=d.get("head_dim") or 0,
        # transformers' defaults: Qwen2 and Qwen3 32768, Llama 2048
        max_position_embeddings=d.get("max_position_embeddings", 2048 if llama else 32768),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        # Qwen2 has no such fields (transformers ignores them): q/k/v bias, no o_proj or MLP bias.
        # Qwen3 reads attention_bias (q/k/v/o) and has no mlp_bias (transformers ignores it).
        attention_bias=True if qwen2 else d.get("attention_bias", False),
        mlp_bias=d.get("mlp_bias", False) if llama else False,
        architecture=arch, bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )


def hf_architecture(d: dict, refuse: Callable) -> str:
    """The architecture "architectures" names (it must agree with model_type), else model_type's."""
    archs, model_type = d.get("architectures"), d.get("model_type")
    if archs is None:
        if model_type not in MODEL_TYPES:
            refuse("model_type", f"is {model_type!r} and there is no 'architectures' field; "
                                 f"expected one of {tuple(MODEL_TYPES)}")
        return MODEL_TYPES[model_type]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        refuse("architectures", f"is {archs!r}, expected one of {ARCHITECTURES}")
    if model_type is not None and MODEL_TYPES.get(model_type) != archs[0]:
        refuse("model_type", f"is {model_type!r} but architectures is {archs!r}")
    return archs[0]


def refuse_unsupported(d: dict, arch: str, refuse: Callable) -> None:
    """Fields that would change the output and that this model does not implement."""
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts",
                    "moe_intermediate_size"):
        if d.get(moe_key):
            refuse(moe_key, "declares a mixture of experts; this engine runs dense models only")
    if arch == "LlamaForCausalLM":  # no such fields in transformers' Llama: refused, not guessed
        for field in ("use_sliding_window", "sliding_window"):
            if d.get(field):
                refuse(field, "asks for sliding-window attention, which is not supported")
    elif layers := sliding_layers(d):
        L, first = d["num_hidden_layers"], layers[0]
        refuse("use_sliding_window", f"is true with sliding_window {d['sliding_window']} and "
                                     f"max_window_layers {first}: layers {first}-{L - 1} of {L} "
                                     "would slide their window, which is not supported")
    if other := [t for t in d.get("layer_types") or [] if t != "full_attention"]:
        refuse("layer_types", f"has {other[0]!r}; only 'full_attention' layers are supported")
    if d.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {d['hidden_act']!r}, only 'silu' (SwiGLU) is supported")
    if d.get("pretraining_tp") not in (None, 1):
        refuse("pretraining_tp", "is not 1")
    if d.get("attention_dropout", 0.0) != 0:
        refuse("attention_dropout", "is not 0; this model has no dropout")
    if d.get("quantization_config") is not None:
        refuse("quantization_config", "is set; only unquantized checkpoints are loaded")
    if d.get("partial_rotary_factor") not in (None, 1.0):
        refuse("partial_rotary_factor", "is not 1; rotary embeddings here cover the whole head")


def sliding_layers(d: dict) -> list[int]:
    """The layers transformers' Qwen2 and Qwen3 configs make sliding_attention when config.json
    gives no layer_types (given ones are checked as they stand): with use_sliding_window and a
    sliding_window, layer i slides when i >= max_window_layers (28 when absent). A config with
    use_sliding_window true beside max_window_layers >= its layer count: every layer full."""
    if not d.get("use_sliding_window") or d.get("sliding_window") is None or \
            d.get("layer_types") is not None:
        return []
    return list(range(d.get("max_window_layers", 28), d["num_hidden_layers"]))


def rope_from_hf(d: dict, refuse: Callable) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's rope_parameters or 4's rope_theta + rope_scaling. Both
    layouts may be present (config_to_hf writes both, so both versions read it) but must agree."""
    thetas: dict[str, float] = {}  # the field that states it -> what it says
    scalings: dict[str, dict | None] = {}
    for field in ("rope_parameters", "rope_scaling"):
        if (rope := d.get(field)) is not None:
            scalings[field] = rope_scaling_from_hf(rope, field, refuse)
            if rope.get("rope_theta") is not None:
                thetas[field] = rope["rope_theta"]
    if d.get("rope_theta") is not None:
        thetas["rope_theta"] = d["rope_theta"]
    for field, theta in thetas.items():
        if not json_value_is(theta, "number") or theta <= 0:
            refuse(field, f"has rope_theta {theta!r}, expected a positive number")
    for stated in (thetas, scalings):
        items = list(stated.items())
        for field, value in items[1:]:
            if value != items[0][1]:
                refuse(field, f"says {value!r} but {items[0][0]} says {items[0][1]!r}; "
                              "the two config layouts disagree")
    theta = float(next(iter(thetas.values()), 10000.0))  # 10000: transformers' default
    return theta, next(iter(scalings.values()), None)


def rope_scaling_from_hf(rope: dict, field: str, refuse: Callable) -> dict | None:
    """ModelConfig.rope_scaling (None for the default rope) from one rope dict of either layout."""
    kind = rope.get("rope_type", rope.get("type", "default"))  # "type": early transformers 4
    if not isinstance(kind, str) or kind not in ROPE_FIELDS:
        refuse(field, f"has rope_type {kind!r}; supported: {', '.join(ROPE_FIELDS)}")
    if extra := sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor",
                                    *ROPE_FIELDS[kind]}):
        refuse(field, f"has {extra[0]!r}, which rope_type {kind!r} does not use")
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        refuse(field, "has partial_rotary_factor != 1; rotary embeddings here cover the whole head")
    scaling = {"rope_type": kind}
    for key in ROPE_FIELDS[kind]:
        kind_of_key = "size" if key == "original_max_position_embeddings" else "number"
        if not json_value_is(rope.get(key), kind_of_key) or rope[key] <= 0:
            refuse(field, f"has {key} {rope.get(key)!r}, expected {EXPECTED[kind_of_key]} > 0")
        scaling[key] = rope[key] if kind_of_key == "size" else float(rope[key])
    return None if kind == "default" else scaling


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json that transformers 4 and 5 both read as `cfg`: rope in 5's rope_parameters and in
    4's rope_theta / rope_scaling (5 prefers a non-null rope_scaling: the same values), the dtype
    under both versions' names."""
    model_type = {arch: name for name, arch in MODEL_TYPES.items()}[cfg.architecture]
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    d = dict(
        architectures=[cfg.architecture], model_type=model_type,
        hidden_act="silu", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, initializer_range=0.02,
        dtype=str(dtype).removeprefix("torch."), torch_dtype=str(dtype).removeprefix("torch."),
        attention_dropout=0.0,
    )
    if model_type == "llama":
        d.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    else:  # Qwen2 always has q/k/v bias (no such field); Qwen3 reads attention_bias, no mlp_bias
        d.update(use_sliding_window=False, sliding_window=None,
                 max_window_layers=cfg.num_hidden_layers)
        if model_type == "qwen3":
            d.update(attention_bias=cfg.attention_bias)
    return d

# -----------------------------------------------------------------------------
# Checkpoint directories: config, generation config, tensors (tp.py's load_sharded uses them too)


def read_json_object(file: str) -> dict:
    try:
        with open(file) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: is a JSON {type(d).__name__}, expected an object")
    return d


def load_config(path: str) -> ModelConfig:
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory; expected a Hugging Face checkpoint "
                                "directory")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found; a checkpoint directory needs config.json")
    return config_from_hf(read_json_object(file), source=file)


def load_generation_config(path: str) -> dict | None:
    """generation_config.json as a dict, or None when the directory has none. Its eos_token_id (an
    id or a list) is checked here, because stop_token_ids trusts it."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return None
    d = read_json_object(file)
    if not json_value_is(d.get("eos_token_id"), "ids?"):
        raise ValueError(f"{file}: field 'eos_token_id' is {json.dumps(d['eos_token_id'])[:60]}, "
                         f"expected {EXPECTED['ids']}")
    return d


def stop_token_ids(config: ModelConfig, generation_config: dict | None) -> tuple[int, ...]:
    """The ids that end a completion: the union of config.json's and generation_config.json's
    eos_token_id, each an id or a list (Llama-3-Instruct's generation_config.json adds <|eot_id|> to
    config.json's <|end_of_text|>). config.json's come first; no id twice."""
    ids: list[int] = []
    for eos in (config.eos_token_id, (generation_config or {}).get("eos_token_id")):
        ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(ids))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor a checkpoint of `cfg` holds (a tied lm_head is none)."""
    with torch.device("meta"):  # shapes only: allocates nothing
        return {name: tuple(p.shape) for name, p in Llama(cfg).named_parameters()}


def checkpoint_tensors(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (file, shape) of every tensor of a checkpoint directory, from the safetensors headers
    only: model.safetensors, or the files model.safetensors.index.json lists."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        listed_files = weight_map.values() if isinstance(weight_map, dict) else [None]
        if not all(isinstance(f, str) for f in listed_files):
            raise ValueError(f"{index}: not a safetensors index (no 'weight_map': tensor -> file)")
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    elif os.path.isfile(single):
        weight_map = {}
        files = [single]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                                "(only safetensors are loaded, never pickled .bin files)")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for missing/corrupt files
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        for name, shape in found.items():
            if name in tensors:
                raise ValueError(f"{file}: tensor '{name}' is also in {tensors[name][0]}")
            tensors[name] = (file, shape)
    for name, fname in weight_map.items():
        if tensors.get(name, ("",))[0] != os.path.join(path, fname):
            raise ValueError(f"{index}: lists tensor '{name}' in {fname}, which does not hold it")
    return tensors


def check_checkpoint(path: str, expected: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Refuse a checkpoint whose tensors are not exactly `expected` (names and full shapes, from
    expected_shapes): a missing, unused or misshaped tensor is one error naming the file and tensor.
    An unused tensor means the model is not the one the file describes: refused, never dropped.
    One exception: a tied model's stored copy of the embedding (TIED_COPY, the Hub's layout of
    Qwen3-0.6B and 1.7B), which must have the embedding's shape; the loaders check its values
    (tied_copy_differs). Returns name -> file, the copy included. Both loaders call it: load_model,
    and tp.load_sharded before it reads its slices."""
    tensors = checkpoint_tensors(path)
    if missing := sorted(set(expected) - set(tensors)):
        raise ValueError(f"{path}: checkpoint is missing {len(missing)} tensors, "
                         f"e.g. '{missing[0]}'")
    tied = TIED_COPY not in expected  # expected_shapes leaves a tied lm_head out
    copy = {TIED_COPY} & set(tensors) if tied else set()
    if unused := sorted(set(tensors) - set(expected) - copy):
        name = unused[0]
        why = "no module of the model config.json describes uses it"
        if name.endswith(".bias"):
            why = "config.json declares no such bias (see its attention_bias / mlp_bias)"
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            why = "config.json's architecture has no per-head q/k norms (Qwen3ForCausalLM has)"
        raise ValueError(f"{tensors[name][0]}: tensor '{name}' is not used ({len(unused)} such "
                         f"tensors): {why}")
    for name, shape in expected.items():
        file, found = tensors[name]
        if found != shape:
            raise ValueError(f"{file}: tensor '{name}' has shape {found}, "
                             f"config.json implies {shape}")
    if copy and tensors[TIED_COPY][1] != expected[EMBEDDING]:
        raise ValueError(f"{tensors[TIED_COPY][0]}: tensor '{TIED_COPY}' has shape "
                         f"{tensors[TIED_COPY][1]}, not the shape {expected[EMBEDDING]} of the "
                         "embedding config.json ties it to (tie_word_embeddings)")
    return {name: tensors[name][0] for name in [*expected, *copy]}

# -----------------------------------------------------------------------------
# A tied model's stored copy of its embedding

# transformers 4 ties lm_head to the embedding on load and ignores a stored lm_head.weight;
# transformers 5.24 unties the two when the copy differs (with a warning). Equal, both compute the
# same model, and so does this one; different, the checkpoint means two models: refused.
COMPARE_BYTES = 64 * 2**20  # rows compared at a time: memory stays bounded, whatever the vocab


def tied_copy_differs(cfg: ModelConfig, files: dict[str, str], start: int = 0,
                      stop: int | None = None) -> bool:
    """Whether a tied model's stored copy of the embedding (files: check_checkpoint's) differs from
    the embedding in rows [start, stop) (tp.load_sharded: a rank's own); False when none is stored
    or the model is untied. Bit for bit in the stored dtype (a NaN equals itself); different dtypes
    compare by value."""
    if not cfg.tie_word_embeddings or TIED_COPY not in files:
        return False
    with safe_open(files[TIED_COPY], framework="pt") as fc, \
            safe_open(files[EMBEDDING], framework="pt") as fe:
        copy, embedding = fc.get_slice(TIED_COPY), fe.get_slice(EMBEDDING)
        V, C = embedding.get_shape()
        stop = V if stop is None else stop
        rows = max(1, COMPARE_BYTES // (8 * C))  # float64 at most, below
        for lo in range(start, stop, rows):
            a, b = copy[lo:min(lo + rows, stop)], embedding[lo:min(lo + rows, stop)]
            if a.dtype == b.dtype:  # the bits: NaN rows equal as stored
                ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                a, b = a.view(ints[a.element_size()]), b.view(ints[b.element_size()])
            if not torch.equal(a.double() if a.is_floating_point() else a,
                               b.double() if b.is_floating_point() else b):
                return True
    return False


def tied_copy_message(files: dict[str, str]) -> str:
    return (f"{files[TIED_COPY]}: tensor '{TIED_COPY}' differs from '{EMBEDDING}', which "
            "config.json ties it to (tie_word_embeddings true): transformers 4 would drop the "
            "copy, transformers 5 untie the two. Set tie_word_embeddings false to load both, or "
            "delete the copy to tie the head to the embedding")
