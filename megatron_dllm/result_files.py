"""The commands' result files (samples, evaluation records, predictions, lm-eval results): an
existing one is written over only when asked, and none is ever seen half-written."""
from __future__ import annotations

import os

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.errors import InputError


def check_result_file(path: str, flag: str, overwrite: bool) -> None:
    """Before the work: `path` is a new file (or `overwrite`), in a directory that exists or can be made."""
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: a directory, expected a file name")
    if os.path.exists(path) and not overwrite:
        raise InputError(f"{flag} {path} already exists; pass --overwrite to replace it")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise InputError(f"{flag} {path}: cannot make its directory ({err.strerror or err})") from None
    if not os.access(directory, os.W_OK):
        raise InputError(f"{flag} {path}: its directory {directory} is not writable")


def write_result_file(path: str, text: str) -> None:
    """`text` into `path` through a temporary beside it, renamed into place once complete."""
    with atomic_write(path) as f:
        f.write(text)
