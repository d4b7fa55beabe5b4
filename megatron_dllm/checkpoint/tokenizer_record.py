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
