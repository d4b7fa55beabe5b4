"""The training logger's metrics file across a resume: a run killed after logging iterations its
last checkpoint does not hold trains them again; the records of the earlier attempt (the same
--save) are cut from the end of the file (another run's records in a shared file stay), so that
every iteration has one record."""
import json
import os
import threading

import pytest

from megatron_dllm.training.logger import Logger


def _log(logger, iterations, loss):
    for it in iterations:
        logger.train(it, 6, loss + it, 1e-3, 0.5, 100.0, 0.1, 8 * it, 1e9 * it)
    logger.valid(iterations[-1], loss, 1e9, 8 * iterations[-1])


def test_a_resume_leaves_one_record_per_iteration(world_of_one, tmp_path, capsys):
    tb, metrics = str(tmp_path / "tb"), str(tmp_path / "metrics.jsonl")
    with open(metrics, "w") as f:  # another run's records before this run's in a shared file: kept
        f.write(json.dumps({"iteration": 9, "loss": 1.0}) + "\n")
    first = Logger(tb, metrics, save_dir=str(tmp_path / "ckpt"))
    _log(first, range(1, 6), 10.0)  # killed after iteration 5; the last checkpoint is iteration 3
    first.close()
    with open(metrics, "a") as f:
        f.write('{"iteration": 6, "loss": 1')  # a line the kill cut short
    again = Logger(tb, metrics, save_dir=str(tmp_path / "ckpt"))
    again.resumed_at(3)
    assert "dropped its last 4 records (iterations after 3" in capsys.readouterr().out
    _log(again, range(4, 7), 20.0)
    again.close()
    with open(metrics) as f:
        lines = f.read().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["iteration"] for r in records if "loss" in r] == [9, 1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records if "loss" in r][4:] == [24.0, 25.0, 26.0]  # the replay's
    assert [r["consumed_samples"] for r in records if "valid_nelbo" in r] == [48]


def test_another_runs_later_records_in_a_shared_file_stay(world_of_one, tmp_path, capsys):
    metrics = str(tmp_path / "shared.jsonl")
    first = Logger(None, metrics, save_dir=str(tmp_path / "a"))
    _log(first, range(1, 4), 10.0)  # run A, killed after iteration 3; its checkpoint is iteration 2
    first.close()
    other = Logger(None, metrics, save_dir=str(tmp_path / "b"))
    _log(other, range(1, 6), 30.0)  # run B, from scratch into the same file
    other.close()
    with open(metrics) as f:
        before = f.read()
    again = Logger(None, metrics, save_dir=str(tmp_path / "a"))
    again.resumed_at(2)  # B's records after iteration 2 are not A's to cut
    again.close()
    with open(metrics) as f:
        assert f.read() == before
    assert "dropped" not in capsys.readouterr().out
    assert {r["save"] for r in map(json.loads, before.splitlines())} == {str(tmp_path / "a"), str(tmp_path / "b")}


def test_an_attempt_killed_before_its_first_save_and_a_repeated_final_validation(world_of_one, tmp_path):
    """Killed before any checkpoint, the run starts again at iteration 0: every record of the
    earlier attempt goes. A finished run started again only validates: the earlier validation of
    its last iteration goes, its training records stay."""
    metrics, save = str(tmp_path / "metrics.jsonl"), str(tmp_path / "ckpt")
    first = Logger(None, metrics, save_dir=save)
    _log(first, [1, 2], 10.0)
    first.close()
    again = Logger(None, metrics, save_dir=save)
    again.resumed_at(0)
    _log(again, [1, 2, 3], 20.0)
    again.close()
    finished = Logger(None, metrics, save_dir=save)
    finished.resumed_at(3, validating_only=True)
    finished.valid(3, 5.0)
    finished.close()
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    assert [(r["iteration"], "loss" in r) for r in records] == [(1, True), (2, True), (3, True), (3, False)]
    assert [r["loss"] for r in records if "loss" in r] == [21.0, 22.0, 23.0] and records[-1]["valid_nelbo"] == 5.0


