"""Fused and compiled elementwise work (`--compile-elementwise`, Megatron-LM's fusion flags)
against the eager reference: a training step's logits and every gradient on CPU in fp32 for every
family (Eso-LM: shuffled order, permuted positions), each fusion alone, under full recompute, the
checkpoint (unchanged), and what the flags resolve to on this platform."""
import argparse
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from attention_cases import FAMILIES, LLAMA, MASK_ID, OPTIONS, PRESET, VOCAB, batch, build, rel_diff, train_step
from megatron.core.transformer import mlp as megatron_mlp

from megatron_dllm import platform
from megatron_dllm.config.model import ModelConfig
from megatron_dllm.config.run import build_parser
from megatron_dllm.config.yaml_config import yaml_tokens
from megatron_dllm.families import get_family
from megatron_dllm.model import elementwise
from megatron_dllm.model import layer as dit_layer
from megatron_dllm.model.fusion import Fusion, resolve_fusion

REL = 1e-6  # relative (Frobenius) difference allowed between fused and eager in fp32
ALL = Fusion(bias_gelu=True, bias_dropout=True, compile_elementwise=True)  # every fusion the CPU can run


@pytest.fixture(scope="module", autouse=True)
def distributed():
    platform.init_distributed(1, 1, seed=0)
    yield
    platform.destroy_distributed()


def compare(name: str, fusion: Fusion, recompute: dict | None = None, reference_fault=None, gpt=None) -> dict:
    """One training step of the eager model and of the fused one, same weights and batch (`gpt`:
    the GPT backbone of that shape)."""
    family = get_family(name, MASK_ID, VOCAB, **OPTIONS.get(name, {}))
    inp = batch(family)
    eager = build(family.attention, "local", recompute=recompute, gpt=gpt)
    fused = build(family.attention, "local", recompute=recompute, fusion=fusion, gpt=gpt)
    if reference_fault:
        reference_fault(eager)
    (logits_a, grads_a), (logits_b, grads_b) = train_step(eager, family, inp), train_step(fused, family, inp)
    assert grads_a.keys() == grads_b.keys()
    return {"logits": rel_diff(logits_b, logits_a),
            "grads": max(rel_diff(grads_b[n], grads_a[n]) for n in grads_a),
            "logits_scale": logits_a.abs().max().item(),
            "min_grad_scale": min(g.abs().max().item() for g in grads_a.values())}


@pytest.mark.slow  # the first test compiles the regions (inductor, g++): seconds to tens of seconds
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_training_step_equals_eager(family, monkeypatch):
    """Compiled LN + modulate and bias + gate + residual, megatron's fused bias-GELU: the same step."""
    calls, chosen = [], set()
    real_gelu, real_regions = megatron_mlp.bias_gelu_impl, dit_layer.regions
    monkeypatch.setattr(megatron_mlp, "bias_gelu_impl", lambda *a: calls.append(1) or real_gelu(*a))
    monkeypatch.setattr(dit_layer, "regions", lambda compiled: chosen.add(compiled) or real_regions(compiled))
    got = compare(family, ALL)
    assert calls, "megatron's fused bias-GELU did not run"
    assert chosen == {False, True}  # eager for the reference, compiled for the fused model
    assert real_regions(True).norm_modulate._torchdynamo_orig_callable is elementwise.norm_modulate
    assert real_regions(True).residual_norm_modulate._torchdynamo_orig_callable is elementwise.residual_norm_modulate
    assert real_regions(True).rotary._torchdynamo_orig_callable is elementwise.rotary
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # dynamo built graphs in this process
    assert got["logits_scale"] > 1 and got["min_grad_scale"] > 1e-3  # every part shapes the result
    assert got["logits"] < REL and got["grads"] < REL, got


@pytest.mark.slow
@pytest.mark.parametrize("alone", ["bias_gelu", "bias_dropout", "compile_elementwise"])
def test_each_fusion_alone_equals_eager(alone):
    got = compare("mdlm", Fusion(**{alone: True}))
    assert got["logits"] < REL and got["grads"] < REL, got


