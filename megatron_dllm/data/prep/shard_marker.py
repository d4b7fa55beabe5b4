"""A finished shard's `.done.json` marker: written last, it lets a re-run skip the shard and lets
the merge check that its shards belong together.

It records a fingerprint of what made the shard: its own inputs with their sizes, and the run's
(the count, total size and SHA-256 of the whole array's input paths and sizes, the number of
shards, the tokenizer with its hash and options, the keys, `--append-eod`), with the shard's
statistics. A re-run skips the shard
when the fingerprint matches and its datasets validate; a marker for other inputs or flags is
refused unless --overwrite (the shard's finished output is not replaced silently).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Sequence, Tuple

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.data.indexed_dataset import DatasetFormatError, validate_indexed_dataset
from megatron_dllm.data.tokenizers import tokenizer_fingerprint
from megatron_dllm.errors import InputError

MARKER_VERSION = 4  # 4: a rejections report per dataset


def _sized(files: Sequence[str]) -> list:
    return [[os.path.abspath(f), os.path.getsize(f)] for f in files]


def _digest(files: Sequence[str]) -> dict:
    """The whole array's inputs in a few fields: every shard's marker holds them, and a corpus of
    100,000 files listed in each of 1,000 markers would be gigabytes."""
    sized = _sized(files)
    return {"files": len(sized), "bytes": sum(size for _, size in sized),
            "sha256": hashlib.sha256(json.dumps(sized).encode()).hexdigest()}


def fingerprint(all_files: Sequence[str], files: Sequence[str], options, tokenizer) -> dict:
    """What made a shard (`options`: its PreprocessOptions); JSON, compared as a whole."""
    return {
        "version": MARKER_VERSION,
        "inputs": _sized(files),
        "run": {
            "inputs": _digest(all_files),  # paths and sizes
            "num_shards": options.num_shards,
            "tokenizer": [options.tokenizer_type, tokenizer.model_path, tokenizer_fingerprint(tokenizer),
                          {k: v for k, v in sorted(options.tokenizer_options.items()) if v is not None}],
            "json_keys": list(options.json_keys),
            "append_eod": bool(options.append_eod),
        },
    }


def differences(a: dict, b: dict, prefix: str = "") -> list:
    """The (dotted) fields in which two fingerprints differ."""
    out = []
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}")
    return out


def read_marker(marker: str) -> Optional[dict]:
    """The marker's contents, or None where there is none; an unreadable one is an InputError."""
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"{marker}: unreadable shard marker ({err}); pass --overwrite to redo the shard") from None
    if not isinstance(info, dict) or not isinstance(info.get("fingerprint"), dict):
        raise InputError(f"{marker}: not a shard marker; pass --overwrite to redo the shard")
    return info


def finished(marker: str, expected: dict, prefixes: Sequence[str]) -> Tuple[Optional[dict], str]:
    """(stats dict of a finished shard, "") or (None, why it must be done); a shard finished for
    other inputs or flags is an InputError (its output is replaced only with --overwrite)."""
    info = read_marker(marker)
    if info is None:
        return None, "no finished output"
    changed = differences(info["fingerprint"], expected)
    if changed:
        raise InputError(f"{marker}: this shard was finished with other inputs, tokenizer or flags "
                         f"({', '.join(changed)} differ); pass --overwrite to redo it")
    try:
        for p in prefixes:
            validate_indexed_dataset(p)
    except DatasetFormatError as err:
        return None, f"finished marker present but the dataset is invalid ({err})"
    return info.get("stats"), ""


def write_marker(marker: str, shard_fingerprint: dict, stats: dict) -> None:
    """Durably, under a temporary name renamed into place; a failed write leaves no temporary."""
    with atomic_write(marker, fsync=True) as f:
        json.dump({"fingerprint": shard_fingerprint, "stats": stats}, f, indent=1)
