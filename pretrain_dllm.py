"""Pretrain a DiT language model of any family with megatron-core.

    torchrun --nproc-per-node 2 pretrain_dllm.py --family mdlm        # embedded demo corpus
    torchrun --nproc-per-node 8 pretrain_dllm.py --family mdlm --preset 1.7B --bf16 \
        --data-path PREFIX --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model ...
"""
import os
import sys

from megatron_dllm.config import parse_args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's ranks stop when torchrun dies
        from megatron_dllm.parent_watch import exit_when_parent_dies

        exit_when_parent_dies("training rank")
    from megatron_dllm import platform
    from megatron_dllm.training.trainer import Trainer

    try:
        Trainer(args).train()
    except ValueError as err:  # bad input: one clear message, no traceback
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        platform.destroy_distributed()


if __name__ == "__main__":  # dist_checkpointing spawns workers: guard the entry point
    main()
