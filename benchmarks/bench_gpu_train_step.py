"""Training-step throughput on one GPU: tokens/s, TFLOP/s, MFU and peak memory per family.

    python benchmarks/bench_gpu_train_step.py [--presets 413M 1.7B] [--families mdlm duo esolm ar]
                                              [--seq 2048] [--vocab 32001] [--max-micro-batch 64]
                                              [--steps 5] [--warmup 2] [--peak-tflops 989.4]
                                              [--recompute-granularity off selective full layernorm+mlp]
                                              [--attention-backend local|sdpa|fused|flash|unfused|auto]
                                              [--transformer-impl local|transformer_engine]
                                              [--fp8-format hybrid|e4m3] [--fp8-recipe delayed|tensorwise|...]
                                              [--fusion default|none|all] [--cuda-graph]
                                              [--[no-]gradient-accumulation-fusion] [--timing-log-level 0|1|2]

For every preset, recompute setting (`--recompute-granularity`, alias `--recompute`: off,
selective = core attention, full = every layer, or modules recomputed selectively such as
layernorm+mlp; default off and full) and family:
`bench_train_step.py`'s `MegatronStep`, i.e. the trainer's own step (`training.step.train_step` on
the model and optimizer that `training.build` makes at TP=1) in bf16 (FP8 linears with
`--fp8-format`) with the local layer spec (or TransformerEngine's), at the largest power-of-two
micro-batch that fits: tried from `--max-micro-batch` (for later families of the same preset and
recompute setting: from the previous family's) down, an out-of-memory step moving to the next
smaller one. The batch is drawn once, on the CPU, and moved to the GPU before timing.

Reported per row: median step time over `--steps` timed steps after `--warmup` ones, each timed
until the GPU has finished the step's kernels, the optimizer's included; tokens/s,
model TFLOP/s in the two conventions of `megatron_dllm/scaling/flops.py` (`calflops`: the paper's,
no attention matmuls; `full`: every matmul incl. attention scores, with causal attention counted
whole), MFU = model TFLOP/s / `--peak-tflops` (H100 SXM dense bf16: 989.4), and the peak memory
torch's allocator saw. Model FLOPs are 3 x forward whether or not activations are recomputed
(recompute runs a fourth forward that is not counted, as in Megatron-LM's MFU).

With `--cuda-graph` the step is the trainer's full-iteration CUDA graph (`training/cuda_graph.py`):
the first warm-up step runs eagerly, the second captures and replays, the timed ones replay.

Without a GPU the script only checks a command (cpu-* presets, fp32, `--max-micro-batch` itself
with no search, since the CPU cannot back off from running out of memory): the runbook's dry run.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_train_step import MegatronStep, make_batch, recompute_setting  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.families import get_family  # noqa: E402
from megatron_dllm.model.attention import TE_BACKENDS  # noqa: E402
from megatron_dllm.model.presets import get_preset  # noqa: E402
from megatron_dllm.scaling.flops import train_flops_per_sequence  # noqa: E402


def _attempt(preset, family, vocab: int, batch: int, seq: int, recompute: str | None, steps: int, warmup: int,
             options: dict):
    """(median step seconds, peak bytes, first loss) at this micro-batch; raises out of memory."""
    inp = make_batch(family, vocab, batch, seq).to(platform.device())
    step = None
    try:
        platform.reset_peak_memory()
        step = MegatronStep(preset, vocab, batch, seq, family, inp, train_iters=warmup + steps + 10,
                            keep_initial=False, bf16=True, recompute=recompute, **options)
        first = step()
        for _ in range(warmup - 1):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()  # returns once the step's kernels (the optimizer's too) have finished
            times.append(time.perf_counter() - t0)
        return statistics.median(times), platform.peak_memory()[0], first
    finally:
        del step, inp
        platform.release_cached_memory()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["413M", "1.7B"])
    p.add_argument("--families", nargs="+", default=["mdlm", "duo", "esolm", "ar"],
                   choices=["mdlm", "duo", "esolm", "ar"],
                   help="of the paper's four families (BD3-LM, which needs a block size, is not timed here)")
    p.add_argument("--recompute-granularity", "--recompute", nargs="+", default=["off", "full"],
                   type=recompute_setting,
                   help="settings to measure: off | selective (core attention) | full (every layer, uniform) | "
                        "modules recomputed selectively, joined by '+' (layernorm+mlp)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32001, help="real vocabulary including [MASK] (the paper's)")
    p.add_argument("--max-micro-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak of the GPU")
    p.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="layer spec (transformer_engine: TransformerEngine's, needs it installed)")
    p.add_argument("--attention-backend", default=None, choices=["local", "sdpa", *TE_BACKENDS],
                   help="core attention (default: local, or auto with --transformer-impl transformer_engine)")
    p.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"],
                   help="TransformerEngine FP8 linears (needs --transformer-impl transformer_engine)")
    p.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"])
    p.add_argument("--fusion", default="default", choices=["default", "none", "all"],
                   help="default: the fusion flags' defaults on this GPU (as the trainer); none: all eager; "
                        "all: compiled regions and bias fusions forced on")
    p.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="the weight gradients added into the fp32 main gradients inside their GEMMs (default: "
                        "the trainer's default on this GPU)")
    p.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=None,
                   help="megatron-core's timers (default: the trainer's, 1; on a GPU each timer at or below "
                        "the level records CUDA events when it starts and stops)")
    p.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="the trainer's NaN guard (its default, as Megatron-LM's): one all-reduce of a flag and "
                        "the step in two halves; --no-... times the step without it")
    p.add_argument("--cuda-graph", action="store_true",
                   help="the trainer's full-iteration CUDA graph (--cuda-graph-scope full_iteration), captured at "
                        "the second warm-up step")
    args = p.parse_args(argv)
    if args.cuda_graph and args.warmup < 2:
        p.error("--cuda-graph needs --warmup 2 or more (the first step runs eagerly, the second captures)")
    if args.cuda_graph and not platform.HAS_CUDA:
        p.error("--cuda-graph needs a CUDA GPU (none found)")
    te = args.transformer_impl == "transformer_engine"
    backend = args.attention_backend or ("auto" if te else "local")
    if args.fp8_format and not te:
        p.error("--fp8-format needs --transformer-impl transformer_engine")
    if te and not platform.HAS_TE:
        p.error("--transformer-impl transformer_engine needs TransformerEngine on a CUDA GPU (not importable here)")
    if backend in TE_BACKENDS and not te:
        p.error(f"--attention-backend {backend} needs --transformer-impl transformer_engine")
    if not platform.HAS_CUDA and not all(name.startswith("cpu-") for name in args.presets):
        p.error("measures a CUDA GPU; without one it only checks the command, with cpu-* presets "
                f"(got {' '.join(args.presets)})")
    options = {"attention_backend": backend, "fusion": args.fusion, "transformer_impl": args.transformer_impl,
               "fp8": args.fp8_format, "fp8_recipe": args.fp8_recipe, "cuda_graph": args.cuda_graph,
               "gradient_accumulation_fusion": args.gradient_accumulation_fusion,
               "timing_log_level": args.timing_log_level,
               "extra_flags": () if args.check_for_nan_in_loss_and_grad else ("--no-check-for-nan-in-loss-and-grad",)}
    precision = f"fp8 {args.fp8_format} ({args.fp8_recipe})" if args.fp8_format else "bf16"

    platform.init_distributed(1, 1, seed=0)
    device = platform.device_name() or "CPU (a check of the command, not a measurement: fp32, no search)"
    print(f"{device}, torch {torch.__version__}, seq {args.seq}, vocab {args.vocab}, {precision}, "
          f"{args.transformer_impl} spec, {backend} core attention, fusion {args.fusion}, gradient-accumulation "
          f"fusion {({None: 'default', True: 'on', False: 'off'})[args.gradient_accumulation_fusion]}, "
          f"{'full-iteration CUDA graph, ' if args.cuda_graph else ''}"
          f"timing log level {'default' if args.timing_log_level is None else args.timing_log_level}, "
          f"NaN guard {'on' if args.check_for_nan_in_loss_and_grad else 'off'}, "
          f"{args.warmup} warm-up + {args.steps} timed steps (median)\n")
    print("| preset | family | recompute | micro-batch | step (ms) | tokens/s | TFLOP/s calflops | "
          "MFU calflops | TFLOP/s full | MFU full | peak memory (GiB) | first loss |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for name in args.presets:
            preset = get_preset(name)
            for recompute in args.recompute_granularity:
                batch = args.max_micro_batch
                for fam_name in args.families:
                    family = get_family(fam_name, args.vocab - 1, args.vocab)
                    attempt = functools.partial(_attempt, preset, family, args.vocab, seq=args.seq,
                                                recompute=None if recompute == "off" else recompute,
                                                steps=args.steps, warmup=args.warmup, options=options)
                    found = platform.halve_until_it_fits(attempt, batch)
                    if found is None:
                        print(f"| {name} | {fam_name} | {recompute} | none fits | | | | | | | | |", flush=True)
                        batch = args.max_micro_batch
                        continue
                    batch, (sec, peak, loss) = found
                    tokens = batch * args.seq
                    flops = {c: batch * train_flops_per_sequence(preset, args.vocab, args.seq, c) / sec / 1e12
                             for c in ("calflops", "full")}
                    print(f"| {name} | {fam_name} | {recompute} | {batch} | {sec * 1e3:.0f} | {tokens / sec:,.0f} "
                          f"| {flops['calflops']:.0f} | {flops['calflops'] / args.peak_tflops:.1%} "
                          f"| {flops['full']:.0f} | {flops['full'] / args.peak_tflops:.1%} "
                          f"| {peak / 2**30:.1f} | {loss:.3f} |", flush=True)
    finally:
        platform.destroy_distributed()


if __name__ == "__main__":
    main()
