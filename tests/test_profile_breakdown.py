"""The profiler breakdown (`training/profile_breakdown.py`, `benchmarks/bench_profile_breakdown.py`)
against real training steps: the categories partition the steps' wall time; known delays put
into the batch iterator, the family loss and the optimizer step show up in input wait, loss
head and optimizer, each by its own amount; backward ops follow their forward op's region; the
device-timeline rule on hand-made intervals; the link from a kernel to its op on torch versions
whose events lack it; the script end to end and its bad input."""
import json
import os
import time
import types

import pytest
import torch
from conftest import REPO, launch_env, run_python
from torch.autograd import DeviceType

from megatron_dllm import platform
from megatron_dllm.config import parse_args
from megatron_dllm.training.profile_breakdown import (
    CATEGORIES,
    breakdown,
    event_key,
    exclusive_timeline,
    folded_ops,
    kineto_links,
    linked_ids,
    profile_steps,
)
from megatron_dllm.training.profile_regions import ATTENTION, INPUT_WAIT, LOSS_HEAD, OPTIMIZER, STEP
from megatron_dllm.training.trainer import Trainer

BENCH = os.path.join(REPO, "benchmarks", "bench_profile_breakdown.py")
MICRO = ["--preset", "cpu-micro", "--seq-length", "32", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def trainer(demo_cache, tmp_path_factory):
    """A real cpu-micro run over the demo corpus, one micro-batch per step, past its first step."""
    work = tmp_path_factory.mktemp("breakdown")
    cfg = parse_args(["--demo-cache-dir", demo_cache, *MICRO, "--global-batch-size", "2", "--train-iters", "30",
                      "--save", str(work / "ckpt"), "--tensorboard-dir", str(work / "tb")])
    try:
        run = Trainer(cfg)
        run.train_step()
        yield run
    finally:
        platform.destroy_distributed()


@pytest.mark.slow
def test_categories_partition_the_steps_and_backward_follows_the_forward_region(trainer):
    result = profile_steps(trainer, 2)
    assert sum(result.us.values()) == pytest.approx(result.total_us, rel=1e-9)
    assert sum(result.share(c) for c in CATEGORIES) == pytest.approx(100.0)
    assert all(result.us[c] > 0 for c in ("matmul", "attention", "elementwise/normalisation", "loss head",
                                          "optimizer", "input wait", "other"))
    ops = result.top_ops
    # local core attention: its score GEMM and softmax, forward and backward, are attention
    for name in ("aten::baddbmm", "aten::_softmax", "BaddbmmBackward0", "SoftmaxBackward0"):
        assert name in ops["attention"], name
        assert not any(name in ops[c] for c in CATEGORIES if c != "attention"), name
    # the family loss (vocab-parallel cross entropy) and its backward are loss head
    assert "_CrossEntropy" in ops["loss head"]
    assert "_CrossEntropyBackward" in ops["loss head"]
    assert "aten::mm" in ops["matmul"] and "aten::_fused_adamw_" in ops["optimizer"]  # Adam's update
    assert trainer.family.loss.__func__ is type(trainer.family).loss  # the regions came off again


def test_an_in_place_gemm_is_matmul():
    """Gradient-accumulation fusion's weight-gradient GEMM (`addmm_` into the main gradient) is a
    matmul, not elementwise work; the add it replaces is elementwise."""
    a, total = torch.randn(128, 128), torch.zeros(128, 128)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(STEP):
            total.addmm_(a, a)
            total.add_(a)
    ops = breakdown(prof.events(), False, lambda e: 0).top_ops
    assert "aten::addmm_" in ops["matmul"] and "aten::add_" in ops["elementwise/normalisation"]


def test_a_compiled_graph_on_the_cpu_is_elementwise_work():
    """On CPU, TorchInductor's fused kernels (`--compile-elementwise`'s regions) run inside the call
    of its compiled graph, without events of their own: that call's own time is elementwise work,
    the GEMM it hands to ATen matmul, and dynamo's and AOTAutograd's wrappers other."""
    fn = torch.compile(lambda x, w: (x @ w).mul(2).add(1).tanh(), fullgraph=True)
    x, w = torch.randn(256, 256), torch.randn(256, 256)
    fn(x, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(STEP):
            fn(x, w)
    ops = breakdown(prof.events(), False, lambda e: 0).top_ops
    assert any(name.startswith("## Call CompiledFxGraph") for name in ops["elementwise/normalisation"])
    assert "aten::mm" in ops["matmul"]
    assert not any("CompiledFxGraph" in name for name in ops["other"])
    assert any(name.startswith("Torch-Compiled Region") for name in ops["other"])


@pytest.mark.slow
def test_known_delays_land_in_their_own_categories(trainer, monkeypatch):
    """Sleeps of different lengths in the batch iterator, the family loss and the optimizer step
    (one micro-batch per step) land, each once, in input wait, loss head and optimizer: in the
    region's own time (the sleep is Python inside the region), and input wait grows by the delay."""
    delays = {"input wait": 0.1, "loss head": 0.25, "optimizer": 0.4}
    region = {"input wait": INPUT_WAIT, "loss head": LOSS_HEAD, "optimizer": OPTIMIZER}
    base = profile_steps(trainer, 2)
    # the step's last half (the NaN guard, on by default, runs megatron-core's step in two halves)
    iteration, loss = trainer.train_batches.iteration, trainer.family.loss
    step = trainer.optimizer.step_with_ready_grads

    def slow_iteration(*args, **kwargs):
        for batch in iteration(*args, **kwargs):
            time.sleep(delays["input wait"])
            yield batch

    def slow(function, seconds):
        def call(*args, **kwargs):
            time.sleep(seconds)
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(trainer.train_batches, "iteration", slow_iteration)
    monkeypatch.setattr(trainer.family, "loss", slow(loss, delays["loss head"]))
    monkeypatch.setattr(trainer.optimizer, "step_with_ready_grads", slow(step, delays["optimizer"]))
    slowed = profile_steps(trainer, 2)
    for category, seconds in delays.items():
        own_ms = slowed.top_ops[category][region[category]] / slowed.steps / 1e3
        # at least the sleep; the rest is the region's Python (a loaded machine may deschedule it)
        assert seconds * 1e3 <= own_ms <= seconds * 1e3 + 60, (category, own_ms)
    grown = slowed.ms_per_step("input wait") - base.ms_per_step("input wait")
    assert grown == pytest.approx(delays["input wait"] * 1e3, abs=40)


def test_device_timeline_gives_each_instant_to_one_category():
    order = ("attention", "matmul", "communication", "input wait")
    intervals = [(10, 30, "matmul"), (20, 50, "communication"), (40, 60, "input wait"), (70, 80, "attention"),
                 (75, 90, "matmul"), (95, 130, "attention"), (150, 160, "matmul")]
    out = exclusive_timeline([(0, 100), (140, 145)], intervals, order, idle="idle")
    assert out == {"attention": 15, "matmul": 30, "communication": 20, "input wait": 10, "idle": 30}


class Event:
    """The part of a torch.profiler FunctionEvent that the breakdown reads, made by hand."""

    def __init__(self, name, start, end, device=DeviceType.CPU, id=0, link=0, children=(), annotation=False,
                 thread=1):
        self.name, self.device_type, self.id, self.link, self.thread = name, device, id, link, thread
        self.time_range = torch.autograd.profiler_util.Interval(start, end)
        self.cpu_children, self.cpu_parent, self.is_user_annotation = list(children), None, annotation
        self.self_cpu_time_total = end - start - sum(c.time_range.elapsed_us() for c in self.cpu_children)
        self.sequence_nr, self.scope, self.fwd_thread, self.is_async = -1, 0, thread, False
        for child in self.cpu_children:
            child.cpu_parent = self


def test_device_timeline_of_a_compiled_step_on_a_gpu():
    """What the H100 profile of the 1.7B step holds: each region also drawn as a span on the device
    timeline (no kernel: the gap under it stays device idle), TorchInductor's kernels under records
    of their own names (compiled elementwise work, not other), a cuBLAS kernel outside any region
    (matmul) and cuDNN's attention kernel under the attention region."""
    attention = Event(ATTENTION, 10, 20, id=3, children=[Event("aten::_cudnn_attention_forward", 11, 19, id=4)])
    triton = Event("triton_red_fused__to_copy_add_mul_native_layer_norm_0", 30, 35, id=5)
    mm = Event("aten::mm", 40, 45, id=6)
    step = Event(STEP, 0, 100, id=1, children=[attention, triton, mm], annotation=True)
    cuda = DeviceType.CUDA
    kernels = [Event(STEP, 2, 98, cuda, id=90, link=1, annotation=True),  # the step's span on the GPU
               Event(ATTENTION, 12, 30, cuda, id=91, link=3, annotation=True),
               Event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 12, 30, cuda, id=92, link=4),
               Event("triton_red_fused__to_copy_add_mul_native_layer_norm_0", 32, 50, cuda, id=93, link=5),
               Event("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 50, 70, cuda, id=94, link=6)]
    result = breakdown([step, *kernels], True, lambda e: e.link)
    ms = {c: result.us[c] for c in CATEGORIES if result.us[c]}
    assert ms == {"attention": 18, "elementwise/normalisation": 18, "matmul": 20, "other": 44}, ms
    assert result.device_idle_us == 44  # 0-12, 30-32 and 70-100: the step's span covers none of it
    assert any(name.startswith("triton_red_fused") for name in result.top_ops["elementwise/normalisation"])


def test_the_kernels_of_a_cuda_graph_replay_go_by_their_names():
    """A full-iteration CUDA graph's replay launches every kernel of the forward and backward from
    one call inside the step (no op, no region of theirs): each kernel is categorised by its name
    (kernel names from the H100 trace of the 1.7B step)."""
    step = Event(STEP, 0, 100, id=1, annotation=True)
    cuda = DeviceType.CUDA
    names = {"nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN": "matmul",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64": "attention",
             "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)": "attention",
             "triton_poi_fused_add_mul_rsub_tanh_0": "elementwise/normalisation",
             "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl>": "elementwise/normalisation",
             "some_library_kernel": "other"}
    kernels = [Event(name, 10 * i, 10 * i + 5, cuda, id=90 + i, link=1) for i, name in enumerate(names)]
    result = breakdown([step, *kernels], True, lambda e: e.link)
    want = {"matmul": 5, "attention": 10, "elementwise/normalisation": 10, "other": 100 - 25}
    assert {c: result.us[c] for c in CATEGORIES if result.us[c]} == want
    assert result.device_idle_us == 100 - 30


@pytest.mark.slow
def test_the_script_prints_the_table_and_writes_the_trace(demo_cache, tmp_path):
    trace = tmp_path / "trace.json"
    proc = run_python([BENCH, "--demo-cache-dir", demo_cache, *MICRO, "--global-batch-size", "4", "--steps", "1",
                       "--warmup", "1", "--attention-backend", "sdpa", "--trace", str(trace)], tmp_path,
                      launch_env(1), 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ")]
    shares = {r[1].strip(): float(r[3]) for r in rows[1:] if r[1].strip() in CATEGORIES}
    assert set(shares) == set(CATEGORIES) and sum(shares.values()) == pytest.approx(100, abs=0.5)
    assert "micro-batch 2 x 2 per step" in proc.stdout and "attention sdpa" in proc.stdout
    assert "aten::_scaled_dot_product" in next(r[4] for r in rows if r[1].strip() == "attention")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"dllm::step", "dllm::attention", "dllm::input_wait"} <= names
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]  # the checkpoint and log directories were temporary


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "error: argument --steps: expected a positive integer, got 0"),
    (["--train-iters", "3"], "error: --train-iters 3 is fewer than --warmup + 2 x --steps = 13, the steps run here"),
])
def test_bad_input_is_one_line_naming_the_flag(demo_cache, tmp_path, flags, message):
    proc = run_python([BENCH, "--demo-cache-dir", demo_cache, *MICRO, *flags], tmp_path, launch_env(1), 600)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == message, proc.stderr[-2000:]



