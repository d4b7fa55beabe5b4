#!/usr/bin/env python
"""Tokenize prompt/response examples into the SFT format: fixed-length Megatron `.bin/.idx` rows
plus a prompt mask (see megatron_dllm/data/prep/sft_preprocess.py).

    python tools/preprocess_sft_data.py --input train.jsonl --output-prefix data/gsm8k_sft \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --seq-length 256 [--packing]

Inputs: JSONL with `prompt`/`response` (or `--prompt-key/--response-key`), JSONL with chat
`messages`, or Deng et al.'s `question||reasoning #### answer` lines (`.txt`). Writes
`{prefix}.bin/.idx`, `{prefix}_prompt_mask.bin/.idx` and `{prefix}.meta.json`; examples longer
than `--seq-length` are dropped and counted. A malformed record: one `error:` line naming the file
and line, exit code 2, nothing published.
"""
import argparse
import sys

from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.config.fields import positive_int


def get_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help=".jsonl[.gz|.zst] or Deng et al. .txt files, or globs over them (rows follow this order)")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}.bin/.idx and {prefix}_prompt_mask.bin/.idx")
    p.add_argument("--seq-length", type=positive_int, required=True, help="row length (the SFT context)")
    p.add_argument("--packing", action="store_true",
                   help="pack several whole examples per row (default: one example per row, EOS-padded)")
    p.add_argument("--prompt-key", default="prompt", help="JSON field of the prompt")
    p.add_argument("--response-key", default="response", help="JSON field of the response")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at --output-prefix (once the new one is complete)")
    TokenizerConfig.add_arguments(p)
    args = p.parse_args(argv)
    if not (args.tokenizer_type and args.tokenizer_model):
        p.error("--tokenizer-type and --tokenizer-model are required")
    return args


@reports_bad_input()
def main(argv=None) -> int:
    args = get_args(argv)
    from megatron_dllm.data.prep.sft_preprocess import preprocess_sft

    tokenizer = TokenizerConfig.from_args(args).build()
    stats = preprocess_sft(args.input, args.output_prefix, tokenizer, args.seq_length, args.packing,
                           args.prompt_key, args.response_key, args.overwrite)
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
