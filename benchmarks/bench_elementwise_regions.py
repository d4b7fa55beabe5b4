"""The DiT layer's middle elementwise work compiled as one region (`residual_norm_modulate`, what
the layer runs) beside the same work as two compiled regions (`gated_residual`, then
`norm_modulate`, what it ran before): forward and backward, time per call.

    python benchmarks/bench_elementwise_regions.py [--shapes 32x64 2048x256 16384x2176] [--dtype float32]

A shape is tokens x hidden (sequence x micro-batch folded into tokens). At a few tokens the time is
the host's: each compiled call costs dynamo's guards and AOTAutograd's wrappers, forward and
backward, whatever the tensors' size; that is the cost the 1.7B step paid per layer while the GPU
waited for the host. At many tokens it is the passes over memory: one region reads the new
residual stream once instead of writing it and reading it back. Both variants compute the same
values (checked here before timing). Rounds alternate (two regions, one region, then one, two)
after a warm-up that compiles both (`--repeats` rounds).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.model.elementwise import regions  # noqa: E402

EPS = 1e-5


def inputs(tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    """The residual stream and attention output [s, 1, h], adaLN chunks [1, 1, h], the norm weight."""
    gen = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(platform.device(), dtype).requires_grad_()
    return {"x": draw(tokens, 1, hidden), "out": draw(tokens, 1, hidden), "gate": draw(1, 1, hidden),
            "weight": draw(hidden), "shift": draw(1, 1, hidden), "scale": draw(1, 1, hidden)}


def two_regions(t: dict):
    compiled = regions(True)
    x = compiled.gated_residual(t["x"], t["out"], None, t["gate"])
    return x, compiled.norm_modulate(x, t["weight"], t["shift"], t["scale"], EPS)


def one_region(t: dict):
    return regions(True).residual_norm_modulate(t["x"], t["out"], t["gate"], t["weight"], t["shift"], t["scale"],
                                                EPS)


def forward_backward(variant, t: dict, grads: tuple) -> tuple:
    """The inputs' gradients (returned, not accumulated into .grad)."""
    return torch.autograd.grad(variant(t), list(t.values()), grads)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--shapes", nargs="+", default=["32x64", "2048x256"], help="tokens x hidden")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--calls", type=int, default=200, help="forward + backward calls per round")
    args = harness.parse_args(ap, repeats=6, threads=1)
    dtype = getattr(torch, args.dtype)
    variants = {"two regions": two_regions, "one region": one_region}
    print(f"{platform.device_name() or 'CPU'}, torch {torch.__version__}, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s), {args.calls} calls per round, {args.repeats} rounds\n")
    print("| tokens x hidden | two regions (us per call) | one region (us per call) | **two / one** | range |")
    print("|---|---:|---:|---:|---|")
    for shape in args.shapes:
        tokens, hidden = (int(v) for v in shape.split("x"))
        t = inputs(tokens, hidden, dtype)
        grads = tuple(torch.randn_like(v) for v in two_regions(t))
        results = [forward_backward(v, t, grads) for v in variants.values()]
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)  # the same arithmetic, before any timing
        times = {name: [] for name in variants}
        order = list(variants)
        for _ in range(2):  # warm-up: compiles both
            for name in order:
                forward_backward(variants[name], t, grads)
        for _ in range(args.repeats):
            for name in order:
                platform.synchronize()
                start = time.perf_counter()
                for _ in range(args.calls):
                    forward_backward(variants[name], t, grads)
                platform.synchronize()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
            order.reverse()
        ratios = [a / b for a, b in zip(times["two regions"], times["one region"])]
        two, one = (statistics.median(times[name]) for name in variants)
        print(f"| {tokens} x {hidden} | {two:.1f} | {one:.1f} | **{statistics.median(ratios):.3f}** | "
              f"{min(ratios):.3f}–{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
