"""Inspect a Megatron `.bin/.idx` dataset: header, dtype, documents, tokens, document-length

A shim for `megatron_dllm.cli.inspect_dataset` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.inspect_dataset import main

if __name__ == "__main__":
    sys.exit(main())
