"""Tokenize JSONL (plain, .gz, .zst), Parquet or plain text into Megatron `.bin/.idx`

A shim for `megatron_dllm.cli.preprocess_data` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
