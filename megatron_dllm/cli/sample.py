"""Generate samples from a megatron_dllm checkpoint (any TP/PP layout) or an exported HF directory.

    python tools/sample.py --load CKPT|HF_DIR --num-samples 8 --steps 256 --batch-size 4 \
        [--seed 0] [--top-p 1.0] [--temperature 1.0] \
        [--predictor ancestral|block|left-to-right|low-confidence|threshold|entropy-bound] \
        [--block-length B] [--tokens-per-step K] [--confidence-threshold TAU] [--entropy-bound GAMMA] \
        [--no-kv-cache] [--no-float64] [--stop-at-eos] [--cut-at-eod] [--prompt TEXT] [--seq-length L] [--use-ema] \
        [--tokenizer-type T --tokenizer-model M [--tiktoken-* ...]] [--device cpu|cuda] \
        [--dtype float32|bfloat16|float16] [--cuda-graphs] [--compile] [--output samples.json] [--overwrite]

Runs as one process. `--predictor ancestral` is each family's default sampler (AR: next-token;
MDLM/Duo/Eso-LM: ancestral); `block` is Eso-LM only; `low-confidence`, `threshold` and
`entropy-bound` (MDLM, Duo) are the remasking samplers, block by block with --block-length.
The JSON output holds every setting, the token ids [N, L], the decoded texts (whole samples
with EOD tokens dropped; --cut-at-eod: the first document only) and the wall time of
generation. Samples run the full length L unless --stop-at-eos.
Bad input prints one line `error: ...` and exits with code 2.
"""
import argparse
import json
import os
import sys
import time

from megatron_dllm import platform  # first: on CPU it quiets megatron-core's fallback warnings
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.cli.sampling_flags import DTYPES, add_sampling_arguments, sampling_config
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.errors import InputError
from megatron_dllm.result_files import check_result_file, write_result_file


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megatron checkpoint root / iter_XXXXXXX dir, or HF directory")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--steps", type=int, default=128, help="T denoising steps (AR, left-to-right: one per token)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per batch (default: all at once)")
    p.add_argument("--seed", type=int, default=0)
    add_sampling_arguments(p)
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="left-to-right (AR): stop a sample at its first EOS and fill the rest with EOS "
                        "(default: the full length, as the paper's samples)")
    p.add_argument("--cut-at-eod", action="store_true",
                   help="texts: keep only each sample's first document (default: the whole sample, "
                        "EOD tokens dropped, as the paper's code decodes it for Gen PPL)")
    p.add_argument("--prompt", default=None, help="text kept at the start of every sample")
    p.add_argument("--use-ema", action="store_true", help="the EMA weights of a megatron checkpoint")
    TokenizerConfig.add_arguments(p)  # default: the tokenizer a megatron checkpoint recorded
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="model weights and compute (bfloat16 on a GPU); the categorical sampling stays "
                        "float64 unless --no-float64")
    p.add_argument("--output", default="samples.json", help="the samples' JSON record (default: samples.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = p.parse_args(argv)
    if bool(args.tokenizer_type) != bool(args.tokenizer_model):
        p.error("--tokenizer-type and --tokenizer-model go together")
    return args


@reports_bad_input()
def main(argv=None):
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()  # stderr keeps only our own messages
    transformers.logging.disable_progress_bar()

    import torch

    from megatron_dllm.families import FAMILIES
    from megatron_dllm.sampling import decode, generate, load_inference_model
    from megatron_dllm.sampling.registry import steps_taken

    sampling = sampling_config(args, stop_at_eos=args.stop_at_eos)
    sampling.check()  # before the (slow) load
    check_result_file(args.output, "--output", args.overwrite)
    if not os.path.exists(args.load):
        raise FileNotFoundError(f"--load {args.load}: no such file or directory")
    device = platform.tool_device(args.device)
    inference_model = load_inference_model(args.load, device, getattr(torch, args.dtype), use_ema=args.use_ema,
                                           tokenizer_type=args.tokenizer_type,
                                           tokenizer_model=args.tokenizer_model,
                                           tokenizer_options=TokenizerConfig.from_args(args).options())
    if args.compile:
        inference_model = inference_model.compile()
    prompt_ids = None
    if inference_model.tokenizer is None:  # what needs its text or its EOD id
        for flag, given in (("--prompt", args.prompt is not None), ("--cut-at-eod", args.cut_at_eod),
                            ("--stop-at-eos", args.stop_at_eos),
                            (f"--family {inference_model.family} without --prompt",  # it starts after an EOD
                             FAMILIES[inference_model.family].next_token)):
            if given:
                raise InputError(f"{flag} needs a tokenizer: give --tokenizer-type/--tokenizer-model")
    if args.prompt is not None:
        prompt_ids = inference_model.tokenizer.tokenize(args.prompt)
        if inference_model.mask_id in prompt_ids:  # the tokenizer's own mask piece, spelled in the text
            raise InputError(f"--prompt: the text encodes to the [MASK] id {inference_model.mask_id} (it spells the "
                             f"mask token), which a prompt cannot hold; write it otherwise")
    start = time.perf_counter()
    tokens = generate(inference_model, sampling, num_samples=args.num_samples, batch_size=args.batch_size,
                      seed=args.seed, prompt_ids=prompt_ids)
    wall = time.perf_counter() - start
    steps = steps_taken(sampling)
    texts = (decode(inference_model, tokens, cut_at_eod=args.cut_at_eod) if inference_model.tokenizer is not None
             else None)
    record = {
        "settings": {**vars(args), "steps": steps,  # what T was, if any; paths absolute: the record leaves the cwd
                     **{k: os.path.abspath(getattr(args, k)) for k in ("load", "output", "tokenizer_model")
                        if getattr(args, k, None)},
                     "device": device, "family": inference_model.family,
                     "block_size": (inference_model.family_options or {}).get("block_size"),
                     "shift": bool((inference_model.family_options or {}).get("shift")),
                     "source": inference_model.source,
                     "dtype": str(next(inference_model.model.parameters()).dtype).removeprefix("torch."),
                     "seq_length": tokens.shape[1], "prompt_ids": prompt_ids},
        "wall_time_s": wall,
        "samples_per_s": args.num_samples / wall,
        "tokens": tokens.tolist(),
        "texts": texts,
    }
    write_result_file(args.output, json.dumps(record, indent=1))
    if texts is None:
        print(f"note: --load {args.load} records no tokenizer: {args.output} holds token ids only (\"texts\": "
              f"null); give --tokenizer-type/--tokenizer-model to decode them", file=sys.stderr)
    print(f"wrote {args.output}: {args.num_samples} {inference_model.family} samples of {tokens.shape[1]} tokens "
          f"in {wall:.2f} s ({args.predictor}{'' if steps is None else f', T={steps}'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
