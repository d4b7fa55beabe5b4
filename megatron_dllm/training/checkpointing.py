"""Checkpoints through megatron-core distributed checkpointing (torch_dist), Megatron's layout:

    SAVE/iter_0000100/...             sharded model + optimizer (reshardable), scheduler, state
    SAVE/latest_checkpointed_iteration.txt

The pointer file is written (atomically) only after every rank finished saving, so a directory
without it, or newer than it, is never taken for a finished checkpoint: a run killed during a
save leaves such a partial `iter_*` directory, which the next load reports and removes (and a
save into an existing directory first removes what is there).

Besides the sharded model and optimizer, a checkpoint holds
  - "ema" (with --ema-decay): the EMA weights, sharded like "model", keys prefixed "ema."
  - "rng_state": every rank's RNG states (python, numpy, torch CPU, CUDA, megatron's
    model-parallel tracker) as a ShardedObject keyed by (pp, tp, dp) rank, as Megatron-LM;
    restored only under the same layout
  - in the common state: iteration, LR schedule, consumed samples, identity, data mix.
"""
from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_dllm import platform

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


def _rng_layout() -> list[int]:
    return [parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size()]


def _rng_sharded_object() -> ShardedObject:
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if platform.HAS_CUDA else None,
             "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    ranks = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
             parallel_state.get_data_parallel_rank())
    return ShardedObject("rng_state", state, tuple(_rng_layout()), ranks, replica_id=0)


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if platform.HAS_CUDA and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


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


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, extra: dict, ema=None) -> str:
    """Save; `extra` (consumed samples, the run's identity, ...) goes into the common state."""
    path = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        if os.path.exists(path):  # a partial save of this iteration (or an old run's): start clean
            shutil.rmtree(path)
        os.makedirs(path)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    if ema is not None:
        state["ema"] = ema.sharded_state_dict(lambda i: _model_key(model, i))
        state["ema_decay"] = ema.decay
    state["rng_state"] = _rng_sharded_object()
    state["rng_layout"] = _rng_layout()
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


def remove_partial_checkpoints(root: str, log=print) -> list[str]:
    """Remove every `iter_*` directory newer than the tracker (all of them without one): saves
    that never finished (a run killed during a save). Returns the removed paths."""
    partial = None
    if dist.get_rank() == 0:
        done = latest_iteration(root)
        partial = sorted(os.path.join(root, name) for name in (os.listdir(root) if os.path.isdir(root) else [])
                         if (m := re.fullmatch(r"iter_(\d+)", name)) and (done is None or int(m.group(1)) > done)
                         and os.path.isdir(os.path.join(root, name)))
        for path in partial:
            shutil.rmtree(path)
    holder = [partial]
    dist.broadcast_object_list(holder, src=0)
    for path in holder[0]:
        log(f"removed partial checkpoint {path} (newer than {TRACKER}: a save that never finished)")
    return holder[0]


def load_checkpoint(root: str, model, optimizer, scheduler, identity: dict, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, ema=None, log=print) -> dict | None:
    """Load the latest finished checkpoint under `root` into model/optimizer/scheduler.

    Returns the common state (iteration, consumed samples, ...), or None when there is none.
    The run's identity (family, architecture, vocabulary) must match the checkpoint's.
    Partial (unfinished) iteration directories are removed first. `load_optim=False` leaves the
    optimizer fresh (the LR schedule is still restored); `finetune` loads the weights only (no
    optimizer, schedule, RNG or EMA), as happens for a model-only checkpoint. With `ema`, the checkpoint's EMA weights are loaded when it
    has them (else the EMA starts at the loaded weights).
    """
    remove_partial_checkpoints(root, log)
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
    # a model-only checkpoint (tools/convert_from_hf.py) starts training from its weights
    weights_only = finetune or "opt_param_scheduler" not in common
    if weights_only:
        load_optim = load_rng = False
    load_optim = load_optim and optimizer is not None
    sharded = _sharded_state(model, optimizer if load_optim else None, is_loading=True)
    load_ema = ema is not None and not finetune and "ema_decay" in common
    if load_ema:
        sharded["ema"] = ema.sharded_state_dict(lambda i: _model_key(model, i))
    if load_rng and common.get("rng_layout") is not None:
        if common["rng_layout"] == _rng_layout():
            sharded["rng_state"] = _rng_sharded_object()
        else:
            log(f"not restoring RNG states: saved under (PP, TP, DP) = {tuple(common['rng_layout'])}, "
                f"loading under {tuple(_rng_layout())}")
    state = dist_checkpointing.load(sharded, path)
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(state[_model_key(model, i)])
    if load_optim:
        with torch.no_grad():  # the distributed optimizer copies into views of the fp32 params
            optimizer.load_state_dict(state["optimizer"])
        _restore_adam_step(optimizer, state["optimizer"])
    if not weights_only:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if "rng_state" in sharded:
        _restore_rng(state["rng_state"])
    if ema is not None:
        if load_ema:
            ema.load(sharded["ema"], state["ema"])
        else:
            ema.reset()
            log(f"EMA starts at the weights loaded from iteration {iteration}"
                + ("" if finetune else " (the checkpoint holds no EMA)"))
    what = ("weights only (--finetune)" if finetune else "weights only (a model-only checkpoint)" if weights_only
            else "weights" + (", optimizer" if load_optim else "") + (", RNG" if "rng_state" in sharded else "")
            + (", EMA" if load_ema else ""))
    log(f"loaded checkpoint {path} at iteration {iteration}: {what}")
    return common
