"""Precompute the dataset index caches a training run needs, so that training starts without

A shim for `megatron_dllm.cli.build_indexes` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.build_indexes import main

if __name__ == "__main__":
    sys.exit(main())
