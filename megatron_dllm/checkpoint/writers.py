"""Which run wrote a checkpoint: a run id per writing run, recorded inside every rank's shard.

Two runs saving the same iteration into one root (a lock that could not work, two hosts on a
shared filesystem) must never publish a checkpoint mixing their shards. Each run draws one id
(rank 0, broadcast); every save stages under a name carrying it, and every rank saves a small
record {"run", "rank"} as its own ShardedObject, so the record lies inside the `.distcp` file that
rank wrote. The manifest names the run too. `check_single_run` reads the records back through
the checkpoint's `.metadata` and fails a checkpoint whose shards come from different runs, naming
the files: a spliced shard carries its own run's record, whatever the manifest says.

Checkpoints written before run ids (no records) are accepted as they are.
"""
from __future__ import annotations

import io
import os
import uuid

from megatron_dllm.checkpoint.manifest import CheckpointError

RECORD_KEY = "writer_run"
_run_id: str | None = None


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def run_id() -> str:
    """This run's id (collective on first call: rank 0 draws it, every rank gets the same)."""
    global _run_id
    if _run_id is None:
        holder = [uuid.uuid4().hex[:12]]
        if (dist := _dist()) is not None:
            dist.broadcast_object_list(holder, src=0)
        _run_id = holder[0]
    return _run_id


def sharded_record():
    """This rank's record, saved into this rank's own shard file."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    return ShardedObject(RECORD_KEY, {"run": run_id(), "rank": rank}, (world,), (rank,), replica_id=0)


def shard_records(directory: str) -> dict[str, dict]:
    """{file: record} of every rank record in the checkpoint (empty for one without records)."""
    import torch

    from megatron_dllm.checkpoint.safe_read import read_metadata

    if not os.path.exists(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"{os.path.join(directory, '.metadata')}: missing")
    metadata = read_metadata(directory)  # through the allowlist: torch's reader would unpickle anything
    records = {}
    for index, info in metadata.storage_data.items():
        if not index.fqn.startswith(RECORD_KEY + "/"):
            continue
        path = os.path.join(directory, info.relative_path)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (named by {os.path.join(directory, '.metadata')}): an incomplete "
                                  f"copy of the checkpoint")
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)[0]
            records[info.relative_path] = {"run": str(data["run"]), "rank": int(data["rank"])}
        except Exception as err:  # a shard from elsewhere: bytes that are no record
            raise CheckpointError(f"{path}: no readable writer record at {index.fqn} ({type(err).__name__}); "
                                  f"the file does not belong to this checkpoint") from None
    return records


def check_single_run(directory: str, manifest_run: str | None) -> None:
    """Fail when the shards of `directory` were written by more than one run (or by another run
    than its manifest names), naming the files of each run."""
    records = shard_records(directory)
    runs: dict[str, list[str]] = {}
    for name, record in sorted(records.items()):
        runs.setdefault(record["run"], []).append(f"{name} (rank {record['rank']})")
    if manifest_run is not None and records and set(runs) != {manifest_run}:
        runs.setdefault(manifest_run, []).insert(0, "manifest.json")
    if len(runs) > 1:
        listing = "; ".join(f"run {run}: {', '.join(files)}" for run, files in runs.items())
        raise CheckpointError(f"{directory}: written by {len(runs)} different runs, a mixed checkpoint that must "
                              f"not be loaded ({listing})")
