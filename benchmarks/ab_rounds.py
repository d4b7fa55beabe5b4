"""Two variants of the training step's forward + backward, timed side by side in one process:
warm-up rounds, then alternating rounds (A B, B A, ...) so drift on a shared machine falls on
both. Used by bench_attention_backend.py (local vs sdpa) and bench_compile.py (eager vs fused).
"""
from __future__ import annotations

import contextlib
import statistics

from bench_train_step import MegatronStep, timed

from megatron_dllm import platform


def forward_backward(step: MegatronStep) -> float:
    """One micro-batch through the trainer's schedule (`training.step.forward_backward`: forward,
    family loss, backward into DDP's grad buffers); returns the loss."""
    from megatron_dllm.training import step as training_step

    step.model[0].zero_grad_buffer()
    loss = training_step.forward_backward(step.model, step.family, step.batches, 0, step.config, step.timers,
                                          training=True)
    platform.synchronize()  # a GPU step ends when its kernels have
    return loss


def alternating_rounds(steps: dict[str, MegatronStep], rounds: int, warmup: int) -> dict:
    """{"wall"|"cpu": (median A, median B, median of the per-round ratios B/A, min ratio, max
    ratio)} in seconds, A and B being `steps`' two variants in order."""
    names = tuple(steps)
    for _ in range(warmup):
        for s in steps.values():
            forward_backward(s)
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:  # alternate who goes first
            seconds, used, _ = timed(lambda s=steps[n]: forward_backward(s), contextlib.nullcontext)
            wall[n].append(seconds)
            cpu[n].append(used)
    stats = {}
    for what, times in (("wall", wall), ("cpu", cpu)):
        a, b = times[names[0]], times[names[1]]
        ratios = [y / x for x, y in zip(a, b)]
        stats[what] = (statistics.median(a), statistics.median(b), statistics.median(ratios), min(ratios),
                       max(ratios))
    return stats


def ratio_cells(stats: dict) -> str:
    """The table cells of `alternating_rounds`' result: ms A | ms B | **ratio** | range, wall then CPU."""
    return " | ".join(f"{1e3 * a:.1f} | {1e3 * b:.1f} | **{ratio:.3f}** | {lo:.2f}–{hi:.2f}"
                      for a, b, ratio, lo, hi in (stats["wall"], stats["cpu"]))
