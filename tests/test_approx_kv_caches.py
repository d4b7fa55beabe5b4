"""MDLM/Duo block-wise decoding (sampling/blocks.py) and Fast-dLLM's approximate prefix/dual KV
caches (sampling/approx_kv_cache.py), float64 on CPU: over a freshly refreshed cache the partial
forward gives the full forward's logits; refreshed at every step the caches give the exact
sampler's samples; refreshed per block they differ from it (the approximation) and run fewer
tokens; batches equal batch-1 runs with every cache; bad combinations are one clear error."""
import pytest
import torch
from test_batched_generation import EOS, PROMPTS, SEEDS, model

from megatron_dllm.errors import InputError
from megatron_dllm.evaluation.gsm8k import Problem, evaluate_gsm8k
from megatron_dllm.sampling import SamplingConfig, generate, get_sampler
from megatron_dllm.sampling.approx_kv_cache import BlockDenoiser
from megatron_dllm.sampling.blocks import block_spans
from megatron_dllm.sampling.conditional import generate_native, generate_native_batch
from megatron_dllm.sampling.prompt_batch import PromptBatch

NEW, BLOCK, STEPS = 12, 4, 3


@pytest.fixture(scope="module", params=["mdlm", "duo"])
def inf(request):
    return model(request.param)


def native(inf, mode, **kw):
    return generate_native_batch(inf, PROMPTS, NEW, EOS, steps=STEPS, seeds=SEEDS, block_length=BLOCK,
                                 approx_kv_cache=mode, **kw)


def test_block_spans():
    assert block_spans(3, 12, 4) == [(3, 7), (7, 11), (11, 12)]
    assert block_spans(3, 12, None) == [(3, 12)]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_partial_forward_over_a_fresh_cache_equals_the_full_forward(inf, mode):
    batch = PromptBatch(PROMPTS, [len(p) + NEW for p in PROMPTS], [], torch.device("cpu"))
    x, real = batch.canvas(inf.mask_id)
    x[real] = torch.randint(0, inf.mask_id, (int(real.sum()),), generator=torch.Generator().manual_seed(0))
    span = {r: block_spans(len(p), len(p) + NEW, BLOCK)[1] for r, p in enumerate(PROMPTS)}
    rows = list(range(len(PROMPTS)))
    sigma = 0.7 if inf.family == "duo" else None
    exact = BlockDenoiser(inf.model, "none", x, real).logits(rows, span, sigma)
    cached = BlockDenoiser(inf.model, mode, x, real)
    cached.start_block(rows)
    refresh = cached.logits(rows, span, sigma)
    partial = cached.logits(rows, span, sigma)  # only the block (dual) or block + suffix (prefix) run
    for r in rows:
        torch.testing.assert_close(refresh[r], exact[r], rtol=0, atol=1e-12)
        torch.testing.assert_close(partial[r], exact[r], rtol=0, atol=1e-12)
    # some positions of each block (MDLM's unmasking ones): the same logits, without a cache from
    # the output layer run only there
    at = {r: torch.tensor([0, span[r][1] - span[r][0] - 1])[:r + 1] for r in rows}
    for denoiser in (BlockDenoiser(inf.model, "none", x, real), cached):
        picked = denoiser.logits(rows, span, sigma, at=at)
        for r in rows:
            torch.testing.assert_close(picked[r], exact[r][at[r]], rtol=0, atol=1e-12)
    # the approximation: once the block changes, the cached positions have not seen it
    for r in rows:
        x[r, span[r][0]] = (x[r, span[r][0]] + 1) % inf.mask_id
    exact = BlockDenoiser(inf.model, "none", x, real).logits(rows, span, sigma)
    stale = cached.logits(rows, span, sigma)
    assert all((stale[r] - exact[r]).abs().max() > 1e-6 for r in rows)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_refreshed_every_step_the_caches_give_the_exact_samples(inf, mode, monkeypatch):
    exact = native(inf, "none")
    monkeypatch.setattr(BlockDenoiser, "refresh_each_step", True)
    assert native(inf, mode) == exact


def test_per_block_caches_run_fewer_tokens(inf):
    fed, out = {}, {}
    for mode in ("none", "prefix", "dual"):
        fed[mode] = 0

        def count(module, args, mode=mode):
            fed[mode] += args[0].numel()

        handle = inf.model.backbone.register_forward_pre_hook(count)
        out[mode] = native(inf, mode)
        handle.remove()
    assert fed["dual"] < fed["prefix"] < fed["none"]
    assert all(len(out[m]) == len(PROMPTS) for m in out)


@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
def test_block_wise_batch_equals_batch_1_runs_and_rows_stop_at_eos(mode):
    for family in ("mdlm", "duo"):
        inf = model(family, eos_bias=2.5)
        got = native(inf, mode, greedy=False)
        expected = [generate_native(inf, p, NEW, EOS, steps=STEPS, seed=s, block_length=BLOCK, approx_kv_cache=mode)
                    for p, s in zip(PROMPTS, SEEDS)]
        assert got == expected
        assert any(len(r) < NEW and r[-1] == EOS for r in got)  # a row ended at EOS in an early block


def test_one_block_without_a_cache_is_the_exact_sampler(inf):
    """`generate_native` (the tensor sampler) vs the block loop with one block (`sample_batch`)."""
    for p, s, row in zip(PROMPTS, SEEDS, generate_native_batch(inf, PROMPTS, NEW, EOS, steps=STEPS, seeds=SEEDS)):
        assert generate_native(inf, p, NEW, EOS, steps=STEPS, seed=s) == row


@pytest.mark.parametrize("family,cfg,message", [
    ("ar", {"approx_kv_cache": "prefix"}, "--approx-kv-cache prefix: block-wise .* --family ar decodes causally"),
    ("esolm", {"approx_kv_cache": "dual"}, "--approx-kv-cache dual: .* --family esolm .* exact KV cache"),
    ("esolm", {"block_length": 4}, "--block-length: .* MDLM and Duo"),
    ("mdlm", {"approx_kv_cache": "prefix", "predictor": "left-to-right"}, "not --predictor left-to-right"),
    ("duo", {"approx_kv_cache": "suffix"}, "--approx-kv-cache 'suffix' is unknown; valid: none, prefix, dual"),
    ("mdlm", {"block_length": 0}, "--block-length 0: must be >= 1"),
])
def test_bad_combinations_are_one_clear_error(family, cfg, message):
    with pytest.raises(InputError, match=message):
        get_sampler(model(family), SamplingConfig(**cfg))


def test_gsm8k_left_to_right_refuses_block_options():
    inf = model("mdlm")
    inf.tokenizer = type("T", (), {"eod": EOS, "tokenize": lambda self, t: [1, 2]})()
    with pytest.raises(InputError, match="apply to --protocol native only"):
        evaluate_gsm8k(inf, [Problem(0, "q", "1", "#### 1")], "left-to-right", 4, approx_kv_cache="dual")


@pytest.mark.parametrize("mode", ["none", "dual"])
def test_unconditional_block_wise_samples(inf, mode):
    """generate() without a prompt (tools/sample.py): full rows of valid ids, reproducible."""
    cfg = SamplingConfig(steps=3, block_length=8, approx_kv_cache=mode, eos_id=EOS)
    x = generate(inf, cfg, num_samples=3, batch_size=2, seed=1)
    assert x.shape == (3, inf.seq_length) and not bool((x == inf.mask_id).any()) and int(x.max()) < inf.mask_id
    assert torch.equal(generate(inf, cfg, num_samples=3, batch_size=2, seed=1), x)
