"""What a long run reports besides its loss: MFU against the device's peak, peak memory,
per-phase times from megatron-core's timers, an ETA, Weights & Biases, and torch profiler
traces (--profile, with a CUDA memory snapshot on GPU).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from megatron.core.timers import Timer, Timers

from megatron_dllm import platform
from megatron_dllm.config.logs import LoggingConfig
from megatron_dllm.errors import InputError

# Dense peak FLOP/s per device from the vendors' datasheets: (bf16, fp8). Sparse figures (twice
# these) are never the denominator of MFU. The first name contained in the device's name wins.
PEAK_FLOPS = {
    "GH200": (989e12, 1979e12),
    "H200": (989e12, 1979e12),
    "H100 PCIe": (756e12, 1513e12),
    "H100 NVL": (835e12, 1671e12),
    "H100": (989e12, 1979e12),
    "H800": (989e12, 1979e12),
    "B200": (2250e12, 4500e12),
    "B100": (1750e12, 3500e12),
    "A100": (312e12, None),
    "A800": (312e12, None),
    "L40S": (362e12, 733e12),
    "L4": (121e12, 242e12),
}

# megatron-core's timer names for the phases of an iteration (the schedule and the gradient
# finalisation record theirs through TransformerConfig.timers; the trainer adds the others)
PHASES = {"data": "batch-generator", "forward-backward": "forward-backward", "grads-sync": "all-grads-sync",
          "optimizer": "optimizer"}


def peak_flops(override: float | None, fp8: bool) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where it comes from) for MFU."""
    if override:
        return override, f"--peak-flops {override:.4g}"
    name = platform.device_name()
    if name is None:
        return None, "CPU: MFU is not meaningful (no peak FLOP/s to compare with)"
    for key, (bf16, fp8_peak) in PEAK_FLOPS.items():
        if key in name:
            if fp8 and fp8_peak:
                return fp8_peak, f"{name}: dense FP8 peak {fp8_peak / 1e12:.0f} TFLOP/s"
            return bf16, f"{name}: dense BF16 peak {bf16 / 1e12:.0f} TFLOP/s"
    return None, f"{name}: peak FLOP/s unknown (give --peak-flops for MFU)"


class HostTimer(Timer):
    """megatron-core's Timer without the device synchronisation its start and stop make. The data
    phase runs once per micro-batch, and a synchronisation there would drain the GPU's queue before
    every fetch (Megatron-LM keeps its batch-generator timer at level 2 for that reason). Timed on
    the host, it still measures what the GPU would wait for if the host fell behind."""

    def start(self, barrier=False):
        assert not self._started and not barrier, "the host timer neither nests nor takes a barrier"
        self._start_time, self._started = time.time(), True

    def stop(self, barrier=False):
        assert self._started and not barrier, "the host timer was not started"
        elapsed = time.time() - self._start_time
        self._elapsed += elapsed
        self._active_time += elapsed
        self._started = False


def make_timers(level: int) -> Timers:
    """megatron-core's timers at `level`; the data phase's on the host (HostTimer)."""
    timers = Timers(log_level=level, log_option="max")
    if level >= 1:
        timers._timers[PHASES["data"]], timers._log_levels[PHASES["data"]] = HostTimer(PHASES["data"]), 1
    return timers


def phase_times(timers: Timers, iterations: int) -> dict[str, float]:
    """Mean milliseconds per iteration of each phase since the last call, on this rank (resets);
    a phase that has not run in this process is left out."""
    out = {}
    for phase, name in PHASES.items():
        if name in timers._timers and timers._timers[name].active_time() > 0:
            out[phase] = timers._timers[name].elapsed(reset=True) * 1000 / max(iterations, 1)
    return out


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{hours:02d}:{minutes:02d}:{secs:02d}"


class WandbWriter:
    """TensorBoard's add_scalar onto a W&B run (last rank), with the resolved config attached.
    wandb is an optional extra; WANDB_MODE=offline works without a network."""

    def __init__(self, logging: LoggingConfig, config: dict, default_dir: str):
        try:
            import wandb
        except ImportError:
            raise InputError("--wandb-project needs the wandb package (pip install -e '.[wandb]')") from None
        directory = logging.wandb_save_dir or default_dir
        os.makedirs(directory, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name, dir=directory, config=config)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class Profiler:
    """torch.profiler over iterations [--profile-step-start, --profile-step-end) on
    --profile-ranks, as Megatron-LM's --use-pytorch-profiler: a trace per rank into
    --tensorboard-dir, plus a CUDA memory snapshot there on GPU."""

    def __init__(self, logging: LoggingConfig, report=print):
        self.active = logging.profile and dist.get_rank() in (logging.profile_ranks or [0])
        self.start, self.end, self.dir, self.report = logging.profile_step_start, logging.profile_step_end, \
            logging.tensorboard_dir, report
        self.prof = None

    def before_iteration(self, iteration: int) -> None:
        """`iteration` is the one about to run (1-based, as logged)."""
        if not self.active:
            return
        if iteration == self.start:
            platform.record_memory_history(True)
            self.prof = torch.profiler.profile(
                activities=platform.profiler_activities(), record_shapes=True, with_stack=False,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.dir, worker_name=f"rank{dist.get_rank()}"))
            self.prof.start()
        elif iteration == self.end:
            self.stop()

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.stop()
        self.prof = None
        snapshot = os.path.join(self.dir, f"memory_snapshot_rank{dist.get_rank()}.pickle")
        if platform.dump_memory_snapshot(snapshot):
            self.report(f"wrote CUDA memory snapshot {snapshot}")
        platform.record_memory_history(False)
        self.report(f"wrote torch profiler trace of iterations {self.start}-{self.end - 1} into {self.dir}")
