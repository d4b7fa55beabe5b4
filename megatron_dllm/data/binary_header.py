"""The header prefix that Megatron's `.idx` and lit-gpt's LITPKDS files share, checked once.

Both formats begin (little endian) with `magic | version <Q | dtype code <B` followed by
format-specific fields; lit-gpt copied the layout from Megatron's index.
"""

from __future__ import annotations

import os
import struct
from typing import Callable, Mapping, Tuple

import numpy as np


def read_binary_header(path: str, *, size: int, magic: bytes, version: int, dtype_codes: Mapping[int, type],
                       kind: str, fail: Callable[[str, int, str], Exception]) -> Tuple[bytes, type]:
    """(the first `size` bytes of `path`, the dtype its code names); raises `fail(path, byte
    offset, what was expected)` for a short file, a wrong magic or version, or an unknown code.
    `kind` names the format in the messages."""
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(size)
    if len(head) < size:
        raise fail(path, len(head), f"truncated header: file is {file_size} bytes, expected a "
                                    f"{size}-byte {kind} header")
    version_at = len(magic)
    code_at = version_at + 8
    if head[:version_at] != magic:
        raise fail(path, 0, f"bad magic {head[:version_at]!r}, expected {magic!r} (not a {kind} file)")
    (found,) = struct.unpack_from("<Q", head, version_at)
    if found != version:
        raise fail(path, version_at, f"bad version {found}, expected {version}")
    code = head[code_at]
    if code not in dtype_codes:
        names = {c: np.dtype(t).name for c, t in dtype_codes.items()}
        raise fail(path, code_at, f"unknown dtype code {code}, expected one of {names}")
    return head, dtype_codes[code]
