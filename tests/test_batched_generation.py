"""Batched conditional generation (sampling/conditional.py `*_batch`, sampling/prompt_batch.py,
sampling/padded_kv_cache.py) for every family: a batch of prompts of different lengths, each with
its own seed, gives token for token the outputs of batch-1 runs (float64 model and sampling on
CPU), greedy and sampled, left to right and native; rows stop at their own EOS; the padding id
changes nothing."""
import pytest
import torch
from test_sampling import MASK, V, random_model

from megatron_dllm.errors import InputError
from megatron_dllm.sampling import InferenceModel
from megatron_dllm.sampling.conditional import (
    generate_left_to_right,
    generate_left_to_right_batch,
    generate_native,
    generate_native_batch,
)
from megatron_dllm.sampling.padded_kv_cache import PaddedKVCache

L, EOS = 32, 0
FAMILIES = ["ar", "mdlm", "duo", "esolm"]
PROMPTS = [[5, 6, 7], [9, 3, 4, 12, 8, 11, 2], [20], [14, 15, 16, 17, 18]]  # lengths 3, 7, 1, 5
SEEDS = [11, 3, 7, 5]


def model(family, eos_bias=0.0):
    m = random_model(family, length=L).to(torch.float64)
    with torch.no_grad():
        m.backbone.output_layer.linear.bias[EOS] += eos_bias
    return InferenceModel(m, family, MASK, V, L, None, "hf")


@pytest.fixture(scope="module", params=FAMILIES)
def inf(request):
    return model(request.param)


def batch_1(run, inf, max_new, **kw):
    return [run(inf, p, max_new, EOS, seed=s, **kw) for p, s in zip(PROMPTS, SEEDS)]


@pytest.mark.parametrize("greedy", [True, False])
def test_left_to_right_batch_equals_batch_1_runs(inf, greedy):
    expected = batch_1(generate_left_to_right, inf, 12, greedy=greedy)
    got = generate_left_to_right_batch(inf, PROMPTS, 12, EOS, greedy=greedy, seeds=SEEDS)
    assert got == expected
    assert len({tuple(r) for r in got}) > 1  # the rows differ: a per-row mix-up would show


@pytest.mark.parametrize("greedy", [True, False])
def test_native_batch_equals_batch_1_runs(inf, greedy):
    expected = batch_1(generate_native, inf, 12, steps=5, greedy=greedy)
    got = generate_native_batch(inf, PROMPTS, 12, EOS, steps=5, greedy=greedy, seeds=SEEDS)
    assert got == expected


def test_default_length_fills_each_rows_context(inf):
    """No max_new_tokens: each row's canvas is its own prompt + the rest of the context."""
    expected = batch_1(generate_native, inf, None, steps=3, temperature=0.7)
    assert generate_native_batch(inf, PROMPTS, None, EOS, steps=3, temperature=0.7, seeds=SEEDS) == expected


@pytest.mark.parametrize("pad_id", [1, 25, MASK])
def test_padding_id_changes_nothing(inf, pad_id):
    base = generate_native_batch(inf, PROMPTS, 10, EOS, steps=4, seeds=SEEDS, pad_id=0)
    assert generate_native_batch(inf, PROMPTS, 10, EOS, steps=4, seeds=SEEDS, pad_id=pad_id) == base
    base = generate_left_to_right_batch(inf, PROMPTS, 10, EOS, greedy=False, seeds=SEEDS, pad_id=0)
    assert generate_left_to_right_batch(inf, PROMPTS, 10, EOS, greedy=False, seeds=SEEDS, pad_id=pad_id) == base


def test_padding_that_leaked_would_be_seen(inf, monkeypatch):
    """The pad-id test above can fail: attending to the padding changes the outputs (diffusion
    families: the key-padding mask dropped; causal ones: padded cache entries marked real)."""
    if inf.family in ("ar", "esolm"):
        original = PaddedKVCache.forward
        monkeypatch.setattr(PaddedKVCache, "forward",
                            lambda self, ids, pos, real, keep, **kw: original(
                                self, ids, pos, torch.ones_like(real), keep, **kw))
    else:
        original = inf.model.forward
        monkeypatch.setattr(inf.model, "forward", lambda *a, attention_mask=None, **kw: original(*a, **kw))
    a = generate_native_batch(inf, PROMPTS, 10, EOS, steps=4, seeds=SEEDS, pad_id=1)
    b = generate_native_batch(inf, PROMPTS, 10, EOS, steps=4, seeds=SEEDS, pad_id=25)
    assert a != b


@pytest.mark.parametrize("family", FAMILIES)
def test_each_row_stops_at_its_own_eos(family):
    """EOS made likely: rows end at different lengths; finished rows leave the batch unchanged."""
    inf = model(family, eos_bias=2.0)
    prompts, seeds = PROMPTS * 2, list(range(8))
    expected = [generate_left_to_right(inf, p, 16, EOS, greedy=False, seed=s) for p, s in zip(prompts, seeds)]
    got = generate_left_to_right_batch(inf, prompts, 16, EOS, greedy=False, seeds=seeds)
    assert got == expected
    ended = [r for r in got if r[-1] == EOS]
    assert ended and all(r.count(EOS) == 1 for r in ended)
    assert len({len(r) for r in got}) > 1


def test_bad_input_names_the_argument():
    inf = model("mdlm")
    with pytest.raises(ValueError, match="seeds: 2 seeds for 4 prompts"):
        generate_left_to_right_batch(inf, PROMPTS, 4, EOS, seeds=[1, 2])
    with pytest.raises(ValueError, match="prompt_ids"):
        generate_left_to_right_batch(inf, [[1, 2], [MASK]], 4, EOS)
    assert generate_native_batch(inf, [], 4, EOS) == []


def test_eso_lm_block_refuses_a_batch_row_whose_length_steps_do_not_divide():
    """Each row's canvas is checked, not only the longest: a shorter row's last positions would
    otherwise stay [MASK]. A batch whose rows all fit the block plan equals its batch-1 runs."""
    inf = model("esolm")
    prompts = [[5, 6, 7, 8], [9, 3, 4, 12, 8, 11, 2, 1, 13, 14, 15, 16, 17, 18, 19, 21, 22, 23, 24, 25]]
    # canvases of 16 and 32 tokens, prompts of 4 and 20: --steps 4 divides them all
    got = generate_native_batch(inf, prompts, 12, EOS, steps=4, predictor="block", seeds=SEEDS[:2])
    assert got == [generate_native(inf, p, 12, EOS, steps=4, predictor="block", seed=s)
                   for p, s in zip(prompts, SEEDS)]
    assert all(MASK not in row for row in got)
    with pytest.raises(InputError, match="--predictor block needs --steps to divide the sequence length 20"):
        generate_native_batch(inf, [[5] * 8, [9] * 24], 12, EOS, steps=8, predictor="block", seeds=SEEDS[:2])
