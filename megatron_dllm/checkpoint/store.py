"""Save and find checkpoints: megatron-core's distributed checkpointing inside the layout of
`layout.py`, with the manifest of `manifest.py` written at save and verified before any load.

Every function here is collective when torch.distributed is initialised: rank 0 decides what
happens on disk and broadcasts it, so every rank sees the same checkpoint and the same error.
"""
from __future__ import annotations

import os
import shutil
from functools import partial

import torch.distributed as dist

from megatron_dllm.checkpoint import layout, retention, safe_read
from megatron_dllm.checkpoint.manifest import CheckpointError, verify_manifest, write_manifest


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _from_rank0(fn):
    """Run `fn` on rank 0 and return its result on every rank; an exception it raised is raised
    on every rank (as CheckpointError), so no rank waits for a collective the others skipped."""
    result = None
    if _rank() == 0:
        try:
            result = ("ok", fn())
        except (OSError, CheckpointError) as err:
            result = ("error", str(err))
    if _distributed():
        holder = [result]
        dist.broadcast_object_list(holder, src=0)
        result = holder[0]
    if result[0] == "error":
        raise CheckpointError(result[1])
    return result[1]


def save(root: str, iteration: int, state: dict, async_queue=None, on_complete=None) -> str:
    """Write `state` (a megatron sharded state dict) as ROOT/iter_N: staged, hashed, renamed into
    place, then the tracker; then `on_complete(final)` runs on every rank. Returns the final
    directory.

    With `async_queue` (megatron-core's AsyncCallsQueue) the shards are written by a background
    process while training goes on; the hashing, renaming and tracker run when the queue
    finalizes the request (`maybe_finalize_async_calls`, on every rank). Until then the save
    exists only under its staging name, so a crash mid-write leaves nothing that loads.
    """
    from megatron.core import dist_checkpointing

    staging, final = layout.staging_dir(root, iteration), layout.iteration_dir(root, iteration)

    def prepare():
        os.makedirs(root, exist_ok=True)
        if os.path.exists(staging):  # this iteration's own earlier attempt, never finished
            shutil.rmtree(staging)
        os.makedirs(staging)

    def complete():
        layout.publish(staging, final)
        layout.write_tracker(root, iteration)

    def finish():
        _barrier()
        write_manifest(staging, iteration)
        _barrier()
        _from_rank0(complete)
        if on_complete is not None:
            on_complete(final)

    _from_rank0(prepare)
    if async_queue is None:
        dist_checkpointing.save(state, staging)
        finish()
        return final
    request = dist_checkpointing.save(state, staging, async_sharded_save=True)
    request = request._replace(async_fn=partial(_write_in_background, request.async_fn))
    request.add_finalize_fn(finish)
    async_queue.schedule_async_request(request)
    return final


def _write_in_background(write, *args, **kwargs):
    """The forked writer: it dies with its training rank, so nothing writes into the staging
    directory after the next run has removed it."""
    from megatron_dllm.parent_watch import watch_parent

    watch_parent("checkpoint writer")
    return write(*args, **kwargs)


def remove_incomplete(root: str, log=print) -> list[str]:
    """Remove unfinished saves under `root` (rank 0), saying which and why on every rank."""
    removed = _from_rank0(lambda: layout.remove_incomplete_saves(root))
    for path in removed:
        log(f"removed incomplete save {path} (a save that never finished: it has no final name)")
    return removed


def apply_retention(root: str, keep_last: int, keep_interval: int | None, log=print) -> list[str]:
    """--keep-last-n-checkpoints/--keep-checkpoint-interval after a completed save (rank 0)."""
    removed = _from_rank0(lambda: retention.apply(root, keep_last, keep_interval))
    for path in removed:
        log(f"removed checkpoint {path} (--keep-last-n-checkpoints {keep_last}"
            + (f", --keep-checkpoint-interval {keep_interval})" if keep_interval else ")"))
    return removed


def remove_leftover_removals(root: str, log=print) -> list[str]:
    """Finish the checkpoint removals a killed run left half done (rank 0)."""
    removed = _from_rank0(lambda: retention.remove_leftovers(root))
    for path in removed:
        log(f"removed {path} (a checkpoint removal that never finished)")
    return removed


def locate(load: str, ckpt_step: int | None = None, log=print) -> layout.Found | None:
    """The checkpoint `--load load [--ckpt-step N]` names, verified against its manifest; None
    when `load` holds no checkpoint. Errors name the file and what was expected."""
    found = _from_rank0(lambda: layout.find_checkpoint(load, ckpt_step))
    if found is None:
        return None
    if layout.has_manifest(found.path):
        verify_manifest(found.path)
    else:
        log(f"{found.path} has no manifest (written by an older version or another tool): "
            f"loading it without verifying its files")
    safe_read.check_no_code(found.path)  # before megatron-core's loader unpickles anything
    return found


def check_writable(save: str) -> None:
    _from_rank0(lambda: layout.check_save_dir(save))


def read(path: str, fn, *args):
    """A reader call whose failure (a truncated or foreign file in a checkpoint without a
    manifest) becomes one message naming the checkpoint."""
    try:
        return fn(*args)
    except Exception as err:  # torch's and megatron's readers raise many types for a bad file
        raise CheckpointError(f"--load {path}: cannot read the checkpoint ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err
