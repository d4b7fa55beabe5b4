"""Flags in a YAML file (--yaml-cfg run.yaml), and the resolved configuration every run writes.

The file maps flag names (`seq-length` or `seq_length`) to values, either at the top level or
under group sections as the resolved file writes them (`model: {preset: 1.7B}`). Its values are
turned into command-line tokens placed before the real command line, so they pass the very same
checks, and a flag given on the command line overrides the file's. A scalar is one value, also
for a multi-value flag (a path may hold spaces); a flag given twice in the file, and a second
--yaml-cfg, are refused.

    family: mdlm
    preset: 1.7B
    bf16: true
    data-path: [0.7, /data/a_text_document, 0.3, /data/b_text_document]

Every run writes its resolved configuration (defaults filled, --train-flops turned into
--train-iters, every rule of config/validate.py checked) as `run_config.yaml` beside its
checkpoints and logs, with its world size under `launch:` (not a flag; --yaml-cfg skips it):
`tools/relaunch.py` or `--yaml-cfg` of that file re-launches the same run, and parses back to
the very configuration that was written.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import yaml

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.errors import InputError, read_text

RESOLVED_NAME = "run_config.yaml"
LAUNCH = "launch"  # the resolved file's record of how the run was launched: not flags


def add_yaml_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yaml-cfg", dest="yaml_cfg", default=None,
                        help="a YAML file of flags (command-line flags override it); a run's own "
                             f"{RESOLVED_NAME} re-launches it")


class YamlFile:
    """A --yaml-cfg file read whole: its top-level mapping as YAML nodes (which keep each key's
    line) and a loader to turn a value node into Python. Every error names the file, and the
    line where there is one."""

    def __init__(self, path: str, what: str | None = "--yaml-cfg"):
        self.path, self.what = path, what
        text = read_text(path, self.at)
        self._loader = yaml.SafeLoader(text)
        try:
            self.root = self._loader.get_single_node()
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise InputError(f"{self.at(mark.line + 1 if mark else None)}: not valid YAML ({problem})") from None
        if self.root is not None and not isinstance(self.root, yaml.MappingNode):
            raise InputError(f"{self.at(None)}: expected a mapping of flag names to values, found "
                             f"{type(self.value(self.root)).__name__}")

    def at(self, line: int | None) -> str:
        return (f"{self.what} " if self.what else "") + self.path + (f":{line}" if line else "")

    def value(self, node):
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            raise InputError(f"{self.at(node.start_mark.line + 1)}: {str(err).splitlines()[0]}") from None

    def items(self, node=None):
        """(key, key line, value node) of a mapping node (default: the top level)."""
        node = self.root if node is None else node
        for key, value in ([] if node is None else node.value):
            yield str(key.value), key.start_mark.line + 1, value

    def launch(self) -> dict:
        """The `launch:` section (what the run was started with; not flags), checked."""
        for key, line, node in self.items():
            if key == LAUNCH:
                if not isinstance(node, yaml.MappingNode):
                    raise InputError(f"{self.at(line)}: {LAUNCH}: expected a mapping such as `{LAUNCH}: "
                                     f"{{world-size: 2}}`, got {type(self.value(node)).__name__}")
                out = {}
                for name, name_line, value in self.items(node):
                    out[name] = self.value(value)
                    if name == "world-size" and not (type(out[name]) is int and out[name] > 0):
                        raise InputError(f"{self.at(name_line)}: {LAUNCH}: world-size must be a positive "
                                         f"integer, got {out[name]!r}")
                    if name == "directory" and not (isinstance(out[name], str) and os.path.isabs(out[name])):
                        raise InputError(f"{self.at(name_line)}: {LAUNCH}: directory must be an absolute path, "
                                         f"got {out[name]!r}")
                return out
        return {}

    def flags(self, sections=None) -> dict:
        """flag dest -> (value, its line, its node), from the top level and the group sections (`sections`:
        their names, if only those may appear). A flag given twice (top level and a section, or
        two sections) is refused, naming both."""
        out = {}

        def walk(node, section):
            for key, line, value in self.items(node):
                if section is None and key == LAUNCH:
                    continue
                if isinstance(value, yaml.MappingNode):  # a group section
                    if section is not None or (sections is not None and key not in sections):
                        raise InputError(f"{self.at(line)}: {key!r} is not a section of this command's flags"
                                         + (f" ({', '.join(sections)})" if sections else ""))
                    walk(value, key)
                    continue
                dest = key.replace("-", "_")
                place = f"in section {section} (line {line})" if section else f"at the top level (line {line})"
                if dest in places:
                    raise InputError(f"{self.at(line)}: {key!r} is given twice: {places[dest]} and {place}")
                places[dest], out[dest] = place, (self.value(value), line, value)

        places = {}
        walk(None, None)
        return out


def yaml_tokens(path: str, parser: argparse.ArgumentParser, sections=None, skip=frozenset(),
                superseded=None) -> list[str]:
    """The command-line tokens equivalent to the flags in `path` (`sections`: the group sections
    it may have; `skip`: flag dests left out; `superseded`: {dest: whether the file's flags show it
    unapplied}, read in a run's resolved file, for files an earlier version wrote). Raises InputError naming the file,
    the line and the key for anything that is not a flag or not a value the flag can take."""
    source = YamlFile(path)
    # a key is a flag's dest or any of its names (a Megatron-LM alias, the --no-x of a switch)
    names = {o.lstrip("-").replace("-", "_"): (a, o) for a in parser._actions for o in a.option_strings}
    names.update({a.dest: (a, a.option_strings[0]) for a in parser._actions if a.option_strings})
    tokens, keys = [], {}
    flags = source.flags(sections)
    resolved = bool(source.launch())  # a run's own run_config.yaml
    for key, (value, line, node) in flags.items():
        where = source.at(line)
        action, written = names.get(key, (None, None))
        if action is None or action.dest in ("yaml_cfg", "help"):
            raise InputError(f"{where}: {key!r} is not a flag of this command")
        if action.dest in keys:
            raise InputError(f"{where}: {key!r} is {action.option_strings[0]}, given already as {keys[action.dest]!r}")
        keys[action.dest] = key
        if action.dest in skip or (resolved and key in (superseded or {}) and superseded[key](flags)):
            continue
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(value, bool) \
                and written.startswith("--no-"):  # `no-x: true` is --no-x
            value = not value
        if value is None:  # `key:` with nothing after it: a forgotten value, never a default
            raise InputError(f"{where}: {option} has no value; give one, or leave the key out")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise InputError(f"{where}: {key} is a switch; expected true or false, got {value!r}")
            tokens += [option] if value else []
        elif isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            if not isinstance(value, bool):
                raise InputError(f"{where}: {key} is a switch; expected true or false, got {value!r}")
            tokens += [action.option_strings[0 if value else 1]]
        elif isinstance(value, (list, tuple)):
            if action.nargs not in ("*", "+"):
                raise InputError(f"{where}: {key} takes one value, got a list")
            flag_like = [str(v) for v in value if str(v).startswith("-")]
            if flag_like:  # the command line would read it as a flag
                raise InputError(f"{where}: {key}: the list element {flag_like[0]!r} starts with '-', which a "
                                 f"command line reads as a flag; give such a value as the flag's only value")
            value = [_as_written(n, v) for n, v in zip(node.value, value)]
            _check_values(action, value, f"{where}: {option}")
            tokens += [option, *value]
        else:  # a scalar is one value, also for a multi-value flag: a path may hold spaces, or start with -
            value = _as_written(node, value)
            _check_values(action, [value], f"{where}: {option}")
            tokens += [f"{option}={value}"]
    return tokens


def _as_written(node, value) -> str:
    """A value's text as the file writes it, as a command line would give it: YAML 1.1 would read
    `0755` as 493, `1.10` as 1.1 and `on` as True."""
    return node.value if isinstance(node, yaml.ScalarNode) else str(value)


def _check_values(action: argparse.Action, values, where: str) -> None:
    """Raises InputError naming the file and line where a value is not of the flag's type or choices
    (argparse would name only the flag, which the user never typed)."""
    for value in map(str, values):
        try:
            converted = action.type(value) if callable(action.type) else value
        except argparse.ArgumentTypeError as err:  # the flag's own check, which names the value
            raise InputError(f"{where}: {err}") from None
        except (TypeError, ValueError) as err:
            raise InputError(f"{where}: invalid value {value!r} ({err})") from None
        if action.choices is not None and converted not in action.choices:
            raise InputError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")


def _given(tokens: list[str], parser: argparse.ArgumentParser) -> set[str]:
    """The dests of the flags among command-line `tokens`."""
    dests = {option: a.dest for a in parser._actions for option in a.option_strings}
    return {dests[t.split("=", 1)[0]] for t in tokens if t.split("=", 1)[0] in dests}


def expand_yaml(argv: list[str], parser: argparse.ArgumentParser, sections=None, alternatives=(),
                superseded=None) -> list[str]:
    """`argv` with `--yaml-cfg FILE` replaced by the file's flags in front (so argv wins);
    `sections`: the group sections the file may have. `alternatives`: groups of flags that stand
    for one another (each group a tuple of alternatives, each a tuple of dests): an alternative
    given in argv displaces the file's others, which would otherwise clash with it; `superseded`:
    as `yaml_tokens`."""
    from megatron_dllm.cli import OneLineParser

    pre = OneLineParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--yaml-cfg", dest="yaml_cfg", action="append", default=[])
    known, rest = pre.parse_known_args(argv)
    if getattr(known, "debug", False):  # every OneLineParser takes it: left for the command's own
        rest.append("--debug")
    if len(known.yaml_cfg) > 1:  # which would win is not obvious: one file, flags override it
        raise InputError(f"--yaml-cfg given {len(known.yaml_cfg)} times ({', '.join(known.yaml_cfg)}); give one "
                         f"file, and override its values with flags")
    if not known.yaml_cfg:
        return list(argv)
    given = _given(rest, parser)
    skip = {dest for group in alternatives for chosen in group if given & set(chosen)
            for other in group if other is not chosen for dest in other}
    return yaml_tokens(known.yaml_cfg[0], parser, sections, skip, superseded) + rest


def resolved_dict(config) -> dict:
    """The run's flags by group, as `--yaml-cfg` reads them back (None values left out)."""
    out = {}
    for group in dataclasses.fields(config):
        values = dataclasses.asdict(getattr(config, group.name))
        out[group.name] = {k.replace("_", "-"): list(v) if isinstance(v, tuple) else v
                           for k, v in values.items() if v is not None}
    return out


def write_resolved(config, directories: list[str], world_size: int | None = None) -> list[str]:
    """Write the resolved configuration as RESOLVED_NAME into each directory (temp name, then
    rename, so a reader never sees half a file), with the launch's world size in a `launch`
    section that --yaml-cfg skips, with the launch directory; returns the paths written."""
    # relative paths in the file are relative to the launch directory: tools/relaunch.py runs there
    launch = {LAUNCH: {"world-size": world_size, "directory": os.getcwd()}} if world_size else {}
    text = ("# the resolved configuration of this run; re-launch with: tools/relaunch.py THIS_FILE\n"
            + yaml.safe_dump({**resolved_dict(config), **launch}, sort_keys=False))
    written = []
    for directory in dict.fromkeys(d for d in directories if d):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, RESOLVED_NAME)
        with atomic_write(path) as f:
            f.write(text)
        written.append(path)
    return written
