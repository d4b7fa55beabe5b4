"""Fit the paper's scaling laws and speed-quality frontier from finished runs; write figures and a
results table.

    python tools/scaling_laws.py --manifest runs/isoflop/manifest.json \\
        --gen-ppl eval/*/gen_ppl*.json --throughput eval/*/throughput*.json --out-dir runs/isoflop/fits

--manifest: written by tools/plan_isoflop.py; each run's loss is the last validation NELBO in its
metrics file, and runs that did not reach their planned iterations are skipped (listed).
--gen-ppl / --throughput: tools/evaluate.py's JSON records (see megatron_dllm/scaling/pareto.py).
Writes isoflop.png, loss_vs_flops.png, params_vs_flops.png, pareto.png (with evaluation files),
results.md and results.json into --out-dir.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import asdict

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.fields import positive_float
from megatron_dllm.errors import InputError
from megatron_dllm.scaling import pareto, plots
from megatron_dllm.scaling.fits import analyze_isoflop
from megatron_dllm.scaling.plan import final_validation, read_manifest, series_name


def finished_runs(manifests) -> tuple[list[dict], list[str]]:
    """The runs that reached their planned iterations, with their last validation NELBO as "loss",
    and what was skipped. A run that trained other FLOPs than planned, or manifests of other
    settings, are bad input: their points would sit at the wrong N or budget."""
    runs, skipped, settings_of, point_of = [], [], {}, {}
    for manifest in manifests:
        settings, planned = read_manifest(manifest)
        for key, value in settings.items():
            first, where = settings_of.setdefault(key, (value, manifest))
            if value != first:
                raise InputError(f"--manifest {manifest}: {key} {value}, but {where} has {first} (the fits "
                                 f"compare runs of one setting)")
        for run in planned:
            record = final_validation(run["metrics_file"])
            # FLOPs per iteration other than planned: another --global-batch-size, --seq-length or vocabulary
            other = record is not None and "flops" in record and not math.isclose(
                record["flops"] * run["iterations"], run["flops"] * record["iteration"], rel_tol=1e-9)
            if not other and (record is None or record["iteration"] < run["iterations"]):
                got = "no validation" if record is None else f"validation at iteration {record['iteration']}"
                skipped.append(f"{run['name']}: unfinished ({got}, planned {run['iterations']} iterations)")
                continue
            if other or record["iteration"] > run["iterations"]:
                raise InputError(f"{run['metrics_file']}: {record.get('flops', '?')} training FLOPs in "
                                 f"{record['iteration']} iterations, but --manifest {manifest} planned "
                                 f"{run['flops']} in {run['iterations']} for {run['name']} (trained with other "
                                 f"--vocab-size, --seq-length or --global-batch-size than planned?)")
            loss = record["valid_nelbo"]
            if loss is None or not math.isfinite(loss):  # diverged (null: non-finite): no point on its curve
                skipped.append(f"{run['name']}: diverged (validation NELBO {'non-finite' if loss is None else loss} "
                               f"at iteration {record['iteration']})")
                continue
            if loss <= 0:
                raise InputError(f"{run['metrics_file']}: validation NELBO {loss} at iteration "
                                 f"{record['iteration']}; a NELBO is positive")
            # the fits compare series: a family, or BD3-LM at one block size (bd3lm-b4)
            series = series_name(run["family"], run.get("block_size"))
            point = (series, run["budget"], run["non_embedding_params"])
            if point in point_of:
                raise InputError(f"--manifest {manifest}: {run['name']} is a second {series} run of "
                                 f"{run['non_embedding_params']} parameters at budget {run['budget']:g} (the "
                                 f"first: {point_of[point]})")
            point_of[point] = run["metrics_file"]
            runs.append({**run, "family": series, "loss": loss})
    return runs, skipped


def _law(law):
    return None if law is None else {"exponent": law.exponent, "coefficient": math.exp(law.intercept)}


def to_json(analysis: dict, frontier: list[dict], models) -> dict:
    families = {}
    for family, e in analysis["families"].items():
        families[family] = {"isoflop": [asdict(f) for f in e["isoflop"]], "loss_law": _law(e["loss_law"]),
                            "params_law": _law(e["params_law"]),
                            "compute_multiplier_vs_ar": e["compute_multiplier_vs_ar"],
                            "size_ratio_vs_ar": e["size_ratio_vs_ar"]}
    curves = [{"family": m.family, "model": m.model,
               "gen_ppl": None if m.gen_ppl is None else asdict(m.gen_ppl),
               "throughput": None if m.throughput is None else asdict(m.throughput),
               "measured": [{"steps": t, "gen_ppl": m.gen_ppl_points[t], "tokens_per_s": m.throughput_points.get(t)}
                            for t in sorted(m.gen_ppl_points)]} for m in models]
    return {"reference_compute": analysis["reference_compute"], "families": families, "skipped": analysis["skipped"],
            "step_curves": curves, "pareto": frontier,
            "pareto_winners": {str(t): f for t, f in pareto.winners(frontier).items()}}


def to_markdown(result: dict) -> str:
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = ["## IsoFLOP minima", "", "| family | budget | N* | L* | N* extrapolated |", "|---|---|---|---|---|"]
    for family, e in result["families"].items():
        for f in e["isoflop"]:
            lines.append(f"| {family} | {f['budget']:.3g} | {f['n_opt']:.4g} | {f['loss_opt']:.4f} | "
                         f"{f['extrapolated']} |")
    lines += ["", f"## Power laws (multiplier and size ratio at C = {fmt(result['reference_compute'], '.3g')})", "",
              "| family | L* = A C^alpha: alpha | A | N* = B C^gamma: gamma | B | compute x AR | N* / N*_AR |",
              "|---|---|---|---|---|---|---|"]
    for family, e in result["families"].items():
        loss, params = e["loss_law"] or {}, e["params_law"] or {}
        lines.append(f"| {family} | {fmt(loss.get('exponent'), '.4f')} | {fmt(loss.get('coefficient'), '.4g')} | "
                     f"{fmt(params.get('exponent'), '.4f')} | {fmt(params.get('coefficient'), '.4g')} | "
                     f"{fmt(e['compute_multiplier_vs_ar'], '.3g')} | {fmt(e['size_ratio_vs_ar'], '.3g')} |")
    if result["step_curves"]:
        lines += ["", "## Sampling: Gen PPL and throughput by steps T", "",
                  "| family | model | steps T | Gen PPL | tokens/s |", "|---|---|---|---|---|"]
        for c in result["step_curves"]:
            for p in c["measured"]:
                lines.append(f"| {c['family']} | {c['model']} | {p['steps']:g} | {p['gen_ppl']:.4g} | "
                             f"{fmt(p['tokens_per_s'], '.4g')} |")
    if result["pareto"]:
        lines += ["", "## Speed-quality Pareto frontier", "",
                  "| target Gen PPL | family | model | steps T | tokens/s |", "|---|---|---|---|---|"]
        for r in result["pareto"]:
            lines.append(f"| {r['target']:g} | {r['family']} | {r['model']} | {r['steps']:.1f} | "
                         f"{r['tokens_per_s']:.4g} |")
    if result["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {s}" for s in result["skipped"]]
    return "\n".join(lines) + "\n"


@reports_bad_input()
def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", nargs="+", required=True, help="run manifests from tools/plan_isoflop.py")
    parser.add_argument("--gen-ppl", nargs="*", default=[], help="Gen PPL JSON files from tools/evaluate.py")
    parser.add_argument("--throughput", nargs="*", default=[], help="throughput JSON files from tools/evaluate.py")
    parser.add_argument("--targets", type=positive_float, nargs="+", default=list(range(40, 201, 10)),
                        help="target Gen PPL values of the Pareto frontier (paper: 40 ... 200)")
    parser.add_argument("--reference-flops", type=positive_float, default=None,
                        help="compute at which multipliers and size ratios are read (default: largest budget)")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    if bool(args.gen_ppl) != bool(args.throughput):
        parser.error("--gen-ppl and --throughput go together (the frontier needs both)")

    runs, skipped = finished_runs(args.manifest)
    if not runs:
        parser.error(f"--manifest: no finished runs ({len(skipped)} unfinished)")
    analysis = analyze_isoflop(runs, args.reference_flops)
    analysis["skipped"] = skipped + analysis["skipped"]
    try:
        models, unpaired = pareto.fit_models(pareto.load_records(args.gen_ppl, "gen_ppl", "--gen-ppl"),
                                             pareto.load_records(args.throughput, "tokens_per_s", "--throughput"))
    except InputError as err:
        parser.error(str(err))
    analysis["skipped"] += [f"Pareto frontier: {what}" for what in unpaired]
    frontier = pareto.pareto_frontier(models, args.targets)
    if models and not frontier:
        lowest = min(g for m in models for g in m.gen_ppl_points.values())
        analysis["skipped"].append(f"Pareto frontier: no model reaches a --targets Gen PPL "
                                   f"({min(args.targets):g} ... {max(args.targets):g}); "
                                   f"the lowest measured is {lowest:.4g}")

    result = to_json(analysis, frontier, models)
    text = json.dumps(result, indent=1, allow_nan=False)  # before any file: a NaN would make it unreadable as JSON
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as err:
        parser.error(f"--out-dir {args.out_dir}: cannot create it ({err.strerror or err})")
    out = lambda name: os.path.join(args.out_dir, name)  # noqa: E731
    families = analysis["families"]
    plots.plot_isoflop({f: [(r["budget"], r["non_embedding_params"], r["loss"]) for r in runs if r["family"] == f]
                        for f in families}, {f: e["isoflop"] for f, e in families.items()}, out("isoflop.png"))
    for key, attr, label, name in (("loss_law", "loss_opt", "optimal validation NELBO L*", "loss_vs_flops.png"),
                                   ("params_law", "n_opt", "optimal parameters N*", "params_vs_flops.png")):
        points = {f: ([x.budget for x in e["isoflop"]], [getattr(x, attr) for x in e["isoflop"]],
                      [x.extrapolated for x in e["isoflop"]]) for f, e in families.items() if e["isoflop"]}
        plots.plot_power_laws(points, {f: e[key] for f, e in families.items() if e[key]}, label, out(name))
    if frontier:
        plots.plot_pareto(frontier, out("pareto.png"))
    elif os.path.exists(out("pareto.png")):  # an earlier run's frontier is not this one's
        os.remove(out("pareto.png"))
    with atomic_write(out("results.json")) as f:
        f.write(text)
    with atomic_write(out("results.md")) as f:
        f.write(to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
