"""Processes started from an interpreter that has already imported torch and megatron-core.

Every `python pretrain_dllm.py` pays 4 to 6 s of CPU importing torch and megatron-core before its
first line of work; on the suite's tiny runs that is most of a launch. A server process imports
them once and forks a child per launch. The child is a real process running the real entry point
as `__main__` (its own pid, working directory, environment, stdout and stderr, signals, exit
status and interpreter shutdown), so a test sees what it would see from `subprocess`; only the
import is shared. Launches whose start-up itself is under test (warnings printed at import, what a
process imports, torchrun's own behaviour) use `subprocess` instead.

Fork safety: the server starts no threads, touches no tensor and initialises no CUDA before forking
(checked at start: a forked child cannot initialise CUDA again, so on a GPU machine conftest hides
the GPUs from the server and starts GPU launches as plain processes).
Python reseeds `random` in every child; torch's generator is in its import-time state, as in a
fresh interpreter.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading

# What the server imports: everything a training rank or a tool imports before its work, and
# TorchDynamo, which megatron_dllm leaves to the first compile but torch.optim imports when the
# first optimizer is built (1.7 s of CPU in every training process).
PRELOAD = ("megatron_dllm.cli.pretrain", "megatron_dllm.training.trainer", "torch._dynamo")
# Variables read while those modules load (or by the interpreter at start): a launch whose value
# differs from the server's starts a plain subprocess.
READ_AT_IMPORT = ("PYTHONPATH", "PYTHONWARNINGS", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "CUDA_VISIBLE_DEVICES", "PYTHONDONTWRITEBYTECODE")
READ_AT_IMPORT_PREFIXES = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_LOGS", "TORCH_COMPILE_")  # dynamo's config


def _serve(path: str) -> dict:
    """The server loop; returns only in a forked child, with its launch request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD reaches the wakeup fd
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection to tell its exit status
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wakeup_r, selectors.EVENT_READ)
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent:  # the test session has gone: so does the server
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is wakeup_r:
                os.read(wakeup_r, 4096)
                continue
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                for fd in (listener.fileno(), wakeup_r, wakeup_w, conn.fileno(),
                           *(c.fileno() for c in waiting.values())):
                    os.close(fd)
                for target, fd in enumerate(fds):  # stdin, stdout, stderr
                    os.dup2(fd, target)
                    os.close(fd)
                return request
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid)
            with contextlib.suppress(OSError):  # the client may have gone (a killed test)
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()
    sys.exit(0)


def _run_child(request: dict) -> None:
    """Become the launched program, `python SCRIPT ARGS...`, from here on."""
    import runpy

    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Python's streams were built on the server's fds; rebuild them on the ones handed over.
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
    sys.argv = list(request["argv"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as the interpreter sets it for a script
    runpy.run_path(sys.argv[0], run_name="__main__")


class PrewarmedProcess:
    """A launched child, with the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(self, conn: socket.socket, args: list[str]):
        self._conn, self._pending, self.args = conn, b"", args
        self.returncode: int | None = None
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> bytes:
        """The server's next line (the pid, then the exit status); TimeoutExpired after `timeout`."""
        while b"\n" not in self._pending:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError(f"the prewarmed server went away while running {self.args}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._line(timeout))
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Server:
    """One server per test session (per pytest-xdist worker), started on first use."""

    def __init__(self, env: dict):
        self.env = env
        self._dir = tempfile.mkdtemp(prefix="prewarmed-")
        self.path = os.path.join(self._dir, "socket")
        self.process = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdout=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the prewarmed server did not start (exit {self.process.wait()})")

    def serves(self, env: dict) -> bool:
        names = {*READ_AT_IMPORT, *(k for k in {*env, *self.env} if k.startswith(READ_AT_IMPORT_PREFIXES))}
        return all(env.get(k) == self.env.get(k) for k in names)

    def popen(self, argv: list[str], cwd, env: dict, stdin, stdout, stderr, start_new_session: bool = False
              ) -> PrewarmedProcess:
        """`subprocess.Popen([sys.executable, *argv], ...)`; stdin, stdout and stderr are open files
        (or fds) the child gets as its own."""
        fds = [f if isinstance(f, int) else f.fileno() for f in (stdin, stdout, stderr)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {"argv": argv, "cwd": str(cwd), "env": env, "new_session": start_new_session}
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        return PrewarmedProcess(conn, argv)

    def run(self, argv: list[str], cwd, env: dict, timeout: float | None = None) -> subprocess.CompletedProcess:
        """`subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`."""
        return self._run_all(argv, cwd, [env], timeout)

    def launch(self, nproc: int, argv: list[str], cwd, env: dict, timeout: float | None = None
               ) -> subprocess.CompletedProcess:
        """`torchrun --standalone --nproc-per-node NPROC` of a script, run-style: the ranks get
        torchrun's environment and rendezvous on a store this process hosts (as torchrun's agent
        does); their output is interleaved in one stdout and one stderr; one failing rank stops the
        others and the launch exits 1, as torchrun does."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False)
        common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
                  "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                  "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True",
                  "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                  "TORCHELASTIC_RUN_ID": "prewarmed"}
        envs = [{**common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)]
        done = self._run_all(argv, cwd, envs, timeout)
        done.returncode = int(done.returncode != 0)
        return done

    def _run_all(self, argv: list[str], cwd, envs: list[dict], timeout: float | None) -> subprocess.CompletedProcess:
        """One child per environment, their output captured together; the first to fail stops the
        others. The exit status is the first non-zero one, else 0."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null:
            children = [self.popen(argv, cwd, env, null, out, err) for env in envs]
            try:
                while None in [child.poll() for child in children]:  # a list: poll every child
                    if any(child.returncode for child in children):
                        for child in children:
                            child.terminate()
                        for child in children:
                            try:
                                child.wait(5)
                            except subprocess.TimeoutExpired:
                                child.kill()
                    elif deadline is not None and time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(argv, timeout)
                    time.sleep(0.02)
            finally:
                for child in children:
                    if child.returncode is None:
                        child.kill()
                        child.wait()
            out.seek(0)
            err.seek(0)
            code = next((child.returncode for child in children if child.returncode), 0)
            return subprocess.CompletedProcess([sys.executable, *argv], code, out.read().decode(errors="replace"),
                                               err.read().decode(errors="replace"))

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


if __name__ == "__main__":
    import importlib

    del sys.path[0]  # this file's folder: a launched script gets its own in its place

    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() != 1:  # forking a threaded process could copy a held lock
        raise SystemExit(f"prewarmed server: importing {PRELOAD} started threads: {threading.enumerate()}")
    if sys.modules["torch"].cuda.is_initialized():  # no child could use the GPU
        raise SystemExit(f"prewarmed server: importing {PRELOAD} initialised CUDA: hide the GPUs from it")
    sys.stdout.flush()
    sys.stderr.flush()
    _run_child(_serve(sys.argv[1]))
