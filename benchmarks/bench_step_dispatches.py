"""ATen operations one training step dispatches per micro-batch, by family: with the loss heads
eager and with them compiled (`--compile-elementwise`'s heads, each chunk body one call).

    python benchmarks/bench_step_dispatches.py [--families mdlm duo esolm ar] [--layers 28]
                                               [--batch 4] [--seq 2048] [--vocab 32001]

On a GPU each dispatched operation is a kernel launch and host time: on 2026-11-27 the 1.7B step
on one H100 was host-bound at micro-batch 4 (benchmarks/RESULTS.md). The count depends on the
number of layers, the micro-batch's shape and the vocabulary (the heads' row chunks), not on the
hidden size, so the model here is `cpu-micro`'s width at `--layers` depth: the 1.7B step's counts
without its arithmetic. It is the trainer's step (`bench_train_step.MegatronStep`, SDPA
attention) with the DiT's elementwise work eager: dynamo does not trace under the counting
dispatch mode, so the compiled regions cannot be counted (they are the same for every family).
On CPU the step runs in fp32 (`platform.params_dtype`), where the eager cross entropy works the
logits whole and in place; bf16 logits, as on the GPU, take it 156 operations more in 64 MiB
chunks (`bench_loss_heads.py`: 227 against 71 at 4 x 2048 x 32,001).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_kernel_count import OpCounter  # noqa: E402
from bench_loss_heads import heads_counted_as_compiled  # noqa: E402
from bench_train_step import MegatronStep  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.families import Noise, get_family  # noqa: E402
from megatron_dllm.model.presets import get_preset  # noqa: E402


def dispatches(step) -> int:
    with OpCounter() as counter:
        step()
    return sum(counter.ops.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["mdlm", "duo", "esolm", "ar"])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32001)
    args = ap.parse_args(argv)
    platform.init_distributed(1, 1, seed=0)
    preset = dataclasses.replace(get_preset("cpu-micro"), num_layers=args.layers)
    print(f"one training step, micro-batch {args.batch} x {args.seq}, vocabulary {args.vocab}, {args.layers} layers "
          f"(cpu-micro's width), SDPA, the DiT's elementwise work eager; torch {torch.__version__}")
    print("| family | ATen ops, heads eager | ATen ops, heads compiled | eager / compiled |")
    print("|---|---:|---:|---:|")
    for name in args.families:
        family = get_family(name, args.vocab - 1, args.vocab)
        length = args.seq + family.extra_token
        ids = torch.arange(args.batch)
        inp = family.corrupt(torch.randint(0, args.vocab - 1, (args.batch, length)), Noise(1, ids, ids, args.batch))
        step = MegatronStep(preset, args.vocab, args.batch, args.seq, family, inp, 3, keep_initial=False,
                            attention_backend="sdpa", fusion="none")
        step()  # warm-up: lazily built state, the optimizer's first step
        eager = dispatches(step)
        with heads_counted_as_compiled() as calls:
            compiled = dispatches(step) + len(calls)
        print(f"| {name} | {eager} | {compiled} | {eager / compiled:.2f} |", flush=True)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
