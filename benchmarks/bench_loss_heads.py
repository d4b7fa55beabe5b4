"""Loss heads side by side on the same logits: time, peak memory and operations of forward + backward.

Logits [L, B, V] (default B=8, L=2048, V=32001, fp32; `--bf16` as training has them) are created
once. Each head runs on a fresh copy of them, standing in for the model's output (the heads work
in place on it), and the gradient with respect to that copy is taken with `torch.autograd.grad`,
as the output layer's backward would receive it. The heads:

- `mdlm, megatron-core CE`: MDLM's head as it was, the baseline: [MASK] and the padding set to
  -inf on the tracked logits, then megatron-core's `vocab_parallel_cross_entropy`;
- `mdlm`: the family's head (`vocab_parallel.cross_entropy`, in place), at each `--ce-chunk-elements`
  size of its fp32 row chunks (bf16 logits; default `vocab_parallel.CHUNK_ELEMENTS`; fp32 logits
  it works whole);
- `duo`: Duo's closed-form NELBO, at each `--duo-chunk-elements` size (default `duo.CHUNK_ELEMENTS`);
- with `--compiled`, both family heads again with their chunk bodies compiled, as the training
  step runs them under `--compile-elementwise` (`vocab_parallel.compiled_heads`). Their first
  calls, which compile, are untimed.

    python benchmarks/bench_loss_heads.py [--batch 8 --seq 2048 --vocab 32001 --repeats 5 --bf16]
                                          [--ce-chunk-elements N [N ...]] [--duo-chunk-elements N [N ...]]
                                          [--compiled]

Heads alternate (A B C, A B C, ...) for the times. Memory and operations come from one more,
untimed pass each: the peak allocated *above* the logits and their copy (so a gradient in a new
buffer counts, one in the copy's own storage does not; `memory_peak.AllocatedPeak`: the
allocator's bytes in use after every ATen operation); and the ATen operations dispatched, views
left out (on a GPU each is a kernel launch). A compiled head's row counts the ATen operations
outside its chunk bodies plus one per body call (each one fused kernel: Inductor's code, checked
by tests/test_vocab_parallel.py). Its memory needs the GPU allocator's peak: dynamo does not trace
under the dispatch mode that samples the CPU's allocator, so on CPU that column says so.
"""
from __future__ import annotations

import argparse
import contextlib
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


def compiled_peak_extra(loss_fn, logits, inp) -> int | None:
    """A compiled head's peak above the logits and their copy: the GPU allocator's; None on CPU."""
    if not platform.HAS_CUDA:
        return None
    out = logits.clone()
    platform.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(loss_fn(out, inp).sum(), out)
    platform.synchronize()
    return torch.cuda.max_memory_allocated() - base


@contextlib.contextmanager
def heads_counted_as_compiled():
    """Inside, every loss head takes its compiled path (whatever the caller's setting) with each
    chunk body run eagerly out of a dispatch counter's sight; yields the list of body calls, one
    entry each (as compiled, each is one fused kernel: tests/test_vocab_parallel.py). Dynamo does
    not trace under a dispatch mode, so the real compiled heads cannot be counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    calls = []

    def counted(fn):
        def body(*args):
            calls.append(fn.__name__)
            with _disable_current_modes():
                return fn(*args)
        return body

    saved = vocab_parallel._compile, vocab_parallel.heads_compiled
    vocab_parallel._compile, vocab_parallel.heads_compiled = counted, lambda: True
    try:
        yield calls
    finally:
        vocab_parallel._compile, vocab_parallel.heads_compiled = saved


def count_compiled_ops(loss_fn, logits, inp) -> int:
    """A compiled head's ATen operations outside its chunk bodies plus one per body call."""
    with heads_counted_as_compiled() as calls:
        return count_ops(loss_fn, logits, inp) + len(calls)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32001)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--ce-chunk-elements", type=int, nargs="+", default=None,
                    help="the cross entropy's fp32 chunk sizes to measure, with --bf16 (fp32 logits it works whole; "
                         "default: vocab_parallel.CHUNK_ELEMENTS)")
    ap.add_argument("--duo-chunk-elements", type=int, nargs="+", default=None,
                    help="Duo's fp32 chunk sizes to measure (default: duo.CHUNK_ELEMENTS)")
    ap.add_argument("--compiled", action="store_true",
                    help="also both family heads with their chunk bodies compiled (--compile-elementwise)")
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

    ce_heads = ({f"mdlm (chunks of {c / 2**18:g} MiB fp32)": ("mdlm", chunked("mdlm", vocab_parallel, c))
                 for c in args.ce_chunk_elements or [vocab_parallel.CHUNK_ELEMENTS]} if args.bf16
                else {"mdlm (whole, in place)": ("mdlm", family["mdlm"].loss)})  # fp32 logits: no chunks
    heads = {"mdlm, megatron-core CE": ("mdlm", lambda logits, inp: megatron_mdlm_loss(family["mdlm"], logits, inp)),
             **ce_heads,
             **{f"duo (chunks of {c / 2**18:g} MiB fp32)": ("duo", chunked("duo", duo, c))
                for c in args.duo_chunk_elements or [duo.CHUNK_ELEMENTS]}}
    if args.compiled:
        def compiled(name):
            def loss(logits, inp):
                with vocab_parallel.compiled_heads():
                    return family[name].loss(logits, inp)
            return loss
        heads.update({f"{name} compiled": (name, compiled(name)) for name in ("mdlm", "duo")})
    logits = torch.randn(L, B, V, device=dev).to(dtype).requires_grad_()
    nbytes = logits.numel() * logits.element_size()
    print(f"logits [{L}, {B}, {V}] {dtype}: {nbytes / 2**20:.0f} MiB; device {dev}; extra peak: "
          "allocated bytes sampled per op")

    def run(fn, head):
        name, loss_fn = heads[head]
        return fn(loss_fn, logits, inputs[name])

    for h in heads:  # warm-up (the compiled heads compile)
        run(timed, h)
    ops = {h: run(count_compiled_ops if h.endswith("compiled") else count_ops, h) for h in heads}
    extra = {h: run(compiled_peak_extra if h.endswith("compiled") else peak_extra, h) for h in heads}
    times = {h: [] for h in heads}
    for _ in range(args.repeats):
        for h in heads:
            times[h].append(run(timed, h))
    print("| head | ATen ops fwd+bwd | median fwd+bwd (s) | min (s) | extra peak (MiB) | extra peak / logits size |")
    print("|---|---:|---:|---:|---:|---:|")
    for h, ts in times.items():
        memory = ("not measured on CPU | -" if extra[h] is None
                  else f"{extra[h] / 2**20:.0f} | {extra[h] / nbytes:.2f}")
        print(f"| {h} | {ops[h]} | {statistics.median(ts):.3f} | {min(ts):.3f} | {memory} |")
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
