"""Check a checkpoint's files against its manifest (sizes and SHA-256) and read its metadata, loading no tensor.

    python tools/verify_checkpoint.py CKPT [--ckpt-step N] [--all]

CKPT is a checkpoint root (the checkpoint `--load CKPT` would load is checked) or one
iter_XXXXXXX directory; --all checks every iter_XXXXXXX directory of the root (and its tracker,
as --load reads it). Prints one line per checkpoint, with what its metadata says (iteration,
consumed samples, model). A missing, truncated or altered file, a manifest of another iteration
than the directory's name, a pickle naming anything but checkpoint data (which loading would
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

    from megatron_dllm.checkpoint import CheckpointError, layout, manifest, store
    from megatron_dllm.checkpoint.meta import CheckpointMeta

    if args.all and args.ckpt_step is not None:
        raise CheckpointError("--all checks every checkpoint of the root; --ckpt-step names one: give one of them")
    loaded = layout.find_checkpoint(args.ckpt, args.ckpt_step)  # a tracker --load would refuse is refused here too
    if args.all and not layout.is_checkpoint_dir(args.ckpt):
        found = [layout.Found(path, it, "--all") for it, path in layout.iterations(args.ckpt).items()]
    else:
        found = [loaded] if loaded else []
    if not found:
        raise CheckpointError(f"{args.ckpt}: no checkpoint there")
    for checkpoint in found:
        store.check_files(checkpoint, unverified=False)
        path, files = checkpoint.path, manifest.read_manifest(checkpoint.path)["files"]
        meta = CheckpointMeta.read(path)  # its pickles passed the allowlist just above
        model = meta.identity
        print(f"ok {path}: {len(files)} files, {sum(f['size'] for f in files.values())} bytes; iteration "
              f"{meta.iteration}, {meta.consumed_samples} consumed samples, {model.family} "
              f"{model.num_layers}x{model.hidden_size} (vocab {model.vocab_size})"
              + (", weights only" if meta.model_only else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
