"""Export a megatron_dllm checkpoint (any TP/PP layout) to a Hugging Face directory.

A shim for `megatron_dllm.cli.convert_to_hf` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.convert_to_hf import main

if __name__ == "__main__":
    sys.exit(main())
