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


def test_one_of_ours_that_raises_is_noted_and_the_others_still_run(capsys, monkeypatch):
    """A variant of ours whose step raises (not for lack of memory) gets a row with the error, its
    traceback goes to stderr, the other variants are measured, and `compare` names it for main's
    exit status."""
    bench = load_benchmark("bench_vs_paper_step")
    real_build = bench.build

    def build(variant, *args):
        if variant == "sdpa+selective":
            raise RuntimeError("no kernel\nfor | this")
        return real_build(variant, *args)

    monkeypatch.setattr(bench, "build", build)
    args = argparse.Namespace(seq=32, steps=1, warmup=1, rounds=1, max_micro_batch=2, peak_tflops=989.4)
    failed = bench.compare(["sdpa+selective", "sdpa"], None, get_preset("cpu-micro"), 64, "2", args)
    captured = capsys.readouterr()
    rows = [line.split(" | ") for line in captured.out.splitlines() if line.startswith("| 64 |")]
    assert failed == ["sdpa+selective"]
    assert rows[0][1:3] == ["sdpa+selective", "2: failed: RuntimeError: no kernel for / this"]
    assert rows[1][1:3] == ["sdpa", "2 (2)"] and float(rows[1][3]) > 0
    assert "Traceback" in captured.err


def test_our_variants_and_their_refusals():
    bench = load_benchmark("bench_vs_paper_step")
    assert bench.our_options("sdpa+graph") == {"attention_backend": "sdpa", "recompute": None, "cuda_graph": True}
    assert bench.our_options("local+selective")["recompute"] == "selective"
    assert bench.our_options("sdpa+layernorm+mlp")["recompute"] == "layernorm+mlp"  # bench_train_step's setting
    with pytest.raises(SystemExit, match="sdpa\\+full\\+graph: the full-iteration CUDA graph takes neither"):
        bench.our_options("sdpa+full+graph")
    with pytest.raises(SystemExit, match="unknown option 'graphs'"):
        bench.our_options("sdpa+graphs")
