"""Which tokenizer a checkpoint was trained with: recorded at save, checked wherever a tokenizer
is given with a checkpoint (resume, fine-tuning, export, sampling, evaluation), and where export
and sampling take the recorded one.

Vocabulary size and [MASK] id are part of the model's identity; two tokenizers can agree on both
and still map text to different ids, so the record holds a content hash of the model file(s).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_dllm.checkpoint.manifest import CheckpointError
from megatron_dllm.errors import InputError


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


def recorded_tokenizer_config(recorded: TokenizerRecord | None, given, checkpoint: str):
    """The `TokenizerConfig` to use with `checkpoint` (the `--load` of export, sampling, evaluation):
    `given` (flags) when it names a tokenizer, refused unless its content is the recorded one's and
    its option flags give the recorded options' ids (given only type and model: the recorded
    options, TikTokenizer's pattern, specials, vocabulary size); without flags the recorded
    tokenizer, refused when its file is gone or changed; else None."""
    from megatron_dllm.config.data import TokenizerConfig

    recorded = recorded or TokenizerRecord(None, None)
    if given is not None and given.tokenizer_type and given.tokenizer_model:
        check_tokenizer(recorded, given.tokenizer_model, checkpoint)
        if recorded.sha256 is None or recorded.type != given.tokenizer_type:  # nothing recorded to hold it to
            return given
        if all(v is None for v in given.options().values()):
            return TokenizerConfig.from_options(given.tokenizer_type, given.tokenizer_model, recorded.options)
        _check_options(recorded, given, checkpoint)
        return given
    if recorded.type and recorded.model:
        _check_recorded_file(recorded, checkpoint)
        return TokenizerConfig.from_options(recorded.type, recorded.model, recorded.options)
    return None


def _check_recorded_file(recorded: TokenizerRecord, checkpoint: str) -> None:
    """The recorded path is the only place the tokenizer is looked for: a file replaced there
    would give other ids with no error, so its content is held to the recorded hash."""
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    try:
        found = tokenizer_fingerprint(recorded.model)
    except InputError:  # the file, or the tokenizer.json of a recorded directory, is gone
        raise CheckpointError(f"--load {checkpoint}: its tokenizer {recorded.model} is gone; give "
                              f"--tokenizer-type/--tokenizer-model") from None
    if recorded.sha256 is not None and found != recorded.sha256:
        raise CheckpointError(f"--load {checkpoint}: its tokenizer {recorded.model} has changed since training "
                              f"(sha256 {found[:12]}..., recorded {recorded.sha256[:12]}...); give "
                              f"--tokenizer-type/--tokenizer-model of the tokenizer it was trained with")


def _check_options(recorded: TokenizerRecord, given, checkpoint: str) -> None:
    """Refuse option flags whose ids differ from the recorded options', both with the tokenizer's
    defaults filled in (a flag left out is its default, not the recorded value), as
    `indexed_dataset.check_tokenizer_options` does for a dataset."""
    from megatron_dllm.config.data import TokenizerConfig
    from megatron_dllm.data.indexed_dataset import _shown

    if given.options() == recorded.options:
        return
    trained = _options_in_effect(TokenizerConfig.from_options(given.tokenizer_type, given.tokenizer_model,
                                                              recorded.options))
    for flag, value in _options_in_effect(given).items():
        if trained[flag] != value:
            raise CheckpointError(f"{flag} {_shown(value)} but {checkpoint} was trained with {_shown(trained[flag])} "
                                  f"(give its tokenizer options, or only --tokenizer-type/--tokenizer-model to use "
                                  f"the recorded ones)")


def _options_in_effect(config) -> dict:
    """{flag: value} of a TikTokenizer's id-changing options, as the built tokenizer fills them in."""
    from megatron_dllm.data.indexed_dataset import TOKENIZER_OPTION_FLAGS

    tok = config.build()
    if hasattr(tok, "id_options"):  # Megatron-LM's JSON vocabulary
        flags = {**TOKENIZER_OPTION_FLAGS, "vocab_size": "--vocab-size"}
        return {flags[key]: value for key, value in tok.id_options.items()}
    # a .tiktoken file: no fillers when --tiktoken-num-special-tokens is left out
    padded = tok.num_special_tokens if tok.num_special_tokens is not None else len(tok.special_tokens)
    return {"--tiktoken-pattern": tok.pattern, "--tiktoken-special-tokens": tok.special_tokens,
            "--tiktoken-num-special-tokens": padded}
