"""Sizes of a model preset: `python tools/model_info.py --preset 1.7B --vocab-size 32001 --json`
(a released model's preset, `--preset smollm2-135m`, is the GPT backbone with its shape).

FLOPs are per sequence of --seq-length tokens in the two conventions of
megatron_dllm/scaling/flops.py (`calflops`: the paper's; `full`: every matmul, attention included);
the same for every family but BD3-LM, whose model runs on [x_t ; x_0], twice the tokens.
"""
import json
import sys

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.fields import positive_int
from megatron_dllm.errors import InputError


@reports_bad_input()
def main(argv=None):
    parser = OneLineParser(description=__doc__)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--vocab-size", type=positive_int, default=32001,
                        help="real vocabulary including [MASK] (the paper: 32000 + 1)")
    parser.add_argument("--seq-length", type=positive_int, default=2048)
    parser.add_argument("--family", default="mdlm",
                        help="ar | mdlm | duo | esolm | bd3lm (the FLOPs are the same for the first four; "
                             "see scaling/flops.py)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from megatron_dllm.families import FAMILIES
    from megatron_dllm.model.params import count_parameters
    from megatron_dllm.model.presets import get_preset, gpt_shape_of
    from megatron_dllm.scaling.flops import forward_flops_per_sequence

    if args.family not in FAMILIES:
        parser.error(f"--family {args.family!r} is not a known family; expected one of: {', '.join(FAMILIES)}")
    try:
        preset = get_preset(args.preset)
    except InputError as err:
        parser.error(str(err))
    gpt = gpt_shape_of(args.preset)
    info = {"preset": args.preset, "family": args.family, "backbone": "gpt" if gpt else "dit",
            "hidden_size": preset.hidden_size, "num_layers": preset.num_layers,
            "num_attention_heads": preset.num_attention_heads,
            **({"num_query_groups": gpt.num_query_groups or preset.num_attention_heads,
                "ffn_hidden_size": gpt.ffn_hidden_size,
                "tied_embeddings": not gpt.untie_embeddings_and_output_weights} if gpt else {}),
            "vocab_size": args.vocab_size, "seq_length": args.seq_length,
            **count_parameters(preset, args.vocab_size, gpt, args.seq_length)}
    model_tokens = args.seq_length * FAMILIES[args.family].input_copies  # BD3-LM: [x_t ; x_0]
    for convention in ("calflops", "full"):
        forward = forward_flops_per_sequence(preset, args.vocab_size, model_tokens, convention, gpt)
        info[f"fwd_flops_per_seq_{convention}"] = forward
        info[f"train_flops_per_seq_{convention}"] = 3 * forward  # as scaling/flops.py: backward = 2 x forward
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            print(f"{key:>28}: {value:,}" if numeric else f"{key:>28}: {value}")


if __name__ == "__main__":
    sys.exit(main())
