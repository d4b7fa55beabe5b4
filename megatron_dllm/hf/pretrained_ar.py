"""A released autoregressive model's Hugging Face directory (Llama, Mistral, Qwen2; SmolLM2 is a
Llama) as the GPT backbone (`model.gpt`): its config.json as a preset and a `GPTShape`, its
safetensors weights (one file, or shards listed by model.safetensors.index.json) renamed and
fused to megatron-core's layout. Only tensors are read: no pickle, no code from the directory.

HF -> megatron-core (per layer i under `decoder.layers.i.`):
    q/k/v_proj (+ bias)            self_attention.linear_qkv: per query group g, its
                                   heads/groups query heads, then k_g, then v_g
    o_proj                         self_attention.linear_proj
    gate_proj, up_proj             mlp.linear_fc1 = [gate; up] (megatron's glu: silu(first) * second)
    down_proj                      mlp.linear_fc2
    input/post_attention_layernorm input_layernorm / pre_mlp_layernorm
    model.norm, embed_tokens, lm_head  decoder.final_layernorm, embedding.word_embeddings, output_layer
Both use the rotate-half rotary layout, so q and k are not permuted.
"""
from __future__ import annotations

import json
import math
import os

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.presets import Preset

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
# megatron-core's Llama-3 rope scaling (`rope_utils._apply_scaling`) hard-codes these
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def is_pretrained_ar(directory: str) -> bool:
    """Whether `directory` holds a transformers causal LM config (rather than this project's export)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") != "dllm" and (
        "architectures" in config or config.get("model_type") in ARCHITECTURES.values())


def read_config(directory: str) -> dict:
    from megatron_dllm.hf.config_json import read_config_json

    return read_config_json(os.path.join(directory, "config.json"), "--hf", dllm=False)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _size(value) -> bool:
    return _positive(value) and isinstance(value, int)


def _rope(config: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None): transformers 4 writes rope_theta and rope_scaling,
    transformers 5 one rope_parameters dict holding both."""
    for name in ("rope_parameters", "rope_scaling"):
        if not isinstance(config.get(name) or {}, dict):
            raise InputError(f"{source}: {name} {config[name]!r} is not a mapping")
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not _positive(theta):
        raise InputError(f"{source}: rope_theta {theta!r} is not a positive number")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind == "llama3" and _positive(scaling.get("factor")) and all(
            _positive(scaling.get(k)) and float(scaling[k]) == v for k, v in LLAMA3_ROPE.items()):
        return float(theta), scaling
    raise InputError(f"{source}: rope scaling {scaling} is not supported (only none, and llama3 with "
                     f"{LLAMA3_ROPE}, as megatron-core implements it)")


