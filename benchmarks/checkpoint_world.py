"""Shared by bench_checkpoint_manifest.py and bench_async_save.py: their flags, and a 1-process world
holding a paper preset's weights plus two AdamW moments of the same shapes, with a scratch directory."""
from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile

import harness
import torch


def parse_args(doc: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="116M")
    p.add_argument("--vocab", type=int, default=32001)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=harness.existing_dir, default=None,
                   help="where to write (default: a temporary directory)")
    return p.parse_args(argv)


def training_state(preset_name: str, vocab: int):
    """(sharded state dict of the weights and AdamW moments, its size in bytes)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.presets import get_preset

    arch = Architecture(get_preset(preset_name), vocab, 2048, "bidirectional")
    config, mlp_config = transformer_config(arch)
    model = build_model(arch, config, mlp_config, seed=0)[0]
    # AdamW keeps two fp32 moments per parameter: random tensors of the same shapes stand in for them
    state = {"model": model.sharded_state_dict()}
    for moment in ("exp_avg", "exp_avg_sq"):
        state[moment] = {name: ShardedTensor.from_rank_offsets(f"{moment}.{name}", torch.randn_like(param.data))
                         for name, param in model.named_parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    return state, nbytes


@contextlib.contextmanager
def checkpoint_world(args: argparse.Namespace, prefix: str):
    """(state, its bytes, a scratch directory under `--dir`) in a 1-process world, torn down after."""
    from megatron_dllm import platform

    platform.init_distributed(1, 1)
    state, nbytes = training_state(args.preset, args.vocab)
    root = tempfile.mkdtemp(dir=args.dir, prefix=prefix)
    try:
        yield state, nbytes, root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        platform.destroy_distributed()
