#!/usr/bin/env python
"""Sample-index and blending-index build time and peak memory: our C++ builders vs the numpy
references vs megatron-core's helpers_cpp, side by side, on synthetic document lengths (no data).

    python benchmarks/bench_index_builders.py                  # 1e8 and 1e10 tokens
    python benchmarks/bench_index_builders.py --tokens 1e8 --reps 1 --markdown out.md

Documents: lengths ~ lognormal with mean ~1000 tokens (1e5 documents per 1e8 tokens), one epoch,
shuffled document index (int32, as GPTDataset builds it), sequence length 2048, AR (extra token).
Blend: `samples = tokens / 2048` samples over 2 and 16 datasets with Dirichlet weights.
Megatron's column is `megatron.core.datasets.helpers.build_sample_idx` (what GPTDataset calls,
including its min/max check) and `helpers_cpp.build_blending_indices`.

Peak memory: the rise of the process's peak RSS over the RSS before the call (`/proc/self/
clear_refs` resets the peak; inputs are allocated before). Times: the best of `--reps` runs.
For context it also times megatron's numpy document-index and shuffle-index builds (RandomState
shuffles, not replaced here), and extrapolates everything linearly to 2.1T tokens.
"""

import os
import sys
import time

import harness
import numpy as np

try:
    import megatron_dllm  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dllm.data import index_builders as ib

TARGET_TOKENS = 2.1e12
SEQ = 2048


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def measure(fn, reps):
    """(best seconds, peak extra bytes, result of the last run)."""
    best, peak, out = float("inf"), 0, None
    for _ in range(reps):
        out = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        base = _status("VmRSS")
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, _status("VmHWM") - base)
    return best, peak, out


def synthetic_lengths(tokens, seed=0):
    rng = np.random.default_rng(seed)
    num_docs = int(round(tokens / 1000))
    sizes = np.maximum(1, rng.lognormal(np.log(1000) - 0.5, 1.0, num_docs)).astype(np.int32)
    doc_idx = rng.permutation(num_docs).astype(np.int32)
    return sizes, doc_idx


def bench_sample_index(tokens, reps, numpy_too=True):
    from megatron.core.datasets import helpers

    sizes, doc_idx = synthetic_lengths(tokens)
    tpe = int(sizes.sum())
    args = (sizes, doc_idx, SEQ, 1, tpe, True, True)
    rows, ref = [], None
    candidates = [("megatron helpers_cpp", lambda: helpers.build_sample_idx(*args))]
    if ib.HAVE_CPP:
        candidates += [("ours C++, 1 thread", lambda: ib._cpp.build_sample_idx_int32(*args[:6], 1, 1)),
                       (f"ours C++, {os.cpu_count()} threads",
                        lambda: ib._cpp.build_sample_idx_int32(*args[:6], 1, 0))]
    if numpy_too:
        candidates.append(("ours numpy", lambda: ib.build_sample_idx_numpy(*args)))
    for name, fn in candidates:
        seconds, peak, out = measure(fn, reps)
        if ref is None:
            ref = out
        same = bool(np.array_equal(out, ref))
        rows.append((name, seconds, peak, same))
        del out
    info = dict(docs=len(sizes), tokens=tpe, samples=ref.shape[0] - 1, out_bytes=ref.nbytes)
    del ref
    # Context: megatron's numpy document and shuffle index for the same dataset.
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    rs = np.random.RandomState(1234)
    t_doc, _, d = measure(lambda: _build_document_index(np.arange(len(sizes), dtype=np.int32), 1, rs, False), 1)
    del d
    t_shuf, _, s = measure(lambda: _build_shuffle_index(info["samples"], info["samples"], rs), 1)
    del s
    info.update(t_document_index=t_doc, t_shuffle_index=t_shuf)
    return rows, info


