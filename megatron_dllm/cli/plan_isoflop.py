"""Plan an IsoFLOP sweep (paper §3.1): every budget x family x preset, its iterations and tokens.

    python tools/plan_isoflop.py --budgets 6e18 1e19 --families ar mdlm --format table
    python tools/plan_isoflop.py --budgets 1e14 --families ar mdlm bd3lm --block-sizes 4 16 --presets cpu-tiny \
        --seq-length 128 --global-batch-size 32 --vocab-size 4097
    python tools/plan_isoflop.py --budgets 1e14 --presets cpu-tiny cpu-small --seq-length 128 \\
        --global-batch-size 32 --vocab-size 4097 --format commands --runs-dir runs/isoflop \\
        --manifest runs/isoflop/manifest.json

Iterations = floor(budget / (training FLOPs per sequence x global batch)), the same rule
`pretrain_dllm.py --train-flops` applies, so --vocab-size must be the tokenizer's vocabulary
(with [MASK]). BD3-LM is planned once per --block-sizes entry (series bd3lm-b<B>), at the FLOPs
of the 2 x --seq-length tokens it trains on. --manifest records the grid for tools/scaling_laws.py.
"""
import argparse
import json
import os
import shlex
import sys

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import BAD_INPUT, OneLineParser, reports_bad_input
from megatron_dllm.config.fields import positive_float, positive_int
from megatron_dllm.errors import InputError
from megatron_dllm.model.presets import ALIASES, PAPER_PRESETS, PRESETS
from megatron_dllm.scaling.plan import (
    FAMILY_ORDER,
    PAPER_BUDGETS,
    PAPER_FAMILIES,
    PAPER_SETTINGS,
    budget_label,
    plan_isoflop,
    write_manifest,
)


def _commands(runs, args) -> list[str]:
    lines = []
    for r in runs:
        run_dir = os.path.join(args.runs_dir, r.name)
        # --standalone: a free rendezvous port, so commands can run side by side on one machine
        cmd = ["torchrun", "--standalone", "--nproc-per-node", str(args.nproc_per_node), "pretrain_dllm.py",
               "--family", r.family, *(["--block-size", str(r.block_size)] if r.block_size else []),
               "--preset", r.preset, "--seq-length", str(args.seq_length),
               "--global-batch-size", str(args.global_batch_size), "--train-flops", budget_label(r.budget),
               "--flops-convention", args.flops_convention, "--eval-interval", str(r.iterations),
               "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
               "--save", os.path.join(run_dir, "checkpoints"),
               "--tensorboard-dir", os.path.join(run_dir, "tensorboard")]
        lines.append(f"mkdir -p {shlex.quote(run_dir)} && {shlex.join(cmd)} {args.extra_args}".rstrip())
    return lines


def _table(runs) -> str:
    header = (f"{'name':<28} {'family':<6} {'preset':<9} {'params':>13} {'iters':>9} "
              f"{'tokens':>15} {'tok/param':>9} {'FLOPs':>10}")
    rows = [f"{r.name:<28} {r.family:<6} {r.preset:<9} {r.non_embedding_params:>13,} {r.iterations:>9,} "
            f"{r.tokens:>15,} {r.tokens_per_param:>9.2f} {r.flops:>10.4g}" for r in runs]
    return "\n".join([header, *rows])


@reports_bad_input()
def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=positive_float, nargs="+", default=list(PAPER_BUDGETS),
                        help="training FLOPs budgets (default: the paper's 6e18 1e19 3e19 6e19 1e20)")
    parser.add_argument("--families", nargs="+", default=list(PAPER_FAMILIES), choices=FAMILY_ORDER,
                        help="default: the paper's four (bd3lm only when named, with --block-sizes)")
    parser.add_argument("--block-sizes", type=positive_int, nargs="+", default=[],
                        help="--families bd3lm: one series per block size (each must divide --seq-length)")
    parser.add_argument("--presets", nargs="+", default=list(PAPER_PRESETS),
                        help="default: the paper's 28 sizes; cpu-micro ... cpu-base for CPU sweeps")
    parser.add_argument("--seq-length", type=positive_int, default=PAPER_SETTINGS["seq_length"])
    parser.add_argument("--global-batch-size", type=positive_int, default=PAPER_SETTINGS["global_batch_size"])
    parser.add_argument("--vocab-size", type=positive_int, default=PAPER_SETTINGS["vocab_size"],
                        help="the tokenizer's vocabulary including [MASK] (paper: 32001)")
    parser.add_argument("--flops-convention", choices=["calflops", "full"], default="calflops")
    parser.add_argument("--min-tokens-per-param", type=float, default=None,
                        help="drop runs below this many training tokens per non-embedding parameter "
                             "(the paper states no bound)")
    parser.add_argument("--max-tokens-per-param", type=float, default=None)
    parser.add_argument("--format", choices=["table", "commands", "json"], default="table")
    parser.add_argument("--runs-dir", default="runs/isoflop", help="commands: one directory per run here")
    parser.add_argument("--nproc-per-node", type=positive_int, default=8)
    parser.add_argument("--extra-args", default="",
                        help="appended to every command (data, tokenizer, precision, parallelism flags; a "
                             "single flag as --extra-args=--bf16)")
    parser.add_argument("--manifest", default=None, help="also write the run manifest for tools/scaling_laws.py")
    args = parser.parse_args(argv)
    unknown = [p for p in args.presets if p not in PRESETS and p not in ALIASES]
    if unknown:
        parser.error(f"--presets: unknown {', '.join(unknown)}; expected names from: {', '.join(PRESETS)}")

    try:
        runs, dropped = plan_isoflop(args.budgets, args.families, args.presets, seq_length=args.seq_length,
                                     global_batch_size=args.global_batch_size, vocab_size=args.vocab_size,
                                     convention=args.flops_convention, min_tokens_per_param=args.min_tokens_per_param,
                                     max_tokens_per_param=args.max_tokens_per_param, block_sizes=args.block_sizes)
    except InputError as err:
        parser.error(str(err))
    if not runs:
        parser.error(f"no run is left to plan: all {len(dropped)} were dropped (first: {dropped[0][0].name}, "
                     f"{dropped[0][1]})")
    if args.manifest:
        try:
            write_manifest(args.manifest, runs, args.runs_dir, seq_length=args.seq_length,
                           global_batch_size=args.global_batch_size, vocab_size=args.vocab_size,
                           flops_convention=args.flops_convention)
        except BAD_INPUT as err:
            parser.error(f"--manifest {args.manifest}: cannot write it ({getattr(err, 'strerror', None) or err})")
    if args.format == "json":
        print(json.dumps({"runs": [{**vars(r), "tokens_per_param": r.tokens_per_param} for r in runs],
                          "dropped": [{"name": r.name, "reason": why} for r, why in dropped]}, indent=1))
        return
    print("\n".join(_commands(runs, args)) if args.format == "commands" else _table(runs))
    for r, why in dropped:
        print(f"# dropped {r.name}: {why}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
