"""What one preprocessing run is told (`tools/preprocess_data.py`'s flags), checked where it is declared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megatron_dllm.data.prep.output import rejections_path
from megatron_dllm.errors import InputError


def shard_prefix(output_prefix: str, shard_index: int, num_shards: int) -> str:
    return f"{output_prefix}_shard{shard_index:05d}of{num_shards:05d}"


@dataclass(frozen=True)
class PreprocessOptions:
    """Inputs, tokenizer, outputs and run-time knobs of `preprocess.run_preprocess`.

    `tokenizer_options` are `build_tokenizer`'s keyword options (a tiktoken pattern, specials, ...).
    With `num_shards`, this run is shard `shard_index` (default 0) of that many. `overwrite`
    replaces an existing dataset, or redoes a finished shard. `chunksize` / `chunk_bytes` bound a
    worker task; `progress` forces the TTY status line on or off (default: on for a TTY, else a
    log line every `log_interval` seconds).
    """

    inputs: Tuple[str, ...]
    output_prefix: str
    tokenizer_type: str
    tokenizer_model: str
    tokenizer_options: Optional[dict] = None
    json_keys: Tuple[str, ...] = ("text",)
    append_eod: bool = False
    num_shards: Optional[int] = None
    shard_index: Optional[int] = None
    overwrite: bool = False
    workers: int = 1
    chunksize: int = 256
    chunk_bytes: int = 1 << 18
    parquet_batch_rows: int = 1024
    progress: Optional[bool] = None
    log_interval: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            raise InputError(f"--input {self.inputs!r}: expected a list of files or globs, got one string")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("inputs", tuple(self.inputs))
        set_("json_keys", tuple(self.json_keys))
        set_("tokenizer_options", dict(self.tokenizer_options or {}))
        if not self.json_keys:
            raise InputError("--json-keys: at least one key is required")
        if len(set(self.json_keys)) != len(self.json_keys):
            raise InputError(f"--json-keys: duplicate keys in {list(self.json_keys)}")
        if self.workers < 1:
            raise InputError(f"--workers {self.workers}: expected >= 1")
        if self.sharded:
            if self.shard_index is None:
                set_("shard_index", 0)
            if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
                raise InputError(f"--shard-index {self.shard_index} / --num-shards {self.num_shards}: expected "
                                 f"0 <= shard index < number of shards")

    @property
    def sharded(self) -> bool:
        return self.num_shards is not None

    @property
    def base(self) -> str:
        """Where this run's outputs go: the output prefix, or the shard's own prefix."""
        if not self.sharded:
            return self.output_prefix
        return shard_prefix(self.output_prefix, self.shard_index, self.num_shards)

    @property
    def dataset_prefixes(self) -> dict:
        """key -> the prefix of its `.bin/.idx`."""
        return {key: f"{self.base}_{key}_document" for key in self.json_keys}

    @property
    def rejections_paths(self) -> dict:
        """key -> its dataset's rejections report."""
        return {key: rejections_path(prefix) for key, prefix in self.dataset_prefixes.items()}

    @property
    def marker_path(self) -> str:
        return f"{self.base}.done.json"

    @property
    def label(self) -> str:
        """Prefix of this run's log lines."""
        return f"[shard {self.shard_index}/{self.num_shards}] " if self.sharded else ""
