"""Where checkpoints are written and which one is loaded."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, non_negative_int, positive_int


@dataclass(frozen=True)
class CheckpointConfig(FlagGroup):
    GROUP = "checkpoints"
    save: str | None = flag(help="checkpoint root to write (default runs/demo-FAMILY/checkpoints on the demo)")
    save_interval: int | None = flag(type=positive_int, help="iterations between saves (and one at the end)")
    load: str | None = flag(help="checkpoint root (loads the iteration its tracker names; without a tracker the "
                                 "newest complete checkpoint) or one iter_XXXXXXX directory")
    ckpt_step: int | None = flag(type=non_negative_int, help="--load: the iteration to load from the root")
    no_load_optim: bool = flag(False, action="store_true",
                               help="--load: leave the optimizer state fresh (weights, LR schedule, counters "
                                    "still load)")
    no_load_rng: bool = flag(False, action="store_true", help="--load: do not restore the RNG states")
    override_opt_param_scheduler: bool = flag(
        False, action="store_true", aliases=("--override-opt_param-scheduler",),
        help="--load: train with this run's LR schedule, weight decay and Adam betas/eps where they differ from "
             "the checkpoint's (without this or the next flag a difference is refused)")
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, action="store_true", aliases=("--use-checkpoint-opt_param-scheduler",),
        help="--load: keep the checkpoint's LR schedule, weight decay and Adam betas/eps whatever the flags say")
    finetune: bool = flag(False, action="store_true", help="--load: weights only; iteration and consumed samples "
                                                           "restart at 0, fresh optimizer and LR schedule")
    pretrained_checkpoint: str | None = flag(
        help="while --load holds no checkpoint, start from this one as --finetune does; once the run has saved, "
             "--load resumes it, so the same command continues the run (Megatron-LM's meaning; give --load and "
             "--save the same directory)")
    async_save: bool = flag(False, action="store_true",
                            help="write checkpoints in the background (megatron-core's asynchronous save); "
                                 "training continues meanwhile")
    keep_last_n_checkpoints: int | None = flag(type=positive_int,
                                               help="remove complete checkpoints older than the newest N (the "
                                                    "tracked one and those newer than it stay)")
    keep_checkpoint_interval: int | None = flag(type=positive_int,
                                                help="with --keep-last-n-checkpoints: also keep every checkpoint "
                                                     "whose iteration is a multiple of this")
