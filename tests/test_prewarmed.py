"""The prewarmed server (tests/prewarmed.py) starts what a plain `python SCRIPT` starts: every test
that launches through `run_python`/`popen_python` relies on it. Each case runs the same script both
ways and compares what a test can observe."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, launch_env
from prewarmed import Server

pytestmark = pytest.mark.slow  # each case starts processes

SCRIPT = textwrap.dedent("""
    import json, os, sys
    mode = sys.argv[1]
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "marker": os.environ.get("MARK"),
                      "main": __name__, "file": __file__, "sid": os.getsid(0) == os.getpid()}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "exit":
        sys.exit(3)
    if mode == "raise":
        raise KeyError("boom")
    if mode == "wait" or (mode == "rank1-fails" and os.environ["RANK"] == "0"):
        import time
        time.sleep(60)
    if mode == "rank1-fails":
        sys.exit(4)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.fixture(scope="module")
def server():
    """A server of its own, so these cases run whether or not the session's launches use one."""
    started = Server(launch_env(1))
    yield started
    started.close()


def _plain(argv, cwd, env):
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", ["ok", "exit", "raise"])
def test_a_launch_sees_what_a_plain_process_sees(server, script, tmp_path, mode):
    env = {**launch_env(1), "MARK": "x"}
    got = server.run([script, mode, "a b"], tmp_path, env, timeout=60)
    want = _plain([script, mode, "a b"], tmp_path, env)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout), (got, want)
    assert got.stderr.splitlines()[0] == "to stderr"
    if mode == "raise":  # the interpreter's own report of an uncaught exception, exit status 1
        assert got.returncode == 1 and got.stderr.splitlines()[-1] == "KeyError: 'boom'"
        assert "Traceback (most recent call last)" in got.stderr
    else:
        assert got.stderr == want.stderr


def test_the_entry_points_help_and_bad_flags_are_the_same(server, tmp_path):
    env = launch_env(1)
    for argv in (["--help"], ["--no-such-flag"]):
        got = server.run([os.path.join(REPO, "pretrain_dllm.py"), *argv], tmp_path, env, timeout=120)
        want = _plain([os.path.join(REPO, "pretrain_dllm.py"), *argv], tmp_path, env)
        assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)


def test_a_left_running_launch_is_a_process_of_its_own(server, script, tmp_path):
    env = launch_env(1)
    with open(tmp_path / "log", "w+") as log, open(os.devnull) as null:
        child = server.popen([script, "wait"], tmp_path, env, null, log, log, start_new_session=True)
        deadline = time.time() + 30
        while "to stderr" not in (tmp_path / "log").read_text() and time.time() < deadline:
            time.sleep(0.01)
        assert child.poll() is None
        assert os.getpgid(child.pid) == child.pid  # a session of its own, as start_new_session gives
        assert '"sid": true' in (tmp_path / "log").read_text()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM


def test_an_environment_read_at_import_gets_a_plain_process(server):
    env = launch_env(1)
    assert server.serves(env) and not server.serves({**env, "OMP_NUM_THREADS": "2"})
    assert not server.serves({**env, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"})  # TorchDynamo's config, preloaded


def test_a_failing_rank_stops_the_others_and_the_launch_exits_1_as_torchrun(server, script, tmp_path):
    env = launch_env(2)
    start = time.monotonic()
    got = server.launch(2, [script, "rank1-fails"], tmp_path, env, timeout=120)
    assert got.returncode == 1 and time.monotonic() - start < 30  # rank 0 did not sleep its 60 s
    want = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script,
                           "rank1-fails"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert want.returncode == got.returncode
