"""Pretrain a DiT language model of any family with megatron-core (Megatron-LM's entry-point name).

    torchrun --nproc-per-node 2 pretrain_dllm.py --family mdlm        # embedded demo corpus

A shim for `megatron_dllm.cli.pretrain` (also installed as `dllm-pretrain`); see its --help.
"""
import sys

from megatron_dllm.cli.pretrain import main

if __name__ == "__main__":  # dist_checkpointing spawns workers: guard the entry point
    sys.exit(main())
