"""What the run reports, and how often it evaluates."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, positive_float, positive_int


@dataclass(frozen=True)
class LoggingConfig(FlagGroup):
    GROUP = "logging and evaluation"
    log_interval: int = flag(10, type=positive_int, help="iterations between log lines")
    eval_interval: int | None = flag(type=positive_int, help="iterations between validations (and one at the end)")
    eval_iters: int = flag(10, type=positive_int, help="global batches per validation")
    tensorboard_dir: str | None = flag(help="TensorBoard event directory")
    metrics_file: str | None = flag(help="append one JSON line per logged iteration and per validation (last rank)")
    # ---- observability
    peak_flops: float | None = flag(type=positive_float,
                                    help="the device's peak FLOP/s for MFU (default: the known device's dense "
                                         "peak at the run's precision)")
    timing_log_level: int = flag(1, type=int, choices=[0, 1, 2],
                                 help="megatron-core timers: 0 iteration time only, 1 phases (data, "
                                      "forward-backward, gradient sync, optimizer), 2 also the schedule's forward and "
                                      "backward compute")
    wandb_project: str | None = flag(help="log to Weights & Biases under this project (pip install wandb)")
    wandb_exp_name: str | None = flag(help="the W&B run name")
    wandb_save_dir: str | None = flag(help="the W&B local directory (default: --save/wandb, else "
                                           "--tensorboard-dir/wandb)")
    profile: bool = flag(False, action="store_true",
                         help="torch profiler traces (and a CUDA memory snapshot on GPU) into --tensorboard-dir")
    profile_step_start: int = flag(10, type=positive_int, help="--profile: first profiled iteration")
    profile_step_end: int = flag(12, type=positive_int, help="--profile: iteration where profiling stops")
    profile_ranks: list | None = flag(type=int, nargs="+", help="--profile: the global ranks to profile (default 0)")