def shape_of(config: dict, source: str) -> tuple[Preset, GPTShape, int]:
    """(Preset, GPTShape, HF vocabulary rows) of a supported config.json; anything this backbone
    does not implement is one InputError naming the field."""
    archs = config.get("architectures")  # absent from configs transformers derives from a GGUF file
    if archs:
        kind = ARCHITECTURES.get(archs[0]) if len(archs) == 1 else None
    else:
        kind = config.get("model_type") if config.get("model_type") in ARCHITECTURES.values() else None
    if kind is None:
        raise InputError(f"{source}: architectures {archs} (model_type {config.get('model_type')!r}) not "
                         f"supported; expected one of {', '.join(ARCHITECTURES)}")
    unsupported = {
        "quantization_config": config.get("quantization_config"),
        "hidden_act (expected silu)": config.get("hidden_act", "silu") != "silu",
        "attention_bias": config.get("attention_bias") and kind != "qwen2",
        "mlp_bias": config.get("mlp_bias"),
        "sliding_window": config.get("sliding_window") is not None and (
            kind == "mistral" or config.get("use_sliding_window")),
        "num_experts": config.get("num_experts") or config.get("num_local_experts"),
        # transformers' Llama, Mistral and Qwen2 never read it (full rotary): a model made for it is another model
        "partial_rotary_factor": any(c.get("partial_rotary_factor") not in (None, 1, 1.0)
                                     for c in (config, config.get("rope_parameters") or {}) if isinstance(c, dict)),
    }
    bad = [name for name, value in unsupported.items() if value]
    if bad:
        raise InputError(f"{source}: {', '.join(bad)} not supported by the gpt backbone")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                           "vocab_size") if not _size(config.get(k))]
    if missing:
        raise InputError(f"{source}: {', '.join(missing)} missing or not an integer >= 1")
    wrong = [f"{k} {config[k]!r}" for k, ok in (("num_key_value_heads", _size), ("head_dim", _size),
                                                 ("max_position_embeddings", _size), ("rms_norm_eps", _positive))
             if config.get(k) is not None and not ok(config[k])]
    if wrong:
        raise InputError(f"{source}: {', '.join(wrong)}: expected a positive number (an integer for sizes)")
    theta, scaling = _rope(config, source)
    if theta != int(theta):
        raise InputError(f"{source}: rope_theta {theta} is not an integer (--rotary-base is)")
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    if heads % groups or (not config.get("head_dim") and h % heads):
        raise InputError(f"{source}: num_attention_heads {heads} must be a multiple of num_key_value_heads "
                         f"{groups}, and divide hidden_size {h} where head_dim is not given")
    head_dim = int(config.get("head_dim") or h // heads)
    shape = GPTShape(
        ffn_hidden_size=int(config["intermediate_size"]),
        num_query_groups=groups if groups != heads else None,
        kv_channels=head_dim if head_dim != h // heads else None,
        normalization="RMSNorm", swiglu=True,
        # GGUF stores eps in float32 (1e-5 reads 9.9999997e-06): 6 significant digits, as presets write it
        norm_epsilon=float(f"{float(config.get('rms_norm_eps', 1e-6)):.6g}"),
        position_embedding_type="rope", rotary_base=int(theta),
        rope_scaling_factor=float(scaling["factor"]) if scaling else None,
        add_bias_linear=False, add_qkv_bias=kind == "qwen2", qk_layernorm=False,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),  # transformers' default
    )
    return Preset(h, int(config["num_hidden_layers"]), heads), shape, int(config["vocab_size"])


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors (sharded via model.safetensors.index.json, or
    one model.safetensors), in float32."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            if not all(isinstance(name, str) for name in files):
                raise ValueError("a weight_map value is not a file name")
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as err:
            raise InputError(f"--hf {index}: not a safetensors index ({err})") from None
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise InputError(f"--hf {directory}: no model.safetensors or model.safetensors.index.json "
                         f"(only safetensors weights are read; .bin pickles are refused)")
    weights = {}
    for name in files:
        path = os.path.join(directory, name)
        try:
            weights.update(load_file(path))
        except (SafetensorError, OSError) as err:
            raise InputError(f"--hf {path}: unreadable safetensors file ({err})") from None
    return {k: v.float() for k, v in weights.items()}


def _take(weights: dict, name: str, used: set, source: str, expected: tuple) -> torch.Tensor:
    """The tensor `name`, of the shape config.json describes (`expected`; None: any size)."""
    if name not in weights:
        raise InputError(f"{source}: tensor {name!r} missing")
    tensor = weights[name]
    if len(tensor.shape) != len(expected) or any(e not in (None, n) for e, n in zip(expected, tensor.shape)):
        described = tuple("any" if e is None else e for e in expected)
        raise InputError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}; config.json describes "
                         f"{described}")
    used.add(name)
    return tensor


