"""IsoFLOP run grids (paper §3.1) and the run manifest that tools/scaling_laws.py reads back.

For every budget C, family and preset the planner trains floor(C / (training FLOPs per sequence x
global batch)) iterations, so a run spends at most C (the paper's reference code rounds the same
way). The paper states no tokens-per-parameter bounds; runs with fewer than one iteration are
dropped, and optional bounds can drop more.

BD3-LM (`bd3lm`) is planned once per block size (`block_sizes`): each block size is its own series
in the fits and the frontier, named `bd3lm-b<B>` (`series_name`), and its training FLOPs are those
of the 2L-token input [x_t ; x_0] it trains on (`flops.train_flops_per_sample`).

The manifest (JSON) lists every planned run with its metrics file, so the fits never have to parse
run names:  {"runs": [{"name", "family", "block_size", "preset", "budget", "non_embedding_params",
"iterations", "tokens", "flops", "metrics_file"}, ...], ...settings}; paths relative to it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.errors import InputError, read_text
from megatron_dllm.model.presets import ALIASES, PAPER_PRESETS, get_preset, gpt_shape_of
from megatron_dllm.scaling.flops import non_embedding_params, train_flops_per_sample

PAPER_BUDGETS = (6e18, 1e19, 3e19, 6e19, 1e20)  # §3.1
PAPER_SETTINGS = dict(seq_length=2048, global_batch_size=256, vocab_size=32001)  # §3: data, tokenizer
FAMILY_ORDER = ("ar", "mdlm", "duo", "esolm", "bd3lm")
PAPER_FAMILIES = FAMILY_ORDER[:4]  # the paper's grid; BD3-LM is planned when asked, with --block-sizes
BLOCK_FAMILIES = ("bd3lm",)  # planned once per --block-sizes entry


def iterations_for_budget(budget: float, flops_per_sequence: int, global_batch_size: int) -> int:
    """Whole iterations the budget pays for, rounded down so a run never exceeds its budget."""
    return int(budget) // (flops_per_sequence * global_batch_size)


def budget_label(budget: float) -> str:
    """6e18 -> '6e18', 3.5e19 -> '3.5e19', 1e8 -> '1e8' (for run names and --train-flops): the
    shortest spelling that reads back as `budget` exactly, so the trainer's iterations equal the
    plan's."""
    text = next(t for digits in range(6, 18) if float(t := f"{budget:.{digits}g}") == budget)
    mantissa, _, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def series_name(family: str, block_size: int | None = None) -> str:
    """What the fits and the frontier compare: the family, or for BD3-LM family and block size."""
    return f"{family}-b{block_size}" if block_size else family


@dataclass(frozen=True)
class PlannedRun:
    name: str
    family: str
    preset: str
    budget: float
    non_embedding_params: int
    iterations: int
    tokens: int
    flops: int  # what the iterations actually spend, <= budget
    block_size: int | None = None  # bd3lm's --block-size

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.non_embedding_params


def _series(families, block_sizes, seq_length: int) -> list[tuple[str, int | None]]:
    """(family, block size) per planned series: BD3-LM once per block size, the others once."""
    if any(f in BLOCK_FAMILIES for f in families) and not block_sizes:
        raise InputError("--families bd3lm needs --block-sizes (tokens per block, e.g. 4 16)")
    for b in block_sizes:
        if b < 1 or seq_length % b:
            raise InputError(f"--block-sizes {b}: a block size must be positive and divide --seq-length {seq_length}")
    return [(f, b) for f in families for b in (block_sizes if f in BLOCK_FAMILIES else [None])]


def _check_distinct(budgets, families, presets, block_sizes) -> None:
    """A grid entry given twice would plan the same run twice, into one directory; and the grid
    is of the DiT sizes (a released model's GPT preset counts other parameters and FLOPs)."""
    for flag, values in (("--budgets", [budget_label(b) for b in budgets]), ("--families", list(families)),
                         ("--presets", [ALIASES.get(p, p) for p in presets]), ("--block-sizes", list(block_sizes))):
        twice = [v for v in dict.fromkeys(values) if values.count(v) > 1]
        if twice:
            raise InputError(f"{flag}: {twice[0]} is given twice (aliases and spellings counted as one)")
    gpt = [p for p in presets if gpt_shape_of(p) is not None]
    if gpt:
        raise InputError(f"--presets {gpt[0]}: a released model's GPT backbone; IsoFLOP grids are planned over the "
                         f"DiT sizes (the paper's presets, cpu-*)")


