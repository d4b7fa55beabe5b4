"""Where a training step's time goes: torch.profiler over real `trainer.train_step()` calls,
each microsecond of each step put in exactly one category, so the shares sum to 100%.

Categories: matmul (GEMMs outside the regions below), attention (the core-attention module:
scores, softmax and the weighted sum, or the fused SDPA/flash/cuDNN kernel), elementwise/
normalisation (every other ATen op: norms, activations, adaLN modulation, residual adds,
rotary, copies), loss head (the final layer: its norm, adaLN and projection to the vocabulary,
plus the family loss), optimizer (megatron-core's optimizer.step incl. gradient clipping),
communication (collectives: c10d/gloo/NCCL), input wait (fetching the next micro-batch from the
batch iterator: reading, corrupting and moving it to the device), other (everything else:
Python, the autograd engine, megatron's schedule, the profiler's own overhead; on GPU also the
time the device sits idle).

The rule (the same on CPU and GPU):
* a collective op, and everything under it, is communication, wherever it runs;
* else the innermost region of `profile_regions` around the op decides. A backward op belongs to
  the region its forward op ran in, found as torch.profiler itself links them (the backward
  function's sequence number and forward thread), also where the autograd engine runs backward
  on a thread of its own (on GPU); a region opened inside a backward function (activation
  recompute) is innermost there;
* else an op under a GEMM op (mm, addmm, bmm, baddbmm, matmul, linear; in place too) is matmul, any other
  ATen op and every TorchInductor kernel (`--compile-elementwise`'s regions, recorded under their
  kernel names on GPU; on CPU they run inside the compiled graph's call, whose own time they are)
  is elementwise/normalisation, and the rest is other (dynamo's and AOTAutograd's wrappers too).

What is measured:
* CPU: the host's main thread. Each profiled event contributes its self time (its duration less
  its children's), so the categories partition the wall time of the steps exactly.
* GPU: the device timeline over the wall time of each step (synchronised at its end). Each
  instant goes to the category of the kernel running then (that of the op that launched it; a
  GEMM kernel launched outside any region is matmul, an NCCL kernel communication; where
  kernels overlap: compute first, then communication); an instant with no kernel running is
  input wait while the host fetches a batch, else other (reported separately as device idle: the
  GPU waiting for the host). The profiler also draws each region's span on the device timeline
  (a user annotation); that span is no kernel and covers nothing. A kernel that no op of a
  category launched goes by its name (`kernel_category`): the kernels a full-iteration CUDA
  graph replays link to the replay's launch, not to their ops, so there the regions cannot name
  them (the loss head's kernels count as matmul and elementwise work, the attention's as
  attention by the kernels' names).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

from megatron_dllm import platform
from megatron_dllm.training import profile_regions as regions

CATEGORIES = ("matmul", "attention", "elementwise/normalisation", "loss head", "optimizer", "communication",
              "input wait", "other")
REGION_CATEGORY = {regions.ATTENTION: "attention", regions.LOSS_HEAD: "loss head",
                   regions.OPTIMIZER: "optimizer", regions.INPUT_WAIT: "input wait"}
# in place too: gradient-accumulation fusion's weight-gradient GEMM is `addmm_` into the main gradient
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::addbmm", "aten::_scaled_mm", "aten::mv", "aten::addmv", "aten::addmm_", "aten::baddbmm_",
            "aten::addbmm_", "aten::addmv_"}
# triton_tem: TorchInductor's GEMM templates
GEMM_KERNEL_MARKS = ("gemm", "cutlass", "cublas", "xmma", "nvjet", "triton_tem")
COMPILED_KERNEL_PREFIXES = ("triton_", "cpp_fused_")  # TorchInductor's kernels (GPU, CPU)
# the call of a TorchInductor graph: on CPU its fused kernels run inside it without events of their own
COMPILED_GRAPH_CALL = "## Call CompiledFxGraph"
ATTENTION_KERNEL_MARKS = ("sdpa", "fmha", "flash", "cudnn")  # cuDNN's fused attention (and its helpers), flash
ANNOTATIONS = {regions.STEP, *REGION_CATEGORY}
# Where device kernels overlap (several streams), the first of these running wins.
DEVICE_ORDER = ("attention", "loss head", "optimizer", "matmul", "elementwise/normalisation", "other",
                "communication", "input wait")
BACKWARD_FUNCTION_SCOPE = 1  # at::RecordScope::BACKWARD_FUNCTION


@dataclass
class Breakdown:
    steps: int
    total_us: float  # the wall time of all profiled steps
    us: dict  # category -> microseconds over all steps (sums to total_us)
    clock: str  # what the times measure
    top_ops: dict = field(default_factory=dict)  # category -> Counter(op name -> microseconds)
    device_idle_us: float | None = None  # GPU: the part of `other` with no kernel running

    def ms_per_step(self, category: str) -> float:
        return self.us[category] / self.steps / 1000

    def share(self, category: str) -> float:
        return 100 * self.us[category] / self.total_us

    def table(self) -> str:
        rows = ["| category | ms per step | share (%) | largest ops |", "|---|---:|---:|---|"]
        for c in CATEGORIES:
            ops = ", ".join(name for name, _ in self.top_ops.get(c, Counter()).most_common(3))
            rows.append(f"| {c} | {self.ms_per_step(c):.2f} | {self.share(c):.1f} | {ops} |")
        rows.append(f"| **step** | **{self.total_us / self.steps / 1000:.2f}** | **100.0** | |")
        return "\n".join(rows)


def profile_steps(trainer, steps: int, trace: str | None = None) -> Breakdown:
    """Run `steps` real training steps under torch.profiler (CUDA too where present) with the
    regions installed; optionally write the Chrome trace to `trace`."""
    remove = regions.install_regions(trainer)
    try:
        with torch.profiler.profile(activities=platform.profiler_activities()) as prof:
            for _ in range(steps):
                with record_function(regions.STEP):
                    trainer.train_step()
                    platform.synchronize()  # the step's kernels end inside its window
    finally:
        remove()
    if trace:
        prof.export_chrome_trace(trace)
    return breakdown(prof.events(), platform.HAS_CUDA, linked_ids(prof))


def linked_ids(prof):
    """event -> the id of the op it belongs to (a kernel, a CUDA runtime call), 0 for an op itself.
    torch >= 2.12 keeps it on the event (`linked_correlation_id`); older ones (the GPU image has
    2.11) only on kineto's raw events (`kineto_links`), read only where the events lack it. A link
    to an op the events leave out goes to the op that stands for it (`folded_ops`)."""
    events = prof.events()
    if events and hasattr(events[0], "linked_correlation_id"):
        def link(e):
            return e.linked_correlation_id
    else:
        links = kineto_links(prof)

        def link(e):
            return links.get(event_key(e), 0)
    folded = folded_ops(prof)

    def resolved(e):
        op = link(e)
        return folded.get(op, op)
    return resolved


def folded_ops(prof) -> dict:
    """The id of each op that the profile's events leave out -> the id of the op that stands for it.
    Building its events, torch.profiler drops an op that is the only child of an op of the same name
    (`aten::sum` inside `aten::sum`, `aten::add_` inside `aten::add_`) and hands its kernels to the
    parent, but the kernels still link to the dropped op's id. The parent is the innermost event of
    the same name, on the same thread, whose span holds the dropped op's."""
    results = prof.profiler.kineto_results
    start = results.trace_start_ns()
    kept, same_name = set(), {}
    for e in prof.events():
        if e.device_type == DeviceType.CPU:
            kept.add(event_key(e))
            same_name.setdefault((e.name, e.thread), []).append(e)
    folded = {}
    for ev in results.events():
        if ev.device_type() != DeviceType.CPU or ev.linked_correlation_id() != 0:
            continue  # not an op: a kernel, a CUDA runtime call
        begin, end = (ev.start_ns() - start) / 1000, (ev.end_ns() - start) / 1000
        if (DeviceType.CPU, ev.correlation_id(), begin) in kept:
            continue
        holders = [e for e in same_name.get((ev.name(), ev.start_thread_id()), ())
                   if e.time_range.start <= begin and end <= e.time_range.end]
        if holders:  # else an op the profiler leaves out by name (aten::is_leaf, ...): it launches nothing
            folded[ev.correlation_id()] = min(holders, key=lambda e: e.time_range.elapsed_us()).id
    return folded


