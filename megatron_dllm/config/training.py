"""How long and on what batches the run trains."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, finite_float, flag, positive_int


@dataclass(frozen=True)
class TrainingConfig(FlagGroup):
    GROUP = "batch and run length"
    micro_batch_size: int | None = flag(type=positive_int, help="default 2 (8 on the demo)")
    global_batch_size: int | None = flag(type=positive_int, help="default 256 (32 on the demo)")
    train_iters: int | None = flag(type=positive_int, help="iterations (or --train-samples / --train-flops)")
    train_samples: int | None = flag(type=positive_int, help="samples, rounded up to whole global batches")
    train_flops: float | None = flag(type=finite_float,
                                     help="training compute budget (e.g. 6e18): iterations = floor(budget / (training "
                                          "FLOPs per sequence x --global-batch-size))")
    flops_convention: str = flag("calflops", choices=["calflops", "full"],
                                 help="how --train-flops and the logged cumulative FLOPs count: calflops (the paper's, "
                                      "no attention matmuls) | full (every matmul)")
    sft: bool = flag(False, action="store_true",
                     help="supervised fine-tuning on an SFT dataset (tools/preprocess_sft_data.py): no loss on, "
                          "and no noise in, prompt tokens; start from a pretrained model with --load ... --finetune")
    train_epochs: float | None = flag(type=finite_float, help="--sft: passes over the training rows "
                                                              "(rounded up to whole global batches)")
    seed: int = flag(1234, type=int, help="seeds weights, data order and noise")
    ema_decay: float | None = flag(type=float, help="keep an fp32 exponential moving average of the weights with "
                                                    "this decay, saved in checkpoints under 'ema'")
