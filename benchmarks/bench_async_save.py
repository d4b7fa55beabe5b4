"""How long a save pauses training: synchronous (`checkpoint.save`) against `--async-save`
(megatron-core's AsyncCallsQueue behind the same staged, hashed, renamed protocol).

A 1-process world saves a paper preset's weights plus two fp32 AdamW moments of the same shapes.
Per round: one synchronous save (the pause is the whole save), then one asynchronous save whose
pause is the call that schedules it; the background write and its completion (manifest, rename,
tracker) are timed until `maybe_finalize_async_calls(blocking=True)` returns. One untimed warm-up
round of each first; medians of per-round ratios are reported.

    python benchmarks/bench_async_save.py --preset 116M --rounds 3
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
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megatron_dllm import checkpoint

    rows = {"sync": [], "async_pause": [], "async_total": []}
    with checkpoint_world(args, "bench-async-") as (state, nbytes, root):
        queue = AsyncCallsQueue()
        for r in range(args.rounds + 1):
            start = time.perf_counter()
            checkpoint.save(os.path.join(root, "sync"), r, state)
            sync = time.perf_counter() - start
            start = time.perf_counter()
            checkpoint.save(os.path.join(root, "async"), r, state, async_queue=queue)
            pause = time.perf_counter() - start
            queue.maybe_finalize_async_calls(blocking=True)
            total = time.perf_counter() - start
            if r:  # round 0 warms up thread pools, the allocator and the fork path
                rows["sync"].append(sync)
                rows["async_pause"].append(pause)
                rows["async_total"].append(total)
            for kind in ("sync", "async"):
                shutil.rmtree(os.path.join(root, kind))
    med = {k: statistics.median(v) for k, v in rows.items()}
    pause_ratio = statistics.median(a / s for a, s in zip(rows["async_pause"], rows["sync"]))
    total_ratio = statistics.median(a / s for a, s in zip(rows["async_total"], rows["sync"]))
    print(f"{args.preset}: {nbytes / 2**20:.0f} MiB of weights + AdamW moments, {args.rounds} rounds")
    print("| save | training paused (s) | until complete (s) | pause vs sync | complete vs sync |")
    print("|---|---:|---:|---:|---:|")
    print(f"| synchronous | {med['sync']:.2f} | {med['sync']:.2f} | 1.00 | 1.00 |")
    print(f"| --async-save | {med['async_pause']:.2f} | {med['async_total']:.2f} | {pause_ratio:.2f} | "
          f"{total_ratio:.2f} |")


if __name__ == "__main__":
    main()
