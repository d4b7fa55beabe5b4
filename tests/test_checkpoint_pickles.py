"""A checkpoint's pickles never run code: `.metadata` (which torch's reader unpickles with plain
pickle), a stored object in a `.distcp` shard (torch.load with weights_only=False in torch's
reader) and `common.pt` are each read through an allowlist before megatron-core opens them.

Each poisoned copy carries a payload that would create a marker file, and a manifest rehashed to
match, as someone passing on a checkpoint could write it: the manifest check passes, the
allowlist refuses."""
import io
import os
import pickle
import shutil

import pytest
import torch
from conftest import launch_env, run_pretrain, run_python

from megatron_dllm.checkpoint import CheckpointError, layout, manifest, safe_read, store

RUN = ["--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1"]


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def trained(demo_cache, tmp_path_factory):
    work = tmp_path_factory.mktemp("pickles")
    run_pretrain(1, ["--demo-cache-dir", demo_cache, *RUN, "--train-iters", "2", "--save", str(work / "ckpt")], work)
    return work / "ckpt"


def _poison_metadata(path, marker):
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data = Payload(marker)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return ".metadata", "posix.system"


def _poison_stored_object(path, marker):
    """Append a torch.save'd payload to a shard and point one stored object (an RNG state) at it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    buffer = io.BytesIO()
    torch.save({"state": Payload(marker)}, buffer)
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
    shard = path / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(buffer.getvalue())
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return f"{info.relative_path} (object {index.fqn})", "posix.system"


def _poison_common(path, marker):
    common = torch.load(path / "common.pt", weights_only=False)
    common["payload"] = Payload(marker)
    torch.save(common, path / "common.pt")
    return "common.pt", "posix.system"


POISONS = {"metadata": _poison_metadata, "stored_object": _poison_stored_object, "common": _poison_common}


@pytest.fixture(params=sorted(POISONS))
def poisoned(request, trained, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    path = layout.iteration_dir(str(root), 2)
    marker = tmp_path / "PAYLOAD_RAN"
    where, name = POISONS[request.param](type(root)(path), marker)
    manifest.write_manifest(path, 2)  # an internally consistent checkpoint: the manifest cannot help
    manifest.verify_manifest(path)
    return root, path, marker, where, name


@pytest.mark.slow
def test_a_real_checkpoint_passes_the_allowlist(trained):
    safe_read.check_no_code(layout.iteration_dir(str(trained), 2))
    assert store.locate(str(trained)).iteration == 2


@pytest.mark.slow
def test_a_poisoned_pickle_is_refused_before_anything_runs(poisoned):
    root, path, marker, where, name = poisoned
    with pytest.raises(CheckpointError) as err:
        store.locate(str(root))
    assert f"{os.path.join(path, where)}: refused, it names '{name}'" in str(err.value)
    assert not marker.exists()
    from megatron_dllm.cli import verify_checkpoint  # the offline check of a downloaded checkpoint refuses it too

    assert verify_checkpoint.main([str(root)]) == 2
    assert not marker.exists()


@pytest.mark.slow
def test_training_and_sampling_refuse_a_poisoned_checkpoint(demo_cache, trained, tmp_path):
    """The real commands: one error line, exit 2, the payload never ran, the checkpoint untouched."""

    from conftest import REPO

    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    path = layout.iteration_dir(str(root), 2)
    marker = tmp_path / "PAYLOAD_RAN"
    _poison_stored_object(type(root)(path), marker)
    manifest.write_manifest(path, 2)
    before = {n: manifest.sha256(os.path.join(path, n)) for n in os.listdir(path)}
    proc, _ = run_pretrain(1, ["--demo-cache-dir", demo_cache, *RUN, "--train-iters", "4", "--load", str(root),
                               "--save", str(root)], tmp_path, check=False)
    assert proc.returncode == 2 and "refused, it names 'posix.system'" in proc.stderr, proc.stderr[-2000:]
    sample = run_python([os.path.join(REPO, "tools", "sample.py"), "--load", str(root), "--num-samples", "1",
                         "--steps", "2"], tmp_path, launch_env(1), 300)
    errors = [line for line in sample.stderr.splitlines() if line.startswith("error:")]
    assert sample.returncode == 2 and len(errors) == 1 and "posix.system" in errors[0], sample.stderr[-2000:]
    assert not marker.exists()
    assert {n: manifest.sha256(os.path.join(path, n)) for n in os.listdir(path)} == before
