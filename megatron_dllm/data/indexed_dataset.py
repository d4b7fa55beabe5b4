"""Megatron's `.bin/.idx` indexed dataset format: writer, validator, token-id scan.

The layout is byte-for-byte that of `megatron.core.datasets.indexed_dataset` (all little endian):

    .idx  magic b"MMIDIDX\\x00\\x00" (9) | version <Q = 1 | dtype code <B | sequence_count <Q |
          document_count <Q (= documents + 1) | int32 lengths[S] | int64 byte pointers[S] |
          int64 document_indices[D] | (optional int8 modes[S], multimodal only)
    .bin  the token ids of all sequences, concatenated, no header

We write one sequence per document (Megatron's preprocess without sentence splitting).
Reading goes through megatron-core's own `IndexedDataset` (`open_indexed_dataset`), after
`validate_indexed_dataset` has turned its bare asserts into messages that name the file.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import numpy as np

from megatron_dllm.data.output import publish_pair, staging_tag
from megatron_dllm.errors import InputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # magic 9 + version 8 + dtype 1 + sequence_count 8 + document_count 8

# Megatron's DType enum (codes are part of the file format).
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

_CHUNK = 1 << 22  # elements per chunk for scans and index writes (bounded memory)
_SPILL = 1 << 20  # document lengths kept in memory by the writer before spilling to disk


class DatasetFormatError(InputError):
    """A `.bin/.idx` pair that megatron-core would misread or crash on."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 when every id fits with margin, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


# --------------------------------------------------------------------------- writer


def meta_path(prefix: str) -> str:
    return prefix + ".meta.json"


