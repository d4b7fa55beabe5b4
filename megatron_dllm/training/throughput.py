"""How fast a run goes: tokens/s, TFLOP/s per device, MFU (only where the device has a known
peak: on a CPU it would mean nothing and is left out), peak memory, per-phase times from
megatron-core's timers, the ETA, and the cumulative training FLOPs.

    meter.start(iteration)                 # before the first iteration of this process
    report = meter.measure(iteration)      # at a log interval: rates since the last measure
    with meter.paused():                   # around a save or a validation: not training time
        ...
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from megatron_dllm import platform
from megatron_dllm.config import RunConfig
from megatron_dllm.scaling.flops import train_flops_per_sequence
from megatron_dllm.training import observability


@dataclass(frozen=True)
class Rates:
    tokens_per_s: float
    tflops: float  # per device, counting every matmul the hardware runs
    mfu: float | None  # None without a known peak


def rates(iterations: int, seconds: float, tokens_per_iteration: int, flops_per_iteration: float,
          world_size: int, peak_flops: float | None) -> Rates:
    tflops = iterations * flops_per_iteration / seconds / 1e12 / world_size
    return Rates(iterations * tokens_per_iteration / seconds, tflops,
                 tflops * 1e12 / peak_flops if peak_flops else None)


@dataclass(frozen=True)
class Report:
    rates: Rates
    text: str  # appended to the log line
    extra: dict  # metrics-file values
    scalars: dict  # TensorBoard/W&B scalars under Megatron-LM's names


class ThroughputMeter:
    def __init__(self, config: RunConfig, vocab_size: int, world_size: int, clock=time.perf_counter):
        training, seq, preset = config.training, config.model.backbone_length(), config.preset()
        self.tokens_per_iteration = training.global_batch_size * config.model.seq_length
        # TFLOP/s counts every matmul the hardware runs; the cumulative FLOPs use the budget's convention.
        gpt = config.gpt_shape()
        self.flops_per_iteration = (training.global_batch_size
                                    * train_flops_per_sequence(preset, vocab_size, seq, "full", gpt))
        self.budget_flops_per_sample = train_flops_per_sequence(preset, vocab_size, seq, training.flops_convention,
                                                                gpt)
        self.peak_flops, self.peak_source = observability.peak_flops(config.logging.peak_flops,
                                                                     config.precision.fp8_format is not None)
        self.timers = observability.make_timers(config.logging.timing_log_level)
        self.world_size, self.total_iterations, self.clock = world_size, training.train_iters, clock
        self.first = self.last = 0
        self.loop_start = self.tick = clock()
        # the interval's training time and phase milliseconds from before its pauses
        self.banked_seconds, self.banked_phases = 0.0, {}

    def start(self, iteration: int) -> None:
        self.first = self.last = iteration
        self.loop_start = self.tick = self.clock()

    @contextmanager
    def paused(self, discard_phase_times: bool = False):
        """What runs inside (a validation, a save) is not training time: the interval's training
        time and phase times so far are banked first. A validation also runs timed phases (the
        schedule), whose times `discard_phase_times` drops."""
        platform.synchronize()  # the training steps queued before it belong to the interval
        self.banked_seconds += self.clock() - self.tick
        self._bank_phases()
        try:
            yield
        finally:
            if discard_phase_times:
                observability.phase_times(self.timers, 1)
            self.tick = self.clock()

    def _bank_phases(self) -> dict:
        """The interval's phase milliseconds (totals), the timers read and reset."""
        for phase, ms in observability.phase_times(self.timers, 1).items():
            self.banked_phases[phase] = self.banked_phases.get(phase, 0.0) + ms
        return self.banked_phases

    def cumulative_flops(self, consumed_samples: int) -> int:
        """Training FLOPs so far (--flops-convention), from the consumed samples so resumes continue."""
        return consumed_samples * self.budget_flops_per_sample

    def measure(self, iteration: int) -> Report:
        """Rates, peak memory, phase times and ETA since the last measure (waits for the device)."""
        platform.synchronize()
        now = self.clock()
        steps, elapsed = iteration - self.last, self.banked_seconds + now - self.tick
        r = rates(steps, elapsed, self.tokens_per_iteration, self.flops_per_iteration, self.world_size,
                  self.peak_flops)
        eta = (now - self.loop_start) / (iteration - self.first) * (self.total_iterations - iteration)
        phases = {phase: ms / steps for phase, ms in self._bank_phases().items()}
        self.banked_seconds, self.banked_phases = 0.0, {}
        memory, measured = platform.peak_memory()
        text = ((f" | MFU {r.mfu:.1%}" if r.mfu is not None else "")
                + f" | peak memory {memory / 2**30:.2f} GiB ({measured})"
                + (" | ms per iteration: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) if phases else "")
                + f" | ETA {observability.format_eta(eta)}")
        mfu = {} if r.mfu is None else {"mfu": r.mfu}
        extra = {**mfu, "peak_memory_bytes": memory, "eta_seconds": eta, **{f"{k}_ms": v for k, v in phases.items()}}
        scalars = {"iteration-time": elapsed / steps, "mem-max-allocated-bytes": memory, **mfu,
                   **{f"{observability.PHASES[k]}-time": v / 1000 for k, v in phases.items()}}
        self.last, self.tick = iteration, self.clock()
        return Report(r, text, extra, scalars)
