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
# finalisation record theirs through TransformerConfig.timers; the trainer adds the others); the
# last two are the schedule's level-2 parts (--timing-log-level 2)
PHASES = {"data": "batch-generator", "forward-backward": "forward-backward", "grads-sync": "all-grads-sync",
          "optimizer": "optimizer", "forward-compute": "forward-compute", "backward-compute": "backward-compute"}


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


class EventTimer(Timer):
    """megatron-core's Timer measured between CUDA events on the current stream instead of across
    two device synchronisations: `start` and `stop` only record, so the host keeps running ahead of
    the GPU; `elapsed` (at a log line, where the meter waits for the device anyway) reads the spans.
    Once more than PENDING spans are unread, those the GPU has finished are read as more are
    recorded, so a long log interval keeps few events."""

    PENDING = 64  # spans kept before the completed ones are folded into the elapsed time

    def __init__(self, name):
        super().__init__(name)
        self._spans = []  # (start, stop) events not yet read

    def _event(self, barrier: bool):
        if barrier:
            dist.barrier(group=self._barrier_group)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, barrier=False):
        assert not self._started, "timer has already been started"
        self._begin, self._started = self._event(barrier), True

    def stop(self, barrier=False):
        assert self._started, "timer is not started"
        self._spans.append((self._begin, self._event(barrier)))
        self._started = False
        while len(self._spans) > self.PENDING and self._spans[0][1].query():
            self._fold(self._spans.pop(0))

    def _fold(self, span) -> None:
        seconds = span[0].elapsed_time(span[1]) / 1000
        self._elapsed += seconds
        self._active_time += seconds

    def _read(self) -> None:
        for _, end in reversed(self._spans):  # the latest first: on one stream the others are then done
            end.synchronize()
        for span in self._spans:
            self._fold(span)
        self._spans = []

    def reset(self):
        self._spans = []
        super().reset()

    def active_time(self):
        self._read()
        return super().active_time()

    def elapsed(self, reset=True, barrier=False):
        started = self._started
        if started:
            self.stop(barrier=barrier)
        self._read()
        elapsed = self._elapsed
        if reset:
            self.reset()
        if started:
            self.start(barrier=barrier)
        return elapsed


class EventTimers(Timers):
    """megatron-core's Timers whose timers are EventTimers (a HostTimer set in place stays)."""

    def __call__(self, name, log_level=None):
        timer = super().__call__(name, log_level)
        if type(timer) is Timer:  # made just now
            timer = self._timers[name] = EventTimer(name)
        return timer


def make_timers(level: int, device_events: bool = platform.HAS_CUDA) -> Timers:
    """megatron-core's timers at `level`, on a GPU measured by CUDA events (`EventTimer`: no
    synchronisation); the data phase's on the host (HostTimer). On a CPU, whose work the host runs
    in order, megatron-core's Timer times it as it is."""
    timers = (EventTimers if device_events else Timers)(log_level=level, log_option="max")
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

    def __init__(self, logging: LoggingConfig, config: dict, directory: str):
        try:
            import wandb
        except ImportError:
            raise InputError("--wandb-project needs the wandb package (pip install -e '.[wandb]')") from None
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
        self.first = self.last = None  # the iterations profiled

    def before_iteration(self, iteration: int) -> None:
        """`iteration` is the one about to run (1-based, as logged). A run resumed inside the
        window profiles the rest of it."""
        if not self.active:
            return
        if self.prof is None and self.first is None and self.start <= iteration < self.end:
            platform.record_memory_history(True)
            self.prof = torch.profiler.profile(
                activities=platform.profiler_activities(), record_shapes=True, with_stack=False,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.dir, worker_name=f"rank{dist.get_rank()}"))
            self.prof.start()
            self.first = iteration
        elif self.prof is not None and iteration == self.end:
            self.stop()
        elif self.prof is not None:
            self.prof.step()  # ProfilerStep#N marks each iteration in the trace
        if self.prof is not None:
            self.last = iteration

    def stop(self) -> None:
        """At the window's end, or the end of training (which may come first)."""
        if self.prof is None:
            if self.active and self.first is None:
                self.first = 0  # said once
                self.report(f"--profile: no trace: iterations {self.start}-{self.end - 1} are not among those "
                            f"this run trained")
            return
        self.prof.stop()
        self.prof = None
        snapshot = os.path.join(self.dir, f"memory_snapshot_rank{dist.get_rank()}.pickle")
        if platform.dump_memory_snapshot(snapshot):
            self.report(f"wrote CUDA memory snapshot {snapshot}")
        platform.record_memory_history(False)
        self.report(f"wrote torch profiler trace of iterations {self.first}-{self.last} into {self.dir}")
