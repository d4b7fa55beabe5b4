"""TorchDynamo and Inductor imported when something compiles, not by every process that imports
megatron-core.

megatron-core decorates its fused elementwise functions with `torch.compile` (its `jit_fuser`)
while its modules are imported, and each decoration imports TorchDynamo and Inductor: about 3.5 s
of CPU in every process (`python -X importtime`), paid by every rank and tool, also on a CPU where
no fused function runs (`platform.fusion_defaults`). Here `jit_fuser` compiles a function with the
same `torch.compile` on its first call instead, so what runs and what it compiles to are unchanged.

`after_import` is the hook that makes this possible: it runs code right after a module's own code
has run, before any importer sees the module (the platform uses it to let TorchDynamo see the real
`torch.cuda` functions whenever it is first imported).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it wraps the loader the other finders return."""

    def __init__(self):
        self.hooks: dict[str, list[Callable]] = {}

    def find_spec(self, name, path, target=None):
        hooks = self.hooks.pop(name, None)
        if hooks is None:
            return None
        spec = importlib.util.find_spec(name)  # the other finders (this one no longer watches `name`)
        run_module = spec.loader.exec_module  # a loader instance of this spec's own

        def run_then_hooks(module):
            for hook in hooks:
                hook(module, run_module)

        spec.loader.exec_module = run_then_hooks
        return spec


_finder = _AfterImport()


def around_import(name: str, hook: Callable) -> None:
    """`hook(module, run)` is called instead of running module `name`'s code when it is first
    imported; it must call `run(module)` once. For a module already imported: `hook(module, None)`."""
    if name in sys.modules:
        hook(sys.modules[name], None)
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.hooks.setdefault(name, []).append(hook)


def compile_on_first_call(fn=None, **options):
    """`torch.compile(fn, **options)`, called when `fn` is first called rather than now."""
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


def _defer_jit_fuser(jit, run) -> None:
    if run is not None:
        run(jit)
    import torch

    if jit.jit_fuser is torch.compile:  # megatron-core's choice for torch >= 2.2
        jit.jit_fuser = compile_on_first_call


def defer_megatron_jit_fuser() -> None:
    """megatron-core's `jit_fuser` compiles on first call (before megatron-core is imported: its
    modules decorate with the `jit_fuser` they find)."""
    around_import("megatron.core.jit", _defer_jit_fuser)
