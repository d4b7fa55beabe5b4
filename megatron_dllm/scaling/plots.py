"""PNG figures of the scaling study (the paper's Figs. IsoFLOP, likelihood-vs-FLOPs,
optimal-params-vs-FLOPs and the speed-quality Pareto frontier). matplotlib's object API with the
Agg canvas: no display and no global pyplot state."""
from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_dllm.scaling.fits import IsoFLOPFit, PowerLaw

FAMILY_COLORS = {"ar": "tab:blue", "mdlm": "tab:orange", "duo": "tab:green", "esolm": "tab:red"}


def _save(fig: Figure, path: str) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_isoflop(runs: dict, fits: dict, path: str) -> None:
    """runs: family -> [(budget, params, loss)]; fits: family -> [IsoFLOPFit]. One panel per
    family, one colour per budget: measured losses, the fitted parabola (dotted) and N*."""
    families = list(runs)
    fig = Figure(figsize=(4.5 * len(families), 3.8))
    budgets = sorted({b for points in runs.values() for b, _, _ in points})
    colors = {b: c for b, c in zip(budgets, _cmap(len(budgets)))}
    for i, family in enumerate(families):
        ax = fig.add_subplot(1, len(families), i + 1)
        fit_by_budget = {f.budget: f for f in fits.get(family, [])}
        for budget in budgets:
            points = sorted((n, loss) for b, n, loss in runs[family] if b == budget)
            if not points:
                continue
            n, loss = np.array(points).T
            ax.scatter(n, loss, color=colors[budget], s=14, label=f"{budget:.0e}")
            fit: IsoFLOPFit | None = fit_by_budget.get(budget)
            if fit is not None:
                grid = np.geomspace(n.min(), n.max(), 100)
                ax.plot(grid, fit.loss(grid), ":", color=colors[budget])
                ax.plot([fit.n_opt], [fit.loss_opt], "*", color=colors[budget], markersize=10)
        ax.set_xscale("log")
        ax.set_title(family)
        ax.set_xlabel("non-embedding parameters")
        ax.set_ylabel("validation NELBO")
        ax.legend(fontsize=7, title="FLOPs", title_fontsize=7)
    _save(fig, path)


def plot_power_laws(points: dict, laws: dict, ylabel: str, path: str) -> None:
    """points: family -> (budgets, values, extrapolated flags); laws: family -> PowerLaw (L*_C or
    N*_C vs C). Minima outside the trained sizes are drawn hollow: the laws leave them out."""
    fig = Figure(figsize=(5.5, 4))
    ax = fig.add_subplot(1, 1, 1)
    for family, (budgets, values, extrapolated) in points.items():
        color = FAMILY_COLORS.get(family)
        law: PowerLaw | None = laws.get(family)
        faces = ["none" if e else color for e in extrapolated]
        ax.scatter(budgets, values, edgecolors=color, facecolors=faces, s=22,
                   label=None if law is not None else f"{family}: no law")
        if law is not None:
            grid = np.geomspace(min(budgets), max(budgets), 50)
            ax.plot(grid, law(grid), color=color, label=f"{family}: C^{law.exponent:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs C (hollow: N* outside the trained sizes, not fitted)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_pareto(frontier: list[dict], path: str) -> None:
    """Best throughput per family against the target Gen PPL."""
    fig = Figure(figsize=(5.5, 4))
    ax = fig.add_subplot(1, 1, 1)
    for family in sorted({r["family"] for r in frontier}):
        rows = sorted((r["target"], r["tokens_per_s"]) for r in frontier if r["family"] == family)
        x, y = zip(*rows)
        ax.plot(x, y, "o-", color=FAMILY_COLORS.get(family), label=family, markersize=3)
    ax.set_xlabel("target Gen PPL")
    ax.set_ylabel("throughput (tokens/s)")
    ax.legend(fontsize=8)
    _save(fig, path)


def _cmap(n: int):
    from matplotlib import colormaps

    return colormaps["viridis"](np.linspace(0, 0.9, max(n, 1)))
