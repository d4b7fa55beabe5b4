"""Pretrain a DiT language model of any family with megatron-core.

    torchrun --nproc-per-node 2 pretrain_dllm.py --family mdlm        # embedded demo corpus
    torchrun --nproc-per-node 8 pretrain_dllm.py --family mdlm --preset 1.7B --bf16 \\
        --data-path PREFIX --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model ...
"""
from __future__ import annotations

import os

from megatron_dllm.cli import reports_bad_input
from megatron_dllm.config import parse_args


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's ranks stop when torchrun dies
        from megatron_dllm.parent_watch import exit_when_parent_dies

        exit_when_parent_dies("training rank")
    from megatron_dllm import platform

    try:
        return _train(cfg)
    finally:
        platform.destroy_distributed()


@reports_bad_input(ValueError)
def _train(cfg) -> int:
    from megatron_dllm.training.trainer import Trainer

    Trainer(cfg).train()
    return 0
