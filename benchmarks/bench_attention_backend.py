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

import torch  # noqa: E402
from ab_rounds import alternating_rounds, forward_backward, ratio_cells  # noqa: E402
from bench_train_step import MegatronStep, make_batch  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.families import get_family  # noqa: E402
from megatron_dllm.model.init import initialize_weights  # noqa: E402
from megatron_dllm.model.presets import get_preset  # noqa: E402

BACKENDS = ("local", "sdpa")


def bench(preset_name: str, seq: int, family_name: str, args) -> dict:
    preset, batch = get_preset(preset_name), max(1, args.tokens // seq)
    family = get_family(family_name, args.vocab - 1, args.vocab)
    inp = make_batch(family, args.vocab, batch, seq + int(family.extra_token)).to(platform.device())
    steps = {b: MegatronStep(preset, args.vocab, batch, seq, family, inp, train_iters=10, keep_initial=False,
                             attention_backend=b, bf16=args.bf16) for b in BACKENDS}
    for s in steps.values():  # live adaLN gates: with zero gates attention would not reach the loss
        initialize_weights(s.model[0].module, seed=7, adaln_zero=False)
    first = {b: forward_backward(s) for b, s in steps.items()}
    print(f"{preset_name} seq {seq} {family_name}: first loss " +
          "  ".join(f"{b} {v:.6f}" for b, v in first.items()), file=sys.stderr)
    row = {"preset": preset_name, "seq": seq, "batch": batch, "family": family_name}
    row.update(alternating_rounds(steps, args.rounds, args.warmup))
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["cpu-small", "cpu-base"])
    p.add_argument("--seqs", nargs="+", type=int, default=[128, 512])
    p.add_argument("--families", nargs="+", default=["mdlm", "ar"], help="mdlm: bidirectional, ar: causal")
    p.add_argument("--vocab", type=int, default=4097, help="real vocabulary including [MASK]")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (batch = tokens / seq)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--bf16", action="store_true", help="bf16 (GPU; the CPU runs fp32)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    platform.init_distributed(1, 1, seed=0)
    print(f"{platform.device_name() or 'CPU'}, {'bf16' if args.bf16 else 'fp32'}, {args.rounds} alternating "
          f"rounds after {args.warmup} warm-up, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"1-min load average {os.getloadavg()[0]:.1f} at the start\n")
    print("| preset | seq x batch | family (attention) | wall ms local | wall ms sdpa | **wall sdpa / local** | "
          "range | CPU ms local | CPU ms sdpa | **CPU sdpa / local** | range | load average |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|", flush=True)
    try:
        for preset in args.presets:
            for seq in args.seqs:
                for family in args.families:
                    r = bench(preset, seq, family, args)
                    kind = "causal" if family == "ar" else "bidirectional"
                    print(f"| {preset} | {seq} x {r['batch']} | {family} ({kind}) | {ratio_cells(r)} | "
                          f"{os.getloadavg()[0]:.1f} |", flush=True)
    finally:
        platform.destroy_distributed()


if __name__ == "__main__":
    main()
