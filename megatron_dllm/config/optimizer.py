"""The optimizer (megatron-core's AdamW) and its learning-rate schedule."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import (
    FlagGroup,
    adam_beta,
    flag,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

WSD_DECAY_STYLE = "exponential"  # Megatron-LM's default --lr-wsd-decay-style


@dataclass(frozen=True)
class OptimizerConfig(FlagGroup):
    GROUP = "optimizer and learning rate"
    weight_decay: float = flag(0.1, type=non_negative_float, help="AdamW weight decay")
    apply_wd_to_all_params: bool = flag(False, action="store_true",
                                        help="decay biases and norm weights too (the paper's code); default: "
                                             "Megatron's, which exempts biases and 1-D parameters")
    adam_beta1: float = flag(0.9, type=adam_beta, help="AdamW beta1")
    adam_beta2: float = flag(0.95, type=adam_beta, help="AdamW beta2")
    adam_eps: float = flag(1e-8, type=positive_float, help="AdamW epsilon")
    clip_grad: float = flag(1.0, type=non_negative_float, help="gradient-norm clipping (0: none)")
    lr: float | None = flag(type=non_negative_float, help="default 2e-4 (1e-3 on the demo)")
    min_lr: float | None = flag(type=non_negative_float, help="default lr/10")
    lr_warmup_iters: int | None = flag(type=non_negative_int, help="warmup iterations")
    lr_warmup_fraction: float | None = flag(type=fraction, help="warmup as a fraction of the decay iterations "
                                                                "(the run's without --lr-decay-iters), unrounded as "
                                                                "Megatron-LM's")
    lr_warmup_min_iters: int = flag(0, type=non_negative_int,
                                    help="with --lr-warmup-fraction: at least this many warmup iterations "
                                         "(the paper's code: max(1%% of the run, 100))")
    lr_decay_style: str = flag("cosine", choices=["constant", "linear", "cosine", "WSD"], help="decay shape")
    lr_decay_iters: int | None = flag(type=positive_int, help="default: all training iterations")
    lr_wsd_decay_style: str | None = flag(choices=["linear", "cosine", "exponential", "minus_sqrt"],
                                          help=f"WSD: shape of the final decay (default {WSD_DECAY_STYLE}, "
                                               f"Megatron-LM's)")
    lr_wsd_decay_iters: int | None = flag(type=positive_int,
                                          help="WSD: iterations of the final decay (default: the last third of "
                                               "the iterations after warmup)")

    def decay_iters(self, train_iters: int) -> int:
        return self.lr_decay_iters or train_iters

    def warmup_iters(self, train_iters: int) -> float:
        """--lr-warmup-iters, or the fraction of the decay iterations, unrounded as Megatron-LM's
        (with --lr-warmup-min-iters, the paper's code: whole iterations, at least that many)."""
        if self.lr_warmup_iters is not None:
            return self.lr_warmup_iters
        warmup = (self.lr_warmup_fraction or 0.0) * self.decay_iters(train_iters)
        return int(max(warmup, self.lr_warmup_min_iters)) if self.lr_warmup_min_iters else warmup

    def wsd_decay_iters(self, train_iters: int) -> int:
        """WSD's final decay: the flag, or the last third of the whole iterations after the warmup."""
        after_warmup = round(self.decay_iters(train_iters) - self.warmup_iters(train_iters))
        return self.lr_wsd_decay_iters or max(1, after_warmup // 3)

    def wsd_decay_style(self) -> str:
        return self.lr_wsd_decay_style or WSD_DECAY_STYLE
