"""A finished shard's `.done.json` marker: written last, it lets a re-run skip the shard.

It records a fingerprint of what made the shard (its inputs with their sizes, the tokenizer with
its hash and options, the keys, `--append-eod`) and the shard's statistics. A re-run skips the
shard only when the fingerprint matches and its datasets validate; anything else is redone.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Tuple

from megatron_dllm.data.indexed_dataset import DatasetFormatError, validate_indexed_dataset
from megatron_dllm.data.prep.output import staging_tag
from megatron_dllm.data.tokenizers import tokenizer_fingerprint

MARKER_VERSION = 2


def fingerprint(files: Sequence[str], options, tokenizer) -> dict:
    """What made a shard (`options`: its PreprocessOptions); JSON, compared as a whole."""
    return {
        "version": MARKER_VERSION,
        "inputs": [[os.path.abspath(f), os.path.getsize(f)] for f in files],
        "tokenizer": [options.tokenizer_type, tokenizer.model_path, tokenizer_fingerprint(tokenizer),
                      {k: v for k, v in sorted(options.tokenizer_options.items()) if v is not None}],
        "json_keys": list(options.json_keys),
        "append_eod": bool(options.append_eod),
    }


def finished(marker: str, expected: dict, prefixes: Sequence[str]) -> Tuple[Optional[dict], str]:
    """(stats dict of a finished shard, "") or (None, why it must be (re)done)."""
    if not os.path.isfile(marker):
        return None, "no finished output"
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError) as err:
        return None, f"unreadable marker {marker} ({err})"
    if info.get("fingerprint") != expected:
        return None, f"{marker} was written for other inputs, tokenizer or flags"
    try:
        for p in prefixes:
            validate_indexed_dataset(p)
    except DatasetFormatError as err:
        return None, f"finished marker present but the dataset is invalid ({err})"
    return info.get("stats"), ""


def write_marker(marker: str, shard_fingerprint: dict, stats: dict) -> None:
    """Durably, under a temporary name renamed into place; a failed write leaves no temporary."""
    tmp = marker + staging_tag()
    try:
        with open(tmp, "w") as f:
            json.dump({"fingerprint": shard_fingerprint, "stats": stats}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, marker)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