def write_metadata(prefix: str, metadata: dict) -> None:
    """Sidecar `{prefix}.meta.json` saying how the dataset was made (tokenizer, vocabulary), so
    training can name both sides of a tokenizer mismatch. Written atomically; Megatron ignores it."""
    tmp = meta_path(prefix) + staging_tag()
    with open(tmp, "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
    os.replace(tmp, meta_path(prefix))


def read_metadata(prefix: str) -> Optional[dict]:
    """The sidecar, or None for datasets made elsewhere (e.g. by Megatron-LM)."""
    try:
        with open(meta_path(prefix)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def tokenizer_metadata(tokenizer) -> dict:
    """`tokenizer_sha256` (`tokenizers.tokenizer_fingerprint`) tells two tokenizers apart even when
    their vocabulary sizes agree; sidecars written before it existed lack it."""
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    return {"tokenizer": tokenizer.name, "tokenizer_model": os.path.basename(str(tokenizer.model_path)),
            "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "mask_id": tokenizer.mask_id,
            **{k: v for k, v in getattr(tokenizer, "id_options", {}).items() if k != "vocab_size"}}


# The flag of each recorded tokenizer option that changes ids (Megatron-LM's TikTokenizer JSON).
TOKENIZER_OPTION_FLAGS = {"tiktoken_pattern": "--tiktoken-pattern",
                          "tiktoken_num_special_tokens": "--tiktoken-num-special-tokens",
                          "tokenizer_special_tokens": "--tokenizer-special-tokens"}


def check_tokenizer_options(prefix: str, made_with: Optional[dict], tokenizer, flag: str) -> None:
    """ValueError naming both values when the sidecar records an id-changing option other than the
    tokenizer's; options a sidecar does not record (older datasets, other tokenizers) pass."""
    given = getattr(tokenizer, "id_options", {})
    for key, option in TOKENIZER_OPTION_FLAGS.items():
        if made_with is None or key not in made_with:
            continue
        if key not in given:
            raise InputError(f"{flag}: {meta_path(prefix)} records {option} {_shown(made_with[key])}, but this "
                             f"run's tokenizer ({getattr(tokenizer, 'name', '?')}) has no such option")
        if made_with[key] != given[key]:
            raise InputError(f"{flag}: {option} {_shown(given[key])} but {meta_path(prefix)} records "
                             f"{_shown(made_with[key])} (preprocess with, or pass, the same tokenizer flags)")


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


class IndexedDatasetWriter:
    """Streaming writer: tokens go straight to disk, only 4 bytes per document stay in memory.

    Files are written under temporary names and renamed on `finalize()`, the `.idx` last, so
    an interrupted run never leaves a pair that looks finished.

        with IndexedDatasetWriter(prefix, np.uint16) as w:
            for ids in docs:
                w.add_document(ids)
        # finalized on clean exit, temporaries removed on exception
    """

    def __init__(self, prefix: str, dtype=np.int32, tag: Optional[str] = None,
                 resume_at: Optional[Tuple[int, int]] = None) -> None:
        """`tag` names the temporaries (default `.tmp-{pid}-{random}`); `resume_at=(tokens, documents)`
        reopens the temporaries of an interrupted writer with that tag, cut back to the state
        a `checkpoint()` returned (ValueError when they hold less)."""
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise InputError(f"dtype {self.dtype} has no Megatron .idx code")
        if os.path.dirname(prefix):
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
        tag = tag or staging_tag()
        self._tmp_bin = bin_path(prefix) + tag
        self._tmp_idx = idx_path(prefix) + tag
        self._tmp_lengths = idx_path(prefix) + tag + ".lengths"
        self._lengths = array.array("i")  # int32, as in the format; spilled past _SPILL entries
        self._spilled = 0  # lengths already in self._tmp_lengths
        self._lengths_file = None
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.num_tokens = 0
        self._ended_tokens = 0  # tokens covered by the lengths recorded so far
        self._prepared = False
        self.finalized = False
        if resume_at is None:
            self._bin = open(self._tmp_bin, "wb")
        else:
            self._reopen(*resume_at)

    def _reopen(self, tokens: int, documents: int) -> None:
        sizes = {self._tmp_bin: tokens * self.dtype.itemsize, self._tmp_lengths: 4 * documents}
        for path, size in sizes.items():
            have = os.path.getsize(path) if os.path.exists(path) else -1
            if have < size:
                raise InputError(f"{path}: cannot resume, holds {max(have, 0)} bytes, expected >= {size}")
        self._bin = open(self._tmp_bin, "r+b")
        self._bin.truncate(sizes[self._tmp_bin])
        self._bin.seek(0, os.SEEK_END)
        self._lengths_file = open(self._tmp_lengths, "r+b")
        self._lengths_file.truncate(sizes[self._tmp_lengths])
        self._lengths_file.seek(0, os.SEEK_END)
        self._spilled = documents
        self.num_tokens = self._ended_tokens = tokens

    def checkpoint(self) -> Tuple[int, int]:
        """Make everything added so far durable in the temporaries; returns `(tokens, documents)`
        for `resume_at`. Every token added must belong to a finished document."""
        if self._ended_tokens != self.num_tokens:
            raise InputError(f"{self.prefix}: {self.num_tokens - self._ended_tokens} tokens belong to no document")
        self._spill()
        for f in (self._bin, self._lengths_file):
            f.flush()
            os.fsync(f.fileno())
        return self.num_tokens, self.num_documents

    @property
    def num_documents(self) -> int:
        return self._spilled + len(self._lengths)

    def _spill(self) -> None:
        """Move the buffered lengths to a temporary file: memory stays bounded for any corpus."""
        if self._lengths_file is None:
            self._lengths_file = open(self._tmp_lengths, "w+b")
        self._lengths_file.write(self._lengths.tobytes())
        self._spilled += len(self._lengths)
        self._lengths = array.array("i")

    def add_documents(self, tokens: np.ndarray, lengths: Iterable[int]) -> None:
        """Append several documents at once: `tokens` is their concatenation (already range-checked
        by the caller or checked here), `lengths` their sizes."""
        arr = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if arr.ndim != 1 or int(lengths.sum()) != arr.size or (lengths.size and lengths.min() < 0):
            raise InputError(f"{self.prefix}: lengths {lengths.sum()} do not tile {arr.size} tokens")
        self.write_tokens(arr)
        self.end_documents(lengths)

    def write_tokens(self, tokens: np.ndarray) -> None:
        """Append tokens whose document lengths `end_documents` gives later: a document may
        arrive in pieces (streaming a file whose documents cross read blocks)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise InputError(f"{self.prefix}: tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if self._info is not None and arr.size and (int(arr.min()) < self._info.min
                                                        or int(arr.max()) > self._info.max):
                raise InputError(f"{self.prefix}: token id range [{arr.min()}, {arr.max()}] does not "
                                 f"fit dtype {self.dtype}")
            arr = arr.astype(self.dtype)
        self._bin.write(np.ascontiguousarray(arr).data)  # no copy of a contiguous block
        self.num_tokens += int(arr.size)

    def end_documents(self, lengths: Iterable[int]) -> None:
        """Record the lengths of the next documents, whose tokens `write_tokens` has written."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if not lengths.size:
            return
        total = int(lengths.sum())
        if lengths.min() < 0 or self._ended_tokens + total > self.num_tokens:
            raise InputError(f"{self.prefix}: document lengths {total} exceed the "
                             f"{self.num_tokens - self._ended_tokens} tokens written for them")
        if lengths.max() > np.iinfo(np.int32).max:
            raise InputError(f"{self.prefix}: document of {lengths.max()} tokens exceeds int32 lengths")
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._ended_tokens += total
        if len(self._lengths) >= _SPILL:
            self._spill()

    def _length_chunks(self):
        """The int32 lengths in file order, in chunks of at most _CHUNK."""
        if self._lengths_file is not None:
            self._lengths_file.flush()
            self._lengths_file.seek(0)
            while True:
                raw = self._lengths_file.read(4 * _CHUNK)
                if not raw:
                    break
                yield np.frombuffer(raw, dtype=np.int32)
        buf = np.frombuffer(self._lengths, dtype=np.int32)
        for i in range(0, buf.size, _CHUNK):
            yield buf[i : i + _CHUNK]

    def add_document(self, ids: Iterable[int]) -> None:
        """Append one document as one sequence."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise InputError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
        if self._info is not None and arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._info.min or hi > self._info.max:
                raise InputError(
                    f"{self.prefix}: token id range [{lo}, {hi}] does not fit dtype {self.dtype}"
                )
        if arr.size > np.iinfo(np.int32).max:
            raise InputError(f"{self.prefix}: document of {arr.size} tokens exceeds int32 lengths")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)
        self._ended_tokens += int(arr.size)
        if len(self._lengths) >= _SPILL:
            self._spill()

    def finalize(self) -> None:
        self.prepare()
        self.publish()

    def prepare(self) -> None:
        """Write the temporaries to disk in full (.bin synced, .idx written and synced): what can
        run out of space happens here, before anything is renamed into place."""
        if self._prepared:
            return
        if self._ended_tokens != self.num_tokens:
            raise InputError(f"{self.prefix}: {self.num_tokens - self._ended_tokens} tokens belong to no document")
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        n = self.num_documents
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", n))
            f.write(struct.pack("<Q", n + 1))
            for lengths in self._length_chunks():
                f.write(lengths.tobytes(order="C"))
            start = 0  # byte pointers = exclusive cumsum of lengths * itemsize, chunked
            for lengths in self._length_chunks():
                if not lengths.size:
                    continue
                chunk = lengths.astype(np.int64) * self.dtype.itemsize
                ptr = np.cumsum(chunk) - chunk + start
                start = int(ptr[-1] + chunk[-1])
                f.write(ptr.tobytes(order="C"))
            for i in range(0, n + 1, _CHUNK):  # one sequence per document: 0, 1, ..., n
                f.write(np.arange(i, min(i + _CHUNK, n + 1), dtype=np.int64).tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        self._drop_lengths_file()
        self._prepared = True

    def publish(self, metadata: Optional[dict] = None) -> None:
        """Rename the prepared temporaries into place, the .idx last (`output.publish_pair`).
        `metadata` becomes the sidecar, written while no `.idx` is there: a dataset is never
        visible beside another dataset's sidecar."""
        if self.finalized:
            return
        self.prepare()
        if metadata is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(idx_path(self.prefix))
            write_metadata(self.prefix, metadata)
        publish_pair(self.prefix, self._tmp_bin, self._tmp_idx)
        self.finalized = True

    def abort(self) -> None:
        """Drop the temporaries (e.g. after an error); the finished files are untouched. Closing
        flushes what is buffered, which fails again on a full disk: the file closes regardless."""
        with contextlib.suppress(OSError):
            self._bin.close()
        self._drop_lengths_file()
        for p in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(p):
                os.remove(p)

    def close(self) -> None:
        """Close the temporaries and keep them, for a later writer with `resume_at`."""
        with contextlib.suppress(OSError):
            self._bin.close()
        if self._lengths_file is not None:
            with contextlib.suppress(OSError):
                self._lengths_file.close()

    def _drop_lengths_file(self) -> None:
        if self._lengths_file is not None:
            with contextlib.suppress(OSError):
                self._lengths_file.close()
            self._lengths_file = None
        if os.path.exists(self._tmp_lengths):
            os.remove(self._tmp_lengths)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif not self.finalized:
            self.abort()


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class IndexHeader:
    prefix: str
    dtype: type
    sequence_count: int
    document_count: int  # len(document_indices) = documents + 1
    num_tokens: int
    multimodal: bool

    @property
    def num_documents(self) -> int:
        return self.document_count - 1


_VALIDATED = {}  # (prefix, idx size, idx mtime, bin size, bin mtime) -> IndexHeader


def _fail(path: str, offset, message: str) -> DatasetFormatError:
    where = f" at byte offset {offset}" if offset is not None else ""
    return DatasetFormatError(f"{path}{where}: {message}")


def _pointer_mismatch(ipath, j, want, lengths, pointers, itemsize, off_lengths, off_pointers,
                      bsize) -> DatasetFormatError:
    """Pointer j disagrees with the lengths before it: blame the right field.

    A corrupted pointer j leaves pointer j+1 consistent with the lengths again; a corrupted
    length j-1 shifts every later pointer, while the stored pointers still step by the other
    lengths (pointer j+1 - pointer j = length j), so the length is the inconsistent field.
    """
    n = lengths.size
    nxt = int(pointers[j + 1]) if j + 1 < n else bsize  # the .bin end closes the last sequence
    if j > 0 and nxt - int(pointers[j]) == int(lengths[j]) * itemsize and nxt != want + int(lengths[j]) * itemsize:
        stored = int(pointers[j]) - int(pointers[j - 1])
        if stored >= 0 and stored % itemsize == 0:
            return _fail(ipath, off_lengths + 4 * (j - 1),
                         f"sequence {j - 1} has length {int(lengths[j - 1])} but the pointers around it "
                         f"span {stored // itemsize} tokens ({stored} bytes); expected equal")
    return _fail(ipath, off_pointers + 8 * j, f"sequence {j} points to byte {int(pointers[j])} of the "
                                               f".bin, expected {want}")


def validate_indexed_dataset(prefix: str, use_cache: bool = True) -> IndexHeader:
    """Check that `prefix.idx/.bin` is a complete Megatron dataset; raise DatasetFormatError.

    Checks, in file order, stopping at the first inconsistency: header (magic, version, dtype),
    `.idx` size, document indices (0 .. sequence_count, non-decreasing), lengths (>= 0),
    pointers (contiguous tiling of the `.bin`; a wrong length is told from a wrong pointer),
    `.bin` size. Every message names the file, the byte offset and what was expected. Cost is
    O(sequences) on the index (memory-mapped, chunked); the `.bin` is only stat-ed (token
    values: `megatron_dllm.data.inspect.verify_dataset`). Results are memoised by size and
    mtime unless `use_cache=False`.
    """
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    for p in (ipath, bpath):
        if not os.path.isfile(p):
            raise _fail(p, None, f"file not found (expected the {p[-4:]} half of the Megatron "
                                  f"indexed dataset with prefix {prefix!r})")
    ist, bst = os.stat(ipath), os.stat(bpath)
    memo_key = (os.path.abspath(prefix), ist.st_size, ist.st_mtime_ns, bst.st_size, bst.st_mtime_ns)
    if use_cache and memo_key in _VALIDATED:  # build paths validate the same prefix several times
        return _VALIDATED[memo_key]
    isize, bsize = ist.st_size, bst.st_size
    with open(ipath, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        raise _fail(ipath, len(head), f".idx truncated: file is {isize} bytes, expected a "
                                      f"{HEADER_SIZE}-byte header")
    if head[:9] != MAGIC:
        raise _fail(ipath, 0, f"bad magic {head[:9]!r}, expected {MAGIC!r} (not a Megatron .idx)")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != VERSION:
        raise _fail(ipath, 9, f"bad version {version}, expected {VERSION}")
    code = head[17]
    if code not in DTYPE_CODES:
        raise _fail(ipath, 17, f"unknown dtype code {code}, expected one of "
                               f"{ {c: np.dtype(t).name for c, t in DTYPE_CODES.items()} }")
    dtype = DTYPE_CODES[code]
    itemsize = np.dtype(dtype).itemsize
    seq_count, doc_count = struct.unpack_from("<QQ", head, 18)
    if doc_count < 1:
        raise _fail(ipath, 26, "document_count is 0, expected documents + 1 >= 1")

    off_lengths = HEADER_SIZE
    off_pointers = off_lengths + 4 * seq_count
    off_docs = off_pointers + 8 * seq_count
    end = off_docs + 8 * doc_count
    if isize < end:
        raise _fail(ipath, isize, f".idx truncated: header promises {seq_count} sequences and "
                                  f"{doc_count} document indices, i.e. {end} bytes, file has {isize}")
    if isize not in (end, end + seq_count):
        raise _fail(ipath, end, f"unexpected .idx size {isize}, expected {end} bytes "
                                f"(or {end + seq_count} with sequence modes)")

    mm = np.memmap(ipath, mode="r", dtype=np.uint8)
    try:
        lengths = np.frombuffer(mm, np.int32, seq_count, off_lengths)
        pointers = np.frombuffer(mm, np.int64, seq_count, off_pointers)
        docs = np.frombuffer(mm, np.int64, doc_count, off_docs)
        if docs[0] != 0 or docs[-1] != seq_count:
            raise _fail(ipath, off_docs, f"document_indices run from {docs[0]} to {docs[-1]}, "
                                         f"expected 0 to sequence_count={seq_count}")
        expected_ptr = 0  # pointers must tile the .bin contiguously (what every writer produces)
        for i in range(0, seq_count, _CHUNK):
            ln = lengths[i : i + _CHUNK]
            if ln.size and ln.min() < 0:
                j = i + int(np.argmax(ln < 0))
                raise _fail(ipath, off_lengths + 4 * j, f"sequence {j} has negative length {lengths[j]}")
            step = ln.astype(np.int64) * itemsize
            want = np.cumsum(step) - step + expected_ptr
            bad = np.nonzero(pointers[i : i + _CHUNK] != want)[0]
            if bad.size:
                j = i + int(bad[0])
                raise _pointer_mismatch(ipath, j, int(want[bad[0]]), lengths, pointers, itemsize,
                                        off_lengths, off_pointers, bsize)
            expected_ptr = int(want[-1] + step[-1])
        if np.any(np.diff(docs) < 0):
            j = int(np.argmax(np.diff(docs) < 0)) + 1
            raise _fail(ipath, off_docs + 8 * j, "document_indices decrease, expected non-decreasing")
    finally:
        del mm
    if bsize != expected_ptr:
        short = bsize < expected_ptr
        raise _fail(bpath, bsize if short else expected_ptr,
                    f".bin is {bsize} bytes but {ipath} describes {expected_ptr} bytes "
                    f"({expected_ptr // itemsize} tokens of {np.dtype(dtype).name})"
                    + (" — truncated" if short else " — the .idx and .bin do not belong together"))
    header = IndexHeader(prefix, dtype, int(seq_count), int(doc_count), expected_ptr // itemsize,
                         isize != end)
    _VALIDATED[memo_key] = header
    return header


def open_indexed_dataset(prefix: str, mmap: bool = True):
    """Validate, then open with megatron-core's reader (imported lazily: it is slow to import)."""
    header = validate_indexed_dataset(prefix)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # numpy cannot mmap an empty .bin; the file reader handles it (there is nothing to read)
    return IndexedDataset(prefix, multimodal=header.multimodal, mmap=mmap and header.num_tokens > 0)


# --------------------------------------------------------------------------- token-id scan


def token_id_range(prefix: str, cache_dir: Optional[str] = None) -> Tuple[int, int]:
    """(min, max) token id of the `.bin`, or (0, -1) when empty; chunked, bounded memory.

    The result is cached as a small JSON in `cache_dir` (if given), keyed by the `.bin`'s
    absolute path, size and mtime, so a re-written file is re-scanned.
    """
    header = validate_indexed_dataset(prefix)
    bpath = os.path.abspath(bin_path(prefix))
    st = os.stat(bpath)
    key = {"bin": bpath, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cache_file = None
    if cache_dir:
        digest = hashlib.md5(bpath.encode("utf-8")).hexdigest()[:16]
        cache_file = os.path.join(cache_dir, f"{os.path.basename(prefix)}-{digest}.token_range.json")
        try:
            with open(cache_file) as f:
                cached = json.load(f)
            if all(cached.get(k) == v for k, v in key.items()):
                return int(cached["min"]), int(cached["max"])
        except (OSError, ValueError, KeyError):
            pass
    lo, hi = 0, -1
    if header.num_tokens:
        data = np.memmap(bpath, mode="r", dtype=header.dtype, shape=(header.num_tokens,))
        lo, hi = None, None
        for i in range(0, header.num_tokens, _CHUNK):
            chunk = data[i : i + _CHUNK]
            cmin, cmax = int(chunk.min()), int(chunk.max())
            lo = cmin if lo is None else min(lo, cmin)
            hi = cmax if hi is None else max(hi, cmax)
        del data
    if cache_file:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{cache_file}.tmp-{os.getpid()}"  # concurrent ranks: each renames its own copy
        with open(tmp, "w") as f:
            json.dump({**key, "min": lo, "max": hi}, f)
        os.replace(tmp, cache_file)
    return lo, hi


def max_token_id(prefix: str, cache_dir: Optional[str] = None) -> int:
    """Largest token id in `prefix.bin` (-1 if empty). See `token_id_range`."""
    return token_id_range(prefix, cache_dir)[1]