def plan_isoflop(budgets, families, presets=tuple(PAPER_PRESETS), *, seq_length: int, global_batch_size: int,
                 vocab_size: int, convention: str = "calflops", min_tokens_per_param: float | None = None,
                 max_tokens_per_param: float | None = None, block_sizes=()
                 ) -> tuple[list[PlannedRun], list[tuple[PlannedRun, str]]]:
    """(kept runs, [(dropped run, reason)]) for every budget x family (bd3lm: x block size) x preset."""
    kept, dropped = [], []
    series = _series(families, block_sizes, seq_length)
    _check_distinct(budgets, families, presets, block_sizes)
    for budget in budgets:
        for family, block_size in series:
            for name in presets:
                preset = get_preset(name)
                per_seq = train_flops_per_sample(preset, vocab_size, seq_length, family, convention)
                iters = iterations_for_budget(budget, per_seq, global_batch_size)
                run = PlannedRun(f"{series_name(family, block_size)}-{name}-C{budget_label(budget)}", family, name,
                                 budget, non_embedding_params(preset, vocab_size), iters,
                                 iters * global_batch_size * seq_length, iters * global_batch_size * per_seq,
                                 block_size)
                if iters < 1:
                    dropped.append((run, "fewer than 1 iteration"))
                elif min_tokens_per_param is not None and run.tokens_per_param < min_tokens_per_param:
                    dropped.append((run, f"{run.tokens_per_param:.3g} tokens/param < {min_tokens_per_param:g}"))
                elif max_tokens_per_param is not None and run.tokens_per_param > max_tokens_per_param:
                    dropped.append((run, f"{run.tokens_per_param:.3g} tokens/param > {max_tokens_per_param:g}"))
                else:
                    kept.append(run)
    return kept, dropped


def write_manifest(path: str, runs: list[PlannedRun], runs_dir: str, **settings) -> None:
    """Writes the manifest; each run's metrics file is <runs_dir>/<name>/metrics.jsonl."""
    base = os.path.dirname(os.path.abspath(path))
    entries = [{**asdict(r), "metrics_file": os.path.relpath(os.path.join(runs_dir, r.name, "metrics.jsonl"), base)}
               for r in runs]
    os.makedirs(base, exist_ok=True)
    with atomic_write(path) as f:
        json.dump({**settings, "runs": entries}, f, indent=1)


def read_manifest(path: str) -> tuple[dict, list[dict]]:
    """(the manifest's settings, its runs with metrics_file made absolute)."""
    base = os.path.dirname(os.path.abspath(path))
    try:
        with open(path) as f:
            manifest = json.load(f)
        runs = [{**r, "metrics_file": os.path.join(base, r["metrics_file"])} for r in manifest["runs"]]
        return {k: v for k, v in manifest.items() if k != "runs"}, runs
    except OSError as err:
        raise InputError(f"--manifest {path}: cannot read it ({err.strerror or err})") from None
    except (ValueError, KeyError, TypeError) as err:  # e.g. plan_isoflop's --format json, which has no metrics_file
        raise InputError(f"--manifest {path}: not a run manifest of tools/plan_isoflop.py --manifest "
                         f"({type(err).__name__}: {err})") from None


def final_validation(metrics_file: str) -> dict | None:
    """The last validation record (`valid_nelbo`) of a --metrics-file JSONL, None if there is none."""
    if not os.path.exists(metrics_file):
        return None
    last = None
    at = lambda line: f"{metrics_file}:{line}" if line else metrics_file  # noqa: E731
    for number, line in enumerate(read_text(metrics_file, at).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise InputError(f"{metrics_file}:{number}: not a JSON record of --metrics-file")
        if "valid_nelbo" in record:
            nelbo, iteration = record["valid_nelbo"], record.get("iteration")
            if not (_is_number(nelbo) or nelbo is None) or type(iteration) is not int:
                raise InputError(f"{metrics_file}:{number}: a validation record needs an integer 'iteration' and "
                                 f"a number (or null) 'valid_nelbo', got {iteration!r} and {nelbo!r}")
            if "flops" in record and not _is_number(record["flops"]):
                raise InputError(f"{metrics_file}:{number}: 'flops' {record['flops']!r} is not a number")
            last = record
    return last


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
