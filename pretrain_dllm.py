"""Pretrain a DiT language model of any family with megatron-core.

    torchrun --nproc-per-node 2 pretrain_dllm.py --family mdlm        # embedded demo corpus
    torchrun --nproc-per-node 8 pretrain_dllm.py --family mdlm --preset 1.7B --bf16 \
        --data-path PREFIX --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model ...
"""
import sys

from megatron_dllm.arguments import parse_args


def main(argv=None) -> None:
    args = parse_args(argv)
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
