"""Command-line flags, named as in Megatron-LM (plus --family, --loss and --preset)."""
from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def split_spec(text: str) -> str:
    """Megatron's --split: up to three non-negative weights (train, valid, test), not all zero."""
    try:
        weights = [float(w) for w in text.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not (1 <= len(weights) <= 3 and all(math.isfinite(w) and w >= 0 for w in weights) and sum(weights) > 0):
        raise argparse.ArgumentTypeError(f"expected up to three non-negative numbers such as 969,30,1, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a DiT language model (AR, MDLM, Duo, Eso-LM) with megatron-core.",
                                allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--family", default="mdlm", help="model family: ar | mdlm | duo | esolm")
    g.add_argument("--loss", default=None,
                   help="training objective; mdlm, esolm: low-var (default) | nelbo; duo: nelbo; ar: nll")
    g.add_argument("--preset", default=None,
                   help="model size: one of the paper's presets (14M ... 1708M, alias 1.7B) or cpu-tiny/"
                        "cpu-small/cpu-base; default cpu-small on the embedded demo")
    g.add_argument("--num-layers", type=positive_int, default=None, help="overrides the preset")
    g.add_argument("--hidden-size", type=positive_int, default=None, help="overrides the preset")
    g.add_argument("--num-attention-heads", type=positive_int, default=None, help="overrides the preset")
    g.add_argument("--seq-length", type=positive_int, default=None, help="default 2048 (128 on the demo)")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine when installed on a GPU, else local")
    g.add_argument("--recompute-activations", action="store_true", help="full activation recompute")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=positive_int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=positive_int, default=None, help="default 2 (8 on the demo)")
    g.add_argument("--global-batch-size", type=positive_int, default=None, help="default 256 (32 on the demo)")
    g.add_argument("--train-iters", type=positive_int, default=None)
    g.add_argument("--train-samples", type=positive_int, default=None)
    g.add_argument("--train-flops", type=float, default=None,
                   help="training compute budget (e.g. 6e18): iterations = floor(budget / (training FLOPs "
                        "per sequence x --global-batch-size)); replaces --train-iters/--train-samples")
    g.add_argument("--flops-convention", choices=["calflops", "full"], default="calflops",
                   help="how --train-flops and the logged cumulative FLOPs count: calflops (the paper's, "
                        "no attention matmuls) | full (every matmul); see megatron_dllm/scaling/flops.py")
    g.add_argument("--lr", type=float, default=None, help="default 2e-4 (1e-3 on the demo)")
    g.add_argument("--min-lr", type=float, default=None, help="default lr/10")
    g.add_argument("--lr-warmup-iters", type=non_negative_int, default=None)
    g.add_argument("--lr-warmup-fraction", type=fraction, default=None)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "WSD"], default="cosine")
    g.add_argument("--lr-decay-iters", type=positive_int, default=None, help="default: all training iterations")
    g.add_argument("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential", "minus_sqrt"],
                   default="cosine")
    g.add_argument("--lr-wsd-decay-iters", type=non_negative_int, default=None,
                   help="WSD: iterations of the final decay (default: the last third)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true", help="bf16 params and compute (GPU; CPU runs fp32)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="TransformerEngine FP8 (H100)")
    g.add_argument("--fp8-recipe", choices=["delayed", "tensorwise", "blockwise", "mxfp8"], default="delayed")
    g.add_argument("--fp8-amax-history-len", type=positive_int, default=1)
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix | w1 prefix1 w2 prefix2 ... (no data flags: the embedded demo corpus)")
    g.add_argument("--split", type=split_spec, default="969,30,1")
    g.add_argument("--train-data-path", nargs="*", default=None,
                   help="per-split paths (Megatron-LM): the training blend, with --valid-data-path")
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default=None,
                   help="SentencePieceTokenizer | HuggingFaceTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--variable-seq-length-prob", type=fraction, default=0.0,
                   help="probability that a micro-batch is cut to a length drawn from U[1, L] "
                        "(the paper's 1.7B runs: 0.01; diffusion families only)")
    g.add_argument("--demo-cache-dir", default=None,
                   help="where the embedded demo corpus is prepared (default ~/.cache/megatron_dllm/demo)")

    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=positive_int, default=10)
    g.add_argument("--eval-interval", type=positive_int, default=None)
    g.add_argument("--eval-iters", type=positive_int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON line per logged iteration and per validation (last rank)")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None,
                   help="checkpoint root (loads the iteration its tracker names; without a tracker the "
                        "newest complete checkpoint) or one iter_XXXXXXX directory")
    g.add_argument("--ckpt-step", type=non_negative_int, default=None, help="--load: the iteration to load from the root")
    g.add_argument("--save-interval", type=positive_int, default=None)
    g.add_argument("--no-load-optim", action="store_true",
                   help="--load: leave the optimizer state fresh (weights, LR schedule, counters still load)")
    g.add_argument("--no-load-rng", action="store_true", help="--load: do not restore the RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="--load: weights only; iteration and consumed samples restart at 0, fresh "
                        "optimizer and LR schedule")
    g.add_argument("--ema-decay", type=float, default=None,
                   help="keep an fp32 exponential moving average of the weights with this decay, "
                        "saved in checkpoints under 'ema'")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed flags; a bad combination exits like any argparse error (usage, `error: ...`, code 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.train_data_path is not None:
        if args.data_path is not None or args.valid_data_path is None:
            parser.error("--train-data-path goes with --valid-data-path and replaces --data-path")
        args.data_path = args.train_data_path
    from megatron_dllm.families import FAMILIES

    if args.family not in FAMILIES:
        parser.error(f"--family {args.family!r} is not a known family; expected one of: {', '.join(FAMILIES)}")
    from megatron_dllm.data.datasets import parse_data_path

    for flag in ("data_path", "valid_data_path"):
        if getattr(args, flag):
            try:
                parse_data_path(getattr(args, flag), "--" + flag.replace("_", "-"))
            except ValueError as err:
                parser.error(str(err))
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and args.seq_length and args.seq_length % tp:
        parser.error(f"--seq-length {args.seq_length} must be a multiple of --tensor-model-parallel-size {tp} "
                     f"under --sequence-parallel")
    if args.ema_decay is not None and not 0 < args.ema_decay < 1:
        parser.error(f"--ema-decay must lie in (0, 1), got {args.ema_decay:g}")
    if args.train_iters is not None and args.train_samples is not None:
        parser.error("give --train-iters or --train-samples, not both")
    if args.train_flops is not None:
        if args.train_iters is not None or args.train_samples is not None:
            parser.error("--train-flops sets the number of iterations; give it without --train-iters/--train-samples")
        if not (math.isfinite(args.train_flops) and args.train_flops > 0):
            parser.error(f"--train-flops must be positive, got {args.train_flops:g}")
    return args
