"""Remasking predictors (sampling/remasking.py) for MDLM and Duo: low-confidence (LLaDA),
threshold (Fast-dLLM) and entropy-bound, block by block.

Float64 random dense models on CPU, as the other sampling tests. Checked against definitions
written here: low-confidence with one token per step equals a plain loop that commits the most
confident draw each step; threshold 1 and entropy bound 0 commit one token per step; the
selection rules against brute force; one block equals no block and blocks finish left to right;
a committed token never changes; a batch equals its batch-1 runs; bad settings are one InputError."""
import math

import pytest
import torch
from test_batched_generation import EOS, L, model
from test_sampling import MASK, V, random_model

from megatron_dllm.cli import sample as sample_cli
from megatron_dllm.cli.evaluate import build_parser, run_gsm8k
from megatron_dllm.errors import InputError
from megatron_dllm.sampling import InferenceModel, SamplingConfig, get_sampler
from megatron_dllm.sampling.conditional import generate_native, generate_native_batch
from megatron_dllm.sampling.remasking import above_threshold, entropy_bounded, most_confident

PROMPT = [5, 6, 7, 8]
GEN = L - len(PROMPT)
FAMILIES = ["mdlm", "duo"]
RULES = [("low-confidence", {"steps": 6}), ("low-confidence", {"tokens_per_step": 3}),
         ("threshold", {"confidence_threshold": 0.1}), ("entropy-bound", {"entropy_bound": 2.0})]


@pytest.fixture(scope="module", params=FAMILIES)
def inf(request):
    return model(request.param)


def run(inf, seed=0, **cfg):
    """(canvas [1, L], the input ids of every model call) of one sample after PROMPT."""
    calls = []
    handle = inf.model.backbone.register_forward_pre_hook(lambda m, args: calls.append(args[0][0].clone()))
    sampler = get_sampler(inf, SamplingConfig(eos_id=EOS, **cfg))
    with torch.inference_mode():
        x = sampler.sample(torch.tensor([PROMPT]), torch.Generator().manual_seed(seed))
    handle.remove()
    return x, calls


def reference_one_per_step(inf, seed):
    """Low-confidence with one token per step, from the definition: each step, draw x0 at every
    open position from softmax(logits) (float64, [MASK] excluded; its cumulative sum inverted at one
    uniform per position) and commit the position whose draw is most likely under the model. Duo:
    open positions start as the sampler's uniform noise, the time input is alpha = the clean
    fraction."""
    g = torch.Generator().manual_seed(seed)
    sampler = get_sampler(inf, SamplingConfig(predictor="low-confidence", tokens_per_step=1))
    x = torch.full((1, L), MASK)
    x[0, :len(PROMPT)] = torch.tensor(PROMPT)
    duo = inf.family == "duo"
    if duo:
        x[0, len(PROMPT):] = sampler.uniform_ids(1, GEN, g, "cpu")[0]
    open_ = list(range(len(PROMPT), L))
    with torch.inference_mode():
        while open_:
            kw = {"attention_mask": torch.ones(1, L, dtype=torch.bool)}
            if duo:
                alpha = max((L - len(open_)) / L, sampler.alpha(1.0))
                kw["sigma"] = torch.tensor([-math.log(alpha)])
            logits = inf.model(input_ids=x, **kw).logits[0, open_].to(torch.float64)
            logits[:, MASK] = -math.inf
            p = logits.softmax(-1)
            u = torch.rand(len(open_), generator=g, dtype=torch.float64)
            cdf = p.cumsum(-1)
            x0 = (cdf < ((1 - u) * cdf[:, -1])[:, None]).sum(-1)  # the first id whose sum reaches it
            best = int(p[torch.arange(len(open_)), x0].argmax())
            x[0, open_.pop(best)] = x0[best]
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_low_confidence_one_per_step_equals_the_definition(inf, seed):
    x, calls = run(inf, seed, predictor="low-confidence", tokens_per_step=1)
    assert len(calls) == GEN  # L - P positions: L - P steps
    assert torch.equal(x, reference_one_per_step(inf, seed))
    # --steps L - P schedules one per step as well
    assert torch.equal(run(inf, seed, predictor="low-confidence", steps=GEN)[0], x)


@pytest.mark.parametrize("predictor,knob", [("threshold", {"confidence_threshold": 1.0}),
                                            ("entropy-bound", {"entropy_bound": 0.0})])
def test_nothing_passes_gives_one_token_per_step(inf, predictor, knob):
    x, calls = run(inf, 3, predictor=predictor, **knob)
    assert len(calls) == GEN
    if inf.family == "mdlm":  # every call has exactly one [MASK] fewer than the one before
        masks = [int((c == MASK).sum()) for c in calls] + [int((x == MASK).sum())]
        assert masks == list(range(GEN, -1, -1))
    loose = {"threshold": {"confidence_threshold": 0.0}, "entropy-bound": {"entropy_bound": 100.0}}[predictor]
    assert len(run(inf, 3, predictor=predictor, **loose)[1]) == 1  # everything passes: one step


