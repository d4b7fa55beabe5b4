"""Scaling-law fits (paper §3.1-3.3), pure numpy/scipy on plain numbers.

    IsoFLOP parabola   log L(N; C) = a (log N)^2 + b log N + c      per budget C
                       N*_C = exp(-b / 2a),  L*_C = exp(c - b^2 / 4a)
    power laws         log L*_C = alpha log C + beta,  log N*_C = gamma log C + delta
    compute multiplier C_family(L) / C_AR(L) at the loss AR reaches with the reference compute
    Gen PPL(T)         alpha + beta T^gamma        (eqn gen-ppl-T)
    throughput(T)      alpha' + beta' T^gamma'     (eqn throughput-T)

Logs are natural logs; the minimiser does not depend on the base.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import curve_fit

from megatron_dllm.errors import InputError


@dataclass(frozen=True)
class IsoFLOPFit:
    budget: float
    a: float
    b: float
    c: float
    n_opt: float
    loss_opt: float
    extrapolated: bool  # N* lies outside the sizes that were trained

    def loss(self, n) -> np.ndarray:
        x = np.log(np.asarray(n, dtype=float))
        return np.exp(self.a * x * x + self.b * x + self.c)


def fit_isoflop(budget: float, params, losses) -> IsoFLOPFit:
    """Parabola in log N through one budget's (N, loss) points; needs 3 sizes and a minimum."""
    x, y = np.log(np.asarray(params, dtype=float)), np.log(np.asarray(losses, dtype=float))
    if len(np.unique(x)) < 3:
        raise InputError(f"budget {budget:g}: an IsoFLOP parabola needs at least 3 model sizes, "
                         f"got {len(np.unique(x))}")
    a, b, c = np.polyfit(x, y, 2)
    if a <= 0:
        raise InputError(f"budget {budget:g}: the losses have no minimum over log N (curvature {a:.3g} <= 0)")
    x_opt = -b / (2 * a)
    return IsoFLOPFit(budget, a, b, c, math.exp(x_opt), math.exp(c - b * b / (4 * a)),
                      not x.min() <= x_opt <= x.max())


@dataclass(frozen=True)
class PowerLaw:
    """y = exp(intercept) * C^exponent, fitted in log-log space."""
    exponent: float
    intercept: float

    def __call__(self, compute) -> np.ndarray:
        return np.exp(self.intercept) * np.asarray(compute, dtype=float) ** self.exponent

    def inverse(self, y) -> np.ndarray:
        """The compute at which the law reaches y."""
        return np.exp((np.log(np.asarray(y, dtype=float)) - self.intercept) / self.exponent)


def fit_power_law(compute, values) -> PowerLaw:
    compute, values = np.asarray(compute, dtype=float), np.asarray(values, dtype=float)
    if len(np.unique(compute)) < 2:
        raise InputError("a power law in compute needs at least 2 budgets")
    exponent, intercept = np.polyfit(np.log(compute), np.log(values), 1)
    return PowerLaw(float(exponent), float(intercept))


def compute_multiplier(family_loss: PowerLaw, ar_loss: PowerLaw, reference_compute: float) -> float:
    """How many times AR's compute the family needs to reach the loss AR reaches at
    `reference_compute` (constant when the two exponents are equal)."""
    return float(family_loss.inverse(ar_loss(reference_compute)) / reference_compute)


def size_ratio(family_params: PowerLaw, ar_params: PowerLaw, reference_compute: float) -> float:
    """N*_family / N*_AR at the same compute (0.5: the family's optimal models are 2x smaller)."""
    return float(family_params(reference_compute) / ar_params(reference_compute))


@dataclass(frozen=True)
class StepCurve:
    """value(T) = alpha + beta T^gamma."""
    alpha: float
    beta: float
    gamma: float

    def __call__(self, steps) -> np.ndarray:
        return self.alpha + self.beta * np.asarray(steps, dtype=float) ** self.gamma

    def steps_for(self, value: float) -> float:
        """The T at which the curve equals `value`; nan when it never does."""
        ratio = (value - self.alpha) / self.beta
        if ratio <= 0 or self.gamma == 0:
            return math.nan
        return float(ratio ** (1.0 / self.gamma))


