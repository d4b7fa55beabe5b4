"""Which tokenizer a checkpoint was trained with: recorded at save, checked wherever a tokenizer
is given with a checkpoint (resume, fine-tuning, export, sampling, evaluation).

Vocabulary size and [MASK] id are part of the model's identity; two tokenizers can agree on both
and still map text to different ids, so the record holds a content hash of the model file(s).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_dllm.checkpoint.manifest import CheckpointError


@dataclass(frozen=True)
class TokenizerRecord:
    type: str | None
    model: str | None  # absolute path at save time: the file may have moved since (the hash decides)
    options: dict = field(default_factory=dict)  # `TokenizerConfig.options()` (TikTokenizer's)
    sha256: str | None = None  # None: saved before hashes, or converted from elsewhere (not checked)

    @classmethod
    def of(cls, tokenizer) -> "TokenizerRecord":
        """The record of a `TokenizerConfig`, to rebuild and check the tokenizer."""
        from megatron_dllm.data.tokenizers import tokenizer_fingerprint

        return cls(tokenizer.tokenizer_type, os.path.abspath(tokenizer.tokenizer_model), tokenizer.options(),
                   tokenizer_fingerprint(tokenizer.tokenizer_model))

    def as_dict(self) -> dict:
        return {"type": self.type, "model": self.model, "options": self.options, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, saved: dict, source: str) -> "TokenizerRecord":
        unknown = sorted(set(saved) - {"type", "model", "options", "sha256"})
        if unknown or not isinstance(saved.get("options") or {}, dict):
            raise CheckpointError(f"{source}: malformed tokenizer record {saved!r} in its common state (expected "
                                  f"type, model, options, sha256)")
        return cls(saved.get("type"), saved.get("model"), saved.get("options") or {}, saved.get("sha256"))


def check_tokenizer(recorded: TokenizerRecord | None, tokenizer_model: str, checkpoint: str) -> None:
    """Refuse `tokenizer_model` unless its content equals the recorded tokenizer's. Checkpoints
    without a hash (older ones, or converted from Hugging Face) are not checked."""
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    if recorded is None or recorded.sha256 is None:
        return
    if tokenizer_fingerprint(tokenizer_model) != recorded.sha256:
        raise CheckpointError(f"--tokenizer-model {tokenizer_model} differs from the tokenizer {checkpoint} was "
                              f"trained with ({recorded.model}, sha256 {recorded.sha256[:12]}...)")


def recorded_tokenizer_config(recorded: TokenizerRecord | None, given=None):
    """The `TokenizerConfig` to use with a checkpoint: `given` (flags) when it names a tokenizer,
    taking the recorded options (TikTokenizer's pattern, specials, vocabulary size) when no
    option flag is given and the model file is the recorded one; else the recorded tokenizer;
    else None."""
    from megatron_dllm.config.data import TokenizerConfig
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    recorded = recorded or TokenizerRecord(None, None)
    if given is not None and given.tokenizer_type and given.tokenizer_model:
        same_file = recorded.sha256 == tokenizer_fingerprint(given.tokenizer_model)
        flagged = any(v is not None for v in given.options().values())
        if flagged or not same_file or recorded.type != given.tokenizer_type:
            return given
        return TokenizerConfig.from_options(given.tokenizer_type, given.tokenizer_model, recorded.options)
    if recorded.type and recorded.model:
        return TokenizerConfig.from_options(recorded.type, recorded.model, recorded.options)
    return None