def kineto_links(prof) -> dict:
    """`event_key` of each of the profile's events -> its linked op id, from kineto's raw events (as
    torch.profiler built the events from them)."""
    results = prof.profiler.kineto_results
    start = results.trace_start_ns()
    return {(ev.device_type(), ev.correlation_id(), (ev.start_ns() - start) / 1000): ev.linked_correlation_id()
            for ev in results.events()}


def event_key(e) -> tuple:
    return e.device_type, e.id, e.time_range.start


def breakdown(events, device: bool, linked) -> Breakdown:
    """The exclusive breakdown of the profiled steps (events named `profile_regions.STEP`);
    `linked`: `linked_ids` of the profile."""
    step_events = [e for e in events if e.name == regions.STEP and e.device_type == DeviceType.CPU]
    if not step_events:
        raise ValueError(f"no {regions.STEP} region in the profile: nothing to break down")
    total = sum(e.time_range.elapsed_us() for e in step_events)
    # On GPU the autograd engine runs backward on a thread of its own: its ops are no children of
    # the step region, but their kernels need their category.
    windows = [(e.time_range.start, e.time_range.end) for e in step_events]
    other_threads = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None
                     and e.thread != step_events[0].thread and not e.is_async
                     and any(w0 <= e.time_range.start and e.time_range.end <= w1 for w0, w1 in windows)]
    forward_region = {}  # (sequence number, thread) of a forward op -> its region's category
    for e, ctx in _walk(step_events + other_threads, {}):
        if e.sequence_nr >= 0 and not _is_backward(e):
            forward_region.setdefault((e.sequence_nr, e.thread), ctx.region)
    us, top = dict.fromkeys(CATEGORIES, 0.0), {c: Counter() for c in CATEGORIES}
    op_category, fetches = {}, []
    for roots, main_thread in ((step_events, True), (other_threads, False)):
        for e, ctx in _walk(roots, forward_region):
            category = _category(e, ctx)
            if linked(e) == 0:  # an op, not a CUDA runtime call (whose ids are CUPTI's)
                op_category[e.id] = category  # its kernels name it by this id
            if main_thread:  # the host's time: the step's own thread only
                us[category] += e.self_cpu_time_total
                top[category][_short(e.name)] += e.self_cpu_time_total
                if e.name == regions.INPUT_WAIT:
                    fetches.append((e.time_range.start, e.time_range.end, "input wait"))
    if not device:
        return Breakdown(len(step_events), total, us, "host wall time, main thread (self time per op)", top)
    return _device_breakdown(events, step_events, op_category, fetches, total, linked)


