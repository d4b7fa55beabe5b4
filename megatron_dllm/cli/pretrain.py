"""Pretrain a DiT language model of any family with megatron-core.

    torchrun --nproc-per-node 2 pretrain_dllm.py --family mdlm        # embedded demo corpus
    torchrun --nproc-per-node 8 pretrain_dllm.py --family mdlm --preset 1.7B --bf16 \\
        --data-path PREFIX --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model ...
"""
from __future__ import annotations

import os
import sys

from megatron_dllm.parent_watch import exit_when_parent_dies


def watch_torchrun() -> None:
    """torchrun's ranks stop when torchrun dies (the watch starts once per process)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_when_parent_dies("training rank")


watch_torchrun()  # from here, before the imports and the parsing below (seconds on a loaded machine)

from megatron_dllm import platform  # noqa: E402  (before megatron-core: on CPU it quiets its fallback warnings)
from megatron_dllm.cli import reports_bad_input  # noqa: E402
from megatron_dllm.config import parse_args  # noqa: E402

NONFINITE_EXIT = 3  # a scheduler's resubmit loop must not restart a diverged run


def main(argv=None) -> int:
    watch_torchrun()  # a rank forked from a process that imported this module (the tests' prewarmed launcher)
    config = parse_args(argv)
    note = platform.cpu_fallback_note()
    if note and os.environ.get("RANK", "0") == "0":  # once per run, not per rank
        print(note, flush=True)
    try:
        return _train(config)
    finally:
        platform.destroy_distributed()


@reports_bad_input()
def _train(config) -> int:
    from megatron_dllm.training.nan_guard import NonFiniteStop
    from megatron_dllm.training.trainer import Trainer

    try:
        Trainer(config).train()
    except NonFiniteStop as err:  # not bad input: the run diverged (its last good state is saved)
        print(f"error: {err}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT
    return 0
