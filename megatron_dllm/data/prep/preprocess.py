"""Text -> Megatron `.bin/.idx`, the logic behind `tools/preprocess_data.py`.

Inputs (files or globs; expanded into one sorted list, see `sources.py`): JSONL (plain,
`.gz`, `.zst`), Parquet (the `--json-keys` are columns, read in row-group batches) and plain
text (`.txt`, one document per paragraph block). Every key of `json_keys` becomes its own
dataset `{output_prefix}_{key}_document`. A value may be a string or a list of strings
(tokenized piecewise and concatenated into one document, as Megatron's document mode does).

Each document is one sequence; with `append_eod` the tokenizer's EOD (= EOS) id ends it. No
BOS is added. A record that yields no document for a key is *rejected* with a reason
(invalid_utf8, invalid_json, missing_key — absent or null —, not_text, empty_text, mask_token), counted,
and listed with its file and line (Parquet: row) in its dataset's `_rejected.tsv`, so for
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

The run is three stages: the readers (`sources.iter_chunks`) stream raw records in chunks, the
tokenizer workers (`tokenize_workers.encoded_chunks`) tokenize them, and the writer
(`preprocess_writer.PreprocessWriter`) writes and finally publishes the datasets; this module
checks the options, claims the outputs and connects the stages.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_dllm.data.indexed_dataset import optimal_dtype, tokenizer_metadata
from megatron_dllm.data.prep import shard_marker
from megatron_dllm.data.prep.output import claim_outputs, release_all, remove_stale_temporaries
from megatron_dllm.data.prep.preprocess_options import PreprocessOptions, shard_prefix
from megatron_dllm.data.prep.preprocess_stats import PreprocessStats
from megatron_dllm.data.prep.preprocess_writer import PreprocessWriter
from megatron_dllm.data.prep.progress import Progress
from megatron_dllm.data.prep.sources import check_parquet_columns, expand_inputs, file_format, iter_chunks, shard_files
from megatron_dllm.data.prep.tokenize_workers import encoded_chunks
from megatron_dllm.data.tokenizers import build_tokenizer
from megatron_dllm.errors import InputError

__all__ = ["preprocess", "run_preprocess", "PreprocessOptions", "PreprocessStats", "shard_prefix"]


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_type: str, tokenizer_model: str,
               log: Optional[Callable[[str], None]] = None, **options) -> PreprocessStats:
    """`run_preprocess(PreprocessOptions(inputs, output_prefix, tokenizer_type, tokenizer_model,
    **options), log)`: the keyword options are PreprocessOptions' fields."""
    return run_preprocess(PreprocessOptions(inputs, output_prefix, tokenizer_type, tokenizer_model, **options), log)


def run_preprocess(options: PreprocessOptions, log: Optional[Callable[[str], None]] = None) -> PreprocessStats:
    """Tokenize `options.inputs` into `{output_prefix}_{key}_document.bin/.idx` for each key (with
    `num_shards`: the shard's `{output_prefix}_shard{i:05d}of{n:05d}_{key}_document`).

    `log` receives progress and rejection lines (default: stderr). A key's rejections go to
    `{dataset prefix}_rejected.tsv` when there are any.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    all_files = expand_inputs(options.inputs)
    if any(file_format(f) == "text" for f in all_files) and len(options.json_keys) > 1:
        raise InputError("--json-keys: plain-text inputs fill a single key, got several")
    tokenizer = build_tokenizer(options.tokenizer_type, options.tokenizer_model,
                                **options.tokenizer_options)  # fail early
    files = shard_files(all_files, options.num_shards, options.shard_index) if options.sharded else all_files
    prefixes = options.dataset_prefixes
    fingerprint = shard_marker.fingerprint(all_files, files, options, tokenizer)
    # One writer per dataset (each shard locks its own); a finished or existing output is judged
    # only once the lock is held. An unfinished shard is redone; a shard finished with other
    # inputs or flags, like a whole run's existing output, needs --overwrite.
    locks = claim_outputs(list(prefixes.values()), f"--output-prefix {options.output_prefix}",
                          overwrite=options.sharded or options.overwrite,
                          other_files=list(options.rejections_paths.values()))
    try:
        if options.sharded and not options.overwrite:
            done, why = shard_marker.finished(options.marker_path, fingerprint, list(prefixes.values()))
            if done is not None:
                stats = PreprocessStats.from_json(done)
                stats.skipped = True
                log(f"{options.label}already finished ({options.marker_path}), skipping; --overwrite redoes it")
                return stats
            log(f"{options.label}{why}: processing {len(files)} files")
        check_parquet_columns(files, options.json_keys)
        return _tokenize(files, options, tokenizer, fingerprint, log)
    finally:
        release_all(locks)


def _tokenize(files: Sequence[str], options: PreprocessOptions, tokenizer, fingerprint: dict,
              log: Callable[[str], None]) -> PreprocessStats:
    """Run the three stages into the locked outputs: temporaries first, published at the end."""
    prefixes, marker = options.dataset_prefixes, options.marker_path
    remove_stale_temporaries([p + ext for p in prefixes.values() for ext in (".bin", ".idx")]
                             + list(options.rejections_paths.values()) + [marker], log)
    stats = PreprocessStats(input_files=len(files), input_bytes=sum(os.path.getsize(f) for f in files),
                            shard=(options.shard_index, options.num_shards) if options.sharded else None)
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    bar = Progress(stats.input_bytes, log, tty=options.progress, log_interval=options.log_interval,
                   label=options.label)
    t0 = time.time()
    writer = None
    try:
        writer = PreprocessWriter(files, prefixes, dtype, stats, log, options.label)
        chunks = iter_chunks(files, options.json_keys, max_records=options.chunksize, max_bytes=options.chunk_bytes,
                             parquet_batch_rows=options.parquet_batch_rows)
        for (encoded, records, seen), chunk in encoded_chunks(chunks, tokenizer, options.json_keys,
                                                              options.append_eod, dtype, options.workers):
            tokens = writer.add(encoded, records, seen, chunk.blank_lines)
            bar.update(records, tokens, chunk.bytes_done)
        bar.close()
        writer.check_counts(whole_run=not options.sharded)
        # Everything is written in full before anything is renamed into place (a full disk fails
        # here, publishing nothing). Then: each dataset with its rejections report and sidecar, marker last.
        writer.prepare()
        metadata = {**tokenizer_metadata(tokenizer), "append_eod": bool(options.append_eod)}
        if options.sharded and os.path.exists(marker):
            os.remove(marker)  # the outputs are about to be replaced
        writer.publish(metadata)
        stats.seconds = time.time() - t0
        if options.sharded:
            shard_marker.write_marker(marker, fingerprint, stats.to_json())
    except BaseException as err:
        if writer is not None:
            writer.abort()
        if isinstance(err, OSError):  # disk full, read-only or vanished output directory
            out_dir = os.path.dirname(os.path.abspath(options.base))
            raise InputError(f"--output-prefix {options.output_prefix}: cannot write {err.filename or out_dir} "
                             f"({err.strerror or err})") from None
        raise
    return stats
