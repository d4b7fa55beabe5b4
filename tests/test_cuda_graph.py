"""The full-iteration CUDA graph (`--cuda-graph-scope full_iteration`, training/cuda_graph.py) on
CPU: what its capture needs (no operation in any family's forward and backward that makes the
host wait for the device), and its bookkeeping (static buffers, the finalisation after the
replay, a new capture when the micro-batches change form: a mask that ends, a shorter iteration)
run with a stand-in that re-runs the captured function. On a CUDA GPU (marked `gpu`): the real
capture and replay, in fp32 and bf16, against the eager step, a shorter iteration's release and
recapture, and a run of pretrain_dllm.py. The flags' rules: test_validate.py."""
import pytest
import torch
from conftest import run_worker_on_two_ranks
from step_cases import GRAPH, Batches, RerunGraph, build, train
from synchronisations import Synchronisations

from megatron_dllm import platform
from megatron_dllm.families import FAMILIES
from megatron_dllm.training import step

# Two runs equal bit for bit: on CPU. On CUDA the attention backward's summation order varies from run
# to run (and Adam turns that into differences of the learning rate's size); there the GPU-marked
# tests compare the real graph with the weights held still.
EXACT = pytest.mark.skipif(platform.HAS_CUDA, reason="bit-exact reruns: CPU only (the GPU-marked tests cover CUDA)")


@pytest.mark.parametrize("family_name", FAMILIES)
def test_no_family_makes_the_host_wait_inside_what_the_graph_captures(family_name, world_of_one):
    """A capture refuses any read of a device value on the host: every family's forward, loss and
    backward over two micro-batches (megatron-core's schedule, its finalisation left out) must
    dispatch none. The finalisation does compare the token count on the host; the graph runs it
    after the replay."""
    # eager regions: a dispatch mode hides the operations inside compiled code (and dynamo refuses
    # to compile under one); the compiled regions are pure elementwise arithmetic
    config, family, built = build(family_name, *GRAPH, "--cuda-graph-warmup-steps", "1", "--no-compile-elementwise")
    mode = Synchronisations()
    built.graph.graph_type = lambda: RerunGraph(built.model, mode)
    batches = Batches(family, config.model.seq_length)
    for i in range(2):  # one eager iteration, then the capture
        step.train_step(built.model, built.optimizer, built.scheduler, family, batches, 4 * i, config,
                        built.transformer_config.timers, iteration=i + 1, graph=built.graph)
    assert built.graph.captures == 1
    assert mode.found == []


def compilations() -> int:
    """How much dynamo, AOTAutograd and Inductor have compiled in this process (each count grows with
    every graph built, from Inductor's cache or not; running compiled code changes none)."""
    counters = torch._dynamo.utils.counters
    return sum(sum(counters[kind].values()) for kind in ("stats", "aot_autograd", "inductor"))


@pytest.mark.slow  # compiles the regions (inductor, g++)
def test_the_compiled_regions_compile_in_the_warm_up_and_never_inside_the_capture(world_of_one):
    """Compiling inside a CUDA graph capture fails (Inductor synchronises and loads kernels): with
    --compile-elementwise, on by default with CUDA, the eager warm-up iteration compiles every region,
    forward and backward, and the capture compiles nothing."""
    config, family, built = build("mdlm", *GRAPH, "--cuda-graph-warmup-steps", "1", "--compile-elementwise")
    inside = []

    class CountingGraph(RerunGraph):
        def capture(self, fn):
            before = compilations()
            outputs = super().capture(fn)
            inside.append(compilations() - before)
            return outputs

    built.graph.graph_type = lambda: CountingGraph(built.model)
    batches = Batches(family, config.model.seq_length)
    torch._dynamo.reset()  # this process may have compiled the same regions for an earlier test
    before = compilations()
    for i in range(3):  # the warm-up iteration, the capture, a replay
        step.train_step(built.model, built.optimizer, built.scheduler, family, batches, 4 * i, config,
                        built.transformer_config.timers, iteration=i + 1, graph=built.graph)
        if i == 0:
            assert compilations() > before  # the warm-up compiled
    assert built.graph.captures == 1
    assert inside == [0]


def test_the_detector_sees_a_host_read_and_a_boolean_mask():
    with Synchronisations() as mode:
        x = torch.arange(4.0)
        x.sum().item()
        x[x > 1]
        x[x > 1] = 0.0  # a scalar: masked_fill, no wait
    assert mode.found == ["aten._local_scalar_dense.default", "aten.index.Tensor"]


@EXACT
@pytest.mark.parametrize("family_name", ["mdlm", "esolm"])
def test_the_graph_trains_exactly_as_the_eager_step(family_name, world_of_one):
    """Four iterations of fresh micro-batches: the warm-up iteration, the capture, two replays whose
    inputs are copied into the capture's buffers; the losses and the weights equal the eager
    step's (the same operations in the same order, fp32)."""
    eager_losses, _, eager_weights, _ = train(family_name, 4)
    losses, _, weights, built = train(family_name, 4, *GRAPH, "--cuda-graph-warmup-steps", "1")
    assert built.graph.captures == 1
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights))


