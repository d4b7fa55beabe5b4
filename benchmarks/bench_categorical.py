"""The sampling arithmetic of one MDLM ancestral step, as the samplers now do it (`categorical`)
beside the paper code's formulas written out plainly: time and peak memory.

One step at `--positions` masked positions over a `--vocab` vocabulary: p_x0 = softmax of the
logits in float64 with [MASK] suppressed (`categorical.probabilities`), q = p_x0 (alpha_s -
alpha_t) with q[MASK] = 1 - alpha_s, then one draw per position: written out, the paper's
exponential race (a logged uniform per id); `categorical.sample`, the cumulative sum inverted at
one uniform per position. The same distribution, not the same ids (tests/test_sampling.py checks
the draws against the paper's chain); the race in the samplers' buffers (float32 keeps it) was
the `categorical` row of the runs before 2026-11-28; `categorical, softmax apart` is
`probabilities` as it was until later that day, its softmax a buffer of its own. A second table
times the samplers' draw from the logits (p_x0 alone, as MDLM draws where positions unmask):
`categorical.draw`, which forms the distribution a chunk of rows at a time, beside the same draw
over every row at once (the same ids). A third times a greedy draw (greedy decoding's top-p of
1e-12, a nucleus of one id): formed and drawn from, as until 2026-11-29, beside `categorical.draw`,
which takes the argmax (the same ids but where the top logits tie, frequent in bf16: the argmax
takes the lowest of them, the sort another; its uniforms are drawn all the same). The logits come
in `--logits-dtype` (a GPU model's bf16 or a CPU model's fp32). Memory: the peak allocated above
the logits (`memory_peak.AllocatedPeak`); at [positions, V] in float64 each buffer is 8 bytes a
logit, so the peak bounds the largest batch a GPU fits. Variants alternate over `--repeats` rounds.

    python benchmarks/bench_categorical.py [--positions 4096] [--vocab 32001] [--logits-dtype float32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_peak import AllocatedPeak  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.sampling import categorical  # noqa: E402

A_T, A_S = 0.3, 0.4  # alpha_t < alpha_s: one step of the schedule


def written_out(logits, mask_id, generator):
    """The step as the paper's code writes it: each operation a new float64 buffer."""
    x = logits.to(torch.float64).clone()
    x[..., mask_id] = float("-inf")
    q = x.softmax(-1) * (A_S - A_T)
    q[:, mask_id] = 1 - A_S
    u = torch.rand(q.shape, generator=generator, dtype=q.dtype, device=q.device)
    return (q / (1e-10 - torch.log(u + 1e-10))).argmax(-1)


def samplers(logits, mask_id, generator, probabilities=categorical.probabilities):
    q = probabilities(logits, torch.float64, suppress=mask_id).mul_(A_S - A_T)
    q[:, mask_id] = 1 - A_S
    return categorical.sample(q, generator)


def softmax_apart(logits, dtype, suppress):
    """`categorical.probabilities` before 2026-11-28 (later): softmax into a buffer of its own."""
    x = logits.to(dtype, copy=True)
    x[..., suppress] = float("-inf")
    return x.softmax(-1)


def every_row_at_once(logits, mask_id, generator):
    """The draw from the logits with the distribution formed over every row at once."""
    return categorical.sample(categorical.probabilities(logits, torch.float64, suppress=mask_id), generator)


def in_chunks(logits, mask_id, generator):
    return categorical.draw(logits, torch.float64, generator, suppress=mask_id)


GREEDY_TOP_P = 1e-12  # greedy decoding's (sampling.conditional): a nucleus of one id


def greedy_formed(logits, mask_id, generator):
    """A greedy draw as it was before 2026-11-29: the nucleus of one id formed (a sort of every
    row) and drawn from, a chunk of rows at a time."""
    ids = []
    u = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
    for chunk in categorical.row_chunks(*logits.shape, torch.float64, logits.device):
        probs = categorical.probabilities(logits[chunk], torch.float64, top_p=GREEDY_TOP_P, suppress=mask_id)
        ids.append(categorical.sample_by_cdf(probs, u[chunk]))
    return torch.cat(ids)


def greedy_draw(logits, mask_id, generator):
    return categorical.draw(logits, torch.float64, generator, top_p=GREEDY_TOP_P, suppress=mask_id)


def compare(title: str, variants: dict, same: tuple, logits, mask_id: int, repeats: int, ties: bool = False) -> None:
    """Time and peak memory of each variant (alternating over `repeats` rounds) as a table; the two
    variants named in `same` must draw the same ids (`ties`: or, where not, ids of equal logits)."""
    dev = logits.device
    extra, ids = {}, {}
    for name, fn in variants.items():
        with AllocatedPeak() as peak:
            ids[name] = fn(logits, mask_id, torch.Generator(dev).manual_seed(5))
        extra[name] = peak.extra
    a, b = ids[same[0]], ids[same[1]]
    tied = ties and torch.equal(logits.gather(-1, a[:, None]), logits.gather(-1, b[:, None]))
    if not (torch.equal(a, b) or tied):
        sys.exit(f"error: {same[0]} and {same[1]} drew other ids")
    if not torch.equal(a, b):
        print(f"{int((a != b).sum())} rows whose top logits tie took another of them")
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(logits, mask_id, torch.Generator(dev).manual_seed(5))
            platform.synchronize()
            times[name].append(time.perf_counter() - t0)
    buffer = logits.numel() * 8
    print(f"{title}: {list(logits.shape)} logits in {logits.dtype} on {dev}; one float64 buffer "
          f"{buffer / 2**20:.0f} MiB")
    print("| variant | median (s) | min (s) | extra peak (MiB) | extra peak / float64 buffer |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f} | {extra[name] / 2**20:.0f} "
              f"| {extra[name] / buffer:.2f} |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32001)
    ap.add_argument("--logits-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    dev = platform.device()
    logits = (3 * torch.randn(args.positions, args.vocab, device=dev)).to(getattr(torch, args.logits_dtype))
    mask_id = args.vocab - 1
    compare("One MDLM step", {"written out (the paper's race)": written_out,
                              "categorical, softmax apart": lambda *a: samplers(*a, probabilities=softmax_apart),
                              "categorical": samplers},
            ("categorical", "categorical, softmax apart"), logits, mask_id, args.repeats)
    compare("The samplers' draw from the logits", {"every row at once": every_row_at_once,
                                                    "categorical.draw (chunks)": in_chunks},
            ("every row at once", "categorical.draw (chunks)"), logits, mask_id, args.repeats)
    compare("A greedy draw (top-p 1e-12)", {"nucleus formed": greedy_formed, "categorical.draw (argmax)": greedy_draw},
            ("nucleus formed", "categorical.draw (argmax)"), logits, mask_id, args.repeats, ties=True)


if __name__ == "__main__":
    main()
