"""Megatron's `.bin/.idx` indexed dataset format at run time: layout, sidecar, validator, token-id scan.

The layout is byte-for-byte that of `megatron.core.datasets.indexed_dataset` (all little endian):

    .idx  magic b"MMIDIDX\\x00\\x00" (9) | version <Q = 1 | dtype code <B | sequence_count <Q |
          document_count <Q (= documents + 1) | int32 lengths[S] | int64 byte pointers[S] |
          int64 document_indices[D] | (optional int8 modes[S], multimodal only)
    .bin  the token ids of all sequences, concatenated, no header

Our writer (`prep/dataset_writer.py`) writes one sequence per document (Megatron's preprocess
without sentence splitting).
Reading goes through megatron-core's own `IndexedDataset` (`open_indexed_dataset`), after
`validate_indexed_dataset` has turned its bare asserts into messages that name the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.data.binary_header import read_binary_header
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

_CHUNK = 1 << 22  # elements per chunk of a scan (bounded memory)


class DatasetFormatError(InputError):
    """A `.bin/.idx` pair that megatron-core would misread or crash on: bad input, named with its
    file and byte offset."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 when every id fits with margin, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def meta_path(prefix: str) -> str:
    return prefix + ".meta.json"


def read_metadata(prefix: str) -> Optional[dict]:
    """The sidecar, or None for datasets made elsewhere (e.g. by Megatron-LM)."""
    try:
        with open(meta_path(prefix)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as err:  # not JSON (or not UTF-8): a damaged sidecar
        raise InputError(f"{meta_path(prefix)}: not a JSON sidecar ({err})") from None


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


def check_made_with(prefix: str, tokenizer, flag: str) -> None:
    """InputError unless `tokenizer` is the one `prefix`'s sidecar records: its vocabulary size,
    its id-changing options and, where recorded, its sha256 (a dataset without a sidecar passes)."""
    from megatron_dllm.data.tokenizers import tokenizer_fingerprint

    made_with = read_metadata(prefix)
    if made_with is not None and made_with.get("vocab_size") != tokenizer.vocab_size:
        raise InputError(
            f"{flag}: {prefix} was preprocessed with {made_with.get('tokenizer')} "
            f"({made_with.get('tokenizer_model')}, vocab_size={made_with.get('vocab_size')} incl. [MASK]) "
            f"but --tokenizer-model gives {getattr(tokenizer, 'name', '?')} "
            f"({os.path.basename(str(getattr(tokenizer, 'model_path', '?')))}, vocab_size={tokenizer.vocab_size})")
    check_tokenizer_options(prefix, made_with, tokenizer, flag)
    recorded = (made_with or {}).get("tokenizer_sha256")  # absent in sidecars of older datasets
    if recorded is not None:
        given = tokenizer_fingerprint(tokenizer)
        if given != recorded:
            raise InputError(
                f"{flag}: {prefix} was preprocessed with another tokenizer: {meta_path(prefix)} records "
                f"{made_with.get('tokenizer_model')} with sha256 {recorded[:16]}..., but --tokenizer-model "
                f"{tokenizer.model_path} has sha256 {given[:16]}... (same vocabulary size or not, the "
                f"token ids would mean other pieces); give the tokenizer the data was made with")


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


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
    values: `megatron_dllm.data.prep.inspect.verify_dataset`). Results are memoised by size and
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
    head, dtype = read_binary_header(ipath, size=HEADER_SIZE, magic=MAGIC, version=VERSION,
                                     dtype_codes=DTYPE_CODES, kind="Megatron .idx", fail=_fail)
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
    """(min, max) token id of the `.bin`, or (0, -1) when empty. See `scan_tokens`."""
    lo, hi, _ = scan_tokens(prefix, cache_dir)
    return lo, hi


def scan_tokens(prefix: str, cache_dir: Optional[str] = None, count_id: Optional[int] = None) -> Tuple[int, int, int]:
    """(min, max, occurrences of `count_id`) over the `.bin`'s token ids, (0, -1, 0) when empty;
    chunked, bounded memory.

    The result is cached as a small JSON in `cache_dir` (if given), keyed by the `.bin`'s
    absolute path, size and mtime and by `count_id`, so a re-written file is re-scanned.
    """
    header = validate_indexed_dataset(prefix)
    bpath = os.path.abspath(bin_path(prefix))
    st = os.stat(bpath)
    key = {"bin": bpath, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "count_id": count_id}
    cache_file = None
    if cache_dir:
        digest = hashlib.md5(bpath.encode("utf-8")).hexdigest()[:16]
        cache_file = os.path.join(cache_dir, f"{os.path.basename(prefix)}-{digest}.token_range.json")
        try:
            with open(cache_file) as f:
                cached = json.load(f)
            if all(cached.get(k) == v for k, v in key.items()):
                return int(cached["min"]), int(cached["max"]), int(cached["count"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    lo, hi, count = 0, -1, 0
    if header.num_tokens:
        data = np.memmap(bpath, mode="r", dtype=header.dtype, shape=(header.num_tokens,))
        lo, hi = None, None
        for i in range(0, header.num_tokens, _CHUNK):
            chunk = data[i : i + _CHUNK]
            cmin, cmax = int(chunk.min()), int(chunk.max())
            lo = cmin if lo is None else min(lo, cmin)
            hi = cmax if hi is None else max(hi, cmax)
            if count_id is not None and cmin <= count_id <= cmax:
                count += int(np.count_nonzero(chunk == count_id))
        del data
    if cache_file:
        os.makedirs(cache_dir, exist_ok=True)
        with atomic_write(cache_file) as f:  # concurrent ranks: each renames its own copy
            json.dump({**key, "min": lo, "max": hi, "count": count}, f)
    return lo, hi, count


def max_token_id(prefix: str, cache_dir: Optional[str] = None) -> int:
    """Largest token id in `prefix.bin` (-1 if empty). See `token_id_range`."""
    return token_id_range(prefix, cache_dir)[1]
