"""Two variants of the training step's forward + backward, timed side by side in one process:
warm-up rounds, then alternating rounds (A B, B A, ...) so drift on a shared machine falls on
both. Used by bench_attention_backend.py (local vs sdpa), bench_compile.py (eager vs fused) and
bench_gradient_accumulation_fusion.py (unfused vs fused), which share their flags, their (preset,
seq, family) grid and the way each case is built here.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from typing import Callable

import torch
from bench_train_step import MegatronStep, make_batch, timed

from megatron_dllm import platform
from megatron_dllm.families import get_family
from megatron_dllm.model.init import initialize_weights
from megatron_dllm.model.presets import get_preset


def add_grid_arguments(p: argparse.ArgumentParser, families: list[str], families_help: str | None = None) -> None:
    """The flags of the (preset, seq, family) grid, of the rounds and of the precision."""
    p.add_argument("--presets", nargs="+", default=["cpu-small", "cpu-base"])
    p.add_argument("--seqs", nargs="+", type=int, default=[128, 512])
    p.add_argument("--families", nargs="+", default=families, help=families_help)
    p.add_argument("--vocab", type=int, default=4097, help="real vocabulary including [MASK]")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (batch = tokens / seq)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--bf16", action="store_true", help="bf16 (GPU; the CPU runs fp32)")


def build_variants(preset_name: str, seq: int, family_name: str, args,
                   variants: dict[str, dict]) -> tuple[int, dict[str, MegatronStep]]:
    """(batch, {variant: step}): one step per variant (`variants` maps its name to MegatronStep's
    options), all with the same weights and batch. The adaLN gates are drawn, not zero: with zero
    gates the attention and MLP regions would not reach the loss."""
    preset, batch = get_preset(preset_name), max(1, args.tokens // seq)
    family = get_family(family_name, args.vocab - 1, args.vocab)
    inp = make_batch(family, args.vocab, batch, seq).to(platform.device())
    steps = {name: MegatronStep(preset, args.vocab, batch, seq, family, inp, train_iters=10, keep_initial=False,
                                bf16=args.bf16, **options) for name, options in variants.items()}
    for s in steps.values():
        initialize_weights(s.model[0].module, seed=7, adaln_zero=False)
    return batch, steps


def run_grid(args, setting: str, table_head: str, case: Callable[..., dict]) -> list[dict]:
    """Print the run's setting and `table_head`, then call `case(preset, seq, family, args)` for the
    whole grid in a world of one; returns the rows it gave."""
    if args.threads:
        torch.set_num_threads(args.threads)
    platform.init_distributed(1, 1, seed=0)
    print(f"{platform.device_name() or 'CPU'}, {'bf16' if args.bf16 else 'fp32'}, {setting}{args.rounds} "
          f"alternating rounds after {args.warmup} warm-up, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; 1-min load average {os.getloadavg()[0]:.1f} at the start\n")
    print(table_head, flush=True)
    try:
        return [case(preset, seq, family, args) for preset in args.presets for seq in args.seqs
                for family in args.families]
    finally:
        platform.destroy_distributed()


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


def first_losses_then_rounds(preset_name: str, seq: int, family_name: str, args,
                             variants: dict[str, dict]) -> tuple[int, dict]:
    """(batch, `alternating_rounds`' stats) of `build_variants`' steps; each variant's first loss,
    which shows that they compute the same step, goes to stderr."""
    batch, steps = build_variants(preset_name, seq, family_name, args, variants)
    first = {name: forward_backward(s) for name, s in steps.items()}
    print(f"{preset_name} seq {seq} {family_name}: first loss " +
          "  ".join(f"{name} {loss:.6f}" for name, loss in first.items()), file=sys.stderr)
    return batch, alternating_rounds(steps, args.rounds, args.warmup)


def ratio_head(names: tuple[str, str]) -> tuple[str, str]:
    """The table head over `ratio_cells` for variants `names` (A, B): (titles, alignment row)."""
    a, b = names
    titles = " | ".join(f"{what} ms {a} | {what} ms {b} | **{what} {b} / {a}** | range" for what in ("wall", "CPU"))
    return titles, "---:|---:|---:|---|" * 2


def ratio_cells(stats: dict) -> str:
    """The table cells of `alternating_rounds`' result: ms A | ms B | **ratio** | range, wall then CPU."""
    return " | ".join(f"{1e3 * a:.1f} | {1e3 * b:.1f} | **{ratio:.3f}** | {lo:.2f}–{hi:.2f}"
                      for a, b, ratio, lo, hi in (stats["wall"], stats["cpu"]))
