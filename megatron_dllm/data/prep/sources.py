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

A file that cannot be read to its end (a truncated or corrupt `.gz` / `.zst` stream, a Parquet
file whose footer or pages do not decode) raises ValueError naming the file and the last line
or row read, never a quiet early end: the caller then publishes nothing. A Parquet file
without a requested column is refused up front from its schema (`check_parquet_columns`).
"""

from __future__ import annotations

import collections
import glob
import gzip
import io
import os
import zlib
from dataclasses import dataclass, field
from typing import Iterator, List, Sequence, Tuple

from megatron_dllm.errors import InputError, not_a_file

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
            raise InputError(f"--input {path!r}: compressed Parquet files are not supported "
                             f"(Parquet compresses its pages itself)")
        return "parquet"
    if base.endswith(".txt"):
        return "text"
    return "jsonl"


def expand_inputs(patterns: Sequence[str], in_given_order: bool = False) -> List[str]:
    """Expand files and globs into one **sorted** list of distinct files (the order of
    documents in the output, and the basis of sharding): a file matched twice, also under
    another spelling (relative and absolute), is read once. `in_given_order`: in the patterns'
    order instead (each glob's matches sorted), a file listed twice refused. A pattern matching
    nothing is an error, not an empty corpus."""
    files = []
    for pattern in patterns:  # an existing file is itself, even where its name has glob characters
        magic = glob.has_magic(pattern) and not os.path.isfile(pattern)
        found = sorted(glob.glob(pattern, recursive=True)) if magic else [pattern]  # `**`: every depth
        matches = [m for m in found if os.path.isfile(m)]
        if not matches:
            raise InputError(f"--input {pattern!r}: " + ("no file matches" if magic else not_a_file(pattern)))
        files += [os.path.normpath(m) for m in matches]
    if not in_given_order:
        distinct = {}
        for f in sorted(files):
            distinct.setdefault(os.path.abspath(f), f)
        return list(distinct.values())
    twice = [f for f, n in collections.Counter(map(os.path.abspath, files)).items() if n > 1]
    if twice:
        raise InputError(f"--input: {twice[0]} is listed twice")
    return files


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
        raise InputError(f"--shard-index {shard_index} / --num-shards {num_shards}: expected "
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


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of concatenated zstd frames. `zstandard`'s stream_reader ends
    quietly when the file stops inside a frame (a truncated download read as a shorter corpus);
    here that raises EOFError. Corrupt data raises zstandard.ZstdError (checksums included, when
    the frames carry them, as the zstd command line writes them)."""

    def __init__(self, raw, zstandard) -> None:
        super().__init__()
        self._raw, self._dctx = raw, zstandard.ZstdDecompressor()
        self._frame = None  # the decompressor of the frame being read, None between frames
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._raw.read(1 << 17)
            if not data:
                if self._frame is not None:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            out = []
            while data:
                if self._frame is None:
                    self._frame = self._dctx.decompressobj()
                out.append(self._frame.decompress(data))
                data = b""
                if self._frame.eof:  # the next frame starts in what is left
                    data, self._frame = self._frame.unused_data, None
            self._out, self._pos = b"".join(out), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n


def _open_binary(path: str):
    """(raw file, decompressed binary stream with readline, errors it raises on bad data)."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return raw, gzip.GzipFile(fileobj=raw, mode="rb"), (EOFError, OSError, zlib.error)
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise InputError(f"--input {path!r}: reading .zst needs the `zstandard` package "
                             f"(pip install zstandard)") from None
        return raw, io.BufferedReader(_ZstdFrames(raw, zstandard), 1 << 20), (EOFError, OSError,
                                                                                 zstandard.ZstdError)
    return raw, raw, (OSError,)


def read_lines(path: str):
    """(line number, line, raw file) for each line of a plain, .gz or .zst file. A stream that
    does not decode to its end raises ValueError naming the file and the last line read."""
    raw, stream, errors = _open_binary(path)
    lineno = 0
    try:
        while True:
            try:
                line = stream.readline()
            except errors as err:
                size = os.path.getsize(path)
                raise InputError(
                    f"--input {path!r}: truncated or corrupt, reading stopped after line {lineno} "
                    f"(at byte {min(raw.tell(), size)} of the {size}-byte file): {err}") from None
            if not line:
                return
            lineno += 1
            yield lineno, line, raw
    finally:
        stream.close()
        raw.close()


def _jsonl_records(fi: int, path: str, base_bytes: int, chunk: "ChunkSink"):
    for lineno, line, raw in read_lines(path):
        if not line.strip():  # blank lines in JSONL are not records
            chunk.blank()
            continue
        yield from chunk.add((fi, lineno, "jsonl", line), len(line), lambda raw=raw: base_bytes + raw.tell())


def _text_records(fi: int, path: str, base_bytes: int, chunk: "ChunkSink"):
    block: List[bytes] = []
    start = 0
    for lineno, line, raw in read_lines(path):
        if line.strip():
            if not block:
                start = lineno
            block.append(line)
        elif block:
            data = b"".join(block).rstrip(b"\r\n")
            yield from chunk.add((fi, start, "text", data), len(data), lambda raw=raw: base_bytes + raw.tell())
            block = []
    if block:
        data = b"".join(block).rstrip(b"\r\n")
        yield from chunk.add((fi, start, "text", data), len(data), lambda: base_bytes + os.path.getsize(path))


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())  # pyarrow's messages span lines; an error is one line


def _open_parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"--input {path!r}: reading Parquet needs the `pyarrow` package "
                         f"(pip install pyarrow)") from None
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError etc.
        raise InputError(f"--input {path!r}: not a readable Parquet file, nothing read from it "
                         f"({os.path.getsize(path)} bytes; {_one_line(err)})") from None


def _check_columns(path: str, pf, keys: Sequence[str]) -> None:
    names = pf.schema_arrow.names
    missing = [k for k in keys if k not in names]
    if missing:
        raise InputError(f"--json-keys {' '.join(missing)}: {path} has no column {missing[0]!r}; "
                         f"its columns are {names}")


def check_parquet_columns(files: Sequence[str], keys: Sequence[str]) -> None:
    """Every Parquet input must have every requested column (its schema says so without
    reading any data): ValueError names the file, the key and the columns there are."""
    for path in files:
        if file_format(path) == "parquet":
            pf = _open_parquet(path)
            try:
                _check_columns(path, pf, keys)
            finally:
                pf.close()


def _cells(column) -> list:
    """A column's Python values, text as bytes: pyarrow does not check UTF-8 when it reads, so
    the tokenizer workers decode it and reject invalid UTF-8 per row, as for JSONL."""
    import pyarrow as pa

    if pa.types.is_string(column.type):
        column = column.cast(pa.binary())
    elif pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    return column.to_pylist()


def _parquet_records(fi: int, path: str, base_bytes: int, keys: Sequence[str], batch_rows: int,
                     chunk: "ChunkSink"):
    pf = _open_parquet(path)
    size = os.path.getsize(path)
    total_rows = max(1, pf.metadata.num_rows)
    row = 0

    def progress():
        return base_bytes + (size * row) // total_rows

    try:
        _check_columns(path, pf, keys)
        batches = pf.iter_batches(batch_size=batch_rows, columns=list(keys))
        while True:
            try:
                batch = next(batches, None)
                if batch is None:
                    return
                values = {k: _cells(batch.column(k)) for k in keys}
            except Exception as err:  # a page that does not decode (OSError, ArrowInvalid, ...)
                raise InputError(f"--input {path!r}: corrupt Parquet data, reading stopped after row "
                                 f"{row} of {pf.metadata.num_rows} ({_one_line(err)})") from None
            for r in range(batch.num_rows):
                row += 1
                cell = {k: values[k][r] for k in keys}
                nbytes = sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in cell.values())
                yield from chunk.add((fi, row, "parquet", cell), nbytes, progress)
    finally:
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