def bench_blend(tokens, num_datasets, reps, numpy_too=True):
    from megatron.core.datasets import helpers_cpp

    size = int(tokens // SEQ)
    w = np.random.default_rng(num_datasets).dirichlet(np.ones(num_datasets))

    def run(fill):
        a = np.zeros(size, np.int16)
        b = np.zeros(size, np.int64)
        fill(a, b)
        return a, b

    candidates = [("megatron helpers_cpp",
                   lambda: run(lambda a, b: helpers_cpp.build_blending_indices(a, b, list(w), num_datasets,
                                                                                size, False)))]
    if ib.HAVE_CPP:
        candidates += [("ours C++, 1 thread",
                        lambda: run(lambda a, b: ib._cpp.build_blending_indices(a, b, w, num_datasets, size,
                                                                                False, 1))),
                       (f"ours C++, {os.cpu_count()} threads",
                        lambda: run(lambda a, b: ib._cpp.build_blending_indices(a, b, w, num_datasets, size,
                                                                                False, 0)))]
    if numpy_too:
        candidates.append(("ours numpy", lambda: run(lambda a, b: ib.build_blending_indices_numpy(
            a, b, w, num_datasets, size))))
    rows, ref = [], None
    for name, fn in candidates:
        seconds, peak, out = measure(fn, reps if name != "ours numpy" else 1)
        if ref is None:
            ref = out
        same = bool(np.array_equal(out[0], ref[0]) and np.array_equal(out[1], ref[1]))
        repair = ib._cpp.last_blend_repair_steps() if "threads" in name else None
        rows.append((name, seconds, peak, same, repair))
        del out
    return rows, dict(samples=size, datasets=num_datasets)


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def fmt_s(s):
    return f"{s * 1e3:.1f} ms" if s < 1 else (f"{s:.2f} s" if s < 600 else f"{s / 60:.1f} min")


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--tokens", nargs="+", type=float, default=[1e8, 1e10])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--datasets", nargs="+", type=int, default=[2, 16])
    p.add_argument("--numpy-blend-max-samples", type=float, default=5e6,
                   help="skip the (Python-loop) numpy blending reference above this many samples")
    p.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)

    lines = [f"Machine: {os.cpu_count()} CPU cores; extension built: {ib.HAVE_CPP}; "
             f"seq_length {SEQ}, AR (extra token), 1 epoch, lognormal document lengths (mean ~1000).", ""]
    lines += ["### Sample index", "",
              "| tokens | documents | samples | builder | time | peak extra memory | same as megatron | "
              "time at 2.1T tokens (linear) |", "|---|---|---|---|---|---|---|---|"]
    contexts = []
    for tokens in args.tokens:
        rows, info = bench_sample_index(tokens, args.reps)
        scale = TARGET_TOKENS / info["tokens"]
        for name, seconds, peak, same in rows:
            lines.append(f"| {tokens:.0e} | {info['docs']:,} | {info['samples']:,} | {name} | {fmt_s(seconds)} | "
                         f"{fmt_bytes(peak)} | {same} | {fmt_s(seconds * scale)} |")
        contexts.append((tokens, info, scale))
        print("\n".join(lines[-len(rows):]), flush=True)
    lines += ["", "Context (megatron's numpy, not replaced): document index = `_build_document_index` "
              "(RandomState shuffle of the documents), shuffle index = `_build_shuffle_index`; output "
              "= the sample index array.", "",
              "| tokens | document index | shuffle index | sample index output | "
              "at 2.1T tokens: doc / shuffle / output |",
              "|---|---|---|---|---|"]
    for tokens, info, scale in contexts:
        lines.append(f"| {tokens:.0e} | {fmt_s(info['t_document_index'])} | {fmt_s(info['t_shuffle_index'])} | "
                     f"{fmt_bytes(info['out_bytes'])} | {fmt_s(info['t_document_index'] * scale)} / "
                     f"{fmt_s(info['t_shuffle_index'] * scale)} / {fmt_bytes(info['out_bytes'] * scale)} |")
    lines += ["", "### Blending indices", "",
              "| tokens | samples | datasets | builder | time | peak extra memory | same as megatron | "
              "re-run steps | time at 2.1T tokens (linear) |", "|---|---|---|---|---|---|---|---|---|"]
    for tokens in args.tokens:
        for n in args.datasets:
            numpy_too = tokens / SEQ <= args.numpy_blend_max_samples
            rows, info = bench_blend(tokens, n, args.reps, numpy_too)
            scale = TARGET_TOKENS / tokens
            for name, seconds, peak, same, repair in rows:
                lines.append(f"| {tokens:.0e} | {info['samples']:,} | {n} | {name} | {fmt_s(seconds)} | "
                             f"{fmt_bytes(peak)} | {same} | {'' if repair is None else repair} | "
                             f"{fmt_s(seconds * scale)} |")
            print("\n".join(lines[-len(rows):]), flush=True)
    print()
    harness.publish(lines, args.markdown)


if __name__ == "__main__":
    main()
