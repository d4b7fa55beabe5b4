"""A GPT-backbone (`--backbone gpt`) checkpoint as Hugging Face weights, and back.

Family `ar` exports as transformers' own `LlamaForCausalLM` (or `Qwen2ForCausalLM` when the q/k/v
projections have biases): config.json + model.safetensors under transformers' names, loaded
without `trust_remote_code`. The diffusion families export as this project's remote code
(`modeling_dllm.py`) with its dense `GPT` backbone, whose parameter names are the Llama names under
`backbone.` (`model.` dropped), so both exports share one mapping (`pretrained_ar.from_megatron` /
`to_megatron`). Vocabulary rows: the real vocabulary ([MASK] included); megatron's padding is dropped.
"""
from __future__ import annotations

import os

import torch

from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.hf import pretrained_ar

PREFIX = "backbone."  # the dense model's parameters (modeling_dllm.DLLMPreTrainedModel.backbone)
_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def llama_state(state_dict: dict, identity: ModelIdentity, vocab_size: int | None = None) -> dict:
    """A TP=1/PP=1 GPTBackbone state dict (global layer numbers) -> fp32 CPU tensors under
    transformers' Llama/Qwen2 names, with the first `vocab_size` (default: the real) vocabulary rows."""
    arch = identity.architecture(1)
    pretrained_ar.transformers_kind(arch.gpt, "the checkpoint")
    rows = vocab_size or identity.vocab_size
    whole = {k: v.detach().float().cpu() for k, v in state_dict.items() if "_extra_state" not in k and v is not None}
    for key in _VOCAB_TENSORS:
        if key in whole:
            whole[key] = whole[key][:rows]
    return {k: v.contiguous().clone() for k, v in pretrained_ar.from_megatron(whole, arch.preset, arch.gpt).items()}


def dense_state(state_dict: dict, identity: ModelIdentity, vocab_size: int | None = None) -> dict:
    """The same tensors under the names of modeling_dllm's dense GPT (`backbone.` + the Llama name
    without `model.`)."""
    return {PREFIX + k.removeprefix("model."): v for k, v in llama_state(state_dict, identity, vocab_size).items()}


def llama_names(dense: dict) -> dict:
    """modeling_dllm's dense GPT names -> transformers' Llama names (the inverse of `dense_state`)."""
    out = {}
    for key, value in dense.items():
        rest = key.removeprefix(PREFIX)
        out[rest if rest == "lm_head.weight" else "model." + rest] = value
    return out


def transformers_config(identity: ModelIdentity, max_length: int):
    """The transformers LlamaConfig/Qwen2Config of a GPT-backbone AR model; `mask_token_id` rides
    along (an extra field transformers keeps) so that re-importing keeps the vocabulary."""
    import transformers

    arch = identity.architecture(max_length)
    shape, preset = arch.gpt, arch.preset
    kind = pretrained_ar.transformers_kind(shape, "the checkpoint")
    config_class, model_class = (getattr(transformers, name) for name in _CLASSES[kind])
    heads = preset.num_attention_heads
    fields = dict(vocab_size=identity.vocab_size, hidden_size=preset.hidden_size,
                  intermediate_size=shape.ffn_hidden_size, num_hidden_layers=preset.num_layers,
                  num_attention_heads=heads, num_key_value_heads=shape.num_query_groups or heads,
                  head_dim=shape.kv_channels or preset.hidden_size // heads, hidden_act="silu",
                  rms_norm_eps=shape.norm_epsilon, rope_theta=float(shape.rotary_base),
                  max_position_embeddings=int(max_length),
                  tie_word_embeddings=not shape.untie_embeddings_and_output_weights,
                  mask_token_id=identity.mask_id,
                  # the exported tokenizer's ids (export.export_tokenizer), not LlamaConfig's 1 and 2
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if shape.rope_scaling_factor is not None:
        fields["rope_scaling"] = {"rope_type": "llama3", "factor": shape.rope_scaling_factor,
                                  **pretrained_ar.LLAMA3_ROPE}
    if kind == "qwen2":
        fields["use_sliding_window"] = False
    else:
        fields.update(attention_bias=False, mlp_bias=False)
    config = config_class(**fields)
    config.architectures = [model_class.__name__]
    config.dtype = torch.float32
    return config


def write_transformers_dir(out: str, state_dict: dict, identity: ModelIdentity, max_length: int) -> int:
    """config.json and model.safetensors of transformers' Llama/Qwen2; returns the number of tensors."""
    from safetensors.torch import save_file

    config = transformers_config(identity, max_length)
    weights = llama_state(state_dict, identity)
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    save_file(dict(sorted(weights.items())), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return len(weights)


def dense_from_transformers_dir(path: str):
    """A transformers Llama/Mistral/Qwen2 directory (this project's AR export, or a released model)
    as the dense AR model sampling and evaluation run (`DLLMForCausalLM` with the GPT backbone).
    Its [MASK] is config.json's `mask_token_id` (an export's); a released model has none, so the id
    after its last row stands in (never sampled: the AR sampler draws only real rows)."""
    from megatron_dllm.hf import export

    source = f"--load {os.path.join(path, 'config.json')}"
    config = pretrained_ar.read_config(path)
    preset, shape, rows = pretrained_ar.shape_of(config, source)
    whole = pretrained_ar.to_megatron(pretrained_ar.read_weights(path), preset, shape, f"--load {path}")
    mask_id = config.get("mask_token_id")
    mask_id = mask_id if isinstance(mask_id, int) and 0 <= mask_id < rows else rows
    identity = ModelIdentity("ar", preset.hidden_size, preset.num_layers, preset.num_attention_heads, rows, mask_id,
                             shape.as_dict())
    return export.hf_model(whole, identity, "causal", int(config.get("max_position_embeddings", 2048)))
