"""Check a checkpoint's files against its manifest (sizes and SHA-256), without loading anything.

A shim for `megatron_dllm.cli.verify_checkpoint` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.verify_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
