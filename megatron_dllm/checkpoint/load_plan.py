"""What `--load` brings back, decided from the flags and the checkpoint's metadata before any
tensor is read; `training_state.load_checkpoint` then carries the plan out.

    nothing    no --load (or --load is --save and holds nothing yet): iteration 0, fresh weights
    resume     weights, optimizer (unless --no-load-optim), LR schedule, RNG (unless --no-load-rng),
               EMA; training continues at the saved iteration and consumed samples. The optimizer
               settings (LR schedule, weight decay, Adam's betas and eps) must equal the
               checkpoint's, or the run says whose to keep (`optimizer_settings`)
    finetune   --finetune: weights only, iteration and consumed samples start again at 0; the
               family may differ from the checkpoint's (adapting an AR model to a diffusion family)
    converted  a model-only checkpoint (written by a converter): weights only, at its iteration

A checkpoint saved under another (PP, TP, DP) layout is resharded by megatron-core on load (the
weights freely, the distributed optimizer's state across DP); its per-rank RNG states belong to
ranks that no longer exist, so they are left out (`LoadPlan.reshard`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from megatron_dllm.checkpoint import optimizer_settings as settings
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.layout import TRACKER, Found
from megatron_dllm.checkpoint.manifest import CheckpointError
from megatron_dllm.checkpoint.meta import CheckpointMeta
from megatron_dllm.checkpoint.tokenizer_record import check_tokenizer
from megatron_dllm.config.checkpoint import CheckpointConfig

NOTHING, RESUME, FINETUNE, CONVERTED = "nothing", "resume", "finetune", "converted"


@dataclass(frozen=True)
class LoadPlan:
    kind: str
    layout: tuple[int, int, int]  # this run's (PP, TP, DP)
    path: str | None = None
    meta: CheckpointMeta | None = None
    optimizer: bool = False  # load the optimizer state
    scheduler: bool = False  # restore the LR schedule
    rng: bool = False  # restore every rank's RNG states
    ema: bool = False  # load the EMA weights (else a run with EMA starts it at the loaded weights)
    iteration: int = 0  # where training continues
    consumed_samples: int = 0
    optimizer_settings: dict | None = None  # with `scheduler`: the settings to train with
    data_offset: int = 0  # consumed samples when the current data mix started
    notes: tuple[str, ...] = ()  # the decisions worth a log line

    @property
    def reshard(self) -> bool:
        saved = self.meta.rng_layout if self.meta is not None else None
        return saved is not None and saved != self.layout

    def describe(self) -> str:
        """What the load brings back, for the log line."""
        if self.kind == FINETUNE:
            return "weights only (--finetune)"
        if self.kind == CONVERTED:
            return "weights only (a model-only checkpoint)"
        return ("weights" + (", optimizer" if self.optimizer else "") + (", RNG" if self.rng else "")
                + (", EMA" if self.ema else ""))


def plan_load(ckpt: CheckpointConfig, found: Found | None, meta: CheckpointMeta | None, *, identity: ModelIdentity,
              layout: tuple[int, int, int], optimizer: bool, ema_decay: float | None, data_path,
              tokenizer_model: str | None, optimizer_settings: dict | None = None,
              distributed_optimizer: bool = False) -> LoadPlan:
    """The plan for `--load` given `found` (`checkpoint.locate`) and its `meta`, for a run of
    `identity` under `layout` with an optimizer or not, its --ema-decay (None: no EMA) and the
    `optimizer_settings` its flags gave (`optimizer_settings.of_run`) and whether it uses the
    distributed optimizer. A checkpoint of another model or tokenizer, of other optimizer
    settings without a say on whose to keep, of optimizer state this run cannot read, or whose
    EMA the run would drop, is refused here, before any tensor is read."""
    layout = tuple(layout)
    if found is None:
        if not ckpt.load:
            return LoadPlan(NOTHING, layout)
        if ckpt.save and os.path.abspath(ckpt.load) == os.path.abspath(ckpt.save):  # the resume idiom
            return LoadPlan(NOTHING, layout, notes=(f"no checkpoint in {ckpt.load}: starting from iteration 0",))
        what = ("holds no checkpoint" if os.path.isdir(ckpt.load) else
                "is a file, not a checkpoint directory" if os.path.exists(ckpt.load) else "does not exist")
        raise CheckpointError(f"--load {ckpt.load} {what} (expected {TRACKER} or iter_XXXXXXX directories, "
                              f"or a checkpoint directory itself)")
    path = found.path
    diffs = identity.differences(meta.identity.as_dict(), weights_only=ckpt.finetune)
    if diffs:
        raise CheckpointError(f"--load {path}: the checkpoint at iteration {meta.iteration} does not match "
                              f"this run ({'; '.join(diffs)})")
    if tokenizer_model:
        check_tokenizer(meta.tokenizer, tokenizer_model, path)
    if ckpt.finetune:
        family = meta.identity.family
        adapted = f"--finetune: the weights of a --family {family} model, trained as --family {identity.family}"
        return LoadPlan(FINETUNE, layout, path, meta, notes=(adapted,) if family != identity.family else ())
    if meta.model_only:
        return LoadPlan(CONVERTED, layout, path, meta, iteration=meta.iteration,
                        consumed_samples=meta.consumed_samples, data_offset=meta.data_mix_start or 0)
    plan = LoadPlan(RESUME, layout, path, meta, optimizer=optimizer and not ckpt.no_load_optim, scheduler=True,
                    ema=ema_decay is not None and meta.ema_decay is not None, iteration=meta.iteration,
                    consumed_samples=meta.consumed_samples, data_offset=meta.data_mix_start or 0)
    if plan.optimizer:
        _check_optimizer_state(path, meta, layout, distributed_optimizer)
    notes = []
    if meta.ema_decay is not None and ema_decay is None:
        raise CheckpointError(f"--load {path}: the checkpoint holds EMA weights (decay {meta.ema_decay}), which this "
                              f"run without --ema-decay would leave out of every later checkpoint; give --ema-decay "
                              f"{meta.ema_decay} to keep them")
    if plan.ema and ema_decay != meta.ema_decay:
        notes.append(f"EMA decay {meta.ema_decay} -> {ema_decay} (--ema-decay) from iteration {meta.iteration}")
    if optimizer_settings is not None:
        chosen, note = _choose_settings(ckpt, path, meta, optimizer_settings)
        plan = replace(plan, optimizer_settings=chosen)
        notes += [note] if note else []
    wants_rng = not ckpt.no_load_rng and meta.rng_layout is not None
    if wants_rng and plan.reshard:
        notes.append(f"not restoring RNG states: saved under (PP, TP, DP) = {meta.rng_layout}, loading under {layout}")
    if meta.data_mix_changed(data_path):  # e.g. the phase-2 mix from a phase-1 checkpoint
        notes.append(f"data mix changed at iteration {meta.iteration}: {_as_saved(meta.data_mix)} -> "
                     f"{_as_saved(data_path)}; reading the new mix from its first sample")
        plan = replace(plan, data_offset=meta.consumed_samples)
    return replace(plan, rng=wants_rng and not plan.reshard, notes=tuple(notes))


def _check_optimizer_state(path: str, meta: CheckpointMeta, layout: tuple, distributed: bool) -> None:
    """megatron-core reads an optimizer state only as the kind of optimizer that saved it, and the
    distributed optimizer's (saved dp_reshardable) only under the same TP and PP."""
    fresh = "or --no-load-optim for a fresh optimizer state"
    if meta.distributed_optimizer is not None and meta.distributed_optimizer != distributed:
        saved, run = ("with", "without") if meta.distributed_optimizer else ("without", "with")
        raise CheckpointError(f"--load {path}: its optimizer state was saved {saved} --use-distributed-optimizer and "
                              f"this run is {run} it: give the checkpoint's setting, {fresh}")
    if meta.distributed_optimizer and meta.rng_layout is not None and tuple(meta.rng_layout[:2]) != layout[:2]:
        (pp, tp), (run_pp, run_tp) = meta.rng_layout[:2], layout[:2]
        raise CheckpointError(f"--load {path}: its distributed optimizer state reshards across data parallelism only "
                              f"(saved at TP={tp}, PP={pp}; this run TP={run_tp}, PP={run_pp}): load it at TP={tp}, "
                              f"PP={pp}, {fresh}")


