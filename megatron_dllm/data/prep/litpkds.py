"""The lit-gpt/TinyLlama packed format ("LITPKDS"): validation and conversion to Megatron `.bin/.idx`.

The format, as TinyLlama's `lit_gpt/packed_dataset.py` writes and the paper's code
(`dataloader.py`) reads it, all little endian:

    header (24 bytes)  magic b"LITPKDS" (7) | version <Q = 1 | dtype code <B | chunk_size <Q
    body               chunks of `chunk_size` token ids (TinyLlama's builder writes one per file)

The dtype codes are Megatron's except that 6 is float32 and 7 float64 (Megatron swaps them).
The builder packs documents back to back across chunk and file boundaries, each ending with
EOS (the tokenizer's default `eos=True`), and pads an unfilled last chunk with its `sep_token`
(TinyLlama's scripts: BOS) — when it writes that chunk at all (TinyLlama's SlimPajama script
drops it). Nothing in a file says where padding starts, so padding is stripped only when
`pad_id` is given: the run of `pad_id` at the end of each file (one EOS kept when
`pad_id == eos_id`, since it ends the last document), counted in the summary. Without it, a file
ending in a long run of one id is reported as possible padding and converted as it is.

Conversion (`convert_litpkds`): every file's tokens, in order, split after each EOS into one
document each (EOS included, as Megatron's `--append-eod` leaves it); the tokens after a
file's last EOS — a document that continues in the next file, or the last one of the corpus —
become one more document, counted as partial. Files are read in blocks (memory does not grow
with the corpus). After each file the output temporaries are synced and a state file
`{output_prefix}.convert-state.json` records how far they hold; a run that is killed or fails
resumes at the first unfinished file and writes the same bytes as an uninterrupted run. The
sync is what costs (an fsync per 4 MB file made the conversion up to 2.2x slower), so it happens after
the first file finished `sync_interval` seconds after the last sync (0: after every file), and
after the last file; a killed run redoes at most that much work. The finished `.bin/.idx` are
renamed into place (`.idx` last) only at the end.

Directories are searched for `*.bin` recursively and read in natural order (numbers by value),
which is the order of both of the paper's layouts: phase 1 `train/{0..255}_*.bin`, phase 2
`train/shard_{k}/*.bin` (and likewise `validation/`). Each split is its own dataset: a corpus
root holding `train/` and `validation/` is refused with that advice.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from megatron_dllm.atomic_file import atomic_write, staging_tag
from megatron_dllm.data.binary_header import read_binary_header
from megatron_dllm.data.indexed_dataset import optimal_dtype, validate_indexed_dataset
from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter
from megatron_dllm.data.prep.output import claim_outputs, release_all, staging_owner_alive
from megatron_dllm.errors import InputError

MAGIC = b"LITPKDS"
VERSION = 1
HEADER_SIZE = 24  # magic 7 + version 8 + dtype 1 + chunk_size 8
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float32, 7: np.float64, 8: np.uint16}
SPLITS = ("train", "validation")
STATE_VERSION = 1
TEMP_TAG = ".tmp-convert"  # + the writer's staging_tag; the state file names it for a resume
PADDING_HINT_RUN = 8  # a file ending in this many copies of one id is reported as possible padding


class LitpkdsFormatError(ValueError):
    """A LITPKDS file whose header or size the readers would reject or misread."""


@dataclass(frozen=True)
class LitpkdsHeader:
    path: str
    dtype: np.dtype
    chunk_size: int
    num_chunks: int

    @property
    def num_tokens(self) -> int:
        return self.chunk_size * self.num_chunks


def _error(path: str, offset: int, message: str) -> LitpkdsFormatError:
    return LitpkdsFormatError(f"{path} at byte offset {offset}: {message}")


def read_header(path: str) -> LitpkdsHeader:
    """Check `path`'s header and size; LitpkdsFormatError names the file, byte offset and
    what was expected."""
    head, scalar_type = read_binary_header(path, size=HEADER_SIZE, magic=MAGIC, version=VERSION,
                                           dtype_codes=DTYPE_CODES, kind="LITPKDS", fail=_error)
    dtype, size = np.dtype(scalar_type), os.path.getsize(path)
    (chunk_size,) = struct.unpack_from("<Q", head, 16)
    if chunk_size == 0:
        raise _error(path, 16, "chunk size 0, expected >= 1")
    chunk_bytes = chunk_size * dtype.itemsize
    body = size - HEADER_SIZE
    if body == 0 or body % chunk_bytes:
        whole = body // chunk_bytes
        raise _error(path, HEADER_SIZE + whole * chunk_bytes,
                     f"file is {size} bytes: {body} bytes after the header, expected a positive multiple "
                     f"of the chunk ({chunk_size} x {dtype.name} = {chunk_bytes} bytes); "
                     f"{whole} whole chunks, then {body - whole * chunk_bytes} bytes")
    return LitpkdsHeader(path, dtype, chunk_size, body // chunk_bytes)


def validate_files(paths: Sequence[str]) -> Tuple[List[LitpkdsHeader], List[str]]:
    """(headers of the valid files, one message per invalid file). A file whose dtype or chunk
    size differs from the first valid file's is invalid too: the readers take both from the
    first file they open."""
    headers, errors = [], []
    for path in paths:
        try:
            h = read_header(path)
        except LitpkdsFormatError as err:
            errors.append(str(err))
            continue
        except OSError as err:
            errors.append(f"{path}: cannot read ({err.strerror or err})")
            continue
        if headers and (h.dtype, h.chunk_size) != (headers[0].dtype, headers[0].chunk_size):
            first = headers[0]
            offset = 15 if h.dtype != first.dtype else 16
            errors.append(str(_error(path, offset, f"{h.dtype.name} chunks of {h.chunk_size} tokens, expected "
                                                   f"those of {first.path} ({first.dtype.name}, {first.chunk_size})")))
            continue
        headers.append(h)
    return headers, errors


# --------------------------------------------------------------------------- inputs


def natural_key(path: str):
    """Numbers compare by value: `2_a.bin` < `10_a.bin`, `shard_2/` < `shard_10/`."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", path)]


