"""Fault injection on the training side: checkpoints are never lost or loaded silently wrong, bad
flags stop at parse time with one `error:` line, and ranks do not outlive their launcher.

Every launch checks the exit code, that the message names the file or flag, and that the
checkpoint directories are byte-identical before and after."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY_RUN, launch_env, run_pretrain

from megatron_dllm.checkpoint import CheckpointError, layout, manifest, store
from megatron_dllm.cli.chaos_resume import running as _alive
from megatron_dllm.config import parse_args

RUN = [*TINY_RUN, "--eval-interval", "100", "--eval-iters", "1"]
TRACKER = layout.TRACKER


def _snapshot(root) -> dict:
    """{relative path: sha256} of every file under root."""
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            out[os.path.relpath(path, root)] = manifest.sha256(path)
    return out


@pytest.fixture(scope="module")
def trained(demo_cache, tmp_path_factory):
    """A real run with complete checkpoints at iterations 2 and 4 (tracker: 4)."""
    work = tmp_path_factory.mktemp("trained")
    run_pretrain(1, ["--demo-cache-dir", demo_cache, *RUN, "--train-iters", "4", "--save-interval", "2",
                     "--save", str(work / "ckpt")], work)
    return work / "ckpt"


@pytest.fixture
def ckpt(trained, tmp_path):
    """A private copy of the trained checkpoints, to break."""
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    return root


def _launch(demo_cache, workdir, *flags):
    return run_pretrain(1, ["--demo-cache-dir", demo_cache, *RUN, *flags], workdir, check=False)


@pytest.mark.slow
def test_saves_are_complete_with_a_manifest(trained):
    assert sorted(layout.iterations(str(trained))) == [2, 4] and (trained / TRACKER).read_text() == "4"
    for it in (2, 4):
        path = layout.iteration_dir(str(trained), it)
        files = manifest.read_manifest(path)["files"]
        assert sorted(files) == sorted(n for n in os.listdir(path) if n != manifest.MANIFEST)
        manifest.verify_manifest(path)
    assert not layout.incomplete_saves(str(trained))


# ------------------------------------------------------------------ loading never deletes


@pytest.mark.slow
def test_older_tracker_loads_that_iteration_and_keeps_newer_ones(ckpt, demo_cache, tmp_path):
    """Rolling back by hand (Megatron-LM style): the tracker names 2 while iter 4 exists."""
    (ckpt / TRACKER).write_text("2")
    before = _snapshot(ckpt)
    proc, records = _launch(demo_cache, tmp_path, "--train-iters", "2", "--load", str(ckpt), "--save", str(ckpt),
                            "--use-checkpoint-opt-param-scheduler")
    assert proc.returncode == 0, proc.stderr
    assert f"loading {ckpt / 'iter_0000002'} ({TRACKER} (newer checkpoints kept, not loaded: iter_0000004))" \
        in proc.stdout
    assert "evaluating only" in proc.stdout
    assert _snapshot(ckpt) == before


@pytest.mark.slow
def test_missing_tracker_loads_the_newest_complete_checkpoint(ckpt, demo_cache, tmp_path):
    (ckpt / TRACKER).unlink()
    (ckpt / "iter_0000006.incomplete").mkdir()  # a killed save: not a candidate, kept (not --save)
    before = _snapshot(ckpt)
    proc, _ = _launch(demo_cache, tmp_path, "--train-iters", "4", "--load", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert f"loading {ckpt / 'iter_0000004'} (no {TRACKER}: the newest complete checkpoint)" in proc.stdout
    assert "loaded checkpoint" in proc.stdout and "at iteration 4" in proc.stdout
    assert _snapshot(ckpt) == before and (ckpt / "iter_0000006.incomplete").is_dir()


@pytest.mark.slow
def test_load_path_with_no_checkpoint_is_an_error(ckpt, demo_cache, tmp_path):
    before = _snapshot(ckpt)
    typo = str(ckpt) + "-typo"
    proc, records = _launch(demo_cache, tmp_path, "--train-iters", "2", "--load", typo, "--save", str(ckpt))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --load {typo} does not exist (expected {TRACKER} or iter_XXXXXXX directories, or a "
        f"checkpoint directory itself)")
    assert not [r for r in records if "loss" in r] and _snapshot(ckpt) == before


@pytest.mark.slow
def test_corrupted_shard_is_refused_before_loading(ckpt, demo_cache, tmp_path):
    shard = ckpt / "iter_0000004" / "__0_1.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    shard.write_bytes(bytes(data))
    before = _snapshot(ckpt)
    proc, records = _launch(demo_cache, tmp_path, "--train-iters", "6", "--load", str(ckpt), "--save", str(ckpt))
    assert proc.returncode == 2
    assert f"error: {shard}: content differs from its SHA-256 in manifest.json (corrupted)" in proc.stderr
    assert "Traceback" not in proc.stderr and not records and _snapshot(ckpt) == before


@pytest.mark.slow
def test_unwritable_save_fails_before_training(demo_cache, tmp_path):
    # Tests run as root, which ignores permission bits; sysfs refuses to create files even for root.
    save = "/sys/megatron_dllm_ckpt"
    proc, records = _launch(demo_cache, tmp_path, "--train-iters", "2", "--save", save)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --save {save}: not writable")
    assert not records and not os.path.exists(save)


def test_a_split_without_a_train_part_is_one_error(demo_cache, tmp_path):
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    demo = prepare_demo_corpus(demo_cache)
    proc, records = _launch(demo_cache, tmp_path, "--train-iters", "2", "--data-path", demo["data_prefix"],
                            "--split", "0,100,0", "--tokenizer-type", demo["tokenizer_type"],
                            "--tokenizer-model", demo["tokenizer_model"])
    assert proc.returncode == 2 and not records
    assert proc.stderr.strip().splitlines()[-1] == ("error: --split 0,100,0: the train split has weight 0, so there is "
                                                    "nothing to train on")


def test_an_unwritable_tensorboard_dir_is_one_error_naming_the_flag(demo_cache, tmp_path):
    (tmp_path / "a_file").write_text("")
    proc, records = _launch(demo_cache, tmp_path, "--train-iters", "2", "--tensorboard-dir", str(tmp_path / "a_file"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: --tensorboard-dir {tmp_path / 'a_file'}: cannot write " \
                                                   f"there (File exists)"
    assert not records


# ------------------------------------------------------------------ in-process: layout and manifest


@pytest.mark.slow
def test_find_checkpoint_by_path_step_and_tracker(ckpt):
    root = str(ckpt)
    assert layout.find_checkpoint(root).path == layout.iteration_dir(root, 4)
    assert layout.find_checkpoint(root, 2).path == layout.iteration_dir(root, 2)
    assert layout.find_checkpoint(layout.iteration_dir(root, 2)).iteration == 2
    with pytest.raises(CheckpointError, match=r"--ckpt-step 3: no iter_0000003 in .* \(checkpoints there: "
                                              r"iter_0000002, iter_0000004\)"):
        layout.find_checkpoint(root, 3)
    (ckpt / TRACKER).write_text("9")
    with pytest.raises(CheckpointError, match=r"names iteration 9, but .*iter_0000009 does not exist"):
        layout.find_checkpoint(root)
    (ckpt / TRACKER).write_text("four")
    with pytest.raises(CheckpointError, match=f"{TRACKER}: expected an iteration number, found 'four'"):
        layout.find_checkpoint(root)
    with pytest.raises(CheckpointError, match="an unfinished save"):
        layout.find_checkpoint(root + "/iter_0000004.incomplete")
    assert layout.find_checkpoint(str(ckpt.parent / "empty")) is None


@pytest.mark.slow
def test_truncated_and_missing_files_are_named(ckpt):
    path = layout.iteration_dir(str(ckpt), 2)
    common = os.path.join(path, "common.pt")
    with open(common, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=f"{common}: 100 bytes, manifest.json says \\d+ \\(truncated"):
        manifest.verify_manifest(path)
    os.remove(common)
    with pytest.raises(CheckpointError, match=f"{common}: missing"):
        manifest.verify_manifest(path)


@pytest.mark.slow
def test_truncated_checkpoint_without_manifest_gives_one_message(ckpt):
    """A checkpoint from before manifests (or another tool) is read unverified; a truncated file
    in it still becomes one message naming the checkpoint, not a traceback from torch."""
    from megatron_dllm.checkpoint.meta import CheckpointMeta

    path = layout.iteration_dir(str(ckpt), 2)
    os.remove(os.path.join(path, manifest.MANIFEST))
    with open(os.path.join(path, "common.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=f"--load {path}: cannot read the checkpoint"):
        CheckpointMeta.read(path)


@pytest.mark.slow
def test_a_checkpoint_that_lost_its_manifest_is_refused(ckpt):
    """It holds the writers' run records, so it was written with a manifest: loading it unverified
    could train on corrupted weights and save them under a fresh, valid manifest."""
    path = layout.iteration_dir(str(ckpt), 2)
    os.remove(os.path.join(path, manifest.MANIFEST))
    with pytest.raises(CheckpointError, match=f"{path}: manifest.json is missing from a checkpoint written with one"):
        store.locate(str(ckpt), 2)


def test_a_failed_shard_read_is_one_message(tmp_path):
    """torch's distributed checkpoint reader wraps a truncated shard's EOFError in a
    CheckpointException, a BaseException: it still becomes one message naming the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    def truncated_shard():
        raise CheckpointException("load_state_dict", {0: (EOFError("Ran out of input"), None)})

    with pytest.raises(CheckpointError, match=f"--load {tmp_path}: cannot read the checkpoint \\(CheckpointException"):
        store.read(str(tmp_path), truncated_shard)


