"""Streaming readers for preprocessing inputs: JSONL (plain, `.gz`, `.zst`), Parquet, plain text.

Nothing here decodes or parses text: records leave as raw bytes (JSONL lines, text blocks) or
as Parquet cell values, and the tokenizer workers decode them strictly, so invalid UTF-8 and
invalid JSON are *rejected with their line*, never replaced or dropped here.

Formats, by file name (a `.gz` or `.zst` suffix is decompressed on the fly):
  * `*.parquet` (or `*.pq`): every `--json-keys` key is a column; rows are read in batches of
    `parquet_batch_rows` from one row group at a time (`ParquetFile.iter_batches`), so memory
    is bounded by one row group, never the file. A row's position is its 1-based row number.
  * `*.txt`: one document per paragraph block (non-blank lines separated by blank lines).
  * anything else: JSONL, one JSON object per line; blank lines are not records (counted).

Records are grouped into chunks of at most `max_records` records / `max_bytes` bytes; each
chunk carries how many input bytes (compressed, as on disk) were consumed when it closed, for
progress and ETA.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Sequence, Tuple

COMPRESSIONS = (".gz", ".zst")


def base_name(path: str) -> str:
    """The file name without a compression suffix."""
    for ext in COMPRESSIONS:
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def file_format(path: str) -> str:
    """'parquet', 'text' or 'jsonl'."""
    base = base_name(path)
    if base.endswith(".parquet") or base.endswith(".pq"):
        if base != path:
            raise ValueError(f"--input {path!r}: compressed Parquet files are not supported "
                             f"(Parquet compresses its pages itself)")
        return "parquet"
    if base.endswith(".txt"):
        return "text"
    return "jsonl"


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Expand files and globs into one **sorted** list of distinct paths (the order of
    documents in the output, and the basis of sharding). A pattern matching nothing is an
    error, not an empty corpus."""
    files = set()
    for pattern in patterns:
        matches = glob.glob(pattern) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise ValueError(f"--input {pattern!r}: no such file")
        files.update(os.path.normpath(m) for m in matches)
    return sorted(files)


def shard_files(files: Sequence[str], num_shards: int, shard_index: int) -> List[str]:
    """The files of one shard: a contiguous run of the sorted list, balanced by bytes.

    File j, whose bytes occupy [s_j, s_j + z_j) of the concatenated inputs (total T bytes),
    goes to shard floor(num_shards * (s_j + z_j / 2) / T), i.e. the shard owning its midpoint
    (by index when all files are empty). The assignment is monotone in j, so shards
    0, 1, ..., n-1 taken in order are exactly the full sorted list, and merging their outputs
    in shard order reproduces a single run byte for byte. A shard may get no files (more
    shards than files): it then writes valid empty datasets.
    """
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"--shard-index {shard_index} / --num-shards {num_shards}: expected "
                         f"0 <= shard index < number of shards")
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    out, start = [], 0
    for j, (path, size) in enumerate(zip(files, sizes)):
        if total:
            owner = min(num_shards - 1, (num_shards * (2 * start + size)) // (2 * total))
        else:
            owner = min(num_shards - 1, (num_shards * j) // len(files))
        if owner == shard_index:
            out.append(path)
        start += size
    return out


@dataclass
class Chunk:
    records: List[Tuple[int, int, str, object]] = field(default_factory=list)  # fi, pos, kind, payload
    bytes_done: int = 0  # input bytes consumed (all files so far) when the chunk closed
    blank_lines: int = 0  # JSONL blank lines skipped inside this chunk (not records)


def _open_binary(path: str):
    """(raw file, decompressed binary stream with readline/iteration)."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise ValueError(f"--input {path!r}: reading .zst needs the `zstandard` package "
                             f"(pip install zstandard)") from None
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return raw, io.BufferedReader(reader, 1 << 20)
    return raw, raw


def _jsonl_records(fi: int, path: str, base_bytes: int, chunk: "ChunkSink"):
    raw, stream = _open_binary(path)
    try:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():  # blank lines in JSONL are not records
                chunk.blank()
                continue
            yield from chunk.add((fi, lineno, "jsonl", line), len(line), lambda: base_bytes + raw.tell())
    finally:
        stream.close()
        raw.close()


def _text_records(fi: int, path: str, base_bytes: int, chunk: "ChunkSink"):
    raw, stream = _open_binary(path)
    try:
        block: List[bytes] = []
        start = 0
        for lineno, line in enumerate(stream, 1):
            if line.strip():
                if not block:
                    start = lineno
                block.append(line)
            elif block:
                data = b"".join(block).rstrip(b"\r\n")
                yield from chunk.add((fi, start, "text", data), len(data), lambda: base_bytes + raw.tell())
                block = []
        if block:
            data = b"".join(block).rstrip(b"\r\n")
            yield from chunk.add((fi, start, "text", data), len(data), lambda: base_bytes + raw.tell())
    finally:
        stream.close()
        raw.close()


def _parquet_records(fi: int, path: str, base_bytes: int, keys: Sequence[str], batch_rows: int,
                     chunk: "ChunkSink"):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--input {path!r}: reading Parquet needs the `pyarrow` package "
                         f"(pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid etc.
        raise ValueError(f"--input {path!r}: not a readable Parquet file ({err})") from None
    size = os.path.getsize(path)
    total_rows = max(1, pf.metadata.num_rows)
    columns = [k for k in keys if k in pf.schema_arrow.names]  # absent keys: rows lack them
    row = 0

    def progress():
        return base_bytes + (size * row) // total_rows

    if not columns:
        for _ in range(pf.metadata.num_rows):
            row += 1
            yield from chunk.add((fi, row, "parquet", {}), 1, progress)
        return
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
            values = {k: batch.column(k).to_pylist() for k in columns}
            for r in range(batch.num_rows):
                row += 1
                cell = {k: values[k][r] for k in columns}
                nbytes = sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in cell.values())
                yield from chunk.add((fi, row, "parquet", cell), nbytes, progress)
    finally:
        if hasattr(pf, "close"):
            pf.close()


class ChunkSink:
    """Collects records into Chunks; `add` yields a Chunk when one is full."""

    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.max_records, self.max_bytes = max(1, max_records), max(1, max_bytes)
        self.current = Chunk()
        self._bytes = 0

    def blank(self) -> None:
        self.current.blank_lines += 1

    def add(self, record, nbytes: int, bytes_done) -> Iterator[Chunk]:
        self.current.records.append(record)
        self._bytes += nbytes
        if len(self.current.records) >= self.max_records or self._bytes >= self.max_bytes:
            yield self.flush(bytes_done())

    def flush(self, bytes_done: int) -> Chunk:
        chunk, self.current, self._bytes = self.current, Chunk(), 0
        chunk.bytes_done = bytes_done
        return chunk


def iter_chunks(files: Sequence[str], keys: Sequence[str], max_records: int = 256,
                max_bytes: int = 1 << 18, parquet_batch_rows: int = 1024) -> Iterator[Chunk]:
    """Stream all records of `files` (in order) as Chunks; memory is one chunk (plus one
    Parquet row group / decompression buffer) whatever the corpus size."""
    sink = ChunkSink(max_records, max_bytes)
    base = 0
    for fi, path in enumerate(files):
        fmt = file_format(path)
        if fmt == "parquet":
            yield from _parquet_records(fi, path, base, keys, parquet_batch_rows, sink)
        elif fmt == "text":
            yield from _text_records(fi, path, base, sink)
        else:
            yield from _jsonl_records(fi, path, base, sink)
        base += os.path.getsize(path)
    last = sink.flush(base)
    if last.records or last.blank_lines:
        yield last