def expand_inputs(inputs: Sequence[str]) -> List[str]:
    """Files, globs and directories (searched recursively for `*.bin`), each in natural order,
    in the order given. ValueError for what matches nothing, a corpus root, or a file twice."""
    files: List[str] = []
    for item in inputs:
        if os.path.isdir(item):
            roots = [s for s in SPLITS if os.path.isdir(os.path.join(item, s))]
            if roots:
                raise InputError(f"INPUT {item} is a corpus root holding {'/, '.join(roots)}/; convert each split "
                                 f"into its own dataset, e.g. INPUT {os.path.join(item, roots[0])}")
            found = glob.glob(os.path.join(glob.escape(item), "**", "*.bin"), recursive=True)
            if not found:
                raise InputError(f"INPUT {item}: directory holds no .bin file")
        elif glob.has_magic(item):
            found = [p for p in glob.glob(item, recursive=True) if os.path.isfile(p)]
            if not found:
                raise InputError(f"INPUT {item!r}: matches no file")
        elif os.path.isfile(item):
            found = [item]
        else:
            raise InputError(f"INPUT {item}: no such file or directory")
        files.extend(sorted(found, key=natural_key))
    seen = set()
    for f in files:
        if os.path.abspath(f) in seen:
            raise InputError(f"INPUT: {f} is listed twice")
        seen.add(os.path.abspath(f))
    return files


def describe_layout(files: Sequence[str]) -> str:
    """The paper's corpus layout the files follow, for the log."""
    if files and all(re.fullmatch(r"shard_\d+", os.path.basename(os.path.dirname(f))) for f in files):
        return f"phase 2 (shard_{{k}}/*.bin, {len({os.path.dirname(f) for f in files})} shards)"
    if files and all(re.match(r"\d+_", os.path.basename(f)) for f in files):
        return "phase 1 ({bucket}_*.bin)"
    return "files in natural order"


def output_dtype(input_dtype: np.dtype, vocab_size: Optional[int]) -> np.dtype:
    """Megatron's rule (uint16 when the vocabulary fits, else int32); without a vocabulary, the
    input's width says it: lit-gpt's builder applies the same rule when it picks the dtype."""
    if vocab_size is not None:
        return np.dtype(optimal_dtype(vocab_size))
    return np.dtype(np.uint16 if input_dtype in (np.dtype(np.uint8), np.dtype(np.uint16)) else np.int32)


