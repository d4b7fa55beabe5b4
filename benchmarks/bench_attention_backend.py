"""Training-step forward + backward on CPU with `--attention-backend local` against `sdpa`.

    python benchmarks/bench_attention_backend.py [--presets cpu-small cpu-base] [--seqs 128 512]
                                                 [--families mdlm ar] [--tokens 2048] [--rounds 10]
                                                 [--warmup 2] [--threads N] [--bf16]

On a GPU (`--bf16`) the same comparison runs on the device, e.g. the 1.7B preset at seq 2048
(see docs/gpu.md).

For every (preset, seq, family) both backends are built with the same weights (adaLN gates drawn,
not zero) and batch (`tokens / seq` sequences; MDLM bidirectional, AR causal) and timed in
alternating rounds (local, sdpa, then sdpa, local, ...) after warm-up rounds, in one process.
One step is the trainer's own `training.step.forward_backward` (megatron's `forward_backward_func`:
forward, family loss, backward into DDP's grad buffers) at TP=1, without the optimizer step (the
same in both). Both backends' first
losses are printed to show they compute the same step. Prints a markdown table: median wall time
and process CPU time (all threads; less sensitive to other processes on a shared machine) per
step of each backend, the medians of the per-round ratios sdpa/local, and the load average.
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

from megatron_dllm.families import FAMILIES  # noqa: E402

BACKENDS = ("local", "sdpa")


def bench(preset_name: str, seq: int, family_name: str, args) -> dict:
    batch, stats = ab_rounds.first_losses_then_rounds(preset_name, seq, family_name, args,
                                                      {b: {"attention_backend": b} for b in BACKENDS})
    row = {"preset": preset_name, "seq": seq, "batch": batch, "family": family_name, **stats}
    kind = FAMILIES[family_name].attention
    print(f"| {preset_name} | {seq} x {batch} | {family_name} ({kind}) | {ab_rounds.ratio_cells(row)} | "
          f"{os.getloadavg()[0]:.1f} |", flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ab_rounds.add_grid_arguments(p, ["mdlm", "ar"], "mdlm: bidirectional, ar: causal")
    args = p.parse_args(argv)
    titles, rule = ab_rounds.ratio_head(BACKENDS)
    ab_rounds.run_grid(args, "", f"| preset | seq x batch | family (attention) | {titles} | load average |\n"
                                 f"|---|---|---|{rule}---:|", bench)


if __name__ == "__main__":
    main()
