"""What a run reads: its configuration resolved, the tokenizer, and the train/valid datasets.

    cfg, inputs = prepare_inputs(parse_args(argv))
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config import RunConfig, resolve_defaults, resolve_iterations
from megatron_dllm.data.datasets import build_datasets
from megatron_dllm.data.prep.demo import prepare_demo_corpus
from megatron_dllm.errors import InputError
from megatron_dllm.families import FAMILIES


@dataclass
class Inputs:
    tokenizer: object
    train_dataset: object
    valid_dataset: object


def prepare_inputs(cfg: RunConfig) -> tuple[RunConfig, Inputs]:
    """Resolve `cfg` (preparing the embedded demo corpus once, if it is used) and build the
    tokenizer and datasets it names."""
    if cfg.training.sft:
        from megatron_dllm.training.sft import prepare_sft_inputs

        return prepare_sft_inputs(cfg)
    if cfg.training.train_epochs is not None:
        raise InputError("--train-epochs applies to --sft runs (epochs over the SFT rows); pretraining "
                         "uses --train-iters, --train-samples or --train-flops")
    cfg = resolve_defaults(cfg, prepare_demo_corpus(cfg.data.demo_cache_dir) if cfg.demo else None)
    tokenizer = cfg.tokenizer.build()
    cfg = resolve_iterations(cfg, tokenizer.vocab_size)
    t, log = cfg.training, cfg.logging
    num_valid = log.eval_iters * t.global_batch_size if log.eval_interval else 0
    train, valid = build_datasets(
        cfg.data.data_path, cfg.data.split, cfg.data.valid_data_path, cfg.model.seq_length,
        FAMILIES[cfg.model.family].extra_token,  # AR reads seq_length + 1 tokens
        t.seed, t.train_iters * t.global_batch_size, num_valid, cfg.data.data_cache_path, tokenizer,
    )
    return cfg, Inputs(tokenizer, train, valid)
