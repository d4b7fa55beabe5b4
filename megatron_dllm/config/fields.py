"""Dataclass fields that are also command-line flags, as Megatron-LM generates its flags from its
config dataclasses: a field `seq_length` is the flag `--seq-length`.

    @dataclass(frozen=True)
    class LoggingConfig(FlagGroup):
        GROUP = "logging"
        log_interval: int = flag(10, type=positive_int)

`LoggingConfig.add_arguments(parser)` declares the group; `LoggingConfig.from_args(namespace)`
builds the frozen config from parsed flags. Value checks that need one flag only live in the
`type=` functions below, so an impossible value fails at parse time with argparse's one-line
`error:` (exit code 2).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Any


def flag(default: Any = None, help: str | None = None, **argparse_kwargs) -> Any:
    """A config field declared as a flag; `argparse_kwargs` go to `add_argument` (type, choices,
    nargs, action), but for `aliases`: other spellings of the flag (Megatron-LM's, where it has one)."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})



def switch(help: str) -> Any:
    """A --x / --no-x flag; absent, the field is None (its consumer's default)."""
    return flag(action=argparse.BooleanOptionalAction, help=help)

class FlagGroup:
    """Mixin for frozen config dataclasses whose fields are flags."""

    GROUP = "options"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, exclude: tuple = (), **defaults) -> None:
        """Declare this group's flags on `parser` (a new argument group); `defaults` override
        field defaults for this parser (e.g. a tool with other defaults)."""
        group = parser.add_argument_group(cls.GROUP)
        for f in dataclasses.fields(cls):
            if f.name in exclude or "help" not in f.metadata:
                continue
            kwargs = {k: v for k, v in f.metadata.items() if v is not None and k != "aliases"}
            group.add_argument("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()), dest=f.name,
                               default=defaults.get(f.name, f.default), **kwargs)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace):
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)
                      if hasattr(namespace, f.name)})

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------ one-flag value checks


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def positive_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def adam_beta(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def seed_value(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**32:  # numpy's seeds
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32), got {text}")
    return value


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def split_spec(text: str) -> str:
    """Megatron's --split: up to three non-negative weights (train, valid, test), not all zero,
    written as plain decimals: megatron-core reads the runs of digits and dots, so `1e2,1` would
    mean 1,2,1 to it."""
    parts = [part.strip() for part in text.replace("/", ",").split(",")]
    weights = [float(part) for part in parts if re.fullmatch(r"\d+\.?\d*|\.\d+", part)]
    if not (1 <= len(weights) == len(parts) <= 3 and sum(weights) > 0):
        raise argparse.ArgumentTypeError(f"expected up to three non-negative decimal numbers such as 969,30,1, "
                                         f"got {text!r}")
    return text
