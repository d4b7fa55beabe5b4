"""The processes that write a checkpoint die with the training rank that started them.

megatron-core's asynchronous save writes from a process forked from the rank, which forks worker
processes of its own, and passes their results through a manager process it spawns. None of them
watches its parent: after a SIGKILLed rank they would go on writing into a staging directory the
next run removes, or linger for good. Here every such process gets a parent watch
(`parent_watch.py`), and the results server also leaves the exit signals to its rank.
"""
from __future__ import annotations

import signal


def write_in_background(write, *args, **kwargs):
    """The forked writer: it dies with its training rank, so nothing writes into the staging
    directory after the next run has removed it."""
    from megatron_dllm.parent_watch import watch_parent

    watch_parent("checkpoint writer")
    return write(*args, **kwargs)


_watched = False
_results_manager = None
# The exit signals a scheduler (or torchrun, forwarding its own with killpg) sends the rank's group
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _results_server_init() -> None:
    """Runs first in the results-queue server: the exit signals are its rank's to handle (it would
    die without a handler, and the save in flight and the exit save with it), and it dies with its
    rank instead."""
    from megatron_dllm.parent_watch import watch_parent

    for sig in _EXIT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _EXIT_SIGNALS)
    watch_parent("checkpoint results queue")


def watch(background: bool = True) -> None:
    """Make every process megatron-core starts to write a checkpoint die with this rank (once per
    process). Its writer workers are forked (from this rank, or from the --async-save writer): each
    fork now starts a watch of its parent.

    The results of a synchronous save (`background=False`) are put and taken in the rank itself: a
    plain in-process queue serves them. Those of a background save come from the forked writer,
    through a queue served by a manager process that megatron-core (0.16) spawns, in the rank's
    process group, with neither a watch nor a signal handler: a SIGKILLed rank left it running, and
    a SIGTERM to the group killed it and crashed the rank's save. It is started here instead, and
    put into megatron-core's cache. Starting it costs a spawned interpreter that imports torch to
    read the results (2 to 3 s of CPU per rank), which is why a synchronous save does without."""
    global _watched, _results_manager
    import multiprocessing
    import queue
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dllm.parent_watch import watch_forked_children

    if not _watched:
        _watched = True
        watch_forked_children("checkpoint writer")
    if not background:
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = queue.Queue()
        return
    if _results_manager is None:
        # Starting the spawn context's resource tracker unblocks SIGTERM (multiprocessing does so
        # after its own start): have it running first, so the mask below holds while the server starts.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _EXIT_SIGNALS)  # inherited: none slips in before the ignore
        try:
            _results_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            _results_manager.start(_results_server_init)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a signal that came meanwhile is handled now
        filesystem_async._results_queue = _results_manager.Queue()
