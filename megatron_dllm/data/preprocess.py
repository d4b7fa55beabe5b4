"""Text -> Megatron `.bin/.idx`, the logic behind `tools/preprocess_data.py`.

Inputs (globs allowed, `.gz` read transparently):
  * JSONL (any name not ending in `.txt`/`.txt.gz`): one JSON object per line; every key of
    `json_keys` becomes its own dataset `{output_prefix}_{key}_document`. A value may be a string
    or a list of strings (tokenized piecewise and concatenated into one document, as Megatron's
    document mode does). Blank lines are not records and are skipped.
  * Plain text (`.txt`): one document per paragraph block, i.e. per run of non-blank lines
    separated by one or more blank (whitespace-only) lines; the block's line breaks are kept.
    The documents go to the first json key (default `text`).

Each document is one sequence; with `append_eod` the tokenizer's EOD (= EOS) id ends it. No
BOS is added. A record that yields no document for a key is *rejected* with a reason
(invalid_json, missing_key, not_text, empty_text), counted, and reported with its file and
line, so for every key: read == written + rejected.
"""

from __future__ import annotations

import glob
import gzip
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_dllm.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype
from megatron_dllm.data.tokenizers import build_tokenizer

REJECT_REASONS = ("invalid_json", "missing_key", "not_text", "empty_text")
MAX_PRINTED_REJECTIONS = 20


@dataclass
class KeyStats:
    written: int = 0
    tokens: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count


