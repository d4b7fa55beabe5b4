"""What the checkpoint manifest costs: a save with and without it, and the verify step of a load.

A 1-process world saves the weights and AdamW state of a paper preset through
`megatron_dllm.checkpoint.save` (staged directory, SHA-256 manifest, rename, tracker), and the same
state through megatron-core's `dist_checkpointing.save` alone; then it times `verify_manifest`
(what `--load` does before any reader opens a file) against `dist_checkpointing.load`. One
untimed warm-up round first; medians of per-round ratios are reported.

    python benchmarks/bench_checkpoint_manifest.py --preset 116M --rounds 3
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_world import checkpoint_world, parse_args  # noqa: E402


def main(argv=None) -> None:
    args = parse_args(__doc__, argv)
    from megatron.core import dist_checkpointing

    from megatron_dllm import checkpoint
    from megatron_dllm.checkpoint import manifest

    rows = {"save": [], "load": []}
    with checkpoint_world(args, "bench-ckpt-") as (state, nbytes, root):
        warm = os.path.join(root, "warm-up")  # first-call costs (thread pools, allocator) out of the figures
        checkpoint.save(warm, 0, state)
        dist_checkpointing.load(state, os.path.join(warm, "iter_0000000"))
        shutil.rmtree(warm)
        for r in range(args.rounds):
            plain = os.path.join(root, f"plain-{r}")
            os.makedirs(plain)
            t0 = time.perf_counter()
            dist_checkpointing.save(state, plain)
            t_plain = time.perf_counter() - t0
            t0 = time.perf_counter()
            path = checkpoint.save(os.path.join(root, f"ours-{r}"), 1, state)
            t_ours = time.perf_counter() - t0
            rows["save"].append((t_plain, t_ours))

            os.sync()
            t0 = time.perf_counter()
            dist_checkpointing.load(state, plain)
            t_load = time.perf_counter() - t0
            t0 = time.perf_counter()
            manifest.verify_manifest(path)
            t_verify = time.perf_counter() - t0
            rows["load"].append((t_load, t_verify))
            shutil.rmtree(plain)
            shutil.rmtree(os.path.join(root, f"ours-{r}"))

    print(f"preset {args.preset}, vocab {args.vocab}: {nbytes / 2**20:.0f} MiB of weights + AdamW moments, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    print("| step | megatron-core alone (s) | with manifest (s) | ratio |")
    print("|---|---:|---:|---:|")
    save_plain = statistics.median(a for a, _ in rows["save"])
    save_ours = statistics.median(b for _, b in rows["save"])
    ratio = statistics.median(b / a for a, b in rows["save"])
    print(f"| save (staged + manifest + rename) | {save_plain:.2f} | {save_ours:.2f} | {ratio:.2f} |")
    load = statistics.median(a for a, _ in rows["load"])
    verify = statistics.median(b for _, b in rows["load"])
    ratio = statistics.median(b / a for a, b in rows["load"])
    print(f"| load (2nd column), and the manifest's verify before it (3rd) | {load:.2f} | {verify:.2f} "
          f"| {ratio:.2f} |")


if __name__ == "__main__":
    main()
