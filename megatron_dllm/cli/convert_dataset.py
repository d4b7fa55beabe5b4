"""Convert a packed corpus of another stack into a Megatron `.bin/.idx` dataset.

    python tools/convert_dataset.py --from litpkds corpus/train --output-prefix data/corpus_train \\
        --eos-id 2

reads the lit-gpt/TinyLlama packed files ("LITPKDS", the format of the paper's corpora) given
as files, globs or directories (searched for `*.bin` in natural order: phase 1
`train/{0..255}_*.bin` and phase 2 `train/shard_{k}/*.bin` both read in bucket/shard order) and
writes `{output-prefix}.bin/.idx`: one document per EOS-terminated run, the tokens after each
file's last EOS kept as one more (partial) document. Convert `train/` and `validation/` into
separate datasets (`--train-data-path` / `--valid-data-path` of training).

The EOS id is `--eos-id`, or the EOS of the tokenizer named by `--tokenizer-type` and
`--tokenizer-model`, which also gives the vocabulary (the output dtype by Megatron's rule, a
bound on the ids, and the `.meta.json` sidecar that training checks). `--pad-id` strips the
padding of an unfilled last chunk (lit-gpt pads with its `sep_token`; TinyLlama's scripts use
BOS) and counts it. A killed run resumes after the last input file synced (`--sync-interval`),
with identical output.

    python tools/convert_dataset.py --from litpkds --validate 'corpus/train/*.bin'

checks every file's header (magic, version, dtype code, chunk size) and size (a whole number of
chunks), and that all files agree; each bad file is listed with its byte offset.
"""
import sys

from megatron_dllm.cli import OneLineParser, fail, reports_bad_input
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.errors import InputError


def get_args(argv=None):
    import argparse

    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="LITPKDS files, globs or directories")
    p.add_argument("--from", dest="source", required=True, choices=["litpkds"], help="the input format")
    p.add_argument("--output-prefix", help="writes {prefix}.bin/.idx")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at --output-prefix (once the new one is complete)")
    p.add_argument("--validate", action="store_true", help="only check the inputs' headers and sizes")
    p.add_argument("--eos-id", type=int, default=None,
                   help="the id that ends each document (default: the tokenizer's EOS)")
    p.add_argument("--pad-id", type=int, default=None,
                   help="strip and count the run of this id that ends each file (chunk padding)")
    TokenizerConfig.add_arguments(p)
    p.add_argument("--sync-interval", type=float, default=10.0,
                   help="seconds between syncs of the output for a resume (0: after every input file)")
    p.add_argument("--log-interval", type=float, default=30.0,
                   help="seconds between progress log lines when stderr is not a TTY")
    p.add_argument("--no-progress", action="store_true", help="no TTY status line (log lines instead)")
    args = p.parse_args(argv)
    if not args.validate and not args.output_prefix:
        p.error("--output-prefix is required (or --validate)")
    if bool(args.tokenizer_type) != bool(args.tokenizer_model):
        p.error("--tokenizer-type and --tokenizer-model go together")
    return args


def _validate(inputs) -> int:
    from megatron_dllm.data.prep.litpkds import expand_inputs, validate_files

    files = expand_inputs(inputs)
    headers, errors = validate_files(files)
    for h in headers:
        print(f"ok {h.path}: {h.dtype.name}, {h.num_chunks} chunk(s) of {h.chunk_size} tokens")
    for message in errors:
        print(f"BAD {message}")
    if errors:
        return fail(f"{len(errors)} of {len(files)} LITPKDS files are invalid; first: {errors[0]}")
    print(f"all {len(files)} files valid: {sum(h.num_tokens for h in headers)} tokens")
    return 0


@reports_bad_input()
def main(argv=None) -> int:
    args = get_args(argv)
    if args.validate:
        return _validate(args.inputs)
    from megatron_dllm.data.indexed_dataset import tokenizer_metadata
    from megatron_dllm.data.prep.litpkds import convert_litpkds
    from megatron_dllm.data.tokenizers import data_id_rule

    eos_id, vocab_size, id_rule, metadata = args.eos_id, None, None, None
    if args.tokenizer_type:
        tokenizer = TokenizerConfig.from_args(args).build()
        if eos_id is not None and eos_id != tokenizer.eod:
            raise InputError(f"--eos-id {eos_id} differs from the EOS {tokenizer.eod} of --tokenizer-model "
                             f"{args.tokenizer_model}")
        eos_id, vocab_size = tokenizer.eod, tokenizer.vocab_size
        metadata = {**tokenizer_metadata(tokenizer), "append_eod": True}  # each document keeps its EOS
        id_rule = data_id_rule(tokenizer)  # what training accepts: never the [MASK] id
    if eos_id is None:
        raise InputError("--eos-id is required (or --tokenizer-type and --tokenizer-model, whose EOS is taken): "
                         "LITPKDS files do not record their separator")
    stats = convert_litpkds(args.inputs, args.output_prefix, eos_id, pad_id=args.pad_id, vocab_size=vocab_size,
                            id_rule=id_rule, metadata=metadata, progress=False if args.no_progress else None,
                            log_interval=args.log_interval, sync_interval=args.sync_interval,
                            overwrite=args.overwrite)
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
