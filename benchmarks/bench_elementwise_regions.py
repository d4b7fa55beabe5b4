"""The DiT layer's middle elementwise work, compiled two ways side by side: forward and backward,
time per call.

    python benchmarks/bench_elementwise_regions.py [--shapes 32x64 2048x256 16384x2176] [--dtype float32]
                                                   [--compare regions|dynamic]

`--compare regions` (default): one region (`residual_norm_modulate`, what the layer runs) beside
two (`gated_residual`, then `norm_modulate`, what it ran before).

`--compare dynamic`: the one region's graph specialised to the length (what a run of full-length
micro-batches uses) beside its graph with the length dynamic (what every micro-batch uses after the
first shorter one of `--variable-seq-length-prob`: automatic dynamic shapes; here marked dynamic
from the first call, `torch._dynamo.mark_dynamic`). The kernels differ in what they know of the
length at compile time.

A shape is tokens x hidden (sequence x micro-batch folded into tokens). At a few tokens the time is
the host's: each compiled call costs dynamo's guards and AOTAutograd's wrappers, forward and
backward, whatever the tensors' size; that is the cost the 1.7B step paid per layer while the GPU
waited for the host. At many tokens it is the passes over memory: one region reads the new
residual stream once instead of writing it and reading it back. Both variants compute the same
values (checked here before timing). Rounds alternate (A, B, then B, A) after a warm-up that
compiles both (two rounds).
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
from megatron_dllm.model.elementwise import regions, residual_norm_modulate  # noqa: E402

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


def _specialised(x, out, gate, weight, shift, scale):
    return residual_norm_modulate(x, out, gate, weight, shift, scale, EPS)


def _dynamic(x, out, gate, weight, shift, scale):  # a code object of its own: dynamo caches graphs per code
    return residual_norm_modulate(x, out, gate, weight, shift, scale, EPS)


SPECIALISED = torch.compile(_specialised, fullgraph=True, dynamic=False)
DYNAMIC = torch.compile(_dynamic, fullgraph=True)


def specialised_length(t: dict):
    return SPECIALISED(**t)


def dynamic_length(t: dict):
    return DYNAMIC(**t)


def length_marked_dynamic(t: dict) -> dict:
    """`t` with its tokens dimension marked dynamic, as automatic dynamic shapes mark it (once,
    before the first call: marking costs the host time that the timed calls must not include)."""
    for name in ("x", "out"):
        torch._dynamo.mark_dynamic(t[name], 0)
    return t


VARIANTS = {"regions": {"two regions": two_regions, "one region": one_region},
            "dynamic": {"length specialised": specialised_length, "length dynamic": dynamic_length}}


def forward_backward(variant, t: dict, grads: tuple) -> tuple:
    """The inputs' gradients (returned, not accumulated into .grad)."""
    return torch.autograd.grad(variant(t), list(t.values()), grads)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--shapes", nargs="+", default=["32x64", "2048x256"], help="tokens x hidden")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--calls", type=int, default=200, help="forward + backward calls per round")
    ap.add_argument("--compare", choices=list(VARIANTS), default="regions")
    args = harness.parse_args(ap, repeats=6, threads=1)
    dtype = getattr(torch, args.dtype)
    variants = VARIANTS[args.compare]
    a_name, b_name = variants
    print(f"{platform.device_name() or 'CPU'}, torch {torch.__version__}, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s), {args.calls} calls per round, {args.repeats} rounds\n")
    print(f"| tokens x hidden | {a_name} (us per call) | {b_name} (us per call) | **A / B** | range |")
    print("|---|---:|---:|---:|---|")
    for shape in args.shapes:
        tokens, hidden = (int(v) for v in shape.split("x"))
        t = {name: inputs(tokens, hidden, dtype) for name in variants}  # each its own (mark_dynamic marks tensors)
        if args.compare == "dynamic":
            length_marked_dynamic(t["length dynamic"])
        grads = tuple(torch.randn_like(v) for v in two_regions(t[a_name]))
        results = [forward_backward(v, t[name], grads) for name, v in variants.items()]
        for a, b in zip(*results):  # the same arithmetic, before any timing (the sums' order may differ)
            torch.testing.assert_close(a, b, **({"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}))
        times = {name: [] for name in variants}
        order = list(variants)
        for _ in range(2):  # warm-up: compiles both
            for name in order:
                forward_backward(variants[name], t[name], grads)
        for _ in range(args.repeats):
            for name in order:
                platform.synchronize()
                start = time.perf_counter()
                for _ in range(args.calls):
                    forward_backward(variants[name], t[name], grads)
                platform.synchronize()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
            order.reverse()
        if args.compare == "dynamic":  # the dynamic graph takes another length without compiling again
            from torch._dynamo.utils import counters
            graphs = counters["stats"]["unique_graphs"]
            shorter = inputs(max(2, tokens // 2), hidden, dtype)
            dynamic_length(length_marked_dynamic(shorter))
            assert counters["stats"]["unique_graphs"] == graphs, "the length-dynamic graph compiled again"
        ratios = [a / b for a, b in zip(times[a_name], times[b_name])]
        a_us, b_us = (statistics.median(times[name]) for name in variants)
        print(f"| {tokens} x {hidden} | {a_us:.1f} | {b_us:.1f} | **{statistics.median(ratios):.3f}** | "
              f"{min(ratios):.3f}–{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
