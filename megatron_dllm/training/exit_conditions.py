"""Leaving a run before --train-iters, as Megatron-LM does: on a signal (--exit-signal-handler:
SIGTERM or SIGUSR1, e.g. a scheduler's warning before its time limit), after a wall-clock
duration (--exit-duration-in-mins) or at an iteration (--exit-interval). The trainer then saves
and exits 0, and the same command resumes exactly.

Every rank must stop after the same iteration, so the decision is one all-reduce (MAX) of each
rank's own reasons: a signal delivered to one rank only still stops them all together.
"""
from __future__ import annotations

import multiprocessing
import signal
import time

import psutil
import torch
import torch.distributed as dist

from megatron_dllm.config.training import TrainingConfig

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitConditions:
    def __init__(self, t: TrainingConfig):
        self.t = t
        # the wall clock counts from process start (imports, data, load): what a scheduler counts
        self.start = psutil.Process().create_time()
        self.received: int | None = None
        if t.exit_signal_handler:
            for sig in SIGNALS:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum  # acted on after the current iteration, never inside it

    def minutes_up(self) -> float:
        return (time.time() - self.start) / 60

    def reason(self, iteration: int) -> str | None:
        """Why the run should save and exit after `iteration` (the same answer on every rank),
        or None. Collective when a signal handler or a duration is set."""
        t = self.t
        local = [self.received is not None,
                 t.exit_duration_in_mins is not None and self.minutes_up() > t.exit_duration_in_mins]
        if t.exit_signal_handler or t.exit_duration_in_mins is not None:
            flags = torch.tensor(local, dtype=torch.int)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            local = [bool(f) for f in flags.tolist()]
        if local[0]:
            name = signal.Signals(self.received).name if self.received else "a signal (on another rank)"
            return f"received {name}"
        if local[1]:
            return f"--exit-duration-in-mins {t.exit_duration_in_mins:g} reached ({self.minutes_up():.1f} min up)"
        if t.exit_interval and iteration % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        return None


def _ignore_exit_signals() -> None:
    """Runs first in megatron-core's results-queue server: the exit signals are its rank's, and
    it dies with its rank (a SIGTERM no longer ends it once its rank is SIGKILLed)."""
    from megatron_dllm.parent_watch import watch_parent

    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    watch_parent("async-save results server")


def shield_async_save_server() -> None:
    """With --async-save, megatron-core (0.16) passes the write results through a multiprocessing
    Manager server that it spawns at the first save, in the rank's process group. A SIGTERM to that
    group (torchrun forwards its own SIGTERM with killpg; schedulers signal every process) killed
    the server, which has no handler: the save in flight, and the exit save the signal asked for,
    then failed with BrokenPipeError or EOFError and the rank crashed. So the server is started
    here, ignoring the exit signals (blocked while it starts, so none slips in before the ignore),
    and put into megatron-core's cache. It ends with its rank: a shutdown message at exit, or its
    parent watch."""
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # the spawned child inherits the mask
    try:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(_ignore_exit_signals)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a signal that came meanwhile is handled now
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
