"""Evaluate a megatron_dllm model: validation NELBO, generative perplexity, sampling throughput.

A shim for `megatron_dllm.cli.evaluate` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
