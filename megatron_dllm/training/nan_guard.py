"""Numerical guards: skip an iteration whose loss or gradient is not finite
(--check-for-nan-in-loss-and-grad), stop after K of them in a row, and report loss spikes.

A skipped iteration still consumes its batch (as Megatron-LM's skipped iterations do): resuming
past a bad stretch of data is usually what a run needs. The weights and optimizer state are left
exactly as after the last good iteration.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist


class NonFiniteStop(RuntimeError):
    """K consecutive non-finite iterations: the run saved its last good state and stopped."""


def grads_and_loss_finite(model, loss: float | None) -> bool:
    """Whether every rank's loss and gradients are finite (collective). The DDP grad buffers hold
    this rank's gradients, so a non-finite value produced anywhere is seen by some rank."""
    bad = loss is not None and not torch.isfinite(torch.tensor(loss)).item()
    for chunk in model:
        for buffer in chunk.buffers:
            bad = bad or not torch.isfinite(buffer.grad_data).all().item()
    flag = torch.tensor([int(bad)], dtype=torch.int)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not flag.item()


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
