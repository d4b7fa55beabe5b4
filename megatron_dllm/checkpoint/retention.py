"""Which checkpoints a long run keeps (--keep-last-n-checkpoints N, --keep-checkpoint-interval K),
and how much disk they will take.

Only complete checkpoints (with a manifest) at or below the tracked iteration are candidates:
checkpoints newer than the tracker belong to a rolled-back timeline and are left alone, and
directories without a manifest (older versions, other tools) are never removed, as `layout.py`
promises. A checkpoint is removed by renaming it to `iter_N.removing` first, so a run killed
half-way through the deletion never leaves a partial `iter_N` that looks complete.
"""
from __future__ import annotations

import os
import shutil

from megatron_dllm.checkpoint import layout

REMOVING = ".removing"


def kept(iterations: list[int], tracked: int, keep_last: int, keep_interval: int | None) -> set[int]:
    """The iterations to keep out of `iterations` (complete checkpoints)."""
    candidates = sorted(it for it in iterations if it <= tracked)
    keep = set(candidates[-keep_last:]) | {tracked} | {it for it in iterations if it > tracked}
    if keep_interval:
        keep |= {it for it in candidates if it % keep_interval == 0}
    return keep


def apply(root: str, keep_last: int, keep_interval: int | None) -> list[str]:
    """Remove the complete checkpoints under `root` that `kept` does not keep (call on one rank);
    returns the removed directories."""
    tracked = layout.read_tracker(root)
    if tracked is None:
        return []
    complete = layout.complete_checkpoints(root)
    keep = kept(list(complete), tracked, keep_last, keep_interval)
    removed = []
    for it, path in complete.items():
        if it not in keep:
            doomed = path + REMOVING
            os.rename(path, doomed)
            shutil.rmtree(doomed)
            removed.append(path)
    return removed


def remove_leftovers(root: str) -> list[str]:
    """Finish removals a killed run left behind (`iter_N.removing`)."""
    if not os.path.isdir(root):
        return []
    leftovers = sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(REMOVING))
    for path in leftovers:
        shutil.rmtree(path)
    return leftovers


def bytes_per_checkpoint(num_parameters: int, bf16: bool, ema: bool) -> int:
    """A checkpoint's size: the weights (2 bytes in bf16, else 4), Adam's two fp32 moments, the
    fp32 main weights under bf16, and the fp32 EMA. Small common state is not counted."""
    per_param = (2 + 4 if bf16 else 4) + 8 + (4 if ema else 0)
    return num_parameters * per_param


def checkpoints_on_disk(train_iters: int, start: int, save_interval: int | None, keep_last: int | None,
                        keep_interval: int | None, existing=()) -> tuple[int, int]:
    """(the most checkpoints --save holds at once during this run, the `existing` ones (their
    iterations) included; how many more than now, what the disk must take), under retention
    (one more while a save is written before the oldest is removed). (len(existing), 0) when the
    run trains no further."""
    saves = [it for it in range(start + 1, train_iters + 1) if save_interval and it % save_interval == 0]
    if start < train_iters and (not saves or saves[-1] != train_iters):
        saves.append(train_iters)
    if not saves:
        return len(existing), 0
    held = len(existing) + len(saves)
    if keep_last is not None:
        interval_keeps = {it for it in [*existing, *saves] if keep_interval and it % keep_interval == 0}
        held = min(held, keep_last + 1 + len(interval_keeps))
    held = max(held, len(existing) + 1)  # a save is complete before retention removes anything
    return held, held - len(existing)
