"""Training-step forward + backward without and with gradient-accumulation fusion
(`--gradient-accumulation-fusion`: each weight gradient is added into its main gradient by the
weight-gradient GEMM itself, instead of a GEMM into a new tensor and DDP's `main_grad.add_`).

    python benchmarks/bench_gradient_accumulation_fusion.py [--presets cpu-small cpu-base] [--seqs 128 512]
                                                            [--families mdlm] [--tokens 2048] [--rounds 10]
                                                            [--warmup 2] [--threads N] [--bf16]

For every (preset, seq, family) both variants are built with the same weights and batch and timed
in alternating rounds in one process (`ab_rounds.py`, as bench_compile.py), SDPA core attention and
the platform's elementwise fusions in both. Prints a markdown table: median wall time and process
CPU time per step of each variant and the medians of the per-round ratios fused/unfused.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ab_rounds  # noqa: E402

VARIANTS = ("unfused", "fused")


def bench(preset_name: str, seq: int, family_name: str, args) -> dict:
    batch, row = ab_rounds.first_losses_then_rounds(
        preset_name, seq, family_name, args,
        {v: {"attention_backend": "sdpa", "gradient_accumulation_fusion": v == "fused"} for v in VARIANTS})
    print(f"| {preset_name} | {seq} x {batch} | {family_name} | {ab_rounds.ratio_cells(row)} | "
          f"{os.getloadavg()[0]:.1f} |", flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ab_rounds.add_grid_arguments(p, ["mdlm"])
    args = p.parse_args(argv)
    titles, rule = ab_rounds.ratio_head(VARIANTS)
    ab_rounds.run_grid(args, "attention sdpa, ", f"| preset | seq x batch | family | {titles} | load average |\n"
                       f"|---|---|---|{rule}---:|", bench)


if __name__ == "__main__":
    main()
