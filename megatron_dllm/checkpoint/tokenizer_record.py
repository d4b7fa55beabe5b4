"""Which tokenizer a checkpoint was trained with: recorded at save, checked wherever a tokenizer
is given with a checkpoint (resume, fine-tuning, export, sampling, evaluation).

Vocabulary size and [MASK] id are part of the model's identity; two tokenizers can agree on both
and still map text to different ids, so the record holds a content hash of the model file(s).
"""
from __future__ import annotations

import os

from megatron_dllm.checkpoint.manifest import CheckpointError


def tokenizer_record(tokenizer) -> dict:
    """What a checkpoint records of its `TokenizerConfig` to rebuild and check the tokenizer."""
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    return {"type": tokenizer.tokenizer_type, "model": os.path.abspath(tokenizer.tokenizer_model),
            "options": tokenizer.options(), "sha256": tokenizer_fingerprint(tokenizer.tokenizer_model)}


def check_tokenizer(recorded: dict | None, tokenizer_model: str, checkpoint: str) -> None:
    """Refuse `tokenizer_model` unless its content equals the recorded tokenizer's. Checkpoints
    without a hash (older ones, or converted from Hugging Face) are not checked."""
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    if not recorded or "sha256" not in recorded:
        return
    if tokenizer_fingerprint(tokenizer_model) != recorded["sha256"]:
        raise CheckpointError(f"--tokenizer-model {tokenizer_model} differs from the tokenizer {checkpoint} was "
                              f"trained with ({recorded.get('model')}, sha256 {recorded['sha256'][:12]}...)")


def recorded_tokenizer_config(recorded: dict | None, given=None):
    """The `TokenizerConfig` to use with a checkpoint: `given` (flags) when it names a tokenizer,
    taking the recorded options (TikTokenizer's pattern, specials, vocabulary size) when no
    option flag is given and the model file is the recorded one; else the recorded tokenizer;
    else None."""
    from megatron_dllm.config.data import TokenizerConfig
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    recorded = recorded or {}
    if given is not None and given.tokenizer_type and given.tokenizer_model:
        same_file = recorded.get("sha256") == tokenizer_fingerprint(given.tokenizer_model)
        if any(v is not None for v in given.options().values()) or not same_file \
                or recorded.get("type") != given.tokenizer_type:
            return given
        return TokenizerConfig.from_options(given.tokenizer_type, given.tokenizer_model, recorded.get("options"))
    if recorded.get("type") and recorded.get("model"):
        return TokenizerConfig.from_options(recorded["type"], recorded["model"], recorded.get("options"))
    return None
