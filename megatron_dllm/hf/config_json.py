"""An exported directory's config.json, read so that every fault names the file (and its line)."""
from __future__ import annotations

import json

from megatron_dllm.errors import InputError, read_text


def read_config_json(path: str, flag: str, dllm: bool = True) -> dict:
    """The settings in `path` (a config.json of a dllm export, or with `dllm=False` any model's);
    ValueError `{flag} PATH[:LINE]: ...` for a file that cannot be read, is not UTF-8 JSON, not an
    object, or not a dllm model's."""
    text = read_text(path, lambda line: f"{flag} {path}" + (f":{line}" if line else ""))
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{flag} {path}: not valid JSON ({err.msg} at line {err.lineno}, "
                         f"column {err.colno})") from None
    if not isinstance(config, dict):
        raise InputError(f"{flag} {path}: expected a JSON object of settings, found {type(config).__name__}")
    if dllm and config.get("model_type") != "dllm":
        raise InputError(f"{flag} {path}: model_type {config.get('model_type')!r}, expected 'dllm'")
    return config
