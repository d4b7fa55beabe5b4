"""Tokenizers behind Megatron's `--tokenizer-type` / `--tokenizer-model` flags.

Every tokenizer carries a [MASK] token for the masked-diffusion families. If the model already
has one (`<mask>` or `[MASK]`) its id is used; otherwise the mask id is appended after the
last id, so `vocab_size` grows by one (Llama's 32000 SentencePiece pieces -> 32001, as in the
paper). `vocab_size` is therefore the real number of ids the model's embedding must cover.

`tokenize` adds no BOS/EOS: documents are concatenated with EOD (= the EOS id) by
preprocessing, and no BOS is ever inserted.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, List, Optional, Tuple

from megatron_dllm.errors import InputError, not_a_file

MASK_PIECES = ("<mask>", "[MASK]")
TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "TikTokenizer")

# Pre-tokenisation regexes for TikTokenizer (`--tiktoken-pattern NAME` or a literal regex).
TIKTOKEN_PATTERNS = {
    # Llama 3's (128k vocabulary; cl100k's regex without possessive quantifiers)
    "llama3": (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""),
    "cl100k": (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
               r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""),
    "o200k": "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]),
}
DEFAULT_TIKTOKEN_PATTERN = "llama3"
DEFAULT_TIKTOKEN_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")


def data_id_rule(tokenizer) -> Tuple[int, Optional[int]]:
    """What a corpus for `tokenizer` may hold: ids below the first value and never the second. An
    appended [MASK] lies past the model's vocabulary, at the limit itself; a mask piece of the model's
    own (SentencePiece's <mask>, a JSON vocabulary's) lies inside it. Either way the data must not
    hold it: the clean target [MASK] has log-probability -inf under every diffusion loss."""
    if getattr(tokenizer, "mask_appended", False):
        return tokenizer.mask_id, None
    return tokenizer.vocab_size, tokenizer.mask_id


def _bad_model(tokenizer_type: str, path, expected: str) -> InputError:
    return InputError(f"--tokenizer-model {path!r}: {expected} (for --tokenizer-type {tokenizer_type})")


class _Tokenizer:
    """Common surface: vocab_size, mask_id, eod, bos, tokenize, detokenize, name, model_path."""

    name: str
    model_path: str
    vocab_size: int
    mask_id: int
    eod: int
    bos: Optional[int]
    mask_appended: bool  # True when the mask id lies past the model's own vocabulary
    # whether a special token's string inside a document encodes to that token (else: as text)
    special_tokens_in_text: bool = False

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
            raise _bad_model(self.name, model_path, f"{not_a_file(model_path)}, expected a SentencePiece .model file")
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

    special_tokens_in_text = True  # the tokenizers library splits its added tokens out of the text

    name = "HuggingFaceTokenizer"
    EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
    BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]")

    def __init__(self, model_path: str) -> None:
        try:
            import tokenizers
        except ImportError:
            raise InputError("--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` package "
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
        eos = self._special("eos_token", config, self.EOS_CANDIDATES, vocab)
        if eos is None:
            raise _bad_model(self.name, model_path, f"no EOS token found (looked for tokenizer_config.json "
                                                    f"eos_token and {self.EOS_CANDIDATES}), expected one to "
                                                    f"serve as EOD")
        self.eod = eos
        self.bos = self._special("bos_token", config, self.BOS_CANDIDATES, vocab)

    @staticmethod
    def _read_config(directory: str) -> dict:
        from megatron_dllm.hf.config_json import read_config_json

        path = os.path.join(directory, "tokenizer_config.json")
        if not os.path.isfile(path):
            return {}
        # a JSON object or one error line naming the file (not a JSON parser's traceback)
        config = read_config_json(path, "--tokenizer-model", dllm=False)
        for key in ("eos_token", "bos_token"):  # a token string, or {"content": string}
            value = config.get(key)
            token = value.get("content") if isinstance(value, dict) else value
            if token is not None and not isinstance(token, str):
                raise InputError(f"--tokenizer-model {path}: {key} {value!r}, expected a token string")
        return config

    def _special(self, key: str, config: dict, candidates, vocab) -> Optional[int]:
        """The id of tokenizer_config.json's `key` token; the first of `candidates` only where the
        config names none (a named token is never swapped for a guess)."""
        configured = config.get(key)
        if isinstance(configured, dict):  # {"content": "</s>", ...} in some configs
            configured = configured.get("content")
        if configured:
            if configured not in vocab:
                raise _bad_model(self.name, self.model_path,
                                 f"tokenizer_config.json {key} {configured!r} is not in the vocabulary, "
                                 f"expected a token of tokenizer.json")
            return vocab[configured]
        return next((vocab[token] for token in candidates if token in vocab), None)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(self._strip_mask(ids), skip_special_tokens=False)

    def __reduce__(self):
        return (HuggingFaceTokenizer, (self.model_path,))


class TikTokenizer(_Tokenizer):
    """A tiktoken-format BPE file (`.tiktoken`: one `base64(token bytes) rank` per line), the
    format of Llama 3's 128k vocabulary, encoded with the `tiktoken` package.

    Ids: the file's ranks 0..R-1 (they must be exactly 0..R-1 and include all 256 single
    bytes, so every text encodes), then `special_tokens` in order (default
    `<|begin_of_text|>`, `<|end_of_text|>`), then, up to `num_special_tokens` specials in
    all, `<|reserved_special_token_{i}|>` fillers (Llama 3: 128000 + 256 = 128256), then
    [MASK]. EOD is `<|end_of_text|>` or `<|endoftext|>`, BOS `<|begin_of_text|>` if present.
    `pattern` is a name in TIKTOKEN_PATTERNS (default "llama3", the cl100k-style regex) or a
    literal regex. Special-token strings inside documents are encoded as ordinary text.
    """

    name = "TikTokenizer"
    EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|eot_id|>")
    BOS_CANDIDATES = ("<|begin_of_text|>", "<s>")

    def __init__(self, model_path: str, pattern: Optional[str] = None,
                 special_tokens: Optional[Iterable[str]] = None,
                 num_special_tokens: Optional[int] = None) -> None:
        try:
            import tiktoken
        except ImportError:
            raise InputError("--tokenizer-type TikTokenizer needs the `tiktoken` package "
                             "(pip install tiktoken)") from None
        if not os.path.isfile(model_path):
            raise _bad_model(self.name, model_path, f"{not_a_file(model_path)}, expected a .tiktoken file of "
                                                    "`base64token rank` lines")
        self.model_path = os.path.abspath(model_path)
        self.pattern = pattern or DEFAULT_TIKTOKEN_PATTERN
        self.special_tokens = list(special_tokens if special_tokens is not None
                                   else DEFAULT_TIKTOKEN_SPECIAL_TOKENS)
        self.num_special_tokens = num_special_tokens
        ranks = self.load_ranks(self.model_path)
        n = len(ranks)
        specials = list(self.special_tokens)
        if num_special_tokens is not None:
            if num_special_tokens < len(specials):
                raise InputError(f"--tiktoken-num-special-tokens {num_special_tokens} is smaller than "
                                 f"the {len(specials)} special tokens given")
            specials += [f"<|reserved_special_token_{i}|>"
                         for i in range(num_special_tokens - len(specials))]
        if len(set(specials)) != len(specials):
            raise InputError(f"--tiktoken-special-tokens: duplicates in {specials}")
        special_ids = {tok: n + i for i, tok in enumerate(specials)}
        pat = TIKTOKEN_PATTERNS.get(self.pattern, self.pattern)
        try:
            self._enc = tiktoken.Encoding(name=os.path.basename(model_path), pat_str=pat,
                                          mergeable_ranks=ranks, special_tokens=special_ids)
        except Exception as err:  # a bad regex is reported by the Rust side
            raise InputError(f"--tiktoken-pattern {self.pattern!r}: not usable ({err})") from None
        existing = next((special_ids[p] for p in MASK_PIECES if p in special_ids), None)
        self._set_mask(n + len(specials), existing)
        eos = next((special_ids[t] for t in self.EOS_CANDIDATES if t in special_ids), None)
        if eos is None:
            raise _bad_model(self.name, model_path, f"no EOS among the special tokens {specials[:8]}, "
                                                    f"expected one of {self.EOS_CANDIDATES} to serve as EOD")
        self.eod = eos
        self.bos = next((special_ids[t] for t in self.BOS_CANDIDATES if t in special_ids), None)

    @classmethod
    def load_ranks(cls, path: str) -> dict:
        """Parse a `.tiktoken` file into {token bytes: rank}; ValueError names file and line."""
        import base64
        import binascii

        ranks = {}
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                parts = line.split()
                try:
                    if len(parts) != 2:
                        raise ValueError
                    token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                except (ValueError, binascii.Error):
                    raise _bad_model(cls.name, path, f"line {lineno} is not `base64token rank`") from None
                if token in ranks:
                    raise _bad_model(cls.name, path, f"line {lineno}: token {token!r} appears twice")
                ranks[token] = rank
        if not ranks:
            raise _bad_model(cls.name, path, "empty .tiktoken file")
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise _bad_model(cls.name, path, f"ranks are not exactly 0..{len(ranks) - 1}")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise _bad_model(cls.name, path, f"{len(missing)} single bytes have no rank (first: "
                                             f"{missing[0]}); every byte must, so any text encodes")
        return ranks

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._enc.decode(self._strip_mask(ids))

    def __reduce__(self):
        return (TikTokenizer, (self.model_path, self.pattern, self.special_tokens, self.num_special_tokens))


# The files a HuggingFaceTokenizer reads (tokenizer.json, and the eos/bos names of the config).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_HASHES: dict = {}  # (path, size, mtime_ns) -> sha256 hex


def _sha256_file(path: str) -> str:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        with open(path, "rb") as f:
            _HASHES[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _HASHES[key]


def tokenizer_files(model_path: str) -> List[Tuple[str, str]]:
    """(name, path) of the files that define the tokenizer at `model_path`, sorted by name: a
    HuggingFace directory or `.json` file gives its tokenizer.json and, when present, the
    tokenizer_config.json beside it (as HuggingFaceTokenizer reads them); any other path is a
    single model file (SentencePiece .model, .tiktoken, Megatron-LM's JSON TikTokenizer list)."""
    from megatron_dllm.data.megatron_tiktoken import is_megatron_vocabulary

    path = os.fspath(model_path)
    if os.path.isdir(path):
        directory, main = path, os.path.join(path, HF_TOKENIZER_FILES[0])
    elif path.endswith(".json") and not is_megatron_vocabulary(path):
        directory, main = os.path.dirname(path), path
    else:
        directory, main = None, path
    if not os.path.isfile(main):
        raise InputError(f"--tokenizer-model {path!r}: no tokenizer file at {main}, cannot fingerprint it")
    files = [(os.path.basename(main), main)]
    config = os.path.join(directory, HF_TOKENIZER_FILES[1]) if directory is not None else None
    if config and os.path.isfile(config) and os.path.abspath(config) != os.path.abspath(main):
        files.append((HF_TOKENIZER_FILES[1], config))
    return sorted(files)


def tokenizer_fingerprint(tokenizer_or_path) -> str:
    """sha256 hex of the tokenizer's model file(s): a built tokenizer (its `model_path`) or a
    `--tokenizer-model` path. One file: the file's sha256 (what `sha256sum` prints). Several
    (a HuggingFace tokenizer.json with its tokenizer_config.json): the sha256 of their
    `sha256sum`-style listing `<sha256>  <file name>\n`, sorted by name, so the fingerprint
    does not depend on where the directory lives. Content only: two tokenizers with equal
    vocabulary sizes but different pieces get different fingerprints."""
    path = getattr(tokenizer_or_path, "model_path", tokenizer_or_path)
    files = tokenizer_files(path)
    if len(files) == 1:
        return _sha256_file(files[0][1])
    listing = "".join(f"{_sha256_file(p)}  {name}\n" for name, p in files)
    return hashlib.sha256(listing.encode("utf-8")).hexdigest()


def build_tokenizer(tokenizer_type: str, tokenizer_model: str, **options) -> _Tokenizer:
    """Megatron-style factory; ValueError names the flag and what was expected.

    `options` go to the tokenizer class (TikTokenizer: pattern, special_tokens,
    num_special_tokens, and for a Megatron-LM JSON vocabulary vocab_size); None values are dropped.
    A TikTokenizer model ending in `.json` is Megatron-LM's JSON format (`megatron_tiktoken.py`),
    any other a `.tiktoken` file.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise InputError(f"--tokenizer-type {tokenizer_type!r} is not supported, expected one of {TOKENIZER_TYPES}")
    if not tokenizer_model:
        raise InputError(f"--tokenizer-model is required for --tokenizer-type {tokenizer_type}")
    options = {k: v for k, v in options.items() if v is not None}
    cls = {"SentencePieceTokenizer": SentencePieceTokenizer, "HuggingFaceTokenizer": HuggingFaceTokenizer,
           "TikTokenizer": TikTokenizer}[tokenizer_type]
    if options and cls is not TikTokenizer:
        raise InputError(f"--tokenizer-type {tokenizer_type} takes no options, got {sorted(options)}")
    if cls is TikTokenizer and str(tokenizer_model).endswith(".json"):
        from megatron_dllm.data.megatron_tiktoken import MegatronTikTokenizer

        return MegatronTikTokenizer(tokenizer_model, **options)
    if "vocab_size" in options:
        raise InputError("--vocab-size applies to Megatron-LM's JSON TikTokenizer vocabulary (a .json "
                         "--tokenizer-model); a .tiktoken file's vocabulary is all of its ranks")
    return cls(tokenizer_model, **options)
