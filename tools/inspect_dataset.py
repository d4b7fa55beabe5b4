#!/usr/bin/env python
"""Inspect a Megatron `.bin/.idx` dataset: header, dtype, documents, tokens, document-length
histogram, and sample documents (decoded when a tokenizer is given).

    python tools/inspect_dataset.py data/corpus_text_document \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --samples 3
    python tools/inspect_dataset.py data/corpus_text_document --verify [--tokenizer-... | --vocab-size V]

`--verify` checks the header, pointers, lengths, document indices and `.bin` size, and every
token id against the vocabulary when the tokenizer or `--vocab-size` is known; it reports the
first inconsistency with its file and byte offset and exits with status 1.
"""

import argparse
import json
import os
import sys

try:
    import megatron_dllm  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dllm.data.indexed_dataset import DatasetFormatError  # noqa: E402
from megatron_dllm.data.inspect import describe_dataset, verify_dataset  # noqa: E402
from megatron_dllm.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", help="dataset prefix (without .bin/.idx)")
    p.add_argument("--tokenizer-type", choices=list(TOKENIZER_TYPES))
    p.add_argument("--tokenizer-model")
    p.add_argument("--tiktoken-pattern", default=None)
    p.add_argument("--tiktoken-special-tokens", nargs="+", default=None)
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="for --verify without a tokenizer")
    p.add_argument("--samples", type=int, default=3, help="evenly spaced documents to show (0: none)")
    p.add_argument("--sample-tokens", type=int, default=128, help="tokens shown per sample document")
    p.add_argument("--verify", action="store_true", help="full consistency check (exit 1 on the first error)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if bool(args.tokenizer_type) != bool(args.tokenizer_model):
        p.error("--tokenizer-type and --tokenizer-model go together")
    return args


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        tok = None
        if args.tokenizer_type:
            opts = {}
            if args.tokenizer_type == "TikTokenizer":
                opts = dict(pattern=args.tiktoken_pattern, special_tokens=args.tiktoken_special_tokens,
                            num_special_tokens=args.tiktoken_num_special_tokens)
            tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model, **opts)
        if args.verify:
            vocab = args.vocab_size if args.vocab_size is not None else (tok.vocab_size if tok else None)
            verify_dataset(args.prefix, vocab)
        report = describe_dataset(args.prefix, tok, args.samples, args.sample_tokens, scan_tokens=args.verify)
    except DatasetFormatError as err:
        print(f"INVALID: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.__dict__, indent=1, default=str))
    else:
        print(report.format())
        if args.verify:
            print("verify: OK (header, pointers, lengths, document indices, .bin size"
                  + (", token ids < vocabulary)" if (args.vocab_size or tok) else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
