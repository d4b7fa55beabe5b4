"""The optimizer step without TransformerEngine or Apex: megatron-core's own fallback (per-tensor
norm and clipping stand-ins, torch's default AdamW) against what `training/optim.py` installs
(torch's multi-tensor norm and clipping, torch's fused AdamW).

    python benchmarks/bench_optimizer_step.py [--preset 1.7B] [--layers N] [--steps 10] [--rounds 3]

Both variants are built as the trainer builds them (megatron DDP, `get_megatron_optimizer`, bf16
weights where a GPU has bf16), side by side in one process. Their gradient buffers hold the same
random values (large enough that clipping scales them), and `optimizer.step()` alone is timed: the
norm, clipping, AdamW and, in bf16, the copy back to the model's weights. The variants alternate,
round by round. Per step, it also counts the host synchronisations (reads of a device value to
the host) and the ATen operations dispatched; these counts are the same on every device.
`--layers` keeps the preset's parameter tensors per layer while a CPU runs a smaller model: the
counts depend on the number of tensors only.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_kernel_count import OpCounter  # noqa: E402
from megatron.core import utils as megatron_utils  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402
from megatron.core.optimizer import optimizer as megatron_optimizers  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.config.optimizer import OptimizerConfig  # noqa: E402
from megatron_dllm.config.parallel import ParallelConfig  # noqa: E402
from megatron_dllm.model.builder import Architecture, build_model, transformer_config  # noqa: E402
from megatron_dllm.model.presets import Preset, get_preset  # noqa: E402
from megatron_dllm.training.optim import build_optimizer, wrap_ddp  # noqa: E402

MEGATRONS_FALLBACK = {(clip_grads, "l2_norm_impl"): megatron_utils.local_multi_tensor_l2_norm,
                      (clip_grads, "multi_tensor_scale_impl"): megatron_utils.local_multi_tensor_scale,
                      (megatron_optimizers, "multi_tensor_scale_impl"): megatron_utils.local_multi_tensor_scale}


@contextlib.contextmanager
def megatrons_fallback():
    """megatron-core's per-tensor stand-ins in place of what `training/optim.py` installed."""
    ours = {key: getattr(*key) for key in MEGATRONS_FALLBACK}
    for (module, name), impl in MEGATRONS_FALLBACK.items():
        setattr(module, name, impl)
    try:
        yield
    finally:
        for (module, name), impl in ours.items():
            setattr(module, name, impl)


class Variant:
    def __init__(self, name: str, preset: Preset, vocab: int):
        self.name, self.fallback = name, name == "megatron fallback"
        arch = Architecture(preset, vocab, 2048, "bidirectional")
        config, mlp_config = transformer_config(arch, bf16=True)
        self.model = wrap_ddp(build_model(arch, config, mlp_config, seed=0), config, ParallelConfig())
        opt = OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1, clip_grad=1.0)
        self.optimizer, _ = build_optimizer(self.model, config, opt, ParallelConfig(), train_iters=1000)
        if self.fallback:  # the AdamW megatron-core builds: torch's default kernel, steps on the host
            for group in self.optimizer.optimizer.param_groups:
                group.update(fused=None, foreach=None)
        gen = torch.Generator().manual_seed(0)
        for p in self.model[0].parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        self.tensors = sum(1 for _ in self.model[0].parameters())

    def step(self) -> None:
        with megatrons_fallback() if self.fallback else contextlib.nullcontext():
            assert self.optimizer.step()[0]

    def counts(self) -> tuple[int, int]:
        """(host synchronisations, ATen operations) in one step."""
        with OpCounter() as counter:
            self.step()
        return counter.ops[torch.ops.aten._local_scalar_dense], sum(counter.ops.values())

    def time(self, steps: int) -> float:
        platform.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        platform.synchronize()
        return (time.perf_counter() - start) / steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="1.7B" if platform.HAS_CUDA else "cpu-base")
    p.add_argument("--layers", type=int, help="the preset's layers by default")
    p.add_argument("--vocab", type=int, default=32001)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    preset = get_preset(args.preset)
    if args.layers:
        preset = Preset(preset.hidden_size, args.layers, preset.num_attention_heads)
    platform.init_distributed(1, 1, seed=0)
    variants = [Variant(name, preset, args.vocab) for name in ("megatron fallback", "foreach + fused AdamW")]
    params = sum(p.numel() for p in variants[0].model[0].parameters())
    print(f"{platform.device_name() or 'CPU'}, torch {torch.__version__}, preset {args.preset} "
          f"(h {preset.hidden_size}, {preset.num_layers} layers), vocab {args.vocab}: {params / 1e6:.1f}M "
          f"parameters in {variants[0].tensors} tensors, {platform.params_dtype(True)} weights")
    counts = {}
    for v in variants:
        v.step()  # AdamW's state exists from here
        counts[v.name] = v.counts()
    times = collections.defaultdict(list)
    for _ in range(args.rounds):
        for v in variants:
            times[v.name].append(v.time(args.steps))
    base = statistics.median(times[variants[0].name])
    print("\n| optimizer step | host syncs | ATen ops | ms (median of rounds) | x fallback |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        ms = statistics.median(times[v.name])
        print(f"| {v.name} | {counts[v.name][0]} | {counts[v.name][1]} | {ms * 1e3:.1f} | {base / ms:.2f} |")
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
