"""Named `torch.profiler.record_function` regions around the parts of a training step whose time
`profile_breakdown` reports: the core attention, the loss head, the optimizer and the fetch of
each micro-batch. Installed on a live Trainer from the outside (module forward hooks and
wrapped callables), so the training code carries no profiling of its own.

    remove = install_regions(trainer)   # ... profile some trainer.train_step() calls ...
    remove()                            # hooks and wrappers gone, the trainer as it was
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator

import torch
from megatron.core.transformer.attention import Attention
from torch.profiler import record_function

from megatron_dllm.model.dit import FinalLayer

STEP = "dllm::step"
ATTENTION = "dllm::attention"
LOSS_HEAD = "dllm::loss_head"
OPTIMIZER = "dllm::optimizer"
INPUT_WAIT = "dllm::input_wait"
REGIONS = (ATTENTION, LOSS_HEAD, OPTIMIZER, INPUT_WAIT)

# megatron-core's optimizer.step() and the halves --check-for-nan-in-loss-and-grad calls instead
OPTIMIZER_METHODS = ("step", "prepare_grads", "get_grad_norm", "step_with_ready_grads")


def install_regions(trainer) -> Callable[[], None]:
    """Put the regions on `trainer`; returns the function that takes them off again.

    The only place that knows the Trainer's attribute names: `model` (DDP-wrapped chunks),
    `family.loss`, `optimizer` and `train_batches.iteration` (one iterator per global batch).
    """
    undo = []
    for chunk in trainer.model:
        for module in chunk.modules():
            if isinstance(module, Attention):  # the core attention whatever the backend
                undo += _module_region(module.core_attention, ATTENTION)
            elif isinstance(module, FinalLayer):  # norm, adaLN and the projection to the vocabulary
                undo += _module_region(module, LOSS_HEAD)
    undo.append(_wrap(trainer.family, "loss", LOSS_HEAD))
    for method in OPTIMIZER_METHODS:
        if hasattr(trainer.optimizer, method):
            undo.append(_wrap(trainer.optimizer, method, OPTIMIZER))
    iteration = trainer.train_batches.iteration
    undo.append(_shadow(trainer.train_batches, "iteration",
                        lambda *args, **kwargs: _fetches_in_region(iteration(*args, **kwargs))))

    def remove() -> None:
        for step in reversed(undo):
            step()
    return remove


def _module_region(module: torch.nn.Module, name: str) -> list:
    """Hooks that open the region before `module`'s forward and close it after (also on error)."""
    open_regions = []

    def enter(_module, _args):
        region = record_function(name)
        region.__enter__()
        open_regions.append(region)

    def leave(_module, _args, _output):
        open_regions.pop().__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    return [h.remove for h in handles]


def _wrap(owner, attribute: str, name: str) -> Callable[[], None]:
    """Run the callable `owner.attribute` inside the region; returns the undo."""
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def in_region(*args, **kwargs):
        with record_function(name):
            return original(*args, **kwargs)

    return _shadow(owner, attribute, in_region)


def _shadow(owner, attribute: str, replacement) -> Callable[[], None]:
    """Set an instance attribute over `owner.attribute`; the undo restores what was there before
    (an earlier instance attribute, or nothing, so that the class's method shows through)."""
    before = vars(owner)
    had, previous = attribute in before, before.get(attribute)
    setattr(owner, attribute, replacement)
    return lambda: setattr(owner, attribute, previous) if had else delattr(owner, attribute)


def _fetches_in_region(batches) -> Iterator:
    """`batches` with each `next()` (reading, corrupting and moving a micro-batch) in INPUT_WAIT."""
    batches = iter(batches)
    while True:
        with record_function(INPUT_WAIT):
            try:
                batch = next(batches)
            except StopIteration:
                return
        yield batch