@pytest.mark.parametrize("tracker", [b"\xff\xfe", "\u00b2".encode(), b"12a", b""])
def test_a_tracker_that_is_no_iteration_number_is_named(tmp_path, tracker):
    (tmp_path / layout.TRACKER).write_bytes(tracker)
    with pytest.raises(CheckpointError, match=f"{tmp_path / layout.TRACKER}: expected an iteration number"):
        layout.read_tracker(str(tmp_path))


@pytest.mark.parametrize("text", ["[]", '{"format": "%s", "files": {"a": {"sha256": "00"}}}',
                                  '{"format": "%s", "files": {"a": "x"}}'])
def test_a_manifest_of_another_shape_is_named(tmp_path, text):
    (tmp_path / manifest.MANIFEST).write_text(text.replace("%s", manifest.FORMAT))
    with pytest.raises(CheckpointError, match=f"{tmp_path / manifest.MANIFEST}: unreadable manifest"):
        manifest.verify_manifest(str(tmp_path))


@pytest.mark.slow
def test_verify_checkpoint_tool(ckpt, capsys):
    from megatron_dllm.cli import verify_checkpoint

    assert verify_checkpoint.main([str(ckpt), "--all"]) == 0
    assert capsys.readouterr().out.count("ok ") == 2
    assert verify_checkpoint.main([str(ckpt / "iter_0000004"), "--all"]) == 0  # a checkpoint is all of itself
    assert capsys.readouterr().out.startswith(f"ok {ckpt / 'iter_0000004'}: ")
    shard = ckpt / "iter_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert verify_checkpoint.main([str(ckpt)]) == 0  # the tracker's checkpoint (4) is intact
    assert verify_checkpoint.main([str(ckpt), "--ckpt-step", "2"]) == 2
    assert f"error: {shard}: " in capsys.readouterr().err


