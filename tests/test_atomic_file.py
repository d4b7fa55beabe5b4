import errno
import os
import subprocess
import sys
import threading

import pytest

from megatron_dllm import atomic_file
from megatron_dllm.atomic_file import atomic_write


def test_concurrent_writers_use_their_own_temporaries_and_one_wins_whole(tmp_path):
    path = str(tmp_path / "out.json")
    writers = 8
    all_open = threading.Barrier(writers)
    names = []

    def write(i):
        with atomic_write(path) as f:
            names.append(f.name)
            all_open.wait(timeout=30)  # every temporary exists at once
            f.write(str(i) * 100_000)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == writers
    assert all(os.path.dirname(n) == str(tmp_path) and ".tmp-" in n for n in names)
    content = open(path).read()
    assert content in {str(i) * 100_000 for i in range(writers)}
    assert os.listdir(tmp_path) == ["out.json"]


def test_an_exception_leaves_the_target_untouched_and_no_temporary(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(str(path), "wb") as f:
            f.write(b"half of the new")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_failed_rename_leaves_no_temporary(tmp_path):
    (tmp_path / "in_the_way").mkdir()  # a directory where the file goes: os.replace refuses
    with pytest.raises(OSError):
        with atomic_write(str(tmp_path / "in_the_way")) as f:
            f.write("new")
    assert os.listdir(tmp_path) == ["in_the_way"]


def test_fsync_on_request_and_permissions_from_the_umask(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(atomic_file.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    with atomic_write(str(tmp_path / "plain")) as f:
        f.write("a")
    assert synced == []
    old_umask = os.umask(0o022)
    try:
        with atomic_write(str(tmp_path / "durable"), fsync=True) as f:
            f.write("b")
    finally:
        os.umask(old_umask)
    assert len(synced) == 1
    assert (tmp_path / "durable").read_text() == "b"
    assert (tmp_path / "durable").stat().st_mode & 0o777 == 0o644  # not tempfile's 0600


_FILE_SIZE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as one on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
"""


@pytest.mark.parametrize("writer", [
    "from megatron_dllm.atomic_file import atomic_write\n"
    "with atomic_write(sys.argv[1]) as f:\n    f.write('x' * 100_000)",
    # an HF export: safetensors (Rust) reports its failed write as no OSError
    "import torch\nfrom safetensors.torch import save_file\nfrom megatron_dllm.hf.export import staged_export\n"
    "with staged_export(sys.argv[1]) as d:\n    save_file({'w': torch.zeros(100_000)}, d + '/model.safetensors')",
])
def test_a_failed_write_is_an_os_error_naming_the_output(tmp_path, writer):
    """The tools print an OSError as their one `error:` line; a failed write() (a full disk) names
    no file by itself, so the writers name their output."""
    out = str(tmp_path / "out")
    script = _FILE_SIZE_LIMIT + f"try:\n    {writer.replace(chr(10), chr(10) + '    ')}\n" \
                                "except OSError as err:\n    print(err.errno, err.filename)\n"
    proc = subprocess.run([sys.executable, "-c", script, out], capture_output=True, text=True)
    assert proc.stdout.split() == [str(errno.EFBIG), out], proc.stderr[-2000:]
    assert os.listdir(tmp_path) == []  # no temporary, no partial output
