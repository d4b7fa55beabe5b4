"""torchrun worker (2 gloo ranks; argv[2]: `tp2-sp`, TP=2 with sequence parallelism;
`dp2-overlap`, two data-parallel ranks on samples of their own with the distributed optimizer and
the gradient reduction overlapped with the backward; or `pp2-gpt-tied`, PP=2 of the GPT backbone
with its tied embedding): tests/step_cases.py's training with and
without gradient-accumulation fusion, weights held still; whether every rank's losses and
gradients equal its unfused run's and the fused kernel ran, as JSON (last rank)."""
import json
import sys

import torch
import torch.distributed as dist
from step_cases import train

from megatron_dllm import platform
from megatron_dllm.model.fusion import WeightGradientKernels

LAYOUTS = {"tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "dp2-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
           "pp2-gpt-tied": ["--pipeline-model-parallel-size", "2", "--backbone", "gpt"]}


def main():
    tp, pp = {"tp2-sp": (2, 1), "pp2-gpt-tied": (1, 2)}.get(sys.argv[2], (1, 1))
    platform.init_distributed(tp, pp, seed=0)
    flags = ["--lr", "0", "--min-lr", "0", *LAYOUTS[sys.argv[2]]]
    first = 1000 * dist.get_rank() if tp * pp == 1 else 0  # data parallel: samples of its own
    want_losses, _, _, plain = train("esolm", 2, *flags, "--no-gradient-accumulation-fusion", first=first)
    calls, real = [], WeightGradientKernels.wgrad_gemm_accum_fp32
    WeightGradientKernels.wgrad_gemm_accum_fp32 = staticmethod(lambda *a: calls.append(1) or real(*a))
    losses, _, _, fused = train("esolm", 2, *flags, "--gradient-accumulation-fusion", first=first)
    want = [p.main_grad for p in plain.model[0].module.parameters()]
    got = [p.main_grad for p in fused.model[0].module.parameters()]
    scale = max(g.abs().max().item() for g in want)
    mine = {"losses_equal": all(a == b or abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, want_losses)),
            "gradients_equal": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale) for a, b in zip(got, want)),
            "fused_calls": len(calls) > 0}
    every = [None, None]
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 1:
        with open(sys.argv[1], "w") as f:
            json.dump({k: all(r[k] for r in every) for k in mine}, f)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
