"""Fit the paper's scaling laws and speed-quality frontier from finished runs; write figures and a

A shim for `megatron_dllm.cli.scaling_laws` (also installed as a console script); see its --help."""
import os
import sys

# the checkout's package, installed or not (as Megatron-LM's tools/ scripts find theirs)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_dllm.cli.scaling_laws import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
