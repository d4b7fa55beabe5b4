"""Sizes of a model preset: `python tools/model_info.py --preset 1.7B --vocab-size 32001 --json`.

A shim for `megatron_dllm.cli.model_info` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.model_info import main

if __name__ == "__main__":
    sys.exit(main())
