"""The ThroughputMeter's arithmetic against hand-computed values: tokens/s, TFLOP/s per device,
MFU against a given peak (and none without one), ETA and the cumulative FLOPs; the data phase's
timer, which never synchronises the device."""
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_dllm.config import parse_args
from megatron_dllm.training import observability, step, throughput
from megatron_dllm.training.throughput import ThroughputMeter, rates

# cpu-micro (h 32, L 2) at s 16, V 100, conditioning c 128, sinusoid f 256 (scaling/flops.py):
#   full     forward L (24 s h^2 + 4 s^2 h + 12 c h) + 2 s h V + 4 c h + 2 (f c + c^2)
#                    = 2 (393216 + 32768 + 49152) + 102400 + 16384 + 98304 = 1,167,360
#   calflops forward L (24 s h^2 + 12 s h + 12 c h) + 4 s h + 2 s h V + 4 c h + 2 (f c + c^2) + 2 c
#                    = 2 (393216 + 6144 + 49152) + 2048 + 102400 + 16384 + 98304 + 256 = 1,116,416
# training = 3 x forward
FULL_PER_SEQUENCE, CALFLOPS_PER_SEQUENCE = 3 * 1_167_360, 3 * 1_116_416


def test_rates_are_tokens_and_flops_per_second_per_device_and_their_share_of_the_peak():
    r = rates(iterations=4, seconds=2.0, tokens_per_iteration=512, flops_per_iteration=3e12, world_size=2,
              peak_flops=10e12)
    assert r.tokens_per_s == 1024.0  # 4 x 512 / 2
    assert r.tflops == pytest.approx(3.0)  # 4 x 3e12 / 2 s / 2 devices = 3e12 FLOP/s
    assert r.mfu == pytest.approx(0.3)  # 3e12 / 10e12
    assert rates(4, 2.0, 512, 3e12, 2, peak_flops=None).mfu is None


class Clock:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def _meter(monkeypatch, flags, clock):
    monkeypatch.setattr(observability.platform, "device_name", lambda: None)  # a CPU: no known peak
    monkeypatch.setattr(throughput.platform, "peak_memory", lambda: (2**30, "test peak"))
    cfg = parse_args(["--preset", "cpu-micro", "--seq-length", "16", "--micro-batch-size", "2",
                      "--global-batch-size", "4", "--train-iters", "10", *flags])
    return ThroughputMeter(cfg, vocab_size=100, world_size=1, clock=clock)


def test_the_meter_reports_rates_eta_and_mfu_against_the_given_peak(monkeypatch):
    meter = _meter(monkeypatch, ["--peak-flops", "1e9"], Clock(0.0, 100.0, 102.0, 102.5))
    assert meter.flops_per_iteration == 4 * FULL_PER_SEQUENCE
    meter.start(0)  # at 100 s
    report = meter.measure(4)  # at 102 s: 4 iterations of 4 x 16 tokens in 2 s
    assert report.rates.tokens_per_s == 4 * 4 * 16 / 2.0
    assert report.rates.tflops == pytest.approx(4 * 4 * FULL_PER_SEQUENCE / 2.0 / 1e12)
    assert report.rates.mfu == pytest.approx(4 * 4 * FULL_PER_SEQUENCE / 2.0 / 1e9)  # 2.8%
    # ETA: 2 s for 4 iterations, 6 to go
    assert report.text == " | MFU 2.8% | peak memory 1.00 GiB (test peak) | ETA 00:00:03"
    assert report.extra == {"mfu": report.rates.mfu, "peak_memory_bytes": 2**30, "eta_seconds": 3.0}
    assert report.scalars["mfu"] == report.rates.mfu and report.scalars["iteration-time"] == 0.5
    assert meter.cumulative_flops(consumed_samples=40) == 40 * CALFLOPS_PER_SEQUENCE


def test_the_meter_leaves_mfu_out_without_a_known_peak(monkeypatch):
    meter = _meter(monkeypatch, [], Clock(0.0, 10.0, 11.0, 11.0, 13.0, 13.0))
    assert meter.peak_flops is None
    meter.start(2)  # a resumed run: its rates and ETA count from iteration 2
    first = meter.measure(3)
    assert first.rates.mfu is None and "MFU" not in first.text
    assert "mfu" not in first.extra and "mfu" not in first.scalars
    second = meter.measure(5)  # 2 iterations in 2 s since the last measure
    assert second.rates.tokens_per_s == 2 * 4 * 16 / 2.0
    assert second.extra["eta_seconds"] == pytest.approx(3.0 / 3 * 5)  # 3 s for 3 iterations, 5 to go


