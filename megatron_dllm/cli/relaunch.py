"""Re-launch a run from the resolved configuration it wrote beside its checkpoints:

    python tools/relaunch.py runs/demo-mdlm/checkpoints/run_config.yaml            # same world size
    python tools/relaunch.py CONFIG --nproc-per-node 4 -- --exit-interval 500       # flags override
    python tools/relaunch.py CONFIG -- --train-iters 600 --override-opt-param-scheduler  # a longer run

It starts `torchrun --standalone --nproc-per-node N pretrain_dllm.py --yaml-cfg CONFIG [FLAGS]`
on this machine, N defaulting to the world size the run was launched with (its `launch:`
section), in the directory the run was launched from (also recorded there), so that the file's
relative paths (and those of the FLAGS) mean what they meant. The run continues from its last
checkpoint: a file with `--save` but no `--load` gets `--load` equal to `--save` (Megatron's
resume idiom); a run that has saved (its own run_config.yaml, which its first save writes into
`--save`, is the file given, or the copy beside its logs once `--save` holds the same)
continues from its `--save`, without the file's flags of its first load (`--finetune`,
`--ckpt-step`, `--no-load-optim`, `--no-load-rng`, `--load` elsewhere or of one checkpoint,
`DIR/iter_N`), which would load that checkpoint again and save over the newer ones. A flag of
the optimizer's settings (a longer --train-iters lengthens the LR decay) needs
--override-opt-param-scheduler, as any resume does. Multi-node runs pass `--yaml-cfg CONFIG` to
their own launcher.
"""
from __future__ import annotations

import filecmp
import os
import shlex
import subprocess
import sys
from contextlib import chdir

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import OneLineParser, fail, reports_bad_input
from megatron_dllm.config.fields import positive_int

# the flags of a run's first load from elsewhere, which its continuation from --save drops
FIRST_LOAD_FLAGS = {"--load", "--finetune", "--ckpt-step", "--no-load-optim", "--no-load-rng"}
PRETRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "pretrain_dllm.py")


@reports_bad_input()
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0],
                           usage="relaunch.py CONFIG [--nproc-per-node N] [--dry-run] [-- PRETRAIN FLAGS ...]")
    parser.add_argument("config", help="a run's run_config.yaml (or any --yaml-cfg file)")
    parser.add_argument("--nproc-per-node", type=positive_int, default=None,
                        help="ranks on this machine (default: the world size in the file's launch: section)")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)  # after --: pretrain_dllm.py flags
    args = parser.parse_args(argv[:split])
    args.flags = argv[split + 1:]

    from megatron_dllm.checkpoint.store import holds_checkpoint
    from megatron_dllm.config import build_parser, parse_args
    from megatron_dllm.config.run import expand_run_yaml
    from megatron_dllm.config.yaml_config import RESOLVED_NAME, YamlFile

    launch = YamlFile(args.config, what=None).launch()
    nproc = args.nproc_per_node or launch.get("world-size")
    if not nproc:
        return fail(f"{args.config} records no world size (no launch: section); pass --nproc-per-node")
    directory = launch.get("directory", os.getcwd())  # files written before it was recorded: here
    if not os.path.isdir(directory):
        return fail(f"{args.config}: the run was launched from {directory}, which no longer exists; its relative "
                    f"paths mean nothing elsewhere (edit launch: directory)")
    checkpoint = parse_args(["--yaml-cfg", args.config, *args.flags]).checkpoint  # bad flags fail here
    run = ["--yaml-cfg", os.path.abspath(args.config)]
    flags = list(args.flags)
    if checkpoint.save and not checkpoint.load:  # a run started without --load resumes from its --save
        flags += ["--load", checkpoint.save]
    elif checkpoint.save:
        written_in = os.path.dirname(os.path.realpath(args.config))  # a link to the file: where it is
        config_path = os.path.abspath(args.config)  # before the chdir
        with chdir(directory):  # the file's relative paths are the launch directory's
            # a first load: from elsewhere, or going back to one of --save's own checkpoints (DIR/iter_N, --ckpt-step)
            first_load = (checkpoint.finetune or checkpoint.ckpt_step is not None or checkpoint.no_load_optim
                          or checkpoint.no_load_rng
                          or os.path.realpath(checkpoint.load) != os.path.realpath(checkpoint.save))
            # the run's own resolved file, which its first save wrote into --save (or the copy it wrote
            # beside its logs at start, once --save holds the same): it has saved since that load
            saved_copy = os.path.join(checkpoint.save, RESOLVED_NAME)
            own = bool(launch) and (written_in == os.path.realpath(checkpoint.save) or (
                os.path.isfile(saved_copy) and filecmp.cmp(config_path, saved_copy, shallow=False)))
            saved = first_load and own and holds_checkpoint(checkpoint.save)
        if saved:  # it has saved since its first load: it continues from there
            expanded = expand_run_yaml([*run, *flags], build_parser())  # the file's flags, as --yaml-cfg reads them
            run = [t for t in expanded[:len(expanded) - len(flags)] if t.split("=", 1)[0] not in FIRST_LOAD_FLAGS]
            flags = ["--load", checkpoint.save, *flags]  # the FLAGS given still win
            print(f"relaunch: continuing from the run's own checkpoints in {checkpoint.save}, without the flags "
                  f"of its first load from {checkpoint.load}", file=sys.stderr)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           PRETRAIN, *run, *flags]
    if args.dry_run:
        print(f"cd {shlex.quote(directory)} && {shlex.join(cmd)}")
        return 0
    rc = subprocess.call(cmd, cwd=directory)
    return 128 - rc if rc < 0 else rc  # killed by signal N: the shell's 128 + N, which requeue scripts test