@pytest.mark.slow
def test_a_checkpoint_renamed_to_another_iteration_is_refused_by_load_and_verify(ckpt, capsys):
    """iter_0000002 moved to iter_0000006 (the tracker naming 6) would resume at iteration 2 from
    what the tracker calls 6; the manifest's iteration gives it away."""
    from megatron_dllm.cli import verify_checkpoint

    os.rename(ckpt / "iter_0000002", ckpt / "iter_0000006")
    (ckpt / TRACKER).write_text("6")
    message = f"{ckpt / 'iter_0000006'}: its manifest.json records iteration 2, not the 6 of its directory's name"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        store.locate(str(ckpt))
    assert verify_checkpoint.main([str(ckpt)]) == 2 and message in capsys.readouterr().err
    assert verify_checkpoint.main([str(ckpt), "--all"]) == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_a_partial_copy_without_its_manifest_names_the_missing_shard(ckpt, capsys):
    """A copy that has .metadata but lost a shard file and the manifest: the shard is missing,
    not a file from elsewhere; load and verify say so alike."""
    from megatron_dllm.cli import verify_checkpoint

    path = ckpt / "iter_0000004"
    os.remove(path / manifest.MANIFEST)
    for shard in path.glob("*.distcp"):  # the one holding the writer records among them
        os.remove(shard)
    message = rf"{path}/__\d+_\d+\.distcp: missing \(named by {path}/\.metadata\): an incomplete copy of the checkpoint"
    with pytest.raises(CheckpointError, match=message):
        store.locate(str(ckpt))
    assert verify_checkpoint.main([str(ckpt)]) == 2 and re.search(message, capsys.readouterr().err)


@pytest.mark.slow
def test_verify_all_refuses_what_load_refuses_and_a_step_with_all(ckpt, capsys):
    from megatron_dllm.cli import verify_checkpoint

    assert verify_checkpoint.main([str(ckpt), "--all", "--ckpt-step", "2"]) == 2
    assert "--all checks every checkpoint of the root; --ckpt-step names one" in capsys.readouterr().err
    (ckpt / TRACKER).write_text("9")
    assert verify_checkpoint.main([str(ckpt), "--all"]) == 2
    assert "names iteration 9, but" in capsys.readouterr().err


