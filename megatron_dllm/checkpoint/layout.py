"""Where checkpoints live on disk, and which of them are complete.

Megatron-LM's layout, with a staging name so that nothing unfinished ever looks finished:

    ROOT/iter_0000100/                    a complete checkpoint (holds manifest.json)
    ROOT/iter_0000200.RUNID.incomplete/   a save under way, or killed: the only thing ever removed
    ROOT/latest_checkpointed_iteration.txt
    ROOT/.dllm-writer.lock                the writer's lock (`output_lock.py`): no checkpoint

A save writes into `iter_N.RUNID.incomplete` (RUNID: the writing run's id, so two runs never
stage into one directory), adds the manifest, and renames the directory to `iter_N` (the atomic
completion step; over an existing `iter_N`, an atomic swap); only then is the tracker pointed at
it. Loading therefore never has to guess: `iter_N` directories are complete (or were written by
an older version or another tool, without a manifest: loadable when named, never removed), and
`*.incomplete` ones are not.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.checkpoint.manifest import MANIFEST, CheckpointError, manifest_size

TRACKER = "latest_checkpointed_iteration.txt"
INCOMPLETE = ".incomplete"
REPLACED = ".replaced"  # a checkpoint publish moved aside (filesystems without an atomic swap)
_ITER = re.compile(r"iter_(\d+)")
_STAGED = re.compile(r"iter_\d+(\.[0-9a-f]+)?")  # before INCOMPLETE; older versions staged without a run id


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int, run_id: str) -> str:
    return f"{iteration_dir(root, iteration)}.{run_id}{INCOMPLETE}"


def is_checkpoint_dir(path: str) -> bool:
    """A single checkpoint (ours with a manifest, or any torch_dist directory)."""
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, "metadata.json"))


def has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def complete_checkpoints(root: str) -> dict[int, str]:
    """{iteration: directory} of the `iter_N` directories under `root` that hold a manifest."""
    return {it: path for it, path in iterations(root).items() if has_manifest(path)}


def iterations(root: str) -> dict[int, str]:
    """{iteration: directory} of every `iter_N` directory under `root` (complete or legacy)."""
    found = {}
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER.fullmatch(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found[int(m.group(1))] = os.path.join(root, name)
    return dict(sorted(found.items()))


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        text = f.read().strip()
    if not re.fullmatch(rb"[0-9]+", text):  # ASCII digits only (str.isdigit takes "²", int() does not)
        raise CheckpointError(f"{path}: expected an iteration number, found "
                              f"{text[:40].decode('utf-8', errors='replace')!r}")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    with atomic_write(os.path.join(root, TRACKER)) as f:
        f.write(str(iteration))


def incomplete_saves(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root)
                  if n.endswith(INCOMPLETE) and _STAGED.fullmatch(n[:-len(INCOMPLETE)]))


def remove_incomplete_saves(root: str) -> list[str]:
    """Remove the `iter_N[.RUNID].incomplete` directories under `root` (saves that never finished),
    after putting back a checkpoint that `publish` had moved aside when it was killed."""
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.endswith(REPLACED) and _ITER.fullmatch(name[:-len(REPLACED)]):
            recover_replaced(os.path.join(root, name[:-len(REPLACED)]))
    removed = incomplete_saves(root)
    for path in removed:
        shutil.rmtree(path)
    return removed


def remove_at_exit_if_empty(directory: str) -> None:
    """A writer about to make `directory`: remove it when the process exits if it stays empty (the
    writer was refused or failed before writing), so that no empty output is left behind. Call it
    before taking the directory's lock: atexit runs the lock's release first."""
    if not os.path.isdir(directory):
        atexit.register(_remove_if_empty, directory)


def _remove_if_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:  # not empty, or already gone
        pass


def publish(staging: str, final: str) -> None:
    """Make a finished directory (a save, an export) visible under its final name. One already
    there (a run rolled back to an earlier iteration, an earlier export) is swapped with it in one
    step, so that a kill at any moment leaves a complete one under `final`; the old one, now under
    the staging name, is then removed (or, after a kill, with the other unfinished saves).
    Where the filesystem cannot swap, the old one is moved aside to FINAL.replaced first, which
    `recover_replaced` puts back after a kill between the two renames."""
    if os.path.exists(final):
        if _exchange(staging, final):
            shutil.rmtree(staging)
            return
        recover_replaced(final)  # a leftover of an earlier kill: `final` stands, so it goes
        os.rename(final, final + REPLACED)
        os.rename(staging, final)
        shutil.rmtree(final + REPLACED)
        return
    os.rename(staging, final)


def recover_replaced(final: str) -> None:
    """FINAL.replaced, left by a kill inside `publish` without a swap: back under its name if
    nothing took it, else removed."""
    old = final + REPLACED
    if os.path.isdir(old):
        if os.path.exists(final):
            shutil.rmtree(old)
        else:
            os.rename(old, final)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the platform or
    filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library without it
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this filesystem or kernel cannot swap
        return False
    raise OSError(err, os.strerror(err), b)


@dataclass(frozen=True)
class Found:
    path: str
    iteration: int | None  # None: a directory given by path whose name carries no iteration
    how: str  # why this one: for the log


def find_checkpoint(load: str, ckpt_step: int | None = None) -> Found | None:
    """The checkpoint `--load load [--ckpt-step N]` means, or None when `load` holds none.

    `load` is a checkpoint root or one checkpoint directory. In a root: `--ckpt-step N` picks
    iter_N; else the iteration the tracker names; else (no tracker) the newest complete one.
    A tracker or step naming a missing directory is an error, never a silent fresh start.
    """
    if load.rstrip(os.sep).endswith(INCOMPLETE):
        raise CheckpointError(f"--load {load}: an unfinished save (its name ends in {INCOMPLETE}); it cannot be loaded")
    if is_checkpoint_dir(load):
        m = _ITER.fullmatch(os.path.basename(os.path.normpath(load)))
        it = int(m.group(1)) if m else None
        if ckpt_step is not None and it is not None and it != ckpt_step:
            raise CheckpointError(f"--load {load} is the checkpoint of iteration {it}, but --ckpt-step {ckpt_step}")
        return Found(load, it, "the directory given")
    found = iterations(load)
    if ckpt_step is not None:
        if ckpt_step not in found:
            raise CheckpointError(f"--ckpt-step {ckpt_step}: no {os.path.basename(iteration_dir(load, ckpt_step))} "
                                  f"in {load} (checkpoints there: {_listing(found)})")
        return Found(found[ckpt_step], ckpt_step, f"--ckpt-step {ckpt_step}")
    tracked = read_tracker(load)
    if tracked is not None:
        if tracked not in found:
            raise CheckpointError(f"{os.path.join(load, TRACKER)} names iteration {tracked}, but "
                                  f"{iteration_dir(load, tracked)} does not exist (checkpoints there: "
                                  f"{_listing(found)}); fix the tracker or pass --ckpt-step")
        newer = {it: p for it, p in found.items() if it > tracked}
        return Found(found[tracked], tracked, TRACKER + (f" (newer checkpoints kept, not loaded: {_listing(newer)})"
                                                        if newer else ""))
    complete = [it for it, path in found.items() if has_manifest(path)]
    if complete:
        return Found(found[complete[-1]], complete[-1], f"no {TRACKER}: the newest complete checkpoint")
    if found:
        raise CheckpointError(f"--load {load}: no {TRACKER} and no checkpoint with a {MANIFEST} (found "
                              f"{_listing(found)}, written without manifests); name one with --ckpt-step")
    return None


def _listing(found: dict) -> str:
    return ", ".join(os.path.basename(p) for p in found.values()) or "none"


def check_save_dir(save: str) -> None:
    """Fail before training if `save` cannot take a checkpoint: not writable, or less free space
    than the newest complete checkpoint already there needs."""
    try:
        os.makedirs(save, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save, prefix=".write-test-"):
            pass
    except OSError as err:
        raise CheckpointError(f"--save {save}: not writable ({err.strerror or err})") from None
    check_free_space(save, None)


def check_free_space(save: str, estimate: int | None) -> None:
    """Fail if `save` cannot hold one more checkpoint: the size of the newest complete one there,
    else `estimate` (bytes; None: no check without a previous checkpoint)."""
    complete = list(complete_checkpoints(save).values())
    free = shutil.disk_usage(save).free
    if complete:
        need = manifest_size(complete[-1])
        if need > free:
            raise CheckpointError(f"--save {save}: {_size(free)} free, but the last checkpoint "
                                  f"{os.path.basename(complete[-1])} took {_size(need)}")
    elif estimate is not None and estimate > free:
        raise CheckpointError(f"--save {save}: {_size(free)} free, but one checkpoint of this model "
                              f"needs about {_size(estimate)}")


def _size(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def refuse_existing(save: str, load: str | None, finetune: bool) -> None:
    """Refuse a run that does not resume `save` (it starts at iteration 0, or from another
    directory's checkpoint) where `save` holds checkpoints: its saves would replace them."""
    found = iterations(save)
    if not found:
        return
    held = f"--save {save} already holds checkpoints ({_listing(found)})"
    if finetune:
        raise CheckpointError(f"{held}; --finetune starts again at iteration 0 and would replace them: pick a new "
                              f"--save (--pretrained-checkpoint {load or 'PRETRAINED'} --load {save} instead starts "
                              f"from its weights and resumes --save once it has saved)")
    if load:
        raise CheckpointError(f"{held}; --load {load} is another directory's, and continuing it here would replace "
                              f"them: resume with --load {save}, or pick a new --save")
    raise CheckpointError(f"{held}; resume with --load {save}, or pick a new --save")


def resumes(load: str | None, save: str) -> bool:
    """Whether `--load` names `save` itself or one checkpoint directory in it (resuming, or
    going back to an earlier iteration of the same run)."""
    if not load:
        return False
    load, save = os.path.realpath(load), os.path.realpath(save)  # a link to the same directory resumes it
    return load == save or os.path.dirname(load) == save
