"""A checkpoint's manifest: every file with its size and SHA-256, checked before anything loads.

torch's distributed-checkpoint reader unpickles `.metadata` and megatron-core's `common.pt`, and
reads `.distcp` shards without checksums: a truncated or bit-flipped file would load silently or
fail deep inside torch. Hashing the files at save time and verifying them before any reader
opens one turns that into one message naming the file.

The manifest guards integrity (disk faults, partial copies, edits), not authenticity: whoever
can write the checkpoint can write its manifest too. Load checkpoints from trusted sources only.

Hashing is split over the ranks (each hashes every world-size-th file), so a large checkpoint
costs one file's worth of reading per rank rather than the whole checkpoint on rank 0.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.errors import InputError

MANIFEST = "manifest.json"
FORMAT = "megatron_dllm checkpoint manifest"


class CheckpointError(InputError):
    """A checkpoint that cannot be used as asked: one message naming the file."""


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(directory: str) -> list[str]:
    out = []
    for base, _, names in os.walk(directory):
        out += [os.path.relpath(os.path.join(base, n), directory) for n in names if n != MANIFEST]
    return sorted(out)


def _gather(local: dict, group=None) -> dict:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return local
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return {k: v for part in parts for k, v in part.items()}


def _rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def write_manifest(directory: str, iteration: int | None, run: str | None = None) -> None:
    """Hash every file of `directory` (collective when distributed) and write the manifest
    atomically (rank 0); `run`: the id of the run that wrote the files (`writers.py`)."""
    rank, size = _rank_and_size()
    names = _files(directory)
    mine = {n: {"size": os.path.getsize(os.path.join(directory, n)), "sha256": sha256(os.path.join(directory, n))}
            for n in names[rank::size]}
    files = _gather(mine)
    if rank == 0:
        with atomic_write(os.path.join(directory, MANIFEST)) as f:
            json.dump({"format": FORMAT, "version": 1, "iteration": iteration,
                       **({"run": run} if run else {}), "files": dict(sorted(files.items()))}, f, indent=1)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
                or not isinstance(manifest.get("files"), dict):
            raise InputError("not a checkpoint manifest")
        for name, entry in manifest["files"].items():
            if not (isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("sha256"), str)
                    and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
                raise InputError(f"its entry for {name!r} is not {{size: bytes, sha256: 64 hex digits}}")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err})") from None
    return manifest


def manifest_size(directory: str) -> int:
    return sum(entry["size"] for entry in read_manifest(directory)["files"].values())


def _problem(directory: str, name: str, entry: dict) -> str | None:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{path}: missing (listed in {MANIFEST})"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{path}: {size} bytes, {MANIFEST} says {entry['size']} (truncated or replaced)"
    if sha256(path) != entry["sha256"]:
        return f"{path}: content differs from its SHA-256 in {MANIFEST} (corrupted)"
    return None


def verify_manifest(directory: str) -> None:
    """Raise CheckpointError naming the first file (in sorted order) that is missing, of another
    size or of other content than the manifest says. Collective when distributed."""
    files = read_manifest(directory)["files"]
    rank, size = _rank_and_size()
    names = sorted(files)
    mine = {n: p for n in names[rank::size] if (p := _problem(directory, n, files[n]))}
    problems = _gather(mine)
    if problems:
        first = min(problems)
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        raise CheckpointError(problems[first] + more)
