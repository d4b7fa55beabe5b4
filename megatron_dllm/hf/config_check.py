"""What an HF directory must agree with before it is imported: config.json's fields with each
other, and every weight's shape with the model config.json describes.

A config.json edited by hand (say `attention: causal` on an `mdlm` model) would otherwise import
silently as a model that behaves differently from the one trained, and a tensor of the wrong
shape would fail deep inside the converter. Each problem is one ValueError naming the file, the
field or tensor, and what was expected.
"""
from __future__ import annotations

import torch

from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.errors import InputError
from megatron_dllm.families import FAMILIES, get_family


def check_config(config: dict, identity: ModelIdentity, source: str) -> None:
    """The fields of config.json (at `source`) that follow from its family and sizes."""
    family = FAMILIES[identity.family]
    if config.get("attention", family.attention) != family.attention:
        raise InputError(f"{source}: attention {config['attention']!r} contradicts family {identity.family!r}, "
                         f"whose attention is {family.attention!r}")
    from megatron_dllm.hf.export import model_class_name

    expected = [model_class_name(identity.family)]
    if config.get("architectures", expected) != expected:
        raise InputError(f"{source}: architectures {config['architectures']!r} contradicts family "
                         f"{identity.family!r}, expected {expected!r}")
    if identity.hidden_size % identity.num_attention_heads:
        raise InputError(f"{source}: hidden_size {identity.hidden_size} is not a multiple of num_heads "
                         f"{identity.num_attention_heads}")
    if not 0 <= identity.mask_id < identity.vocab_size:
        raise InputError(f"{source}: mask_token_id {identity.mask_id} lies outside vocab_size {identity.vocab_size}")
    try:  # family_options are the family's own settings (BD3-LM's blocks, MDLM's shift)
        get_family(identity.family, identity.mask_id, identity.vocab_size, **identity.family_options)
    except TypeError:
        raise InputError(f"{source}: family_options {identity.family_options!r} are not settings of family "
                         f"{identity.family!r}") from None


def check_shapes(weights: dict, identity: ModelIdentity, max_length: int, source: str) -> None:
    """Every tensor of `weights` (read from `source`) that the described model has must have its
    shape; the model is built on the meta device, so this costs no memory."""
    from megatron_dllm.hf import export
    from megatron_dllm.hf.configuration_dllm import DLLMConfig

    config = export.hf_config_dict(identity, FAMILIES[identity.family].attention, max_length)
    for key in ("auto_map", "architectures", "model_type"):
        del config[key]
    with torch.device("meta"):
        expected = export.model_class(identity.family)(DLLMConfig(**config)).state_dict()
    for name, tensor in sorted(weights.items()):
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise InputError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected[name].shape)} for the model its config.json describes")