@dataclass
class PreprocessStats:
    read: int = 0  # records (JSON lines / text paragraphs)
    keys: Dict[str, KeyStats] = field(default_factory=dict)
    output_prefixes: Dict[str, str] = field(default_factory=dict)  # key -> dataset prefix
    rejections: List[Tuple[str, int, str, str]] = field(default_factory=list)  # file, line, key, reason
    rejections_file: Optional[str] = None
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"documents read: {self.read} ({self.seconds:.1f} s)"]
        for key, s in self.keys.items():
            rej = sum(s.rejected.values())
            by_reason = ", ".join(f"{r}={n}" for r, n in sorted(s.rejected.items())) or "none"
            lines.append(f"  [{key}] written: {s.written}, rejected: {rej} ({by_reason}), "
                         f"tokens written: {s.tokens} -> {self.output_prefixes[key]}.bin/.idx")
        if self.rejections_file:
            lines.append(f"  all rejections with file and line: {self.rejections_file}")
        return "\n".join(lines)


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Expand globs; a pattern that matches nothing is an error, not an empty corpus."""
    files: List[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise ValueError(f"--input {pattern!r}: no such file")
        files.extend(matches)
    return files


def _is_plain_text(path: str) -> bool:
    return path.endswith(".txt") or path.endswith(".txt.gz")


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, "rt", encoding="utf-8", errors="replace")


def _read_records(files: Sequence[str]) -> Iterator[Tuple[int, int, bool, str]]:
    """Yield (file index, 1-based line, is_plain_text, raw record) in input order."""
    for fi, path in enumerate(files):
        plain = _is_plain_text(path)
        with _open_text(path) as f:
            if not plain:
                for lineno, line in enumerate(f, 1):
                    if line.strip():  # blank lines in JSONL are not records
                        yield fi, lineno, False, line
                continue
            block: List[str] = []
            start = 0
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    if not block:
                        start = lineno
                    block.append(line)
                elif block:
                    yield fi, start, True, "".join(block).rstrip("\n")
                    block = []
            if block:
                yield fi, start, True, "".join(block).rstrip("\n")


# ---- worker side: a module global so each Pool worker builds its tokenizer once
_worker = {}


def _init_worker(tokenizer_type: str, tokenizer_model: str, json_keys: Sequence[str], append_eod: bool):
    tok = build_tokenizer(tokenizer_type, tokenizer_model)
    _worker.update(tok=tok, keys=list(json_keys), eod=tok.eod if append_eod else None)


def _encode(record: Tuple[int, int, bool, str]):
    """-> (file index, line, {key: token ids | reject reason})."""
    fi, lineno, plain, raw = record
    keys = _worker["keys"]
    if plain:
        values = {keys[0]: raw}
    else:
        try:
            obj = json.loads(raw)
        except ValueError:
            return fi, lineno, {k: "invalid_json" for k in keys}
        if not isinstance(obj, dict):
            return fi, lineno, {k: "invalid_json" for k in keys}
        values = obj
    out = {}
    for key in keys:
        if key not in values:
            out[key] = "missing_key"
            continue
        text = values[key]
        # Megatron's document mode: a list of strings is tokenized piecewise and concatenated.
        pieces = [text] if isinstance(text, str) else text
        if not isinstance(pieces, list) or not all(isinstance(t, str) for t in pieces):
            out[key] = "not_text"
            continue
        ids = [i for t in pieces if t.strip() for i in _worker["tok"].tokenize(t)]
        if not ids:
            out[key] = "empty_text"
            continue
        if _worker["eod"] is not None:
            ids.append(_worker["eod"])
        out[key] = ids
    return fi, lineno, out


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    chunksize: int = 64,
    log: Optional[Callable[[str], None]] = None,
) -> PreprocessStats:
    """Tokenize `inputs` into `{output_prefix}_{key}_document.bin/.idx` for each key.

    `workers > 1` tokenizes in a multiprocessing Pool (imap keeps input order, so output is
    identical for any worker count). `log` receives progress and rejection lines (default:
    stderr). Rejections go to `{output_prefix}_rejected.tsv` when there are any.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    json_keys = list(json_keys)
    if not json_keys:
        raise ValueError("--json-keys: at least one key is required")
    files = expand_inputs(inputs)
    if any(_is_plain_text(f) for f in files) and len(json_keys) > 1:
        raise ValueError("--json-keys: plain-text inputs fill a single key, got several")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model)  # fail early, in this process
    dtype = optimal_dtype(tokenizer.vocab_size)

    stats = PreprocessStats()
    writers = {}
    for key in json_keys:
        prefix = f"{output_prefix}_{key}_document"
        stats.output_prefixes[key] = prefix
        stats.keys[key] = KeyStats()
        writers[key] = IndexedDatasetWriter(prefix, dtype)
    rejections_path = f"{output_prefix}_rejected.tsv"
    rejections_out = None
    t0 = time.time()
    init_args = (tokenizer_type, tokenizer_model, json_keys, append_eod)
    pool = None
    try:
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=init_args)
            results = pool.imap(_encode, _read_records(files), max(32, chunksize))
        else:
            _init_worker(*init_args)
            results = map(_encode, _read_records(files))
        for fi, lineno, out in results:
            stats.read += 1
            for key in json_keys:
                value = out[key]
                if isinstance(value, str):
                    stats.keys[key].rejected[value] += 1
                    entry = (files[fi], lineno, key, value)
                    if len(stats.rejections) < 1000:
                        stats.rejections.append(entry)
                    if rejections_out is None:
                        rejections_out = open(rejections_path, "w", encoding="utf-8")
                        rejections_out.write("file\tline\tkey\treason\n")
                    rejections_out.write("\t".join(map(str, entry)) + "\n")
                    if sum(sum(s.rejected.values()) for s in stats.keys.values()) <= MAX_PRINTED_REJECTIONS:
                        log(f"rejected {files[fi]}:{lineno} [{key}]: {value}")
                else:
                    writers[key].add_document(value)
                    stats.keys[key].written += 1
                    stats.keys[key].tokens += len(value)
            if stats.read % 100000 == 0:
                log(f"{stats.read} documents, {time.time() - t0:.0f} s")
        for w in writers.values():
            w.finalize()
    except BaseException:
        if pool is not None:
            pool.terminate()
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if rejections_out is not None:
            rejections_out.close()
    if rejections_out is not None:
        stats.rejections_file = rejections_path
    elif os.path.exists(rejections_path):
        os.remove(rejections_path)  # stale report from an earlier run of the same prefix
    stats.seconds = time.time() - t0
    for key, s in stats.keys.items():
        assert stats.read == s.written + sum(s.rejected.values()), key
    return stats