def test_threshold_one_equals_low_confidence_one_per_step(inf):
    assert torch.equal(run(inf, 4, predictor="threshold", confidence_threshold=1.0)[0],
                       run(inf, 4, predictor="low-confidence", tokens_per_step=1)[0])


def test_selection_rules_against_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        values = torch.rand(9, generator=g, dtype=torch.float64) * 2
        order = sorted(range(9), key=lambda i: -float(values[i]))
        assert most_confident(values, 4).tolist() == order[:4]
        for tau in (0.0, 0.5, 1.5, 2.0):
            assert sorted(above_threshold(values, tau).tolist()) == sorted(
                [i for i in range(9) if values[i] > tau] or order[:1])
        for gamma in (0.0, 0.3, 1.0, 5.0):
            h = sorted(values.tolist())  # the largest k whose k smallest entropies, less their max, fit
            k = max(n for n in range(1, 10) if sum(h[:n]) - max(h[:n]) <= gamma)
            got = entropy_bounded(values, gamma)
            assert len(got) == k and sorted(values[got].tolist()) == h[:k]


@pytest.mark.parametrize("predictor,knobs", RULES)
def test_one_block_equals_no_block(inf, predictor, knobs):
    base = run(inf, 5, predictor=predictor, **knobs)[0]
    for width in (GEN, GEN + 7):
        assert torch.equal(run(inf, 5, predictor=predictor, block_length=width, **knobs)[0], base)


