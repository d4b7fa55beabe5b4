"""Flags in a YAML file (--yaml-cfg run.yaml), and the resolved configuration every run writes.

The file maps flag names (`seq-length` or `seq_length`) to values, either at the top level or
under group sections as the resolved file writes them (`model: {preset: 1.7B}`). Its values are
turned into command-line tokens placed before the real command line, so they pass the very same
checks, and a flag given on the command line overrides the file's.

    family: mdlm
    preset: 1.7B
    bf16: true
    data-path: [0.7, /data/a_text_document, 0.3, /data/b_text_document]

Every run writes its resolved configuration (defaults filled, --train-flops turned into
--train-iters) as `run_config.yaml` beside its checkpoints and logs, with its world size under
`launch:` (not a flag; --yaml-cfg skips it): `tools/relaunch.py` or `--yaml-cfg` of that file
re-launches the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import yaml

RESOLVED_NAME = "run_config.yaml"
LAUNCH = "launch"  # the resolved file's record of how the run was launched: not flags
# resolved into --train-iters (and --data-path) by the run: writing both would be contradictory
_RESOLVED_AWAY = {"training": ("train_samples", "train_flops"), "data": ("train_data_path",)}


def add_yaml_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yaml-cfg", dest="yaml_cfg", default=None,
                        help="a YAML file of flags (command-line flags override it); a run's own "
                             f"{RESOLVED_NAME} re-launches it")


def _flat(mapping: dict, path: str) -> dict:
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):  # a group section
            out.update(_flat(value, path))
        else:
            out[str(key).replace("-", "_")] = value
    return out


def yaml_tokens(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line tokens equivalent to the flags in `path`. Raises ValueError naming the
    file and the key for anything that is not a flag or not a value the flag can take."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ValueError(f"--yaml-cfg {path}: cannot read it ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--yaml-cfg {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--yaml-cfg {path}: expected a mapping of flag names to values, found "
                         f"{type(data).__name__}")
    data = {k: v for k, v in data.items() if k != LAUNCH}
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    tokens = []
    for key, value in _flat(data, path).items():
        action = actions.get(key)
        if action is None or key == "yaml_cfg":
            raise ValueError(f"--yaml-cfg {path}: {key!r} is not a flag of this command")
        option = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ValueError(f"--yaml-cfg {path}: {key} is a switch; expected true or false, got {value!r}")
            tokens += [option] if value else []
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            if action.nargs not in ("*", "+"):
                raise ValueError(f"--yaml-cfg {path}: {key} takes one value, got a list")
            tokens += [option, *map(str, value)]
        elif isinstance(value, dict):
            raise ValueError(f"--yaml-cfg {path}: {key}: expected a value, got a mapping")
        else:
            tokens += [option, *([str(value)] if action.nargs not in ("*", "+") else str(value).split())]
    return tokens


def expand_yaml(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with `--yaml-cfg FILE` replaced by the file's flags in front (so argv wins)."""
    pre = argparse.ArgumentParser(add_help=False)
    add_yaml_flag(pre)
    known, rest = pre.parse_known_args(argv)
    if known.yaml_cfg is None:
        return list(argv)
    return yaml_tokens(known.yaml_cfg, parser) + rest


def resolved_dict(cfg) -> dict:
    """The run's flags by group, as `--yaml-cfg` reads them back (None values left out)."""
    out = {}
    for group in dataclasses.fields(cfg):
        values = dataclasses.asdict(getattr(cfg, group.name))
        skip = _RESOLVED_AWAY.get(group.name, ())
        out[group.name] = {k.replace("_", "-"): list(v) if isinstance(v, tuple) else v
                           for k, v in values.items() if v is not None and k not in skip}
    return out


def write_resolved(cfg, directories: list[str], world_size: int | None = None) -> list[str]:
    """Write the resolved configuration as RESOLVED_NAME into each directory (temp name, then
    rename, so a reader never sees half a file), with the launch's world size in a `launch`
    section that --yaml-cfg skips; returns the paths written."""
    launch = {LAUNCH: {"world-size": world_size}} if world_size else {}
    text = ("# the resolved configuration of this run; re-launch with: tools/relaunch.py THIS_FILE\n"
            + yaml.safe_dump({**resolved_dict(cfg), **launch}, sort_keys=False))
    written = []
    for directory in dict.fromkeys(d for d in directories if d):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, RESOLVED_NAME)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        written.append(path)
    return written
