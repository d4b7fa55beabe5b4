"""Scaling-law tooling: FLOPs conventions, --train-flops, the IsoFLOP planner, fits, Pareto, plots."""
import importlib
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from megatron_dllm.errors import InputError
from megatron_dllm.hf.configuration_dllm import DLLMConfig
from megatron_dllm.hf.modeling_dllm import DiT
from megatron_dllm.model.presets import PAPER_PRESETS, Preset, get_preset
from megatron_dllm.scaling import pareto
from megatron_dllm.scaling.fits import analyze_isoflop, fit_step_curve
from megatron_dllm.scaling.flops import (
    forward_flops_per_sequence,
    non_embedding_params,
    train_flops_per_sample,
    train_flops_per_sequence,
)
from megatron_dllm.scaling.plan import PlannedRun, budget_label, plan_isoflop, write_manifest


def _tool(name: str):
    """The command `name` (tools/<name>.py is its shim)."""
    return importlib.import_module(f"megatron_dllm.cli.{name}")

# ------------------------------------------------------------------ FLOPs conventions

# calflops 0.3.2, calculate_flops(dense DiT(h, L, heads, V, causal), kwargs=(ids, positions, sigma),
# include_backPropagation=True) / batch: fwd + bwd FLOPs per sequence, measured on this repo's model
# (recorded: importing calflops pulls in transformers and accelerate, ~10 s, too dear for a test).
RECORDED_CALFLOPS = [  # (hidden, layers, heads, vocab, seq, causal) -> training FLOPs per sequence
    ((64, 2, 4, 4097, 32, False), 70_374_144),
    ((128, 3, 4, 300, 48, True), 183_927_552),
    ((96, 2, 3, 1000, 64, True), 123_642_624),
]
# The paper's own calflops forward FLOPs per sequence (s-sahoo/scaling-dllms configs/flops/*.json;
# vocab 32001, length 2048), rounded by calflops' string output.
PAPER_CALFLOPS = {(384, 8): 108.6e9, (768, 12): 449.41e9, (1280, 18): 1618.7e9, (2048, 25): 5425.4e9}


def _inputs(vocab, seq, batch):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, position_ids=torch.arange(seq).expand(batch, seq), sigma=torch.zeros(batch))


@pytest.mark.parametrize("config,flops", RECORDED_CALFLOPS)
def test_calflops_convention_reproduces_recorded_calflops(config, flops):
    h, layers, heads, vocab, seq, _ = config
    assert train_flops_per_sequence(Preset(h, layers, heads), vocab, seq, "calflops") == flops
    assert forward_flops_per_sequence(Preset(h, layers, heads), vocab, seq) * 3 == flops  # default: calflops


