"""Check a checkpoint's files against its manifest (sizes and SHA-256) and read its metadata, loading no tensor.

    python tools/verify_checkpoint.py CKPT [--ckpt-step N] [--all]

CKPT is a checkpoint root (the checkpoint `--load CKPT` would load is checked) or one
iter_XXXXXXX directory; --all checks every iter_XXXXXXX directory of the root. Prints one line
per checkpoint, with what its metadata says (iteration, consumed samples, model). A missing,
truncated or altered file, a pickle naming anything but checkpoint data (which loading would
refuse rather than run), shards written by different runs (a mixed checkpoint), or metadata
that cannot be read gives `error: ...` naming the files and exit code 2.
"""
import argparse
import sys

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.fields import non_negative_int


@reports_bad_input()
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="checkpoint root or iter_XXXXXXX directory")
    parser.add_argument("--ckpt-step", type=non_negative_int, default=None, help="the iteration to check in a root")
    parser.add_argument("--all", action="store_true", help="check every iter_XXXXXXX directory of the root")
    args = parser.parse_args(argv)

    from megatron_dllm.checkpoint import CheckpointError, layout, manifest, safe_read, writers
    from megatron_dllm.checkpoint.meta import CheckpointMeta

    if args.all and layout.is_checkpoint_dir(args.ckpt):  # one checkpoint is all there is to check
        paths = [args.ckpt]
    elif args.all:
        paths = list(layout.iterations(args.ckpt).values())
    else:
        found = layout.find_checkpoint(args.ckpt, args.ckpt_step)
        paths = [found.path] if found else []
    if not paths:
        raise CheckpointError(f"{args.ckpt}: no checkpoint there")
    for path in paths:
        if not layout.has_manifest(path):
            raise CheckpointError(f"{path}: no {manifest.MANIFEST} (written by an older version or another "
                                  f"tool): nothing to verify against")
        manifest.verify_manifest(path)
        safe_read.check_no_code(path)
        record = manifest.read_manifest(path)
        writers.check_single_run(path, record.get("run"))
        meta = CheckpointMeta.read(path)  # its pickles passed the allowlist just above
        files, model = record["files"], meta.identity
        print(f"ok {path}: {len(files)} files, {sum(f['size'] for f in files.values())} bytes; iteration "
              f"{meta.iteration}, {meta.consumed_samples} consumed samples, {model.family} "
              f"{model.num_layers}x{model.hidden_size} (vocab {model.vocab_size})"
              + (", weights only" if meta.model_only else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
