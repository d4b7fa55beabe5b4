"""Run configuration: frozen dataclasses per concern, each owning its flags (see fields.py)."""
from megatron_dllm.config.run import RunConfig, build_parser, parse_args, resolve_defaults, resolve_iterations

__all__ = ["RunConfig", "build_parser", "parse_args", "resolve_defaults", "resolve_iterations"]
