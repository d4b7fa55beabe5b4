"""Load one of this project's Hugging Face exports with this project's own classes.

An export ships `modeling_dllm.py`, `configuration_dllm.py` and the sampler files behind
`generate` (for users of transformers' Auto classes with `trust_remote_code=True`), and anyone who
passes it on can edit them or add python files and an `auto_map` to its configs. The tools never
import them: the model is `megatron_dllm/hf/modeling_dllm.py`'s class of the config's family (its
`generate` runs megatron_dllm/sampling), and the tokenizer is the transformers class that
tokenizer_config.json names (one of transformers' own, nothing from the directory).
"""
from __future__ import annotations

import json
import os

from megatron_dllm.errors import InputError


def load_config(path: str):
    from megatron_dllm.hf.configuration_dllm import DLLMConfig

    return DLLMConfig.from_pretrained(path)


def load_model(path: str, **kwargs):
    """DLLMForMaskedLM or DLLMForCausalLM (by the config's family) with the export's weights, every
    one of them (transformers would fill a missing one with random values and only warn)."""
    from safetensors import SafetensorError

    from megatron_dllm.families import FAMILIES
    from megatron_dllm.hf import export

    config = load_config(path)
    if config.family not in FAMILIES:
        raise InputError(f"{path}/config.json: family {config.family!r} is not one of {', '.join(FAMILIES)}")
    try:
        # mismatched shapes are reported, not raised: refused below with the others, naming them
        model, info = export.model_class(config.family).from_pretrained(
            path, config=config, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    except SafetensorError as err:
        raise InputError(f"{path}: unreadable safetensors weights ({err})") from None
    problems = [f"{what} {', '.join(map(str, info[key]))}" for key, what in (
        ("missing_keys", "missing:"), ("unexpected_keys", "not of this model:"), ("mismatched_keys", "other shapes:"))
        if info.get(key)]
    if problems:
        raise InputError(f"{path}: the weights do not match the {config.family} model of config.json "
                         f"({'; '.join(problems)})")
    return model


def load_tokenizer(path: str):
    """The exported tokenizer as the transformers class its tokenizer_config.json names."""
    import transformers

    config_path = os.path.join(path, "tokenizer_config.json")
    try:
        with open(config_path) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError) as err:
        raise InputError(f"{config_path}: not a readable tokenizer config ({err})") from None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        raise InputError(f"{config_path}: tokenizer_class {name!r} is not a tokenizer class of transformers "
                         f"(tokenizers shipped as code in an export are never run)")
    return cls.from_pretrained(path)
