"""Batches for conditional generation in evaluation (GSM8K, lm-eval `generate_until`): `--batch-size N|auto`.

Prompts are sorted by length before they are cut into batches, so a batch pads little; the
results do not depend on the grouping (row i of a batch is exactly the batch-1 generation, see
`sampling.conditional.generate_left_to_right_batch`). `auto` starts at the device's
`platform.auto_generation_batch` (GPU 64, CPU 8); where running out of memory raises (GPU) it
halves whenever a batch runs out of device memory, then goes on at that size (the largest that
fits, to a power of two).
"""
from __future__ import annotations

import argparse
from typing import Callable, Sequence

from megatron_dllm import platform


def parse_batch_size(text: str) -> int | str:
    """argparse type of --batch-size: a positive integer or 'auto'."""
    if str(text) == "auto":
        return "auto"
    if not str(text).isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text}")
    return int(text)


def in_batches(lengths: Sequence[int], batch_size: int | str, device, run: Callable[[list[int]], list]) -> list:
    """`run(indices)` (one result per index) over batches of indices sorted by `lengths`;
    the results in input order."""
    auto = batch_size == "auto"
    size = platform.auto_generation_batch(device) if auto else int(batch_size)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    results: list = [None] * len(lengths)
    first = 0
    while first < len(order):
        chunk = order[first:first + size]
        try:
            outputs = run(chunk)
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if not (auto and size > 1 and platform.out_of_memory_raises(device) and platform.is_out_of_memory(err)):
                raise
        else:
            for i, out in zip(chunk, outputs):
                results[i] = out
            first += len(chunk)
            continue
        platform.release_cached_memory()  # with the error gone, which held the failed batch
        size //= 2
    return results
