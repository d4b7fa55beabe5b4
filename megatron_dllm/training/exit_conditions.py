"""Leaving a run before --train-iters, as Megatron-LM does: on a signal (--exit-signal-handler:
SIGTERM or SIGUSR1, e.g. a scheduler's warning before its time limit), after a wall-clock
duration (--exit-duration-in-mins) or at an iteration (--exit-interval). The trainer then saves
and exits 0, and the same command resumes exactly.

Every rank must stop after the same iteration, so the decision is one all-reduce (MAX) of each
rank's own reasons: a signal delivered to one rank only still stops them all together.
"""
from __future__ import annotations

import signal
import time

import psutil

from megatron_dllm import platform
from megatron_dllm.config.training import TrainingConfig

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitConditions:
    def __init__(self, training: TrainingConfig):
        self.training = training
        # the wall clock counts from process start (imports, data, load): what a scheduler counts
        self.start = psutil.Process().create_time()
        self.received: int | None = None
        if training.exit_signal_handler:
            for sig in SIGNALS:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum  # acted on after the current iteration, never inside it

    def minutes_up(self) -> float:
        return (time.time() - self.start) / 60

    def reason(self, iteration: int) -> str | None:
        """Why the run should save and exit after `iteration` (the same answer on every rank),
        or None. Collective when a signal handler or a duration is set."""
        training = self.training
        # 0 minutes means off, as in Megatron-LM (`if args.exit_duration_in_mins:`)
        local = [self.received is not None,
                 bool(training.exit_duration_in_mins) and self.minutes_up() > training.exit_duration_in_mins]
        if training.exit_signal_handler or training.exit_duration_in_mins:
            local = platform.any_rank(local)
        if local[0]:
            name = signal.Signals(self.received).name if self.received else "a signal (on another rank)"
            return f"received {name}"
        if local[1]:
            return (f"--exit-duration-in-mins {training.exit_duration_in_mins:g} reached "
                    f"({self.minutes_up():.1f} min up)")
        if training.exit_interval and iteration % training.exit_interval == 0:
            return f"--exit-interval {training.exit_interval}"
        return None
