"""Speed-quality Pareto frontier (paper §3.3).

For each family and model: fit Gen PPL(T) and throughput(T) (fits.StepCurve), find the fewest
steps T that reach a target Gen PPL, read the throughput there, and keep the best model per family
and target. T is searched only inside the step range where both were measured (no extrapolation);
a model measured at fewer than 3 step counts (AR: one) is used at its measured points, without a
fit.

Input records are tools/evaluate.py's: Gen PPL {"family", "steps", "gen_ppl", "entropy"} and
throughput {"family", "steps", "tokens_per_s", "samples_per_s", "batch_size"}. A record's model is
its "model" or "preset" key, else the name of the file's directory: write each model's evaluate.py
--output files into that model's run directory so Gen PPL and throughput pair up. BD3-LM records
carry their "block_size" and compete as the series bd3lm-b<B> (`plan.series_name`), as in the fits.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megatron_dllm.errors import InputError
from megatron_dllm.scaling.fits import StepCurve, fit_step_curve
from megatron_dllm.scaling.plan import series_name


def _json_line(path: str, number: int, line: str) -> dict:
    try:
        return json.loads(line)
    except ValueError:
        raise InputError(f"{path}:{number}: neither a JSON file nor JSON lines (expected tools/evaluate.py's "
                         f"records)") from None


def load_records(paths, value: str, flag: str) -> list[dict]:
    """Records from JSON files (an object or a list of objects) or JSON-lines files, each tagged
    with its model (see the module docstring); each must hold `value` (given as `flag`)."""
    records = []
    for path in paths:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError as err:
            raise InputError(f"{path}: cannot read it ({err.strerror or err})") from None
        try:
            data = json.loads(text)
            items = data if isinstance(data, list) else [data]
        except json.JSONDecodeError:
            items = [_json_line(path, number, line) for number, line in enumerate(text.splitlines(), 1)
                     if line.strip()]
        default_model = os.path.basename(os.path.dirname(os.path.abspath(path)))
        for item in items:
            if not isinstance(item, dict) or value not in item:
                raise InputError(f"{flag} {path}: a record without {value!r} (expected tools/evaluate.py's "
                                 f"{value.replace('_', ' ')} records)")
            if item.get("steps") is None:
                raise InputError(f"{path}: a record has no 'steps' (Gen PPL and throughput are fitted "
                                 f"against the sampling steps T)")
            for key in ("steps", value):  # a fit of null, NaN, 0 or text would fail far from the file
                number = item[key]
                if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 < number < math.inf:
                    raise InputError(f"{flag} {path}: {key} {number!r}, expected a finite positive number")
            if not isinstance(item.get("family"), str):
                raise InputError(f"{flag} {path}: a record without its 'family' (expected tools/evaluate.py's)")
            records.append({**item, "family": series_name(item["family"], item.get("block_size")),
                            "model": str(item.get("model", item.get("preset", default_model))), "file": path,
                            "sampler": _sampler(item)})
    return records


# what makes two measurements of one model at one T the same sampler (the steps aside); KV caching,
# CUDA graphs, compilation and top-p/temperature change speed or quality too little to refuse a pair
SAMPLER_KEYS = ("predictor", "seq_length", "max_new_tokens", "block_length", "approx_kv_cache", "noise_removal",
                "tokens_per_step", "confidence_threshold", "entropy_bound")


def _sampler(item: dict) -> dict:
    """The sampler settings a record was measured with: a Gen PPL record's samples' `sampling`,
    a throughput record's `settings.sampling` and `seq_length` (what a record holds of them)."""
    sampling = item.get("sampling") or (item.get("settings") or {}).get("sampling") or {}
    found = {key: sampling[key] for key in SAMPLER_KEYS if isinstance(sampling, dict) and sampling.get(key) is not None}
    if item.get("seq_length") is not None:
        found["seq_length"] = item["seq_length"]
    return found


def _check_one_sampler(records) -> None:
    """A model's Gen PPL and throughput must come from one sampler: a pair measured with different
    ones (another predictor, length or cache) would put a point on the frontier no sampler reached."""
    first = {}
    for r in records:
        key = (r["family"], r["model"])
        if key not in first:
            first[key] = r
            continue
        this, other = r.get("sampler", {}), first[key].get("sampler", {})
        differ = [f"{k} {this[k]} vs {other[k]}" for k in SAMPLER_KEYS
                  if k in this and k in other and this[k] != other[k]]
        if differ:
            raise InputError(f"{r['file']} and {first[key]['file']}: {key[0]} model {key[1]!r} measured with different "
                             f"samplers ({'; '.join(differ)}); give one sampler's Gen PPL and throughput per model "
                             f"(another sampler: another directory or 'model' key)")


