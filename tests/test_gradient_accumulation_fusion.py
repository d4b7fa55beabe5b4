"""Gradient-accumulation fusion (`--gradient-accumulation-fusion`, model/fusion.py): megatron-core's
linear layers add each micro-batch's weight gradient into the weight's main gradient inside the
weight-gradient GEMM (torch's addmm standing in for Apex's kernel). On CPU in fp32, every family's
accumulated gradients and losses over iterations of two micro-batches equal the unfused step's,
the tied embedding of the GPT backbone keeps both its gradients, the CUDA-graph stand-in replays
it exactly, and two ranks (TP=2 with sequence parallelism; data parallel with the reduction
overlapped; PP=2 with a tied embedding) agree with their unfused run. On a GPU (marked `gpu`):
the bf16 GEMM into an fp32 gradient, and the step in bf16 with and without the graph."""
import pytest
import torch
from conftest import run_worker_on_two_ranks
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel import layers as megatron_layers
from step_cases import GRAPH, train

from megatron_dllm import platform
from megatron_dllm.model.fusion import Fusion, WeightGradientKernels, provide_weight_gradient_kernels, resolve_fusion

FUSED, UNFUSED = "--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"
STILL = ["--lr", "0", "--min-lr", "0"]  # weights held still: each iteration's gradients compare directly
CASES = {"mdlm": [], "duo": [], "esolm": [], "bd3lm": [], "ar": [], "ar-gpt-tied": ["--backbone", "gpt"]}


def main_grads(built) -> dict:
    """The last iteration's accumulated gradients, by parameter name."""
    return {name: p.main_grad.clone() for name, p in built.model[0].module.named_parameters()}


def assert_same_gradients(got: dict, want: dict):
    """Equal up to fp32 rounding: the fused GEMM sums in another order than a GEMM and an add."""
    scale = max(g.abs().max().item() for g in want.values())
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6 * scale, msg=name)


def fused_calls(monkeypatch) -> list:
    calls, real = [], WeightGradientKernels.wgrad_gemm_accum_fp32
    monkeypatch.setattr(WeightGradientKernels, "wgrad_gemm_accum_fp32",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))
    return calls


