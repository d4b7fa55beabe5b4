"""The CPU compatibility layer: what megatron-core hard-codes for CUDA runs on the CPU."""
import logging

import pytest
import torch

from megatron_dllm import platform

pytestmark = [pytest.mark.skipif(platform.HAS_CUDA, reason="the compatibility layer is installed only without CUDA"),
              pytest.mark.usefixtures("world_of_one")]  # conftest


def test_cuda_requests_land_on_the_cpu():
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.cuda.current_device() == "cpu"
    assert platform.device() == torch.device("cpu") and platform.backend() == "gloo"


def test_tensor_type_answers_with_cuda_names():
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64  # conversions untouched


def test_streams_and_events_are_no_ops():
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    stream.wait_event(event)
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.synchronize()
    assert event.query() and event.elapsed_time(event) == 0.0


def test_megatron_rng_tracker_forks_the_cpu_generator():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored
    with get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    assert not torch.equal(inside, again)  # the model-parallel stream advanced


def test_recompute_runs_forward_code_inside_backward():
    from megatron.core import tensor_parallel

    def f(x):  # megatron code that builds a mask on "cuda" in forward
        from megatron.core.transformer.utils import get_default_causal_mask

        return (x * (~get_default_causal_mask(x.shape[0])).float()).sum()

    x = torch.randn(4, 4, requires_grad=True)
    tensor_parallel.checkpoint(f, False, x).backward()
    assert torch.equal(x.grad, torch.tril(torch.ones(4, 4)))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_halve_until_it_fits_backs_off_only_where_out_of_memory_raises(device, monkeypatch):
    """The benchmarks' micro-batch search: from 16, halved on each out-of-memory error down to what
    fits (4 here); other errors propagate; on the CPU an out-of-memory error is not retried."""
    monkeypatch.setattr(platform, "device", lambda: torch.device(device))
    tried = []

    def run(batch):
        tried.append(batch)
        if batch > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch * 10

    if device == "cpu":
        with pytest.raises(torch.OutOfMemoryError):
            platform.halve_until_it_fits(run, 16)
        assert tried == [16]
        return
    assert platform.halve_until_it_fits(run, 16) == (4, 40) and tried == [16, 8, 4]
    assert platform.halve_until_it_fits(lambda b: run(99), 2) is None
    with pytest.raises(ValueError):
        platform.halve_until_it_fits(lambda b: int("x"), 8)


@pytest.mark.parametrize("search", ["halve_until_it_fits", "largest_batch", "in_batches"])
def test_a_batch_that_ran_out_of_memory_is_freed_before_the_next_one_runs(search, monkeypatch):
    """A training model is a reference cycle (megatron-core's DDP keeps gradient hooks whose
    closures hold the module), which only the cycle collector frees, and an out-of-memory error's
    traceback holds the failed attempt's frames until its `except` clause ends. Every batch search
    must free the failed attempt's model before it goes on: on a GPU the next, smaller batch would
    otherwise run (and have its peak measured) beside the failed one's weights and optimizer state.
    Automatic collection is off here, so only the search's own collection can free it."""
    import gc
    import weakref

    import step_cases

    from megatron_dllm.evaluation.generation_batches import in_batches
    from megatron_dllm.evaluation.throughput import largest_batch

    monkeypatch.setattr(platform, "device", lambda: torch.device("cuda"))  # where running out of memory raises
    models, alive = [], []  # which models are alive at the start of each attempt, and at the end

    def attempt(batch: int):
        alive.append([m() is not None for m in models])
        built = step_cases.build("mdlm")[2]
        models.append(weakref.ref(built.model[0]))
        if batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [batch] * batch

    searches = {"halve_until_it_fits": lambda: platform.halve_until_it_fits(attempt, 4),
                "largest_batch": lambda: largest_batch(attempt, None, torch.device("cuda")),
                "in_batches": lambda: in_batches([0] * 6, "auto", torch.device("cuda"), lambda c: attempt(len(c)))}
    monkeypatch.setattr(platform, "auto_generation_batch", lambda device: 4)
    gc.collect()
    gc.disable()
    try:
        found = searches[search]()
        alive.append([m() is not None for m in models])
    finally:
        gc.enable()
    assert found == {"halve_until_it_fits": (2, [2, 2]), "largest_batch": 2, "in_batches": [2] * 6}[search]
    failed = {"halve_until_it_fits": 0, "largest_batch": 2, "in_batches": 0}[search]  # the attempt at 4
    assert not any(snapshot[failed] for snapshot in alive[failed + 1:]), alive


def test_allocated_bytes_follow_a_tensor_allocated_and_freed():
    """What the benchmarks' allocator-exact peaks sample: a 64 MiB tensor adds its bytes and its
    release takes them back (the C allocator's bytes in use on CPU)."""
    before = platform.allocated_bytes()
    block = torch.ones(16 << 20, device=platform.device())  # 64 MiB of fp32
    held = platform.allocated_bytes()
    del block
    assert 64 << 20 <= held - before < 65 << 20 and platform.allocated_bytes() - before < 1 << 20


def test_a_cuda_build_of_torch_without_a_gpu_logs_nothing_of_the_missing_runtime(caplog, monkeypatch, tmp_path):
    """A CUDA build of torch on a node without a GPU (torch 2.11+cu130 on a CPU machine) logs "No CUDA
    runtime is found" when megatron-core imports torch.utils.cpp_extension, ahead of every tool's
    own lines. torch's own lookup, given a CUDA_HOME to find, logs it here; nothing of it is emitted."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert cpp_extension._find_cuda_home() == str(tmp_path)
        logging.getLogger(cpp_extension.__name__).warning("another line")
    assert [record.getMessage() for record in caplog.records] == ["another line"]
