"""Writing `.tiktoken` vocabulary files (offline: converting a tokenizer for `TikTokenizer`)."""
from __future__ import annotations

from typing import Iterable

from megatron_dllm.atomic_file import atomic_write


def write_tiktoken_file(path: str, tokens: Iterable[bytes]) -> None:
    """Write token byte strings as a `.tiktoken` file, rank = position (atomic)."""
    import base64

    with atomic_write(path, "wb") as f:
        for rank, token in enumerate(tokens):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def write_tiktoken_from_bytelevel(path: str, vocab: dict) -> None:
    """Convert a byte-level BPE vocabulary (GPT-2 style `tokenizers` vocab: piece -> id, pieces
    spelled with GPT-2's printable stand-ins for bytes) into a `.tiktoken` file, ranks in id order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    pieces = sorted(vocab.items(), key=lambda kv: kv[1])
    write_tiktoken_file(path, [bytes(byte_of[c] for c in piece) for piece, _ in pieces])