# --------------------------------------------------------------------------- conversion


@dataclass
class ConvertStats:
    output_prefix: str = ""
    layout: str = ""
    dtype: str = ""
    files: int = 0
    files_resumed: int = 0  # finished by an earlier, interrupted run and not read again
    chunks: int = 0
    tokens_read: int = 0
    tokens_written: int = 0
    documents: int = 0
    partial_documents: int = 0  # files' trailing tokens after their last EOS
    padding_tokens: int = 0
    padded_files: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.tokens_read / self.seconds if self.seconds > 0 else float("nan")
        resumed = f" ({self.files_resumed} finished by an earlier run)" if self.files_resumed else ""
        return (f"files: {self.files}{resumed}, {self.layout}; chunks: {self.chunks}; tokens read: "
                f"{self.tokens_read}, written: {self.tokens_written} ({self.dtype}); documents: {self.documents}, "
                f"of which partial (after a file's last EOS): {self.partial_documents}; padding tokens stripped: "
                f"{self.padding_tokens} in {self.padded_files} files; {self.seconds:.1f} s, {rate:.0f} tokens/s "
                f"-> {self.output_prefix}.bin/.idx")


# What `ConvertStats` counts per file; kept in the state file for a resumed run.
COUNTED = ("chunks", "tokens_read", "tokens_written", "documents", "partial_documents", "padding_tokens",
           "padded_files")


def _padding_run(path: str, header: LitpkdsHeader, token: int, limit: int, block: int) -> int:
    """How many copies of `token` end the file (at most `limit`), reading backwards in blocks
    that grow from 4096 tokens to `block`."""
    itemsize, n = header.dtype.itemsize, header.num_tokens
    run, step = 0, 4096
    with open(path, "rb") as f:
        while run < min(n, limit):
            count = min(step, n - run, limit - run)
            f.seek(HEADER_SIZE + (n - run - count) * itemsize)
            tail = np.fromfile(f, dtype=header.dtype, count=count)
            other = np.flatnonzero(tail != token)
            if other.size:
                return run + count - 1 - int(other[-1])
            run += count
            step = min(2 * step, block)
    return run


IdRule = Tuple[int, Optional[int]]  # tokenizers.data_id_rule: ids below the first, never the second


def _check_ids(path: str, arr: np.ndarray, start: int, itemsize: int, id_rule: Optional[IdRule],
               out_dtype: np.dtype) -> None:
    """Ids outside the tokenizer's `data_id_rule` (its vocabulary, never its [MASK]) or, without a
    tokenizer, beyond what the output dtype holds, are refused with the byte offset of the first."""
    if id_rule is not None:
        (limit, own_mask), what = id_rule, "the tokenizer's vocabulary, never its [MASK]"
    else:
        limit, own_mask, what = int(np.iinfo(out_dtype).max) + 1, None, f"what the {out_dtype.name} output holds"
    bad = (arr < 0) | (arr >= limit)
    if own_mask is not None:
        bad |= arr == own_mask
    if not bad.any():
        return
    first = int(np.flatnonzero(bad)[0])
    expected = f"0 <= id < {limit}" + (f", id != {own_mask}" if own_mask is not None else "")
    raise InputError(f"{path} at byte offset {HEADER_SIZE + (start + first) * itemsize}: token id "
                     f"{int(arr[first])}, expected {expected} ({what})")


