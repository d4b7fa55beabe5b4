"""benchmarks/compare_loss_curves.py (FP8 against bf16 on a GPU with TE): on CPU with flags a CPU
has. Two runs with the same flags give the same curve to the bit (only the compared flags may
differ between them), and a real difference at the end fails the tolerance."""
import pytest
from conftest import TINY_RUN, load_benchmark

curves = load_benchmark("compare_loss_curves")


@pytest.mark.slow
def test_same_flags_give_the_same_curve_and_a_changed_flag_fails_the_tolerance(demo_cache, tmp_path, capsys):
    both = ["--", "--demo-cache-dir", demo_cache, *TINY_RUN]
    same = ["--families", "mdlm", "--train-iters", "20", "--tail", "2", "--a", "", "--b", ""]
    assert curves.main([*same, "--tolerance", "0", "--work", str(tmp_path / "same"), *both]) == 0
    out = capsys.readouterr().out
    assert "| 20 |" in out and "(mean of the last 2 logged losses each)" in out and "| 0.00% | yes |" in out, out

    changed = ["--families", "mdlm", "--train-iters", "20", "--tail", "2", "--a", "", "--b", "--lr 0.003"]
    assert curves.main([*changed, "--tolerance", "0.001", "--work", str(tmp_path / "changed"), *both]) == 1
    out = capsys.readouterr().out
    assert "| within 0.1% |" in out and "% | NO |" in out, out


def test_the_end_is_the_mean_of_the_last_logged_losses():
    a, b = {10: 4.0, 20: 3.0, 30: 2.0}, {10: 4.0, 20: 3.3, 30: 2.2}
    end_a, end_b, diff = curves.end_difference(a, b, 2)
    assert (end_a, end_b) == (2.5, 2.75) and diff == pytest.approx(0.1)
    with pytest.raises(ValueError, match="different iterations"):
        curves.end_difference(a, {10: 4.0, 20: 3.0}, 2)
