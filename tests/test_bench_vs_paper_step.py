"""benchmarks/bench_vs_paper_step.py's comparison on CPU, in process: when the paper's step raises,
its row carries the error and this project's step is still measured beside it."""
import argparse
import types

import pytest
import torch
from conftest import load_benchmark

from megatron_dllm.model.presets import get_preset

pytestmark = pytest.mark.usefixtures("world_of_one")


class FailingDiT(torch.nn.Module):
    """Stands in for the paper's `models/dit.py` DiT: built, then raising in its forward, as its
    compiled FlexAttention could on a GPU session's first meeting with it."""

    def __init__(self, config, vocab):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, sigma):
        raise RuntimeError("flex_attention: no kernel\nfor | this shape")


@pytest.mark.parametrize("setting", ["2", "max"])
def test_a_failing_paper_step_is_noted_and_ours_still_run(capsys, setting):
    bench = load_benchmark("bench_vs_paper_step")
    paper = types.SimpleNamespace(DiT=FailingDiT)
    args = argparse.Namespace(seq=32, steps=1, warmup=1, rounds=1, max_micro_batch=2, peak_tflops=989.4)
    bench.compare(["paper", "sdpa"], paper, get_preset("cpu-micro"), 64, setting, args)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 |")]
    assert [row[1] for row in rows] == ["paper", "sdpa"]
    assert rows[0][2] == f"{setting}: the paper's code failed: RuntimeError: flex_attention: no kernel for / this shape"
    assert rows[1][2] == f"2 ({setting})" and rows[1][5] == "n/a"  # measured; no paper rate to divide by
    assert float(rows[1][3]) > 0 and float(rows[1][-1].rstrip(" |")) > 0  # step ms, loss
