#!/usr/bin/env python
"""Merge Megatron `.bin/.idx` datasets (e.g. the shards of tools/preprocess_data.py) into one.

    python tools/merge_datasets.py --input 'data/corpus_shard*_text_document' \\
        --output-prefix data/corpus_text_document

concatenates the inputs in order (a glob's matches sorted, so shards come in shard order) by
streaming copies; the result equals preprocessing all inputs in one run byte for byte. Shard
outputs must form one complete set of finished shards of one preprocessing run (every shard's
`.done.json` there, recording the same inputs, shard count, tokenizer, keys and --append-eod;
`--allow-incomplete` to override), made with one tokenizer
(their `.meta.json` sidecars must agree, `tokenizer_sha256` included). The datasets'
`{prefix}_rejected.tsv` reports are joined, in order, into `{output-prefix}_rejected.tsv`.

    python tools/merge_datasets.py --input 'data/corpus_shard*_text_document' --blend-file data/blend.txt

instead writes a Megatron weighted list, one `tokens prefix` pair per line, usable as
`--data-path $(cat data/blend.txt)` (weights proportional to size: the same mixture as the merge,
without copying; the datasets must share a tokenizer and their paths must hold no whitespace).
"""

import argparse
import sys

from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.data.prep.merge import check_shard_set, expand_prefixes, merge_datasets, write_blend_file


def get_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="dataset prefixes (without .bin/.idx) or globs over them, in merge order")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-prefix", help="write the merged {prefix}.bin/.idx")
    out.add_argument("--blend-file", help="write a Megatron weighted list `tokens prefix` instead of merging")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="merge a shard set with missing shards, or shards mixed with other datasets")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at --output-prefix (once the merged one is complete), or an "
                        "existing --blend-file")
    p.add_argument("--relative", action="store_true", help="--blend-file: keep prefixes as given, not absolute")
    return p.parse_args(argv)


@reports_bad_input()
def main(argv=None) -> int:
    args = get_args(argv)
    prefixes = expand_prefixes(args.input)
    if not args.allow_incomplete:
        check_shard_set(prefixes)
    if args.blend_file:
        pairs = write_blend_file(prefixes, args.blend_file, absolute=not args.relative, overwrite=args.overwrite,
                                 log=print)
        print(f"wrote {len(pairs)} weighted prefixes ({sum(w for w, _ in pairs)} tokens) to {args.blend_file}")
    else:
        stats = merge_datasets(prefixes, args.output_prefix, log=print, overwrite=args.overwrite)
        print(f"documents: {stats.documents}, sequences: {stats.sequences}, tokens: {stats.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
