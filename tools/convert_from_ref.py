"""Import a checkpoint of the paper's code (Lightning .ckpt or hub-mixin directory).

A shim for `megatron_dllm.cli.convert_from_ref` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.convert_from_ref import main

if __name__ == "__main__":
    sys.exit(main())
