"""Training checkpoints through megatron-core distributed checkpointing (torch_dist), saved and
found through `megatron_dllm.checkpoint` (Megatron's layout, staged saves, manifests).

Besides the sharded model and optimizer, a checkpoint holds
  - "ema" (with --ema-decay): the EMA weights, sharded like "model", keys prefixed "ema."
  - "rng_state": every rank's RNG states (python, numpy, torch CPU, CUDA, megatron's
    model-parallel tracker) as a ShardedObject keyed by (pp, tp, dp) rank, as Megatron-LM;
    restored only under the same layout
  - in the common state: iteration, LR schedule, consumed samples, identity, data mix, tokenizer.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_dllm import checkpoint, platform
from megatron_dllm.checkpoint import CheckpointError


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
             "cuda": platform.device_rng_state(),
             "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    ranks = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
             parallel_state.get_data_parallel_rank())
    return ShardedObject("rng_state", state, tuple(_rng_layout()), ranks, replica_id=0)


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    platform.set_device_rng_state(state["cuda"])
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


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, extra: dict, ema=None,
                    async_queue=None, on_complete=None) -> str:
    """Save; `extra` (consumed samples, the run's identity, ...) goes into the common state.
    `async_queue`, `on_complete`: see `checkpoint.save`."""
    state = _sharded_state(model, optimizer, is_loading=False)
    if ema is not None:
        state["ema"] = ema.sharded_state_dict(lambda i: _model_key(model, i))
        state["ema_decay"] = ema.decay
    state["rng_state"] = _rng_sharded_object()
    state["rng_layout"] = _rng_layout()
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    state.update(extra)
    return checkpoint.save(root, iteration, state, async_queue=async_queue, on_complete=on_complete)


def load_checkpoint(path: str, model, optimizer, scheduler, identity, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, ema=None, log=print) -> dict:
    """Load the checkpoint directory `path` (found and verified by `checkpoint.locate`) into
    model/optimizer/scheduler and return its common state (iteration, consumed samples, ...).

    The run's `ModelIdentity` (family, architecture, vocabulary) must match the checkpoint's.
    `load_optim=False` leaves the optimizer fresh (the LR schedule is still restored); `finetune`
    loads the weights only (no optimizer, schedule, RNG or EMA), as happens for a model-only
    checkpoint. With `ema`, the checkpoint's EMA weights are loaded when it has them (else the EMA
    starts at the loaded weights).
    """
    common = checkpoint.read(path, dist_checkpointing.load_common_state_dict, path)
    iteration = common.get("iteration")
    diffs = identity.differences(common.get("identity", {}))
    if diffs:
        raise CheckpointError(f"--load {path}: the checkpoint at iteration {iteration} does not match "
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
    state = checkpoint.read(path, dist_checkpointing.load, sharded, path)
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

