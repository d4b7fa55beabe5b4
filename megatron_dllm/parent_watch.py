"""Child processes that end when the process that started them dies.

torchrun starts every rank in a session of its own, and a process pool's workers are plain
children: if the launcher is SIGKILLed (no chance to clean up), they would go on training,
saving or tokenizing. A daemon thread polls the parent pid; once the parent is gone the child
kills itself at once, so it never writes anything more. Polling (rather than Linux's
PR_SET_PDEATHSIG) also works where the launcher's spawning thread is not its main thread.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

POLL_SECONDS = 0.5
_started = False


def _watch(parent: int, what: str) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    print(f"{what} (pid {os.getpid()}): parent process {parent} died; exiting", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(what: str) -> None:
    """Start a watch in this process even if the process it was forked from had one (threads do
    not survive a fork)."""
    threading.Thread(target=_watch, args=(os.getppid(), what), name="parent-watch", daemon=True).start()


def watch_forked_children(what: str) -> None:
    """Every process forked from this one from now on (megatron-core's per-bucket checkpoint
    writers, which have no watch of their own) starts a watch of this process."""
    os.register_at_fork(after_in_child=lambda: watch_parent(what))


def exit_when_parent_dies(what: str = "worker") -> None:
    """Start the watch (once per process). `what` names the process in the exit message."""
    global _started
    if _started:
        return
    _started = True
    threading.Thread(target=_watch, args=(os.getppid(), what), name="parent-watch", daemon=True).start()
