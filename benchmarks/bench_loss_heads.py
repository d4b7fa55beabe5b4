"""Loss heads side by side on the same logits: time, peak memory and operations of forward + backward.

Logits [L, B, V] (default B=8, L=2048, V=32001, fp32; `--bf16` as training has them) are created
once. Each head runs on a fresh copy of them, standing in for the model's output (the heads work
in place on it), and the gradient with respect to that copy is taken with `torch.autograd.grad`,
as the output layer's backward would receive it. The heads:

- `mdlm, megatron-core CE`: MDLM's head as it was, the baseline: [MASK] and the padding set to
  -inf on the tracked logits, then megatron-core's `vocab_parallel_cross_entropy`;
- `mdlm`: the family's head (`vocab_parallel.cross_entropy`, in place), at each `--ce-chunk-elements`
  size of its fp32 row chunks (bf16 logits; default `vocab_parallel.CHUNK_ELEMENTS`);
- `duo`: Duo's closed-form NELBO, at each `--duo-chunk-elements` size (default `duo.CHUNK_ELEMENTS`).

    python benchmarks/bench_loss_heads.py [--batch 8 --seq 2048 --vocab 32001 --repeats 5 --bf16]
                                          [--ce-chunk-elements N [N ...]] [--duo-chunk-elements N [N ...]]

Heads alternate (A B C, A B C, ...) for the times. Memory and operations come from one more,
untimed pass each: the peak allocated *above* the logits and their copy (so a gradient in a new
buffer counts, one in the copy's own storage does not; `memory_peak.AllocatedPeak`: the
allocator's bytes in use after every ATen operation); and the ATen operations dispatched, views
left out (on a GPU each is a kernel launch).
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
from memory_peak import AllocatedPeak  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.families import Noise, duo, get_family, vocab_parallel  # noqa: E402


def megatron_mdlm_loss(family, logits, inp):
    """MDLM's `nelbo` head as it was before `vocab_parallel.cross_entropy`: the baseline."""
    from megatron.core import tensor_parallel
    for lo, hi in vocab_parallel.excluded_columns(logits, family.mask_id, family.vocab_size):
        logits[..., lo:hi] = float("-inf")
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits, inp.targets.t().contiguous()).t()
    return nll * (inp.input_ids == family.mask_id) * inp.valid / inp.t[:, None]


def head_gradient(loss_fn, logits, inp):
    """The gradient at the model's output (a tracked copy of the logits) of the head's summed loss."""
    out = logits.clone()
    return torch.autograd.grad(loss_fn(out, inp).sum(), out)[0]


def timed(loss_fn, logits, inp) -> float:
    t0 = time.perf_counter()
    head_gradient(loss_fn, logits, inp)
    platform.synchronize()
    return time.perf_counter() - t0


def peak_extra(loss_fn, logits, inp) -> int:
    out = logits.clone()
    with AllocatedPeak() as peak:
        torch.autograd.grad(loss_fn(out, inp).sum(), out)
    return peak.extra


def count_ops(loss_fn, logits, inp) -> int:
    with OpCounter() as counter:
        head_gradient(loss_fn, logits, inp)
    return sum(counter.ops.values())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32001)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--ce-chunk-elements", type=int, nargs="+", default=None,
                    help="the cross entropy's fp32 chunk sizes to measure (default: vocab_parallel.CHUNK_ELEMENTS)")
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

    def chunked(name, module, chunk):
        """The family's loss with `module.CHUNK_ELEMENTS` set to `chunk` while it runs."""
        def loss(logits, inp):
            default, module.CHUNK_ELEMENTS = module.CHUNK_ELEMENTS, chunk
            try:
                return family[name].loss(logits, inp)
            finally:
                module.CHUNK_ELEMENTS = default
        return loss

    heads = {"mdlm, megatron-core CE": ("mdlm", lambda logits, inp: megatron_mdlm_loss(family["mdlm"], logits, inp)),
             **{f"mdlm (chunks of {c / 2**18:g} MiB fp32)": ("mdlm", chunked("mdlm", vocab_parallel, c))
                for c in args.ce_chunk_elements or [vocab_parallel.CHUNK_ELEMENTS]},
             **{f"duo (chunks of {c / 2**18:g} MiB fp32)": ("duo", chunked("duo", duo, c))
                for c in args.duo_chunk_elements or [duo.CHUNK_ELEMENTS]}}
    logits = torch.randn(L, B, V, device=dev).to(dtype).requires_grad_()
    nbytes = logits.numel() * logits.element_size()
    print(f"logits [{L}, {B}, {V}] {dtype}: {nbytes / 2**20:.0f} MiB; device {dev}; extra peak: "
          "allocated bytes sampled per op")

    def run(fn, head):
        name, loss_fn = heads[head]
        return fn(loss_fn, logits, inputs[name])

    ops = {h: run(count_ops, h) for h in heads}
    extra = {h: run(peak_extra, h) for h in heads}
    times = {h: [] for h in heads}
    for h in heads:  # warm-up
        run(timed, h)
    for _ in range(args.repeats):
        for h in heads:
            times[h].append(run(timed, h))
    print("| head | ATen ops fwd+bwd | median fwd+bwd (s) | min (s) | extra peak (MiB) | extra peak / logits size |")
    print("|---|---:|---:|---:|---:|---:|")
    for h, ts in times.items():
        print(f"| {h} | {ops[h]} | {statistics.median(ts):.3f} | {min(ts):.3f} | {extra[h] / 2**20:.0f} "
              f"| {extra[h] / nbytes:.2f} |")
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