@dataclass(frozen=True)
class _Context:
    region: str | None = None  # category of the innermost region around the op
    gemm: bool = False  # under a GEMM op
    collective: bool = False  # under a collective op


def _walk(roots, forward_region: dict):
    """(event, context) for every CPU event under `roots`, parents before children."""
    stack = [(e, _Context()) for e in roots]
    while stack:
        e, ctx = stack.pop()
        region = REGION_CATEGORY.get(e.name, ctx.region)
        if _is_backward(e):  # the region of the forward op, not the one the engine runs in
            region = forward_region.get((e.sequence_nr, e.fwd_thread))
        ctx = _Context(region, ctx.gemm or e.name in GEMM_OPS, ctx.collective or _is_collective(e.name))
        yield e, ctx
        stack.extend((child, ctx) for child in e.cpu_children)


def _category(e, ctx: _Context) -> str:
    if ctx.collective:
        return "communication"
    if ctx.region:
        return ctx.region
    if ctx.gemm:
        return "matmul"
    elementwise = e.name.startswith(("aten::", *COMPILED_KERNEL_PREFIXES, COMPILED_GRAPH_CALL))
    return "elementwise/normalisation" if elementwise else "other"


def _is_backward(e) -> bool:
    """A backward function or the autograd engine's record around it."""
    return e.scope == BACKWARD_FUNCTION_SCOPE or e.name.startswith("autograd::engine::evaluate_function")


