"""Bad input to any command is one `error: ...` line naming the flag or file, exit code 2, and no
usage block: unknown flags for every command (run in process through its shim's `main(argv)`),
evaluate's --limit, relaunch's configuration file, --yaml-cfg files, and refresh_constraints --help."""
import os
import runpy

import pytest
from conftest import REPO

BAD = "--no-such-flag"

# each command's shim, with just the arguments it requires, so the unknown flag is the only fault
COMMANDS = {
    "pretrain_dllm.py": [],
    "tools/build_indexes.py": [],
    "tools/chaos_resume.py": ["--work", "w"],
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


@pytest.mark.parametrize("command, argv, message", [
    ("tools/convert_to_hf.py", ["--load", "l", "--out", "o", "--seq-length", "-5"], "--seq-length: expected a"),
    ("tools/convert_to_hf.py", ["--load", "l", "--out", "o", "--seq-length", "0"], "--seq-length: expected a positive"),
    ("tools/convert_from_hf.py", ["--hf", "h", "--save", "s", "--iteration", "-1"], "--iteration: expected an integer"),
    ("tools/convert_from_hf.py", ["--hf", "h", "--save", "s", "--tensor-model-parallel-size", "0"],
     "--tensor-model-parallel-size: expected a positive integer"),
    ("tools/convert_from_hf.py", ["--hf", "h", "--save", "s", "--make-vocab-size-divisible-by", "0"],
     "--make-vocab-size-divisible-by: expected a positive integer"),
    ("tools/preprocess_data.py", ["--input", "a.jsonl", "--output-prefix", "o", "--chunksize", "-5"],
     "--chunksize: expected a positive integer"),
    ("tools/preprocess_data.py", ["--input", "a.jsonl", "--output-prefix", "o", "--chunk-bytes", "-1"],
     "--chunk-bytes: expected a positive integer"),
    ("tools/inspect_dataset.py", ["prefix", "--sample-tokens", "-5"], "--sample-tokens: expected a positive integer"),
    ("tools/inspect_dataset.py", ["prefix", "--vocab-size", "0"], "--vocab-size: expected a positive integer"),
    ("tools/chaos_resume.py", ["--work", "w", "--train-iters", "0"], "--train-iters must be positive"),
    ("tools/chaos_resume.py", ["--work", "/dev/null/w"], "--work /dev/null/w: cannot be made a directory"),
])
def test_a_value_out_of_range_is_refused_before_anything_runs(command, argv, message, capsys, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_error(capsys, lambda: _run(command, argv))
    assert message in line and os.listdir(tmp_path) == []


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


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-2"])
def test_evaluate_downstream_limit_must_be_a_positive_finite_number_at_parse_time(value, capsys, monkeypatch):
    from megatron_dllm.cli import evaluate

    loaded = []
    monkeypatch.setattr(evaluate, "_check_load", loaded.append)  # nothing past parsing may run
    code = evaluate.main(["downstream", "--load", "ckpt", "--tasks", "piqa", "--limit", value])
    (line,) = capsys.readouterr().err.splitlines()
    assert code == 2 and not loaded
    assert line.startswith("error: ") and "argument --limit: expected a positive finite number" in line


def _yaml(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def _one_error(capsys, call) -> str:
    """The one stderr line of `call()`, which must end with exit code 2."""
    try:
        code = call()
    except SystemExit as exit_:
        code = exit_.code
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines)
    return lines[0]


@pytest.mark.parametrize("text, message", [
    (b"launch:\n  world-size: 2\npreset: \xff\xfe cpu\n", ":3: not UTF-8 text"),
    ("launch: 4\n", "launch: expected a mapping such as `launch: {world-size: 2}`, got int"),
    ("launch: [2]\n", "launch: expected a mapping such as `launch: {world-size: 2}`, got list"),
    ("- launch\n", "expected a mapping of flag names to values, found list"),
    ("launch:\n  world-size: 0\n", ":2: launch: world-size must be a positive integer, got 0"),
    ("launch:\n  world-size: -2\n", ":2: launch: world-size must be a positive integer, got -2"),
    ("launch:\n  world-size: 2.5\n", ":2: launch: world-size must be a positive integer, got 2.5"),
    ("launch:\n  world-size: two\n", ":2: launch: world-size must be a positive integer, got 'two'"),
    ("launch:\n  world-size: true\n", ":2: launch: world-size must be a positive integer, got True"),
    ("launch:\n  world-size: [\n", ":3: not valid YAML"),
    ("launch:\n  world-size: 2\n  directory: runs\n", ":3: launch: directory must be an absolute path, got 'runs'"),
])
def test_relaunch_refuses_a_bad_configuration_in_one_line_naming_the_file(tmp_path, capsys, text, message):
    from megatron_dllm.cli import relaunch

    path = _yaml(tmp_path, text)
    line = _one_error(capsys, lambda: relaunch.main([path, "--dry-run"]))
    assert line.startswith(f"error: {path}") and message in line, line


def test_relaunch_refuses_a_bad_nproc_per_node(tmp_path, capsys):
    from megatron_dllm.cli import relaunch

    path = _yaml(tmp_path, "launch:\n  world-size: 2\n")
    line = _one_error(capsys, lambda: relaunch.main([path, "--dry-run", "--nproc-per-node", "0"]))
    assert "argument --nproc-per-node: expected a positive integer, got 0" in line


def test_a_yaml_scalar_for_a_multi_value_flag_is_one_value(tmp_path):
    from megatron_dllm.config import parse_args, parse_flags

    path = _yaml(tmp_path, 'data-path: "my corpus/file_text_document"\nprofile-ranks: 3\n'
                           "tokenizer-type: SentencePieceTokenizer\ntokenizer-model: t.model\n")
    cfg = parse_args(["--yaml-cfg", path])
    assert cfg.data.data_path == ["my corpus/file_text_document"] and cfg.logging.profile_ranks == [3]
    listed = _yaml(tmp_path, "data-path: [0.7, /d/a, 0.3, /d/b]\n", "listed.yaml")  # several: a list
    assert parse_flags(["--yaml-cfg", listed]).data.data_path == ["0.7", "/d/a", "0.3", "/d/b"]


@pytest.mark.parametrize("text, message", [
    ("lr: 1.0e-3\noptimizer:\n  lr: 2.0e-3\n",
     ":3: 'lr' is given twice: at the top level (line 1) and in section optimizer (line 3)"),
    ("seq-length: 64\nmodel:\n  seq_length: 32\n",
     ":3: 'seq_length' is given twice: at the top level (line 1) and in section model (line 3)"),
    ("model:\n  preset: cpu-tiny\ntraining:\n  preset: cpu-small\n",
     ":4: 'preset' is given twice: in section model (line 2) and in section training (line 4)"),
    ("preset: cpu-tiny\npreset: cpu-small\n", ":2: 'preset' is given twice: at the top level (line 1) and at the "
                                              "top level (line 2)"),
    ("preset: cpu-tiny\nlr: [1, 2]\n", ":2: lr takes one value, got a list"),
    ("model:\n  preset: cpu-tiny\n  no-such-flag: 1\n", ":3: 'no_such_flag' is not a flag of this command"),
    (b"preset: cpu-tiny\n# \xe9t\xe9\n", ":2: not UTF-8 text (byte 19 is 0xe9)"),
    ("preset: [\n", ":2: not valid YAML"),
    # argparse would name only the flag, which the user never typed
    ("seq-length: abc\n", ":1: --seq-length: invalid value 'abc' (invalid literal for int()"),
    ("model:\n  attention-backend: flashy\n", ":2: --attention-backend: 'flashy' is not one of "),
])
def test_a_bad_yaml_config_is_one_error_naming_the_file_and_line(tmp_path, capsys, text, message):
    from megatron_dllm.config import parse_args

    path = _yaml(tmp_path, text)
    line = _one_error(capsys, lambda: parse_args(["--yaml-cfg", path]))
    assert f"--yaml-cfg {path}{message}" in line, line


def test_a_second_yaml_cfg_is_refused_naming_both(tmp_path, capsys):
    from megatron_dllm.config import parse_args

    a, b = _yaml(tmp_path, "preset: cpu-tiny\n", "a.yaml"), _yaml(tmp_path, "lr: 1.0e-3\n", "b.yaml")
    line = _one_error(capsys, lambda: parse_args(["--yaml-cfg", a, "--yaml-cfg=" + b]))
    assert f"--yaml-cfg given 2 times ({a}, {b}); give one file" in line


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe\x00binary", ":1: not UTF-8 text (byte 0 is 0xff)"),
    (b"[1, 2]\n", ": expected a JSON object of settings, found list"),
    (b'{"model_type": "dllm",\n "family": }\n', ": not valid JSON (Expecting value at line 2, column 12)"),
    (b'{"model_type": "bert"}\n', ": model_type 'bert', expected 'dllm'"),
])
@pytest.mark.parametrize("command", ["tools/convert_from_hf.py", "tools/sample.py"])
def test_a_bad_config_json_is_one_error_naming_the_file_and_line(tmp_path, capsys, monkeypatch, command, content,
                                                                 message):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(content)
    (hf / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    argv = ["--hf", str(hf), "--save", str(tmp_path / "ckpt")] if "convert" in command else ["--load", str(hf)]
    line = _one_error(capsys, lambda: _run(command, argv))
    assert f"{argv[0]} {hf / 'config.json'}{message}" in line, line
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("command", ["sample", "evaluate nelbo", "evaluate gsm8k", "evaluate downstream"])
def test_an_existing_result_file_is_refused_before_the_work(tmp_path, capsys, command):
    """Only --overwrite replaces a result; the check comes before the model is loaded (here: a
    --load that does not exist is reported only once the result file is allowed)."""
    from megatron_dllm.cli import evaluate, sample

    main = sample.main if command == "sample" else evaluate.main
    flag = {"evaluate gsm8k": "--predictions", "evaluate downstream": "--output-path"}.get(command, "--output")

    def argv(path, *more):
        return [*command.split()[1:], "--load", str(tmp_path / "nowhere"), flag, str(path), *more,
                *(["--tasks", "arc_easy"] if command == "evaluate downstream" else [])]

    result = tmp_path / "result.json"
    result.write_text("earlier results\n")
    assert _one_error(capsys, lambda: main(argv(result))) == (
        f"error: {flag} {result} already exists; pass --overwrite to replace it")
    assert "nowhere" in _one_error(capsys, lambda: main(argv(result, "--overwrite")))
    assert result.read_text() == "earlier results\n"
    for bad, why in [(tmp_path, "a directory, expected a file name"), (result / "x.json", "cannot make its directory")]:
        assert _one_error(capsys, lambda bad=bad: main(argv(bad))).startswith(f"error: {flag} {bad}: {why}")


def test_two_outputs_in_one_file_or_an_existing_table_are_refused_before_the_work(tmp_path, capsys):
    """One output would silently replace the other (lm-eval's results by the summary, GSM8K's
    predictions by the summary); the markdown table beside --output-path is a result file too."""
    from megatron_dllm.cli import evaluate

    same = str(tmp_path / "same.json")
    load = ["--load", str(tmp_path / "nowhere")]
    assert _one_error(capsys, lambda: evaluate.main(["downstream", *load, "--tasks", "arc_easy", "--output-path",
                                                     same, "--output", same])) == (
        f"error: --output-path {same}: the same file as --output; give each output a file of its own")
    assert _one_error(capsys, lambda: evaluate.main(["gsm8k", *load, "--predictions", same, "--output", same])) == (
        f"error: --predictions {same}: the same file as --output; give each output a file of its own")
    (tmp_path / "r.md").write_text("my notes\n")
    assert _one_error(capsys, lambda: evaluate.main(["downstream", *load, "--tasks", "arc_easy", "--output-path",
                                                     str(tmp_path / "r.json")])) == (
        f"error: --output-path (its .md table) {tmp_path / 'r.md'} already exists; pass --overwrite to replace it")
    assert (tmp_path / "r.md").read_text() == "my notes\n"


def test_a_result_file_is_renamed_into_place_complete(tmp_path, monkeypatch):
    from megatron_dllm import result_files

    path = tmp_path / "r.json"
    result_files.write_result_file(str(path), "one\n")
    assert path.read_text() == "one\n" and os.listdir(tmp_path) == ["r.json"]

    def fails(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(result_files.os, "replace", fails)  # the write fails before the rename
    with pytest.raises(OSError):
        result_files.write_result_file(str(path), "two\n")
    assert path.read_text() == "one\n" and os.listdir(tmp_path) == ["r.json"]  # the old one, no temporary