@pytest.mark.parametrize("case", CASES)
def test_fused_accumulation_gives_the_unfused_gradients(case, monkeypatch, world_of_one):
    """Three iterations of two micro-batches: the same losses and the same accumulated gradients
    (the last iteration's, so the per-iteration reset is covered), and every linear weight's
    gradient of every micro-batch went through the fused GEMM (the GPT backbone's output layer
    into the tied embedding's)."""
    flags = [*CASES[case], *STILL]
    family = case.split("-")[0]
    want_losses, _, _, plain = train(family, 3, *flags, UNFUSED)
    calls = fused_calls(monkeypatch)
    losses, _, _, fused = train(family, 3, *flags, FUSED)
    assert "gradient-accumulation" in fused.layer_impl and "gradient-accumulation" not in plain.layer_impl
    linears = [m for m in fused.model[0].modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(calls) == 3 * 2 * len(linears)
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert_same_gradients(main_grads(fused), main_grads(plain))


def test_the_comparison_sees_a_gradient_that_overwrites_instead_of_adding(monkeypatch, world_of_one):
    """A kernel that writes the micro-batch's gradient over the main gradient (the first
    micro-batch lost) fails the comparison above."""
    want = main_grads(train("mdlm", 1, *STILL, UNFUSED)[3])
    monkeypatch.setattr(WeightGradientKernels, "wgrad_gemm_accum_fp32",
                        staticmethod(lambda x, dy, main_grad: torch.mm(dy.t(), x, out=main_grad)))
    got = main_grads(train("mdlm", 1, *STILL, FUSED)[3])
    with pytest.raises(AssertionError):
        assert_same_gradients(got, want)


@pytest.mark.skipif(platform.HAS_CUDA, reason="bit-exact reruns: CPU only (the GPU-marked test covers CUDA)")
def test_the_graph_stand_in_replays_the_fused_step_exactly(world_of_one):
    """Through the full-iteration graph's bookkeeping (its CPU stand-in), the fused step trains as
    the eager fused step: the accumulation into the main gradients is part of what is captured."""
    eager_losses, _, eager_weights, _ = train("mdlm", 4, FUSED)
    losses, _, weights, built = train("mdlm", 4, FUSED, *GRAPH, "--cuda-graph-warmup-steps", "1")
    assert built.graph.captures == 1
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2-sp", "dp2-overlap", "pp2-gpt-tied"])
def test_two_ranks_accumulate_as_unfused(layout, tmp_path):
    """Two gloo ranks: TP=2 with sequence parallelism (the weight-gradient GEMM of the all-gathered
    input); two data-parallel ranks with the distributed optimizer and the reduction overlapped
    with the backward (megatron's bucket hooks need the dummy gradient the fused path returns); or
    PP=2 of the GPT backbone, whose tied embedding's copy on the last stage takes the output
    layer's fused gradient: each rank's losses and gradients equal its unfused run's."""
    result = run_worker_on_two_ranks("gradient_accumulation_fusion_worker.py", tmp_path, layout, timeout=240)
    assert result == {"losses_equal": True, "gradients_equal": True, "fused_calls": True}


def test_flags_and_defaults(monkeypatch):
    """Off by default on CPU (it would change the last bits of the sums), on where asked; on by
    default with CUDA only where torch can add a bf16 product into fp32, and asked for where it
    cannot, an error naming the flag."""
    if not platform.HAS_CUDA:
        assert platform.fusion_defaults()["gradient_accumulation"] is False
        assert resolve_fusion("sdpa").gradient_accumulation is False
    if platform.fp32_accumulating_gemm():  # always on CPU; on CUDA test_on_cuda_a_bf16_gemm_... says if not
        asked = resolve_fusion("sdpa", gradient_accumulation=True)
        assert asked == Fusion(bias_gelu=platform.HAS_CUDA, bias_swiglu=platform.HAS_CUDA, bias_dropout=True,
                               compile_elementwise=platform.HAS_CUDA, gradient_accumulation=True)
        assert asked.config_fields()["gradient_accumulation_fusion"]
    monkeypatch.setattr(platform, "fusion_defaults",
                        lambda: {"compile_elementwise": True, "bias_gelu": True, "bias_swiglu": True,
                                 "bias_dropout": True, "masked_softmax": False, "gradient_accumulation": True})
    monkeypatch.setattr(platform, "fp32_accumulating_gemm", lambda: False)
    assert resolve_fusion("sdpa").gradient_accumulation is False
    with pytest.raises(ValueError, match=r"^--gradient-accumulation-fusion: torch .* cannot add a bf16 GEMM"):
        resolve_fusion("sdpa", gradient_accumulation=True)


def test_the_probe_says_no_where_addmm_cannot_add_bf16_into_fp32(monkeypatch):
    """The CUDA probe run on a device whose addmm has no bf16-into-fp32 kernel (this CPU build's,
    standing in for an older torch's CUDA addmm) answers False instead of raising."""
    monkeypatch.setattr(platform, "HAS_CUDA", True)
    monkeypatch.setattr(platform, "device", lambda: torch.device("cpu"))
    assert platform.fp32_accumulating_gemm.__wrapped__() is False


def test_apex_kernels_are_kept_where_installed(monkeypatch):
    apex = object()
    monkeypatch.setattr(megatron_layers, "fused_weight_gradient_mlp_cuda", apex, raising=False)
    monkeypatch.setattr(megatron_layers, "_grad_accum_fusion_available", True)
    provide_weight_gradient_kernels()
    assert megatron_layers.fused_weight_gradient_mlp_cuda is apex
    monkeypatch.setattr(megatron_layers, "_grad_accum_fusion_available", False)
    provide_weight_gradient_kernels()
    assert megatron_layers.fused_weight_gradient_mlp_cuda is WeightGradientKernels


@pytest.mark.gpu
def test_on_cuda_a_bf16_gemm_adds_into_an_fp32_gradient():
    """The kernel on CUDA: bf16 factors, an fp32 sum, against the fp32 product of the same bf16
    values (one accumulation, not a bf16 rounding of the product)."""
    assert platform.fp32_accumulating_gemm()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 256, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(4096, 512, device="cuda", generator=gen).bfloat16()
    main_grad = torch.randn(512, 256, device="cuda", generator=gen)
    want = main_grad + dy.float().t() @ x.float()
    WeightGradientKernels.wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad, want, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [[], GRAPH], ids=["eager", "graph"])
def test_on_cuda_the_bf16_step_gives_the_unfused_losses_and_gradients(graph, world_of_one):
    """bf16 with the compiled regions (CUDA's defaults), weights held still: five iterations' losses
    and gradient norms equal the unfused step's within bf16's tolerance, eagerly and replayed."""
    flags = ["--bf16", *STILL, *graph, *(["--cuda-graph-warmup-steps", "2"] if graph else [])]
    want_losses, want_norms, _, _ = train("mdlm", 5, *flags, UNFUSED, stand_in=False)
    losses, norms, _, built = train("mdlm", 5, *flags, FUSED, stand_in=False)
    assert "gradient-accumulation" in built.layer_impl
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-2, atol=1e-4)
