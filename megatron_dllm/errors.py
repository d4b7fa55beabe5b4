"""The exception type for bad input.

A flag, a file, a dataset or a checkpoint that the user can fix raises `InputError`; the commands
print its message as one `error: ...` line and exit 2. Every other exception is a bug and keeps
its traceback (exit 1). `InputError` is a ValueError, so code that catches ValueError still does.
"""


class InputError(ValueError):
    """Bad input the user can fix; the message names the flag or file."""