@pytest.mark.parametrize("shape", list(PAPER_CALFLOPS))
def test_calflops_convention_matches_the_papers_figures(shape):
    preset = Preset(shape[0], shape[1], shape[0] // 64)
    ours = forward_flops_per_sequence(preset, 32001, 2048, "calflops")
    assert ours == pytest.approx(PAPER_CALFLOPS[shape], rel=2.5e-3)  # their elementwise ops differ slightly


@pytest.mark.parametrize("causal", [False, True])
def test_full_convention_equals_flop_counter_mode(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    h, layers, heads, vocab, seq, batch = 64, 2, 4, 300, 48, 2
    model = DiT(DLLMConfig(hidden_size=h, num_layers=layers, num_heads=heads, vocab_size=vocab,
                           attention="causal" if causal else "bidirectional"))
    # the math backend runs attention as matmuls FlopCounterMode sees (the CPU fused kernel has no formula)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**_inputs(vocab, seq, batch))
    per_module = counter.get_flop_counts()
    assert per_module["Global"][torch.ops.aten.bmm] == batch * layers * 4 * seq * seq * h  # attention: full square
    assert sum(per_module["DiT.blocks.0.adaLN_modulation"].values()) == batch * 2 * 128 * 6 * h
    full = forward_flops_per_sequence(Preset(h, layers, heads), vocab, seq, "full")
    assert counter.get_total_flops() == batch * full
    assert train_flops_per_sequence(Preset(h, layers, heads), vocab, seq, "full") == 3 * full
    # the two conventions differ by attention and calflops' elementwise terms
    calflops = forward_flops_per_sequence(Preset(h, layers, heads), vocab, seq, "calflops")
    assert full - calflops == layers * (4 * seq * seq * h - 12 * seq * h) - 4 * seq * h - 2 * 128


def test_bd3lm_counts_the_two_copy_input_it_trains_on():
    """BD3-LM's training forward runs [x_t ; x_0] (2L tokens, the family's own model_input) through
    the whole model: FlopCounterMode on it gives the full count at 2L, what --train-flops and the
    planner charge a BD3-LM sample (and 2x / 4x the linears / attention of an L-token family)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_dllm.families import get_family

    h, layers, heads, vocab, seq, batch, block = 64, 2, 4, 300, 24, 2, 4
    preset = Preset(h, layers, heads)
    family = get_family("bd3lm", vocab - 1, vocab, block_size=block)
    model = DiT(DLLMConfig(family="bd3lm", hidden_size=h, num_layers=layers, num_heads=heads, vocab_size=vocab,
                           attention="block_diffusion", family_options={"block_size": block}))
    tokens = torch.randint(0, vocab - 1, (batch, seq), generator=torch.Generator().manual_seed(0))
    inp = family.corrupt(tokens, _noise(batch))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(inp.input_ids, inp.position_ids, inp.sigma, inp.attend())
    assert inp.input_ids.shape == (batch, 2 * seq)
    assert counter.get_total_flops() == batch * forward_flops_per_sequence(preset, vocab, 2 * seq, "full")
    for convention in ("calflops", "full"):
        assert (train_flops_per_sample(preset, vocab, seq, "bd3lm", convention)
                == train_flops_per_sequence(preset, vocab, 2 * seq, convention))
        assert (train_flops_per_sample(preset, vocab, seq, "mdlm", convention)
                == train_flops_per_sequence(preset, vocab, seq, convention))


def _noise(batch):
    from megatron_dllm.families.base import Noise

    return Noise(1, torch.arange(batch), torch.arange(batch), batch)


def test_non_embedding_params_closed_form():
    for name in ("cpu-tiny", "14M"):
        p = get_preset(name)
        with torch.device("meta"):
            model = DiT(DLLMConfig(hidden_size=p.hidden_size, num_layers=p.num_layers,
                                   num_heads=p.num_attention_heads, vocab_size=32001))
        total = sum(t.numel() for t in model.parameters())
        assert non_embedding_params(p, 32001) == total - model.vocab_embed.weight.numel()
    for name, p in PAPER_PRESETS.items():  # the paper's table truncates to millions
        assert non_embedding_params(p, 32001) // 10**6 == int(name[:-1])


def test_model_info_reports_both_conventions(capsys):
    _tool("model_info").main(["--preset", "cpu-tiny", "--vocab-size", "4097", "--seq-length", "32", "--family", "ar",
                              "--json"])
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["train_flops_per_seq_calflops"] == 70_374_144 and info["family"] == "ar"
    assert info["train_flops_per_seq_full"] == 3 * info["fwd_flops_per_seq_full"] > info["train_flops_per_seq_calflops"]
    # BD3-LM's model runs on [x_t ; x_0]: its sequence costs what the trainer counts per sample
    _tool("model_info").main(["--preset", "cpu-tiny", "--vocab-size", "4097", "--seq-length", "32", "--family", "bd3lm",
                              "--json"])
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for convention in ("calflops", "full"):
        assert info[f"train_flops_per_seq_{convention}"] == train_flops_per_sample(
            get_preset("cpu-tiny"), 4097, 32, "bd3lm", convention) > 70_374_144


# ------------------------------------------------------------------ budgets and planning

CPU_TINY_TRAIN_FLOPS = 70_374_144  # vocab 4097, 32 tokens, calflops (the first recorded figure)


def test_planner_iterations_by_hand():
    runs, dropped = plan_isoflop([1e12, 1e8], ["ar", "duo"], ["cpu-tiny"], seq_length=32, global_batch_size=8,
                                 vocab_size=4097)
    # 1e12 / (70,374,144 x 8) = 1776.2 -> 1776 iterations; 1e8 buys less than one
    assert [(r.family, r.iterations, r.tokens, r.flops) for r in runs] == [
        ("ar", 1776, 1776 * 8 * 32, 1776 * 8 * CPU_TINY_TRAIN_FLOPS),
        ("duo", 1776, 1776 * 8 * 32, 1776 * 8 * CPU_TINY_TRAIN_FLOPS)]
    assert runs[0].name == "ar-cpu-tiny-C1e12" and budget_label(3.5e19) == "3.5e19"
    # the label is --train-flops: it reads back exactly (6 digits would plan 4000 iterations, train 3999)
    assert budget_label(1.3787328e18) == "1.3787328e18" and float(budget_label(1 / 3 * 1e19)) == 1 / 3 * 1e19
    assert [(r.name, why) for r, why in dropped] == [("ar-cpu-tiny-C1e8", "fewer than 1 iteration"),
                                                     ("duo-cpu-tiny-C1e8", "fewer than 1 iteration")]
    runs, dropped = plan_isoflop([1e12], ["ar"], ["cpu-tiny", "cpu-small"], seq_length=32, global_batch_size=8,
                                 vocab_size=4097, max_tokens_per_param=0.5)
    # cpu-tiny: 454,656 tokens for 530,561 parameters (0.857 per parameter) is over the bound
    assert [r.preset for r in runs] == ["cpu-small"] and runs[0].tokens_per_param < 0.5
    assert [(r.preset, why) for r, why in dropped] == [("cpu-tiny", "0.857 tokens/param > 0.5")]


def test_planner_plans_bd3lm_per_block_size_at_its_two_copy_flops(tmp_path):
    per_seq = train_flops_per_sequence(get_preset("cpu-tiny"), 4097, 64)  # [x_t ; x_0] of 2 x 32 tokens
    runs, _ = plan_isoflop([1e12], ["ar", "bd3lm"], ["cpu-tiny"], seq_length=32, global_batch_size=8,
                           vocab_size=4097, block_sizes=[4, 16])
    iters = 10**12 // (8 * per_seq)
    assert [(r.name, r.family, r.block_size, r.iterations, r.tokens, r.flops) for r in runs[1:]] == [
        (f"bd3lm-b{b}-cpu-tiny-C1e12", "bd3lm", b, iters, iters * 8 * 32, iters * 8 * per_seq) for b in (4, 16)]
    assert runs[0].block_size is None and runs[0].iterations == 1776 and 1.9 < 1776 / iters < 2  # ~half as many
    for bad, message in (([], "--families bd3lm needs --block-sizes"), ([5], "--block-sizes 5: .* divide")):
        with pytest.raises(ValueError, match=message):
            plan_isoflop([1e12], ["bd3lm"], ["cpu-tiny"], seq_length=32, global_batch_size=8, vocab_size=4097,
                         block_sizes=bad)
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
        _tool("plan_isoflop").main(["--budgets", "1e12", "--families", "bd3lm", "--block-sizes", "4",
                                    "--presets", "cpu-tiny", "--seq-length", "32", "--global-batch-size", "8",
                                    "--vocab-size", "4097", "--format", "commands",
                                    "--manifest", str(tmp_path / "manifest.json"), "--runs-dir", str(tmp_path)])
    assert "--family bd3lm --block-size 4 --preset cpu-tiny" in lines[0] and "--train-flops 1e12" in lines[0]
    # the fits read each block size as its own series
    metrics = tmp_path / "bd3lm-b4-cpu-tiny-C1e12" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text(json.dumps({"iteration": iters, "valid_nelbo": 3.0}) + "\n")
    runs, skipped = _tool("scaling_laws").finished_runs([str(tmp_path / "manifest.json")])
    assert [(r["family"], r["block_size"], r["loss"]) for r in runs] == [("bd3lm-b4", 4, 3.0)] and not skipped


def test_the_documented_plan_runs_with_the_default_families(tmp_path, capsys):
    """The CPU demo's plan (examples/isoflop_demo_cpu.sh) names no families: the paper's four, with
    the manifest written into a directory that does not exist yet."""
    manifest = tmp_path / "runs" / "manifest.json"
    _tool("plan_isoflop").main(["--budgets", "5e11", "1e12", "--presets", "cpu-micro", "cpu-tiny", "--seq-length", "64",
                                "--global-batch-size", "16", "--vocab-size", "4097", "--format", "table",
                                "--manifest", str(manifest)])
    families = {line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert families == {"ar", "mdlm", "duo", "esolm"}
    assert {r["family"] for r in json.loads(manifest.read_text())["runs"]} == families


@pytest.mark.parametrize("flag, value", [("--budgets", "nan"), ("--budgets", "0"), ("--global-batch-size", "-4"),
                                         ("--seq-length", "0")])
def test_plan_refuses_a_value_out_of_range_in_one_line(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        _tool("plan_isoflop").main(["--presets", "cpu-micro", flag, value])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().startswith(f"error: argument {flag}: expected")


@pytest.mark.slow
def test_train_flops_runs_the_budgeted_iterations(pretrain):
    per_iteration = 8 * CPU_TINY_TRAIN_FLOPS
    budget = 3.5 * per_iteration  # pays for 3 whole iterations
    proc, records = pretrain(1, "--preset", "cpu-tiny", "--seq-length", "32", "--global-batch-size", "8",
                             "--micro-batch-size", "8", "--train-flops", repr(budget), "--log-interval", "1",
                             "--eval-interval", "3", "--eval-iters", "1")
    train = [r for r in records if "loss" in r]
    assert [(r["iteration"], r["flops"]) for r in train] == [(i, i * per_iteration) for i in (1, 2, 3)]
    valid = [r for r in records if "valid_nelbo" in r]
    assert [(r["iteration"], r["flops"]) for r in valid] == [(3, 3 * per_iteration)]
    assert "3 iterations of 8 x 32 tokens" in proc.stdout and f"FLOPs {3 * per_iteration:.4g}" in proc.stdout


def test_run_length_flags_exclude_each_other(capsys):
    from megatron_dllm.config import parse_args

    flops_error = "error: --train-flops sets the number of iterations; give it without --train-iters/--train-samples"
    for argv, error in ((["--train-flops", "6e18", "--train-iters", "3"], flops_error),
                        (["--train-flops", "6e18", "--train-samples", "24"], flops_error),
                        (["--train-iters", "3", "--train-samples", "24"],
                         "error: give --train-iters or --train-samples, not both")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and error in capsys.readouterr().err


# ------------------------------------------------------------------ fits

def _synthetic_isoflop(rng, noise=0.003):
    """AR: N*(C) = 0.1 C^0.5, L*(C) = 40 C^-0.05; duo needs 20x AR's compute (same exponent) with
    optimal models half AR's size. Each budget trains 7 sizes around N*."""
    runs = []
    for family, compute_factor, size_factor in (("ar", 1.0, 1.0), ("duo", 20.0, 0.5)):
        for budget in (1e16, 3e16, 1e17, 3e17, 1e18):
            n_opt = size_factor * 0.1 * budget ** 0.5
            loss_opt = 40 * (budget / compute_factor) ** -0.05
            for n in n_opt * np.geomspace(0.2, 5, 7):
                loss = loss_opt * math.exp(0.02 * math.log(n / n_opt) ** 2) * math.exp(rng.normal(0, noise))
                runs.append({"family": family, "budget": budget, "non_embedding_params": int(n), "loss": loss})
    return runs


def test_isoflop_fits_recover_minima_exponents_and_multiplier():
    result = analyze_isoflop(_synthetic_isoflop(np.random.default_rng(0)))
    ar, duo = result["families"]["ar"], result["families"]["duo"]
    for fit in ar["isoflop"]:
        assert fit.n_opt == pytest.approx(0.1 * fit.budget ** 0.5, rel=0.15)
        assert fit.loss_opt == pytest.approx(40 * fit.budget ** -0.05, rel=0.005)
        assert not fit.extrapolated
    assert ar["loss_law"].exponent == pytest.approx(-0.05, abs=0.005)
    assert ar["params_law"].exponent == pytest.approx(0.5, abs=0.05)
    assert duo["loss_law"].exponent == pytest.approx(-0.05, abs=0.005)
    assert duo["compute_multiplier_vs_ar"] == pytest.approx(20, rel=0.3)
    assert duo["size_ratio_vs_ar"] == pytest.approx(0.5, rel=0.15)
    assert ar["compute_multiplier_vs_ar"] == pytest.approx(1.0) and result["reference_compute"] == 1e18


def test_a_compute_multiplier_a_flat_loss_law_cannot_give_is_skipped_not_infinite():
    """L*(C) = A C^-1e-4 reaches AR's loss only at a compute past any float: no multiplier, no
    size ratio (null in results.json), and the reason under "skipped"."""
    runs = _synthetic_isoflop(np.random.default_rng(0), noise=0)
    for r in runs:
        if r["family"] == "duo":  # L* = 30 C^-1e-4 in place of duo's own law
            r["loss"] *= 30 * r["budget"] ** -1e-4 / (40 * (r["budget"] / 20) ** -0.05)
    result = analyze_isoflop(runs)
    duo = result["families"]["duo"]
    assert duo["loss_law"].exponent == pytest.approx(-1e-4, abs=1e-6)
    assert duo["compute_multiplier_vs_ar"] is None and duo["size_ratio_vs_ar"] is None
    assert any(s.startswith("duo: no finite compute multiplier or size ratio against AR") for s in result["skipped"])


def test_isoflop_fit_without_a_minimum_is_skipped():
    runs = [{"family": "ar", "budget": 1e18, "non_embedding_params": n, "loss": math.exp(-0.01 * math.log(n) ** 2)}
            for n in (1e6, 1e7, 1e8)]  # log L concave in log N: a maximum, no minimum
    result = analyze_isoflop(runs)
    assert result["families"]["ar"]["isoflop"] == []
    assert any("no minimum" in s for s in result["skipped"])


def test_extrapolated_minimum_stays_out_of_the_power_laws():
    runs = _synthetic_isoflop(np.random.default_rng(0))
    inside = analyze_isoflop(runs)["families"]["ar"]
    # at 1e16 keep only the sizes 1.7x-5x above N*: the parabola still has a minimum, outside them
    shifted = [r for r in runs if not (r["family"] == "ar" and r["budget"] == 1e16)
               or r["non_embedding_params"] > 1.5 * 0.1 * 1e16 ** 0.5]
    result = analyze_isoflop(shifted)
    ar = result["families"]["ar"]
    assert [f.budget for f in ar["isoflop"] if f.extrapolated] == [1e16]
    assert any(s.startswith("ar: budget 1e+16: N* = ") and s.endswith("(left out of the power laws)")
               for s in result["skipped"])
    # the laws are those of the other four budgets
    four = analyze_isoflop([r for r in runs if not (r["family"] == "ar" and r["budget"] == 1e16)])["families"]["ar"]
    assert ar["loss_law"] == four["loss_law"] and ar["params_law"] == four["params_law"] != inside["params_law"]


def test_step_curve_fit_recovers_parameters():
    rng = np.random.default_rng(1)
    steps = np.array([8, 16, 32, 64, 128, 256, 512, 1024])
    ppl = (30 + 400 * steps ** -0.6) * np.exp(rng.normal(0, 0.005, len(steps)))
    fit = fit_step_curve(steps, ppl)
    assert (fit.alpha, fit.beta, fit.gamma) == pytest.approx((30, 400, -0.6), rel=0.1)
    speed = fit_step_curve(steps, 2e4 / steps)  # throughput ~ 1 / T
    assert speed.gamma == pytest.approx(-1, abs=1e-3) and abs(speed.alpha) < 1e-2


# ------------------------------------------------------------------ Pareto frontier

def _hand_records():
    """m1: Gen PPL 20 + 800/T at 10000/T tokens/s; m2 (smaller, faster): 60 + 800/T at 30000/T;
    AR: one point, Gen PPL 30 at 50 tokens/s. Measured at T = 4 ... 256."""
    gen, speed = [], []
    for model, floor, scale in (("m1", 20, 1e4), ("m2", 60, 3e4)):
        for t in (4, 8, 16, 32, 64, 128, 256):
            gen.append({"family": "mdlm", "model": model, "steps": t, "gen_ppl": floor + 800 / t, "entropy": 5.0})
            speed.append({"family": "mdlm", "model": model, "steps": t, "tokens_per_s": scale / t,
                          "samples_per_s": scale / t / 128, "batch_size": 16})
    gen.append({"family": "ar", "model": "ar", "steps": 128, "gen_ppl": 30.0, "entropy": 5.0})
    speed.append({"family": "ar", "model": "ar", "steps": 128, "tokens_per_s": 50.0, "samples_per_s": 0.4,
                  "batch_size": 16})
    return gen, speed


def test_pareto_frontier_hand_example():
    models, unpaired = pareto.fit_models(*_hand_records())
    frontier = pareto.pareto_frontier(models, [25, 50, 100, 400])
    assert unpaired == []
    got = {(r["target"], r["family"]): (r["model"], r["steps"], r["tokens_per_s"]) for r in frontier}
    # target 25: only m1 (T = 800/5 = 160); AR (30) and m2 (>= 60) cannot reach it
    assert set(got) == {(25, "mdlm"), (50, "ar"), (50, "mdlm"), (100, "ar"), (100, "mdlm"), (400, "ar"), (400, "mdlm")}
    expected = {25: ("m1", 160, 1e4 / 160),
                50: ("m1", 800 / 30, 1e4 * 30 / 800),  # m2 cannot reach 50
                100: ("m2", 20, 3e4 / 20),  # m2 at T=20 beats m1 at T=10
                400: ("m2", 4, 3e4 / 4)}  # reached below T=4: the measured minimum
    for target, (model, steps, tokens_per_s) in expected.items():
        assert got[(target, "mdlm")][0] == model
        assert got[(target, "mdlm")][1:] == pytest.approx((steps, tokens_per_s), rel=1e-4)
    assert got[(50, "ar")] == ("ar", 128, 50.0)
    assert pareto.winners(frontier) == {25: "mdlm", 50: "mdlm", 100: "mdlm", 400: "mdlm"}


def test_pareto_takes_bd3lm_records_per_block_size(tmp_path):
    """evaluate.py's Gen PPL / throughput records of BD3-LM models carry block_size: each block
    size is its own series on the frontier (as in the fits)."""
    for b, speed in ((4, 10.0), (16, 40.0)):
        (tmp_path / f"b{b}").mkdir()
        gen = [{"family": "bd3lm", "block_size": b, "steps": t, "gen_ppl": 50.0 + b + 400 / t} for t in (8, 16, 32)]
        thr = [{"family": "bd3lm", "block_size": b, "steps": t, "tokens_per_s": speed * 8 / t} for t in (8, 16, 32)]
        (tmp_path / f"b{b}" / "gen.json").write_text(json.dumps(gen))
        (tmp_path / f"b{b}" / "thr.json").write_text(json.dumps(thr))
    models, _ = pareto.fit_models(pareto.load_records(sorted(map(str, tmp_path.glob("*/gen.json"))), "gen_ppl", "g"),
                                  pareto.load_records(sorted(map(str, tmp_path.glob("*/thr.json"))), "tokens_per_s",
                                                      "t"))
    assert sorted((m.family, m.model) for m in models) == [("bd3lm-b16", "b16"), ("bd3lm-b4", "b4")]
    frontier = pareto.pareto_frontier(models, [80, 100])
    assert [(r["target"], r["family"]) for r in frontier] == [(t, f"bd3lm-b{b}") for t in (80, 100) for b in (16, 4)]
    assert pareto.winners(frontier) == {80: "bd3lm-b16", 100: "bd3lm-b16"}


# ------------------------------------------------------------------ tools/scaling_laws.py end to end

@pytest.mark.slow
def test_scaling_laws_tool_end_to_end(tmp_path, capsys):
    main = _tool("scaling_laws").main
    runs = _synthetic_isoflop(np.random.default_rng(2))
    planned = [PlannedRun(f"{r['family']}-{i}", r["family"], "x", r["budget"], r["non_embedding_params"], 100, 0, 0)
               for i, r in enumerate(runs)]
    write_manifest(str(tmp_path / "manifest.json"), planned, str(tmp_path / "runs"))
    for i, (plan, run) in enumerate(zip(planned, runs)):
        os.makedirs(tmp_path / "runs" / plan.name)
        with open(tmp_path / "runs" / plan.name / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"iteration": 100, "loss": 9.0, "flops": 1}) + "\n")
            if i != 3:  # run 3 never validated: skipped
                f.write(json.dumps({"iteration": 50, "valid_nelbo": 99.0}) + "\n\n")  # a blank line is no record
                f.write(json.dumps({"iteration": 100, "valid_nelbo": run["loss"], "valid_ppl": 1.0}) + "\n")
    gen, speed = _hand_records()
    (tmp_path / "gen.json").write_text(json.dumps(gen))
    (tmp_path / "speed.jsonl").write_text("\n".join(json.dumps(r) for r in speed))
    out = tmp_path / "fits"
    main(["--manifest", str(tmp_path / "manifest.json"), "--gen-ppl", str(tmp_path / "gen.json"),
          "--throughput", str(tmp_path / "speed.jsonl"), "--targets", "50", "100", "--out-dir", str(out)])
    for name in ("isoflop.png", "loss_vs_flops.png", "params_vs_flops.png", "pareto.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "results.json").read_text())
    assert result == json.loads((out / "results.json").read_text(), parse_constant=pytest.fail)  # strict JSON
    assert result["families"]["duo"]["compute_multiplier_vs_ar"] == pytest.approx(20, rel=0.3)
    assert result["families"]["ar"]["loss_law"]["exponent"] == pytest.approx(-0.05, abs=0.005)
    assert result["pareto_winners"] == {"50.0": "mdlm", "100.0": "mdlm"}
    assert any(s.startswith(f"{planned[3].name}: unfinished") for s in result["skipped"])
    markdown = (out / "results.md").read_text()
    assert "## Power laws" in markdown and "| duo |" in markdown and "## Speed-quality Pareto frontier" in markdown
    assert "## Sampling: Gen PPL and throughput by steps T" in markdown
    # targets no model reaches: no frontier, and the results say why instead of leaving it out silently
    main(["--manifest", str(tmp_path / "manifest.json"), "--gen-ppl", str(tmp_path / "gen.json"),
          "--throughput", str(tmp_path / "speed.jsonl"), "--targets", "1", "--out-dir", str(tmp_path / "none")])
    result = json.loads((tmp_path / "none" / "results.json").read_text())
    assert result["pareto"] == [] and not (tmp_path / "none" / "pareto.png").exists()
    assert any(s.startswith("Pareto frontier: no model reaches a --targets Gen PPL (1 ... 1)")
               for s in result["skipped"])
    # the same --out-dir again without a frontier: the earlier pareto.png is not left beside the new results
    main(["--manifest", str(tmp_path / "manifest.json"), "--gen-ppl", str(tmp_path / "gen.json"),
          "--throughput", str(tmp_path / "speed.jsonl"), "--targets", "1", "--out-dir", str(out)])
    assert not (out / "pareto.png").exists() and (out / "isoflop.png").exists()
    capsys.readouterr()
    # bad inputs: one error line each, naming the file
    (tmp_path / "notjson.jsonl").write_text("{\"steps\": 4, \"gen_ppl\": 9}\nnot json\n")
    (tmp_path / "plan.json").write_text(json.dumps({"runs": [{"name": "x", "iterations": 1}]}))  # --format json
    for argv, message in [
        (["--manifest", str(tmp_path / "missing.json")], f"--manifest {tmp_path / 'missing.json'}: cannot read it"),
        (["--manifest", str(tmp_path / "gen.json")], f"--manifest {tmp_path / 'gen.json'}: not a run manifest"),
        (["--manifest", str(tmp_path / "manifest.json"), "--gen-ppl", str(tmp_path / "notjson.jsonl"),
          "--throughput", str(tmp_path / "speed.jsonl")], f"{tmp_path / 'notjson.jsonl'}:2: neither a JSON file"),
        (["--manifest", str(tmp_path / "manifest.json"), "--gen-ppl", str(tmp_path / "speed.jsonl"),
          "--throughput", str(tmp_path / "gen.json")], f"--gen-ppl {tmp_path / 'speed.jsonl'}: a record without "
                                                       f"'gen_ppl'"),
        (["--manifest", str(tmp_path / "plan.json")], f"--manifest {tmp_path / 'plan.json'}: not a run manifest"),
    ]:
        try:
            code = main([*argv, "--out-dir", str(tmp_path / "bad")])
        except SystemExit as exit_:  # a parser error
            code = exit_.code
        assert code == 2 and capsys.readouterr().err.strip().startswith(f"error: {message}")


def test_a_diverged_run_is_skipped_by_name_and_unpaired_records_are_reported(tmp_path):
    planned = [PlannedRun(f"ar-{i}", "ar", "x", 1e12, 1000 * (i + 1), 10, 0, 0) for i in range(3)]
    write_manifest(str(tmp_path / "manifest.json"), planned, str(tmp_path / "runs"))
    for plan, loss in zip(planned, (float("nan"), 3.0, None)):  # NaN as earlier trainers wrote it, null as now
        os.makedirs(tmp_path / "runs" / plan.name)
        (tmp_path / "runs" / plan.name / "metrics.jsonl").write_text(json.dumps({"iteration": 10, "valid_nelbo": loss}))
    runs, skipped = _tool("scaling_laws").finished_runs([str(tmp_path / "manifest.json")])
    assert [r["name"] for r in runs] == ["ar-1"]
    assert skipped == ["ar-0: diverged (validation NELBO nan at iteration 10)",
                       "ar-2: diverged (validation NELBO non-finite at iteration 10)"]
    gen = [{"family": "mdlm", "model": "a", "steps": 8, "gen_ppl": 50.0, "entropy": 5.0}]
    thr = [{"family": "mdlm", "model": "b", "steps": 8, "tokens_per_s": 9.0}]
    models, unpaired = pareto.fit_models(gen, thr)
    assert models == [] and [line.split(":")[0] for line in unpaired] == ["mdlm a", "mdlm b"]


@pytest.mark.parametrize("change, message", [
    (dict(budgets=[1e12, 1000000000000]), "--budgets: 1e12 is given twice"),
    (dict(families=["ar", "ar"]), "--families: ar is given twice"),
    (dict(presets=["cpu-tiny", "cpu-tiny"]), "--presets: cpu-tiny is given twice"),
    (dict(presets=["smollm2-135m"]), "--presets smollm2-135m: a released model's GPT backbone"),
])
def test_the_planner_refuses_a_grid_entry_twice_and_gpt_presets(change, message):
    grid = {**dict(budgets=[1e12], families=["ar"], presets=["cpu-tiny"]), **change}
    with pytest.raises(ValueError, match=message):
        plan_isoflop(grid["budgets"], grid["families"], grid["presets"], seq_length=32, global_batch_size=8,
                     vocab_size=4097)


def _finished(tmp_path, name: str, planned: list[PlannedRun], records, **settings) -> str:
    """A manifest of `planned` under tmp_path/name whose runs wrote `records` (one per run)."""
    manifest = tmp_path / name / "manifest.json"
    write_manifest(str(manifest), planned, str(tmp_path / name / "runs"), **settings)
    for plan, record in zip(planned, records):
        os.makedirs(tmp_path / name / "runs" / plan.name)
        (tmp_path / name / "runs" / plan.name / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return str(manifest)


def test_the_fits_refuse_runs_that_trained_other_flops_or_settings_than_planned(tmp_path):
    """A run trained with another --vocab-size than planned logs other FLOPs (its point would sit at
    the wrong N); manifests of other settings, or one model twice, would pool unlike points."""
    finished_runs = _tool("scaling_laws").finished_runs
    run = PlannedRun("ar-a", "ar", "cpu-tiny", 1e12, 1000, 10, 640, 10**12 - 5)
    ok = _finished(tmp_path, "ok", [run], [{"iteration": 10, "valid_nelbo": 3.0, "flops": 10**12 - 5}],
                   seq_length=64)
    assert [r["loss"] for r in finished_runs([ok])[0]] == [3.0]
    for name, record, message in [
        ("vocab", {"iteration": 10, "valid_nelbo": 3.0, "flops": 3 * 10**11}, "300000000000 training FLOPs in 10 "
                                                                              "iterations, but --manifest"),
        ("longer", {"iteration": 20, "valid_nelbo": 3.0, "flops": 2 * 10**12}, "in 20 iterations, but"),
        ("zero", {"iteration": 10, "valid_nelbo": 0.0}, "validation NELBO 0.0 at iteration 10; a NELBO is positive"),
        # twice the planned batch: the planned FLOPs in half the iterations, not an unfinished run
        ("batch", {"iteration": 5, "valid_nelbo": 3.0, "flops": 10**12 - 5}, "in 5 iterations, but --manifest"),
        ("text", {"iteration": 10, "valid_nelbo": "3.0"}, r"metrics.jsonl:1: a validation record needs an integer "
                                                         r"'iteration' and a number \(or null\) 'valid_nelbo'"),
    ]:
        with pytest.raises(InputError, match=message):
            finished_runs([_finished(tmp_path, name, [run], [record], seq_length=64)])
    half = _finished(tmp_path, "half", [run], [{"iteration": 5, "valid_nelbo": 3.0, "flops": (10**12 - 5) // 2}],
                     seq_length=64)
    assert finished_runs([half]) == ([], ["ar-a: unfinished (validation at iteration 5, planned 10 iterations)"])
    other = _finished(tmp_path, "s128", [run], [{"iteration": 10, "valid_nelbo": 3.5}], seq_length=128)
    with pytest.raises(InputError, match=re.escape(f"--manifest {other}: seq_length 128, but {ok} has 64")):
        finished_runs([ok, other])
    again = _finished(tmp_path, "again", [run], [{"iteration": 10, "valid_nelbo": 3.5}], seq_length=64)
    with pytest.raises(InputError, match="ar-a is a second ar run of 1000 parameters at budget 1e"):
        finished_runs([ok, again])


def test_pareto_refuses_two_models_in_one_directory_and_reads_no_fit_outside_both_ranges(tmp_path):
    """Two models' records in one directory would merge into one model (the last file read winning);
    and throughput fitted on T = 8 ... 32 extrapolates below zero at T = 200."""
    for preset, ppl in (("a", 50.0), ("b", 70.0)):
        (tmp_path / f"gen_{preset}.json").write_text(json.dumps({"family": "mdlm", "steps": 8, "gen_ppl": ppl}))
    with pytest.raises(InputError, match=r"gen_b.json and .*gen_a.json: two gen_ppl values for mdlm model "):
        pareto.fit_models(pareto.load_records(sorted(map(str, tmp_path.glob("gen_*.json"))), "gen_ppl", "g"), [])
    steps = (8, 16, 32, 64, 128, 256, 512, 1024)
    gen = [{"family": "mdlm", "model": "m", "steps": t, "gen_ppl": 40 + 4000 / t} for t in steps]
    thr = [{"family": "mdlm", "model": "m", "steps": t, "tokens_per_s": s} for t, s in ((8, 100.0), (16, 60.0),
                                                                                       (32, 30.0))]
    models, unpaired = pareto.fit_models(gen, thr)
    assert models[0].throughput_at(200) < 0 and not unpaired  # the fit, read where nothing was measured
    frontier = pareto.pareto_frontier(models, [60, 100, 200, 600])
    # 200: T = 4000/160 = 25; 600: T = 8 (the fewest measured) reaches 540; 60 and 100 need T > 32
    assert {r["target"]: r["steps"] for r in frontier} == pytest.approx({200: 25.0, 600: 8.0})
    assert all(r["tokens_per_s"] > 0 for r in frontier)
    models, unpaired = pareto.fit_models(gen, [{"family": "mdlm", "model": "m", "steps": 4, "tokens_per_s": 9.0}])
    assert models == [] and unpaired == ["mdlm m: Gen PPL measured at T = 8 ... 1024, throughput at 4 ... 4: "
                                         "no common range"]


@pytest.mark.parametrize("command", [["plan_isoflop", "--format", "commands"], ["model_info", "--preset", "14M"]])
def test_a_listing_whose_reader_went_away_ends_quietly(command):
    """`plan_isoflop.py --format commands | head -1`: no traceback, the shell's SIGPIPE exit code,
    whether the output is written during the command (the paper grid) or flushed at its end."""
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-m", f"megatron_dllm.cli.{command[0]}", *command[1:]],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # the reader is gone before the child writes a line
    assert (child.wait(timeout=120), child.stderr.read()) == (141, b"")


def test_pareto_reads_a_gen_ppl_fit_that_rises_with_the_steps():
    """A small model's Gen PPL can rise with T: the fewest steps that reach the target are still
    the first measured ones, not 'unreachable'."""
    gen = [{"family": "mdlm", "model": "m", "steps": t, "gen_ppl": g} for t, g in ((8, 100.0), (16, 120.0),
                                                                                   (32, 140.0), (64, 160.0))]
    thr = [{"family": "mdlm", "model": "m", "steps": t, "tokens_per_s": 6400.0 / t} for t in (8, 16, 32, 64)]
    models, _ = pareto.fit_models(gen, thr)
    assert models[0].gen_ppl(64) > models[0].gen_ppl(8)  # the fit rises too
    (row,) = pareto.pareto_frontier(models, [110])
    assert (row["steps"], row["tokens_per_s"]) == pytest.approx((8.0, 800.0), rel=1e-6)


def test_pareto_refuses_gen_ppl_and_throughput_of_different_samplers(tmp_path):
    def record(kind, predictor, seq_length):
        sampling = {"predictor": predictor, "seq_length": seq_length, "approx_kv_cache": "none"}
        if kind == "gen":  # gen-ppl: its samples' settings
            return {"family": "esolm", "steps": 8, "gen_ppl": 50.0, "sampling": sampling}
        return {"family": "esolm", "steps": 8, "tokens_per_s": 1e4, "seq_length": seq_length,  # throughput
                "settings": {"sampling": {**sampling, "seq_length": None}}}

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "gen.json").write_text(json.dumps(record("gen", "ancestral", 64)))
    (tmp_path / "m" / "thr.json").write_text(json.dumps(record("thr", "block", 32)))
    gen = pareto.load_records([str(tmp_path / "m" / "gen.json")], "gen_ppl", "--gen-ppl")
    thr = pareto.load_records([str(tmp_path / "m" / "thr.json")], "tokens_per_s", "--throughput")
    with pytest.raises(InputError, match=r"thr.json and .*gen.json: esolm model 'm' measured with different samplers "
                                         r"\(predictor block vs ancestral; seq_length 32 vs 64\)"):
        pareto.fit_models(gen, thr)
    (tmp_path / "m" / "thr.json").write_text(json.dumps(record("thr", "ancestral", 64)))
    thr = pareto.load_records([str(tmp_path / "m" / "thr.json")], "tokens_per_s", "--throughput")
    assert len(pareto.fit_models(gen, thr)[0]) == 1
