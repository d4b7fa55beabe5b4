"""What the checkpoint manifest costs: a save with and without it, and the verify step of a load.

A 1-process world saves the weights and AdamW state of a paper preset through
`megatron_dllm.checkpoint.save` (staged directory, SHA-256 manifest, rename, tracker), and the same
state through megatron-core's `dist_checkpointing.save` alone; then it times `verify_manifest`
(what `--load` does before any reader opens a file) against `dist_checkpointing.load`. One
untimed warm-up round first; medians of per-round ratios are reported.

    python benchmarks/bench_checkpoint_manifest.py --preset 116M --rounds 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch


def _state(preset_name: str, vocab: int):
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="116M")
    p.add_argument("--vocab", type=int, default=32001)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)

    from megatron.core import dist_checkpointing

    from megatron_dllm import checkpoint, platform
    from megatron_dllm.checkpoint import manifest

    platform.init_distributed(1, 1)
    state, nbytes = _state(args.preset, args.vocab)
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench-ckpt-")
    rows = {"save": [], "load": []}
    try:
        warm = os.path.join(root, "warm-up")  # first-call costs (thread pools, allocator) out of the figures
        checkpoint.save(warm, 0, state)
        dist_checkpointing.load(state, os.path.join(warm, "iter_0000000"))
        shutil.rmtree(warm)
        for r in range(args.rounds):
            plain = os.path.join(root, f"plain-{r}")
            os.makedirs(plain)
            t0 = time.perf_counter()
            dist_checkpointing.save(state, plain)
            t_plain = time.perf_counter() - t0
            t0 = time.perf_counter()
            path = checkpoint.save(os.path.join(root, f"ours-{r}"), 1, state)
            t_ours = time.perf_counter() - t0
            rows["save"].append((t_plain, t_ours))

            os.sync()
            t0 = time.perf_counter()
            dist_checkpointing.load(state, plain)
            t_load = time.perf_counter() - t0
            t0 = time.perf_counter()
            manifest.verify_manifest(path)
            t_verify = time.perf_counter() - t0
            rows["load"].append((t_load, t_verify))
            shutil.rmtree(plain)
            shutil.rmtree(os.path.join(root, f"ours-{r}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        platform.destroy_distributed()

    print(f"preset {args.preset}, vocab {args.vocab}: {nbytes / 2**20:.0f} MiB of weights + AdamW moments, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    print("| step | megatron-core alone (s) | with manifest (s) | ratio |")
    print("|---|---:|---:|---:|")
    save_plain = statistics.median(a for a, _ in rows["save"])
    save_ours = statistics.median(b for _, b in rows["save"])
    ratio = statistics.median(b / a for a, b in rows["save"])
    print(f"| save (staged + manifest + rename) | {save_plain:.2f} | {save_ours:.2f} | {ratio:.2f} |")
    load = statistics.median(a for a, _ in rows["load"])
    verify = statistics.median(b for _, b in rows["load"])
    ratio = statistics.median(b / a for a, b in rows["load"])
    print(f"| verify before load, vs the load itself | {load:.2f} | {verify:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
