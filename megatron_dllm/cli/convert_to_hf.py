"""Export a megatron_dllm checkpoint (any TP/PP layout) to a Hugging Face directory.

    python tools/convert_to_hf.py --load CKPT --out DIR [--use-ema] \
        [--tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model] [--seq-length 2048]

The tokenizer flags are training's (`--tiktoken-*`, `--tokenizer-special-tokens`, `--vocab-size` for
TikTokenizer); given only type and model, the options the checkpoint recorded are used.

Runs as one process: the checkpoint is resharded to TP=1/PP=1 on load (model weights only).
The directory is written under a temporary name beside DIR and renamed into place when complete;
an existing DIR is refused unless --overwrite, which replaces it whole. Files are mode 0644.
The directory loads with `AutoModelForMaskedLM` (mdlm, duo, esolm) or `AutoModelForCausalLM` (ar)
`.from_pretrained(DIR, trust_remote_code=True)`, and `AutoTokenizer.from_pretrained(DIR,
trust_remote_code=True)` (its config.json names the remote code, so transformers asks otherwise).
A `--backbone gpt` checkpoint of family ar exports as transformers' own LlamaForCausalLM (or
Qwen2ForCausalLM with q/k/v biases), loaded without trust_remote_code; of a diffusion family, as
the remote code above with its Llama-style backbone. A checkpoint exports the tokenizer it
recorded (training's, or an imported model's own) unless the tokenizer flags name another; a
recorded tokenizer whose file is gone is an error naming it.
"""
import argparse
import os
import sys

from megatron_dllm import platform  # first: on CPU it quiets megatron-core's fallback warnings
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.config.fields import non_negative_int, positive_int
from megatron_dllm.output_lock import exclusive, lock_path_for_prefix


@reports_bad_input()
def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint root (with latest_checkpointed_iteration.txt)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory whole")
    parser.add_argument("--ckpt-step", type=non_negative_int, default=None,
                        help="the iteration to export (default: the tracker's)")
    parser.add_argument("--use-ema", action="store_true", help="export the EMA weights (checkpoint key 'ema')")
    parser.add_argument("--seq-length", type=positive_int, default=None,
                        help="max_position_embeddings (default: the checkpoint's, else 2048)")
    TokenizerConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    if bool(args.tokenizer_type) != bool(args.tokenizer_model):
        parser.error("--tokenizer-type and --tokenizer-model go together")

    from megatron_dllm.hf import export

    out = os.path.realpath(args.out)  # through a symlink (a `latest` link): replace the export it names
    # the lock is a sibling (OUT.lock): the export is staged beside OUT and renamed whole
    with exclusive(lock_path_for_prefix(out), f"--out {args.out}"):
        export.check_export_target(out, "--out", args.overwrite, source=args.load)
        return _export(args, out)


def _export(args, out: str) -> int:
    from megatron_dllm.checkpoint.tokenizer_record import recorded_tokenizer_config
    from megatron_dllm.hf import export

    platform.init_distributed(1, 1)
    model, identity, meta, arch = export.load_megatron_model(args.load, args.use_ema, args.seq_length,
                                                               args.ckpt_step)
    given = TokenizerConfig.from_args(args) if args.tokenizer_model else None
    tokenizer = recorded_tokenizer_config(meta.tokenizer, given, args.load)
    with export.staged_export(out) as staging:
        tensors = export.write_model_dir(staging, model.state_dict(), identity, arch.attention, arch.seq_length)
        if tokenizer is not None:
            export.export_tokenizer(staging, tokenizer.tokenizer_type, tokenizer.tokenizer_model,
                                    identity.vocab_size, identity.mask_id, tokenizer.options())
    print(f"wrote {args.out} ({identity.family}, {tensors} tensors"
          f"{', EMA' if args.use_ema else ''}{', tokenizer' if tokenizer is not None else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