def test_a_pause_for_validation_or_a_save_leaves_the_intervals_training_time_and_phases(monkeypatch):
    """Iterations 1-2 train in 2 s, a validation takes 8 s, iterations 3-4 train in 2 s: the log line
    at 4 gives the rates of 4 iterations in 4 s, and the phases of training alone (the validation's
    schedule ran the same timers)."""
    meter = _meter(monkeypatch, [], Clock(0.0, 100.0, 102.0, 110.0, 112.0, 112.0))
    read = iter([{"forward-backward": 20.0},    # the training before the pause (ms, totals)
                 {"forward-backward": 500.0},   # the validation's schedule: dropped
                 {"forward-backward": 20.0}])   # the training after it
    monkeypatch.setattr(observability, "phase_times", lambda timers, iterations: next(read))
    meter.start(0)  # at 100 s
    with meter.paused(discard_phase_times=True):  # from 102 s to 110 s
        pass
    report = meter.measure(4)  # at 112 s
    assert report.rates.tokens_per_s == 4 * 4 * 16 / 4.0
    assert report.scalars["iteration-time"] == 1.0 and report.extra["forward-backward_ms"] == 10.0


def test_the_data_phase_is_timed_on_the_host_and_never_synchronises_the_device(monkeypatch):
    """megatron-core's Timer synchronises the device at each start and stop. The data phase runs once
    per micro-batch, so there that would drain the GPU's queue before every fetch."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: syncs.append(args))
    timers = observability.make_timers(1)

    def batches():
        time.sleep(0.05)  # the host reading and corrupting a micro-batch
        yield SimpleNamespace(input_ids=None, position_ids=None, sigma=None, attention_mask=None)

    step.forward_step(None, True, 64, timers, batches(), lambda *inputs: "logits")
    assert syncs == []
    assert observability.phase_times(timers, 1)["data"] >= 50
    timers("forward-backward", log_level=1).start()  # a phase of its own synchronises, as megatron's does
    assert len(syncs) == 1
    assert "data" not in observability.phase_times(observability.make_timers(0), 1)


class ManualEvent:
    """torch.cuda.Event's part the timers use, on a device whose clock the test sets: an event is
    recorded at `now` ms and completes once `done` has reached it; a synchronisation on one not yet
    complete is a wait, counted, after which the device is done up to it."""
    now, done, waits = 0.0, 0.0, 0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        self.at = ManualEvent.now

    def query(self):
        return self.at <= ManualEvent.done

    def synchronize(self):
        ManualEvent.waits += self.at > ManualEvent.done
        ManualEvent.done = max(ManualEvent.done, self.at)

    def elapsed_time(self, end):
        return end.at - self.at


@pytest.fixture
def device_clock(monkeypatch):
    """ManualEvent as torch.cuda.Event; (synchronisations, barriers) are recorded."""
    syncs, barriers = [], []
    monkeypatch.setattr(torch.cuda, "Event", ManualEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: syncs.append(args))
    monkeypatch.setattr(torch.distributed, "barrier", lambda *args, **kwargs: barriers.append(kwargs))
    monkeypatch.setattr(ManualEvent, "now", 0.0)
    monkeypatch.setattr(ManualEvent, "done", 0.0)
    monkeypatch.setattr(ManualEvent, "waits", 0)
    return syncs, barriers


def test_device_timers_record_events_and_wait_only_when_read(device_clock):
    """On a GPU the phase timers record CUDA events: the host never waits while they start and stop,
    a phase's time is the device's between them, and only reading them waits (for one event)."""
    syncs, barriers = device_clock
    timers = observability.make_timers(1, device_events=True)
    assert isinstance(timers("batch-generator", log_level=1), observability.HostTimer)
    assert timers("forward-compute", log_level=2) is timers._dummy_timer  # above the level: not timed
    phase = timers("forward-backward", log_level=1)
    assert isinstance(phase, observability.EventTimer)
    for _ in range(3 * observability.EventTimer.PENDING):  # the device falls behind the host
        phase.start()
        ManualEvent.now += 5.0
        phase.stop()
        ManualEvent.now += 1.0
    assert syncs == [] and barriers == [] and ManualEvent.waits == 0
    assert len(phase._spans) == 3 * observability.EventTimer.PENDING  # none completed: none read
    ManualEvent.done = ManualEvent.now / 2  # the device has run half of them
    phase.start()
    phase.stop()  # folds the completed ones in, without waiting for the others
    assert len(phase._spans) == 3 * observability.EventTimer.PENDING // 2 + 1 and ManualEvent.waits == 0
    ManualEvent.done = ManualEvent.now
    phase.start()
    phase.stop()  # all completed: PENDING kept
    assert len(phase._spans) == observability.EventTimer.PENDING and ManualEvent.waits == 0
    phase.start()
    ManualEvent.now += 7.0
    # read while running: the running span counts up to now, and the timer goes on running
    assert phase.elapsed(reset=True) * 1000 == pytest.approx(5.0 * 3 * observability.EventTimer.PENDING + 7.0)
    assert ManualEvent.waits == 1 and phase._started and syncs == [] and barriers == []
    ManualEvent.now += 2.0
    phase.stop()
    assert observability.phase_times(timers, 1) == {"forward-backward": pytest.approx(2.0)}
    phase.start()
    phase.stop()
    phase.reset()  # drops what was not read
    assert phase.elapsed() == 0.0


def test_a_training_step_with_device_timers_never_waits_for_the_device(device_clock, world_of_one, monkeypatch):
    """The trainer's step with the GPU's timers: megatron-core's schedule, gradient sync and the
    optimizer's timer start and stop without a synchronisation or a barrier, and every phase is timed."""
    import step_cases

    syncs, barriers = device_clock  # on the host's clock: a CPU runs the step in order
    config, family, built = step_cases.build("mdlm")
    timers = built.transformer_config.timers = observability.make_timers(1, device_events=True)
    monkeypatch.setattr(ManualEvent, "record", lambda event: setattr(event, "at", time.perf_counter() * 1000))
    step.train_step(built.model, built.optimizer, built.scheduler, family,
                    step_cases.Batches(family, config.model.seq_length), 0, config, timers, iteration=1)
    assert syncs == [] and barriers == []
    phases = observability.phase_times(timers, 1)
    assert set(phases) == {"data", "forward-backward", "grads-sync", "optimizer"} and min(phases.values()) > 0


