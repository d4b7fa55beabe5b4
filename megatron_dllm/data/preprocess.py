"""Text -> Megatron `.bin/.idx`, the logic behind `tools/preprocess_data.py`.

Inputs (files or globs; expanded into one sorted list, see `sources.py`): JSONL (plain,
`.gz`, `.zst`), Parquet (the `--json-keys` are columns, read in row-group batches) and plain
text (`.txt`, one document per paragraph block). Every key of `json_keys` becomes its own
dataset `{output_prefix}_{key}_document`. A value may be a string or a list of strings
(tokenized piecewise and concatenated into one document, as Megatron's document mode does).

Each document is one sequence; with `append_eod` the tokenizer's EOD (= EOS) id ends it. No
BOS is added. A record that yields no document for a key is *rejected* with a reason
(invalid_utf8, invalid_json, missing_key — absent or null —, not_text, empty_text), counted,
and listed with its file and line (Parquet: row) in `{output_prefix}_rejected.tsv`, so for
every key: read == written + rejected. Blank JSONL lines are not records (counted apart).

Memory is bounded independently of the corpus: records stream through chunks of at most
`chunk_records` records / `chunk_bytes` bytes, at most `2 * workers + 2` chunks are in flight,
and the writer spills document lengths to disk. Output is identical for any worker count.

Sharding (`num_shards`, `shard_index`): the shard's files are a contiguous, byte-balanced
run of the sorted input list (`sources.shard_files`); it writes
`{output_prefix}_shard{i:05d}of{n:05d}_{key}_document.bin/.idx` through temporary names and
an atomic rename, then a `..._shard{i:05d}of{n:05d}.done.json` marker. A re-run skips a shard
whose marker matches its inputs/tokenizer/flags and whose datasets validate, and redoes any
other (an interrupted shard leaves only temporaries, which are removed). Merging the shards
in order (`merge.merge_datasets`) equals a single unsharded run byte for byte.

One writer per dataset: each dataset prefix (a shard's own, when sharded) is locked while it
is written (`output.claim_outputs`), and a run without shards refuses a prefix that already holds
a dataset unless `overwrite`.

Failures publish nothing: an input that does not read to its end (truncated or corrupt `.gz`,
`.zst`, Parquet), a key that no record has (a Parquet column missing from a file's schema is
caught before tokenizing), an output directory that cannot be written (checked before
tokenizing) or a disk that fills up all raise ValueError naming the file, and leave earlier
outputs of the same prefix, and their `.done.json`, as they were. Tokenizer workers end when
this process dies (`parent_watch`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_dllm.data.indexed_dataset import (
    DatasetFormatError,
    IndexedDatasetWriter,
    optimal_dtype,
    tokenizer_metadata,
    validate_indexed_dataset,
)
from megatron_dllm.data.output import claim_outputs, release_all, staging_owner_alive, staging_tag
from megatron_dllm.data.sources import check_parquet_columns, expand_inputs, file_format, iter_chunks, shard_files
from megatron_dllm.data.tokenizers import build_tokenizer, tokenizer_fingerprint
from megatron_dllm.errors import InputError

__all__ = ["preprocess", "expand_inputs", "shard_prefix", "PreprocessStats", "REJECT_REASONS"]

REJECT_REASONS = ("invalid_utf8", "invalid_json", "missing_key", "not_text", "empty_text")
MAX_PRINTED_REJECTIONS = 20
MAX_KEPT_REJECTIONS = 1000
MAX_SEEN_KEYS = 50  # field names remembered to name in a "no record has key" error
MARKER_VERSION = 2


@dataclass
class KeyStats:
    written: int = 0
    tokens: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count


@dataclass
class PreprocessStats:
    read: int = 0  # records (JSON lines / Parquet rows / text paragraphs)
    keys: Dict[str, KeyStats] = field(default_factory=dict)
    output_prefixes: Dict[str, str] = field(default_factory=dict)  # key -> dataset prefix
    rejections: List[Tuple[str, int, str, str]] = field(default_factory=list)  # file, line/row, key, reason
    rejections_file: Optional[str] = None
    seconds: float = 0.0
    input_files: int = 0
    input_bytes: int = 0
    blank_lines: int = 0
    skipped: bool = False  # a finished shard found on disk, not redone
    shard: Optional[Tuple[int, int]] = None  # (index, count)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.keys.values())

    def summary(self) -> str:
        rate = lambda n: n / self.seconds if self.seconds > 0 else float("nan")  # noqa: E731
        where = f"shard {self.shard[0]} of {self.shard[1]}: " if self.shard else ""
        if self.skipped:
            where += "already finished, skipped (delete its .done.json or pass --overwrite to redo); "
        lines = [f"{where}documents read: {self.read} from {self.input_files} files "
                 f"({self.input_bytes / 1e6:.1f} MB) in {self.seconds:.1f} s; "
                 f"{rate(self.read):.1f} docs/s, {rate(self.tokens):.0f} tokens/s, "
                 f"{rate(self.input_bytes) / 1e6:.2f} MB/s"
                 + (f"; {self.blank_lines} blank lines skipped" if self.blank_lines else "")]
        for key, s in self.keys.items():
            rej = sum(s.rejected.values())
            by_reason = ", ".join(f"{r}={n}" for r, n in sorted(s.rejected.items())) or "none"
            lines.append(f"  [{key}] written: {s.written}, rejected: {rej} ({by_reason}), "
                         f"tokens written: {s.tokens} -> {self.output_prefixes[key]}.bin/.idx")
        if self.rejections_file:
            lines.append(f"  all rejections with file and line/row: {self.rejections_file}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        d["keys"] = {k: {"written": s.written, "tokens": s.tokens, "rejected": dict(s.rejected)}
                     for k, s in self.keys.items()}
        d["rejections"] = [list(r) for r in self.rejections[:MAX_PRINTED_REJECTIONS]]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PreprocessStats":
        st = cls(**{k: v for k, v in d.items() if k not in ("keys", "rejections", "shard")})
        st.keys = {k: KeyStats(v["written"], v["tokens"], Counter(v["rejected"])) for k, v in d["keys"].items()}
        st.rejections = [tuple(r) for r in d.get("rejections", [])]
        st.shard = tuple(d["shard"]) if d.get("shard") else None
        return st


def shard_prefix(output_prefix: str, shard_index: int, num_shards: int) -> str:
    return f"{output_prefix}_shard{shard_index:05d}of{num_shards:05d}"


# --------------------------------------------------------------------------- workers

_worker = {}  # per process: the tokenizer, built once


def _init_worker(tok, json_keys: Sequence[str], append_eod: bool, dtype_name: str) -> None:
    """`tok` is the built tokenizer (pickled to a worker: rebuilt from its file, or from its
    tables for a Megatron JSON TikTokenizer)."""
    _worker.update(tok=tok, keys=list(json_keys), eod=tok.eod if append_eod else None,
                   dtype=np.dtype(dtype_name))


def _init_pool_worker(parent: int, *init_args) -> None:
    """A pool worker: ends when the preprocessing process dies (even by SIGKILL), then builds
    the tokenizer. A parent already gone before the watch starts is caught here."""
    from megatron_dllm.parent_watch import exit_when_parent_dies

    if os.getppid() != parent:
        os._exit(1)
    exit_when_parent_dies("preprocessing worker")
    _init_worker(*init_args)


def _values(kind: str, payload, keys):
    """-> dict of field values, or a reject reason for the whole record."""
    if kind == "parquet":
        return payload
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    if kind == "text":
        return {keys[0]: text.replace("\r\n", "\n")}
    try:
        obj = json.loads(text)
    except ValueError:
        return "invalid_json"
    return obj if isinstance(obj, dict) else "invalid_json"


def _has_surrogates(pieces) -> bool:
    try:
        for t in pieces:
            t.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _encode_chunk(records):
    """Tokenize one chunk -> ({key: (tokens array, int64 lengths, [(fi, pos, reason)])}, n records,
    some of the field names seen)."""
    tok, keys, eod, dtype = _worker["tok"], _worker["keys"], _worker["eod"], _worker["dtype"]
    ids = {k: [] for k in keys}
    lengths = {k: [] for k in keys}
    rejects = {k: [] for k in keys}
    seen = set()
    for fi, pos, kind, payload in records:
        values = _values(kind, payload, keys)
        if len(seen) < MAX_SEEN_KEYS and isinstance(values, dict):
            seen.update(map(str, values))
        for key in keys:
            if isinstance(values, str):
                rejects[key].append((fi, pos, values))
                continue
            text = values.get(key)
            if text is None:  # absent or null
                rejects[key].append((fi, pos, "missing_key"))
                continue
            if isinstance(text, bytes):  # a Parquet binary column
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    rejects[key].append((fi, pos, "invalid_utf8"))
                    continue
            # Megatron's document mode: a list of strings is tokenized piecewise and concatenated.
            pieces = [text] if isinstance(text, str) else text
            if not isinstance(pieces, list) or not all(isinstance(t, str) for t in pieces):
                rejects[key].append((fi, pos, "not_text"))
                continue
            try:
                if len(pieces) == 1:  # the common case: no per-id Python loop
                    doc = tok.tokenize(pieces[0]) if pieces[0].strip() else []
                else:
                    doc = [i for t in pieces if t.strip() for i in tok.tokenize(t)]
            except Exception:
                if not _has_surrogates(pieces):
                    raise
                rejects[key].append((fi, pos, "invalid_utf8"))  # lone surrogates from JSON \ud800 escapes
                continue
            if not doc:
                rejects[key].append((fi, pos, "empty_text"))
                continue
            if eod is not None:
                doc.append(eod)
            ids[key].extend(doc)
            lengths[key].append(len(doc))
    out = {k: (np.array(ids[k], dtype=dtype), np.array(lengths[k], dtype=np.int64), rejects[k])
           for k in keys}
    return out, len(records), seen


def _encoded_chunks(chunks, workers: int, init_args, max_inflight: int):
    """Yield (encoded chunk, source Chunk without its records) in input order; at most
    `max_inflight` chunks are submitted and not yet consumed."""
    if workers <= 1:
        _init_worker(*init_args)
        for chunk in chunks:
            result = _encode_chunk(chunk.records)
            chunk.records = None
            yield result, chunk
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the parent may hold threads (pyarrow, tokenizers) that fork would copy mid-lock
    ex = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_pool_worker, initargs=(os.getpid(), *init_args))
    pending = deque()
    try:
        for chunk in chunks:
            pending.append((ex.submit(_encode_chunk, chunk.records), chunk))
            chunk.records = None
            while len(pending) >= max_inflight:
                fut, c = pending.popleft()
                yield fut.result(), c
        while pending:
            fut, c = pending.popleft()
            yield fut.result(), c
    finally:
        for fut, _ in pending:
            fut.cancel()
        ex.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- progress


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--:--"
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """A redrawn status line on a TTY (docs/s, tokens/s, MB/s, % and ETA by input bytes read),
    otherwise a log line every `log_interval` seconds."""

    def __init__(self, total_bytes: int, log: Callable[[str], None], tty: Optional[bool] = None,
                 log_interval: float = 30.0, label: str = "") -> None:
        self.total, self.log, self.label = total_bytes, log, label
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.interval = 0.25 if self.tty else log_interval
        self.t0 = self.last = time.time()
        self.docs = self.tokens = self.bytes = 0

    def line(self) -> str:
        dt = max(time.time() - self.t0, 1e-9)
        frac = self.bytes / self.total if self.total else float("nan")
        eta = dt * (1 - frac) / frac if self.total and frac > 0 else float("nan")
        pct = f"{100 * frac:5.1f}%" if self.total else "  ?  "
        return (f"{self.label}{pct} {self.docs} docs {self.tokens} tokens | {self.docs / dt:.1f} docs/s "
                f"{self.tokens / dt:.0f} tokens/s {self.bytes / dt / 1e6:.2f} MB/s | "
                f"{self.bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB | elapsed {_hms(dt)} ETA {_hms(eta)}")

    def update(self, docs: int, tokens: int, bytes_done: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes = bytes_done
        now = time.time()
        if now - self.last >= self.interval:
            self.last = now
            if self.tty:
                sys.stderr.write("\r\x1b[K" + self.line())
                sys.stderr.flush()
            else:
                self.log(self.line())

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K" + self.line() + "\n")
            sys.stderr.flush()


# --------------------------------------------------------------------------- driver


def _fingerprint(files, tokenizer_type, tokenizer, tokenizer_options, json_keys, append_eod):
    return {
        "version": MARKER_VERSION,
        "inputs": [[os.path.abspath(f), os.path.getsize(f)] for f in files],
        "tokenizer": [tokenizer_type, tokenizer.model_path, tokenizer_fingerprint(tokenizer),
                      {k: v for k, v in sorted((tokenizer_options or {}).items()) if v is not None}],
        "json_keys": list(json_keys),
        "append_eod": bool(append_eod),
    }


def _remove_stale_temporaries(paths: Sequence[str], log) -> None:
    """Temporaries `{path}.tmp-*` of an interrupted run; never finished files, nor the
    temporaries of a writer still running here (one that bypassed the lock)."""
    stale = [p for path in paths for p in glob.glob(glob.escape(path) + ".tmp-*")
             if not staging_owner_alive(p)]
    for p in sorted(set(stale)):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    if stale:
        log(f"removed {len(set(stale))} temporary files of an interrupted run: {sorted(set(stale))[:4]}")


def _finished(marker: str, fingerprint: dict, prefixes: Sequence[str]) -> Tuple[Optional[dict], str]:
    """(stats dict of a finished shard, "") or (None, why it must be (re)done)."""
    if not os.path.isfile(marker):
        return None, "no finished output"
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError) as err:
        return None, f"unreadable marker {marker} ({err})"
    if info.get("fingerprint") != fingerprint:
        return None, f"{marker} was written for other inputs, tokenizer or flags"
    try:
        for p in prefixes:
            validate_indexed_dataset(p)
    except DatasetFormatError as err:
        return None, f"finished marker present but the dataset is invalid ({err})"
    return info.get("stats"), ""


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    chunksize: int = 256,
    log: Optional[Callable[[str], None]] = None,
    tokenizer_options: Optional[dict] = None,
    num_shards: Optional[int] = None,
    shard_index: Optional[int] = None,
    overwrite: bool = False,
    chunk_bytes: int = 1 << 18,
    parquet_batch_rows: int = 1024,
    progress: Optional[bool] = None,
    log_interval: float = 30.0,
) -> PreprocessStats:
    """Tokenize `inputs` into `{output_prefix}_{key}_document.bin/.idx` for each key (with
    `num_shards`: the shard's `{output_prefix}_shard{i:05d}of{n:05d}_{key}_document`).

    `workers > 1` tokenizes in that many processes; the output is identical for any count.
    `log` receives progress and rejection lines (default: stderr). `progress`: force the TTY
    status line on/off (default: on when stderr is a TTY, else log lines every
    `log_interval` s). Rejections go to `{prefix}_rejected.tsv` when there are any.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    json_keys = list(json_keys)
    if not json_keys:
        raise InputError("--json-keys: at least one key is required")
    if len(set(json_keys)) != len(json_keys):
        raise InputError(f"--json-keys: duplicate keys in {json_keys}")
    if workers < 1:
        raise InputError(f"--workers {workers}: expected >= 1")
    all_files = expand_inputs(inputs)
    if any(file_format(f) == "text" for f in all_files) and len(json_keys) > 1:
        raise InputError("--json-keys: plain-text inputs fill a single key, got several")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, **(tokenizer_options or {}))  # fail early
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))

    sharded = num_shards is not None
    if sharded:
        shard_index = 0 if shard_index is None else shard_index
        files = shard_files(all_files, num_shards, shard_index)
        base = shard_prefix(output_prefix, shard_index, num_shards)
    else:
        files, base = all_files, output_prefix
    prefixes = {key: f"{base}_{key}_document" for key in json_keys}
    rejections_path = f"{base}_rejected.tsv"
    marker = f"{base}.done.json"
    label = f"[shard {shard_index}/{num_shards}] " if sharded else ""

    fingerprint = _fingerprint(files, tokenizer_type, tokenizer, tokenizer_options, json_keys, append_eod)
    # One writer per dataset (each shard locks its own); a finished or existing output is judged
    # only once the lock is held. A shard is redone as before; a whole run needs --overwrite.
    locks = claim_outputs(list(prefixes.values()), f"--output-prefix {output_prefix}",
                          overwrite=sharded or overwrite, other_files=[rejections_path])
    try:
        if sharded and not overwrite:
            done, why = _finished(marker, fingerprint, list(prefixes.values()))
            if done is not None:
                stats = PreprocessStats.from_json(done)
                stats.skipped = True
                log(f"{label}already finished ({marker}), skipping; --overwrite redoes it")
                return stats
            log(f"{label}{why}: processing {len(files)} files")
        check_parquet_columns(files, json_keys)
        return _write(files, prefixes, rejections_path, marker, label, sharded, fingerprint, tokenizer, dtype,
                      json_keys, append_eod, workers, chunksize, chunk_bytes, parquet_batch_rows, progress,
                      log_interval, output_prefix, base, (shard_index, num_shards), log)
    finally:
        release_all(locks)


