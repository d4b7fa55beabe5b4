"""The training logger's metrics file across a resume: a run killed after logging iterations its
last checkpoint does not hold trains them again; the records of the earlier attempt are cut from
the end of the file (records before them stay, another run's in a shared file too), so that every
iteration has one record."""
import json

from megatron_dllm.training.logger import Logger


def _log(logger, iterations, loss):
    for it in iterations:
        logger.train(it, 6, loss + it, 1e-3, 0.5, 100.0, 0.1, 8 * it, 1e9 * it)
    logger.valid(iterations[-1], loss, 1e9, 8 * iterations[-1])


def test_a_resume_leaves_one_record_per_iteration(world_of_one, tmp_path, capsys):
    tb, metrics = str(tmp_path / "tb"), str(tmp_path / "metrics.jsonl")
    with open(metrics, "w") as f:  # another run's records before this run's in a shared file: kept
        f.write(json.dumps({"iteration": 9, "loss": 1.0}) + "\n")
    first = Logger(tb, metrics)
    _log(first, range(1, 6), 10.0)  # killed after iteration 5; the last checkpoint is iteration 3
    first.close()
    with open(metrics, "a") as f:
        f.write('{"iteration": 6, "loss": 1')  # a line the kill cut short
    again = Logger(tb, metrics)
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
