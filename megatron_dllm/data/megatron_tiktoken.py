"""Megatron-LM's TikTokenizer JSON vocabulary (`--tokenizer-type TikTokenizer --tokenizer-model
vocab.json`), as `tools/preprocess_data.py` of Megatron-LM core_v0.16.1 builds it.

The file is a JSON list of `{"rank", "token_bytes" (base64), "token_str"}` records, rank = list
position, ranks 0..255 the single bytes. Id layout: the special tokens first (ids
0..num_special_tokens-1: `--tokenizer-special-tokens`, default `<unk> <s> </s> <mask> <pad> <cls>
<sep>`, then `<SPECIAL_{i}>` fillers), then the ranks shifted by num_special_tokens and cut to
`vocab_size - num_special_tokens` of them (default vocabulary 131072, 1000 specials).
Special-token strings inside a document encode as their special ids.

The tokenizer itself is megatron-core's `TikTokenTokenizer` (the class Megatron-LM's
preprocessing builds by default); this module checks the flags first and, when megatron-core
refuses the file, finds the first bad record, so bad input is reported as one line naming the
flag or the file. The diffusion [MASK] is `<mask>`, which megatron-core requires among the
specials (so `vocab_size` never grows).
"""
from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional

from megatron_dllm.data.tokenizers import _bad_model, _Tokenizer
from megatron_dllm.errors import InputError, not_a_file

PATTERNS = ("v1", "v2")
DEFAULT_PATTERN = "v2"
DEFAULT_NUM_SPECIAL_TOKENS = 1000
DEFAULT_VOCAB_SIZE = 2 ** 17
RECORD_KEYS = {"rank", "token_bytes", "token_str"}


def is_megatron_vocabulary(path: str) -> bool:
    """A `.json` vocabulary whose first character opens a list (an HF tokenizer.json is an object)."""
    if not str(path).endswith(".json") or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(64).lstrip()[:1] == b"["


class MegatronTikTokenizer(_Tokenizer):
    name = "TikTokenizer"
    special_tokens_in_text = True  # megatron-core's text_to_ids: encode(allowed_special="all")

    def __init__(self, model_path: str, pattern: Optional[str] = None,
                 special_tokens: Optional[Iterable[str]] = None, num_special_tokens: Optional[int] = None,
                 vocab_size: Optional[int] = None) -> None:
        try:
            import tiktoken  # noqa: F401  (megatron-core imports it silently)
            from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as core
        except ImportError:
            raise InputError("--tokenizer-type TikTokenizer needs the `tiktoken` package "
                             "(pip install tiktoken)") from None
        self.pattern = pattern or DEFAULT_PATTERN
        self.special_tokens = list(special_tokens) if special_tokens is not None else None
        self.num_special_tokens = num_special_tokens
        self.requested_vocab_size = vocab_size
        specials = self.special_tokens if self.special_tokens is not None else list(core.SPECIAL_TOKENS)
        n_special = DEFAULT_NUM_SPECIAL_TOKENS if num_special_tokens is None else num_special_tokens
        size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        _check_flags(self.pattern, specials, n_special, size, core.SPECIAL_TOKENS)
        # Every option that changes ids, as in effect (defaults filled in): a dataset's sidecar
        # records them and training compares (`indexed_dataset.check_tokenizer_options`).
        self.id_options = {"tiktoken_pattern": self.pattern, "tiktoken_num_special_tokens": n_special,
                           "tokenizer_special_tokens": list(specials), "vocab_size": size}
        if not os.path.isfile(model_path):
            raise _bad_model(self.name, model_path, f"{not_a_file(model_path)}, expected Megatron-LM's JSON vocabulary")
        self.model_path = os.path.abspath(model_path)
        try:
            built = core.TikTokenTokenizer(self.model_path, special_tokens=specials, num_special_tokens=n_special,
                                           pattern=self.pattern, vocab_size=size)
        except Exception as err:  # megatron-core asserts; name what is wrong with the file
            _check_vocabulary(self.model_path, size - n_special, size, n_special)
            raise _bad_model(self.name, model_path, f"megatron-core refused it ({err or type(err).__name__})") from None
        # megatron-core's `text_to_ids` is `encode(text, allowed_special="all")` on this tiktoken
        # Encoding; keeping only the Encoding lets workers unpickle it without importing megatron-core.
        self._enc = built.tokenizer
        self.all_special_tokens = list(built.special_tokens)
        self._special_set = frozenset(self.all_special_tokens)
        self._special_starts = sorted({t[0] for t in self.all_special_tokens})
        self._special_lengths = sorted({len(t) for t in self.all_special_tokens})
        self._set_mask(size, built.mask_id)
        self.eod = built.eod
        self.bos = built.bos_id

    def tokenize(self, text: str) -> List[int]:
        # encode(allowed_special="all") runs a regex of all 1000 specials over the text, about 10x
        # the cost of the BPE itself; without a special in the text it equals encode_ordinary.
        if self._has_special(text):
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode_ordinary(text)

    def _has_special(self, text: str) -> bool:
        for start in self._special_starts:
            pos = text.find(start)
            while pos >= 0:
                if any(text[pos:pos + n] in self._special_set for n in self._special_lengths):
                    return True
                pos = text.find(start, pos + 1)
        return False

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._enc.decode(self._strip_mask(ids))

    def __reduce__(self):  # the built tokenizer: workers neither re-read the file nor import megatron-core
        return (_restore, (self.__dict__,))