def _write(files, prefixes, rejections_path, marker, label, sharded, fingerprint, tokenizer, dtype, json_keys,
           append_eod, workers, chunksize, chunk_bytes, parquet_batch_rows, progress, log_interval,
           output_prefix, base, shard, log) -> PreprocessStats:
    """Tokenize `files` into the locked outputs: temporaries first, published at the end."""
    shard_index, num_shards = shard
    out_dir = os.path.dirname(os.path.abspath(base))
    _remove_stale_temporaries([p + ext for p in prefixes.values() for ext in (".bin", ".idx")]
                              + [rejections_path, marker], log)

    stats = PreprocessStats(input_files=len(files), input_bytes=sum(os.path.getsize(f) for f in files),
                            shard=(shard_index, num_shards) if sharded else None)
    writers = {}
    for key in json_keys:
        stats.output_prefixes[key] = prefixes[key]
        stats.keys[key] = KeyStats()
    tag = staging_tag()
    rejections_tmp, marker_tmp = rejections_path + tag, marker + tag
    rejections_out = None
    n_rejected = 0
    seen_keys = set()
    bar = Progress(stats.input_bytes, log, tty=progress, log_interval=log_interval, label=label)
    t0 = time.time()
    init_args = (tokenizer, json_keys, append_eod, dtype.name)
    try:
        for key in json_keys:
            writers[key] = IndexedDatasetWriter(prefixes[key], dtype)
        chunks = iter_chunks(files, json_keys, max_records=chunksize, max_bytes=chunk_bytes,
                             parquet_batch_rows=parquet_batch_rows)
        for (encoded, n_records, seen), chunk in _encoded_chunks(chunks, workers, init_args, 2 * workers + 2):
            stats.read += n_records
            stats.blank_lines += chunk.blank_lines
            if len(seen_keys) < MAX_SEEN_KEYS:
                seen_keys.update(seen)
            chunk_tokens = 0
            for key in json_keys:
                tokens, lengths, rejects = encoded[key]
                if lengths.size:
                    writers[key].add_documents(tokens, lengths)
                ks = stats.keys[key]
                ks.written += int(lengths.size)
                ks.tokens += int(tokens.size)
                chunk_tokens += int(tokens.size)
                for fi, pos, reason in rejects:
                    ks.rejected[reason] += 1
                    entry = (files[fi], pos, key, reason)
                    if len(stats.rejections) < MAX_KEPT_REJECTIONS:
                        stats.rejections.append(entry)
                    if rejections_out is None:
                        rejections_out = open(rejections_tmp, "w", encoding="utf-8")
                        rejections_out.write("file\tline_or_row\tkey\treason\n")
                    rejections_out.write("\t".join(map(str, entry)) + "\n")
                    n_rejected += 1
                    if n_rejected <= MAX_PRINTED_REJECTIONS:
                        where = (f"{files[fi]} row {pos}" if file_format(files[fi]) == "parquet"
                                 else f"{files[fi]}:{pos}")
                        log(f"{label}rejected {where} [{key}]: {reason}")
            bar.update(n_records, chunk_tokens, chunk.bytes_done)
        bar.close()
        for key in json_keys:
            ks = stats.keys[key]
            assert stats.read == ks.written + sum(ks.rejected.values()), key
            if stats.read and ks.rejected["missing_key"] == stats.read:
                inputs_read = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
                raise InputError(f"--json-keys {key}: none of the {stats.read} records of {inputs_read} "
                                 f"has this key (or a non-null value for it); their keys are {sorted(seen_keys)}")
        # Everything is written in full before anything is renamed into place (a full disk
        # fails here, publishing nothing). Then: rejections report, datasets (.bin then .idx
        # each) with their sidecars, marker last.
        if rejections_out is not None:
            rejections_out.close()
        for w in writers.values():
            w.prepare()
        metadata = tokenizer_metadata(tokenizer)
        if sharded and os.path.exists(marker):
            os.remove(marker)  # the outputs are about to be replaced
        if rejections_out is not None:
            os.replace(rejections_tmp, rejections_path)
            stats.rejections_file = rejections_path
        elif os.path.exists(rejections_path):
            os.remove(rejections_path)  # stale report from an earlier run of the same prefix
        for w in writers.values():
            w.publish(metadata)
        stats.seconds = time.time() - t0
        if sharded:
            with open(marker_tmp, "w") as f:
                json.dump({"fingerprint": fingerprint, "stats": stats.to_json()}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(marker_tmp, marker)
    except BaseException as err:
        for w in writers.values():
            w.abort()
        if rejections_out is not None:
            with contextlib.suppress(OSError):  # a full disk fails the flush again
                rejections_out.close()
        for tmp in (rejections_tmp, marker_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
        if isinstance(err, OSError):  # disk full, read-only or vanished output directory
            raise InputError(f"--output-prefix {output_prefix}: cannot write {err.filename or out_dir} "
                             f"({err.strerror or err})") from None
        raise
    return stats

