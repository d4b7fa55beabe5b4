"""BD3-LM's block sampler (megatron_dllm/sampling/bd3lm.py) on small random dense models in float64:
the exact block KV cache gives the no-cache recompute's samples at a fraction of the tokens run, a
block's logits are those of the training layout [x_t ; x_0] under the block mask, the output
ends at --max-new-tokens or after the first EOS, and a batch of prompts of different lengths gives
each prompt its batch-1 output, padding never attended."""
import pytest
import torch

from megatron_dllm.errors import InputError
from megatron_dllm.families import get_family
from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.sampling import InferenceModel, SamplingConfig, generate, get_sampler
from megatron_dllm.sampling.bd3lm import CommittedBlocks
from megatron_dllm.sampling.conditional import generate_left_to_right, generate_native, generate_native_batch

V, MASK, L, BLOCK = 33, 32, 24, 4
PROMPT = [5, 6, 7, 8, 9]  # ends inside the second block: a partial first block to generate


def model_for(noise: str, seed: int = 0) -> InferenceModel:
    options = {"block_size": BLOCK, "noise": noise}
    model = random_dense_model("bd3lm", V, L, scale=0.3, seed=seed, family_options=options)
    return InferenceModel(model.double(), "bd3lm", MASK, V, L, None, "hf", family_options=options)


def tokens_run(inf):
    stats = {"tokens": 0}

    def hook(module, args, kwargs=None):
        stats["tokens"] += args[0].numel()

    return stats, inf.model.backbone.register_forward_pre_hook(hook)


def run(inf, prompt, seed=0, rows=2, **cfg):
    sampler = get_sampler(inf, SamplingConfig(steps=6, **cfg))
    with torch.no_grad():
        return sampler.sample(torch.tensor([prompt] * rows), torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("noise", ["mask", "uniform"])
@pytest.mark.parametrize("prompt", [[3], PROMPT, PROMPT[:4]])
def test_cached_equals_recompute_and_costs_less(noise, prompt):
    inf = model_for(noise)
    out, cost = {}, {}
    for kv in (True, False):
        stats, handle = tokens_run(inf)
        out[kv] = run(inf, prompt, kv_cache=kv)
        handle.remove()
        cost[kv] = stats["tokens"]
    assert torch.equal(out[True], out[False])
    assert torch.equal(out[True][:, :len(prompt)], torch.tensor([prompt] * 2))
    generated = out[True][:, len(prompt):]
    assert not (generated == MASK).any()
    # Duo's greedy tail takes the argmax, which a random model's output bias dominates
    assert len(set(generated.flatten().tolist())) > (3 if noise == "mask" else 1)
    assert cost[True] < cost[False] / 2, cost


def test_block_logits_are_the_training_layout():
    """A block's logits over the committed prefix (cached, and recomputed) = the x_t copy's logits
    of the two-copy training input whose clean copy holds that prefix (what the model was trained
    to predict)."""
    inf = model_for("mask", seed=1)
    family = get_family("bd3lm", MASK, V, block_size=BLOCK)
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(0, MASK, (2, L), generator=gen)
    start, end = 2 * BLOCK, 3 * BLOCK
    x = clean.clone()
    x[:, start + 1:end:2] = MASK  # the block being denoised, partly masked
    inp = family.model_input(clean, x, torch.ones(2, L))  # x_t = x, x_0 = clean
    with torch.no_grad():
        want = inf.model(input_ids=inp.input_ids, position_ids=inp.position_ids,
                         attention_mask=inp.attend()).logits[:, start:end]
        for cached in (True, False):
            blocks = CommittedBlocks(inf.model, BLOCK, x, torch.ones_like(x, dtype=torch.bool), cached)
            blocks.commit([0, 1], start)
            got = blocks.logits([0, 1], {0: (start, end), 1: (start + 1, end)})
            torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(got[1], want[1, 1:], rtol=1e-10, atol=1e-10)
            if cached:  # one row of the two, over a copy of its cache rows
                torch.testing.assert_close(blocks.logits([1], {1: (start, end)})[1], want[1], rtol=1e-10, atol=1e-10)


def test_max_new_tokens_and_stop_at_eos():
    inf = model_for("mask")
    out = run(inf, PROMPT, max_new_tokens=6)
    assert out.shape == (2, len(PROMPT) + 6)
    # EOS = the token the free run generates at position P + 1, in the block [4, 8): with stopping,
    # the same block comes out, EOS fills everything after its first occurrence, and no later
    # block is run
    free = run(inf, PROMPT, rows=1)[0].tolist()
    eos = free[len(PROMPT) + 1]
    first = free.index(eos, len(PROMPT))
    costs = {}
    for stop in (True, False):
        stats, handle = tokens_run(inf)
        got = run(inf, PROMPT, rows=1, stop_at_eos=stop, eos_id=eos)[0].tolist()
        handle.remove()
        costs[stop] = stats["tokens"]
    assert got == free  # stop_at_eos off: the full canvas
    stopped = run(inf, PROMPT, rows=1, stop_at_eos=True, eos_id=eos)[0].tolist()
    assert stopped[:first + 1] == free[:first + 1] and set(stopped[first:]) == {eos}
    assert len(set(free[2 * BLOCK:])) > 1  # the free run goes on (stopping is what ended it)
    assert costs[True] < costs[False] / 3, costs
    with pytest.raises(InputError, match="--max-new-tokens"):
        run(inf, PROMPT, max_new_tokens=L)
    with pytest.raises(InputError, match="--max-new-tokens 6 sets the canvas .*; give it without --seq-length 12"):
        run(inf, PROMPT, max_new_tokens=6, seq_length=12)  # two lengths for one canvas


# prompts of 1, 3, 5 and 10 tokens: first blocks 0, 0, 4 and 8 (the last commits two prompt blocks
# while the others generate); with 9 new tokens each canvas ends at its own place inside a block
PROMPTS, SEEDS, EOS = [[20], [4, 5, 6], PROMPT, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]], [11, 3, 7, 5], 0


