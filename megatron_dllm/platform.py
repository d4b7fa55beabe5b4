"""Device, backend and precision choice: the one place that knows CPU from GPU.

On a CUDA machine this is a thin layer over NCCL and `torch.cuda`. On a machine without CUDA it
makes megatron-core's *unmodified* code run on CPU over gloo by redirecting what megatron-core
hard-codes for CUDA:

* `device="cuda"` arguments and `Tensor.cuda()/.to("cuda")` are rewritten to the CPU by a
  `TorchFunctionMode`, which also answers `Tensor.type()` with the `torch.cuda.*` names that the
  optimizers compare against;
* `torch.cuda.current_device()` returns "cpu"; streams, events, synchronize, empty_cache,
  set_device and memory queries become no-ops;
* the "CUDA" RNG state that megatron's RNG tracker forks is the CPU default generator's;
* activation recompute (which runs forward code inside autograd's backward) re-enters the mode.

Nothing outside this module may branch on CPU vs GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import gc
import logging
import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_dllm.errors import InputError

HAS_CUDA = torch.cuda.is_available()

try:  # TransformerEngine is optional: used on GPU when present, never needed on CPU.
    import transformer_engine  # noqa: F401

    HAS_TE = HAS_CUDA
except ImportError:
    HAS_TE = False


# megatron-core warns, once per process, about each fused CUDA path it falls back from when Apex or
# TransformerEngine is missing. On a CPU none of them could run: the run says so in one line
# (`cpu_fallback_note`) instead, and megatron-core's advice on CUDA_DEVICE_MAX_CONNECTIONS (a CUDA
# setting) is moot. On a GPU the warnings stay, since there a missing kernel costs speed.
CPU_FALLBACK_WARNINGS = ("Apex is not installed", "Transformer Engine and Apex are not installed",
                         "When using sequence parallelism it is recommended to set the environment variable "
                         "CUDA_DEVICE_MAX_CONNECTIONS")
if not HAS_CUDA:
    for _message in CPU_FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=_message)
    # A CUDA build of torch on a machine without a GPU (a cluster's CPU nodes) logs, when megatron-core
    # imports torch.utils.cpp_extension, that it found CUDA_HOME but no CUDA runtime: moot here too.
    logging.getLogger("torch.utils.cpp_extension").addFilter(
        lambda record: not record.getMessage().startswith("No CUDA runtime is found"))


def cpu_fallback_note() -> str | None:
    """The one line a CPU run prints in place of megatron-core's fallback warnings; None on GPU."""
    if HAS_CUDA:
        return None
    return ("CPU run: megatron-core's fused CUDA paths (TransformerEngine layers and attention, Apex fused "
            "LayerNorm, fused Adam and multi-tensor kernels) are unavailable; their PyTorch fallbacks compute "
            "the same results, and the fused kernels only make GPUs faster")


def device() -> torch.device:
    """The device this rank computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")


def to_device(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor on this rank's device, without making the host wait. A CUDA copy from pageable
    memory synchronises the stream, so the GPU would sit idle while the host read and corrupted the
    next micro-batch; from pinned memory the copy is queued behind the running kernels (the caching
    host allocator keeps the pinned block until the copy has run)."""
    if not HAS_CUDA:
        return tensor
    # pin_memory refuses a view whose elements overlap (an expand()ed tensor): copy it out first
    return tensor.contiguous().pin_memory().to(device(), non_blocking=True)


def norm_dtype(device: torch.device) -> torch.dtype:
    """The accumulation dtype of a gradient norm. torch's CPU norm sums float32 in sequence: 1.6e-3
    relative error at 30M elements (an embedding's gradient), enough to move clipping and to differ
    between TP layouts; CUDA's reduces in a tree."""
    return torch.float64 if device.type == "cpu" else torch.float32


def tool_device(requested: str | None = None) -> str:
    """The device of a one-process tool (`--device`): the one asked for, else CUDA where present.
    Asking for CUDA on a machine without it is an error, not a silent fall-back to the CPU."""
    if requested is None:
        return "cuda" if HAS_CUDA else "cpu"
    try:
        kind = torch.device(requested).type
    except RuntimeError:  # not a device name at all ("gpu")
        kind = None
    if kind not in ("cpu", "cuda"):
        raise InputError(f"--device {requested}: expected cpu, cuda or cuda:N")
    if kind == "cuda" and not HAS_CUDA:
        raise InputError(f"--device {requested}: CUDA is not available on this machine")
    return requested


