"""Import a checkpoint of the paper's code (Scaling Beyond Masked Diffusion Language Models) into a
megatron_dllm checkpoint at any TP/PP layout, or straight into this project's Hugging Face export:

    torchrun --nproc-per-node T*P tools/convert_from_ref.py --ref last.ckpt --weights ema \\
        --save CKPT --tensor-model-parallel-size T --pipeline-model-parallel-size P
    python tools/convert_from_ref.py --ref HUB_DIR --hf-out DIR

--ref is a PyTorch Lightning checkpoint of its trainer (`--weights raw` or `ema`) or a directory
written by its DiT's `save_pretrained` (huggingface_hub mixin: config.json + model.safetensors).
The family is --family, else the checkpoint's `algo.name` (ar, mdlm, esolm, duo_base/distillation
-> duo). The [MASK] id is --mask-id, else the one of --tokenizer-type/--tokenizer-model (whose
vocabulary must match; --hf-out then exports it), else the last vocabulary id (the paper's code
appends [MASK] to a tokenizer that has none). A Lightning
checkpoint is a pickle: it is read through an allowlist that runs no code from the file
(megatron_dllm/hf/safe_load.py). Bad input: one `error: ...` line, exit code 2.
"""
import argparse
import os
import sys

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.config.fields import non_negative_int, positive_int
from megatron_dllm.errors import InputError
from megatron_dllm.output_lock import exclusive, lock_path_for_prefix


@reports_bad_input()
def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="Lightning .ckpt file or hub-mixin directory")
    parser.add_argument("--weights", default="raw", choices=["raw", "ema"],
                        help="Lightning checkpoint: the trained parameters or their EMA (default raw)")
    parser.add_argument("--family", default=None, choices=["ar", "mdlm", "duo", "esolm"],
                        help="default: inferred from the checkpoint's config (algo.name)")
    parser.add_argument("--mask-id", type=int, default=None,
                        help="default: the tokenizer's [MASK] with --tokenizer-model, else the last vocabulary id")
    TokenizerConfig.add_arguments(parser)  # the run's tokenizer: checked against the vocabulary, gives the
    # [MASK] id, exported with --hf-out; TikTokenizer takes training's --tiktoken-* options
    parser.add_argument("--num-attention-heads", type=positive_int, default=None,
                        help="only for weights with neither config nor rotary buffer")
    parser.add_argument("--seq-length", type=positive_int, default=None,
                        help="max_position_embeddings of the result (default: the config's model.length, else 2048)")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--save", help="megatron checkpoint root to write")
    out.add_argument("--hf-out", help="Hugging Face directory to write (as tools/convert_to_hf.py)")
    parser.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    parser.add_argument("--iteration", type=non_negative_int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace what --save or --hf-out holds")
    args = parser.parse_args(argv)
    if bool(args.tokenizer_type) != bool(args.tokenizer_model):
        parser.error("--tokenizer-type and --tokenizer-model go together")
    if args.hf_out and (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) != (1, 1):
        parser.error("--tensor/--pipeline-model-parallel-size shape a --save checkpoint, not --hf-out")
    return convert(args)


def load_reference(args):
    """(identity, hf_state, max_length) of --ref."""
    from megatron_dllm.checkpoint.identity import ModelIdentity
    from megatron_dllm.hf import export, reference

    ref = reference.read(args.ref, args.weights)
    if args.num_attention_heads is not None:
        model = ref.section("model")
        if model.setdefault("n_heads", args.num_attention_heads) != args.num_attention_heads:
            raise InputError(f"--num-attention-heads {args.num_attention_heads} but {args.ref} says "
                             f"model.n_heads {model['n_heads']}")
    family = ref.family(args.family)
    hf_state = ref.hf_state()
    sizes = ref.sizes()
    vocab = sizes["vocab_size"]
    mask_id = vocab - 1 if args.mask_id is None else args.mask_id
    if args.tokenizer_model:
        tokenizer = TokenizerConfig.from_args(args).build()
        mask_id = tokenizer.mask_id if args.mask_id is None else args.mask_id
        if (tokenizer.vocab_size, tokenizer.mask_id) != (vocab, mask_id):
            raise InputError(f"--tokenizer-model {args.tokenizer_model}: vocabulary {tokenizer.vocab_size} with "
                             f"[MASK] {tokenizer.mask_id}, but {args.ref} has {vocab} rows and [MASK] {mask_id}")
    if not 0 <= mask_id < vocab:
        raise InputError(f"--mask-id {mask_id}: outside the checkpoint's vocabulary of {vocab}")
    identity = ModelIdentity(family, sizes["hidden_size"], sizes["num_layers"], sizes["num_heads"], vocab, mask_id)
    max_length = args.seq_length or reference.default_max_length(ref, export.DEFAULT_SEQ_LENGTH)
    return identity, hf_state, max_length


def convert(args) -> int:
    if args.save:  # write_checkpoint holds --save's lock
        from megatron_dllm.checkpoint.tokenizer_record import TokenizerRecord
        from megatron_dllm.cli.convert_from_hf import write_checkpoint

        identity, hf_state, max_length = load_reference(args)
        tokenizer = TokenizerRecord.of(TokenizerConfig.from_args(args)) if args.tokenizer_model else None
        return write_checkpoint(hf_state, identity, max_length, args, source=args.ref, tokenizer=tokenizer)
    # a sibling lock (OUT.lock), taken before reading --ref: the export is staged beside OUT and renamed whole
    with exclusive(lock_path_for_prefix(os.path.realpath(args.hf_out)), f"--hf-out {args.hf_out}"):
        identity, hf_state, max_length = load_reference(args)
        return write_hf(args, identity, hf_state, max_length)


def write_hf(args, identity, hf_state: dict, max_length: int) -> int:
    """The HF export, staged beside --hf-out and renamed into place when complete."""
    from megatron_dllm.families import FAMILIES
    from megatron_dllm.hf import export

    out = os.path.realpath(args.hf_out)  # through a symlink: replace the export it names
    export.check_export_target(out, "--hf-out", args.overwrite, source=args.ref)
    with export.staged_export(out) as staging:
        export.write_hf_dir(staging, hf_state,
                            export.hf_config_dict(identity, FAMILIES[identity.family].attention, max_length))
        if args.tokenizer_model:
            export.export_tokenizer(staging, args.tokenizer_type, args.tokenizer_model, identity.vocab_size,
                                    identity.mask_id, TokenizerConfig.from_args(args).options())
    print(f"wrote {args.hf_out} ({identity.family}, {len(hf_state)} tensors, {args.weights} weights"
          f"{', tokenizer' if args.tokenizer_model else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
