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
    assert all(" gsm8k --load " in line and line.endswith("--limit 5") for line in evals)
    assert f"{tmp_path}/lr2e-05_min5e-08/checkpoints" in train[1] and f"{tmp_path}/lr2e-05_min5e-08" in evals[1]


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


def test_flags_set_per_pair_are_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        sft_lr_grid.main(["print", "--run-dir", str(tmp_path), "--", "--sft", "--lr", "1e-4"])
    assert exit_.value.code == 2
