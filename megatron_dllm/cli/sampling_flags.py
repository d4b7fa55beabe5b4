"""The sampler flags shared by `dllm-sample` and `dllm-evaluate throughput`, spelled one way."""
from __future__ import annotations

import argparse

from megatron_dllm.config.fields import positive_int


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampler")
    g.add_argument("--predictor", default="ancestral",
                   help="ancestral (each family's own sampler) | block (Eso-LM) | left-to-right")
    g.add_argument("--seq-length", type=positive_int, default=None,
                   help="L, any prompt included (default: the model's training length)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="bd3lm: generate at most this many tokens after the prompt, block by block "
                        "(the canvas ends there; with stop-at-EOS it ends at the first EOS)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept at each step")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--float64", action=argparse.BooleanOptionalAction, default=True,
                   help="categorical sampling from float64 probabilities (--no-float64: float32)")
    g.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="AR/Eso-LM KV cache, MDLM no-change cache (--no-kv-cache: recompute)")


def sampling_config(args, stop_at_eos: bool):
    from megatron_dllm.sampling import SamplingConfig

    return SamplingConfig(steps=args.steps, seq_length=args.seq_length, top_p=args.top_p,
                          temperature=args.temperature, float64=args.float64, predictor=args.predictor,
                          kv_cache=args.kv_cache, stop_at_eos=stop_at_eos,
                          max_new_tokens=args.max_new_tokens)
