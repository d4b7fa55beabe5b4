"""One writer at a time: an exclusive lock on an output (a checkpoint root, a dataset prefix).

The lock is a file beside the output (`ROOT/.dllm-writer.lock`, `PREFIX.lock`) that holds who
writes: host, pid, start time and command, so a second writer can name the first. Two ways to
hold it, chosen per filesystem:

- `fcntl.flock` (local disks, NFSv4, Lustre mounted with `-o flock`): the kernel releases the
  lock when its holder dies, however it dies, so a lock left by a killed run is simply taken
  over (with a message naming the dead writer).
- Where flock is refused (ENOLCK, EOPNOTSUPP, ENOSYS: Lustre without `-o flock`, some NFS
  setups), the lock file itself is the lock, created with O_EXCL. A lock whose writer ran on
  this host and is gone is taken over; one from another host cannot be checked from here, so it
  is refused with its owner named, and must be removed by hand once that run is known dead.

`DLLM_LOCK_MODE=file` forces the second way (for tests, or a filesystem whose flock is unsafe).
The holder removes the file on release; a forked child (a pool worker, megatron-core's async
writer) inherits the flock but never releases it, so the lock lasts while any of them runs.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutputLockedError(OSError):
    """Another writer holds the output (or its lock cannot be taken); the message names it."""


def lock_path_for_dir(directory: str) -> str:
    return os.path.join(directory, ".dllm-writer.lock")


def lock_path_for_prefix(prefix: str) -> str:
    return prefix + ".lock"


def _describe(owner: dict | None) -> str:
    if not owner:
        return "a writer whose record is empty"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("start_time", 0)))
    command = owner.get("command", "")
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started {started}"
            + (f" ({command[:200]})" if command else ""))


def _read_owner(path: str) -> dict | None:
    try:
        with open(path) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def pid_alive(pid) -> bool:
    """Whether a process of this pid runs on this host."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """An exclusive lock on one output, named by `flag` in messages (e.g. `--save DIR`)."""

    def __init__(self, path: str, flag: str, log=None):
        self.path, self.flag = path, flag
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._fd: int | None = None
        self._pid = None

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start_time": time.time(),
                           "command": " ".join(sys.argv)}).encode()

    def acquire(self) -> OutputLock:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if os.environ.get("DLLM_LOCK_MODE") == "file" or not self._acquire_flock():
                self._acquire_file()
        except OutputLockedError:
            raise
        except OSError as err:  # a read-only or full place, or a file in the way: name the output, not the lock
            directory = os.path.dirname(os.path.abspath(self.path))
            if isinstance(err, (FileExistsError, NotADirectoryError)):
                raise OutputLockedError(f"{self.flag}: {err.filename or directory} is a file, expected a directory") \
                    from None
            raise OutputLockedError(f"{self.flag}: cannot write to {directory} ({err.strerror or err})") from None
        self._pid = os.getpid()
        return self

    def _acquire_flock(self) -> bool:
        """True once held; False when this filesystem does not support flock."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(self.path)
                os.close(fd)
                raise OutputLockedError(f"{self.flag}: another writer is using it: {_describe(owner)}; "
                                        f"lock file {self.path}") from None
            except OSError as err:
                os.close(fd)
                if err.errno in _NO_FLOCK:
                    return False
                raise
            try:  # the file we locked may have been released and unlinked meanwhile: lock the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = _read_owner(self.path)
            if previous:
                self.log(f"{self.flag}: taking over the lock left by {_describe(previous)}, "
                         f"which is no longer running")
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._record(), 0)
            os.fsync(fd)
            self._fd = fd
            return True

    def _acquire_file(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = _read_owner(self.path)
                stale = owner and owner.get("host") == socket.gethostname() and not pid_alive(owner.get("pid"))
                if not stale:
                    if not owner:  # created, its record not yet written (or never: killed in between)
                        where = "starting now, or killed while starting: remove the lock file if no writer runs"
                    elif owner.get("host") == socket.gethostname():
                        where = "still running"
                    else:
                        where = ("on another host, which cannot be checked from here: remove the lock file "
                                 "once that run is known to be dead")
                    raise OutputLockedError(f"{self.flag}: another writer is using it: {_describe(owner)}, "
                                            f"{where}; lock file {self.path}") from None
                self.log(f"{self.flag}: taking over the lock left by {_describe(owner)}, "
                         f"which is no longer running")
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            os.write(fd, self._record())
            os.fsync(fd)
            self._fd = fd
            return
        raise OutputLockedError(f"{self.flag}: could not take the lock file {self.path} (other writers keep "
                                f"replacing it)")

    def release(self) -> None:
        """Remove the lock (only in the process that took it; a forked child's copy does nothing)."""
        if self._fd is None or os.getpid() != self._pid:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def exclusive(path: str, flag: str, log=None):
    """`with exclusive(lock_path, "--output-prefix P"):` hold the lock while writing."""
    with OutputLock(path, flag, log):
        yield
