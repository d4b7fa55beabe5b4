"""Generate samples from a megatron_dllm checkpoint (any TP/PP layout) or an exported HF directory.

A shim for `megatron_dllm.cli.sample` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.sample import main

if __name__ == "__main__":
    sys.exit(main())
