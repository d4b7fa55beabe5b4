"""What the benchmarks' command lines share: the round and thread flags of the sampling and
evaluation benchmarks (threads set before anything runs), a wall and CPU timer, the writing of
their figures (JSON with the flags that produced them; markdown tables printed and, on request,
saved), and the fence around calls into the paper's code."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help shows the benchmark's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_args(ap: argparse.ArgumentParser, *, repeats: int = 3, threads: int = 1) -> argparse.Namespace:
    """`ap`'s flags plus --repeats, --threads and --json; sets torch's intra-op threads."""
    import torch

    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def existing_dir(path: str) -> str:
    """argparse type of a --dir flag: an existing directory (one usage error, not mkdtemp's traceback)."""
    import os

    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not an existing directory")
    return path


def timed(fn, *args, **kwargs):
    """(wall s, CPU s of this process, result) of `fn(*args, **kwargs)`. With one torch thread on a shared machine
    the CPU time is the figure that other processes' load does not inflate."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, time.process_time() - cpu, out


def write_json(args: argparse.Namespace, **figures) -> None:
    """`figures` and the flags to --json, if it was given."""
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), **figures}, fh, indent=1)


def publish(lines: list[str], path: str | None) -> None:
    """Print the markdown `lines`, and write them to `path` too if given."""
    text = "\n".join(lines)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


class PaperFailed(Exception):
    """The paper's code raised, and not for lack of memory. The benchmarks that run it beside ours
    note the error in the paper's row and go on: code the user brings must not cost a GPU session
    the rest of its figures."""


@contextlib.contextmanager
def papers_code():
    """Around a call into the paper's code: its errors become `PaperFailed` (traceback to stderr);
    running out of memory stays what it is, for the batch search to halve."""
    from megatron_dllm import platform

    try:
        yield
    except PaperFailed:
        raise
    except Exception as err:
        if platform.is_out_of_memory(err):
            raise
        traceback.print_exc(file=sys.stderr)
        raise PaperFailed(f"the paper's code failed: {table_cell_error(err)}") from err


def table_cell_error(err: BaseException) -> str:
    """`err` as one line of at most about 300 characters that fits a markdown table cell."""
    message = " ".join(str(err).split())
    message = message if len(message) <= 300 else message[:297] + "..."
    return f"{type(err).__name__}: {message}".replace("|", "/")
