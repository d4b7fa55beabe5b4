"""Static KV caches (hf/modeling_dllm.py `KVCache(num_layers, max_length)`, sampling/padded_kv_cache.py)
for AR and Eso-LM, in float64: the preallocated cache written in place gives the logits of a full
recompute and of the growing (concatenating) cache, and the same samples as both, batch 1 and
batched; its buffers are allocated once per run."""
import pytest
import torch
from test_sampling import EOS, MASK, PROMPT, V, random_model

from megatron_dllm.hf.modeling_dllm import KVCache
from megatron_dllm.sampling import InferenceModel, SamplingConfig, generate
from megatron_dllm.sampling.base import Sampler
from megatron_dllm.sampling.conditional import _config, _run, generate_left_to_right_batch, generate_native_batch

L = 24
PROMPTS = [[5, 6, 7], [9, 3, 4, 12, 8, 11, 2], [20], [14, 15, 16, 17, 18]]
SEEDS = [11, 3, 7, 5]


@pytest.fixture(scope="module")
def models():
    return {f: InferenceModel(random_model(f).to(torch.float64), f, MASK, V, L, None, "hf") for f in ("ar", "esolm")}


def incremental_logits(model, x, positions, cache, chunks):
    """Logits of x fed chunk by chunk through `cache`; a chunk (size, keep) caches its first `keep`."""
    out, at = [], 0
    for size, keep in chunks:
        sl = slice(at, at + size)
        out.append(model(input_ids=x[:, sl], position_ids=positions[:, sl], kv_cache=cache, kv_keep=keep).logits)
        at += keep
    return out


# a prompt of 5, then slices that cache all but their last token (Eso-LM: the masks decoded now)
CHUNKS = [(5, 5), (1, 1), (3, 2), (4, 4), (2, 1), (6, 6)]


def ids_and_positions(family):
    """[3, L] random ids and their rotary positions: in order (AR), a decoding order (Eso-LM)."""
    torch.manual_seed(0)
    x = torch.randint(0, V - 1, (3, L))
    if family == "esolm":  # rotary at the original positions
        return x, torch.stack([torch.randperm(L) for _ in range(3)])
    return x, torch.arange(L).expand(3, -1)


@pytest.mark.parametrize("family", ["ar", "esolm"])
def test_static_cache_logits_equal_growing_cache_and_recompute(models, family):
    model = models[family].model
    x, positions = ids_and_positions(family)
    chunks = CHUNKS
    static = incremental_logits(model, x, positions, KVCache(model.config.num_layers, L), chunks)
    growing = incremental_logits(model, x, positions, KVCache(model.config.num_layers), chunks)
    full = model(input_ids=x, position_ids=positions).logits  # causal over the fed order
    at = 0
    for (size, keep), s, g in zip(chunks, static, growing):
        assert torch.equal(s, g)
        torch.testing.assert_close(s, full[:, at:at + size], rtol=0, atol=1e-12)
        at += keep


def test_static_cache_is_allocated_once_and_bounded(models):
    model = models["ar"].model
    cache = KVCache(model.config.num_layers, 8)
    x = torch.randint(0, V - 1, (2, 9))
    model(input_ids=x[:, :4], kv_cache=cache)
    buffers = [k.data_ptr() for k in cache.keys]
    for pos in range(4, 8):
        model(input_ids=x[:, pos:pos + 1], kv_cache=cache)
    assert [k.data_ptr() for k in cache.keys] == buffers and len(cache) == 8
    assert cache.keys[0].shape == (2, model.config.num_heads, 8, model.config.hidden_size // model.config.num_heads)
    with pytest.raises(ValueError, match="exceed max_length 8"):
        model(input_ids=x[:, 8:9], kv_cache=cache)


def runs_with_each_cache(monkeypatch, run):
    """run() with the static cache, the growing cache and no cache (SamplingConfig.kv_cache=False)."""
    out = {}
    for name, static, kv in (("static", True, True), ("growing", False, True), ("none", True, False)):
        monkeypatch.setattr(Sampler, "static_kv_cache", static)
        out[name] = run(kv)
    return out


@pytest.mark.parametrize("family,predictor,steps", [("ar", "ancestral", 1), ("esolm", "ancestral", 9),
                                                    ("esolm", "block", 4), ("esolm", "left-to-right", 1)])
def test_samples_equal_with_static_growing_and_no_cache(models, monkeypatch, family, predictor, steps):
    def run(kv):
        cfg = SamplingConfig(steps=steps, predictor=predictor, kv_cache=kv, eos_id=EOS, stop_at_eos=False)
        return generate(models[family], cfg, num_samples=4, batch_size=2, seed=7, prompt_ids=PROMPT)

    out = runs_with_each_cache(monkeypatch, run)
    assert torch.equal(out["static"], out["growing"]) and torch.equal(out["static"], out["none"])


@pytest.mark.parametrize("family", ["ar", "esolm"])
def test_batched_static_cache_equals_growing_cache_and_batch_1_without_cache(models, monkeypatch, family):
    """The padded batched cache, static vs growing (rows of different lengths, rows leaving at EOS),
    and each row against its batch-1 run without any cache."""
    inf = models[family]

    def run(kv):
        return (generate_left_to_right_batch(inf, PROMPTS, 12, EOS, greedy=False, seeds=SEEDS),
                generate_native_batch(inf, PROMPTS, 12, EOS, steps=5, seeds=SEEDS))

    out = {}
    for static in (True, False):
        monkeypatch.setattr(Sampler, "static_kv_cache", static)
        out[static] = run(True)
    assert out[True] == out[False]
    for i, (p, s) in enumerate(zip(PROMPTS, SEEDS)):
        for j, predictor in enumerate(("left-to-right", "ancestral")):
            cfg = _config(inf, p, 12, EOS, False, 1.0, 1.0, predictor=predictor, steps=5, kv_cache=False)
            assert _run(inf, p, cfg, s) == out[True][j][i]
