"""What the run reports, and how often it evaluates."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, positive_int


@dataclass(frozen=True)
class LoggingConfig(FlagGroup):
    GROUP = "logging and evaluation"
    log_interval: int = flag(10, type=positive_int, help="iterations between log lines")
    eval_interval: int | None = flag(type=positive_int, help="iterations between validations (and one at the end)")
    eval_iters: int = flag(10, type=positive_int, help="global batches per validation")
    tensorboard_dir: str | None = flag(help="TensorBoard event directory")
    metrics_file: str | None = flag(help="append one JSON line per logged iteration and per validation (last rank)")
