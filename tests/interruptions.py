"""Interrupting a tool mid-run without racing it: the tests of kills and Ctrl-C during
preprocessing stop the tool's session before they interrupt it, so the interruption lands before
the tool publishes its outputs however late the test sees the moment it waited for."""
import contextlib
import os
import signal
import subprocess
import tempfile
import time

import pytest
from conftest import REPO


def wait_for(pred, timeout=60.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return True
        time.sleep(0.005)
    return False


def pool_workers(p) -> list:
    """The worker processes of `p`'s process pool (psutil.Process), multiprocessing's resource
    tracker left out."""
    import psutil

    return [c for c in psutil.Process(p.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]


def interrupt_before_publishing(argv, ready, outputs, interrupt, attempts=3):
    """Run the tool `argv` in a session of its own until `ready(p)`, stop the session there and,
    unless any of its `outputs` exists yet, `interrupt(p)` before letting it go on; returns
    (p, stderr) once it has ended. On a loaded machine a whole shard once finished between the
    test seeing its first tokens and its Ctrl-C. A run that published first tests nothing: its
    outputs go, and it runs again."""
    for _ in range(attempts):
        # stderr to a file: a worker that outlives the tool (what some tests look for) would hold a pipe open
        with tempfile.TemporaryFile("w+") as stderr:
            p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO, start_new_session=True)
            in_time = wait_for(lambda p=p: p.poll() is not None or ready(p))
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGSTOP)
            missed = any(os.path.exists(f) for f in outputs)
            if not in_time:
                os.killpg(p.pid, signal.SIGKILL)
            elif not missed and p.poll() is None:  # one that ended unpublished is for the caller to judge
                interrupt(p)
            with contextlib.suppress(ProcessLookupError):  # a SIGKILL may have ended the whole session
                os.killpg(p.pid, signal.SIGCONT)
            p.wait(timeout=60)
            stderr.seek(0)
            err = stderr.read()
        assert in_time, f"never ready: {err[-3000:]}"
        if not missed:
            return p, err
        for f in filter(os.path.exists, outputs):
            os.remove(f)
    pytest.fail(f"{argv[1]} published its outputs before it could be stopped, {attempts} times")
