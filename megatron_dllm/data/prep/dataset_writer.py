"""Writing Megatron's `.bin/.idx` indexed datasets (the layout: `data/indexed_dataset.py`) and
their `.meta.json` sidecars, through temporaries published with `output.publish_pair`."""

from __future__ import annotations

import array
import contextlib
import json
import os
import struct
from typing import Iterable, Optional, Tuple

import numpy as np

from megatron_dllm.atomic_file import atomic_write, staging_tag
from megatron_dllm.data.indexed_dataset import CODE_OF_DTYPE, MAGIC, VERSION, bin_path, idx_path, meta_path
from megatron_dllm.data.prep.output import publish_pair
from megatron_dllm.errors import InputError

_CHUNK = 1 << 22  # lengths per chunk of an index write (bounded memory)
_SPILL = 1 << 20  # document lengths kept in memory before spilling to disk


def write_metadata(prefix: str, metadata: dict) -> None:
    """Sidecar `{prefix}.meta.json` saying how the dataset was made (tokenizer, vocabulary), so
    training can name both sides of a tokenizer mismatch. Written atomically; Megatron ignores it."""
    with atomic_write(meta_path(prefix)) as f:
        json.dump(metadata, f, indent=1, sort_keys=True)



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
