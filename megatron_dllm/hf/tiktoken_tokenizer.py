"""A tiktoken Encoding as a Hugging Face `tokenizers` tokenizer with the same ids, for exports.

tiktoken splits text with its regex, then merges each piece's bytes greedily by rank: a piece
that is itself a token stays whole, otherwise the adjacent pair whose concatenation has the
lowest rank merges first. The equivalent byte-level BPE: the same regex as a `Split`
pre-tokenizer, GPT-2's byte-to-character map, `ignore_merges` (a whole-token piece stays whole),
and for every token every split into two tokens as a merge, ordered by the token's rank (then
by the parts' ranks, as transformers' own tiktoken converter orders them). Special tokens are
added tokens at their own ids, matched in text as tiktoken's `allowed_special="all"` does.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from megatron_dllm.errors import InputError


def _byte_chars() -> Dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (ByteLevel's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return chars


def vocab_and_merges(ranks: Dict[bytes, int]) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    chars = _byte_chars()
    spell = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    vocab = {spell(token): i for token, i in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort(key=lambda m: m[:3])
    return vocab, [(spell(m[3]), spell(m[4])) for m in merges]


def hf_tokenizer_from_tiktoken(encoding):
    """A `tokenizers.Tokenizer` giving `encoding.encode(text, allowed_special="all")`'s ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    ranks, specials = encoding._mergeable_ranks, encoding._special_tokens
    vocab, merges = vocab_and_merges(ranks)
    clash = [t for t in specials if t in vocab]
    if clash:
        raise InputError(f"special token {clash[0]!r} is also an ordinary token; a Hugging Face vocabulary "
                         f"cannot hold both")
    vocab.update(specials)  # added tokens below keep these ids
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, _ in sorted(specials.items(), key=lambda kv: kv[1])])
    return tok
