"""How commands end on an error, in real subprocesses: bad input is one `error: ...` line and exit
code 2; a bug (any other exception) keeps its traceback and exits 1; `--debug` or
MEGATRON_DLLM_DEBUG=1 adds the traceback to bad input as well; a Ctrl-C is the one line
`interrupted` and exit code 130."""
import os
import subprocess
import sys

import pytest
from conftest import REPO, REPO_PYTHONPATH

TRACEBACK = "Traceback (most recent call last)"


def _run(argv: list[str], debug_env: str | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGV...`, or `python -c CODE ARGV...` (CODE injects a fault, then runs a main)."""
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_DLLM_DEBUG"}
    env["PYTHONPATH"] = REPO_PYTHONPATH
    if debug_env is not None:
        env["MEGATRON_DLLM_DEBUG"] = debug_env
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("mode", ["plain", "env-0", "--debug", "env-1"])
def test_bad_input_is_one_line_unless_debugging(mode, tmp_path):
    prefix = str(tmp_path / "missing")
    argv = [os.path.join(REPO, "tools", "inspect_dataset.py"), prefix] + (["--debug"] if mode == "--debug" else [])
    proc = _run(argv, debug_env={"env-0": "0", "env-1": "1"}.get(mode))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[-1].startswith("error: ") and f"{prefix}.idx" in lines[-1]
    if mode in ("plain", "env-0"):
        assert len(lines) == 1, lines
    else:  # the traceback, down to the raise site of the bad-input error, then the same one line
        assert lines[0].startswith(TRACEBACK) and "DatasetFormatError" in lines[-2], lines
        assert "megatron_dllm/data/indexed_dataset.py" in proc.stderr


def test_debug_shows_the_traceback_of_pretrains_bad_flag_file(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    argv = [os.path.join(REPO, "pretrain_dllm.py"), "--yaml-cfg", missing]
    plain, debug = _run(argv), _run(argv + ["--debug"])
    assert plain.returncode == debug.returncode == 2
    assert plain.stderr.splitlines() == [f"error: --yaml-cfg {missing}: cannot read it (No such file or directory)"]
    assert debug.stderr.startswith(TRACEBACK) and "yaml_config.py" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.strip()


# A bug: an exception that is not bad input, raised where the command's real work runs.
INJECT_INTO_TRAINING = """
import sys
from megatron_dllm.cli.pretrain import main  # first, as pretrain_dllm.py imports it
import megatron_dllm.training.trainer as trainer

class Trainer:
    def __init__(self, cfg):
        raise ValueError("an injected bug")

trainer.Trainer = Trainer
sys.exit(main(sys.argv[1:]))
"""

INJECT_INTO_INSPECT = """
import sys
import megatron_dllm.cli.inspect_dataset as command

def describe_dataset(*args, **kwargs):
    raise KeyError("an injected bug")

command.describe_dataset = describe_dataset
sys.exit(command.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("code, argv", [(INJECT_INTO_TRAINING, ["--family", "mdlm", "--train-iters", "1"]),
                                        (INJECT_INTO_INSPECT, ["prefix"])], ids=["pretrain", "inspect_dataset"])
def test_a_bug_keeps_its_traceback_and_exits_1(code, argv, tmp_path):
    proc = _run(argv, code=code)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines[0].startswith(TRACEBACK), lines
    assert lines[-1] in ("ValueError: an injected bug", "KeyError: 'an injected bug'")
    assert not any(line.startswith("error: ") for line in lines), lines  # not reported as bad input


INJECT_CTRL_C_INTO_MERGE = """
import sys
import megatron_dllm.cli.merge_datasets as command

def expand_prefixes(*args, **kwargs):
    raise KeyboardInterrupt

command.expand_prefixes = expand_prefixes
sys.exit(command.main(sys.argv[1:]))
"""


def test_ctrl_c_in_a_commands_work_is_one_line_and_exit_130(tmp_path):
    proc = _run(["--input", str(tmp_path / "a"), "--output-prefix", str(tmp_path / "out")],
                code=INJECT_CTRL_C_INTO_MERGE)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == ["interrupted"]


INJECT_CTRL_C_INTO_EVALUATE = """
import sys
import megatron_dllm.cli.evaluate as command

def run_nelbo(args):
    raise KeyboardInterrupt

command.run_nelbo = run_nelbo
sys.exit(command.main(sys.argv[1:]))
"""


def test_ctrl_c_in_an_evaluation_is_one_line_and_exit_130(tmp_path):
    proc = _run(["nelbo", "--load", str(tmp_path)], code=INJECT_CTRL_C_INTO_EVALUATE)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == ["interrupted"]
