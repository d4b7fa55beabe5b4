"""The training step, one function shared by the trainer and the benchmarks (so every figure
measures the real step): megatron-core's schedule over one global batch with the family loss,
then the optimizer and LR-schedule step.

    loss, grad_norm = train_step(model, optimizer, scheduler, family, batches, consumed, config, timers)

`batches` is anything with `num_microbatches`, `mbs` and `iteration(consumed)` yielding that many
ModelInputs (training.batches.BatchSchedule, or a benchmark's fixed batch).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_dllm.config import RunConfig
from megatron_dllm.families import vocab_parallel
from megatron_dllm.training import nan_guard


def loss_func(family, training: bool, seq_length: int, inp, logits):
    """(summed loss, token count, reported [sum, count]): megatron-core divides by the global token
    count, so the gradient is the token-weighted mean over the whole global batch.

    A micro-batch cut short by --variable-seq-length-prob counts as `seq_length` positions a
    sample, its mean unchanged: it weighs as much as a full one, as in the reference code (where
    every micro-batch's mean loss weighs alike), not by its few tokens."""
    per_token = family.loss(logits, inp) if training else family.nelbo(logits, inp)
    total, count = per_token.sum(), inp.valid.sum()
    cut = inp.targets.shape[1]
    if cut < seq_length:
        weighted = torch.round(count * (seq_length / cut))
        total, count = total * (weighted / count), weighted
    return total, count.to(torch.int), {"loss": torch.stack([total.detach().double(), count.double()])}


def forward_step(family, training: bool, seq_length: int, timers, data_iterator, model):
    timers("batch-generator", log_level=1).start()
    inp = next(data_iterator)
    timers("batch-generator").stop()
    logits = model(inp.input_ids, inp.position_ids, inp.sigma, inp.attention_mask)
    # looked up per call: tests patch loss_func
    return logits, partial(loss_func, family, training, seq_length, inp)


def forward_backward(model: list, family, batches, consumed: int, config: RunConfig, timers,
                     training: bool, iteration: int | None = None, graph=None) -> float | None:
    """Forward (and, training, backward) over one global batch; returns the token-weighted mean
    loss on the last pipeline stage (None elsewhere). `iteration`: the number of the training
    iteration (1-based), for batches whose attention depends on it (annealing); `graph`: a
    training iteration's `cuda_graph.FullIterationGraph` (one model chunk)."""
    sums = loss_sums(model, family, batches, consumed, config, timers, training, iteration, graph)
    return None if sums is None else (sums[0] / sums[1]).item()


def loss_sums(model: list, family, batches, consumed: int, config: RunConfig, timers,
              training: bool, iteration: int | None = None, graph=None) -> torch.Tensor | None:
    """forward_backward's [summed loss, token count] over all data-parallel ranks (float64), for
    means over several global batches (validation)."""
    chunks = len(model)
    iterators = [batches.iteration(consumed, iteration) for _ in range(chunks)]
    schedule = partial(
        get_forward_backward_func(),
        forward_step_func=partial(forward_step, family, training, config.model.seq_length, timers),
        model=model if chunks > 1 else model[0],
        num_microbatches=batches.num_microbatches, seq_length=config.model.backbone_length(),
        micro_batch_size=batches.mbs, forward_only=not training,
    )
    # the loss heads' vocabulary work compiled with the DiT's elementwise regions (--compile-elementwise)
    with vocab_parallel.compiled_heads(getattr(get_model_config(model[0]), "compile_elementwise", False)):
        if graph is not None and training:
            losses = graph(schedule, iterators[0])
        else:
            losses = schedule(data_iterator=iterators if chunks > 1 else iterators[0])
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    summed = torch.stack([d["loss"] for d in losses]).sum(0)
    dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    return summed


def train_step(model: list, optimizer, scheduler, family, batches, consumed: int, config: RunConfig, timers,
               ema=None, iteration: int | None = None, graph=None) -> tuple[float | None, float | None]:
    """One iteration (number `iteration`, 1-based, where the batches need it): (loss on the last
    stage, total gradient norm). A None norm means the weights did not move: under
    --check-for-nan-in-loss-and-grad the loss or norm was not finite. `graph`: the run's
    full-iteration CUDA graph (`--cuda-graph-scope full_iteration`), or None."""
    for chunk in model:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_backward(model, family, batches, consumed, config, timers, training=True, iteration=iteration,
                            graph=graph)
    timers("optimizer", log_level=1).start()
    if config.training.check_for_nan_in_loss_and_grad:
        # megatron-core's step in two halves, so a non-finite norm never reaches Adam
        grad_norm = nan_guard.finite_grad_norm(optimizer, loss)
        ok = grad_norm is not None and nan_guard.step_with_norm(optimizer, grad_norm)
    else:
        ok, grad_norm, _ = optimizer.step()
    timers("optimizer").stop()
    if ok:
        scheduler.step(increment=1)
        if ema is not None:
            ema.update()
    return loss, grad_norm if ok else None