@pytest.mark.slow  # megatron-core's fused SwiGLU compiles (its jit_fuser is torch.compile)
@pytest.mark.parametrize("family", ["ar", "mdlm"])
def test_fused_swiglu_on_the_gpt_backbone_equals_eager(family, monkeypatch):
    calls, real = [], megatron_mlp.bias_swiglu_impl
    monkeypatch.setattr(megatron_mlp, "bias_swiglu_impl", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = compare(family, Fusion(bias_swiglu=True), gpt=LLAMA)
    assert calls, "megatron's fused SwiGLU did not run"
    assert got["logits_scale"] > 1 and got["min_grad_scale"] > 1e-4
    assert got["logits"] < REL and got["grads"] < REL, got


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"recompute_granularity": "selective", "recompute_modules": ["layernorm", "mlp"]},
    {"recompute_granularity": "selective", "recompute_modules": ["layernorm", "mlp_act"]},
], ids=["full", "layernorm+mlp", "layernorm+mlp_act"])
def test_fused_with_recompute_equals_eager(recompute):
    """Recompute re-runs the compiled regions inside autograd's backward (the recomputed norms'
    first run is under no_grad: a graph of its own)."""
    got = compare("esolm", ALL, recompute=recompute)
    assert got["logits"] < REL and got["grads"] < REL, got


@pytest.mark.slow  # compiles a region
def test_a_compiled_region_takes_every_sequence_length():
    """Variable-length micro-batches (`--variable-seq-length-prob`: lengths from U[1, L]) meet many
    lengths. A region meeting a second length compiles once more with the length dynamic; specialised
    to each length (dynamic=False), the ninth stopped the run, as fullgraph=True turns dynamo's
    recompile limit into an error."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the compiles of this process's earlier tests do not count
    counters.clear()
    compiled, eager = elementwise.regions(True), elementwise.regions(False)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, generator=gen)
    for length in range(1, 13):
        x = torch.randn(length, 2, 16, generator=gen, requires_grad=True)
        shift, scale = torch.randn(2, 1, 2, 16, generator=gen)
        torch.testing.assert_close(compiled.norm_modulate(x, weight, shift, scale, 1e-5),
                                   eager.norm_modulate(x, weight, shift, scale, 1e-5))
    assert counters["stats"]["unique_graphs"] <= 3  # length 1 (dynamo specialises it), 2, then dynamic


@pytest.mark.slow
def test_compiled_rotary_stands_in_for_megatrons_and_is_checked(monkeypatch):
    """Compiled, the queries and keys rotate in `elementwise.rotary` (megatron-core's rotary does not
    run); a region that rotated other pairs than megatron's halves (interleaved, as GPT-J) fails."""
    from megatron.core.transformer import attention as megatron_attention

    calls, real_rope = [], megatron_attention.apply_rotary_pos_emb
    monkeypatch.setattr(megatron_attention, "apply_rotary_pos_emb",
                        lambda *a, **k: calls.append(1) or real_rope(*a, **k))
    assert compare("mdlm", Fusion(compile_elementwise=True))["logits"] < REL
    assert len(calls) == 2 * PRESET.num_layers  # the eager model's queries and keys; none of the compiled one's

    def interleaved(query, key, freqs):
        def rotate(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1, x2), -1) * freqs.cos() + torch.cat((-x2, x1), -1) * freqs.sin()
        return rotate(query), rotate(key)

    real_regions = dit_layer.regions
    monkeypatch.setattr(dit_layer, "regions", lambda compiled: real_regions(compiled)._replace(rotary=interleaved))
    got = compare("mdlm", Fusion(compile_elementwise=True))
    assert got["logits"] > 100 * REL and got["grads"] > 100 * REL, got


@pytest.mark.slow
def test_the_comparison_sees_an_erf_gelu():
    """The tolerance can fail: megatron's fused kernel is the tanh GELU; an erf GELU in the
    reference differs by far more than REL."""
    def erf_gelu(model):
        for layer in model.layers:
            layer.mlp.activation_func = F.gelu

    got = compare("mdlm", ALL, reference_fault=erf_gelu)
    assert got["logits"] > 100 * REL and got["grads"] > 100 * REL, got


def test_checkpoints_do_not_change():
    """No parameter added, none renamed: the same (sharded) state dict keys and initial values."""
    eager, fused = build("bidirectional", "local"), build("bidirectional", "local", fusion=ALL)
    assert eager.sharded_state_dict().keys() == fused.sharded_state_dict().keys()
    want, got = eager.state_dict(), fused.state_dict()
    assert want.keys() == got.keys()
    for key, value in want.items():
        if torch.is_tensor(value):
            assert torch.equal(got[key], value), key


