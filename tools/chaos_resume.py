"""Kill a 2-rank training run at random moments, restart it until it completes, and compare it
with an uninterrupted run bit for bit.

A shim for `megatron_dllm.cli.chaos_resume` (also installed as a console script); see its --help."""
import os
import sys

# the checkout's package, installed or not (as Megatron-LM's tools/ scripts find theirs)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_dllm.cli.chaos_resume import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
