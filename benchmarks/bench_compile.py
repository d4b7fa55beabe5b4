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

import torch  # noqa: E402
from ab_rounds import alternating_rounds, forward_backward, ratio_cells  # noqa: E402
from bench_train_step import MegatronStep, make_batch  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.families import get_family  # noqa: E402
from megatron_dllm.model.init import initialize_weights  # noqa: E402
from megatron_dllm.model.presets import get_preset  # noqa: E402

VARIANTS = ("eager", "fused")


def bench(preset_name: str, seq: int, family_name: str, args) -> dict:
    preset, batch = get_preset(preset_name), max(1, args.tokens // seq)
    family = get_family(family_name, args.vocab - 1, args.vocab)
    inp = make_batch(family, args.vocab, batch, seq + int(family.extra_token)).to(platform.device())
    fusions = {"eager": "none", "fused": "all"}
    steps = {v: MegatronStep(preset, args.vocab, batch, seq, family, inp, train_iters=10, keep_initial=False,
                             attention_backend=args.attention_backend, bf16=args.bf16, fusion=fusions[v])
             for v in VARIANTS}
    for s in steps.values():  # live adaLN gates: every region reaches the loss
        initialize_weights(s.model[0].module, seed=7, adaln_zero=False)
    first, first_s = {}, {}
    for v, s in steps.items():
        start = time.perf_counter()
        first[v] = forward_backward(s)
        first_s[v] = time.perf_counter() - start
    print(f"{preset_name} seq {seq} {family_name}: first loss " +
          "  ".join(f"{v} {first[v]:.6f} ({first_s[v]:.1f} s)" for v in VARIANTS), file=sys.stderr)
    row = {"batch": batch, "compile_s": first_s["fused"] - first_s["eager"],
           "fusion": steps["fused"].config.model.fusion(use_te=False)}
    row.update(alternating_rounds(steps, args.rounds, args.warmup))
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["cpu-small", "cpu-base"])
    p.add_argument("--seqs", nargs="+", type=int, default=[128, 512])
    p.add_argument("--families", nargs="+", default=["mdlm", "esolm"])
    p.add_argument("--vocab", type=int, default=4097, help="real vocabulary including [MASK]")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (batch = tokens / seq)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--attention-backend", default="local", choices=["local", "sdpa"], help="core attention")
    p.add_argument("--bf16", action="store_true", help="bf16 (GPU; the CPU runs fp32)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    platform.init_distributed(1, 1, seed=0)
    print(f"{platform.device_name() or 'CPU'}, {'bf16' if args.bf16 else 'fp32'}, attention {args.attention_backend}, "
          f"{args.rounds} alternating rounds after {args.warmup} warm-up, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; 1-min load average {os.getloadavg()[0]:.1f} at the start\n")
    print("| preset | seq x batch | family | wall ms eager | wall ms fused | **wall fused / eager** | range | "
          "CPU ms eager | CPU ms fused | **CPU fused / eager** | range | first step extra (compile) | load average |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|", flush=True)
    try:
        for preset in args.presets:
            for seq in args.seqs:
                for family in args.families:
                    r = bench(preset, seq, family, args)
                    print(f"| {preset} | {seq} x {r['batch']} | {family} | {ratio_cells(r)} | "
                          f"{r['compile_s']:.1f} s | {os.getloadavg()[0]:.1f} |", flush=True)
        print(f"\nfused = {r['fusion'].describe()}")
    finally:
        platform.destroy_distributed()


if __name__ == "__main__":
    main()