@pytest.mark.parametrize("predictor,knobs", RULES)
def test_blocks_finish_left_to_right_and_commits_never_change(inf, predictor, knobs):
    B = 5  # blocks [4, 9), [9, 14), ..., [29, 32)
    x, calls = run(inf, 6, predictor=predictor, block_length=B, **knobs)
    seen = calls + [x[0]]
    changes = torch.stack([a != b for a, b in zip(seen[:-1], seen[1:])])  # [calls, L]
    assert int(changes.sum(0).max()) <= 1  # every position changes at most once: committed stays
    assert not changes[:, :len(PROMPT)].any()
    if inf.family == "mdlm":
        assert all(bool((a[b != a] == MASK).all()) for a, b in zip(seen[:-1], seen[1:]))
        for c in calls:  # a block opens only when the blocks before it are complete
            open_blocks = {(i - len(PROMPT)) // B for i in (c == MASK).nonzero()[:, 0].tolist()}
            first = min(open_blocks)
            assert all(bool((c[len(PROMPT) + b * B:len(PROMPT) + (b + 1) * B] == MASK).all())
                       for b in open_blocks if b > first)
    if predictor == "low-confidence" and "steps" in knobs:  # 6 steps over 6 blocks: one each
        assert len(calls) == 6


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("predictor,knobs", RULES)
def test_batch_equals_batch_1_runs(inf, predictor, knobs, greedy):
    prompts, seeds = [[5, 6, 7], [9, 3, 4, 12, 8, 11, 2], [20], [14, 15, 16, 17, 18]], [11, 3, 7, 5]
    kw = {"steps": 4, "greedy": greedy, "predictor": predictor, "block_length": 4, **knobs}
    expected = [generate_native(inf, p, 9, EOS, seed=s, **kw) for p, s in zip(prompts, seeds)]
    assert generate_native_batch(inf, prompts, 9, EOS, seeds=seeds, **kw) == expected
    assert len({tuple(r) for r in expected}) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_stop_at_a_settled_eos(family):
    """EOS likely: a row stops once everything up to a committed EOS is committed; the cut output
    equals decoding every block, with fewer model calls."""
    inf = model(family, eos_bias=4.0)
    prompts, seeds = [[5, 6, 7], [9, 3, 4, 12], [20], [14, 15]] * 2, list(range(8))
    kw = {"steps": 8, "predictor": "low-confidence", "block_length": 4}
    got = generate_native_batch(inf, prompts, 16, EOS, seeds=seeds, **kw)
    assert got == [generate_native(inf, p, 16, EOS, seed=s, **kw) for p, s in zip(prompts, seeds)]
    assert sum(r[-1] == EOS for r in got) >= 4 and len({len(r) for r in got}) > 1
    early = run(inf, 1, predictor="threshold", block_length=4, stop_at_eos=True)
    full = run(inf, 1, predictor="threshold", block_length=4)
    row = full[0][0, len(PROMPT):].tolist()
    assert EOS in row
    cut = row.index(EOS) + 1
    assert early[0][0, len(PROMPT):len(PROMPT) + cut].tolist() == row[:cut]
    rest = early[0][0, len(PROMPT) + cut:]
    assert (rest == EOS).all()  # open positions and those committed before the EOS alike
    assert len(early[1]) < len(full[1])


@pytest.mark.parametrize("family", [*FAMILIES, "esolm"])
def test_stop_at_eos_ends_every_sampler_s_rows_at_their_first_eos(family):
    """The ancestral samplers that decode every position together end each row at its first EOS
    once it is complete; for MDLM and Duo that is what one block covering the canvas gives."""
    inf = model(family, eos_bias=4.0)
    ended = 0
    for seed in range(6):
        stopped, _ = run(inf, seed, steps=8, stop_at_eos=True)
        full, _ = run(inf, seed, steps=8)
        row, full_row = stopped[0, len(PROMPT):].tolist(), full[0, len(PROMPT):].tolist()
        if EOS not in full_row:
            assert row == full_row
            continue
        ended += 1
        cut = full_row.index(EOS) + 1
        assert row == full_row[:cut] + [EOS] * (len(row) - cut)
        if family != "esolm":
            one_block, _ = run(inf, seed, steps=8, stop_at_eos=True, block_length=GEN)
            assert one_block[0].tolist() == stopped[0].tolist()
    assert ended >= 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("predictor, knobs", [("low-confidence", {"steps": 4}),
                                              ("threshold", {"confidence_threshold": 0.0}),
                                              ("entropy-bound", {"entropy_bound": 1e9})])
def test_under_stop_at_eos_a_remasking_row_holds_only_eos_after_its_first(family, predictor, knobs):
    """Also when the EOS settles at the last step of the last block (threshold 0 and a huge
    entropy bound commit the whole canvas in that one step)."""
    inf = model(family, eos_bias=2.5)
    ended = 0
    for seed in range(16):
        x, _ = run(inf, seed, predictor=predictor, stop_at_eos=True, **knobs)
        row = x[0, len(PROMPT):].tolist()
        if EOS in row:
            ended += 1
            assert set(row[row.index(EOS):]) == {EOS}, row
    assert ended >= 2


@pytest.mark.parametrize("settings,message", [
    ({"predictor": "threshold", "tokens_per_step": 2}, "--tokens-per-step applies to --predictor low-confidence"),
    ({"predictor": "low-confidence", "confidence_threshold": 0.5},
     "--confidence-threshold applies to --predictor threshold"),
    ({"predictor": "threshold", "entropy_bound": 0.5}, "--entropy-bound applies to --predictor entropy-bound"),
    ({"predictor": "left-to-right", "block_length": 4},
     r"--block-length applies to --predictor ancestral\|low-confidence\|threshold\|entropy-bound only"),
    ({"predictor": "threshold", "confidence_threshold": 1.5}, r"--confidence-threshold 1.5: must be in \[0, 1\]"),
    ({"predictor": "entropy-bound", "entropy_bound": -1.0}, "--entropy-bound -1.0: must be a finite number >= 0"),
    ({"predictor": "low-confidence", "block_length": 0}, "--block-length 0: must be >= 1"),
])
def test_bad_settings_are_one_input_error(settings, message):
    with pytest.raises(InputError, match=message):
        SamplingConfig(**settings).check()


@pytest.mark.parametrize("family,why", [("ar", "no open positions to rank"), ("esolm", "fix the decoding order")])
def test_families_without_remasking_say_why(family, why):
    inf = InferenceModel(random_model(family, length=L), family, MASK, V, L, None, "hf")
    with pytest.raises(InputError, match=f"--predictor threshold is not available for --family {family}: .*{why}"):
        get_sampler(inf, SamplingConfig(predictor="threshold"))


def test_commands_refuse_a_knob_of_another_predictor_in_one_line(capsys):
    assert sample_cli.main(["--load", "nowhere", "--predictor", "threshold", "--tokens-per-step", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --tokens-per-step applies to --predictor low-confidence only, not --predictor threshold"]
    args = build_parser().parse_args(["gsm8k", "--load", "nowhere", "--predictor", "threshold"])
    with pytest.raises(InputError, match="apply to --protocol native only"):
        run_gsm8k(args)
    args = build_parser().parse_args(["gsm8k", "--load", "nowhere", "--steps", "4"])  # left to right: no steps
    with pytest.raises(InputError, match=r"^--steps applies to --protocol native only"):
        run_gsm8k(args)


@pytest.mark.parametrize("family, predictor, knobs, taken", [
    ("mdlm", "ancestral", {}, 8), ("esolm", "block", {}, 8), ("mdlm", "low-confidence", {}, 8),
    ("duo", "low-confidence", {"tokens_per_step": 2}, None), ("mdlm", "threshold", {}, None),
    ("duo", "entropy-bound", {}, None), ("esolm", "left-to-right", {}, None), ("ar", "ancestral", {}, 8)])
def test_records_give_steps_only_where_they_set_the_steps(family, predictor, knobs, taken):
    """A samples file or GSM8K record with `steps: 64` for the threshold sampler would misstate
    its model calls (and a Pareto fit would read it as T); AR's is the point the fit takes of it."""
    from megatron_dllm.sampling.registry import steps_taken

    assert steps_taken(SamplingConfig(steps=8, predictor=predictor, **knobs)) == taken
