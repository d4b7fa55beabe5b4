"""Join Megatron `.bin/.idx` datasets (e.g. preprocessing shards) into one, or write a blend.

`merge_datasets(prefixes, out)` concatenates the datasets in the given order by streaming
copies (the `.bin` in 16 MiB blocks, the index sections in chunks): memory does not grow with
the corpus. The result is what megatron-core's `IndexedDatasetBuilder.add_index` would build
(lengths concatenated, pointers recomputed, document indices shifted, modes kept), and for our
shards it equals preprocessing all inputs in one run byte for byte. The output prefix is locked
and, without `overwrite`, must not hold a dataset yet. Outputs are written under temporary names
and renamed, `.idx` last. Datasets whose sidecars differ (another tokenizer, by
name, vocabulary or `tokenizer_sha256`) are refused. The rejections reports of the merged
datasets (preprocessing's `{prefix}_rejected.tsv`, a shard's among them) are joined in order
into `{output_prefix}_rejected.tsv`.

`write_blend_file(prefixes, path)` writes the Megatron `--data-path` form `w1 p1 w2 p2 ...`
(one pair per line; weights = token counts, so blending samples like the concatenation).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from megatron_dllm.atomic_file import staging_tag
from megatron_dllm.data.indexed_dataset import (
    _CHUNK,
    CODE_OF_DTYPE,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    bin_path,
    idx_path,
    meta_path,
    read_metadata,
    validate_indexed_dataset,
)
from megatron_dllm.data.prep import shard_marker
from megatron_dllm.data.prep.dataset_writer import write_metadata
from megatron_dllm.data.prep.output import (
    claim_outputs,
    publish_pair,
    rejections_path,
    release_all,
    remove_stale_temporaries,
)
from megatron_dllm.errors import InputError
from megatron_dllm.result_files import check_result_file, write_result_file

SHARD_RE = re.compile(r"_shard(\d{5})of(\d{5})_")


def expand_prefixes(patterns: Sequence[str]) -> List[str]:
    """Prefixes or globs over prefixes (`out/corpus_shard*_text_document`, matched against the
    `.idx` files); each glob's matches are sorted. Order of the patterns is kept."""
    out: List[str] = []
    for pattern in patterns:
        if pattern.endswith(".idx") or pattern.endswith(".bin"):
            pattern = pattern[:-4]
        if glob.has_magic(pattern) and not os.path.isfile(pattern + ".idx"):  # an existing dataset is itself
            matches = sorted(p[:-4] for p in glob.glob(pattern + ".idx", recursive=True))
            if not matches:
                raise InputError(f"--input {pattern!r}: matches no .idx file")
            out.extend(matches)
        else:
            out.append(pattern)
    if len(set(map(os.path.abspath, out))) != len(out):
        raise InputError(f"--input: a dataset is listed twice in {out}")
    return out


def check_shard_set(prefixes: Sequence[str]) -> None:
    """If the prefixes are preprocessing shards (`_shardIIIIIofNNNNN_`), they must be one
    complete set, in order; ValueError names the missing or misplaced shards."""
    found = [SHARD_RE.search(os.path.basename(p)) for p in prefixes]
    if not any(found):
        return
    if not all(found):
        raise InputError("--input mixes shard outputs with other datasets; pass --allow-incomplete to merge anyway")
    counts = {int(m.group(2)) for m in found}
    stems = {SHARD_RE.sub("_", p) for p in prefixes}
    if len(counts) != 1 or len(stems) != 1:
        raise InputError(f"--input holds shards of different runs ({sorted(stems)}, counts {sorted(counts)})")
    (n,) = counts
    indices = [int(m.group(1)) for m in found]
    missing = sorted(set(range(n)) - set(indices))
    if missing:
        raise InputError(f"--input has {len(indices)} of {n} shards; missing shard indices {missing[:20]} "
                         f"(unfinished preprocessing? pass --allow-incomplete to merge anyway)")
    if indices != sorted(indices):
        raise InputError("--input shards are out of order; list them by shard index")
    _check_shard_markers(prefixes)


def _shard_stem(prefix: str, match: re.Match) -> str:
    """`{run}_shardIIIIIofNNNNN_` of a shard's dataset prefix `{run}_shardIIIIIofNNNNN_{key}_document`."""
    return prefix[: len(prefix) - len(os.path.basename(prefix)) + match.end()]


def _check_shard_markers(prefixes: Sequence[str]) -> None:
    """Every shard finished (its `.done.json` is there) in one preprocessing run: the same inputs
    of the whole array, shard count, tokenizer, keys and --append-eod."""
    first = None
    for p in prefixes:
        marker = _shard_stem(p, SHARD_RE.search(os.path.basename(p)))[:-1] + ".done.json"
        info = shard_marker.read_marker(marker)
        if info is None:
            raise InputError(f"--input {p}: no {marker}, so its shard did not finish (rerun it); pass "
                             f"--allow-incomplete to merge anyway")
        run = info["fingerprint"].get("run", {})  # markers of older versions record no run
        if first is None:
            first = marker, run
        elif run != first[1]:
            raise InputError(f"--input shards of different preprocessing runs: {first[0]} and {marker} differ in "
                             f"{', '.join(shard_marker.differences(first[1], run))}; redo the mismatched shards "
                             f"with --overwrite, or pass --allow-incomplete to merge anyway")


