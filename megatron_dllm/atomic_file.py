"""Writing a file that no reader ever sees half-written: the content goes to a temporary beside
it, renamed over the file once complete.

The temporary is `{path}.tmp-{pid}-{random}` (`staging_tag`), so two writers of one file never
write into each other's temporary, and `data/prep/output.py` can tell whose temporary a leftover
is. It is created with O_EXCL and the default permissions (umask), not tempfile's 0600: the
published file is as readable as one written in place.
"""
from __future__ import annotations

import contextlib
import os
import secrets


def staging_tag() -> str:
    """The suffix of a temporary: `.tmp-{pid}-{random}`."""
    return f".tmp-{os.getpid()}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", *, fsync: bool = False, encoding: str | None = None):
    """Yield a file object (`mode` "w" or "wb") whose content replaces `path` when the block
    ends; on an exception `path` is left as it was and the temporary is removed. `fsync`: the
    content is on disk before the rename (a crash then leaves the old file or the new one)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode {mode!r}, expected 'w' or 'wb'")
    tmp = path + staging_tag()
    try:
        with open(tmp, mode.replace("w", "x"), encoding=encoding) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if isinstance(err, OSError) and err.filename is None:  # a failed write (a full disk) names no file
            raise OSError(err.errno, err.strerror, path) from None
        raise
