"""Import a Hugging Face directory written by tools/convert_to_hf.py back into a megatron_dllm

A shim for `megatron_dllm.cli.convert_from_hf` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.convert_from_hf import main

if __name__ == "__main__":
    sys.exit(main())
