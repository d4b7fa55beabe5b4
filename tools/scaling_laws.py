"""Fit the paper's scaling laws and speed-quality frontier from finished runs; write figures and a

A shim for `megatron_dllm.cli.scaling_laws` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.scaling_laws import main

if __name__ == "__main__":
    sys.exit(main())