def _convert_file(header: LitpkdsHeader, writer: IndexedDatasetWriter, eos_id: int, pad_id: Optional[int],
                  id_rule: Optional[IdRule], block: int, counters: dict, on_block: Callable[[int, int, int], None],
                  log: Callable[[str], None]) -> None:
    path, n, itemsize = header.path, header.num_tokens, header.dtype.itemsize
    if pad_id is not None:
        padding = _padding_run(path, header, pad_id, n, block)
        if pad_id == eos_id and padding:
            padding -= 1  # the first EOS of the run ends the last document
    else:
        padding, last = 0, _last_token(path, header)
        if _padding_run(path, header, last, PADDING_HINT_RUN, block) >= PADDING_HINT_RUN:
            log(f"{path}: ends in {PADDING_HINT_RUN}+ copies of id {last}, which looks like chunk padding; "
                f"converted as data (pass --pad-id to strip and count it)")
    end = n - padding
    carry = documents = 0  # carry: tokens of the document not yet ended
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        for start in range(0, end, block):
            count = min(block, end - start)
            arr = np.fromfile(f, dtype=header.dtype, count=count)
            if arr.size != count:
                raise InputError(f"{path} at byte offset {HEADER_SIZE + (start + arr.size) * itemsize}: file "
                                 f"ended early (did it change during the conversion?)")
            _check_ids(path, arr, start, itemsize, id_rule, writer.dtype)
            ends = np.flatnonzero(arr == eos_id)
            writer.write_tokens(arr)
            if ends.size:
                lengths = np.diff(ends, prepend=-1)
                lengths[0] += carry
                writer.end_documents(lengths)
                carry = count - 1 - int(ends[-1])
            else:
                carry += count
            documents += int(ends.size)
            on_block(int(ends.size), count, count * itemsize)
    if carry:
        writer.end_documents([carry])
        documents += 1
        counters["partial_documents"] += 1
    counters["chunks"] += header.num_chunks
    counters["tokens_read"] += n
    counters["tokens_written"] += end
    counters["documents"] += documents
    counters["padding_tokens"] += padding
    counters["padded_files"] += bool(padding)


def _last_token(path: str, header: LitpkdsHeader) -> int:
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE + (header.num_tokens - 1) * header.dtype.itemsize)
        return int(np.fromfile(f, dtype=header.dtype, count=1)[0])


def state_path(output_prefix: str) -> str:
    return output_prefix + ".convert-state.json"


def _write_json(path: str, obj: dict) -> None:
    with atomic_write(path, fsync=True) as f:
        json.dump(obj, f, indent=1)


def _resume_state(output_prefix: str, fingerprint: str, log) -> Optional[dict]:
    """The state of an interrupted run with the same inputs and settings, or None."""
    try:
        with open(state_path(output_prefix)) as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log(f"{state_path(output_prefix)}: unreadable ({err}); starting over")
        return None
    if staging_owner_alive(str(state.get("tag", ""))):
        log(f"{state_path(output_prefix)}: its writer is still running; starting over")
        return None
    if state.get("fingerprint") != fingerprint:
        log(f"{state_path(output_prefix)}: an interrupted run with other inputs or flags; starting over")
        return None
    return state


def _remove_temporaries(output_prefix: str) -> None:
    """An interrupted run's temporaries and the state file (of a run that cannot be resumed, or
    one finished); not those of a writer still running here (one that bypassed the lock)."""
    state = state_path(output_prefix)
    stale = [p for pattern in (glob.escape(output_prefix) + ".*" + TEMP_TAG + "*", glob.escape(state) + ".tmp-*")
             for p in glob.glob(pattern) if not staging_owner_alive(p)]
    for p in stale + [state]:
        if os.path.exists(p):
            os.remove(p)


