"""BD3-LM's block sampler (megatron_dllm/sampling/bd3lm.py) on small random dense models in float64:
the exact block KV cache gives the no-cache recompute's samples at a fraction of the tokens run, a
block's logits are those of the training layout [x_t ; x_0] under the block mask, and the output
ends at --max-new-tokens or after the first EOS."""
import pytest
import torch

from megatron_dllm.errors import InputError
from megatron_dllm.families import get_family
from megatron_dllm.hf.modeling_dllm import KVCache
from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.sampling import InferenceModel, SamplingConfig, get_sampler
from megatron_dllm.sampling.prompt_batch import PromptBatch

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
    """The cached call for a block = the x_t copy's logits of the two-copy training input whose
    clean copy holds the committed prefix (what the model was trained to predict)."""
    inf = model_for("mask", seed=1)
    family = get_family("bd3lm", MASK, V, block_size=BLOCK)
    sampler = get_sampler(inf, SamplingConfig(steps=2))
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(0, MASK, (2, L), generator=gen)
    start, end = 2 * BLOCK, 3 * BLOCK
    x = clean.clone()
    x[:, start + 1:end:2] = MASK  # the block being denoised, partly masked
    cache = KVCache(inf.model.config.num_layers)
    with torch.no_grad():
        sampler.commit(x, 0, start, cache)
        got = sampler.block_logits(x, start, end, cache)
        inp = family.model_input(clean, x, torch.ones(2, L))  # x_t = x, x_0 = clean
        want = inf.model(input_ids=inp.input_ids, position_ids=inp.position_ids,
                         attention_mask=inp.attend()).logits[:, start:end]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


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


def test_batch_rows_equal_batch_of_one():
    inf = model_for("uniform")
    sampler = get_sampler(inf, SamplingConfig(steps=3, seq_length=L))
    prompts, lengths = [[4, 5, 6], PROMPT], [14, L]
    batch = PromptBatch(prompts, lengths, [torch.Generator().manual_seed(s) for s in (1, 2)], torch.device("cpu"))
    with torch.no_grad():
        rows = sampler.sample_batch(batch)
        for prompt, length, seed, row in zip(prompts, lengths, (1, 2), rows):
            alone = sampler.generate(torch.tensor([prompt]), torch.Generator().manual_seed(seed), length)
            assert row == alone[0, len(prompt):].tolist()


def test_other_predictors_are_refused():
    with pytest.raises(InputError, match="--predictor left-to-right is not available for --family bd3lm"):
        get_sampler(model_for("mask"), SamplingConfig(predictor="left-to-right"))