def test_platform_defaults():
    defaults = platform.fusion_defaults()
    defaults["gradient_accumulation"] &= platform.fp32_accumulating_gemm()  # where torch can (CUDA)
    assert resolve_fusion("local") == Fusion(**defaults)
    assert resolve_fusion("sdpa") == Fusion(**{**defaults, "masked_softmax": False})  # SDPA fuses it itself
    if not platform.HAS_CUDA:  # compiling costs more than it gains on CPU; no apex kernels
        assert defaults == {"compile_elementwise": False, "bias_gelu": False, "bias_swiglu": False,
                            "bias_dropout": True, "masked_softmax": False, "gradient_accumulation": False}
    assert resolve_fusion("local", bias_gelu=not defaults["bias_gelu"], bias_swiglu=not defaults["bias_swiglu"],
                          bias_dropout=False, compile_elementwise=not defaults["compile_elementwise"], rope=False,
                          gradient_accumulation=False) == Fusion(
        bias_gelu=not defaults["bias_gelu"], bias_swiglu=not defaults["bias_swiglu"],
        compile_elementwise=not defaults["compile_elementwise"], masked_softmax=defaults["masked_softmax"])


def test_each_backbone_keeps_the_fusions_it_has():
    every = Fusion(bias_gelu=True, bias_swiglu=True, bias_dropout=True, compile_elementwise=True)
    assert every.for_backbone(None) == Fusion(bias_gelu=True, bias_dropout=True, compile_elementwise=True)
    assert every.for_backbone(LLAMA) == Fusion(bias_swiglu=True, bias_dropout=True)
    assert every.for_backbone(dataclasses.replace(LLAMA, swiglu=False)) == Fusion(bias_dropout=True)


def test_fusions_that_cannot_apply_are_refused():
    with pytest.raises(ValueError, match="^--rope-fusion: .*per sample"):
        resolve_fusion("local", rope=True)
    if not platform.fusion_defaults()["masked_softmax"]:
        from megatron_dllm.config import parse_flags, validate

        with pytest.raises(ValueError, match="^--masked-softmax-fusion with --attention-backend local needs apex"):
            validate(parse_flags(["--masked-softmax-fusion", "--transformer-impl", "local"]), world_size=1)
    assert not resolve_fusion("sdpa", masked_softmax=True).masked_softmax  # inside SDPA's kernel anyway


def test_flags_take_megatron_and_positive_forms(tmp_path):
    """Megatron-LM's --no- forms and the positive ones; absent = None (the platform's default);
    a --yaml-cfg file and the resolved run_config.yaml spell them as booleans."""
    parser = build_parser()
    ns = parser.parse_args(["--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
                            "--no-rope-fusion", "--compile-elementwise"])
    cfg = ModelConfig.from_args(ns)
    assert (cfg.bias_gelu_fusion, cfg.bias_dropout_fusion, cfg.masked_softmax_fusion, cfg.rope_fusion,
            cfg.compile_elementwise) == (False, False, False, False, True)
    assert cfg.fusion(use_te=False) == Fusion(compile_elementwise=True)
    assert ModelConfig.from_args(parser.parse_args([])).compile_elementwise is None
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  bias-gelu-fusion: false\n  compile-elementwise: true\n")
    assert yaml_tokens(str(path), parser) == ["--no-bias-gelu-fusion", "--compile-elementwise"]
    path.write_text("compile-elementwise: yes please\n")
    with pytest.raises(ValueError, match="compile_elementwise is a switch; expected true or false"):
        yaml_tokens(str(path), parser)
    assert isinstance(next(a for a in parser._actions if a.dest == "rope_fusion"), argparse.BooleanOptionalAction)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["esolm", "duo"])  # the cross entropy's compiled chunks, Duo's head's
def test_pretrain_compiled_run_matches_eager_and_says_so(family, pretrain, tmp_path):
    """Through pretrain_dllm.py: the fused run logs its fusions and repeats the eager run's losses,
    every micro-batch of another length (U[1, 32]: more lengths than dynamo's recompile limit, which
    stopped the compiled run when each length compiled anew); the loss heads compile too."""
    iterations = 16
    run = ["--family", family, "--preset", "cpu-micro", "--seq-length", "32", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", "100",
           "--train-iters", str(iterations), "--variable-seq-length-prob", "1.0"]
    proc, eager = pretrain(1, *run, "--no-bias-gelu-fusion", "--no-compile-elementwise",
                           "--save", str(tmp_path / "eager"))
    assert "fusion: bias-dropout |" in proc.stdout + proc.stderr
    proc, fused = pretrain(1, *run, "--bias-gelu-fusion", "--compile-elementwise", "--save", str(tmp_path / "fused"))
    assert "fusion: bias-gelu, bias-dropout, compiled elementwise |" in proc.stdout + proc.stderr
    losses = [r["loss"] for r in eager if "loss" in r]
    assert len(losses) == iterations and [r["loss"] for r in fused if "loss" in r] == pytest.approx(losses, rel=1e-6)
    proc, _ = pretrain(1, *run, "--rope-fusion", check=False)
    assert proc.returncode != 0 and "--rope-fusion: TransformerEngine's fused RoPE" in proc.stderr