def convert_litpkds(inputs: Sequence[str], output_prefix: str, eos_id: int, pad_id: Optional[int] = None,
                    vocab_size: Optional[int] = None, id_rule: Optional[IdRule] = None,
                    metadata: Optional[dict] = None,
                    log: Optional[Callable[[str], None]] = None, progress: Optional[bool] = None,
                    log_interval: float = 30.0, block_tokens: int = 1 << 24,
                    sync_interval: float = 10.0, overwrite: bool = False) -> ConvertStats:
    """Convert the LITPKDS files `inputs` (files, globs, directories) into `output_prefix.bin/.idx`.

    `vocab_size` (when known) picks the output dtype by Megatron's rule and bounds the ids, or
    `id_rule` does (`tokenizers.data_id_rule`: the ids below a limit, never the tokenizer's [MASK]);
    `metadata` is written as the dataset's `.meta.json` sidecar. Raises ValueError, naming the
    file and byte offset, for invalid inputs (all headers are checked before anything is read).
    """
    from megatron_dllm.data.prep.progress import Progress

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.time()
    files = expand_inputs(inputs)
    headers, errors = validate_files(files)
    if errors:
        more = f" (and {len(errors) - 1} more invalid files; --validate lists them)" if len(errors) > 1 else ""
        raise InputError(errors[0] + more)
    in_dtype = headers[0].dtype
    if in_dtype.kind == "f":
        raise InputError(f"{files[0]} at byte offset 15: {in_dtype.name} chunks, expected integer token ids")
    info = np.iinfo(in_dtype)
    for flag, value in (("--eos-id", eos_id), ("--pad-id", pad_id)):
        if value is not None and not info.min <= value <= info.max:
            raise InputError(f"{flag} {value} cannot occur in {in_dtype.name} data ({files[0]})")
    dtype = output_dtype(in_dtype, vocab_size)
    if id_rule is None and vocab_size is not None:
        id_rule = (vocab_size, None)
    out_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(f) in (out_abs + ".bin", out_abs + ".idx") for f in files):
        raise InputError(f"--output-prefix {output_prefix}: would overwrite an input")

    # One writer at a time; an existing dataset is replaced only with --overwrite. An interrupted
    # run published nothing, so its resume needs no --overwrite.
    locks = claim_outputs([output_prefix], f"--output-prefix {output_prefix}", overwrite)
    try:
        settings = {"version": STATE_VERSION,
                    "inputs": [[os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files],
                    "eos_id": eos_id, "pad_id": pad_id, "vocab_size": vocab_size, "dtype": dtype.name}
        fingerprint = hashlib.sha256(json.dumps(settings).encode()).hexdigest()  # the state file stays small
        state = _resume_state(output_prefix, fingerprint, log)
        counters = dict.fromkeys(COUNTED, 0)
        writer, done = None, 0
        tag = TEMP_TAG + staging_tag()
        if state is not None:
            try:
                writer = IndexedDatasetWriter(output_prefix, dtype, tag=state["tag"],
                                              resume_at=(state["tokens"], state["documents"]))
                tag = state["tag"]
                done, counters = state["files_done"], state["counters"]
                log(f"resuming an interrupted conversion after {done} of {len(files)} files")
            except (ValueError, OSError, KeyError) as err:
                log(f"cannot resume ({err}); starting over")
        if writer is None:
            _remove_temporaries(output_prefix)
            writer = IndexedDatasetWriter(output_prefix, dtype, tag=tag)
        stats = ConvertStats(output_prefix, describe_layout(files), dtype.name, len(files), done)
        log(f"converting {len(files)} LITPKDS files ({stats.layout}; {in_dtype.name} chunks of "
            f"{headers[0].chunk_size} tokens) -> {output_prefix}.bin/.idx ({dtype.name})")
        total_bytes = sum(os.path.getsize(f) - HEADER_SIZE for f in files)
        bar = Progress(total_bytes, log, tty=progress, log_interval=log_interval)
        bar.bytes = sum(os.path.getsize(f) - HEADER_SIZE for f in files[:done])

        def on_block(docs: int, tokens: int, nbytes: int) -> None:
            bar.update(docs, tokens, bar.bytes + nbytes)

        last_sync = time.time()
        try:
            for i in range(done, len(files)):
                _convert_file(headers[i], writer, eos_id, pad_id, id_rule, block_tokens, counters, on_block, log)
                if time.time() - last_sync >= sync_interval or i + 1 == len(files):
                    tokens, documents = writer.checkpoint()
                    _write_json(state_path(output_prefix), {"fingerprint": fingerprint, "tag": tag,
                                                            "files_done": i + 1, "tokens": tokens,
                                                            "documents": documents, "counters": counters})
                    last_sync = time.time()
            bar.close()
            writer.prepare()
            if metadata is None and os.path.exists(output_prefix + ".meta.json"):
                os.remove(output_prefix + ".meta.json")  # the replaced (--overwrite) dataset's, not this one's
            writer.publish(metadata)
        except BaseException as err:
            writer.close()  # the temporaries and the state file stay, for the next run to resume
            if isinstance(err, OSError):
                raise InputError(f"{err.filename or output_prefix}: {err.strerror or err} (converting into "
                                 f"--output-prefix {output_prefix}; a rerun resumes)") from None
            raise
        _remove_temporaries(output_prefix)  # the state file, and what killed runs left (a state write cut short)
        validate_indexed_dataset(output_prefix, use_cache=False)
        for key in COUNTED:
            setattr(stats, key, counters[key])
        stats.seconds = time.time() - t0
        return stats
    finally:
        release_all(locks)