def _write_rejections(prefixes: Sequence[str], tmp: str) -> int:
    """Join the datasets' rejections reports, in order, into `tmp`; returns the row count (0: no
    file written)."""
    rows, header = [], None
    for path in map(rejections_path, prefixes):
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            header = f.readline()
            rows.extend(f)
    if rows:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(header)
            f.writelines(rows)
    return len(rows)


@dataclass
class MergeStats:
    output_prefix: str
    datasets: int
    sequences: int
    documents: int
    tokens: int
    dtype: str
    rejections_file: Optional[str] = None


def _copy_section(src, offset: int, nbytes: int, dst, transform=None, itemtype=None) -> None:
    """Copy `nbytes` from `src` at `offset` to `dst` in chunks, optionally through
    `transform(np.ndarray of itemtype) -> np.ndarray`."""
    src.seek(offset)
    step = _CHUNK * 8
    left = nbytes
    while left > 0:
        raw = src.read(min(step, left))
        if not raw:
            raise OSError(f"{src.name}: unexpected end of file at byte {src.tell()}")
        left -= len(raw)
        if transform is None:
            dst.write(raw)
        else:
            dst.write(transform(np.frombuffer(raw, dtype=itemtype)).tobytes(order="C"))


def _sidecar(prefix: str, meta: Optional[dict]) -> str:
    if meta is None:
        return f"{meta_path(prefix)} does not exist"
    return f"{meta_path(prefix)} says {json.dumps(meta, sort_keys=True)}"


def merge_datasets(prefixes: Sequence[str], output_prefix: str,
                   log: Optional[Callable[[str], None]] = None, overwrite: bool = False) -> MergeStats:
    """Concatenate the datasets `prefixes` (in order) into `output_prefix.bin/.idx`; an existing
    dataset there is replaced only with `overwrite` (once the new one is complete)."""
    log = log or (lambda m: None)
    if not prefixes:
        raise InputError("--input: no dataset to merge")
    out_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out_abs for p in prefixes):
        raise InputError(f"--output-prefix {output_prefix!r} is also an input")
    locks = claim_outputs([output_prefix], f"--output-prefix {output_prefix}", overwrite,
                          other_files=[rejections_path(output_prefix)])
    try:
        remove_stale_temporaries([bin_path(output_prefix), idx_path(output_prefix), rejections_path(output_prefix)],
                                 log)
        return _merge(prefixes, output_prefix, log)
    finally:
        release_all(locks)


def _one_tokenizer(prefixes: Sequence[str]) -> Optional[dict]:
    """The datasets' sidecars, which must agree: one tokenizer and one --append-eod made them all. A
    field only some sidecars hold (written by an older version) is compared among those. Returns
    the merged dataset's sidecar: every field any of them holds (None: the datasets have none)."""
    metas = [read_metadata(p) for p in prefixes]
    first = {}  # field -> (its first holder, the value there)
    for p, m in zip(prefixes, metas):
        if (m or {}).get("sft") is not None:  # its rows' prompt masks live in files of their own
            raise InputError(f"--input {p}: an SFT dataset (tools/preprocess_sft_data.py), whose prompt masks "
                             f"are not merged; preprocess its examples together with the others' instead")
        if (m is None) != (metas[0] is None):
            raise InputError(f"--input datasets were made with different tokenizers or settings (one has no "
                             f"sidecar): {_sidecar(prefixes[0], metas[0])}; {_sidecar(p, m)}")
        for key, value in (m or {}).items():
            holder, held = first.setdefault(key, (p, value))
            if held != value:
                raise InputError(f"--input datasets were made with different tokenizers or settings ({key} "
                                 f"differ): {_sidecar(holder, read_metadata(holder))}; {_sidecar(p, m)}")
    return None if metas[0] is None else {key: value for key, (_, value) in first.items()}