def release_cached_memory() -> None:
    """Free what a finished or failed attempt left unreferenced, then return the CUDA caching
    allocator's free blocks. A model is a reference cycle (megatron-core's DDP keeps its gradient
    hooks, whose closures hold the DDP module), so only the cycle collector frees it. After an
    out-of-memory error call this once the `except` clause has ended: until then the error's
    traceback keeps the failed attempt's frames, and with them its model, alive."""
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


# `--batch-size auto` (evaluation) searches by running batches until one runs out of memory, which
# only works where that raises: a GPU's allocator does; on the CPU the OS kills the process instead.
def out_of_memory_raises(device) -> bool:
    """Whether running out of memory on `device` raises an error a batch-size search can catch and
    back off from (a GPU), rather than the OS killing the process (the CPU's host memory)."""
    return torch.device(device).type != "cpu"


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is the device running out of memory (torch.OutOfMemoryError or its message)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def halve_until_it_fits(run, batch: int):
    """(b, run(b)) for the first b of batch, batch // 2, ..., 1 at which `run` does not run out of
    memory, or None if even 1 does. Where running out of memory kills the process instead of raising
    (the CPU), only `batch` itself is tried."""
    while batch >= 1:
        try:
            return batch, run(batch)
        except Exception as err:  # also a compiler's error that wraps running out of memory
            if not (out_of_memory_raises(device()) and is_out_of_memory(err)):
                raise
        release_cached_memory()  # here, with the error gone: see its docstring
        batch //= 2
    return None


def auto_generation_batch(device) -> int:
    """The batch size `--batch-size auto` starts conditional generation at on `device`: 64 where
    running out of memory raises (halved on each such error); 8 on the CPU, which cannot back off
    and gains little beyond (benchmarks/RESULTS.md, "Batched conditional generation")."""
    return 64 if out_of_memory_raises(device) else 8


def device_name() -> str | None:
    """The accelerator's name (for its peak FLOP/s), or None on a CPU machine."""
    return torch.cuda.get_device_name() if HAS_CUDA else None


def peak_memory() -> tuple[int, str]:
    """(bytes, what they measure): the CUDA allocator's peak on GPU, the process's peak resident
    set on CPU (where the allocator queries are stand-ins)."""
    if HAS_CUDA:
        return torch.cuda.max_memory_allocated(), "GPU allocator peak"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "CPU RSS peak"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _mallinfo2():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def allocated_bytes() -> int:
    """Bytes tensors hold now: the CUDA caching allocator's allocated bytes on GPU; on CPU, where
    tensors come from the C allocator, glibc's bytes in use (heap blocks plus the mmapped blocks
    large tensors get). Sampled after each operation, it gives a peak that can be reset, which
    `peak_memory`'s resident set on CPU cannot."""
    if HAS_CUDA:
        return torch.cuda.memory_allocated()
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


def reset_peak_memory() -> None:
    """Start `peak_memory`'s GPU figure afresh (the CPU's peak resident set cannot be reset)."""
    if HAS_CUDA:
        torch.cuda.reset_peak_memory_stats()


def record_memory_history(enabled: bool) -> None:
    """Start/stop recording CUDA allocations for a memory snapshot (a no-op on CPU)."""
    if HAS_CUDA:
        torch.cuda.memory._record_memory_history(max_entries=100000 if enabled else 0,
                                                 enabled="all" if enabled else None)


def dump_memory_snapshot(path: str) -> bool:
    """Write the recorded CUDA memory snapshot (pickle, for pytorch.org/memory_viz); False on CPU."""
    if not HAS_CUDA:
        return False
    torch.cuda.memory._dump_snapshot(path)
    return True


def device_rng_state():
    """The CUDA generator's state, or None on a CPU machine (checkpointed with the other RNGs)."""
    return torch.cuda.get_rng_state() if HAS_CUDA else None


def set_device_rng_state(state) -> None:
    if HAS_CUDA and state is not None:
        torch.cuda.set_rng_state(state)


def backend() -> str:
    return "nccl" if HAS_CUDA else "gloo"


