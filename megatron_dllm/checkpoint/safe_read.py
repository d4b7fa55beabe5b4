"""Loading a checkpoint never runs code from it.

torch's distributed-checkpoint reader unpickles a checkpoint's `.metadata` with plain
`pickle.load`, and each non-tensor item stored in the `.distcp` shards (megatron-core's
ShardedObjects: RNG states, layers' extra state) with `torch.load(weights_only=False)`: a
checkpoint from a stranger could name any function in those pickles and have it run. Before
megatron-core's loader opens anything, every pickle in the checkpoint is read here through an
allowlist:
- `.metadata`: the classes of torch's checkpoint metadata (plain dataclasses and enums), tensor
  sizes, dtypes and layouts, builtin containers;
- each stored object and `common.pt`: torch's own weights-only unpickler, which builds tensors
  and containers only, plus numpy arrays (the RNG states hold numpy's).
A name outside the allowlist is refused with the file and the name. The loader then reads the
same bytes (their hashes were just checked against the manifest).
"""
from __future__ import annotations

import io
import os
import pickle
import re

import numpy as np
import torch

from megatron_dllm.checkpoint.manifest import CheckpointError

METADATA = ".metadata"
COMMON = "common.pt"

_DCP = "torch.distributed.checkpoint."
_METADATA_NAMES = {
    _DCP + "metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                        "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    _DCP + "filesystem": {"_StorageInfo"},
    _DCP + "planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "str", "int", "float", "bool", "bytes"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # torch records the checkpoint id a save was given as a Path
}
# numpy arrays, as numpy pickles them (the RNG states' MT19937 key)
_NUMPY_GLOBALS = [np.dtype, np.ndarray, np._core.multiarray._reconstruct, *(
    getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith("DType"))]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _METADATA_NAMES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"names '{module}.{name}', which is not checkpoint metadata")


def read_metadata(directory: str):
    """The torch checkpoint metadata of `directory`, unpickled through the allowlist."""
    path = os.path.join(directory, METADATA)
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as err:
        raise CheckpointError(f"{path}: refused, it {_reason(err)} (a checkpoint's pickles are read "
                              f"through an allowlist, so no code from them runs)") from None


def _weights_only(data: bytes | str, where: str) -> None:
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"{where}: refused, it {_reason(err)} (a checkpoint's pickles are read through "
                              f"an allowlist, so no code from them runs)") from None


def _reason(err: BaseException) -> str:
    text = str(err)
    named = re.search(r"GLOBAL ([\w.]+)", text)  # torch's weights-only unpickler: the global, not its advice
    if named:
        return f"names '{named.group(1)}', which is not a tensor, a container or a numpy array"
    if text.startswith("names "):
        return text
    return f"is not a readable pickle ({(text.splitlines() or [type(err).__name__])[0]})"


def check_no_code(directory: str) -> None:
    """Raise CheckpointError naming the file if any pickle of the checkpoint in `directory` could
    run code when megatron-core loads it. A directory without torch metadata is not checked here
    (megatron-core's loader will refuse it)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if not os.path.exists(os.path.join(directory, METADATA)):
        return
    metadata = read_metadata(directory)
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            path = os.path.join(directory, info.relative_path)
            with open(path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            _weights_only(blob, f"{path} (object {index.fqn})")
    common_state = os.path.join(directory, COMMON)
    if os.path.exists(common_state):
        _weights_only(common_state, common_state)