def _merge(prefixes: Sequence[str], output_prefix: str, log) -> MergeStats:
    out_abs = os.path.abspath(output_prefix)
    headers = [validate_indexed_dataset(p) for p in prefixes]
    sidecar = _one_tokenizer(prefixes)
    dtypes = {np.dtype(h.dtype) for h in headers}
    if len(dtypes) != 1:
        raise InputError(f"--input datasets have different dtypes {sorted(d.name for d in dtypes)}; "
                         f"cannot concatenate token files")
    if len({h.multimodal for h in headers}) != 1:
        raise InputError("--input mixes datasets with and without sequence modes")
    dtype = dtypes.pop()
    multimodal = headers[0].multimodal
    n_seq = sum(h.sequence_count for h in headers)
    n_doc = sum(h.num_documents for h in headers)
    if not any(h.num_tokens for h in headers):  # as preprocessing: an empty dataset would look finished
        raise InputError(f"--input: the {len(prefixes)} datasets hold no tokens (every record rejected? see "
                         f"their _rejected.tsv reports); nothing written")
    tag = staging_tag()
    tmp_bin, tmp_idx = bin_path(output_prefix) + tag, idx_path(output_prefix) + tag
    rejections = rejections_path(output_prefix)
    tmp_rejections = rejections + tag
    try:
        os.makedirs(os.path.dirname(out_abs), exist_ok=True)
        with open(tmp_bin, "wb") as fb:
            for p in prefixes:
                with open(bin_path(p), "rb") as src:
                    shutil.copyfileobj(src, fb, 1 << 24)
            fb.flush()
            os.fsync(fb.fileno())
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
            f.write(struct.pack("<Q", n_seq))
            f.write(struct.pack("<Q", n_doc + 1))
            srcs = [open(idx_path(p), "rb") for p in prefixes]
            try:
                for h, src in zip(headers, srcs):  # lengths
                    _copy_section(src, HEADER_SIZE, 4 * h.sequence_count, f)
                byte_offset = 0
                for h, src in zip(headers, srcs):  # pointers, shifted by the bytes before
                    _copy_section(src, HEADER_SIZE + 4 * h.sequence_count, 8 * h.sequence_count, f,
                                  lambda a, o=byte_offset: a + np.int64(o), np.int64)
                    byte_offset += h.num_tokens * dtype.itemsize
                f.write(struct.pack("<q", 0))
                seq_offset = 0
                for h, src in zip(headers, srcs):  # document indices[1:], shifted by sequences before
                    start = HEADER_SIZE + 12 * h.sequence_count + 8
                    _copy_section(src, start, 8 * h.num_documents, f,
                                  lambda a, o=seq_offset: a + np.int64(o), np.int64)
                    seq_offset += h.sequence_count
                if multimodal:
                    for h, src in zip(headers, srcs):
                        _copy_section(src, HEADER_SIZE + 12 * h.sequence_count + 8 * h.document_count,
                                      h.sequence_count, f)
            finally:
                for src in srcs:
                    src.close()
            f.flush()
            os.fsync(f.fileno())
        n_rejected = _write_rejections(prefixes, tmp_rejections)
        if n_rejected:
            os.replace(tmp_rejections, rejections)
        elif os.path.exists(rejections):
            os.remove(rejections)  # from an earlier merge into the same prefix
        if os.path.exists(idx_path(output_prefix)):
            os.remove(idx_path(output_prefix))  # no dataset is visible while its sidecar changes
        if sidecar is not None:
            write_metadata(output_prefix, sidecar)
        elif os.path.exists(meta_path(output_prefix)):
            os.remove(meta_path(output_prefix))  # the replaced (--overwrite) dataset's, not these datasets'
        publish_pair(output_prefix, tmp_bin, tmp_idx)
    except BaseException as err:
        for p in (tmp_bin, tmp_idx, tmp_rejections):
            if os.path.exists(p):
                os.remove(p)
        if isinstance(err, OSError):  # disk full, read-only output directory
            raise InputError(f"--output-prefix {output_prefix}: cannot write "
                             f"{err.filename or os.path.dirname(out_abs)} ({err.strerror or err})") from None
        raise
    header = validate_indexed_dataset(output_prefix)
    stats = MergeStats(output_prefix, len(prefixes), header.sequence_count, header.num_documents,
                       header.num_tokens, dtype.name, rejections if n_rejected else None)
    log(f"merged {len(prefixes)} datasets: {stats.documents} documents, {stats.tokens} tokens "
        f"({dtype.name}) -> {output_prefix}.bin/.idx"
        + (f"; {n_rejected} rejected records listed in {rejections}" if n_rejected else ""))
    return stats


def write_blend_file(prefixes: Sequence[str], path: str, absolute: bool = True, overwrite: bool = False,
                     log=lambda message: None) -> List[tuple]:
    """Write `tokens prefix` lines (Megatron `--data-path` weights, proportional to size) of
    datasets made with one tokenizer; the file's whitespace-split contents are a valid
    `--data-path` value. A dataset without tokens (a shard that got no file) is left out, logged;
    an existing file is replaced only with `overwrite`. Returns the pairs."""
    check_result_file(path, "--blend-file", overwrite)
    pairs = []
    for p in prefixes:
        h = validate_indexed_dataset(p)
        if h.num_tokens == 0:  # Megatron weights must be positive
            log(f"left out of the blend: {p} (no tokens)")
            continue
        prefix = os.path.abspath(p) if absolute else p
        if len(prefix.split()) != 1:
            raise InputError(f"--input {prefix!r}: a path with whitespace cannot stand in a --data-path list")
        pairs.append((h.num_tokens, prefix))
    if not pairs:
        raise InputError(f"--input: none of the {len(prefixes)} datasets holds tokens; no --blend-file written")
    _one_tokenizer(prefixes)
    write_result_file(path, "".join(f"{w} {p}\n" for w, p in pairs))
    return pairs
