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


def _sharded_state(model, optimizer, is_loading: bool) -> dict:
    state = {}
    for i, chunk in enumerate(model):
        state["model" if len(model) == 1 else f"model{i}"] = chunk.sharded_state_dict()
    if optimizer is not None:
        # fully_reshardable: the distributed optimizer's state in canonical per-parameter form, so
        # checkpoints reshard across TP/PP/DP (megatron's default format cannot be saved in 0.16).
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
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
        chunk.load_state_dict(state["model" if len(model) == 1 else f"model{i}"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(common["opt_param_scheduler"])
    return common
