"""Bad input to any command is one `error: ...` line naming the flag or file, exit code 2, and no
usage block: unknown flags for every command (run in process through its shim's `main(argv)`),
evaluate's --limit, relaunch's configuration file, --yaml-cfg files, and refresh_constraints --help."""
import os
import runpy

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = "--no-such-flag"

# each command's shim, with just the arguments it requires, so the unknown flag is the only fault
COMMANDS = {
    "pretrain_dllm.py": [],
    "tools/build_indexes.py": [],
    "tools/convert_dataset.py": ["--from", "litpkds", "in.bin"],
    "tools/convert_from_hf.py": ["--hf", "h", "--save", "s"],
    "tools/convert_from_ref.py": ["--ref", "r", "--save", "s"],
    "tools/convert_to_hf.py": ["--load", "l", "--out", "o"],
    "tools/evaluate.py nelbo": ["nelbo", "--load", "l"],
    "tools/evaluate.py gen-ppl": ["gen-ppl", "--samples", "s", "--judge", "j"],
    "tools/evaluate.py throughput": ["throughput", "--load", "l", "--steps", "4"],
    "tools/evaluate.py downstream": ["downstream", "--load", "l", "--tasks", "piqa"],
    "tools/evaluate.py gsm8k": ["gsm8k", "--load", "l"],
    "tools/inspect_dataset.py": ["prefix"],
    "tools/merge_datasets.py": ["--input", "a", "--output-prefix", "o"],
    "tools/model_info.py": ["--preset", "14M"],
    "tools/plan_isoflop.py": [],
    "tools/preprocess_data.py": ["--input", "a.jsonl", "--output-prefix", "o"],
    "tools/preprocess_sft_data.py": ["--input", "a.jsonl", "--output-prefix", "o", "--seq-length", "8"],
    "tools/refresh_constraints.py": [],
    "tools/relaunch.py": ["run.yaml"],
    "tools/sample.py": ["--load", "l"],
    "tools/scaling_laws.py": ["--manifest", "m.json", "--out-dir", "o"],
    "tools/sft_lr_grid.py": ["print", "--run-dir", "r"],
    "tools/verify_checkpoint.py": ["ckpt"],
}


def _run(script: str, argv: list[str]) -> int:
    """`main(argv)` of a shim (tools/refresh_constraints.py is its own), as `python script` runs it."""
    main = runpy.run_path(os.path.join(REPO, script))["main"]
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_every_command_is_covered():
    shims = {f"tools/{n}" for n in os.listdir(os.path.join(REPO, "tools")) if n.endswith(".py")}
    assert shims | {"pretrain_dllm.py"} == {c.split()[0] for c in COMMANDS}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unknown_flag_is_one_error_line_naming_it(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a command might write lands in the repository
    code = _run(command.split()[0], COMMANDS[command] + [BAD])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and BAD in lines[0]


def test_refresh_constraints_help_prints_help_and_changes_nothing(tmp_path, capsys, monkeypatch):
    import importlib.util
    import subprocess
    import sys

    spec = importlib.util.spec_from_file_location("refresh_constraints", os.path.join(REPO, "tools",
                                                                                     "refresh_constraints.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "constraints.txt").write_text("torch==2.13.0\n")
    monkeypatch.setattr(module, "REPO", str(tmp_path))  # never the repository's own constraints.txt
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a) or pytest.fail("pip was started"))
    monkeypatch.setattr(sys, "argv", ["refresh_constraints.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0 and not started
    assert "usage:" in capsys.readouterr().out
    assert (tmp_path / "constraints.txt").read_text() == "torch==2.13.0\n"
