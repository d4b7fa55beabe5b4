"""Checkpoints through megatron-core distributed checkpointing (torch_dist), Megatron's layout:

    SAVE/iter_0000100/...             sharded model + optimizer (reshardable), scheduler, state
    SAVE/latest_checkpointed_iteration.txt

The pointer file is written (atomically) only after every rank finished saving, so a directory
without it, or newer than it, is never taken for a finished checkpoint.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _model_key(model, i: int) -> str:
    return "model" if len(model) == 1 else f"model{i}"


def _materialize_optimizer_state(optimizer) -> None:
    """torch's AdamW creates its state lazily at the first step, but megatron's loader needs the
    state's structure (including `step`) to load into; the loaded values replace these."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(opt.optimizer, opt.config)
        for param_state in opt.optimizer.state.values():
            param_state.setdefault("step", torch.tensor(0.0))


def _restore_adam_step(optimizer, loaded: dict) -> None:
    """megatron-core 0.16's distributed optimizer keeps torch AdamW's `step` in its param groups
    but then overwrites the per-parameter `step` with the loading template's; put it back."""
    groups = loaded.get("optimizer", {}).get("param_groups", [])
    steps = {g["step"] for g in groups if "step" in g}
    if len(steps) != 1:
        return
    step = float(steps.pop())
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in opt.optimizer.state.values():
            param_state["step"] = torch.tensor(step)


def _sharded_state(model, optimizer, is_loading: bool) -> dict:
    state = {}
    for i, chunk in enumerate(model):  # chunks are DDP-wrapped: checkpoint the module itself
        state[_model_key(model, i)] = chunk.module.sharded_state_dict()
    if optimizer is not None:
        if is_loading:
            _materialize_optimizer_state(optimizer)
        # dp_reshardable, Megatron-LM's default for the distributed optimizer (megatron-core's
        # own default cannot be saved in 0.16, and fully_reshardable cannot be loaded into torch's
        # AdamW). Model weights reshard freely; this optimizer state reshards across DP only.
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, extra: dict) -> str:
    """Save; `extra` (consumed samples, the run's identity, ...) goes into the common state."""
    path = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    state.update(extra)
    dist_checkpointing.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return path


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


def load_checkpoint(root: str, model, optimizer, scheduler, identity: dict) -> dict | None:
    """Load the latest finished checkpoint under `root` into model/optimizer/scheduler.

    Returns the common state (iteration, consumed samples, ...), or None when there is none.
    The run's identity (family, architecture, vocabulary) must match the checkpoint's.
    """
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    saved = common.get("identity", {})
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {v!r}" for k, v in identity.items()
             if saved.get(k) != v]
    if diffs:
        raise ValueError(f"--load {root}: the checkpoint at iteration {iteration} does not match "
                         f"this run ({'; '.join(diffs)})")
    state = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), path)
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(state[_model_key(model, i)])
    if optimizer is not None:
        with torch.no_grad():  # the distributed optimizer copies into views of the fp32 params
            optimizer.load_state_dict(state["optimizer"])
        _restore_adam_step(optimizer, state["optimizer"])
    scheduler.load_state_dict(common["opt_param_scheduler"])
    return common