def _is_collective(name: str) -> bool:
    return name.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms")) or name.lower().startswith("nccl")


def _short(name: str) -> str:
    return name if len(name) <= 48 else name[:45] + "..."


def _device_breakdown(events, step_events, op_category: dict, fetches: list, total: float, linked) -> Breakdown:
    kernels, top = [], {c: Counter() for c in CATEGORIES}
    for e in events:
        category = device_category(e, op_category, linked) if e.device_type == DeviceType.CUDA else None
        if category is None:
            continue
        kernels.append((e.time_range.start, e.time_range.end, category))
        top[category][_short(e.name)] += e.time_range.elapsed_us()
    windows = [(e.time_range.start, e.time_range.end) for e in step_events]
    us = exclusive_timeline(windows, kernels + fetches, DEVICE_ORDER, idle="device idle")
    idle = us.pop("device idle")
    us["other"] += idle
    return Breakdown(len(step_events), total, us, "device timeline over each step's wall time", top, idle)


def device_category(e, op_category: dict, linked) -> str | None:
    """A device event's category: its op's (`op_category`: op id -> category), with a GEMM kernel
    outside any region as matmul, an NCCL kernel as communication and a kernel of no op's
    category by its name (`kernel_category`); None for a region's span that the profiler draws on
    the device timeline (a user annotation, no kernel)."""
    if getattr(e, "is_user_annotation", False) or e.name in ANNOTATIONS:
        return None
    lowered = e.name.lower()
    if lowered.startswith("nccl"):
        return "communication"
    category = op_category.get(linked(e), "other")
    if category == "other":  # launched by no op of a category: a CUDA graph's replay, for one
        return kernel_category(lowered)
    if category == "elementwise/normalisation" and any(m in lowered for m in GEMM_KERNEL_MARKS):
        return "matmul"
    return category


def kernel_category(lowered: str) -> str:
    """A kernel's category by its (lower-cased) name alone: cuBLAS's and Inductor's GEMMs, cuDNN's
    and flash attention, Inductor's and ATen's elementwise kernels, else other."""
    if any(m in lowered for m in GEMM_KERNEL_MARKS):
        return "matmul"
    if any(m in lowered for m in ATTENTION_KERNEL_MARKS):
        return "attention"
    if lowered.startswith(COMPILED_KERNEL_PREFIXES) or "at::native::" in lowered:
        return "elementwise/normalisation"
    return "other"


def exclusive_timeline(windows, intervals, order, idle: str) -> dict:
    """Time per category over `windows` [(start, end)]: each instant goes to the first category
    of `order` with an interval (start, end, category) covering it, else to `idle`."""
    out = dict.fromkeys((*order, idle), 0.0)
    rank = {c: i for i, c in enumerate(order)}
    for w0, w1 in windows:
        points = [(w0, None, 0), (w1, None, 0)]
        for s, e, c in intervals:
            s, e = max(s, w0), min(e, w1)
            if s < e:
                points += [(s, rank[c], 1), (e, rank[c], -1)]
        points.sort(key=lambda p: p[0])
        active, previous = [0] * len(order), w0
        for time, category, delta in points:
            if time > previous:
                out[next((order[i] for i, n in enumerate(active) if n), idle)] += time - previous
                previous = time
            if category is not None:
                active[category] += delta
    return out