def test_a_fresh_run_or_one_validating_an_earlier_checkpoint_cuts_no_other_record(world_of_one, tmp_path):
    """A fresh run keeps the records of a run without --save before it in the file; one that only
    validates an earlier checkpoint of a finished run keeps that run's later iterations."""
    metrics, save = str(tmp_path / "metrics.jsonl"), str(tmp_path / "ckpt")
    unsaved = Logger(None, metrics)
    _log(unsaved, [1, 2], 10.0)
    unsaved.close()
    fresh = Logger(None, metrics, save_dir=save)
    fresh.resumed_at(0)
    _log(fresh, [1, 2, 3, 4], 20.0)
    fresh.close()
    with open(metrics) as f:
        before = f.read()
    earlier = Logger(None, metrics, save_dir=save)
    earlier.resumed_at(2, validating_only=True)  # --ckpt-step 2 --train-iters 2
    earlier.close()
    with open(metrics) as f:
        assert f.read() == before and len(before.splitlines()) == 3 + 5


def test_records_of_an_earlier_version_without_save_are_cut_as_the_run_s_own(world_of_one, tmp_path):
    """A run upgraded between requeues: its records from before records named their --save."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i, "loss": 1.0}) + "\n" for i in range(1, 5)))
    again = Logger(None, str(metrics), save_dir=str(tmp_path / "ckpt"))
    again.resumed_at(2)
    again.close()
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_a_resume_logging_to_a_pipe_goes_on(world_of_one, tmp_path):
    read_end, write_end = os.pipe()  # --metrics-file /dev/stdout with stdout piped: nothing to cut
    logger = Logger(None, f"/proc/self/fd/{write_end}", save_dir=str(tmp_path / "ckpt"))
    resume = threading.Thread(target=logger.resumed_at, args=(3,), daemon=True)
    resume.start()
    resume.join(timeout=10)
    assert not resume.is_alive(), "resumed_at waited for the pipe's end"
    _log(logger, [4], 1.0)
    logger.close()
    os.close(write_end)
    with os.fdopen(read_end) as f:
        assert [json.loads(line)["iteration"] for line in f] == [4, 4]


def test_a_metrics_file_that_cannot_be_written_is_named(world_of_one, tmp_path):
    from megatron_dllm.errors import InputError

    logger = Logger(None, "/dev/full")  # every write: no space left on device
    with pytest.raises(InputError, match=r"^--metrics-file /dev/full: cannot write \(No space left on device\)$"):
        _log(logger, [1], 1.0)


def test_a_moved_run_knows_its_records_and_a_new_run_in_a_reused_path_does_not(world_of_one, tmp_path, capsys):
    """The run id lives in --save: it moves with the directory and goes with it."""
    import shutil

    metrics = str(tmp_path / "metrics.jsonl")
    first = Logger(None, metrics, save_dir=str(tmp_path / "a"))
    _log(first, range(1, 6), 10.0)  # killed after iteration 5; the last checkpoint is iteration 3
    first.close()
    os.rename(tmp_path / "a", tmp_path / "b")  # the run's directory moved before the resume
    again = Logger(None, metrics, save_dir=str(tmp_path / "b"))
    again.resumed_at(3)
    _log(again, range(4, 7), 20.0)
    again.close()
    shutil.rmtree(tmp_path / "b")  # the finished run deleted; a new run in the same path
    fresh = Logger(None, metrics, save_dir=str(tmp_path / "b"))
    fresh.resumed_at(0)
    _log(fresh, [1, 2], 30.0)
    fresh.close()
    records = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6, 1, 2]
    assert len({r["run"] for r in records}) == 2 and "dropped its last 3 records" in capsys.readouterr().out


def test_records_naming_the_save_path_of_an_earlier_version_are_cut_only_on_a_resume(world_of_one, tmp_path):
    metrics, save = tmp_path / "metrics.jsonl", str(tmp_path / "ckpt")
    metrics.write_text("".join(json.dumps({"iteration": i, "loss": 1.0, "save": save}) + "\n" for i in range(1, 5)))
    fresh = Logger(None, str(metrics), save_dir=save)
    fresh.resumed_at(0)  # a new run in that path: not its records
    fresh.close()
    assert len(metrics.read_text().splitlines()) == 4
    again = Logger(None, str(metrics), save_dir=save)
    again.resumed_at(2)
    again.close()
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2]
