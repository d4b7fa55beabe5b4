"""Command-line entry points: one module per command, each with `main(argv=None) -> int`.

Installed as console scripts (setup.py) and reachable through the thin shims `pretrain_dllm.py`
and `tools/*.py`, so Megatron users' habits and every documented command keep working:

    dllm-pretrain        pretrain_dllm.py              train any family (torchrun)
    dllm-preprocess      tools/preprocess_data.py      text -> Megatron .bin/.idx
    dllm-merge           tools/merge_datasets.py       join shards / datasets
    dllm-convert-dataset tools/convert_dataset.py      lit-gpt/TinyLlama packed files -> Megatron .bin/.idx
    dllm-inspect         tools/inspect_dataset.py      summarise and verify a dataset
    dllm-build-indexes   tools/build_indexes.py        build the sample/blend index caches ahead of training
    dllm-sample          tools/sample.py               generate from a checkpoint or HF export
    dllm-evaluate        tools/evaluate.py             NELBO, generative perplexity, throughput
    dllm-convert-to-hf   tools/convert_to_hf.py        checkpoint -> Hugging Face directory
    dllm-convert-from-hf tools/convert_from_hf.py      Hugging Face directory -> checkpoint
    dllm-convert-from-ref tools/convert_from_ref.py    the paper code's checkpoint -> checkpoint / HF
    dllm-verify-checkpoint tools/verify_checkpoint.py  check a checkpoint against its manifest
    dllm-chaos-resume    tools/chaos_resume.py         kill a run at random until done; compare bit for bit
    dllm-model-info      tools/model_info.py           parameters and FLOPs of a preset
    dllm-relaunch        tools/relaunch.py             re-launch a run from its run_config.yaml
    dllm-plan-isoflop    tools/plan_isoflop.py         the IsoFLOP run grid
    dllm-scaling-laws    tools/scaling_laws.py         fits, Pareto frontier, figures

Bad input is reported the same way everywhere: one `error: ...` line and exit code 2. Bad input is
an `InputError` (a flag, a file, a dataset or a checkpoint the user can fix) or an OSError (a missing,
unreadable, locked or full path). Any other exception is a bug: it propagates with its traceback
(exit code 1). `--debug` (every command) or MEGATRON_DLLM_DEBUG=1 adds the traceback to bad input too.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

from megatron_dllm.errors import InputError

BAD_INPUT_EXIT = 2
BAD_INPUT = (InputError, OSError)
DEBUG_ENV = "MEGATRON_DLLM_DEBUG"

_debug_flag = False  # set by any OneLineParser that parsed --debug


def debugging() -> bool:
    """Whether errors show their traceback: `--debug` was given or MEGATRON_DLLM_DEBUG is set (not 0)."""
    return _debug_flag or os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def fail(message: str) -> int:
    """Report bad input: one line on stderr (under --debug, after the traceback of the exception
    being handled); returns the exit code."""
    if debugging() and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr, flush=True)
    return BAD_INPUT_EXIT


BROKEN_PIPE_EXIT = 141  # the shell's code for a writer whose reader went away (128 + SIGPIPE)
INTERRUPTED_EXIT = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def interrupted() -> int:
    """Report a Ctrl-C in one line (the writers publish nothing unfinished); returns the exit code."""
    print("interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT


def reports_bad_input(*errors: type[BaseException]):
    """Decorate a command's `main`: bad input (InputError, OSError and any `errors` given) becomes
    `fail(str(err))`, a Ctrl-C one line, a closed stdout pipe silence; anything else is a bug and
    keeps its traceback."""
    caught = BAD_INPUT + errors

    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                code = main(*args, **kwargs)
                sys.stdout.flush()  # a reader gone away shows here, not as a traceback at exit
                return code
            except BrokenPipeError:  # `... | head`: the reader has what it wanted; no traceback at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return BROKEN_PIPE_EXIT
            except caught as err:
                return fail(str(err))
            except KeyboardInterrupt:
                return interrupted()
        return run
    return wrap


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (subcommands' too) are one `error: ...` line, exit code 2,
    without the usage block; every one accepts `--debug`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # SUPPRESS: a subcommand's parser leaves a --debug given before the subcommand alone
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help=f"show the traceback of any error, bad input included (or set {DEBUG_ENV}=1)")

    def parse_known_args(self, args=None, namespace=None):
        global _debug_flag
        namespace, rest = super().parse_known_args(args, namespace)
        # sticky: a pre-parser (--yaml-cfg's) may consume --debug before the command's own parser runs
        _debug_flag = _debug_flag or getattr(namespace, "debug", False)
        return namespace, rest

    def error(self, message):
        subcommand = self.prog.split()[-1] + ": " if " " in self.prog else ""
        sys.exit(fail(subcommand + message))
