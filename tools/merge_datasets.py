"""Merge Megatron `.bin/.idx` datasets (e.g. the shards of tools/preprocess_data.py) into one.

A shim for `megatron_dllm.cli.merge_datasets` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.merge_datasets import main

if __name__ == "__main__":
    sys.exit(main())
