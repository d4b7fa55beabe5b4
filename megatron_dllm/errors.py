"""The exception type for bad input, and two file helpers that word it (`not_a_file`, `read_text`).

A flag, a file, a dataset or a checkpoint that the user can fix raises `InputError`; the commands
print its message as one `error: ...` line and exit 2. Every other exception is a bug and keeps
its traceback (exit 1). `InputError` is a ValueError, so code that catches ValueError still does.
"""
import os


class InputError(ValueError):
    """Bad input the user can fix; the message names the flag or file."""


def not_a_file(path: str) -> str:
    """Why `path`, expected to be a file, is not one: a directory there, or nothing."""
    return "a directory, not a file" if os.path.isdir(path) else "no such file"


def read_text(path: str, at) -> str:
    """The UTF-8 text of file `path`; InputError for a file that cannot be read or is not UTF-8,
    its place named by `at(line)` (line None where there is none)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise InputError(f"{at(None)}: cannot read it ({err.strerror or err})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:  # a binary file: a parser would report it without its name
        line = raw[:err.start].count(b"\n") + 1
        raise InputError(f"{at(line)}: not UTF-8 text (byte {err.start} is {raw[err.start]:#04x})") from None
