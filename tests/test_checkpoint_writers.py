"""Checkpoint writers, with real launches and real kills: one writer per --save (a second one exits
2 naming the first; a SIGKILLed run's lock is taken over), converters lock their outputs, a
checkpoint mixing two runs' shards is refused, a run never starts over existing checkpoints, every
process of an --async-save run dies with it, a full disk is named, and an HF directory whose
config.json contradicts itself or its weights is refused."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, REPO_PYTHONPATH, TINY_RUN, launch_env, popen_python, run_pretrain, run_python, tmpfs

from megatron_dllm.checkpoint import layout, manifest
from megatron_dllm.cli.chaos_resume import children as _kids
from megatron_dllm.cli.chaos_resume import process_tree
from megatron_dllm.cli.chaos_resume import running as _alive
from megatron_dllm.output_lock import OutputLock, lock_path_for_dir, lock_path_for_prefix

pytestmark = pytest.mark.slow

RUN = [*TINY_RUN, "--eval-interval", "1000", "--eval-iters", "1"]
TRACKER = layout.TRACKER
LOCK = ".dllm-writer.lock"


def _snapshot(root) -> dict:
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            out[os.path.relpath(os.path.join(base, name), root)] = manifest.sha256(os.path.join(base, name))
    return out


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _start(demo_cache, workdir, *flags, nproc=1, env=None):
    """A training launch left running (one rank: the process itself; else torchrun)."""
    script = [os.path.join(REPO, "pretrain_dllm.py"), "--demo-cache-dir", demo_cache, *RUN, *flags]
    environ = {**launch_env(nproc), **(env or {})}
    log = open(os.path.join(str(workdir), f"run-{time.time_ns()}.log"), "w+")
    if nproc == 1:
        environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT="0")
        return popen_python(script, workdir, environ, log), log
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    return subprocess.Popen(cmd, cwd=str(workdir), env=environ, stdout=log, stderr=log), log


def _wait(proc, condition, what, log, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = condition()
        if found:
            return found
        time.sleep(0.01)
    log.seek(0)
    raise AssertionError(f"never {what}:\n{log.read()[-4000:]}")


def _launch(demo_cache, workdir, *flags, check=False):
    return run_pretrain(1, ["--demo-cache-dir", demo_cache, *RUN, *flags], workdir, check=check)


# ------------------------------------------------------------------ one writer at a time


def test_a_second_training_on_the_same_save_exits_2_naming_the_first(demo_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "5", "--train-iters", "100000",
             "--exit-signal-handler", "--keep-last-n-checkpoints", "1"]
    first, log = _start(demo_cache, tmp_path, *flags)
    try:  # retention has removed a checkpoint, and left the lock file alone
        _wait(first, lambda: (ckpt / TRACKER).exists() and int((ckpt / TRACKER).read_text()) >= 10,
              "saved two checkpoints", log)
        owner = json.loads((ckpt / LOCK).read_text())
        assert owner["pid"] == first.pid
        second, records = _launch(demo_cache, tmp_path, *flags)
        assert second.returncode == 2, second.stderr[-3000:]
        assert _errors(second.stderr) == [second.stderr.strip().splitlines()[-1]]
        line = _errors(second.stderr)[0]
        assert line.startswith(f"error: --save {ckpt}: another writer is using it: pid {first.pid} on host "
                               f"{owner['host']}, started "), line
        assert "family" not in second.stdout and not records  # stopped before building the model
        assert first.poll() is None  # the first run goes on, and completes
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
    done = int((ckpt / TRACKER).read_text())
    assert done >= 10 and list(layout.iterations(str(ckpt))) == [done]
    for path in layout.iterations(str(ckpt)).values():
        manifest.verify_manifest(path)
        assert LOCK not in json.dumps(manifest.read_manifest(path))
    assert not (ckpt / LOCK).exists()  # released at exit
    assert not layout.incomplete_saves(str(ckpt))


@pytest.mark.parametrize("mode", ["flock"])  # the lock-file mode's takeover: tests/test_output_lock.py
def test_a_sigkilled_runs_lock_is_taken_over_on_restart(demo_cache, tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    env = {"DLLM_LOCK_MODE": mode}
    first, log = _start(demo_cache, tmp_path, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
                        "--train-iters", "100000", env=env)
    try:
        _wait(first, lambda: (ckpt / TRACKER).exists(), "saved a checkpoint", log)
        children = _descendants(first.pid)  # any writer at work (a synchronous save starts no results server:
    finally:  # the async one's end is test_every_process_of_an_async_save_run_dies_with_it's)
        first.kill()
        first.wait()
        log.close()
    assert _all_gone(children)
    assert json.loads((ckpt / LOCK).read_text())["pid"] == first.pid  # left behind by the killed run
    done = int((ckpt / TRACKER).read_text())
    with _env(DLLM_LOCK_MODE=mode):
        proc, records = _launch(demo_cache, tmp_path, "--save", str(ckpt), "--load", str(ckpt), "--save-interval",
                                "100", "--train-iters", str(done + 2), "--override-opt-param-scheduler", check=True)
    assert f"--save {ckpt}: taking over the lock left by pid {first.pid} on host " in proc.stdout
    assert "which is no longer running" in proc.stdout
    assert f"loaded checkpoint {layout.iteration_dir(str(ckpt), done)}" in proc.stdout
    assert (ckpt / TRACKER).read_text() == str(done + 2) and not (ckpt / LOCK).exists()


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def exported(demo_cache, tmp_path_factory):
    """(checkpoint root, HF export) of a 2-iteration mdlm run."""
    work = tmp_path_factory.mktemp("exported")
    run_pretrain(1, ["--demo-cache-dir", demo_cache, *RUN, "--train-iters", "2", "--save", str(work / "ckpt")], work)
    hf = work / "hf"
    done = run_python([os.path.join(REPO, "tools", "convert_to_hf.py"), "--load", str(work / "ckpt"), "--out", str(hf)],
                      work, launch_env(1))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not os.path.exists(str(hf) + ".lock") and "dllm-writer" not in " ".join(os.listdir(hf))
    # no tokenizer flags: the tokenizer the checkpoint recorded (the demo's) goes with the weights
    assert done.stdout.strip().endswith(", tokenizer)") and (hf / "tokenizer_config.json").is_file()
    return work / "ckpt", hf


def _tool(name, *args, env=None):
    return run_python([os.path.join(REPO, "tools", name), *args], os.getcwd(), {**launch_env(1), **(env or {})}, 300)


@pytest.mark.parametrize("mode", ["flock"])  # both modes name the holder alike: tests/test_output_lock.py
def test_converters_refuse_an_output_another_writer_holds(exported, tmp_path, mode):
    ckpt, hf = exported
    cases = [("convert_to_hf.py", ["--load", str(ckpt), "--out", str(tmp_path / "out")], "--out",
              lock_path_for_prefix(str(tmp_path / "out"))),
             ("convert_from_ref.py", ["--ref", str(tmp_path / "no-such-ref"), "--hf-out", str(tmp_path / "out")],
              "--hf-out", lock_path_for_prefix(str(tmp_path / "out"))),
             ("convert_from_hf.py", ["--hf", str(hf), "--save", str(tmp_path / "save")], "--save",
              lock_path_for_dir(str(tmp_path / "save")))]
    with _env(DLLM_LOCK_MODE=mode):
        for tool, args, flag, lock in cases:
            with OutputLock(lock, "test"):
                r = _tool(tool, *args)
            assert r.returncode == 2, (tool, r.stderr[-3000:])
            assert _errors(r.stderr) == [r.stderr.strip().splitlines()[-1]], (tool, r.stderr[-3000:])
            assert _errors(r.stderr)[0].startswith(f"error: {flag} {tmp_path}/"), r.stderr
            assert f"another writer is using it: pid {os.getpid()} on host" in r.stderr
            assert not (tmp_path / "out").exists() and not layout.iterations(str(tmp_path / "save"))
            assert not os.path.exists(lock)


# ------------------------------------------------------------------ a checkpoint of one run only


@pytest.mark.multiprocess
def test_a_checkpoint_mixing_two_runs_shards_is_refused(demo_cache, tmp_path):
    from megatron_dllm import checkpoint
    from megatron_dllm.cli import verify_checkpoint

    roots = []
    for name in ("a", "b"):
        root = tmp_path / name
        run_pretrain(2, ["--demo-cache-dir", demo_cache, *RUN, "--train-iters", "2", "--save", str(root),
                         "--tensor-model-parallel-size", "2"], tmp_path)
        roots.append(root)
    a, b = (layout.iteration_dir(str(r), 2) for r in roots)
    assert verify_checkpoint.main([a]) == 0 and verify_checkpoint.main([b]) == 0
    run_a, run_b = manifest.read_manifest(a)["run"], manifest.read_manifest(b)["run"]
    assert run_a != run_b
    spliced = sorted(n for n in os.listdir(a) if n.startswith("__1_"))
    assert spliced
    record = manifest.read_manifest(a)
    for name in spliced:  # rank 1's shards from run b, the manifest rehashed: internally consistent
        shutil.copyfile(os.path.join(b, name), os.path.join(a, name))
        record["files"][name] = {"size": os.path.getsize(os.path.join(a, name)),
                                 "sha256": manifest.sha256(os.path.join(a, name))}
    with open(os.path.join(a, manifest.MANIFEST), "w") as f:
        json.dump(record, f)
    manifest.verify_manifest(a)  # every hash matches
    r = _tool("verify_checkpoint.py", str(roots[0]))
    assert r.returncode == 2 and len(_errors(r.stderr)) == 1, r.stderr
    line = _errors(r.stderr)[0]
    assert line.startswith(f"error: {a}: written by 2 different runs"), line
    assert f"run {run_a}: manifest.json, __0_" in line, line
    assert any(f"run {run_b}: {name} (rank 1)" in line for name in spliced), line
    with pytest.raises(checkpoint.CheckpointError, match="written by 2 different runs"):
        checkpoint.locate(str(roots[0]))  # the check before every load


def test_checkpoints_without_writer_records_still_verify(exported, tmp_path):
    """Every save records its run in each shard; a checkpoint from before run ids (a torch_dist
    directory without records, and no run in its manifest) is accepted as it is."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_dllm.checkpoint import writers

    path = layout.iteration_dir(str(exported[0]), 2)
    records = writers.shard_records(path)
    assert {r["run"] for r in records.values()} == {manifest.read_manifest(path)["run"]} and len(records) == 1
    writers.check_single_run(path, manifest.read_manifest(path)["run"])
    old = tmp_path / "old"
    dcp.save({"weight": torch.ones(3)}, checkpoint_id=str(old))
    assert writers.shard_records(str(old)) == {}
    writers.check_single_run(str(old), None)


