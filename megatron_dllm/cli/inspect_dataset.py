#!/usr/bin/env python
"""Inspect a Megatron `.bin/.idx` dataset: header, dtype, documents, tokens, document-length
histogram, and sample documents (decoded when a tokenizer is given).

    python tools/inspect_dataset.py data/corpus_text_document \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --samples 3
    python tools/inspect_dataset.py data/corpus_text_document --verify [--tokenizer-... | --vocab-size V]

`--verify` checks the header, pointers, lengths, document indices and `.bin` size, and every
token id against the vocabulary when the tokenizer or `--vocab-size` is known; it reports the
first inconsistency with its file and byte offset and exits with status 2.
"""

import argparse
import json
import sys

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import OneLineParser, fail, reports_bad_input
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.config.fields import non_negative_int, positive_int
from megatron_dllm.data.indexed_dataset import DatasetFormatError, check_made_with
from megatron_dllm.data.prep.inspect import describe_dataset, verify_dataset
from megatron_dllm.data.sft import sft_metadata, validate_sft_dataset
from megatron_dllm.data.tokenizers import data_id_rule


def get_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", help="dataset prefix (a .bin or .idx suffix is dropped)")
    TokenizerConfig.add_arguments(p, exclude=("vocab_size",))
    p.add_argument("--vocab-size", type=positive_int, default=None, help="for --verify without a tokenizer; with "
                                                                 "Megatron's JSON TikTokenizer, its --vocab-size")
    p.add_argument("--samples", type=non_negative_int, default=3, help="evenly spaced documents to show (0: none)")
    p.add_argument("--sample-tokens", type=positive_int, default=128, help="tokens shown per sample document")
    p.add_argument("--verify", action="store_true", help="full consistency check (exit 2 on the first error)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if bool(args.tokenizer_type) != bool(args.tokenizer_model):
        p.error("--tokenizer-type and --tokenizer-model go together")
    if args.prefix.endswith((".bin", ".idx")):
        args.prefix = args.prefix[:-4]
    return args


@reports_bad_input()
def main(argv=None) -> int:
    args = get_args(argv)
    try:
        tokenizer = TokenizerConfig.from_args(args)
        if tokenizer.tokenizer_type != "TikTokenizer":
            tokenizer = tokenizer.replace(vocab_size=None)  # only the verification's vocabulary
        tok = tokenizer.build() if args.tokenizer_type else None
        if tok is not None:  # decoding with another tokenizer would print other text
            check_made_with(args.prefix, tok, "--tokenizer-model")
        if args.verify:
            # with a tokenizer, training's rule: its vocabulary, never its [MASK]
            rule = data_id_rule(tok) if tok else (args.vocab_size, None) if args.vocab_size is not None else ()
            verify_dataset(args.prefix, *rule)
        report = describe_dataset(args.prefix, tok, args.samples, args.sample_tokens, scan_tokens=args.verify)
        sft = sft_metadata(args.prefix)
        if sft is not None:  # the SFT format: also check the prompt mask against the rows
            sft = validate_sft_dataset(args.prefix) if args.verify else sft
    except DatasetFormatError as err:
        return fail(f"INVALID: {err}")
    if args.json:
        print(json.dumps({**report.__dict__, "sft": sft}, indent=1, default=str))
    else:
        print(report.format())
        if sft is not None:
            print(f"sft: rows of {sft['seq_length']} tokens ({'packed' if sft['packing'] else 'EOS-padded'}), "
                  f"{sft['rows']} rows from {sft['examples']} examples ({sft['dropped_too_long']} dropped: too "
                  f"long); prompt mask {args.prefix}_prompt_mask"
                  + (" verified" if args.verify else ""))
        if args.verify:
            print("verify: OK (header, pointers, lengths, document indices, .bin size"
                  + (", token ids < vocabulary" + (", no [MASK]" if tok else "") + ")"
                     if (args.vocab_size or tok) else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
