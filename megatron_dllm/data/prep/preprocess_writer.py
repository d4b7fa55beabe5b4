"""Preprocessing stage 3: the tokenized chunks (`tokenize_workers`) -> one `.bin/.idx` per key, each
with its rejections report `{dataset prefix}_rejected.tsv`, counted into `PreprocessStats`.

Everything is written under temporaries first (`prepare` writes them in full, so a full disk fails
before anything is renamed); `publish` then renames the reports and the datasets into place, each
`.idx` last. `abort` drops the temporaries and leaves earlier outputs as they were.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Dict, Sequence

import numpy as np

from megatron_dllm.atomic_file import staging_tag
from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter
from megatron_dllm.data.prep.output import rejections_path
from megatron_dllm.data.prep.preprocess_stats import (
    MAX_KEPT_REJECTIONS,
    MAX_PRINTED_REJECTIONS,
    KeyStats,
    PreprocessStats,
)
from megatron_dllm.data.prep.sources import file_format
from megatron_dllm.data.prep.tokenize_workers import MAX_SEEN_KEYS
from megatron_dllm.errors import InputError


class PreprocessWriter:
    """Writes the datasets of one run (`prefixes`: key -> dataset prefix) from `files`' records."""

    def __init__(self, files: Sequence[str], prefixes: Dict[str, str], dtype: np.dtype,
                 stats: PreprocessStats, log: Callable[[str], None], label: str = "") -> None:
        self.files, self.prefixes = files, prefixes
        self.stats, self.log, self.label = stats, log, label
        for key, prefix in prefixes.items():
            stats.output_prefixes[key] = prefix
            stats.keys[key] = KeyStats()
        self._reports_tmp = {key: rejections_path(prefix) + staging_tag() for key, prefix in prefixes.items()}
        self._reports = {}  # key -> its open report, from the key's first rejection
        self._rejected = 0
        self._seen_keys = set()
        self._writers = {}
        try:
            for key, prefix in prefixes.items():
                self._writers[key] = IndexedDatasetWriter(prefix, dtype)
        except BaseException:
            self.abort()  # the writers opened so far
            raise

    def add(self, encoded: dict, records: int, seen: set, blank_lines: int) -> int:
        """Write one tokenized chunk; returns its tokens (all keys)."""
        stats = self.stats
        stats.read += records
        stats.blank_lines += blank_lines
        if len(self._seen_keys) < MAX_SEEN_KEYS:
            self._seen_keys.update(seen)
        chunk_tokens = 0
        for key, (tokens, lengths, rejects) in encoded.items():
            if lengths.size:
                self._writers[key].add_documents(tokens, lengths)
            ks = stats.keys[key]
            ks.written += int(lengths.size)
            ks.tokens += int(tokens.size)
            chunk_tokens += int(tokens.size)
            for fi, pos, reason in rejects:
                ks.rejected[reason] += 1
                self._reject((self.files[fi], pos, key, reason))
        return chunk_tokens

    def _reject(self, entry: tuple) -> None:
        """Count, keep, report (the key's `_rejected.tsv`) and, for the first few, log one rejected record."""
        stats, key = self.stats, entry[2]
        if len(stats.rejections) < MAX_KEPT_REJECTIONS:
            stats.rejections.append(entry)
        if key not in self._reports:
            self._reports[key] = open(self._reports_tmp[key], "w", encoding="utf-8")
            self._reports[key].write("file\tline_or_row\tkey\treason\n")
        self._reports[key].write("\t".join(map(str, entry)) + "\n")
        self._rejected += 1
        if self._rejected <= MAX_PRINTED_REJECTIONS:
            path, pos, _, reason = entry
            where = f"{path} row {pos}" if file_format(path) == "parquet" else f"{path}:{pos}"
            self.log(f"{self.label}rejected {where} [{key}]: {reason}")

    def check_counts(self, whole_run: bool) -> None:
        """Every record read is written or rejected, per key; a key that no record has is an error,
        and so, for a whole run (a shard may hold none), is a key with no document written: its
        empty dataset would look finished."""
        stats, files = self.stats, self.files
        inputs_read = files[0] if len(files) == 1 else f"{len(files)} files" + (f" ({files[0]}, ...)" if files else "")
        for key, ks in stats.keys.items():
            assert stats.read == ks.written + sum(ks.rejected.values()), key
            if stats.read and ks.rejected["missing_key"] == stats.read:
                raise InputError(f"--json-keys {key}: none of the {stats.read} records of {inputs_read} "
                                 f"has this key (or a non-null value for it); their keys are "
                                 f"{sorted(self._seen_keys)}")
            if whole_run and not ks.written:
                rejected = ", ".join(f"{n} {reason}" for reason, n in sorted(ks.rejected.items()) if n)
                raise InputError(f"--input {inputs_read}: no document for key {key!r} in its {stats.read} records"
                                 + (f" (rejected: {rejected})" if rejected else "") + "; nothing written")

    def prepare(self) -> None:
        """Write every temporary in full: what can run out of space fails here, publishing nothing."""
        for report in self._reports.values():
            report.close()
        for w in self._writers.values():
            w.prepare()

    def publish(self, metadata: dict) -> None:
        """Rename into place, per key: the rejections report (or remove a stale one), then the
        dataset (`.bin` then `.idx`) with `metadata` as its sidecar."""
        for key, prefix in self.prefixes.items():
            report = rejections_path(prefix)
            if key in self._reports:
                os.replace(self._reports_tmp[key], report)
                self.stats.rejections_files[key] = report
            elif os.path.exists(report):
                os.remove(report)  # stale, from an earlier run of the same dataset
            self._writers[key].publish(metadata)

    def abort(self) -> None:
        for w in self._writers.values():
            w.abort()
        for report in self._reports.values():
            with contextlib.suppress(OSError):  # a full disk fails the flush again
                report.close()
        for tmp in self._reports_tmp.values():
            if os.path.exists(tmp):
                os.remove(tmp)
