"""Supervised fine-tuning (`pretrain_dllm.py --sft`): the same trainer, parallelism and checkpoints,
reading an SFT dataset (rows + prompt mask, `data/sft.py`) instead of a pretraining token stream.

The prompt mask travels with each sample to `family.corrupt(tokens, noise, prompt)`: prompt tokens
are never corrupted and carry no loss (valid = 0), so the trainer's token-weighted mean is over
response (and EOS padding) positions. Diffusion families train on the NELBO weights by default
under --sft (the masked-diffusion SFT recipe's 1/t weighting), unless --loss says otherwise.
The run length is --train-epochs (whole passes over the training rows, rounded up to whole
global batches) or the usual --train-iters/--train-samples; samples are read epoch by epoch in
a seeded order, so a resumed run continues mid-epoch exactly.
"""
from __future__ import annotations

import math

from megatron_dllm import platform
from megatron_dllm.config import RunConfig, resolve_iterations, validate
from megatron_dllm.data.sft import build_sft_datasets
from megatron_dllm.families import FAMILIES


def prepare_sft_inputs(config: RunConfig):
    """(resolved config, Inputs) of an --sft run, from a config whose defaults are filled
    (`inputs.check_flags`)."""
    from megatron_dllm.training.inputs import Inputs

    tokenizer = config.tokenizer.build()
    family = FAMILIES[config.model.family]
    training, logging = config.training, config.logging
    train, valid = build_sft_datasets(config.data.data_path, config.data.split, config.data.valid_data_path,
                                      config.model.seq_length, family.extra_token, training.seed, tokenizer,
                                      with_valid=bool(logging.eval_interval))
    if training.train_epochs is not None:
        config = config.replace(training={"train_epochs": None, "train_iters": math.ceil(
            training.train_epochs * train.num_rows / training.global_batch_size)})
    config = resolve_iterations(config, tokenizer.vocab_size)
    if config.model.loss is None and "nelbo" in family.losses:
        config = config.replace(model={"loss": "nelbo"})
    return validate(config, platform.world_size()), Inputs(tokenizer, train, valid)
