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

from megatron_dllm.config import RunConfig, resolve_defaults, resolve_iterations
from megatron_dllm.data.sft import build_sft_datasets
from megatron_dllm.errors import InputError
from megatron_dllm.families import FAMILIES


def prepare_sft_inputs(cfg: RunConfig):
    """(resolved cfg, Inputs) of an --sft run."""
    from megatron_dllm.training.inputs import Inputs

    t = cfg.training
    if cfg.demo:
        raise InputError("--sft needs --data-path: an SFT dataset written by tools/preprocess_sft_data.py")
    if t.train_epochs is not None and (t.train_iters or t.train_samples or t.train_flops):
        raise InputError("--train-epochs sets the run length; give it without --train-iters/--train-samples/"
                         "--train-flops")
    cfg = resolve_defaults(cfg)
    tokenizer = cfg.tokenizer.build()
    family = FAMILIES[cfg.model.family]
    t, log = cfg.training, cfg.logging
    train, valid = build_sft_datasets(cfg.data.data_path, cfg.data.split, cfg.data.valid_data_path,
                                      cfg.model.seq_length, family.extra_token, t.seed, tokenizer,
                                      with_valid=bool(log.eval_interval))
    if t.train_epochs is not None:
        cfg = cfg.replace(training={"train_iters": math.ceil(t.train_epochs * train.num_rows / t.global_batch_size)})
    cfg = resolve_iterations(cfg, tokenizer.vocab_size)
    if cfg.model.loss is None and "nelbo" in family.losses:
        cfg = cfg.replace(model={"loss": "nelbo"})
    return cfg, Inputs(tokenizer, train, valid)