def to_megatron(weights: dict, preset: Preset, shape: GPTShape, source: str) -> dict[str, torch.Tensor]:
    """Whole (TP=1) megatron-core tensors under GPTBackbone's global names; vocabulary-sized
    tensors keep the HF row count (padding is the caller's). Unused HF tensors are an error."""
    h, heads = preset.hidden_size, preset.num_attention_heads
    d = shape.kv_channels or h // heads
    groups = shape.num_query_groups or heads
    used: set = set()
    if not shape.untie_embeddings_and_output_weights and "model.embed_tokens.weight" not in weights \
            and "lm_head.weight" in weights:  # a tied pair saved once, under the head's name
        weights = {**weights, "model.embed_tokens.weight": weights["lm_head.weight"]}
        used.add("lm_head.weight")
    ffn = shape.ffn_hidden_size
    out = {"embedding.word_embeddings.weight": _take(weights, "model.embed_tokens.weight", used, source, (None, h)),
           "decoder.final_layernorm.weight": _take(weights, "model.norm.weight", used, source, (h,))}
    if shape.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = _take(weights, "lm_head.weight", used, source, (None, h))
    elif "lm_head.weight" in weights and "lm_head.weight" not in used:  # some tied checkpoints store the copy too
        if not torch.equal(weights["lm_head.weight"], out["embedding.word_embeddings.weight"]):
            raise InputError(f"{source}: tie_word_embeddings is set but lm_head.weight differs from the embedding")
        used.add("lm_head.weight")

    def qkv(suffix: str, tail: tuple) -> torch.Tensor:
        q, k, v = (_take(weights, f"{p}.{n}_proj.{suffix}", used, source, (rows * d, *tail))
                   for n, rows in zip("qkv", (heads, groups, groups)))
        return torch.cat([q.reshape(groups, heads // groups * d, *tail), k.reshape(groups, d, *tail),
                          v.reshape(groups, d, *tail)], dim=1).reshape(-1, *tail)

    for i in range(preset.num_layers):
        p, m = f"model.layers.{i}.self_attn", f"decoder.layers.{i}."
        out[m + "self_attention.linear_qkv.weight"] = qkv("weight", (h,))
        if shape.add_qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = qkv("bias", ())
        out[m + "self_attention.linear_proj.weight"] = _take(weights, f"{p}.o_proj.weight", used, source,
                                                             (h, heads * d))
        mlp = f"model.layers.{i}.mlp"
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_take(weights, f"{mlp}.{n}_proj.weight", used, source, (ffn, h))
                                                      for n in ("gate", "up")])
        out[m + "mlp.linear_fc2.weight"] = _take(weights, f"{mlp}.down_proj.weight", used, source, (h, ffn))
        for ours, theirs in (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm")):
            out[m + ours + ".weight"] = _take(weights, f"model.layers.{i}.{theirs}.weight", used, source, (h,))
    unused = sorted(k for k in set(weights) - used if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise InputError(f"{source}: tensors this architecture does not use: {unused[:5]}")
    return out


def transformers_kind(shape: GPTShape, source: str) -> str:
    """"qwen2" (q/k/v biases) or "llama": the transformers architecture a GPT-backbone shape is;
    shapes neither has are one InputError naming the flag."""
    unsupported = {"--normalization LayerNorm (expected RMSNorm)": shape.normalization != "RMSNorm",
                   "no --swiglu": not shape.swiglu,
                   f"--position-embedding-type {shape.position_embedding_type} (expected rope)":
                       shape.position_embedding_type != "rope",
                   f"--rotary-percent {shape.rotary_percent}": shape.rotary_percent != 1.0,
                   "biases in the linear layers (expected --disable-bias-linear)": shape.add_bias_linear,
                   "--qk-layernorm": shape.qk_layernorm}
    bad = [name for name, value in unsupported.items() if value]
    if bad:
        raise InputError(f"{source}: a --backbone gpt model with {', '.join(bad)} is neither a Llama nor a Qwen2; "
                         f"Hugging Face export, sampling and evaluation support the Llama/Qwen2 shape")
    return "qwen2" if shape.add_qkv_bias else "llama"


def from_megatron(whole: dict, preset: Preset, shape: GPTShape) -> dict[str, torch.Tensor]:
    """The inverse of `to_megatron`: GPTBackbone's whole (TP=1) tensors under global names ->
    the transformers Llama/Qwen2 names (a tied model has no lm_head.weight)."""
    h, heads = preset.hidden_size, preset.num_attention_heads
    d = shape.kv_channels or h // heads
    groups = shape.num_query_groups or heads
    per_group = heads // groups * d

    def split_qkv(fused: torch.Tensor) -> list[torch.Tensor]:
        tail = tuple(fused.shape[1:])
        parts = fused.reshape(groups, per_group + 2 * d, *tail).split([per_group, d, d], dim=1)
        return [p.reshape(-1, *tail).contiguous() for p in parts]

    out = {"model.embed_tokens.weight": whole["embedding.word_embeddings.weight"],
           "model.norm.weight": whole["decoder.final_layernorm.weight"]}
    if shape.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = whole["output_layer.weight"]
    for i in range(preset.num_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        for name, value in zip("qkv", split_qkv(whole[m + "self_attention.linear_qkv.weight"])):
            out[f"{p}self_attn.{name}_proj.weight"] = value
        if shape.add_qkv_bias:
            for name, value in zip("qkv", split_qkv(whole[m + "self_attention.linear_qkv.bias"])):
                out[f"{p}self_attn.{name}_proj.bias"] = value
        out[p + "self_attn.o_proj.weight"] = whole[m + "self_attention.linear_proj.weight"]
        gate, up = whole[m + "mlp.linear_fc1.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[p + "mlp.down_proj.weight"] = whole[m + "mlp.linear_fc2.weight"]
        out[p + "input_layernorm.weight"] = whole[m + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = whole[m + "pre_mlp_layernorm.weight"]
    return out
