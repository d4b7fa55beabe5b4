"""Kill a 2-rank training run at random moments, restart it until it completes, and compare it
with an uninterrupted run bit for bit.

A shim for `megatron_dllm.cli.chaos_resume` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.chaos_resume import main

if __name__ == "__main__":
    sys.exit(main())
