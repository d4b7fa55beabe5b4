"""Numerical guards: skip an iteration whose loss or total gradient norm is not finite
(--check-for-nan-in-loss-and-grad), stop after K of them in a row, and report loss spikes.

A skipped iteration still consumes its batch (as Megatron-LM's skipped iterations do): resuming
past a bad stretch of data is usually what a run needs. The weights and optimizer state are left
exactly as after the last good iteration.
"""
from __future__ import annotations

import math
from collections import deque

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megatron_dllm import platform


class NonFiniteStop(RuntimeError):
    """K consecutive non-finite iterations: the run saved its last good state and stopped."""


def finite_grad_norm(optimizer, loss: float | None) -> float | None:
    """The step's total gradient norm, or None when the step must be skipped (collective): the
    loss or the norm is not finite, or megatron-core's prepare_grads found an inf. The norm is
    the one megatron-core clips with, so it also catches finite gradients whose squared sum
    overflows (the norm is inf), which would otherwise clip every gradient to 0 and still move
    Adam's moments and step count. This is the first half of megatron-core's optimizer.step();
    step_with_norm is the rest."""
    found_inf = optimizer.prepare_grads()
    norm = optimizer.get_grad_norm()
    bad = found_inf or not math.isfinite(norm) or (loss is not None and not math.isfinite(loss))
    return None if platform.any_rank([bad])[0] else norm  # the loss is known on the last pipeline stage only


def step_with_norm(optimizer, grad_norm: float) -> bool:
    """The rest of megatron-core's optimizer.step() after finite_grad_norm: clip by the norm
    already computed (as its ChainedOptimizer does), then step; returns whether it stepped."""
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(member, "is_stub_optimizer", False) else member.get_parameters()
        if params and member.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, member.config.clip_grad, grad_norm,
                                         member.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return optimizer.step_with_ready_grads()


class NonFiniteCounter:
    def __init__(self, max_consecutive: int):
        self.max_consecutive, self.consecutive, self.skipped = max_consecutive, 0, 0

    def record(self, finite: bool) -> bool:
        """Count an iteration; True when the run must stop."""
        self.consecutive = 0 if finite else self.consecutive + 1
        self.skipped += not finite
        return self.consecutive >= self.max_consecutive


class LossSpikes:
    """A loss above `factor` x the mean of the previous `window` iterations' losses is a spike."""

    def __init__(self, factor: float | None, window: int = 50, warmup: int = 10):
        self.factor, self.warmup = factor, warmup
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float | None) -> float | None:
        """The recent mean when `loss` is a spike, else None (finite losses only enter the mean)."""
        if not self.factor or loss is None or loss != loss or loss in (float("inf"), float("-inf")):
            return None
        mean = sum(self.recent) / len(self.recent) if len(self.recent) >= self.warmup else None
        self.recent.append(loss)
        return mean if mean is not None and loss > self.factor * mean else None
