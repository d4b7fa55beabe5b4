"""What each selective recompute setting costs the training step's forward + backward, against
none: the time side of `bench_activation_memory.py`'s count.

    python benchmarks/bench_recompute_cost.py [--recompute mlp_act layernorm layernorm+mlp_act mlp]
                                              [--presets cpu-small] [--seqs 128] [--families mdlm]
                                              [--tokens 2048] [--rounds 10] [--warmup 2] [--threads N] [--bf16]

For every (preset, seq, family) and setting, the step without recompute and with the setting are
built with the same weights and batch and timed in alternating rounds in one process
(`ab_rounds.py`), SDPA core attention and the platform's elementwise fusions in both. Prints a
markdown table: median wall time and process CPU time per step of each and the medians of the
per-round ratios setting/off. On a CPU the elementwise passes that `layernorm` and `mlp_act`
repeat weigh more against the GEMMs than on a GPU: an upper bound of their share there.
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
from bench_train_step import recompute_setting  # noqa: E402


def bench(preset_name: str, seq: int, family_name: str, args) -> list[dict]:
    rows = []
    for setting in args.recompute:
        batch, row = ab_rounds.first_losses_then_rounds(
            preset_name, seq, family_name, args,
            {name: {"attention_backend": "sdpa", "recompute": recompute}
             for name, recompute in (("off", None), (setting, setting))})
        print(f"| {preset_name} | {seq} x {batch} | {family_name} | {setting} | {ab_rounds.ratio_cells(row)} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ab_rounds.add_grid_arguments(p, ["mdlm"])
    p.add_argument("--recompute", nargs="+", type=recompute_setting,
                   default=["mlp_act", "layernorm", "layernorm+mlp_act", "mlp"],
                   help="the settings timed against none: selective (core attention) or modules joined by '+'")
    args = p.parse_args(argv)
    titles, rule = ab_rounds.ratio_head(("off", "setting"))
    ab_rounds.run_grid(args, "attention sdpa, ", f"| preset | seq x batch | family | recompute | {titles} | "
                       f"load average |\n|---|---|---|---|{rule}---:|", bench)


if __name__ == "__main__":
    main()
