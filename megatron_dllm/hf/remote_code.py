"""The python files every HF export ships (transformers' remote code), and where each comes from.

config.json maps transformers' Auto classes to configuration_dllm.py and modeling_dllm.py, and
transformers copies with them, recursively, every file they name in a `from .name import` line
(`transformers.dynamic_module_utils.get_relative_imports`), all from the export's top directory.
modeling_dllm.py's `generate` runs megatron_dllm's sampler files (sampling/hf_generation.py and
what it imports), so an export ships them flat beside it, with `hf/sampling_deps.py` as their
`deps.py` and the self-contained errors.py, seeding.py, families/schedules.py and
model/constants.py (the noise schedule), families/shift.py (MDLM's shift) and families/uniform.py
(uniform-state noise), and samples without megatron_dllm.
This project's tools never import an export's files (hf/load_export.py).
"""
from __future__ import annotations

import ast
import os

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # megatron_dllm/
ENTRY_FILES = ("configuration_dllm.py", "modeling_dllm.py")  # config.json's auto_map
# module name in an export -> its source in megatron_dllm; every other name: sampling/<name>.py
SOURCES = {"configuration_dllm": "hf/configuration_dllm.py", "modeling_dllm": "hf/modeling_dllm.py",
           "deps": "hf/sampling_deps.py", "errors": "errors.py", "seeding": "seeding.py",
           "schedules": "families/schedules.py", "constants": "model/constants.py",
           "shift": "families/shift.py", "uniform": "families/uniform.py"}


def source_path(module: str) -> str:
    path = os.path.join(PACKAGE, SOURCES.get(module, f"sampling/{module}.py"))
    if module in SOURCES and module != "deps" and os.path.exists(os.path.join(PACKAGE, "sampling", f"{module}.py")):
        raise RuntimeError(f"remote code: sampling/{module}.py and {SOURCES[module]} would both be {module}.py")
    return path


def relative_imports(path: str) -> tuple[set[str], set[str]]:
    """(the modules transformers copies for the file `path`: its `from .name import` lines, every
    sibling module the file imports relatively, `from . import name` included)."""
    from transformers.dynamic_module_utils import get_relative_imports

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            imported |= {node.module} if node.module else {alias.name for alias in node.names}
    return set(get_relative_imports(path)), imported


def remote_code_files() -> dict[str, str]:
    """{file name in an export: its source}: the entry files and every module they import
    relatively, recursively. Raises if transformers would not copy a module the files import (a
    `from . import name` that no `from .name import` line names) or a source is missing."""
    files: dict[str, str] = {}
    copied: set[str] = set()
    imported: set[str] = set()
    todo = [name[:-3] for name in ENTRY_FILES]
    while todo:
        module = todo.pop()
        if f"{module}.py" in files:
            continue
        path = source_path(module)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"remote code: module {module!r} is imported relatively but {path} does not exist")
        files[f"{module}.py"] = path
        by_transformers, by_python = relative_imports(path)
        copied |= by_transformers
        imported |= by_python
        todo.extend(by_transformers | by_python)
    missed = imported - copied
    if missed:
        raise RuntimeError(f"remote code: transformers copies only the modules named in `from .name import` lines; "
                           f"{sorted(missed)} are imported only as `from . import name`")
    return files
