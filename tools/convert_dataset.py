"""Convert a packed corpus of another stack (lit-gpt/TinyLlama "LITPKDS") into Megatron `.bin/.idx`.

A shim for `megatron_dllm.cli.convert_dataset` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.convert_dataset import main

if __name__ == "__main__":
    sys.exit(main())
