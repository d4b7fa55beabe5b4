"""Run configuration: frozen dataclasses per concern, each owning its flags (see fields.py),
parsed and resolved in run.py, every rule between flags checked in validate.py."""
from megatron_dllm.config.run import (
    RunConfig,
    build_parser,
    parse_args,
    parse_flags,
    resolve_defaults,
    resolve_iterations,
)
from megatron_dllm.config.validate import validate

__all__ = ["RunConfig", "build_parser", "parse_args", "parse_flags", "resolve_defaults", "resolve_iterations",
           "validate"]