# ------------------------------------------------------------------ nothing replaced unasked


@pytest.mark.parametrize("mode", ["file"])  # the mode whose lock only an explicit release removes
def test_a_run_without_load_refuses_a_save_holding_checkpoints(exported, demo_cache, tmp_path, mode):
    """... and releases its lock on that handled error: the directory is byte-identical after."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    shutil.copytree(exported[0], ckpt)
    shutil.copytree(exported[0], other)
    before = _snapshot(ckpt)
    held = f"error: --save {ckpt} already holds checkpoints (iter_0000002)"
    for flags, message in [
        ([], f"{held}; resume with --load {ckpt}, or pick a new --save"),
        (["--load", str(other)], f"{held}; --load {other} is another directory's, and continuing it here would "
                                 f"replace them: resume with --load {ckpt}, or pick a new --save"),
        (["--load", str(other), "--finetune"],
         f"{held}; --finetune starts again at iteration 0 and would replace them: pick a new --save "
         f"(--pretrained-checkpoint {other} --load {ckpt} instead starts from its weights and resumes --save once "
         f"it has saved)")]:
        with _env(DLLM_LOCK_MODE=mode):
            proc, records = _launch(demo_cache, tmp_path, "--train-iters", "2", "--save", str(ckpt), *flags)
        assert proc.returncode == 2 and _errors(proc.stderr) == [message], proc.stderr[-3000:]
        assert not records and _snapshot(ckpt) == before


def test_a_pretrained_checkpoint_starts_the_run_and_the_same_command_then_resumes_it(exported, demo_cache, tmp_path):
    """Megatron-LM's --pretrained-checkpoint: weights only while --load is empty, then --load."""
    run = tmp_path / "run"
    flags = ["--pretrained-checkpoint", str(exported[0]), "--load", str(run), "--save", str(run),
             "--train-iters", "4", "--exit-interval", "2"]
    first, records = _launch(demo_cache, tmp_path, *flags, check=True)
    assert f"no checkpoint in --load {run} yet: starting from --pretrained-checkpoint {exported[0]}" in first.stdout
    assert "weights only (--finetune)" in first.stdout
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2] and (run / TRACKER).read_text() == "2"
    again, records = _launch(demo_cache, tmp_path, *flags[:-2], check=True)  # the same command, to the end
    assert f"loading {run / 'iter_0000002'}" in again.stdout and "starting from --pretrained" not in again.stdout
    assert [r["iteration"] for r in records if "loss" in r] == [3, 4] and (run / TRACKER).read_text() == "4"