def fit_step_curve(steps, values) -> StepCurve:
    """Least-squares fit of alpha + beta T^gamma (needs 3 distinct T). Started from the power law
    through the points relative to an asymptote just beyond the last value, so decreasing (Gen PPL)
    and increasing or decreasing (throughput) curves converge alike."""
    t, v = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    if len(np.unique(t)) < 3:
        raise InputError(f"alpha + beta T^gamma needs at least 3 distinct step counts, got {len(np.unique(t))}")
    order = np.argsort(t)
    t, v = t[order], v[order]
    # asymptote guess: a little past the value at the largest T, in the direction the curve moves
    direction = 1.0 if v[-1] > v[0] else -1.0
    alpha0 = v[-1] + 0.1 * direction * ((v.max() - v.min()) or abs(v[-1]) or 1.0)
    gamma0, log_beta0 = np.polyfit(np.log(t), np.log(np.abs(v - alpha0)), 1)
    p0 = (alpha0, -direction * math.exp(log_beta0), gamma0)
    (alpha, beta, gamma), _ = curve_fit(lambda x, a, b, g: a + b * x ** g, t, v, p0=p0, maxfev=20000)
    return StepCurve(float(alpha), float(beta), float(gamma))


def analyze_isoflop(runs: list[dict], reference_compute: float | None = None) -> dict:
    """The whole §3.1-3.2 analysis from finished runs [{"family", "budget", "non_embedding_params",
    "loss"}]: per family the IsoFLOP fits, the L*(C) and N*(C) power laws, and against AR the
    compute multiplier and optimal-size ratio at `reference_compute` (default: the largest budget).
    The power laws use only minima inside the trained sizes. Budgets or families that cannot be
    fitted, and minima that are extrapolated, are listed under "skipped" with the reason."""
    results, skipped = {}, []
    by_family = {}
    for r in runs:
        by_family.setdefault(r["family"], {}).setdefault(float(r["budget"]), []).append(r)
    for family, budgets in by_family.items():
        fits = []
        for budget in sorted(budgets):
            group = budgets[budget]
            try:
                fits.append(fit_isoflop(budget, [r["non_embedding_params"] for r in group],
                                        [r["loss"] for r in group]))
            except ValueError as err:
                skipped.append(f"{family}: {err}")
        entry = {"isoflop": fits, "loss_law": None, "params_law": None}
        # a minimum outside the trained sizes is the parabola's guess, not a measurement
        inside = [f for f in fits if not f.extrapolated]
        skipped.extend(f"{family}: budget {f.budget:g}: N* = {f.n_opt:.4g} lies outside the trained sizes "
                       f"(left out of the power laws)" for f in fits if f.extrapolated)
        if len(inside) >= 2:
            entry["loss_law"] = fit_power_law([f.budget for f in inside], [f.loss_opt for f in inside])
            entry["params_law"] = fit_power_law([f.budget for f in inside], [f.n_opt for f in inside])
        else:
            skipped.append(f"{family}: power laws need IsoFLOP minima inside the trained sizes at 2 budgets "
                           f"or more, got {len(inside)}")
        results[family] = entry
    if reference_compute is None and runs:
        reference_compute = max(float(r["budget"]) for r in runs)
    ar = results.get("ar")
    for family, entry in results.items():
        entry["compute_multiplier_vs_ar"] = entry["size_ratio_vs_ar"] = None
        if ar is None or ar["loss_law"] is None or entry["loss_law"] is None:
            continue
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            multiplier = compute_multiplier(entry["loss_law"], ar["loss_law"], reference_compute)
            ratio = size_ratio(entry["params_law"], ar["params_law"], reference_compute)
        if not (math.isfinite(multiplier) and math.isfinite(ratio)):  # a flat L*(C): AR's loss never reached
            skipped.append(f"{family}: no finite compute multiplier or size ratio against AR at C = "
                           f"{reference_compute:.3g} (L* = A C^alpha with alpha {entry['loss_law'].exponent:.3g})")
            continue
        entry["compute_multiplier_vs_ar"], entry["size_ratio_vs_ar"] = multiplier, ratio
    return {"families": results, "reference_compute": reference_compute, "skipped": skipped}
