"""Re-launch a run from its resolved configuration: `python tools/relaunch.py DIR/run_config.yaml`.

A shim for `megatron_dllm.cli.relaunch` (also installed as a console script); see its --help."""
import sys

from megatron_dllm.cli.relaunch import main

if __name__ == "__main__":
    sys.exit(main())
