"""Rewrite constraints.txt: the exact versions pip resolves today for the package and its test
extra, so every fresh install (the README's commands, CI) gets the set the suite passed with.

    python tools/refresh_constraints.py        # then run the full test suite and commit both

Run it on purpose (to take new releases), never as part of an install. It resolves from scratch
(--ignore-installed, without the current pins) and writes every package but this one.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from megatron_dllm.cli import OneLineParser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"  # the README's pin; its CPU build comes from the local index
HEADER = ("# Exact versions for `pip install -c constraints.txt ...` (README, .ci/run).\n"
          "# Regenerate with `python tools/refresh_constraints.py`, then run the full test suite.\n")


def main(argv=None) -> int:
    # no flags, but --help must only print this, and a stray flag must not rewrite the pins
    OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        env = {**os.environ, "PIP_CONSTRAINT": ""}  # resolve afresh, not from the pins being replaced
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", report, TORCH, "-e", f"{REPO}[test]"], check=True, env=env)
        with open(report) as f:
            installs = json.load(f)["install"]
    pins = sorted((i["metadata"]["name"], i["metadata"]["version"].split("+")[0]) for i in installs
                  if i["metadata"]["name"].replace("_", "-") != "megatron-dllm")
    with open(os.path.join(REPO, "constraints.txt"), "w") as f:
        f.write(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins, key=lambda p: p[0].lower())))
    print(f"wrote constraints.txt: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