@pytest.mark.slow
def test_free_space_is_checked_against_the_last_checkpoint(ckpt):
    path = layout.iteration_dir(str(ckpt), 4)
    with open(os.path.join(path, manifest.MANIFEST)) as f:
        record = json.load(f)
    record["files"]["__0_0.distcp"]["size"] = 1 << 60  # a checkpoint larger than any disk here
    with open(os.path.join(path, manifest.MANIFEST), "w") as f:
        json.dump(record, f)
    with pytest.raises(CheckpointError, match=rf"--save {ckpt}: [\d.]+ [GM]iB free, but the last checkpoint "
                                              rf"iter_0000004 took [\d.]+ GiB"):
        layout.check_save_dir(str(ckpt))


@pytest.mark.slow
def test_a_save_replaces_a_complete_checkpoint_only_once_complete(ckpt):
    staging = layout.staging_dir(str(ckpt), 4, "0123abcd")
    shutil.copytree(ckpt / "iter_0000002", staging)
    layout.publish(staging, layout.iteration_dir(str(ckpt), 4))
    assert _snapshot(ckpt / "iter_0000004") == _snapshot(ckpt / "iter_0000002")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", TRACKER, "metrics_run_id.txt",
                                        "run_config.yaml"]


# ------------------------------------------------------------------ parse-time errors


@pytest.mark.parametrize("flags, message", [
    (["--micro-batch-size", "0"], "argument --micro-batch-size: expected a positive integer, got 0"),
    (["--train-iters", "-5"], "argument --train-iters: expected a positive integer, got -5"),
    (["--global-batch-size", "-1"], "argument --global-batch-size: expected a positive integer, got -1"),
    (["--seq-length", "0"], "argument --seq-length: expected a positive integer, got 0"),
    (["--eval-iters", "0"], "argument --eval-iters: expected a positive integer, got 0"),
    (["--split", "1,x,0"], "argument --split: expected up to three non-negative decimal numbers such as 969,30,1, "
                           "got '1,x,0'"),
    (["--split", "0,0,0"], "argument --split: expected up to three non-negative decimal numbers"),
    (["--split", "1e2,1"], "argument --split: expected up to three non-negative decimal numbers"),  # megatron: 1,2,1
    (["--data-path", "nan", "a", "1", "b"], "--data-path: weights must be positive finite numbers, got [nan, 1.0]"),
    (["--data-path", "inf", "a"], "--data-path: weights must be positive finite numbers, got [inf]"),
    (["--train-flops", "inf"], "argument --train-flops: expected a finite number, got inf"),
    (["--train-flops", "-1"], "--train-flops must be positive, got -1"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33"],
     "--seq-length 33 must be a multiple of --tensor-model-parallel-size 2 under --sequence-parallel"),
    (["--ema-decay", "1.5"], "--ema-decay must lie in (0, 1), got 1.5"),
    (["--ckpt-step", "-1"], "argument --ckpt-step: expected an integer >= 0, got -1"),
])
def test_impossible_values_are_rejected_at_parse_time(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len([line for line in err if "error:" in line]) == 1
    assert message in err[-1]


def test_evaluate_rejects_zero_eval_iters(capsys):
    from megatron_dllm.cli import evaluate

    with pytest.raises(SystemExit) as exit_:
        evaluate.build_parser().parse_args(["nelbo", "--load", "x", "--eval-iters", "0"])
    assert exit_.value.code == 2
    assert "argument --eval-iters: expected a positive integer, got 0" in capsys.readouterr().err


# ------------------------------------------------------------------ ranks and their launcher


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def _kill_torchrun_and_wait_for(proc, ranks, log) -> None:
    """SIGKILL torchrun alone; its ranks must say why and be gone within seconds."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while any(_alive(r) for r in ranks) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(_alive(r) for r in ranks), "ranks outlived torchrun"
    assert "parent process" in log.read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_exit_when_torchrun_is_killed(demo_cache, tmp_path):
    """SIGKILL torchrun alone (its ranks live in sessions of their own): the ranks stop within a
    few seconds and write no checkpoint after that."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           os.path.join(REPO, "pretrain_dllm.py"), "--demo-cache-dir", demo_cache, *RUN,
           "--train-iters", "1000", "--save-interval", "1", "--save", str(ckpt)]
    env = launch_env(2)
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=log, stderr=log)
    try:
        deadline = time.time() + 120
        while not (ckpt / TRACKER).exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert (ckpt / TRACKER).exists(), (tmp_path / "run.log").read_text()[-3000:]
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        _kill_torchrun_and_wait_for(proc, ranks, tmp_path / "run.log")
        saved = sorted(os.listdir(ckpt))
        time.sleep(2)
        assert sorted(os.listdir(ckpt)) == saved  # nothing written after the ranks were gone
    finally:
        for r in _children(proc.pid) if _alive(proc.pid) else []:
            os.kill(r, signal.SIGKILL)
        log.close()


