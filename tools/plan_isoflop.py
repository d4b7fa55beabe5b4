"""Plan an IsoFLOP sweep (paper §3.1): every budget x family x preset, its iterations and tokens.

A shim for `megatron_dllm.cli.plan_isoflop` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.plan_isoflop import main

if __name__ == "__main__":
    sys.exit(main())
