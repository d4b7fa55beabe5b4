"""Training checkpoints through megatron-core distributed checkpointing (torch_dist), saved and
found through `megatron_dllm.checkpoint` (Megatron's layout, staged saves, manifests).

Besides the sharded model and optimizer, a checkpoint holds
  - "ema" (with --ema-decay): the EMA weights, sharded like "model", keys prefixed "ema."
  - "rng_state": every rank's RNG states (python, numpy, torch CPU, CUDA, megatron's
    model-parallel tracker) as a ShardedObject keyed by (pp, tp, dp) rank, as Megatron-LM;
    restored only under the same layout
  - in the common state: the `CheckpointMeta` (iteration, LR schedule, Adam's betas and eps,
    consumed samples, identity, data mix, tokenizer, RNG layout), as `meta.py` writes and reads it.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_dllm import checkpoint, platform
from megatron_dllm.checkpoint import optimizer_settings
from megatron_dllm.checkpoint.load_plan import FINETUNE, LoadPlan
from megatron_dllm.checkpoint.meta import CheckpointMeta


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


def parallel_layout() -> tuple[int, int, int]:
    """This run's (PP, TP, DP): the layout the per-rank RNG states are saved under."""
    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size())


def _rng_sharded_object() -> ShardedObject:
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": platform.device_rng_state(),
             "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    ranks = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
             parallel_state.get_data_parallel_rank())
    return ShardedObject("rng_state", state, parallel_layout(), ranks, replica_id=0)


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


def save_checkpoint(root: str, meta: CheckpointMeta, model, optimizer, scheduler, ema=None, async_queue=None,
                    on_complete=None) -> str:
    """Save at `meta.iteration`; `meta` (consumed samples, the run's identity, ...) goes into the
    common state with the LR schedule, RNG layout and EMA decay filled in here.
    `async_queue`, `on_complete`: see `checkpoint.save`."""
    state = _sharded_state(model, optimizer, is_loading=False)
    if ema is not None:
        state["ema"] = ema.sharded_state_dict(lambda i: _model_key(model, i))
    state["rng_state"] = _rng_sharded_object()
    meta = meta.replace(scheduler=optimizer_settings.scheduler_state(scheduler),
                        adam=optimizer_settings.adam_state(optimizer), rng_layout=parallel_layout(),
                        ema_decay=ema.decay if ema is not None else None)
    state.update(meta.to_dict())
    return checkpoint.save(root, meta.iteration, state, async_queue=async_queue, on_complete=on_complete)


def load_checkpoint(plan: LoadPlan, model, optimizer, scheduler, ema=None, log=print) -> None:
    """Carry out `plan` (`load_plan.plan_load`): load the checkpoint's weights into `model` and,
    as the plan says, its optimizer state, LR schedule, RNG states and EMA weights. With `ema`
    and no EMA to load, the EMA starts at the loaded weights."""
    path, meta = plan.path, plan.meta
    for note in plan.notes:
        log(note)
    sharded = _sharded_state(model, optimizer if plan.optimizer else None, is_loading=True)
    if plan.ema:
        sharded["ema"] = ema.sharded_state_dict(lambda i: _model_key(model, i))
    if plan.rng:
        sharded["rng_state"] = _rng_sharded_object()
    state = checkpoint.read(path, dist_checkpointing.load, sharded, path)
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(state[_model_key(model, i)])
    if plan.optimizer:
        with torch.no_grad():  # the distributed optimizer copies into views of the fp32 params
            optimizer.load_state_dict(state["optimizer"])
        _restore_adam_step(optimizer, state["optimizer"])
    if plan.scheduler:
        scheduler.load_state_dict(meta.scheduler)
        optimizer_settings.apply(plan.optimizer_settings, optimizer, scheduler)
    if plan.rng:
        _restore_rng(state["rng_state"])
    if ema is not None:
        if plan.ema:
            ema.load(sharded["ema"], state["ema"])
        else:
            ema.reset()
            log(f"EMA starts at the weights loaded from iteration {meta.iteration}"
                + ("" if plan.kind == FINETUNE else " (the checkpoint holds no EMA)"))
    log(f"loaded checkpoint {path} at iteration {meta.iteration}: {plan.describe()}")
