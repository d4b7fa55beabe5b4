"""What a run reads: its configuration resolved and validated, the tokenizer, and the train/valid
datasets.

    config, inputs = prepare_inputs(parse_args(argv))
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm import platform
from megatron_dllm.config import RunConfig, resolve_defaults, resolve_iterations, validate
from megatron_dllm.data.datasets import build_datasets
from megatron_dllm.data.prep.demo import prepare_demo_corpus
from megatron_dllm.families import FAMILIES


@dataclass
class Inputs:
    tokenizer: object
    train_dataset: object
    valid_dataset: object


def check_flags(config: RunConfig) -> RunConfig:
    """The defaults filled and every rule checked against this launch: all that can be known
    before any work (the demo corpus, the tokenizer, the datasets, the process group)."""
    return validate(resolve_defaults(config), platform.world_size())


def prepare_inputs(config: RunConfig) -> tuple[RunConfig, Inputs]:
    """Resolve and validate `config` (preparing the embedded demo corpus once, if it is used) and
    build the tokenizer and datasets it names."""
    config = check_flags(config)
    if config.training.sft:
        from megatron_dllm.training.sft import prepare_sft_inputs

        return prepare_sft_inputs(config)
    config = resolve_defaults(config, prepare_demo_corpus(config.data.demo_cache_dir) if config.demo else None)
    tokenizer = config.tokenizer.build()
    config = validate(resolve_iterations(config, tokenizer.vocab_size), platform.world_size())  # the final one
    training, logging = config.training, config.logging
    num_valid = logging.eval_iters * training.global_batch_size if logging.eval_interval else 0
    train, valid = build_datasets(
        config.data.data_path, config.data.split, config.data.valid_data_path, config.model.seq_length,
        FAMILIES[config.model.family].extra_token,  # AR reads seq_length + 1 tokens
        training.seed, training.train_iters * training.global_batch_size, num_valid, config.data.data_cache_path,
        tokenizer,
    )
    return config, Inputs(tokenizer, train, valid)
