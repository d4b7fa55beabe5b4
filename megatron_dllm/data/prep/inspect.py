"""Look inside a Megatron `.bin/.idx` dataset: header, sizes, length histogram, samples, and a
full verification (the logic behind `tools/inspect_dataset.py`).

`verify_dataset` = `validate_indexed_dataset` (header, pointers, lengths, document indices,
`.bin` size; first inconsistency with its byte offset) without the memo, plus a scan of every
token against the vocabulary when its size is known (first out-of-range token with its `.bin`
byte offset and document). All scans are chunked: memory stays bounded for any size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from megatron_dllm.data.indexed_dataset import (
    _CHUNK,
    HEADER_SIZE,
    DatasetFormatError,
    IndexHeader,
    bin_path,
    idx_path,
    validate_indexed_dataset,
)
from megatron_dllm.errors import InputError


@dataclass
class DatasetReport:
    prefix: str
    dtype: str
    sequences: int
    documents: int
    tokens: int
    multimodal: bool
    idx_bytes: int
    bin_bytes: int
    min_length: int = 0
    max_length: int = 0
    mean_length: float = 0.0
    histogram: List[tuple] = field(default_factory=list)  # (lo, hi, documents), lo <= len < hi
    samples: List[Dict] = field(default_factory=list)  # {"document", "tokens", "ids", "text"}
    token_range: Optional[tuple] = None

    def format(self) -> str:
        lines = [
            f"dataset   {self.prefix}",
            f"files     {self.prefix}.idx ({self.idx_bytes} bytes), {self.prefix}.bin ({self.bin_bytes} bytes)",
            f"header    dtype {self.dtype}, sequences {self.sequences}, documents {self.documents}"
            + (", with sequence modes" if self.multimodal else ""),
            f"tokens    {self.tokens}",
        ]
        if self.documents:
            lines.append(f"doc length (tokens): min {self.min_length}, mean {self.mean_length:.1f}, "
                         f"max {self.max_length}")
            peak = max(c for _, _, c in self.histogram) or 1
            for lo, hi, count in self.histogram:
                bar = "#" * max(1 if count else 0, round(40 * count / peak))
                lines.append(f"  [{lo:>9}, {hi:>9})  {count:>10}  {bar}")
        if self.token_range is not None:
            lines.append(f"token ids in [{self.token_range[0]}, {self.token_range[1]}]")
        for s in self.samples:
            lines.append(f"--- document {s['document']} ({s['tokens']} tokens; first {len(s['ids'])} shown)")
            lines.append(s["text"] if s.get("text") is not None else " ".join(map(str, s["ids"])))
        return "\n".join(lines)


def _document_lengths(prefix: str, header: IndexHeader):
    """Yield token counts per document, in chunks (sequence lengths summed per document)."""
    mm = np.memmap(idx_path(prefix), mode="r", dtype=np.uint8)
    try:
        s = header.sequence_count
        lengths = np.frombuffer(mm, np.int32, s, HEADER_SIZE)
        docs = np.frombuffer(mm, np.int64, header.document_count, HEADER_SIZE + 12 * s)
        for i in range(0, header.document_count - 1, _CHUNK):  # a document: sequences docs[d] ... docs[d+1]
            bounds = docs[i : i + _CHUNK + 1]
            c = np.concatenate([[0], np.cumsum(lengths[bounds[0] : bounds[-1]], dtype=np.int64)])
            yield np.diff(c[bounds - bounds[0]])
    finally:
        del mm


def describe_dataset(prefix: str, tokenizer=None, samples: int = 3, sample_tokens: int = 128,
                     scan_tokens: bool = False) -> DatasetReport:
    """Header, sizes, document-length histogram (power-of-two buckets) and `samples` evenly
    spaced documents (decoded with `tokenizer` if given)."""
    header = validate_indexed_dataset(prefix)
    rep = DatasetReport(prefix, np.dtype(header.dtype).name, header.sequence_count, header.num_documents,
                        header.num_tokens, header.multimodal, os.path.getsize(idx_path(prefix)),
                        os.path.getsize(bin_path(prefix)))
    if header.num_documents:
        buckets = np.zeros(65, dtype=np.int64)
        lo, hi, total = None, None, 0
        for ln in _document_lengths(prefix, header):
            if not ln.size:
                continue
            b = np.zeros(ln.size, dtype=np.int64)
            pos = ln > 0
            b[pos] = np.floor(np.log2(ln[pos])).astype(np.int64) + 1  # 0: empty; k: [2^(k-1), 2^k)
            buckets += np.bincount(b, minlength=65)[:65]
            lo = int(ln.min()) if lo is None else min(lo, int(ln.min()))
            hi = int(ln.max()) if hi is None else max(hi, int(ln.max()))
            total += int(ln.sum())
        rep.min_length, rep.max_length, rep.mean_length = lo, hi, total / header.num_documents
        nz = np.nonzero(buckets)[0]
        for k in range(int(nz[0]), int(nz[-1]) + 1):
            rep.histogram.append((0, 1, int(buckets[k])) if k == 0 else (2 ** (k - 1), 2 ** k, int(buckets[k])))
    if scan_tokens and header.num_tokens:
        rep.token_range = _token_scan(prefix, header)[:2]
    if samples and header.num_documents:
        from megatron_dllm.data.indexed_dataset import open_indexed_dataset

        ds = open_indexed_dataset(prefix)
        docs = ds.index.document_indices
        picks = sorted({round(i * (header.num_documents - 1) / max(1, samples - 1)) for i in range(samples)})
        for d in picks[:samples]:
            seqs = range(int(docs[d]), int(docs[d + 1]))
            ids = np.concatenate([ds[j] for j in seqs]) if len(seqs) else np.zeros(0, dtype=header.dtype)
            shown = ids[:sample_tokens]
            text = None
            if tokenizer is not None:
                outside = shown[(shown < 0) | (shown >= tokenizer.vocab_size)]
                if outside.size:  # the tokenizer cannot decode it: the dataset is not this tokenizer's, or corrupt
                    raise InputError(f"{prefix}: document {d} holds token id {int(outside[0])}, outside the "
                                     f"tokenizer's vocabulary of {tokenizer.vocab_size}; --verify checks every token")
                text = tokenizer.detokenize(shown.tolist())
            rep.samples.append({"document": d, "tokens": int(ids.size), "ids": shown.tolist(), "text": text})
    return rep


def _token_scan(prefix: str, header: IndexHeader, vocab_size: Optional[int] = None, own_mask: Optional[int] = None):
    """(min id, max id, index of the first id outside [0, vocab_size) or equal to `own_mask`, or None)."""
    data = np.memmap(bin_path(prefix), mode="r", dtype=header.dtype, shape=(header.num_tokens,))
    lo = hi = None
    try:
        for i in range(0, header.num_tokens, _CHUNK):
            chunk = data[i : i + _CHUNK]
            cmin, cmax = int(chunk.min()), int(chunk.max())
            lo = cmin if lo is None else min(lo, cmin)
            hi = cmax if hi is None else max(hi, cmax)
            if vocab_size is not None:
                bad = (chunk < 0) | (chunk >= vocab_size)
                if own_mask is not None:
                    bad |= chunk == own_mask
                if bad.any():
                    return lo, hi, i + int(np.argmax(bad))
    finally:
        del data
    return lo, hi, None


def verify_dataset(prefix: str, vocab_size: Optional[int] = None, own_mask: Optional[int] = None) -> IndexHeader:
    """Full check; raise DatasetFormatError naming the first inconsistency and its byte offset.
    With `vocab_size`, every id must lie below it and differ from `own_mask` (`data_id_rule`)."""
    header = validate_indexed_dataset(prefix, use_cache=False)
    if vocab_size is not None and header.num_tokens:
        _, _, bad = _token_scan(prefix, header, vocab_size, own_mask)
        if bad is not None:
            itemsize = np.dtype(header.dtype).itemsize
            value = int(np.memmap(bin_path(prefix), mode="r", dtype=header.dtype, shape=(header.num_tokens,))[bad])
            mm = np.memmap(idx_path(prefix), mode="r", dtype=np.uint8)
            pointers = np.frombuffer(mm, np.int64, header.sequence_count, HEADER_SIZE + 4 * header.sequence_count)
            seq = int(np.searchsorted(pointers, bad * itemsize, side="right")) - 1
            del pointers, mm
            raise DatasetFormatError(
                f"{bin_path(prefix)} at byte offset {bad * itemsize}: token {bad} (in sequence {seq}) "
                f"is {value}, " + ("the tokenizer's [MASK] id, which training refuses" if value == own_mask
                                   else f"outside the vocabulary [0, {vocab_size})"))
    return header
