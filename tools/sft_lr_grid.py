"""The paper's SFT learning-rate grid: fine-tune per (lr, min-lr) pair, score GSM8K, tabulate

A shim for `megatron_dllm.cli.sft_lr_grid` (also installed as a console script); see its --help."""
import os
import sys

# the checkout's package, installed or not (as Megatron-LM's tools/ scripts find theirs)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_dllm.cli.sft_lr_grid import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