def test_a_bad_pretrained_checkpoint_is_named_by_its_own_flag(demo_cache, tmp_path):
    """The load errors of a --pretrained-checkpoint started from (it stands in for --load) name the
    flag given, not --load."""
    run, missing = tmp_path / "run", tmp_path / "nonexistent"
    proc, records = _launch(demo_cache, tmp_path, "--pretrained-checkpoint", str(missing), "--load", str(run),
                            "--save", str(run), "--train-iters", "2")
    assert proc.returncode == 2 and not records
    assert _errors(proc.stderr) == [f"error: --pretrained-checkpoint {missing} does not exist (expected "
                                    f"latest_checkpointed_iteration.txt or iter_XXXXXXX directories, or a checkpoint "
                                    f"directory itself)"], proc.stderr[-3000:]


def test_relaunch_continues_a_finetuned_run_from_its_own_checkpoints(exported, demo_cache, tmp_path):
    """A run that started with --load elsewhere and --finetune continues, once it has saved, from
    its --save, without the file's flags of that first load; from the copy beside its logs too."""
    run, logs = tmp_path / "run", tmp_path / "tb"
    _launch(demo_cache, tmp_path, "--load", str(exported[0]), "--finetune", "--no-load-rng", "--save", str(run),
            "--tensorboard-dir", str(logs), "--train-iters", "4", "--exit-interval", "2", check=True)
    config = str(run / "run_config.yaml")
    beside_logs = os.path.relpath(logs / "run_config.yaml", tmp_path.parent)  # relative to another directory
    for copy, cwd in ((config, tmp_path), (str(logs / "run_config.yaml"), tmp_path), (beside_logs, tmp_path.parent)):
        dry = run_python([os.path.join(REPO, "tools", "relaunch.py"), copy, "--dry-run"], cwd, launch_env(1))
        assert dry.returncode == 0, dry.stderr
        assert f"continuing from the run's own checkpoints in {run}" in dry.stderr
        command = dry.stdout.split()
        assert "--yaml-cfg" not in command and "--finetune" not in command and "--no-load-rng" not in command
        assert command[command.index("--load") + 1] == str(run) and command.count("--load") == 1
    relaunch = [os.path.join(REPO, "tools", "relaunch.py"), config, "--dry-run"]
    debug = run_python(relaunch + ["--", "--debug"], tmp_path, launch_env(1))  # only adds tracebacks
    assert debug.stdout.split() == run_python(relaunch, tmp_path, launch_env(1)).stdout.split() + ["--debug"]
    done = run_python([os.path.join(REPO, "tools", "relaunch.py"), config], tmp_path, launch_env(1), 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"loaded checkpoint {run / 'iter_0000002'} at iteration 2" in done.stdout
    assert (run / TRACKER).read_text() == "4"


def test_a_finished_run_without_validation_set_has_nothing_to_do(demo_cache, tmp_path):
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    demo, run = prepare_demo_corpus(demo_cache), tmp_path / "run"
    flags = [*TINY_RUN, "--data-path", demo["data_prefix"], "--tokenizer-type", demo["tokenizer_type"],
             "--tokenizer-model", demo["tokenizer_model"], "--train-iters", "1", "--load", str(run), "--save", str(run)]
    run_pretrain(1, flags, tmp_path)
    again, records = run_pretrain(1, flags, tmp_path)
    assert "iteration 1 already reaches --train-iters 1: nothing to do (no --eval-interval)" in again.stdout


def test_the_demo_command_resumes_its_own_checkpoints():
    from megatron_dllm.config import parse_args
    from megatron_dllm.config.run import resolve_defaults

    corpus = {"data_prefix": "d", "valid_prefix": "v", "tokenizer_type": "SentencePieceTokenizer",
              "tokenizer_model": "t.model"}
    demo = resolve_defaults(parse_args(["--family", "mdlm"]), corpus)
    assert demo.checkpoint.load == demo.checkpoint.save == "runs/demo-mdlm/checkpoints"
    assert demo.logging.tensorboard_dir == "runs/demo-mdlm/tensorboard"
    # a run with its own --save writes neither into the demo run's checkpoints nor its TensorBoard
    mine = resolve_defaults(parse_args(["--family", "ar", "--save", "mine"]), corpus)
    assert (mine.checkpoint.save, mine.checkpoint.load, mine.logging.tensorboard_dir) == ("mine", None, None)


# ------------------------------------------------------------------ every descendant dies with the run


def _descendants(pid: int) -> list[int]:
    return process_tree(pid)[1:]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _all_gone(pids, seconds=10) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:  # the test's own processes: never left running
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return not left


@pytest.mark.multiprocess
def test_every_process_of_an_async_save_run_dies_with_it(demo_cache, tmp_path):
    """SIGKILL torchrun, its ranks and their checkpoint writers together, mid-save: the writers'
    own workers and megatron-core's results-queue server go too, and nothing more is published."""
    ckpt = tmp_path / "ckpt"
    proc, log = _start(demo_cache, tmp_path, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
                       "--train-iters", "100000", "--async-save", nproc=2)
    everything = []

    def mid_save():  # a rank's forked writer (same command line as the rank) has its workers running
        if not (ckpt / TRACKER).exists():
            return None
        ranks = _kids(proc.pid)
        writers = [w for r in ranks for w in _kids(r) if _cmdline(w) == _cmdline(r)]
        if len(ranks) == 2 and any(_kids(w) for w in writers):
            return ranks, writers, _descendants(proc.pid)
        return None

    try:
        ranks, writers, everything = _wait(proc, mid_save, "caught during a save", log)
        for pid in [proc.pid, *ranks, *writers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        left = everything
        deadline = time.time() + 10
        while time.time() < deadline and (left := [p for p in everything if _alive(p)]):
            time.sleep(0.1)
        assert not left, [(p, _cmdline(p)[:200]) for p in left]
        assert len(everything) > len(ranks) + len(writers)  # the run had more processes than those killed
        published = sorted(os.listdir(ckpt))
        time.sleep(2)
        assert sorted(os.listdir(ckpt)) == published  # nothing written after the kill
        for path in layout.iterations(str(ckpt)).values():
            manifest.verify_manifest(path)
    finally:  # whatever the test saw, and anything still under torchrun
        for pid in [*everything, *_descendants(proc.pid), proc.pid]:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        log.close()


# ------------------------------------------------------------------ full disk


@pytest.mark.parametrize("flags", [[], ["--async-save"]])
def test_a_full_disk_during_a_save_is_named_and_nothing_partial_is_published(exported, demo_cache, tmp_path, flags):
    one = manifest.manifest_size(layout.iteration_dir(str(exported[0]), 2))
    with tmpfs(tmp_path / "disk", f"{int(one * 1.5) // 1024}k"):
        ckpt = tmp_path / "disk" / "ckpt"
        proc, records = _launch(demo_cache, tmp_path, "--train-iters", "3", "--save-interval", "1",
                                "--save", str(ckpt), *flags)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert _errors(proc.stderr) == [proc.stderr.strip().splitlines()[-1]], proc.stderr[-3000:]
        line = _errors(proc.stderr)[0]
        assert line.startswith(f"error: --save {ckpt}: no space left on device (ENOSPC) writing "
                               f"{ckpt}/iter_0000002."), line
        # the lock released too
        assert sorted(os.listdir(ckpt)) == ["iter_0000001", TRACKER, "metrics_run_id.txt", "run_config.yaml"]
        assert (ckpt / TRACKER).read_text() == "1"
        manifest.verify_manifest(layout.iteration_dir(str(ckpt), 1))


def test_a_run_refuses_to_start_without_space_for_one_checkpoint(exported, demo_cache, tmp_path):
    one = manifest.manifest_size(layout.iteration_dir(str(exported[0]), 2))
    with tmpfs(tmp_path / "disk", f"{int(one * 0.5) // 1024}k"):
        ckpt = tmp_path / "disk" / "ckpt"
        proc, records = _launch(demo_cache, tmp_path, "--train-iters", "2", "--save", str(ckpt))
        assert proc.returncode == 2 and len(_errors(proc.stderr)) == 1, proc.stderr[-3000:]
        assert _errors(proc.stderr)[0].startswith(f"error: --save {ckpt}: "), proc.stderr
        assert "MiB free, but one checkpoint of this model needs about" in proc.stderr
        assert not records and not layout.iterations(str(ckpt)) and not layout.incomplete_saves(str(ckpt))


# ------------------------------------------------------------------ HF import checks


def _bad_copy(hf, tmp_path, name):
    bad = tmp_path / name
    shutil.copytree(hf, bad)
    return bad


@pytest.mark.parametrize("field, value, message", [
    ("attention", "causal", "attention 'causal' contradicts family 'mdlm', whose attention is 'bidirectional'"),
    ("architectures", ["DLLMForCausalLM"],
     "architectures ['DLLMForCausalLM'] contradicts family 'mdlm', expected ['DLLMForMaskedLM']"),
    ("mask_token_id", 999999, "mask_token_id 999999 lies outside vocab_size 4097"),
    ("num_heads", 0, "num_heads 0: expected integers (sizes >= 1, mask_token_id >= 0)"),
    ("hidden_size", "96", "hidden_size '96': expected integers (sizes >= 1, mask_token_id >= 0)"),
    ("family_options", [1], "family_options [1] is not a mapping"),
])
def test_convert_from_hf_refuses_a_self_contradicting_config(exported, tmp_path, field, value, message):
    bad = _bad_copy(exported[1], tmp_path, "bad")
    config = json.loads((bad / "config.json").read_text())
    config[field] = value
    (bad / "config.json").write_text(json.dumps(config))
    r = _tool("convert_from_hf.py", "--hf", str(bad), "--save", str(tmp_path / "out"))
    assert r.returncode == 2 and _errors(r.stderr) == [f"error: --hf {bad}/config.json: {message}"], r.stderr
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_convert_from_hf_refuses_a_weight_of_the_wrong_shape(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = _bad_copy(exported[1], tmp_path, "bad")
    weights = load_file(str(bad / "model.safetensors"))
    name = "backbone.blocks.1.attn_out.weight"
    expected = tuple(weights[name].shape)
    weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = _tool("convert_from_hf.py", "--hf", str(bad), "--save", str(tmp_path / "out"))
    assert r.returncode == 2 and _errors(r.stderr) == [
        f"error: --hf {bad}/model.safetensors: tensor {name} has shape {(expected[0], expected[1] - 1)}, expected "
        f"{expected} for the model its config.json describes"], r.stderr
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_results_queue_server_survives_a_sigterm_to_the_group_while_it_starts(tmp_path):
    """A SIGTERM to the rank's process group while megatron-core's results-queue server is still
    starting (its spawned interpreter importing) must neither kill it nor the rank's save: the
    signals stay blocked until the server ignores them, and the rank handles its own afterwards.
    (multiprocessing's resource tracker, started on the way, unblocks SIGTERM: it is started first.)"""
    script = """
import os, signal, threading, time
os.setpgrp()
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))
from megatron_dllm.checkpoint import writer_processes
from megatron.core.dist_checkpointing.strategies import filesystem_async
threading.Thread(target=lambda: (time.sleep(0.05), os.killpg(os.getpgrp(), signal.SIGTERM))).start()
writer_processes.watch()
queue = filesystem_async._results_queue
queue.put("result")
time.sleep(0.5)
print("queue", queue.get(), "rank saw", got, flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": REPO_PYTHONPATH})
    assert proc.returncode == 0 and "queue result rank saw ['TERM']" in proc.stdout, proc.stderr[-3000:]
