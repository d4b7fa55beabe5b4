"""The sampler flags shared by `dllm-sample` and `dllm-evaluate throughput`, spelled one way."""
from __future__ import annotations

import argparse

from megatron_dllm.config.fields import fraction, non_negative_float, positive_int

DTYPES = ("float32", "bfloat16", "float16")  # --dtype of the tools that load a model: its weights and compute


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampler")
    g.add_argument("--predictor", default="ancestral",
                   help="ancestral (each family's own sampler) | block (Eso-LM) | left-to-right | "
                        "low-confidence | threshold | entropy-bound (MDLM, Duo)")
    g.add_argument("--seq-length", type=positive_int, default=None,
                   help="L, any prompt included (default: the model's training length)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="bd3lm: generate at most this many tokens after the prompt, block by block "
                        "(the canvas ends there; with stop-at-EOS it ends at the first EOS)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept at each step")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--float64", action=argparse.BooleanOptionalAction, default=True,
                   help="categorical sampling from float64 probabilities (--no-float64: float32)")
    g.add_argument("--noise-removal", choices=["greedy", "ancestral"], default="greedy",
                   help="MDLM/Duo/BD3-LM ancestral: the final step at t = 1e-5, the denoiser's argmax (greedy; "
                        "Duo's greedy tail) or a posterior step to alpha_s = 1 (ancestral: the paper code's "
                        "config default)")
    g.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="AR/Eso-LM KV cache, MDLM no-change cache (--no-kv-cache: recompute)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="capture the denoiser's forwards as CUDA graphs and replay them (CUDA only; the "
                        "same samples, far fewer kernel launches at small batches)")
    g.add_argument("--compile", action="store_true",
                   help="compile the model's forward with torch.compile (TorchInductor): each layer's elementwise "
                        "work fused into a few kernels; each new shape pays a compile first (seconds to minutes); "
                        "samples equal to rounding")
    add_remasking_arguments(g)


def add_remasking_arguments(group) -> None:
    """Block-wise decoding, its approximate caches and the knobs of the remasking predictors
    (sampling/blocks.py, approx_kv_cache.py, remasking.py); each only with its predictors."""
    group.add_argument("--block-length", type=positive_int, default=None,
                       help="MDLM/Duo: generated positions per block, decoded left to right (default: one "
                            "block); --steps per block with ancestral, in total with low-confidence")
    group.add_argument("--approx-kv-cache", choices=["none", "prefix", "dual"], default="none",
                       help="MDLM/Duo ancestral with --block-length: Fast-dLLM's approximate KV caches, "
                            "refreshed at each block (none: exact)")
    group.add_argument("--tokens-per-step", type=positive_int, default=None,
                       help="low-confidence: commit this many per step (default: spread over --steps)")
    group.add_argument("--confidence-threshold", type=fraction, default=None,
                       help="threshold: commit every position with p(x0) > tau, at least one (default 0.9)")
    group.add_argument("--entropy-bound", type=non_negative_float, default=None,
                       help="entropy-bound: gamma, the summed entropy (less its largest) of the positions "
                            "committed together (default 0.1)")


def remasking_options(args) -> dict:
    """The remasking knobs as `SamplingConfig` fields."""
    return {"block_length": args.block_length, "approx_kv_cache": args.approx_kv_cache,
            "tokens_per_step": args.tokens_per_step,
            "confidence_threshold": args.confidence_threshold, "entropy_bound": args.entropy_bound}


def sampling_config(args, stop_at_eos: bool):
    from megatron_dllm.sampling import SamplingConfig

    return SamplingConfig(steps=args.steps, seq_length=args.seq_length, top_p=args.top_p,
                          temperature=args.temperature, float64=args.float64, predictor=args.predictor,
                          kv_cache=args.kv_cache, cuda_graphs=args.cuda_graphs, stop_at_eos=stop_at_eos,
                          max_new_tokens=args.max_new_tokens, noise_removal=args.noise_removal,
                          **remasking_options(args))