def _choose_settings(ckpt: CheckpointConfig, path: str, meta: CheckpointMeta, run: dict) -> tuple[dict, str | None]:
    """(the optimizer settings to resume with, a note when they differ from the checkpoint's)."""
    saved = settings.of_checkpoint(meta.scheduler, meta.adam)
    # the checkpoint's where it records them; an older one's Adam settings stay as its param groups load
    kept = {**{key: value for key, value in run.items() if not key.startswith("adam_")}, **saved}
    diffs = settings.differences(run, saved)
    if not diffs:
        return kept, None
    if ckpt.override_opt_param_scheduler:
        return run, f"training with this run's optimizer settings (--override-opt-param-scheduler): {'; '.join(diffs)}"
    if ckpt.use_checkpoint_opt_param_scheduler:
        return kept, (f"keeping the checkpoint's optimizer settings (--use-checkpoint-opt-param-scheduler) over "
                      f"the flags': {'; '.join(diffs)}")
    raise CheckpointError(f"--load {path}: this run's optimizer settings differ from the checkpoint's at iteration "
                          f"{meta.iteration}: {'; '.join(diffs)}; give --override-opt-param-scheduler to train with "
                          f"the flags', or --use-checkpoint-opt-param-scheduler to keep the checkpoint's")


def _as_saved(data_path) -> list | None:
    """A mix as the log has always shown it (the list the flag gave)."""
    return list(data_path) if data_path is not None else None
