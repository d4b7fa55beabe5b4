"""Duo vs MDLM loss head: time and peak memory of forward + backward on the same logits.

Logits [L, B, V] (default B=8, L=2048, V=32001, fp32) are created once; each round runs, per
head, `loss(logits.clone()).sum().backward()` into logits.grad (the clone stands in for the model's output, which
the heads modify in place) and records wall time and the peak memory *above the live logits and
their clone* (so the logits gradient, one logits-sized buffer, is included): on GPU
torch.cuda.max_memory_allocated, on CPU the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs before each measurement). Heads alternate (A B, A B, ...).

    python benchmarks/bench_loss_heads.py [--batch 8 --seq 2048 --vocab 32001 --repeats 5 --bf16]
                                          [--duo-chunk-elements N [N ...]]

Each head's ATen operations per forward + backward are counted too (one more untimed pass, views
left out): on a GPU each is a kernel launch, whatever the device that counted them.
`--duo-chunk-elements` measures Duo's head at those chunk sizes (default: `duo.CHUNK_ELEMENTS`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel_count import OpCounter  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.families import Noise, duo, get_family  # noqa: E402


def rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def current() -> int:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else rss_peak()


def run_head(family, leaf, inp):
    leaf.grad = None
    out = leaf.clone()  # the model's output, modified in place by suppress
    base = current()
    reset_peak()
    t0 = time.perf_counter()
    loss = family.loss(out, inp).sum()
    loss.backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    extra = peak() - base
    del out, loss
    leaf.grad = None
    return dt, extra


def count_ops(family, leaf, inp) -> int:
    with OpCounter() as counter:
        family.loss(leaf.clone(), inp).sum().backward()
    leaf.grad = None
    return sum(counter.ops.values())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32001)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--duo-chunk-elements", type=int, nargs="+", default=None,
                    help="Duo's fp32 chunk sizes to measure (default: duo.CHUNK_ELEMENTS)")
    args = ap.parse_args(argv)
    platform.init_distributed(1, 1, seed=0)
    dev = platform.device()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    V, B, L = args.vocab, args.batch, args.seq
    family = {name: get_family(name, V - 1, V, "nelbo") for name in ("mdlm", "duo")}
    tokens = torch.randint(0, V - 1, (B, L))
    ids = torch.arange(B)
    inputs = {n: f.corrupt(tokens, Noise(1, ids, ids, B)).to(dev) for n, f in family.items()}
    chunks = args.duo_chunk_elements or [duo.CHUNK_ELEMENTS]
    heads = {"mdlm": ("mdlm", None), **{f"duo (chunks of {c / 2**18:g} MiB fp32)": ("duo", c) for c in chunks}}
    logits = torch.randn(L, B, V, device=dev).to(dtype).requires_grad_()
    nbytes = logits.numel() * logits.element_size()
    print(f"logits [{L}, {B}, {V}] {dtype}: {nbytes / 2**20:.0f} MiB; device {dev}; "
          f"{'cuda max_memory_allocated' if torch.cuda.is_available() else 'peak RSS (VmHWM)'} above the live logits")
    default_chunk = duo.CHUNK_ELEMENTS

    def run(head, fn):
        name, chunk = heads[head]
        duo.CHUNK_ELEMENTS = chunk or default_chunk
        try:
            return fn(family[name], logits, inputs[name])
        finally:
            duo.CHUNK_ELEMENTS = default_chunk

    ops = {h: run(h, count_ops) for h in heads}
    results = {h: [] for h in heads}
    for h in heads:  # warm-up
        run(h, run_head)
    for _ in range(args.repeats):
        for h in heads:
            results[h].append(run(h, run_head))
    print("| head | ATen ops fwd+bwd | median fwd+bwd (s) | min (s) | median extra peak (MiB) "
          "| extra peak / logits size |")
    print("|---|---:|---|---|---|---|")
    for h, r in results.items():
        ts, ms = [x[0] for x in r], [x[1] for x in r]
        med = statistics.median(ms)
        print(f"| {h} | {ops[h]} | {statistics.median(ts):.3f} | {min(ts):.3f} | {med / 2**20:.0f} "
              f"| {med / nbytes:.2f} |")
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
