"""The paper's SFT learning-rate grid: fine-tune per (lr, min-lr) pair, score GSM8K, tabulate

A shim for `megatron_dllm.cli.sft_lr_grid` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.sft_lr_grid import main

if __name__ == "__main__":
    sys.exit(main())