@EXACT
def test_micro_batches_of_another_form_drop_the_graph_and_capture_anew(world_of_one):
    """An annealed attention mask ends (a mask, then None): the graph of the masked form is dropped,
    the warm-up runs eagerly again, and a new capture serves the rest, still equal to eager."""
    eager_losses, _, eager_weights, _ = train("mdlm", 6, mask_until=3)
    losses, _, weights, built = train("mdlm", 6, *GRAPH, "--cuda-graph-warmup-steps", "1", mask_until=3)
    assert built.graph.captures == 2  # iteration 2 (masked), iteration 5 (after the eager iteration 4)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights))


@EXACT
def test_a_shorter_iteration_gives_the_graph_back_and_a_new_capture_follows(world_of_one, monkeypatch):
    """--variable-seq-length-prob: a shorter iteration (3) drops the graph, gives its memory back and
    runs eagerly; the next full-length iteration (the warm-up over) captures anew; still exactly
    the eager step's losses and weights."""
    lengths = {3: 9}
    eager_losses, _, eager_weights, _ = train("mdlm", 6, "--variable-seq-length-prob", "0.01", lengths=lengths)
    releases, release = [], RerunGraph.release
    monkeypatch.setattr(RerunGraph, "release", lambda self: releases.append(1) or release(self))
    losses, _, weights, built = train("mdlm", 6, "--variable-seq-length-prob", "0.01", *GRAPH,
                                      "--cuda-graph-warmup-steps", "1", lengths=lengths)
    assert built.graph.captures == 2 and len(releases) == 1  # captures at iterations 2 and 4
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights))


@pytest.mark.slow
@pytest.mark.multiprocess
@EXACT
def test_data_parallel_ranks_reduce_their_gradients_after_the_replay(tmp_path):
    """Two data-parallel ranks (gloo), each on samples of its own: with the graph, the gradient
    all-reduce runs after each replay (megatron-core's finalisation), and each rank's losses and
    weights equal the eager step's exactly; the ranks' weights agree."""
    result = run_worker_on_two_ranks("cuda_graph_worker.py", tmp_path, timeout=240)
    assert result == {"losses_equal": True, "weights_equal": True, "ranks_agree": True, "captures": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family_name", ["mdlm", "esolm", "ar"])
def test_on_cuda_the_replayed_graph_gives_the_eager_losses_and_gradients(family_name, precision, world_of_one):
    """The real capture and replay (with the compiled regions, on by default with CUDA): five
    iterations of fresh micro-batches, the capture at the third; each iteration's loss and
    gradient norm equal the eager step's. The weights stay still (--lr 0): on a GPU the attention
    backward's summation order varies from run to run, and Adam would turn such differences in
    tiny gradients into differences of the learning rate's size."""
    flags = ["--lr", "0", "--min-lr", "0", *(["--bf16"] if precision == "bf16" else [])]
    eager_losses, eager_norms, _, _ = train(family_name, 5, *flags)
    losses, norms, _, built = train(family_name, 5, *flags, *GRAPH, "--cuda-graph-warmup-steps", "2",
                                    stand_in=False)
    assert built.graph.captures == 1
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if precision == "fp32" else {"rtol": 1e-2, "atol": 1e-4}
    assert len(set(eager_losses)) == 5 and min(eager_norms) > 0  # fresh batches, live gradients
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), **tolerance)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(eager_norms), **tolerance)


@pytest.mark.gpu
def test_on_cuda_a_shorter_iteration_gives_the_memory_back_and_a_new_capture_follows(world_of_one):
    """bf16, weights held still: a shorter iteration (4) releases the graph (its pool) and runs
    eagerly, a new capture follows after the warm-up; every loss and gradient norm as eager."""
    flags = ["--lr", "0", "--min-lr", "0", "--bf16", "--variable-seq-length-prob", "0.01"]
    lengths = {4: 9}
    eager_losses, eager_norms, _, _ = train("mdlm", 7, *flags, lengths=lengths)
    losses, norms, _, built = train("mdlm", 7, *flags, *GRAPH, "--cuda-graph-warmup-steps", "2", stand_in=False,
                                    lengths=lengths)
    assert built.graph.captures == 2  # iterations 3 and 6
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(eager_norms), rtol=1e-2, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.slow
def test_on_cuda_pretrain_with_the_graph_logs_the_eager_runs_losses(pretrain, tmp_path):
    """pretrain_dllm.py on the demo corpus in bf16: the same losses with and without the graph."""
    runs = []
    for name, flags in (("eager", []), ("graph", GRAPH)):
        proc, records = pretrain(1, "--bf16", "--train-iters", "12", "--log-interval", "1", "--eval-interval", "12",
                              "--eval-iters", "1", "--save", str(tmp_path / name), "--tensorboard-dir",
                              str(tmp_path / f"tb-{name}"), *flags)
        runs.append([r["loss"] for r in records if "loss" in r])
    assert "iteration 4: forward and backward captured as a CUDA graph" in proc.stdout + proc.stderr
    assert len(runs[1]) == 12
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=2e-2, atol=1e-3)
