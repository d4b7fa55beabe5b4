#!/usr/bin/env python
"""Tokenize JSONL or plain text into Megatron `.bin/.idx` (Megatron-LM's flags).

    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx`. Plain-text inputs (`.txt`) hold one document per
paragraph block (non-blank lines separated by blank lines). Rejected records are listed with
file and line; see megatron_dllm/data/preprocess.py.
"""

import argparse
import os
import sys

try:
    import megatron_dllm  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dllm.data.preprocess import preprocess  # noqa: E402


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="JSONL or .txt file(s); globs allowed")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to extract (default: text)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True,
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"])
    g.add_argument("--tokenizer-model", required=True, help=".model file or tokenizer.json (or its directory)")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD (EOS) id")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--chunksize", type=int, default=64, help="records per worker task (>= 32)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        stats = preprocess(
            args.input, args.output_prefix, args.tokenizer_type, args.tokenizer_model,
            json_keys=args.json_keys, append_eod=args.append_eod, workers=args.workers,
            chunksize=args.chunksize,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
