"""Sampling throughput: generated tokens/s and samples/s at a given number of steps and batch size.

Each measurement is one `sampling.generate` call of exactly one batch, wall-clock between device
synchronisations; one warm-up call (allocator, kernels, caches) is run first and not counted.
The figure is total tokens / total time over `repeats` calls (plus each call's time), a sample's
tokens being its `seq_length` positions: for AR these include the EOD it starts from, which it does
not generate (1/L of its figure), so that every family is counted over the same L.

`batch_size="auto"` finds the largest power of two that runs: it tries 1, 2, 4, ... until a call
runs out of device memory or `max_batch_size` is reached. Running out of host memory is not an
error Python can catch (the OS kills the process), hence the cap, which a CPU run must give.
"""
from __future__ import annotations

import time

import torch

from megatron_dllm import platform
from megatron_dllm.errors import InputError
from megatron_dllm.sampling.cuda_graphs import shared_graphs


def _generate_once(inference_model, sampling, batch_size: int, seed: int) -> tuple[torch.Tensor, float]:
    from megatron_dllm.sampling import generate

    platform.synchronize()
    tick = time.perf_counter()
    tokens = generate(inference_model, sampling, num_samples=batch_size, batch_size=batch_size, seed=seed)
    platform.synchronize()
    return tokens, time.perf_counter() - tick


def check_auto_cap(device, max_batch_size: int | None) -> None:
    """`auto_batch_size` on `device` needs `max_batch_size` where running out of memory cannot be
    caught (the CPU); the command checks it before loading the model."""
    if max_batch_size is None and not platform.out_of_memory_raises(device):
        raise InputError("--batch-size auto on CPU needs --max-batch-size (running out of host memory "
                         "kills the process instead of raising an error)")


def largest_batch(fits, max_batch_size: int | None, device) -> int:
    """The largest power of two <= max_batch_size for which `fits(batch)` runs without running out
    of memory on `device`: tries 1, 2, 4, ... (benchmarks/bench_gpu_generation.py probes with a
    truncated run). Errors other than running out of memory propagate."""
    check_auto_cap(device, max_batch_size)
    best, b = None, 1
    while max_batch_size is None or b <= max_batch_size:
        try:
            fits(b)
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if not platform.is_out_of_memory(err):
                raise
            break
        best, b = b, b * 2
    platform.release_cached_memory()  # here, with the error (which held the failed batch) gone
    if best is None:
        raise InputError("--batch-size auto: even a batch of 1 runs out of memory")
    return best


def auto_batch_size(inference_model, sampling, max_batch_size: int | None, seed: int = 0) -> int:
    """The largest power of two <= max_batch_size for which one generate call fits in memory."""
    return largest_batch(lambda b: _generate_once(inference_model, sampling, b, seed), max_batch_size,
                         inference_model.device)


def measure_throughput(inference_model, sampling, batch_size: int, repeats: int = 3, seed: int = 0) -> dict:
    """Tokens/s (over each sample's L positions) and samples/s over `repeats` timed calls after one
    warm-up call."""
    if repeats < 1:
        raise InputError(f"--repeats {repeats}: expected at least 1")
    with shared_graphs(inference_model.model):  # --cuda-graphs: the timed calls replay the warm-up's graphs
        tokens, _ = _generate_once(inference_model, sampling, batch_size, seed)  # warm-up, not timed
        length = tokens.shape[1]
        times = [_generate_once(inference_model, sampling, batch_size, seed + 1 + r)[1] for r in range(repeats)]
    total = sum(times)
    return {"batch_size": batch_size, "seq_length": length, "tokens_per_s": repeats * batch_size * length / total,
            "samples_per_s": repeats * batch_size / total, "seconds_per_batch": times}
