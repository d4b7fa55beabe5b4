"""Two training runs that differ only in some flags, side by side: their training losses at every
logged iteration and the relative difference at the end. By default the pair is TransformerEngine's
layers in bf16 against FP8 (`--fp8-format hybrid`), the check that FP8 tracks bf16 within 1.5%
at the end of a short run for MDLM and Duo.

    python benchmarks/compare_loss_curves.py [--families mdlm duo] [--train-iters 300]
        [--a "--transformer-impl transformer_engine --bf16"] [--b "... --fp8-format hybrid --fp8-recipe delayed"]
        [--tolerance 0.015] [--tail 3] [--work DIR] [-- FLAGS FOR BOTH RUNS]

Each run is `pretrain_dllm.py` in one process on the embedded default (the `cpu-small` preset on
the Shakespeare demo corpus, 32 x 128 tokens an iteration) with the same seed, so the data and
the initial weights are the same and only the flags of `--a` and `--b` differ. "At the end" is
the mean of the last `--tail` logged losses of each run (`--log-interval 10`). Exits 1 if a
family's difference exceeds `--tolerance`. On a CPU (no TE), give other flags to compare, e.g.
`--a "" --b "--compile-elementwise"`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from megatron_dllm.config.fields import positive_int

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TE = "--transformer-impl transformer_engine --attention-backend fused --bf16"


def train(family: str, flags: list[str], iters: int, work: str, name: str) -> dict[int, float]:
    """{iteration: training loss} of one run, from its --metrics-file. Each run has a directory of
    its own (its working directory: the demo's checkpoints and logs go there), made afresh."""
    run_dir = os.path.join(work, f"{family}-{name}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun into the same --work must not resume
    os.makedirs(run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, os.path.join(REPO, "pretrain_dllm.py"), "--family", family, "--train-iters", str(iters),
           "--log-interval", str(LOG_INTERVAL), "--eval-interval", str(iters), "--eval-iters", "1", "--seed", "1234",
           "--metrics-file", metrics, *flags]
    proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{family} run {name} failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-3000:]}")
    with open(metrics) as f:
        # a non-finite loss is null in the metrics file
        return {r["iteration"]: float("nan") if r["loss"] is None else r["loss"] for r in map(json.loads, f)
                if "loss" in r}


def end_difference(a: dict[int, float], b: dict[int, float], tail: int) -> tuple[float, float, float]:
    """(a's end loss, b's end loss, |b - a| / a): each the mean of its last `tail` logged losses."""
    if sorted(a) != sorted(b) or len(a) < tail:
        raise ValueError(f"the runs logged different iterations or fewer than {tail}: {sorted(a)} and {sorted(b)}")
    last = sorted(a)[-tail:]
    end_a, end_b = (sum(curve[i] for i in last) / tail for curve in (a, b))
    return end_a, end_b, abs(end_b - end_a) / end_a


LOG_INTERVAL = 10


def logged_iterations(iters: int, flags: list[str]) -> list[int]:
    """The iterations a run of `iters` iterations logs a loss at: every --log-interval (the last one
    given wins, as train() passes LOG_INTERVAL first) and the last iteration."""
    interval = LOG_INTERVAL
    for i, flag in enumerate(flags):
        if flag == "--log-interval" and i + 1 < len(flags):
            interval = positive_int(flags[i + 1])
        elif flag.startswith("--log-interval="):
            interval = positive_int(flag.split("=", 1)[1])
    return sorted(set(range(interval, iters + 1, interval)) | {iters})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=["mdlm", "duo"])
    p.add_argument("--train-iters", type=positive_int, default=300)
    p.add_argument("--a", default=TE, help="flags of the first run (the reference)")
    p.add_argument("--b", default=f"{TE} --fp8-format hybrid --fp8-recipe delayed", help="flags of the second run")
    p.add_argument("--tolerance", type=float, default=0.015, help="largest relative difference at the end")
    p.add_argument("--tail", type=positive_int, default=3, help="logged losses averaged for 'at the end'")
    p.add_argument("--work", default=None, help="directory for the runs' files (default: a temporary one)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    # before any training: the verdict compares --tail losses logged at the same iterations
    try:
        logged = [logged_iterations(args.train_iters, shlex.split(flags) + common) for flags in (args.a, args.b)]
    except (argparse.ArgumentTypeError, ValueError) as err:
        p.error(f"--log-interval: {err}")
    if logged[0] != logged[1]:
        p.error(f"--a and --b log losses at different iterations (another --log-interval): {logged[0]} and "
                f"{logged[1]}")
    if len(logged[0]) < args.tail:
        p.error(f"--train-iters {args.train_iters} logs {len(logged[0])} losses with {shlex.join(common)}, fewer "
                f"than --tail {args.tail}")
    work = args.work or tempfile.mkdtemp(prefix="loss-curves-")
    os.makedirs(work, exist_ok=True)
    print(f"a: {args.a or '(no flags)'}\nb: {args.b or '(no flags)'}\nboth: {shlex.join(common) or '(no flags)'}, "
          f"{args.train_iters} iterations, files in {work}\n")
    ends = []
    for family in args.families:
        curves = [train(family, shlex.split(flags) + common, args.train_iters, work, name)
                  for name, flags in (("a", args.a), ("b", args.b))]
        ends.append((family, *end_difference(*curves, args.tail)))
        print(f"| {family} iteration | loss a | loss b | (b - a) / a |\n|---:|---:|---:|---:|")
        for it in sorted(curves[0]):
            a, b = curves[0][it], curves[1][it]
            print(f"| {it} | {a:.4f} | {b:.4f} | {(b - a) / a:+.2%} |")
        print(flush=True)
    print(f"| family | end a | end b (mean of the last {args.tail} logged losses each) | difference | "
          f"within {args.tolerance:.1%} |\n|---|---:|---:|---:|---|")
    for family, end_a, end_b, diff in ends:
        print(f"| {family} | {end_a:.4f} | {end_b:.4f} | {diff:.2%} | {'yes' if diff <= args.tolerance else 'NO'} |")
    return 1 if any(not diff <= args.tolerance for *_, diff in ends) else 0  # a NaN end (a diverged run) fails

if __name__ == "__main__":
    sys.exit(main())