@dataclass
class ModelCurves:
    family: str
    model: str
    gen_ppl_points: dict  # steps -> Gen PPL
    throughput_points: dict  # steps -> tokens/s
    gen_ppl: StepCurve | None = None  # None: fewer than 3 step counts
    throughput: StepCurve | None = None

    def steps_range(self) -> tuple[float, float]:
        """The steps measured for both Gen PPL and throughput (empty when lo > hi): the frontier
        reads neither fit outside it."""
        return (max(min(self.gen_ppl_points), min(self.throughput_points)),
                min(max(self.gen_ppl_points), max(self.throughput_points)))

    def throughput_at(self, steps: float) -> float:
        if self.throughput is not None:
            return float(self.throughput(steps))
        known = sorted(self.throughput_points.items())
        if len(known) == 1:
            return known[0][1]
        xs, ys = zip(*known)  # interpolate in log T between the measured points
        return float(np.interp(math.log(steps), np.log(xs), ys))

    def steps_for(self, target: float) -> float | None:
        """Fewest steps in `steps_range` with Gen PPL <= target, None if none."""
        lo, hi = self.steps_range()
        if self.gen_ppl is None:
            ok = [t for t, g in self.gen_ppl_points.items() if g <= target and lo <= t <= hi]
            return min(ok) if ok else None
        if lo > hi:
            return None
        if self.gen_ppl(lo) <= target:  # first: a fit may rise with T (a small model's can)
            return float(lo)
        if self.gen_ppl(hi) > target:
            return None
        return self.gen_ppl.steps_for(target)


def _points(records, value: str) -> dict:
    """(family, model) -> {steps: value}; two files that measure one model at one T differently
    are refused (two models written into one directory would otherwise merge)."""
    points, source = defaultdict(dict), {}
    for r in records:
        key, steps, measured = (r["family"], r["model"]), float(r["steps"]), float(r[value])
        if points[key].get(steps, measured) != measured:
            raise InputError(f"{r.get('file', 'a record')} and {source[key + (steps,)]}: two {value} values "
                             f"for {key[0]} model {key[1]!r} at T = {steps:g} (give each model its own directory "
                             f"or a 'model' key; one model measured twice: keep one)")
        points[key][steps] = measured
        source[key + (steps,)] = r.get("file", "a record")
    return points


def fit_models(gen_ppl_records, throughput_records) -> tuple[list[ModelCurves], list[str]]:
    """(one ModelCurves per (family, model) with both kinds of measurement, what has only one or
    no steps measured for both)."""
    _check_one_sampler([*gen_ppl_records, *throughput_records])
    gen, thr = _points(gen_ppl_records, "gen_ppl"), _points(throughput_records, "tokens_per_s")
    models, unpaired = [], []
    for key in sorted(gen.keys() & thr.keys()):
        m = ModelCurves(*key, gen[key], thr[key])
        lo, hi = m.steps_range()
        if lo > hi:
            unpaired.append(f"{key[0]} {key[1]}: Gen PPL measured at T = {min(gen[key]):g} ... {max(gen[key]):g}, "
                            f"throughput at {min(thr[key]):g} ... {max(thr[key]):g}: no common range")
            continue
        if len(m.gen_ppl_points) >= 3:
            m.gen_ppl = fit_step_curve(list(m.gen_ppl_points), list(m.gen_ppl_points.values()))
        if len(m.throughput_points) >= 3:
            m.throughput = fit_step_curve(list(m.throughput_points), list(m.throughput_points.values()))
        models.append(m)
    unpaired += [f"{family} {model}: {kind} records only (a model's records pair by its 'model'/'preset' key, "
                 f"else its files' directory)" for kind, only in (("Gen PPL", gen.keys() - thr.keys()),
                                                                ("throughput", thr.keys() - gen.keys()))
                 for family, model in sorted(only)]
    return models, unpaired


def pareto_frontier(models: list[ModelCurves], targets) -> list[dict]:
    """For every target Gen PPL and family, the highest throughput over the family's models:
    rows {"target", "family", "model", "steps", "tokens_per_s"}; families that reach no target
    are left out of that target's rows."""
    rows = []
    for target in targets:
        best = {}
        for m in models:
            steps = m.steps_for(target)
            if steps is None:
                continue
            speed = m.throughput_at(steps)
            if not (math.isfinite(speed) and speed > 0):  # a fit gone wrong between points is no speed
                continue
            if m.family not in best or speed > best[m.family]["tokens_per_s"]:
                best[m.family] = {"target": float(target), "family": m.family, "model": m.model,
                                  "steps": steps, "tokens_per_s": speed}
        rows.extend(best[f] for f in sorted(best))
    return rows


def winners(frontier: list[dict]) -> dict:
    """target -> the family with the highest throughput there."""
    out = {}
    for row in frontier:
        if row["target"] not in out or row["tokens_per_s"] > out[row["target"]]["tokens_per_s"]:
            out[row["target"]] = row
    return {t: r["family"] for t, r in out.items()}
