"""`megatron_dllm.output_lock`: one writer at a time, checked with real processes in both modes
(flock, and the O_EXCL lock file that `DLLM_LOCK_MODE=file` forces)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO

from megatron_dllm.output_lock import OutputLock, OutputLockedError, lock_path_for_prefix

# A holder in a process of its own: takes the lock, says so, and keeps it until stdin closes.
HOLDER = """
import sys
from megatron_dllm.output_lock import OutputLock
lock = OutputLock(sys.argv[1], "--output-prefix P").acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def _env(mode):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("DLLM_LOCK_MODE", None)
    if mode == "file":
        env["DLLM_LOCK_MODE"] = "file"
    return env


def _holder(path, mode):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=_env(mode))
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.fixture(params=["flock", "file"])
def mode(request, monkeypatch):
    if request.param == "file":
        monkeypatch.setenv("DLLM_LOCK_MODE", "file")
    else:
        monkeypatch.delenv("DLLM_LOCK_MODE", raising=False)
    return request.param


def test_a_second_process_is_refused_naming_the_first(tmp_path, mode):
    path = lock_path_for_prefix(str(tmp_path / "c_text_document"))
    holder = _holder(path, mode)
    try:
        with pytest.raises(OutputLockedError) as err:
            OutputLock(path, "--output-prefix P").acquire()
        message = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}, started " in message, message
        assert message.startswith("--output-prefix P: another writer is using it") and "\n" not in message
    finally:
        holder.communicate("")
    assert holder.returncode == 0 and not os.path.exists(path)  # release removes the file
    with OutputLock(path, "--output-prefix P"):  # free again
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_the_lock_of_a_sigkilled_holder_is_taken_over(tmp_path, mode):
    path = str(tmp_path / "d.lock")
    holder = _holder(path, mode)
    holder.kill()  # SIGKILL: no release, the file stays
    holder.wait()
    holder.stdin.close()
    holder.stdout.close()
    assert os.path.exists(path)
    logs = []
    with OutputLock(path, "--output-prefix P", log=logs.append):
        assert json.load(open(path))["pid"] == os.getpid()
    assert len(logs) == 1 and f"taking over the lock left by pid {holder.pid}" in logs[0], logs


def test_a_holder_on_another_host_is_refused_in_file_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("DLLM_LOCK_MODE", "file")
    path = str(tmp_path / "d.lock")
    record = {"host": "node-that-is-not-this-one", "pid": 1, "start_time": time.time(), "command": "x"}
    with open(path, "w") as f:
        json.dump(record, f)
    with pytest.raises(OutputLockedError, match="pid 1 on host node-that-is-not-this-one.*another host"):
        OutputLock(path, "--output-prefix P").acquire()
    assert json.load(open(path)) == record  # left for a person to remove


def test_a_forked_child_does_not_release(tmp_path, mode):
    path = str(tmp_path / "d.lock")
    lock = OutputLock(path, "--output-prefix P").acquire()
    try:
        pid = os.fork()
        if pid == 0:  # a pool worker forked while the lock is held, ending
            lock.release()
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.exists(path)
        r = subprocess.run([sys.executable, "-c", HOLDER, path], input="", capture_output=True, text=True,
                           env=_env(mode), timeout=60)
        assert r.returncode != 0 and "another writer is using it" in r.stderr, r.stderr[-2000:]
    finally:
        lock.release()
    assert not os.path.exists(path)


def test_a_holder_stopped_by_sigterm_mid_write_leaves_a_lock_that_is_taken_over(tmp_path, mode):
    """A writer ended by a signal it does not handle leaves the file; the next one takes it over."""
    path = str(tmp_path / "d.lock")
    holder = _holder(path, mode)
    os.kill(holder.pid, signal.SIGTERM)
    holder.wait()
    holder.stdin.close()
    holder.stdout.close()
    logs = []
    with OutputLock(path, "--output-prefix P", log=logs.append):
        pass
    assert any("taking over" in m for m in logs)


def test_file_mode_lock_without_a_record_is_refused_as_starting(tmp_path, monkeypatch):
    """A lock file created but not yet written (a writer between O_EXCL and its record) is not
    taken over, and the message does not blame another host."""
    monkeypatch.setenv("DLLM_LOCK_MODE", "file")
    path = tmp_path / "out.lock"
    path.write_text("")
    with pytest.raises(OutputLockedError, match="record is empty, starting now, or killed while starting"):
        OutputLock(str(path), "--output-prefix X").acquire()
    assert path.read_text() == ""
