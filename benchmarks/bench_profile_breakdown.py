"""Where the training step's time goes: matmul, attention, elementwise/normalisation, loss head,
optimizer, communication, input wait, other, as a markdown table of ms per step and shares.

    python benchmarks/bench_profile_breakdown.py [--steps 5] [--warmup 3] [--trace trace.json]
                                                 [pretrain_dllm.py flags ...]

    # CPU default: the demo run (embedded Shakespeare corpus, cpu-small, 8 x 128, 4 micro-batches)
    python benchmarks/bench_profile_breakdown.py --attention-backend sdpa
    # one GPU: the 1.7B step (see docs/gpu.md)
    python benchmarks/bench_profile_breakdown.py --preset 1.7B --seq-length 2048 --bf16 \\
        --micro-batch-size 1 --global-batch-size 8 --attention-backend sdpa

Every flag other than the three above is a `pretrain_dllm.py` flag and goes through the same
parser, and the run is built exactly as `pretrain_dllm.py` builds it (`Trainer(config)`); with no
data flags that is the embedded demo corpus. `--train-iters` defaults to the steps run here, and
`--save`/`--tensorboard-dir` to a temporary directory (nothing is saved). After `--warmup` steps,
`--steps` steps are timed without the profiler, then `--steps` more run under torch.profiler
(CPU, plus CUDA on a GPU) and are broken down by `megatron_dllm/training/profile_breakdown.py`
(its docstring states the rule: each microsecond in exactly one category). The profiler's own
overhead is part of the profiled steps; the header line gives both step times.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.cli import OneLineParser, fail  # noqa: E402
from megatron_dllm.config import parse_args  # noqa: E402
from megatron_dllm.config.fields import positive_int  # noqa: E402
from megatron_dllm.training.profile_breakdown import profile_steps  # noqa: E402

ITERATION_FLAGS = ("--train-iters", "--train-samples", "--train-flops")


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps, and as many profiled ones")
    p.add_argument("--warmup", type=positive_int, default=3, help="steps before any timing")
    p.add_argument("--trace", help="write the profiled steps' Chrome trace (Perfetto, chrome://tracing) here")
    args, pretrain_argv = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    needed = args.warmup + 2 * args.steps
    with tempfile.TemporaryDirectory(prefix="profile-breakdown-") as tmp:
        defaults = {"--save": os.path.join(tmp, "checkpoints"), "--tensorboard-dir": os.path.join(tmp, "tb"),
                    "--train-iters": str(needed)}
        for flag, value in defaults.items():
            given = ITERATION_FLAGS if flag == "--train-iters" else (flag,)
            if not any(a == f or a.startswith(f + "=") for a in pretrain_argv for f in given):
                pretrain_argv += [flag, value]
        config = parse_args(pretrain_argv)  # a bad pretrain flag: one `error:` line, exit 2
        try:
            return _run(config, args, needed)
        except ValueError as err:
            return fail(str(err))
        finally:
            platform.destroy_distributed()


def _run(config, args, needed: int) -> int:
    from megatron_dllm.training.trainer import Trainer

    trainer = Trainer(config)
    iters = trainer.config.training.train_iters
    if iters < needed:  # the datasets hold no more samples than the iterations ask for
        return fail(f"--train-iters {iters} is fewer than --warmup + 2 x --steps = {needed}, the steps run here")
    for _ in range(args.warmup):
        trainer.train_step()
    plain = []
    for _ in range(args.steps):
        platform.synchronize()
        start = time.perf_counter()
        trainer.train_step()
        platform.synchronize()
        plain.append(time.perf_counter() - start)
    result = profile_steps(trainer, args.steps, trace=args.trace)
    if dist.get_rank() != 0:
        return 0
    config, training = trainer.config, trainer.config.training
    print(f"{platform.device_name() or f'CPU, {torch.get_num_threads()} threads'}, torch {torch.__version__} | "
          f"{trainer.family.name}, preset {config.model.preset}, seq {config.model.seq_length}, micro-batch "
          f"{training.micro_batch_size} x {trainer.train_batches.num_microbatches} per step, "
          f"vocab {trainer.arch.vocab_size}, "
          f"{'bf16' if config.precision.bf16 and platform.HAS_CUDA else 'fp32'}, layers {trainer.layer_impl}, "
          f"world size {dist.get_world_size()} (rank 0 shown)")
    print(f"{args.warmup} warm-up steps; step {statistics.median(plain) * 1e3:.1f} ms without the profiler "
          f"(median of {args.steps}), {result.total_us / result.steps / 1e3:.1f} ms under it "
          f"(mean of {result.steps}); times: {result.clock}\n")
    print(result.table())
    if result.device_idle_us is not None:
        print(f"\nof `other`: device idle (no kernel running, host not fetching input) "
              f"{result.device_idle_us / result.steps / 1e3:.2f} ms per step")
    if args.trace:
        print(f"\nwrote the Chrome trace of the profiled steps to {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
