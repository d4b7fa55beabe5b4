"""What a checkpoint says about itself, besides its tensors: the one reader and writer of the
common state (megatron-core's `common.pt`) for every command that saves or loads a checkpoint.

    meta = CheckpointMeta.read(path)             # before any tensor is read; errors name `path`
    state.update(meta.to_dict())               # at save, beside the sharded tensors

The keys (documented in docs/checkpoints.md) are those every earlier version wrote, so their
checkpoints load unchanged. The optimizer's own non-tensor state (its param groups) lands in the
same file but belongs to megatron-core's optimizer, which reads it back itself.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.manifest import CheckpointError
from megatron_dllm.checkpoint.tokenizer_record import TokenizerRecord


@dataclass(frozen=True)
class CheckpointMeta:
    iteration: int
    identity: ModelIdentity
    consumed_samples: int = 0
    seq_length: int | None = None  # the training context: what sampling and export rebuild the model at
    tokenizer: TokenizerRecord | None = None  # None: converted from elsewhere, or saved before records
    data_mix: tuple | None = None  # the --data-path the run was training on (None: per-split paths)
    data_mix_start: int | None = None  # consumed samples when that mix started; None: no mix recorded
    scheduler: dict | None = None  # megatron's OptimizerParamScheduler state; None: a model-only checkpoint
    adam: dict | None = None  # AdamW's betas and eps (optimizer_settings.adam_state); None: saved before they were
    rng_layout: tuple[int, int, int] | None = None  # (PP, TP, DP) the per-rank RNG states were saved under
    ema_decay: float | None = None  # set when the checkpoint holds EMA weights
    # the optimizer state is megatron's distributed optimizer's (read from its own common state,
    # so older checkpoints tell too); None: no optimizer state
    distributed_optimizer: bool | None = None
    run_id: str | None = None  # the run that wrote the files: from manifest.json, never in the common state

    def __post_init__(self):  # lists as given (flags) or stored, kept as tuples: the metadata is frozen
        for name in ("data_mix", "rng_layout"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def model_only(self) -> bool:
        """Weights only (a converter's checkpoint): no optimizer, schedule, RNG or EMA to resume."""
        return self.scheduler is None

    # ------------------------------------------------------------------ the common state

    def to_dict(self) -> dict:
        """The common-state entries of this checkpoint; fields left unset are not written (a
        model-only checkpoint has no schedule, RNG layout or data mix). `distributed_optimizer`
        is not among them: megatron's optimizer writes its own state."""
        entries = {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                   "identity": self.identity.as_dict(), "seq_length": self.seq_length,
                   "tokenizer": self.tokenizer.as_dict() if self.tokenizer is not None else None,
                   "opt_param_scheduler": self.scheduler, "adam": self.adam, "rng_layout": _listed(self.rng_layout),
                   "ema_decay": self.ema_decay}
        entries = {key: value for key, value in entries.items() if value is not None}
        if self.data_mix_start is not None:  # a training run's: its mix as given, None included
            entries.update(data_mix=_listed(self.data_mix), data_mix_start=self.data_mix_start)
        return entries

    def data_mix_changed(self, data_path) -> bool:
        """Whether a run on `data_path` trains on another mix than the one this checkpoint recorded
        (the same files by another path, or a weight written otherwise, are the same mix)."""
        return self.data_mix_start is not None and _canonical_mix(self.data_mix) != _canonical_mix(data_path)

    @classmethod
    def from_dict(cls, stored: dict, path: str, run_id: str | None = None) -> "CheckpointMeta":
        """The metadata in `stored`, the common state of the checkpoint `path`. A missing or
        malformed entry is one CheckpointError naming `path` and the entry."""
        identity = ModelIdentity.from_dict(stored.get("identity"), path)
        iteration = _entry(stored, "iteration", int, path, required=True)
        rng_layout = _entry(stored, "rng_layout", (list, tuple), path)
        if rng_layout is not None and (len(rng_layout) != 3 or not all(isinstance(n, int) for n in rng_layout)):
            raise CheckpointError(f"{path}: 'rng_layout' in its common state is {rng_layout!r}, expected "
                                  f"[PP, TP, DP] sizes")
        data_mix = _entry(stored, "data_mix", (list, tuple), path)
        optimizer = stored.get("optimizer")
        tokenizer = _entry(stored, "tokenizer", dict, path)
        return cls(iteration=iteration, identity=identity,
                   consumed_samples=_entry(stored, "consumed_samples", int, path) or 0,
                   seq_length=_entry(stored, "seq_length", int, path),
                   tokenizer=TokenizerRecord.from_dict(tokenizer, path) if tokenizer else None,
                   data_mix=data_mix,
                   data_mix_start=_entry(stored, "data_mix_start", int, path),
                   scheduler=_entry(stored, "opt_param_scheduler", dict, path),
                   adam=_entry(stored, "adam", dict, path),
                   rng_layout=rng_layout,
                   ema_decay=_entry(stored, "ema_decay", (int, float), path), run_id=run_id,
                   distributed_optimizer=("param_state_sharding_type" in optimizer
                                          if isinstance(optimizer, dict) else None))

    # ------------------------------------------------------------------ on disk

    @classmethod
    def read(cls, path: str) -> "CheckpointMeta":
        """The metadata of the checkpoint directory `path` (found and verified by
        `checkpoint.locate`, or checked by `verify_checkpoint`); no tensor is read."""
        from megatron_dllm.checkpoint import layout
        from megatron_dllm.checkpoint.manifest import read_manifest

        run_id = read_manifest(path).get("run") if layout.has_manifest(path) else None
        return cls.from_dict(read_common_state(path), path, run_id)

    def replace(self, **changes) -> "CheckpointMeta":
        return dataclasses.replace(self, **changes)


def read_common_state(path: str) -> dict:
    """megatron-core's whole common state of the checkpoint `path` (the optimizer's part too), as
    stored: for `CheckpointMeta.read` and for comparing two checkpoints bit for bit."""
    from megatron.core import dist_checkpointing

    from megatron_dllm.checkpoint.store import read

    if not os.path.isdir(path):
        raise CheckpointError(f"--load {path}: not a checkpoint directory")
    return read(path, dist_checkpointing.load_common_state_dict, path)


def _entry(stored: dict, key: str, types, path: str, required: bool = False):
    value = stored.get(key)
    if value is None:
        if required:
            raise CheckpointError(f"{path}: no {key!r} in its common state; is it a megatron_dllm checkpoint?")
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise CheckpointError(f"{path}: {key!r} in its common state is {value!r}, expected {expected}")
    return value


def _canonical_mix(data_path) -> tuple | None:
    """A --data-path as the datasets it builds: each prefix as its resolved .bin and .idx (relative
    to this process's directory, as the run reading them resolves them; through links to the
    directory or to the files) and weights normalised to sum 1, as megatron-core normalises them
    (`0.3 A 0.7 B` and `3 A 7 B` are one mix); the order counts."""
    from megatron_dllm.data.datasets import parse_data_path

    if data_path is None:
        return None
    prefixes, weights = parse_data_path(data_path)
    if weights is not None:
        weights = tuple(round(w / sum(weights), 12) for w in weights)
    return tuple((os.path.realpath(p + ".bin"), os.path.realpath(p + ".idx")) for p in prefixes), weights


def _listed(values) -> list | None:
    """Stored as lists, as earlier versions wrote them (a tuple would change common.pt's bytes)."""
    return list(values) if values is not None else None
