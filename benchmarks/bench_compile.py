"""Training-step forward + backward, eager against fused (`--compile-elementwise`, `--bias-gelu-fusion`,
`--bias-dropout-fusion`, and `--masked-softmax-fusion` where apex's kernels are installed).

    python benchmarks/bench_compile.py [--presets cpu-small cpu-base] [--seqs 128 512]
                                       [--families mdlm esolm] [--tokens 2048] [--rounds 10]
                                       [--warmup 2] [--threads N] [--attention-backend local|sdpa] [--bf16]

On a GPU (`--bf16`) the same comparison runs on the device, e.g. the 1.7B preset at seq 2048
(see docs/gpu.md).

For every (preset, seq, family) both variants are built with the same weights (adaLN gates drawn,
not zero) and batch (`tokens / seq` sequences) and timed in alternating rounds (eager, fused,
then fused, eager, ...) after warm-up rounds, in one process; the fused variant's first step,
which compiles, is reported on its own. One step is megatron's `forward_backward_func` as in
bench_attention_backend.py. Both variants' first losses are printed to show they compute the same
step. Prints a markdown table: median wall time and process CPU time per step of each variant,
the medians of the per-round ratios fused/eager, and the load average.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ab_rounds  # noqa: E402

VARIANTS = ("eager", "fused")


def bench(preset_name: str, seq: int, family_name: str, args) -> dict:
    fusions = {"eager": "none", "fused": "all"}
    batch, steps = ab_rounds.build_variants(preset_name, seq, family_name, args,
                                            {v: {"attention_backend": args.attention_backend, "fusion": fusions[v]}
                                             for v in VARIANTS})
    first, first_s = {}, {}
    for v, s in steps.items():
        start = time.perf_counter()
        first[v] = ab_rounds.forward_backward(s)
        first_s[v] = time.perf_counter() - start
    print(f"{preset_name} seq {seq} {family_name}: first loss " +
          "  ".join(f"{v} {first[v]:.6f} ({first_s[v]:.1f} s)" for v in VARIANTS), file=sys.stderr)
    row = {"batch": batch, "compile_s": first_s["fused"] - first_s["eager"],
           "fusion": steps["fused"].config.model.fusion(use_te=False)}
    row.update(ab_rounds.alternating_rounds(steps, args.rounds, args.warmup))
    print(f"| {preset_name} | {seq} x {batch} | {family_name} | {ab_rounds.ratio_cells(row)} | "
          f"{row['compile_s']:.1f} s | {os.getloadavg()[0]:.1f} |", flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ab_rounds.add_grid_arguments(p, ["mdlm", "esolm"])
    p.add_argument("--attention-backend", default="local", choices=["local", "sdpa"], help="core attention")
    args = p.parse_args(argv)
    titles, rule = ab_rounds.ratio_head(VARIANTS)
    rows = ab_rounds.run_grid(args, f"attention {args.attention_backend}, ",
                              f"| preset | seq x batch | family | {titles} | first step extra (compile) | "
                              f"load average |\n|---|---|---|{rule}---:|---:|", bench)
    print(f"\nfused = {rows[-1]['fusion'].describe()}")


if __name__ == "__main__":
    main()
