"""Tokenizers behind Megatron's `--tokenizer-type` / `--tokenizer-model` flags.

Every tokenizer carries a [MASK] token for the masked-diffusion families. If the model already
has one (`<mask>` or `[MASK]`) its id is used; otherwise the mask id is appended after the
last id, so `vocab_size` grows by one (Llama's 32000 SentencePiece pieces -> 32001, as in the
paper). `vocab_size` is therefore the real number of ids the model's embedding must cover.

`tokenize` adds no BOS/EOS: documents are concatenated with EOD (= the EOS id) by
preprocessing, and no BOS is ever inserted.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional

MASK_PIECES = ("<mask>", "[MASK]")
TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")


def _bad_model(tokenizer_type: str, path, expected: str) -> ValueError:
    return ValueError(f"--tokenizer-model {path!r}: {expected} (for --tokenizer-type {tokenizer_type})")


class _Tokenizer:
    """Common surface: vocab_size, mask_id, eod, bos, tokenize, detokenize, name, model_path."""

    name: str
    model_path: str
    vocab_size: int
    mask_id: int
    eod: int
    bos: Optional[int]
    mask_appended: bool  # True when the mask id lies past the model's own vocabulary

    def _set_mask(self, base_vocab_size: int, existing_mask: Optional[int]) -> None:
        self.mask_appended = existing_mask is None
        self.mask_id = base_vocab_size if existing_mask is None else existing_mask
        self.vocab_size = base_vocab_size + (1 if existing_mask is None else 0)

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def _strip_mask(self, ids: Iterable[int]) -> List[int]:
        return [int(i) for i in ids if int(i) != self.mask_id]

    def __repr__(self) -> str:
        return (f"{self.name}(model={self.model_path!r}, vocab_size={self.vocab_size}, "
                f"mask_id={self.mask_id}, eod={self.eod}, bos={self.bos})")


class SentencePieceTokenizer(_Tokenizer):
    name = "SentencePieceTokenizer"

    def __init__(self, model_path: str) -> None:
        import sentencepiece

        if not os.path.isfile(model_path):
            raise _bad_model(self.name, model_path, "file not found, expected a SentencePiece .model file")
        self.model_path = os.path.abspath(model_path)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (OSError, RuntimeError) as err:
            raise _bad_model(self.name, model_path, f"not a loadable SentencePiece model ({err})") from None
        n = self._sp.GetPieceSize()
        existing = None
        for piece in MASK_PIECES:
            i = self._sp.PieceToId(piece)
            if self._sp.IdToPiece(i) == piece and i != self._sp.unk_id():
                existing = i
                break
        self._set_mask(n, existing)
        if self._sp.eos_id() < 0:
            raise _bad_model(self.name, model_path, "model has no EOS piece, expected one to serve as EOD")
        self.eod = self._sp.eos_id()
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    def tokenize(self, text: str) -> List[int]:
        return self._sp.EncodeAsIds(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.DecodeIds(self._strip_mask(ids))

    # Pickle by path: multiprocessing workers rebuild the processor.
    def __reduce__(self):
        return (SentencePieceTokenizer, (self.model_path,))


class HuggingFaceTokenizer(_Tokenizer):
    """A `tokenizers` tokenizer.json (or a directory holding one, and optionally
    tokenizer_config.json naming `eos_token` / `bos_token`)."""

    name = "HuggingFaceTokenizer"
    EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
    BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]")

    def __init__(self, model_path: str) -> None:
        try:
            import tokenizers
        except ImportError:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` package "
                             "(pip install tokenizers)") from None
        path = model_path
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise _bad_model(self.name, model_path,
                             "not found, expected a tokenizer.json file or a directory containing one")
        self.model_path = os.path.abspath(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.model_path)
        except Exception as err:  # the Rust side raises its own Exception type
            raise _bad_model(self.name, model_path, f"not a loadable tokenizer.json ({err})") from None
        config = self._read_config(os.path.dirname(self.model_path))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise _bad_model(self.name, model_path, "empty vocabulary")
        existing = next((vocab[p] for p in MASK_PIECES if p in vocab), None)
        self._set_mask(max(vocab.values()) + 1, existing)
        eos = self._special(config.get("eos_token"), self.EOS_CANDIDATES, vocab)
        if eos is None:
            raise _bad_model(self.name, model_path, f"no EOS token found (looked for tokenizer_config.json "
                                                    f"eos_token and {self.EOS_CANDIDATES}), expected one to serve as EOD")
        self.eod = eos
        self.bos = self._special(config.get("bos_token"), self.BOS_CANDIDATES, vocab)

    @staticmethod
    def _read_config(directory: str) -> dict:
        path = os.path.join(directory, "tokenizer_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    @staticmethod
    def _special(configured, candidates, vocab) -> Optional[int]:
        if isinstance(configured, dict):  # {"content": "</s>", ...} in some configs
            configured = configured.get("content")
        for token in ([configured] if configured else []) + list(candidates):
            if token in vocab:
                return vocab[token]
        return None

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(self._strip_mask(ids), skip_special_tokens=False)

    def __reduce__(self):
        return (HuggingFaceTokenizer, (self.model_path,))


def build_tokenizer(tokenizer_type: str, tokenizer_model: str) -> _Tokenizer:
    """Megatron-style factory; ValueError names the flag and what was expected."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported, expected one of {TOKENIZER_TYPES}")
    if not tokenizer_model:
        raise ValueError(f"--tokenizer-model is required for --tokenizer-type {tokenizer_type}")
    cls = SentencePieceTokenizer if tokenizer_type == "SentencePieceTokenizer" else HuggingFaceTokenizer
    return cls(tokenizer_model)
