"""benchmarks/compare_loss_curves.py (FP8 against bf16 on a GPU with TE), on CPU: two real runs with
the same flags give the same curve to the bit (so only the compared flags can make a difference),
and a difference at the end beyond the tolerance fails."""
import pytest
from conftest import TINY_RUN, load_benchmark

curves = load_benchmark("compare_loss_curves")


@pytest.mark.slow
def test_two_runs_with_the_same_flags_give_the_same_curve(demo_cache, tmp_path, capsys):
    argv = ["--families", "mdlm", "--train-iters", "10", "--tail", "2", "--a", "", "--b", "", "--tolerance", "0",
            "--work", str(tmp_path), "--", "--demo-cache-dir", demo_cache, *TINY_RUN]
    assert curves.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 10 |" in out and "(mean of the last 2 logged losses each)" in out and "| 0.00% | yes |" in out, out


def test_a_difference_beyond_the_tolerance_fails(monkeypatch, capsys):
    runs = {"a": {10: 4.0, 20: 3.0, 30: 2.0}, "b": {10: 4.0, 20: 3.3, 30: 2.2}}
    monkeypatch.setattr(curves, "train", lambda family, flags, iters, work, name: runs[name])
    argv = ["--families", "duo", "--tail", "2", "--a", "", "--b", ""]
    assert curves.main([*argv, "--tolerance", "0.11"]) == 0
    assert curves.main([*argv, "--tolerance", "0.09"]) == 1  # the end: 2.5 against 2.75, 10%
    assert "| duo | 2.5000 | 2.7500 | 10.00% | NO |" in capsys.readouterr().out
    runs["b"] = {10: 4.0, 20: 3.0}
    with pytest.raises(ValueError, match="different iterations"):
        curves.main(argv)
    with pytest.raises(SystemExit) as exit_:  # too few logged losses: refused before any run
        curves.main([*argv, "--train-iters", "10"])
    assert exit_.value.code == 2 and "--train-iters 10 logs 1 losses" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # other log intervals: refused before any run
        curves.main([*argv[:-1], "--log-interval 5", "--train-iters", "20"])
    assert exit_.value.code == 2 and "log losses at different iterations" in capsys.readouterr().err
    for bad in ("0", "x"):  # a --log-interval that is no positive integer: one line, before any run
        with pytest.raises(SystemExit) as exit_:
            curves.main([*argv, "--", "--log-interval", bad])
        assert exit_.value.code == 2 and "--log-interval: " in capsys.readouterr().err