def _restore(state: dict) -> MegatronTikTokenizer:
    tok = MegatronTikTokenizer.__new__(MegatronTikTokenizer)
    tok.__dict__.update(state)
    return tok


def _check_flags(pattern, specials, n_special, vocab_size, required) -> None:
    if pattern not in PATTERNS:
        raise InputError(f"--tiktoken-pattern {pattern!r}: Megatron-LM's JSON vocabulary takes v1 or v2")
    if len(set(specials)) != len(specials):
        raise InputError(f"--tokenizer-special-tokens: duplicates in {specials}")
    missing = [t for t in required if t not in specials]
    if missing:
        raise InputError(f"--tokenizer-special-tokens: missing {missing}; megatron-core's TikTokenizer needs "
                         f"all of {list(required)}")
    if not len(specials) <= n_special < vocab_size:
        raise InputError(f"--tiktoken-num-special-tokens {n_special}: expected at least the {len(specials)} "
                         f"special tokens and less than --vocab-size {vocab_size}")


def _check_vocabulary(path: str, n_ranks: int, vocab_size: int, n_special: int) -> None:
    """The file is a list of rank records, long enough for `n_ranks` (names the first bad record)."""
    import base64
    import binascii

    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise _bad_model("TikTokenizer", path, f"not JSON ({err})") from None
    if not isinstance(vocab, list):
        raise _bad_model("TikTokenizer", path, "expected a JSON list of {rank, token_bytes, token_str} records")
    if len(vocab) < n_ranks:
        raise _bad_model("TikTokenizer", path, f"has {len(vocab)} ranks; --vocab-size {vocab_size} with "
                                               f"{n_special} special tokens needs {n_ranks}")
    seen = set()
    for i, rec in enumerate(vocab[:n_ranks]):
        try:
            ok = isinstance(rec, dict) and rec.keys() == RECORD_KEYS and rec["rank"] == i
            token = base64.b64decode(rec["token_bytes"], validate=True) if ok else None
        except (binascii.Error, TypeError, ValueError):
            ok = False
        if not ok or (i < 256 and token != bytes([i])) or token in seen:
            raise _bad_model("TikTokenizer", path, f"record {i} is not {{rank: {i}, token_bytes: base64, "
                                                   f"token_str}} with distinct bytes (ranks 0..255 the single "
                                                   f"bytes): {str(rec)[:80]}")
        seen.add(token)
