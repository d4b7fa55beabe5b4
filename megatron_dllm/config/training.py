"""How long and on what batches the run trains."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_dllm.config.fields import (
    FlagGroup,
    finite_float,
    flag,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    seed_value,
)


@dataclass(frozen=True)
class TrainingConfig(FlagGroup):
    GROUP = "batch and run length"
    micro_batch_size: int | None = flag(type=positive_int, help="default 2 (8 on the demo)")
    global_batch_size: int | None = flag(type=positive_int, help="default 256 (32 on the demo)")
    train_iters: int | None = flag(type=positive_int, help="iterations (or --train-samples / --train-flops)")
    train_samples: int | None = flag(type=positive_int,
                                     help="samples, rounded down to whole global batches (as Megatron-LM)")
    train_flops: float | None = flag(type=finite_float,
                                     help="training compute budget (e.g. 6e18): iterations = floor(budget / (training "
                                          "FLOPs per sequence x --global-batch-size))")
    flops_convention: str = flag("calflops", choices=["calflops", "full"],
                                 help="how --train-flops and the logged cumulative FLOPs count: calflops (the paper's, "
                                      "no attention matmuls) | full (every matmul)")
    sft: bool = flag(False, action="store_true",
                     help="supervised fine-tuning on an SFT dataset (tools/preprocess_sft_data.py): no loss on, "
                          "and no noise in, prompt tokens; start from a pretrained model with --load ... --finetune")
    train_epochs: float | None = flag(type=positive_float, help="--sft: passes over the training rows "
                                                              "(rounded up to whole global batches)")
    seed: int = flag(1234, type=seed_value, help="seeds weights, data order and noise")
    ema_decay: float | None = flag(type=float, help="keep an fp32 exponential moving average of the weights with "
                                                    "this decay, saved in checkpoints under 'ema'")
    # ---- leaving early and numerical guards (Megatron-LM's names and meanings)
    exit_signal_handler: bool = flag(False, action="store_true",
                                     help="on SIGTERM or SIGUSR1 finish the iteration, save and exit 0")
    exit_duration_in_mins: float | None = flag(type=non_negative_float,
                                               help="save and exit 0 once the run has been up this many minutes "
                                                    "(0: off, as in Megatron-LM)")
    exit_interval: int | None = flag(type=non_negative_int, help="save and exit 0 at the first iteration divisible "
                                                                 "by this (0: off)")
    check_for_nan_in_loss_and_grad: bool = flag(True, action=argparse.BooleanOptionalAction,
                                                help="skip (and log) an iteration whose loss or gradient is not "
                                                     "finite (on by default, as in Megatron-LM)")
    max_consecutive_nonfinite_iters: int = flag(5, type=positive_int,
                                                help="--check-for-nan-in-loss-and-grad: after this many skipped "
                                                     "iterations in a row, save the last good state and stop")
    loss_spike_factor: float | None = flag(2.0, type=non_negative_float,
                                           help="log a loss spike when an iteration's loss exceeds this multiple "
                                                "of the mean of the previous 50 (0 turns it off)")
