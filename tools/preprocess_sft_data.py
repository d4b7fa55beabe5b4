"""Tokenize prompt/response examples into the SFT format (.bin/.idx rows + prompt mask)

A shim for `megatron_dllm.cli.preprocess_sft` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.preprocess_sft import main

if __name__ == "__main__":
    sys.exit(main())
