"""Save and find checkpoints: megatron-core's distributed checkpointing inside the layout of
`layout.py`, with the manifest of `manifest.py` written at save and verified before any load.

Every function here is collective when torch.distributed is initialised: rank 0 decides what
happens on disk and broadcasts it, so every rank sees the same checkpoint and the same error.
"""
from __future__ import annotations

import atexit
import errno
import os
import shutil
from contextlib import contextmanager
from functools import partial

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dllm.checkpoint import layout, retention, safe_read, writer_processes, writers
from megatron_dllm.checkpoint.manifest import CheckpointError, read_manifest, verify_manifest, write_manifest
from megatron_dllm.output_lock import OutputLock, lock_path_for_dir


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

    writer_processes.watch(background=async_queue is not None)
    run = writers.run_id()
    staging, final = layout.staging_dir(root, iteration, run), layout.iteration_dir(root, iteration)
    state = {**state, writers.RECORD_KEY: writers.sharded_record()}  # lands in this rank's own shard file

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
        write_manifest(staging, iteration, run)
        _barrier()
        _from_rank0(complete)
        if on_complete is not None:
            on_complete(final)

    _from_rank0(prepare)
    if async_queue is None:
        with reporting_full_disk(root, staging):
            dist_checkpointing.save(state, staging)
            finish()
        return final
    with reporting_full_disk(root, staging):
        request = dist_checkpointing.save(state, staging, async_sharded_save=True)
    request = request._replace(async_fn=partial(writer_processes.write_in_background, request.async_fn))
    request.add_finalize_fn(finish)
    async_queue.schedule_async_request(request)
    return final


def _disk_full(err: BaseException) -> bool:
    """Whether ENOSPC caused `err`, however torch's and megatron's writers wrapped it (as a cause,
    as a per-rank failure of a CheckpointException, or only in the text of a worker's error)."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (tuple, list, dict)):  # CheckpointException.failures: {rank: (exception, traceback)}
            todo += list(e.values() if isinstance(e, dict) else e)
            continue
        if getattr(e, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(e):
            return True
        if isinstance(e, BaseException):
            todo += [e.__cause__, e.__context__, getattr(e, "failures", None), *e.args]
    return False


def _no_space_left(root: str) -> bool:
    try:
        return shutil.disk_usage(root).free < _NEARLY_FULL
    except OSError:
        return False


_NEARLY_FULL = 1 << 20


@contextmanager
def reporting_full_disk(root: str, staging: str | None = None):
    """A full disk under a save becomes one CheckpointError naming ENOSPC and the directory; the
    staged save is removed (rank 0) to give the space back. It never had its final name."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch's CheckpointException, wrapping the OSError, is a BaseException
        # torch's zip writer reports a short write as a position mismatch, without the errno: a
        # write that failed on a filesystem left with no free space is taken as ENOSPC too
        full = _disk_full(err) or (not isinstance(err, CheckpointError) and _no_space_left(root))
        if not full:
            raise
        unfinished = [staging] if staging else layout.incomplete_saves(root)  # a background save's
        if _rank() == 0:
            for path in unfinished:
                shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(f"--save {root}: no space left on device (ENOSPC) writing "
                              f"{', '.join(unfinished) or root}; the unfinished save was removed, complete "
                              f"checkpoints are kept") from err


def finalize_saves(root: str, async_queue, blocking: bool) -> None:
    """Finish the background saves that are done (or all, `blocking`): megatron's write-result
    check, then our manifest, rename and tracker; a full disk is reported as in a plain save."""
    with reporting_full_disk(root):
        async_queue.maybe_finalize_async_calls(blocking=blocking)


_save_lock: OutputLock | None = None


def lock_save(save: str, log=print) -> None:
    """Take the one-writer lock of the checkpoint root `save` on rank 0 for the rest of this
    process (collective: a writer already there fails every rank with its name). Released at exit
    (normal or by a handled error); a killed process's lock is taken over by the next run."""

    def take():
        global _save_lock
        if _save_lock is None:
            _save_lock = OutputLock(lock_path_for_dir(save), f"--save {save}", log=log).acquire()
            atexit.register(_save_lock.release)

    _from_rank0(take)


def release_save_lock() -> None:
    global _save_lock
    if _save_lock is not None:
        _save_lock.release()
        _save_lock = None


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
    """The checkpoint `--load load [--ckpt-step N]` names, verified (`check_files`); None when
    `load` holds no checkpoint. Errors name the file and what was expected."""
    found = _from_rank0(lambda: layout.find_checkpoint(load, ckpt_step))
    if found is not None:
        check_files(found, log)
    return found


def check_files(found: layout.Found, log=print, unverified: bool = True) -> None:
    """Before anything of the checkpoint `found` unpickles: its files against its manifest, the
    iteration the manifest records against its directory's name, its pickles against the
    allowlist, its shards from one run. Without a manifest (an older version's or another tool's
    checkpoint) it is `log`ged and loaded unverified where `unverified`, else refused."""
    path = found.path
    if layout.has_manifest(path):
        verify_manifest(path)
        recorded = _from_rank0(lambda: read_manifest(path).get("iteration"))
        if None not in (recorded, found.iteration) and recorded != found.iteration:
            raise CheckpointError(f"{path}: its manifest.json records iteration {recorded}, not the {found.iteration} "
                                  f"of its directory's name (renamed or copied into place?); name the checkpoint "
                                  f"by the iteration it holds")
    elif _from_rank0(lambda: writers.shard_records(path)):  # written since manifests were
        raise CheckpointError(f"{path}: manifest.json is missing from a checkpoint written with one (it holds "
                              f"the writers' run records), so its files cannot be verified; load an earlier "
                              f"checkpoint with --ckpt-step")
    elif unverified:
        log(f"{path} has no manifest (written by an older version or another tool): "
            f"loading it without verifying its files")
    else:
        raise CheckpointError(f"{path}: no manifest.json (written by an older version or another tool): nothing "
                              f"to verify against")
    safe_read.check_no_code(path)
    if layout.has_manifest(path):
        _from_rank0(lambda: writers.check_single_run(path, read_manifest(path).get("run")))


def check_writable(save: str) -> None:
    """Fail now if `save` cannot take a checkpoint. A directory made here is removed at exit if the
    run leaves it empty (refused, or stopped before its first save)."""

    def check():
        layout.remove_at_exit_if_empty(save)
        layout.check_save_dir(save)

    _from_rank0(check)


def check_free_space(save: str, estimate: int) -> None:
    """Fail before the first iteration when --save cannot hold one more checkpoint (rank 0)."""
    _from_rank0(lambda: layout.check_free_space(save, estimate))


def refuse_existing(save: str, load: str | None, finetune: bool) -> None:
    """A run that does not resume from --save must not write over the checkpoints there."""
    _from_rank0(lambda: layout.refuse_existing(save, load, finetune))


def holds_checkpoint(load: str, ckpt_step: int | None = None) -> bool:
    """Whether `--load load [--ckpt-step N]` names a checkpoint (no manifest read: see `locate`)."""
    return _from_rank0(lambda: layout.find_checkpoint(load, ckpt_step) is not None)


def read(path: str, fn, *args):
    """A reader call whose failure (a truncated or foreign file in a checkpoint without a
    manifest) becomes one message naming the checkpoint."""
    try:
        return fn(*args)
    except (Exception, CheckpointException) as err:  # many types for a bad file; torch's DCP one is a BaseException
        raise CheckpointError(f"--load {path}: cannot read the checkpoint ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err