def _profile(device: str):
    x = torch.randn(64, 64, device=device)
    with torch.profiler.profile(activities=platform.profiler_activities()) as prof:
        (x @ x).relu().sum()
        platform.synchronize()
    return prof


def test_kineto_links_key_every_event_as_the_profiler_built_it():
    """torch 2.11 (the GPU image's) has no `linked_correlation_id` on its events: the breakdown finds
    it in kineto's raw events by each event's (device type, id, start), which must match them all."""
    prof = _profile(platform.device().type)
    links = kineto_links(prof)
    events = [e for e in prof.events() if e.name != "[memory]"]
    assert len(events) > 3 and all(event_key(e) in links for e in events)


def test_an_op_folded_into_its_parent_of_the_same_name_resolves_to_the_parent():
    """The profile's events leave out the `aten::sum` that `aten::sum` calls (torch.profiler drops an
    op that is the only child of an op of the same name and hands its kernels to the parent; on the
    H100 the kernel of `.sum()` linked to the dropped op's id, which no event had): a link to a
    dropped op resolves to the op of the same name whose span holds it."""
    prof = _profile(platform.device().type)
    links = kineto_links(prof)
    ops = {e.id: e for e in prof.events() if e.device_type == DeviceType.CPU and links[event_key(e)] == 0}
    start = prof.profiler.kineto_results.trace_start_ns()
    dropped = [ev for ev in prof.profiler.kineto_results.events() if ev.device_type() == DeviceType.CPU
               and ev.linked_correlation_id() == 0 and ev.correlation_id() not in ops]
    assert "aten::sum" in [ev.name() for ev in dropped]
    folded = folded_ops(prof)
    for ev in dropped:
        parent = ops[folded[ev.correlation_id()]]
        assert parent.name == ev.name() and parent.time_range.start <= (ev.start_ns() - start) / 1000
        assert (ev.end_ns() - start) / 1000 <= parent.time_range.end
    if hasattr(prof.events()[0], "linked_correlation_id"):  # torch >= 2.12 (on 2.11 the GPU test below)
        sum_id = next(ev.correlation_id() for ev in dropped if ev.name() == "aten::sum")
        kernel_of_the_dropped_sum = types.SimpleNamespace(linked_correlation_id=sum_id)
        linked = linked_ids(prof)
        assert ops[linked(kernel_of_the_dropped_sum)].name == "aten::sum"
        assert all(linked(op) == 0 for op in ops.values())


@pytest.mark.gpu
def test_every_kernel_links_to_the_op_that_launched_it():
    prof = _profile("cuda")
    linked = linked_ids(prof)
    events = prof.events()
    ops = {e.id: e for e in events if e.device_type == DeviceType.CPU and linked(e) == 0}
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    assert kernels
    by_id = {}
    for e in events:
        by_id.setdefault(e.id, []).append((e.name, str(e.device_type), linked(e)))
    for kernel in kernels:  # unlinked: the kernel, its link, and every event with the link's id
        link = linked(kernel)
        assert link in ops, (kernel.name, link, by_id.get(link))
        assert kernel.name in [k.name for k in ops[link].kernels], (kernel.name, ops[link].name)
