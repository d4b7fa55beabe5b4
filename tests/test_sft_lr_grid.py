"""tools/sft_lr_grid.py: the paper's six (lr, min-lr) pairs become fine-tuning + GSM8K commands, and
the per-pair results one table."""
import json

import pytest

from megatron_dllm.cli import sft_lr_grid


def test_print_gives_two_commands_per_paper_pair(capsys, tmp_path):
    assert sft_lr_grid.main(["print", "--run-dir", str(tmp_path), "--limit", "5", "--",
                             "--family", "duo", "--sft", "--train-epochs", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 12
    train, evals = lines[0::2], lines[1::2]
    pairs = [(line.split("--lr ")[1].split()[0], line.split("--min-lr ")[1].split()[0]) for line in train]
    assert pairs == [("1e-05", "2e-06"), ("2e-05", "5e-08"), ("2e-05", "5e-07"), ("2e-05", "2e-06"),
                     ("4e-05", "2e-06"), ("5e-05", "5e-06")]
    assert all("pretrain_dllm.py --family duo --sft --train-epochs 5" in line for line in train)
    assert all(" gsm8k --load " in line and line.endswith("--limit 5 --overwrite") for line in evals)
    assert not any("--load" in line for line in train)  # the flags' own --load, if any, is the start
    assert f"{tmp_path}/lr2e-05_min5e-08/checkpoints" in train[1] and f"{tmp_path}/lr2e-05_min5e-08" in evals[1]
    # the exact lr reaches training; pairs that 6 significant digits write alike would share a run
    assert sft_lr_grid.main(["print", "--run-dir", str(tmp_path), "--pairs", "1.0000001e-5:2e-6", "--",
                             "--family", "duo", "--sft"]) == 0
    assert " --lr 1.0000001e-05 " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sft_lr_grid.main(["print", "--run-dir", str(tmp_path), "--pairs", "1e-5:2e-6", "1.0000001e-5:2e-6", "--",
                          "--family", "duo", "--sft"])
    assert "two pairs alike to 6 significant digits" in capsys.readouterr().err


def test_collect_tabulates_and_marks_missing_runs(capsys, tmp_path):
    for (lr, min_lr), acc in (((1e-5, 2e-6), 0.25), ((4e-5, 2e-6), 0.5)):
        d = tmp_path / f"lr{lr:g}_min{min_lr:g}"
        d.mkdir()
        (d / "gsm8k.json").write_text(json.dumps({"accuracy": acc, "problems": 1319,
                                                  "throughput_tokens_per_s": 25.0}))
    assert sft_lr_grid.main(["collect", "--run-dir", str(tmp_path), "--output", str(tmp_path / "t.md")]) == 0
    table = capsys.readouterr().out
    assert "| 1e-05 | 2e-06 | 25.0 | 1319 | 25.0 |" in table and "| 4e-05 | 2e-06 | 50.0 | 1319 | 25.0 |" in table
    assert table.count("missing") == 4 and "best: lr 4e-05, min-lr 2e-06 (50.0%)" in table
    assert (tmp_path / "t.md").read_text().strip() == table.strip()
    # the table is not written over without --overwrite; a result cut short is named, not a traceback
    assert sft_lr_grid.main(["collect", "--run-dir", str(tmp_path), "--output", str(tmp_path / "t.md")]) == 2
    assert f"--output {tmp_path / 't.md'} already exists; pass --overwrite" in capsys.readouterr().err
    cut = tmp_path / "lr1e-05_min2e-06" / "gsm8k.json"
    cut.write_text('{"accuracy": 0.2')
    assert sft_lr_grid.main(["collect", "--run-dir", str(tmp_path), "--output", str(tmp_path / "t.md"),
                             "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {cut}: not a GSM8K result of tools/evaluate.py gsm8k")
    # before any run: the table of missing runs, in a directory made for it
    assert sft_lr_grid.main(["collect", "--run-dir", str(tmp_path / "new"), "--output",
                             str(tmp_path / "new" / "t.md")]) == 0
    assert (tmp_path / "new" / "t.md").read_text().count("missing") == 6


@pytest.mark.parametrize("argv, message", [
    (["--", "--sft", "--lr", "1e-4"], "--lr: --lr, --min-lr, --save are set per pair"),
    (["--", "--sft", "--lr=1e-4"], "--lr=1e-4: --lr, --min-lr, --save are set per pair"),
    (["--", "--sft", "--pretrained-checkpoint", "p", "--load", "x"],
     "--load: --lr, --min-lr, --save, --load are set per pair"),
    (["--pairs", "1e-5:1e-6", "1e-5:1e-6", "--", "--sft"], "--pairs: a pair is given twice"),
    (["--limit", "0", "--", "--sft"], "argument --limit: expected a positive integer, got 0"),
])
def test_flags_that_would_be_lost_are_refused(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        sft_lr_grid.main(["print", "--run-dir", str(tmp_path), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_launch_checks_the_flags_before_the_first_fine_tuning(tmp_path, capsys, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("a command was started"))
    with pytest.raises(SystemExit) as exit_:
        sft_lr_grid.main(["launch", "--run-dir", str(tmp_path), "--", "--family", "nosuch"])
    assert exit_.value.code == 2 and "--family 'nosuch' is not a known family" in capsys.readouterr().err
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: 1)  # the first fine-tuning fails
    assert sft_lr_grid.main(["launch", "--run-dir", str(tmp_path), "--", "--family", "duo", "--train-iters", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("error: the fine-tuning of lr 1e-05, min-lr 2e-06 exited with "
                                                        "status 1; the grid stops (pairs finished before it keep their "
                                                        "results)")


def test_launch_again_continues_the_grid(tmp_path, capsys, monkeypatch):
    """A pair scored already is skipped; with --pretrained-checkpoint each pair loads its own --save,
    so a pair whose scoring never ran resumes (or only evaluates) instead of being refused."""
    import subprocess

    started = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: started.append(cmd) or 0)
    pairs = ["--pairs", "1e-5:2e-6", "4e-5:2e-6"]
    scored = tmp_path / "lr1e-05_min2e-06"
    scored.mkdir()
    (scored / "gsm8k.json").write_text("{}")
    assert sft_lr_grid.main(["launch", "--run-dir", str(tmp_path), *pairs, "--", "--family", "duo",
                             "--pretrained-checkpoint", "pre", "--train-iters", "2"]) == 0
    assert "# lr 1e-05, min-lr 2e-06: scored already (gsm8k.json), skipped" in capsys.readouterr().out
    train, score = started
    ckpt = str(tmp_path / "lr4e-05_min2e-06" / "checkpoints")
    assert train[train.index("--load") + 1] == train[train.index("--save") + 1] == ckpt
    assert score[score.index("--load") + 1] == ckpt and score[-1] == "--overwrite"


def _fine_tuned(root, pair: str, reached: int, planned: int = 4) -> None:
    """What a fine-tuning leaves in its --save: the tracker and its run_config.yaml."""
    ckpt = root / pair / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(reached))
    (ckpt / "run_config.yaml").write_text(f"family: duo\ntraining:\n  train-iters: {planned}\n")


def test_a_fine_tuning_stopped_by_an_exit_condition_is_not_scored(tmp_path, capsys, monkeypatch):
    """--exit-duration-in-mins saves and exits 0 before --train-iters (Megatron-LM's convention):
    the grid stops before scoring that checkpoint, launched again it continues the pair, and a
    result scored from such a checkpoint is neither skipped nor ranked."""
    import subprocess

    started = []

    def call(cmd, reached):
        started.append(cmd)
        if "gsm8k" not in cmd:
            _fine_tuned(tmp_path, "lr4e-05_min2e-06", reached)
        return 0

    argv = ["launch", "--run-dir", str(tmp_path), "--pairs", "4e-5:2e-6", "--", "--family", "duo",
            "--pretrained-checkpoint", "pre", "--train-iters", "4"]
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: call(cmd, 2))
    assert sft_lr_grid.main(argv) == 2 and len(started) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: the fine-tuning of lr 4e-05, min-lr 2e-06 stopped at iteration 2 of 4 (an exit condition: "
        "--exit-duration-in-mins, --exit-interval or a signal); the grid stops before scoring it: launch again to "
        "continue it")
    (tmp_path / "lr4e-05_min2e-06" / "gsm8k.json").write_text(json.dumps(
        {"accuracy": 0.9, "problems": 3, "throughput_tokens_per_s": 1.0}))  # an earlier scoring of iteration 2
    assert sft_lr_grid.main(["collect", "--run-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| 4e-05 | 2e-06 | unfinished (iteration 2 of 4) | | |" in table and "best" not in table
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: call(cmd, 4))
    assert sft_lr_grid.main(argv) == 0 and len(started) == 3 and "gsm8k" in started[-1]
    assert "scored already" not in capsys.readouterr().out
    # started with --load PRETRAINED --finetune, a pair cannot resume its own checkpoints: said so
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: call(cmd, 2))
    (tmp_path / "lr4e-05_min2e-06" / "gsm8k.json").unlink()
    finetune = [a for a in argv if a not in ("--pretrained-checkpoint", "pre")] + ["--load", "pre", "--finetune"]
    assert sft_lr_grid.main(finetune) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "a --load PRETRAINED --finetune run cannot continue: use --pretrained-checkpoint, or remove the pair's "
        "checkpoints/")


def test_collect_finds_the_pairs_a_grid_ran(tmp_path, capsys):
    """`collect --run-dir D` after `launch --pairs ...`: the pairs of D's lr*_min* directories."""
    for name, acc in (("lr0.001_min0.0001", 0.5), ("lr0.002_min0.0001", 0.25)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "gsm8k.json").write_text(json.dumps({"accuracy": acc, "problems": 3,
                                                                 "throughput_tokens_per_s": 2.0}))
    (tmp_path / "lrx_min0.1").mkdir()  # not a pair's directory
    assert sft_lr_grid.main(["collect", "--run-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "missing" not in table and table.count("| 3 | 2.0 |") == 2 and "best: lr 0.001, min-lr 0.0001" in table
