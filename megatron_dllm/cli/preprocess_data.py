#!/usr/bin/env python
"""Tokenize JSONL (plain, .gz, .zst), Parquet or plain text into Megatron `.bin/.idx`
(Megatron-LM's flags).

    python tools/preprocess_data.py --input 'corpus/*.jsonl.zst' --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx`. `--json-keys` names the JSON fields (Parquet
columns); plain-text inputs (`.txt`) hold one document per paragraph block. The input files
are the expanded globs, sorted by path. Rejected records (invalid UTF-8 or JSON, missing
field, non-text, empty text, text that spells the tokenizer's own mask piece) are counted by
reason and listed with file and line (Parquet: row) in the dataset's report,
`{prefix}_{key}_document_rejected.tsv`.

Many machines: `--num-shards N --shard-index I` (defaults: SLURM_ARRAY_TASK_COUNT and
SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN in a Slurm array job) processes a contiguous,
byte-balanced run of the sorted file list into
`{prefix}_shard{I:05d}of{N:05d}_{key}_document.bin/.idx`; re-running skips finished shards
and redoes interrupted ones. Then `tools/merge_datasets.py` joins them. See
megatron_dllm/data/prep/preprocess.py and examples/preprocess_slurm_array.sbatch.

A truncated or corrupt input, a key no record has, a read-only or full output disk: one
`error: ...` line naming the file, exit code 2, and no output of this run published (earlier
outputs of the prefix are left as they were).
"""

import argparse
import os
import sys

from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.config.fields import positive_int
from megatron_dllm.data.prep.preprocess import preprocess


def _slurm_default(name: str):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def get_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True,
                   help="JSONL (.jsonl[.gz|.zst]), Parquet (.parquet) or .txt files; globs allowed")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON keys / Parquet columns to extract (default: text)")
    TokenizerConfig.add_arguments(p)
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD (EOS) id")
    g = p.add_argument_group("sharding (many machines)")
    g.add_argument("--num-shards", type=int, default=None,
                   help="split the sorted inputs into this many shards (default: $SLURM_ARRAY_TASK_COUNT)")
    g.add_argument("--shard-index", type=int, default=None,
                   help="the shard to process (default: $SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset at --output-prefix (once the new one is complete); "
                        "with shards: redo a shard that is finished (a shard finished with other inputs, "
                        "tokenizer or flags is refused without it)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (1: tokenize in this process)")
    g.add_argument("--chunksize", type=positive_int, default=256, help="max records per worker task")
    g.add_argument("--chunk-bytes", type=positive_int, default=1 << 18, help="max text bytes per worker task")
    g.add_argument("--log-interval", type=float, default=30.0,
                   help="seconds between progress log lines when stderr is not a TTY")
    g.add_argument("--no-progress", action="store_true", help="no TTY status line (log lines instead)")
    args = p.parse_args(argv)
    if not (args.tokenizer_type and args.tokenizer_model):
        p.error("--tokenizer-type and --tokenizer-model are required")
    if args.num_shards is None:
        args.num_shards = _slurm_default("SLURM_ARRAY_TASK_COUNT")
    if args.num_shards is not None and args.shard_index is None:
        task = _slurm_default("SLURM_ARRAY_TASK_ID")
        args.shard_index = None if task is None else task - (_slurm_default("SLURM_ARRAY_TASK_MIN") or 0)
    if args.shard_index is not None and args.num_shards is None:
        p.error("--shard-index needs --num-shards")
    if args.num_shards is not None and args.shard_index is None:
        p.error("--num-shards needs --shard-index (or run inside a Slurm array job)")
    return args


@reports_bad_input()
def main(argv=None) -> int:
    args = get_args(argv)
    stats = preprocess(  # bad input, an unwritable output, Ctrl-C: one line, nothing published
        args.input, args.output_prefix, args.tokenizer_type, args.tokenizer_model,
        json_keys=args.json_keys, append_eod=args.append_eod, workers=args.workers,
        chunksize=args.chunksize, chunk_bytes=args.chunk_bytes,
        tokenizer_options=TokenizerConfig.from_args(args).options(),
        num_shards=args.num_shards, shard_index=args.shard_index, overwrite=args.overwrite,
        progress=False if args.no_progress else None, log_interval=args.log_interval,
    )
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
