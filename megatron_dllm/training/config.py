"""Resolve a run from the flags: defaults, the embedded demo, tokenizer, datasets, iterations.

With no data flags the run trains on the embedded demo corpus (Shakespeare, prepared once into a
cache) with defaults sized for 2 CPU cores; with data flags the defaults are the paper's
sweep settings. Flags given explicitly always win.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_dllm.data.datasets import build_datasets
from megatron_dllm.data.demo import prepare_demo_corpus
from megatron_dllm.data.tokenizers import build_tokenizer
from megatron_dllm.families import FAMILIES
from megatron_dllm.model.presets import Preset, get_preset
from megatron_dllm.scaling.flops import train_flops_per_sequence
from megatron_dllm.scaling.plan import iterations_for_budget

DEMO_DEFAULTS = dict(
    preset="cpu-small", seq_length=128, micro_batch_size=8, global_batch_size=32, train_iters=300,
    lr=1e-3, lr_warmup_fraction=0.05, eval_interval=100,
    save="runs/demo-{family}/checkpoints", tensorboard_dir="runs/demo-{family}/tensorboard",
)
DEFAULTS = dict(preset="14M", seq_length=2048, micro_batch_size=2, global_batch_size=256, lr=2e-4,
                lr_warmup_fraction=0.01)


@dataclass
class Run:
    tokenizer: object
    train_dataset: object
    valid_dataset: object
    train_iters: int
    demo: bool


def _fill(args, defaults: dict) -> None:
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value.format(family=args.family) if isinstance(value, str) else value)


def resolve_preset(args) -> Preset:
    """The --preset with any --hidden-size/--num-layers/--num-attention-heads override applied."""
    overrides = {"hidden_size": args.hidden_size, "num_layers": args.num_layers,
                 "num_attention_heads": args.num_attention_heads}
    return dataclasses.replace(get_preset(args.preset), **{k: v for k, v in overrides.items() if v})


def resolve_run(args) -> Run:
    demo = args.data_path is None
    if demo:
        if args.tokenizer_type or args.tokenizer_model:
            raise ValueError("--tokenizer-type/--tokenizer-model need --data-path (the embedded demo "
                             "brings its own tokenizer)")
        corpus = prepare_demo_corpus(args.demo_cache_dir)
        args.data_path, args.valid_data_path = [corpus["data_prefix"]], [corpus["valid_prefix"]]
        args.tokenizer_type, args.tokenizer_model = corpus["tokenizer_type"], corpus["tokenizer_model"]
        _fill(args, DEMO_DEFAULTS)
    else:
        if not (args.tokenizer_type and args.tokenizer_model):
            raise ValueError("--data-path needs --tokenizer-type and --tokenizer-model (the tokenizer "
                             "the data was preprocessed with)")
        _fill(args, DEFAULTS)
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    if args.train_flops is not None:
        per_sequence = train_flops_per_sequence(resolve_preset(args), tokenizer.vocab_size, args.seq_length,
                                                args.flops_convention)
        # rounded down, so the run spends at most the budget
        args.train_iters = iterations_for_budget(args.train_flops, per_sequence, args.global_batch_size)
        if args.train_iters < 1:
            raise ValueError(f"--train-flops {args.train_flops:g} pays for no iteration: one costs "
                             f"{per_sequence * args.global_batch_size:.4g} FLOPs ({args.flops_convention}) "
                             f"at --global-batch-size {args.global_batch_size}")
    if args.train_iters is None:
        if args.train_samples is None:
            raise ValueError("give --train-iters, --train-samples or --train-flops")
        args.train_iters = math.ceil(args.train_samples / args.global_batch_size)
    extra_token = FAMILIES[args.family].extra_token  # AR reads seq_length + 1 tokens
    num_valid = args.eval_iters * args.global_batch_size if args.eval_interval else 0
    train, valid = build_datasets(
        args.data_path, args.split, args.valid_data_path, args.seq_length, extra_token, args.seed,
        args.train_iters * args.global_batch_size, num_valid, args.data_cache_path, tokenizer,
    )
    return Run(tokenizer, train, valid, args.train_iters, demo)