@pytest.mark.slow
def test_tokenizer_of_other_content_is_refused(trained, demo_cache, tmp_path):
    """The checkpoint records its tokenizer's SHA-256: the same file elsewhere passes, a file of
    other content (same vocabulary size or not) is refused with both files named."""
    from megatron_dllm.checkpoint.meta import CheckpointMeta
    from megatron_dllm.checkpoint.tokenizer_record import check_tokenizer
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    path = layout.iteration_dir(str(trained), 4)
    recorded = CheckpointMeta.read(path).tokenizer
    model = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    assert recorded.model == os.path.abspath(model) and recorded.sha256 == manifest.sha256(model)
    moved = tmp_path / "moved.model"
    shutil.copyfile(model, moved)
    check_tokenizer(recorded, str(moved), path)
    other = tmp_path / "other.model"
    data = bytearray(moved.read_bytes())
    data[-1] ^= 0xFF
    other.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"--tokenizer-model {other} differs from the tokenizer {path} was "
                                              f"trained with \\({recorded.model}, sha256"):
        check_tokenizer(recorded, str(other), path)


# a process killed inside layout.publish, at the one moment each way of replacing can be caught
_KILLED_IN_PUBLISH = """
import os, shutil, signal, sys
from megatron_dllm.checkpoint import layout
die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[3] == "swap":
    shutil.rmtree = die  # swapped: the old one, under the staging name, not yet removed
else:  # a filesystem that cannot swap: killed between moving the old one aside and the new one in
    layout._exchange = lambda a, b: False
    rename, calls = os.rename, []
    os.rename = lambda a, b: die() if calls.append(a) or len(calls) == 2 else rename(a, b)
layout.publish(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("how, survivor", [("swap", "new"), ("aside", "old")])
def test_a_save_killed_while_replacing_a_checkpoint_leaves_one_complete(tmp_path, how, survivor):
    """A run rolled back re-saves an iteration that exists: killed at any moment, the next start
    finds a complete checkpoint under the tracker's iteration and nothing else left over."""
    root = tmp_path / "ckpt"
    final, staging = layout.iteration_dir(str(root), 4), layout.staging_dir(str(root), 4, "abc")
    for path, text in ((final, "old"), (staging, "new")):
        os.makedirs(path)
        with open(os.path.join(path, "which"), "w") as f:
            f.write(text)
    layout.write_tracker(str(root), 4)
    proc = subprocess.run([sys.executable, "-c", _KILLED_IN_PUBLISH, staging, final, how], cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL
    layout.remove_incomplete_saves(str(root))  # what the next start does first
    assert layout.find_checkpoint(str(root)).path == final
    with open(os.path.join(final, "which")) as f:
        assert f.read() == survivor
    assert sorted(os.listdir(root)) == [os.path.basename(final), TRACKER]


def test_an_export_moved_aside_by_a_killed_overwrite_is_put_back(tmp_path):
    from megatron_dllm.hf.export import staged_export

    out = tmp_path / "hf"
    (tmp_path / "hf.replaced").mkdir()  # the earlier export, with no export under OUT
    (tmp_path / "hf.replaced" / "config.json").write_text("{}")
    with staged_export(str(out)) as staging:
        (tmp_path / staging / "config.json").write_text('{"new": 1}')
    assert (out / "config.json").read_text() == '{"new": 1}' and sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_exit_when_torchrun_is_killed_while_they_start(demo_cache, tmp_path):
    """SIGKILL torchrun a second after its ranks appear, while they still import and parse (seconds
    on a loaded machine): their watch runs from before that, so they stop too."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           os.path.join(REPO, "pretrain_dllm.py"), "--demo-cache-dir", demo_cache, *RUN, "--train-iters", "1000"]
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=launch_env(2), stdout=log, stderr=log)
    try:
        deadline = time.time() + 60
        while len(ranks := _children(proc.pid)) < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert len(ranks) == 2, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(1.0)
        _kill_torchrun_and_wait_for(proc, ranks, tmp_path / "run.log")
    finally:
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