@pytest.mark.parametrize("noise,kv_cache,predictor", [("mask", True, "ancestral"), ("uniform", True, "ancestral"),
                                                      ("mask", False, "ancestral"), ("uniform", False, "ancestral"),
                                                      ("mask", True, "left-to-right"),
                                                      ("uniform", True, "left-to-right")])
def test_batch_rows_equal_batch_of_one(noise, kv_cache, predictor):
    """Batched conditional generation: row i = the batch-1 run of prompt i with seed i, token for
    token, with rows stopping at their own EOS (made likely) in different blocks."""
    inf = model_for(noise, seed=2)
    with torch.no_grad():
        inf.model.backbone.output_layer.linear.bias[EOS] += 5.0
    kw = dict(steps=4, kv_cache=kv_cache, predictor=predictor)
    expected = [generate_native(inf, p, 9, EOS, seed=s, **kw) for p, s in zip(PROMPTS, SEEDS)]
    assert generate_native_batch(inf, PROMPTS, 9, EOS, seeds=SEEDS, **kw) == expected
    assert generate_native_batch(inf, PROMPTS[::-1], 9, EOS, seeds=SEEDS[::-1], pad_id=7, **kw) == expected[::-1]
    assert len({len(r) for r in expected}) > 1 and any(r[-1] == EOS for r in expected)


def test_left_to_right_fills_one_position_per_call_from_the_block_logits():
    """Left to right: each call's draw at the next position is a categorical draw from the block's
    logits there (checked against the block logits the cache gives at every step, greedy), one
    model call per generated token plus one commit per finished block."""
    inf = model_for("mask", seed=1)
    prompt, new = PROMPT, 7  # positions 5..11: blocks [4, 8) and [8, 12)
    stats, handle = tokens_run(inf)
    out = generate_left_to_right(inf, prompt, new, eos_id=MASK + 1)  # an EOS never drawn: full length
    handle.remove()
    x = torch.tensor([prompt + [MASK] * new])
    with torch.no_grad():
        for pos in range(len(prompt), len(prompt) + new):
            start = pos // BLOCK * BLOCK
            blocks = CommittedBlocks(inf.model, BLOCK, x, torch.ones_like(x, dtype=torch.bool), True)
            blocks.commit([0], start)
            logits = blocks.logits([0], {0: (pos, min(start + BLOCK, x.shape[1]))})[0][0]
            logits[MASK] = -float("inf")
            x[0, pos] = int(logits.argmax())
    assert out == x[0, len(prompt):].tolist()
    # prefix [0, 4) once, 7 block calls of 4 tokens (3 + 4 positions), the block [4, 8) committed
    assert stats["tokens"] == 4 + 7 * 4 + 4


@pytest.mark.parametrize("cached", [True, False])
def test_padding_is_never_attended(cached):
    """A row whose canvas ends inside the block (10 of 12 positions real) gets its batch-1 logits
    with any padding ids; a mask that let real tokens see the padding would not (checked)."""
    inf = model_for("mask", seed=2)
    x = torch.randint(0, MASK, (2, 12), generator=torch.Generator().manual_seed(4))
    real = torch.ones_like(x, dtype=torch.bool)
    real[0, 10:] = False
    start, span = 2 * BLOCK, {0: (2 * BLOCK, 10), 1: (2 * BLOCK + 1, 12)}
    with torch.no_grad():
        alone = CommittedBlocks(inf.model, BLOCK, x[:1, :10], real[:1, :10], cached)
        alone.commit([0], start)
        want = alone.logits([0], {0: span[0]})[0]
        for pad in (0, 17):
            x[0, 10:] = pad
            blocks = CommittedBlocks(inf.model, BLOCK, x, real, cached)
            blocks.commit([0, 1], start)
            torch.testing.assert_close(blocks.logits([0, 1], span)[0], want, rtol=1e-10, atol=1e-10)
        blocks = CommittedBlocks(inf.model, BLOCK, x, torch.ones_like(real), cached)  # padding taken as real
        blocks.commit([0, 1], start)
        assert (blocks.logits([0, 1], span)[0] - want).abs().max() > 1e-4


def test_other_predictors_are_refused():
    with pytest.raises(InputError, match="--predictor block is not available for --family bd3lm"):
        get_sampler(model_for("mask"), SamplingConfig(predictor="block"))


@pytest.mark.parametrize("noise", ["mask", "uniform"])
def test_model_generate_uses_the_block_sampler(noise):
    """The HF model class's `generate` (what an export runs) builds the family from config.json's
    family_options: its samples are the block sampler's, unconditional and with padded prompts."""
    inf = model_for(noise)
    got = inf.model.generate(num_return_sequences=2, max_new_tokens=8, steps=2, seed=1)
    assert torch.equal(got, generate(inf, SamplingConfig(steps=2, seq_length=8), num_samples=2, seed=1))
    prompts = torch.tensor([[5, 6, 7], [1, 2, 3]])
    padded = inf.model.generate(prompts, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]), max_new_tokens=6,
                                steps=2, eos_token_id=EOS)
    row = padded[1, 3:].tolist()
    assert row[:row.index(EOS) + 1 if EOS in row else None] == generate_native(inf, [2, 3], 6, EOS, steps=2, seed=0)