def any_rank(flags: list[bool], group=None) -> list[bool]:
    """Each flag OR-ed over the ranks of `group` (one all-reduce), so every rank takes the same
    decision. The flags travel on this rank's device: NCCL refuses host tensors ("No backend type
    associated with device type cpu")."""
    tensor = torch.tensor([int(f) for f in flags], dtype=torch.int, device=device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [bool(f) for f in tensor.tolist()]


def from_rank(value, src: int):
    """`value` as rank `src` has it, on every rank (a picklable object, e.g. the error message a
    rank alone met, so that every rank stops alike instead of waiting in a later collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=src)
    return shared[0]


def params_dtype(requested_bf16: bool) -> torch.dtype:
    """bf16 where the hardware has it and it was asked for; fp32 on CPU (exact tests, speed)."""
    return torch.bfloat16 if (HAS_CUDA and requested_bf16) else torch.float32


def megatron_config_overrides() -> dict:
    """TransformerConfig fields that depend on the device: on CPU, megatron must build weights on
    the host (its GPU path allocates on CUDA and forks the CUDA RNG)."""
    return {"use_cpu_initialization": not HAS_CUDA}


@functools.cache
def sdpa_backends() -> list:
    """PyTorch SDPA kernels in priority order (`--attention-backend sdpa`): on Hopper cuDNN's fused
    attention first (it outruns flash there), else flash; the memory-efficient kernel and the
    math fallback after them. On CPU the fused CPU kernel, then math."""
    from torch.nn.attention import SDPBackend

    if not HAS_CUDA:
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    if torch.cuda.get_device_capability()[0] == 9:
        fused.reverse()
    return [*fused, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def fusion_defaults() -> dict:
    """Defaults of the fusion flags (`model/fusion.py`). The compiled ones (--compile-elementwise,
    --bias-gelu-fusion and --bias-swiglu-fusion, whose megatron-core kernels torch.compile builds) are on with CUDA and
    off on CPU, where compiling with inductor and g++ costs seconds in every process and gained a
    small model little (benchmarks/bench_compile.py). The masked-softmax fusion is on where apex's
    kernels are installed (CUDA only). Bias-dropout fusion costs nothing eager: on, as Megatron-LM.
    Gradient-accumulation fusion is on with CUDA (where `fp32_accumulating_gemm`), as Megatron-LM;
    off on CPU, where it saves one add per weight and changes the last bits of the sums."""
    import importlib.util

    kernels = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")
    return {"compile_elementwise": HAS_CUDA, "bias_gelu": HAS_CUDA, "bias_swiglu": HAS_CUDA, "bias_dropout": True,
            "masked_softmax": HAS_CUDA and all(importlib.util.find_spec(k) is not None for k in kernels),
            "gradient_accumulation": HAS_CUDA}


@functools.cache
def fp32_accumulating_gemm() -> bool:
    """Whether a bf16 GEMM can add its product straight into an fp32 tensor (torch.addmm's
    out_dtype, CUDA only), which gradient-accumulation fusion needs where weights are bf16. On CPU,
    where weights are fp32 (`params_dtype`), a plain addmm does. Checked on CUDA once, on a 2x2
    product, after the rank's device is set."""
    if not HAS_CUDA:
        return True
    ones = torch.ones(2, 2, dtype=torch.bfloat16, device=device())
    total = torch.ones(2, 2, device=device())
    try:
        torch.addmm(total, ones, ones, out_dtype=torch.float32, out=total)
    except (TypeError, RuntimeError):  # a torch without out_dtype, or whose CUDA addmm wants `self` in bf16
        return False
    return bool((total == 3).all())


def profiler_activities() -> list:
    """What torch.profiler records here: the host always, the device's kernels on a GPU."""
    return [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if HAS_CUDA else [])


def synchronize() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# CPU compatibility for megatron-core
# ---------------------------------------------------------------------------------------------

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and (_is_cuda(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and (_is_cuda(args[1]) or isinstance(args[1], int)):
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


class _NullSync:
    """CPU work is already ordered: waiting, recording and synchronising are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullStream(_NullSync):
    """Stand-in for torch.cuda.Stream/ExternalStream."""

    def wait_stream(self, *args, **kwargs):
        pass

    wait_event = wait_stream

    def record_event(self, event=None):
        return event or _NullEvent()


class _NullEvent(_NullSync):
    """Stand-in for torch.cuda.Event."""

    def record(self, *args, **kwargs):
        pass

    wait = record

    def elapsed_time(self, other):
        return 0.0


def _noop():
    """A fresh no-op function (each patched name gets its own object)."""
    return lambda *args, **kwargs: None


_cpu_mode: _CpuDeviceMode | None = None


def _import_with_real_cuda(real_cuda: dict, dynamo, run) -> None:
    """TorchDynamo maps torch.cuda's functions while it is imported and when it first builds its
    trace rules (cached): both happen with the real functions in place, the CPU stand-ins after."""
    stand_ins = {module: {name: value for name, value in vars(module).items()
                          if name in real and real[name] is not value} for module, real in real_cuda.items()}
    for module, replaced in stand_ins.items():
        for name in replaced:
            setattr(module, name, real_cuda[module][name])
    try:
        if run is not None:
            run(dynamo)
        import torch._dynamo.trace_rules

        torch._dynamo.trace_rules.get_torch_obj_rule_map()
    finally:
        for module, replaced in stand_ins.items():
            for name, value in replaced.items():
                setattr(module, name, value)


def install_cpu_compat() -> None:
    """Make megatron-core run on CPU. Idempotent; does nothing when CUDA is present."""
    global _cpu_mode
    if HAS_CUDA or _cpu_mode is not None:
        return
    # What maps torch.cuda's functions must see the real ones: megatron's RNG module is imported
    # before patching, TorchDynamo whenever something first imports it (`_import_with_real_cuda`).
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron_dllm import lazy_imports

    cuda = torch.cuda
    real_cuda = {module: dict(vars(module)) for module in (cuda, cuda.random)}
    lazy_imports.around_import("torch._dynamo", functools.partial(_import_with_real_cuda, real_cuda))
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 1
    cuda.set_device = _noop()
    cuda.synchronize = _noop()
    cuda.empty_cache = _noop()
    cuda.Stream = cuda.ExternalStream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = _noop()
    cuda.memory_allocated = cuda.max_memory_allocated = cuda.memory_reserved = lambda *a, **k: 0
    cuda.memory_stats = lambda *a, **k: {}
    # The "CUDA" generator is the CPU default generator, so megatron's RNG tracker forks real state.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    mcore_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # Python function modes are not active inside autograd's backward, where megatron's
    # activation recompute re-runs forward code: re-enter the mode there.
    checkpoint_backward = mcore_random.CheckpointFunction.backward

    def backward_in_cpu_mode(ctx, *grads):
        with _CpuDeviceMode():
            return checkpoint_backward(ctx, *grads)

    mcore_random.CheckpointFunction.backward = staticmethod(backward_in_cpu_mode)

    _cpu_mode = _CpuDeviceMode()
    _cpu_mode.__enter__()


def world_size() -> int:
    """The launch's world size: torch.distributed's once initialised, before that torchrun's
    WORLD_SIZE (a plain process without it runs as a world of one, as `init_distributed`)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    seed: int = 1234,
    timeout_minutes: int = 10,
) -> None:
    """Initialise torch.distributed from torchrun's environment, megatron's parallel state and
    the RNGs (as Megatron-LM: seed + 100 * pipeline rank, and megatron's model-parallel tracker).

    A single process without torchrun's variables runs as world size 1.
    """
    install_cpu_compat()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if HAS_CUDA:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if local_rank >= torch.cuda.device_count():  # NCCL needs a GPU of its own per rank
                raise InputError(f"--nproc-per-node: local rank {local_rank} has no GPU of its own "
                                 f"({torch.cuda.device_count()} visible); start at most one rank per GPU")
            torch.cuda.set_device(local_rank)
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "WORLD_SIZE" in os.environ:  # torchrun, Slurm wrappers: env:// rendezvous
            dist.init_process_group(backend=backend(), timeout=timeout)
        else:  # a plain process (tools, notebooks): a world of one, leaving os.environ alone
            dist.init_process_group(backend=backend(), init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    if world % model_parallel:
        raise InputError(
            f"--tensor-model-parallel-size {tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {pipeline_model_parallel_size} = {model_parallel} "
            f"does not divide the world size {world}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
