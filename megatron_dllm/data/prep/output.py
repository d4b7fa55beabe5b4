"""How every dataset writer claims and publishes its output.

- `claim_outputs`: the output directory must be writable (checked with a real file: root ignores
  permission bits), then each dataset prefix is locked (`output_lock`: a second writer stops with
  one line naming the first), then, unless `--overwrite`, a prefix that already holds a dataset
  is refused. The lock comes before the "already exists" check so that check sees a settled disk.
- temporaries are named by `atomic_file.staging_tag`, `.tmp-{pid}-{random}`, so two writers of
  one prefix (the lock bypassed, or a filesystem that ignores it) never write into each other's
  files, and a leftover's writer can be told (`staging_pid`).
- `publish_pair`: renames a staged `.bin/.idx` into place so that what is left is one writer's
  pair, never a `.bin` of one writer beside the `.idx` of another (see its docstring).
"""
from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from typing import Callable, Optional, Sequence

from megatron_dllm.errors import InputError
from megatron_dllm.output_lock import OutputLock, lock_path_for_prefix, pid_alive

DATASET_SUFFIXES = (".bin", ".idx", ".meta.json")


def rejections_path(prefix: str) -> str:
    """The rejections report of the dataset `prefix` (preprocessing's rejected records, a merge's
    joined reports): beside its `.bin/.idx`, under the same lock, so no other dataset's writer
    touches it."""
    return prefix + "_rejected.tsv"


def staging_pid(path: str) -> Optional[int]:
    """The pid in a `...tmp-{pid}[-{random}]...` temporary's name, or None."""
    tail = path.rsplit(".tmp-", 1)[-1].split("-")[0].split(".")[0]
    return int(tail) if tail.isdigit() else None


def staging_owner_alive(path: str) -> bool:
    """Whether the temporary `path` belongs to another writer still running on this host."""
    pid = staging_pid(path)
    return pid is not None and pid != os.getpid() and pid_alive(pid)


def remove_stale_temporaries(paths: Sequence[str], log: Callable[[str], None]) -> None:
    """Remove the temporaries `{path}.tmp-*` of an interrupted writer; never finished files, nor the
    temporaries of a writer still running here (one that bypassed the lock)."""
    stale = [p for path in paths for p in glob.glob(glob.escape(path) + ".tmp-*")
             if not staging_owner_alive(p)]
    for p in sorted(set(stale)):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    if stale:
        log(f"removed {len(set(stale))} temporary files of an interrupted run: {sorted(set(stale))[:4]}")


def check_writable(directory: str, flag: str) -> None:
    """Create the directory and a one-byte file in it: a read-only or full file system fails
    here, before any work, with one message naming the path."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        try:
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as err:
        raise InputError(f"{flag}: cannot write to {directory} ({err.strerror or err})") from None


def existing_outputs(paths: Sequence[str]) -> list:
    return [p for p in paths if os.path.lexists(p)]


def claim_outputs(prefixes: Sequence[str], flag: str, overwrite: bool = True,
                  other_files: Sequence[str] = ()) -> list:
    """Check, lock and (without `overwrite`) refuse to replace the datasets `prefixes`; returns
    the held locks, to `release_all` when the writer is done. Raises ValueError / OSError."""
    for directory in sorted({os.path.dirname(os.path.abspath(p)) for p in prefixes}):
        check_writable(directory, flag)
    locks = []
    try:
        # Testing only: lets a test run two writers at once to check `publish_pair` on its own.
        if os.environ.get("DLLM_TEST_NO_DATA_LOCK") != "1":
            for p in sorted(prefixes):  # one order for every writer
                locks.append(OutputLock(lock_path_for_prefix(p), f"{flag} ({p})").acquire())
        outputs = [p + s for p in prefixes for s in DATASET_SUFFIXES] + list(other_files)
        in_the_way = [p for p in outputs if os.path.isdir(p)]
        if in_the_way:  # --overwrite replaces files, never a directory
            raise InputError(f"{flag}: {in_the_way[0]} is a directory, where an output file goes")
        if not overwrite:
            there = existing_outputs(outputs)
            if there:
                raise InputError(f"{flag}: {there[0]} already exists"
                                 + (f" (and {len(there) - 1} more output files)" if len(there) > 1 else "")
                                 + "; pass --overwrite to replace it")
    except BaseException:
        release_all(locks)
        raise
    return locks


def release_all(locks) -> None:
    for lock in reversed(locks):
        lock.release()


def _inode(path: str):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _place(staged: str, final: str) -> None:
    """Rename `staged` onto `final` through a hard link, keeping `staged` (so it can be placed
    again); where hard links are refused, a plain rename."""
    link = staged + ".pub"
    try:
        os.link(staged, link)
    except OSError:
        os.replace(staged, final)
        return
    os.replace(link, final)


class PublishRaceError(InputError):
    """Another writer published the same prefix at the same moment (no lock held)."""


def publish_pair(prefix: str, tmp_bin: str, tmp_idx: str) -> None:
    """Put the staged `tmp_bin`/`tmp_idx` in place as `prefix.bin/.idx`.

    Order: the old `.idx` is removed first (an old `.idx` beside a new `.bin` could look valid),
    then the `.bin` is renamed in, then the `.idx`: a reader sees the old dataset, no dataset, or
    the new one. Two writers without the lock can interleave their renames so that one's `.bin`
    lands between the other's `.bin` and `.idx`; the writer whose `.idx` is in place then puts its
    own `.bin` back (kept through a hard link) and checks again. A writer that finds the published
    files are not both its own raises PublishRaceError, after removing its `.idx` if that is still
    there. What remains is one writer's pair, or no `.idx` at all; the only window in which a
    reader can see a mismatched pair is between a writer's `.idx` rename and its check.
    """
    bin_final, idx_final = prefix + ".bin", prefix + ".idx"
    mine_bin, mine_idx = _inode(tmp_bin), _inode(tmp_idx)
    with contextlib.suppress(FileNotFoundError):
        os.remove(idx_final)
    try:
        _place(tmp_bin, bin_final)
        os.replace(tmp_idx, idx_final)
        if _inode(idx_final) == mine_idx and _inode(bin_final) != mine_bin and os.path.exists(tmp_bin):
            _place(tmp_bin, bin_final)  # another writer's .bin landed inside our renames
        ours = _inode(bin_final) == mine_bin and _inode(idx_final) == mine_idx
        if not ours:
            if _inode(idx_final) == mine_idx:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(idx_final)
            raise PublishRaceError(f"{prefix}: another writer published this dataset at the same time "
                                   f"(was its lock bypassed?); run one writer at a time")
    finally:
        for p in (tmp_bin, tmp_bin + ".pub"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