def test_timing_level_2_adds_the_schedules_forward_and_backward_compute(world_of_one):
    import step_cases

    config, family, built = step_cases.build("mdlm")
    for level, extra in ((1, set()), (2, {"forward-compute", "backward-compute"})):
        timers = built.transformer_config.timers = observability.make_timers(level)
        step.train_step(built.model, built.optimizer, built.scheduler, family,
                        step_cases.Batches(family, config.model.seq_length), 0, config, timers, iteration=1)
        phases = observability.phase_times(timers, 1)
        assert set(phases) == {"data", "forward-backward", "grads-sync", "optimizer"} | extra


@pytest.mark.gpu
def test_device_timers_time_the_gpu_without_waiting_for_it():
    """On a GPU: a phase around some 50 ms of device work (a spinning kernel) returns to the host at
    once, and reads the device's time."""
    phase = observability.make_timers(1, device_events=True)("forward-backward", log_level=1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    phase.start()
    torch.cuda._sleep(100_000_000)  # clock cycles: 50-100 ms at an H100's 1-2 GHz
    phase.stop()
    host = time.perf_counter() - start
    assert host < 0.01 and 0.03 < phase.elapsed() < 1.0, host


def test_the_profiler_covers_the_part_of_its_window_a_run_reaches(world_of_one, monkeypatch, tmp_path):
    """A run resumed inside [--profile-step-start, --profile-step-end) profiles the rest of it (the
    trace names the iterations it holds); one that never reaches it says so."""
    calls = []

    class Profile:
        def __init__(self, **options):
            pass

        def start(self):
            calls.append("start")

        def step(self):
            calls.append("step")

        def stop(self):
            calls.append("stop")

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.profiler, "tensorboard_trace_handler", lambda *args, **kwargs: None)
    logging = parse_args(["--profile", "--profile-step-start", "3", "--profile-step-end", "6",
                          "--tensorboard-dir", str(tmp_path)]).logging
    for first, expected, said_last in ((4, ["start", "step", "stop"], f"iterations 4-5 into {tmp_path}"),
                                       (7, [], "--profile: no trace: iterations 3-5 are not among those")):
        calls.clear()
        said = []
        profiler = observability.Profiler(logging, report=said.append)
        for iteration in range(first, 9):
            profiler.before_iteration(iteration)
        profiler.stop()  # the end of training
        assert calls == expected and said_last in said[-1], (calls, said)
