"""The optimizer settings a resume must agree on: the LR and weight-decay schedule (megatron-core's
OptimizerParamScheduler) and AdamW's betas and eps.

megatron-core keeps them in three places that a resume restores separately: the scheduler's own
state, every param group's `max_lr`/`min_lr` (which the scheduler reads before its own), and torch's
param groups (betas, eps). A flag changed between save and resume would be overruled by the
checkpoint in some of them and not in others. So the run's and the checkpoint's settings are
compared up front: equal, they load as saved; different, the run says which to train with
(Megatron-LM's --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler), and
`apply` writes the chosen ones into all three places.
"""
from __future__ import annotations

import math

# setting -> the flag(s) that set it, for messages
FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "warmup (--lr-warmup-iters/--lr-warmup-fraction)",
    "lr_decay_steps": "decay (--lr-decay-iters, default --train-iters)", "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay", "wsd_decay_steps": "--lr-wsd-decay-iters",
    "lr_wsd_decay_style": "--lr-wsd-decay-style", "adam_betas": "--adam-beta1/--adam-beta2", "adam_eps": "--adam-eps",
}
WSD_ONLY = ("wsd_decay_steps", "lr_wsd_decay_style")  # read by the WSD decay style only
# what megatron's state_dict leaves out; saved beside it (megatron's loader ignores extra keys)
EXTRA_SCHEDULER_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")


def _groups(optimizer) -> list[dict]:
    return [group for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for group in opt.optimizer.param_groups]


def scheduler_state(scheduler) -> dict:
    """The scheduler's state as a checkpoint stores it: megatron's, plus the WSD decay it omits."""
    return {**scheduler.state_dict(), **{key: getattr(scheduler, key) for key in EXTRA_SCHEDULER_KEYS}}


def adam_state(optimizer) -> dict:
    """AdamW's betas and eps (every param group has the run's)."""
    group = _groups(optimizer)[0]
    return {"adam_betas": list(group["betas"]), "adam_eps": group["eps"]}


def of_run(scheduler, optimizer) -> dict:
    """The settings this run's flags gave (read before anything is loaded)."""
    return {**{key: value for key, value in scheduler_state(scheduler).items() if key in FLAGS},
            **adam_state(optimizer)}


def of_checkpoint(scheduler: dict, adam: dict | None) -> dict:
    """The settings a checkpoint recorded; older checkpoints lack the WSD decay and Adam's."""
    return {key: value for key, value in {**scheduler, **(adam or {})}.items() if key in FLAGS}


def differences(run: dict, saved: dict) -> list[str]:
    """'FLAG RUN (checkpoint SAVED)' for each setting both record and that differ."""
    wsd = run.get("lr_decay_style") == "WSD" or saved.get("lr_decay_style") == "WSD"
    return [f"{FLAGS[key]} {_shown(run[key])} (checkpoint {_shown(saved[key])})"
            for key in FLAGS if key in run and key in saved and _shown(run[key]) != _shown(saved[key])
            and (wsd or key not in WSD_ONLY) and not _rounded_warmup(key, run[key], saved[key])]


def _rounded_warmup(key: str, run, saved) -> bool:
    """Whether a checkpoint holds the warmup of the run's --lr-warmup-fraction as earlier versions
    rounded it, down to whole iterations (it resumes with the checkpoint's)."""
    return (key == "lr_warmup_steps" and isinstance(saved, int) and isinstance(run, float)
            and saved == math.floor(run))


def _shown(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def apply(settings: dict, optimizer, scheduler) -> None:
    """Train with `settings` from here on: the scheduler's, every param group's, then the LR and
    weight decay of the current step (megatron's loader sets the step's weight decay before it
    reads the saved one)."""
    for key, value in settings.items():
        if hasattr(scheduler, key):
            setattr(scheduler, key, value)
    if "start_wd" in settings:
        scheduler.end_wd = settings["start_wd"]  # constant weight decay: one flag sets both
    if optimizer is not None:
        for group in _groups(optimizer):
            group.update(max_lr=scheduler.max_lr, min_lr=scheduler.min_lr)
            if "adam_betas" in settings:
                group["betas"] = tuple(settings["adam_betas"])
            if "adam_eps" in settings:
                group["eps"] = settings["adam_eps"]
    scheduler.step(increment=0)
